"""What the tests share to keep the default run short: one case per mechanism by default, the sweep's
others in the slow stage (``-m slow``), and the sweeps CI cannot afford marked ``heavy`` (``-m heavy``)."""

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


def heavy(cases: Iterable[Any], slow: Iterable[Any]) -> list[Any]:
    """``cases`` for ``pytest.mark.parametrize``: those in ``slow`` marked slow (CI's slow stage), the rest
    marked heavy: the full sweep, run by hand with ``-m heavy``."""
    kept = set(slow)
    return [pytest.param(case, marks=pytest.mark.slow if case in kept else pytest.mark.heavy) for case in cases]
