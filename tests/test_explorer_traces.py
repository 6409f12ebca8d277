"""The explorer's traced steps, kept in memory and on disk (explorer.compute.traced_step, explorer.disk)."""

from __future__ import annotations

import pytest


def test_a_traced_step_is_kept_on_disk_and_read_by_a_new_server(monkeypatch):
    import bonsai_core.rank
    from explorer import compute, disk

    options = (("batch", 3),)
    first = compute.traced_step("gpt", options)
    compute.traced_step.clear()  # a new server: nothing in memory
    monkeypatch.setattr(bonsai_core.rank, "trace", lambda *a, **k: pytest.fail("traced again"))
    again = compute.traced_step("gpt", options)
    assert again is not first and again.hash == first.hash and again.to_dict() == first.to_dict()
    assert disk.load_trace("gpt", (("batch", 4),)) is None  # another size is not the one kept
    assert disk.load_trace("mlp", options) is None  # nor another model
    compute.traced_step.clear()
