"""The Compiled switch: the Model page traces the step under torch.compile too, and the Memory page draws
the same plan eager and compiled side by side (explorer/compute.py's compiled_of)."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from bonsai_core.schedule import no_remat_peak
from bonsai_core.units import format_bytes
from explorer import compute
from tests.test_app import app as explorer_app
from tests.test_app import goto

pytest.importorskip("transformers")

TINY_LLAMA = dict(batch=2, seq=64, width=32, layers=1, heads=2, vocab=32)


def memory_lines(at: AppTest) -> list[pd.DataFrame]:
    """The lines (schedule, x, mib) of each memory chart on the page."""
    found = []
    for chart in at.get("vega_lite_chart"):
        data = {d.name: pa.ipc.open_stream(d.data.data).read_pandas() for d in chart.proto.datasets}
        if "lines" in data:
            found.append(data["lines"])
    return found


def compiled_llama() -> AppTest:
    """The explorer with hf:llama at a tiny size traced with the switch on."""
    at = explorer_app(timeout=300)  # a transformers model built, traced, then compiled through inductor (slow under load)
    at.selectbox(key="hf_arch").set_value("llama").run()
    for k, v in TINY_LLAMA.items():
        at.number_input(key=f"hf_llama_{k}").set_value(v)
    at.toggle(key="hf_compiled").set_value(True).run()
    at.button(key="hf_trace").click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    return at


def test_the_switch_draws_the_same_plan_compiled_beside_the_eager_one():
    at = compiled_llama()
    model = at.session_state["model"]
    assert model.zoo == "hf:llama" and model.compiled == "model" and model.options == TINY_LLAMA
    assert any("Compiled (torch.compile(model))" in i.value for i in at.info)  # the Model page's summary
    assert at.session_state["compiled_on"]  # remembered past the Model page
    at.sidebar.slider(key="budget_pct").set_value(90).run()  # one layer: bonsai finds no plan at the default 70%
    goto(at, "memory")
    assert not at.error, [e.value for e in at.error]
    drawn = [set(lines.schedule) for lines in memory_lines(at)]
    s = at.session_state["settings"]
    assert s.method == "bonsai"
    out = compute.solve(model.graph, s.budget, s.method, s.options)
    assert out.plan is not None and out.plan.recomputed  # a plan with checkpoint regions
    planned = compute.compiled_step(model, out.schedule)
    assert planned.regions  # laid onto submodules
    assert {"eager: bonsai", "compiled: bonsai", "eager: no remat", "compiled: no remat"} in drawn
    compiled_lines = next(lines for lines in memory_lines(at) if "compiled: bonsai" in set(lines.schedule))
    assert compiled_lines.x.max() <= 1.0  # over the share of each step: ops eager, kernels compiled
    freed = out.sim.peak - planned.peak
    metric = next(m.value for m in at.metric if m.label == "compiling frees")
    assert metric.startswith(format_bytes(freed) if freed >= 0 else "none")
    caption = next(c.value for c in at.caption if "the same plan compiled" in c.value)
    assert f"{planned.peak:,} B" in caption and f"{out.sim.peak:,} B" in caption
    reference = compute.compiled_step(model, None)
    assert reference.peak < no_remat_peak(model.graph)  # compiling frees something without a plan too


def test_a_parallel_layout_or_an_upload_is_refused_in_words():
    at = explorer_app()
    at.session_state["compiled_on"] = True
    at.run()
    goto(at, "memory")  # the built-in default: traced before the switch, no compiled curve yet
    assert any("trace it again" in i.value for i in at.info)
    refused = compute.compile_refusal(compute.Model(at.session_state["model"].graph, "json", "g.json"))
    assert "came from an upload" in refused
    titan = compute.Model(at.session_state["model"].graph, "zoo", "t", zoo="torchtitan:llama3:debugmodel",
                          options={"tp": 2})
    assert "TP > 1" in compute.compile_refusal(titan)


def test_torchtitan_is_compiled_block_by_block_and_refused_for_a_parallel_layout():
    """The torchtitan tab's switch: blocks mode (each TransformerBlock compiled), on an FSDP rank too; with TP
    (or CP, PP) the tab says why there is no compiled trace, and the trace is eager."""
    from tests.test_app_bound import titan_tab

    at = titan_tab(256)
    at.default_timeout = 300  # each block compiled through inductor: minutes under load
    at.toggle(key="titan_compiled").set_value(True).run()
    at.number_input(key="titan_tp").set_value(2).run()
    assert any("TP > 1" in i.value and "eager only" in i.value for i in at.info)
    at.number_input(key="titan_tp").set_value(1).run()
    at.number_input(key="titan_fsdp").set_value(2).run()
    at.button(key="titan_trace").click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    model = at.session_state["model"]
    assert model.compiled == "blocks" and model.options == {"fsdp": 2, "layers": 1, "seq": 256}
    at.sidebar.slider(key="budget_pct").set_value(95).run()
    goto(at, "memory")
    assert not at.error, [e.value for e in at.error]
    assert any("compiled: bonsai" in set(lines.schedule) for lines in memory_lines(at))
