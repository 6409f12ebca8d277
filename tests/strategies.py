"""Hypothesis strategies: random but valid training-step-like graphs."""

from __future__ import annotations

from hypothesis import strategies as st

from bonsai_core.graph import Graph


@st.composite
def graphs(draw, min_nodes: int = 2, max_nodes: int = 14) -> Graph:
    """A random DAG in topological order: a forward part, then a backward part; some views."""
    n = draw(st.integers(min_nodes, max_nodes))
    n_forward = draw(st.integers(1, n - 1)) if n > 1 else 1
    nodes = []
    for v in range(n):
        deps = sorted(draw(st.sets(st.integers(0, v - 1), max_size=3))) if v else []
        view_of = draw(st.sampled_from(deps)) if deps and draw(st.integers(0, 4)) == 0 else None
        nodes.append(dict(
            name=f"n{v}", op="aten.view.default" if view_of is not None else "aten.op",
            phase="forward" if v < n_forward else "backward",
            cost=0.0 if view_of is not None else draw(st.floats(1e-6, 1e-2)),
            mem=0 if view_of is not None else draw(st.integers(1, 1000)),
            deps=deps, alias_of=view_of))
    return Graph.from_nodes("random", draw(st.integers(0, 500)), nodes)
