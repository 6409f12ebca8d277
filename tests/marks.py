"""What the tests share to keep the default run short: one case per mechanism by default, the sweep's
others in the slow stage (``-m slow``)."""

from __future__ import annotations

from typing import Any, Iterable

import pytest


def sweep(cases: Iterable[Any], kept: int = 1) -> list[Any]:
    """``cases`` for ``pytest.mark.parametrize``: the first ``kept`` in the default run, the rest marked
    slow (a case may be a ``pytest.param`` already; its marks stay)."""
    out = []
    for i, case in enumerate(cases):
        if i < kept:
            out.append(case)
        elif isinstance(case, type(pytest.param(None))):
            out.append(pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow], id=case.id))
        else:
            out.append(pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow))
    return out
