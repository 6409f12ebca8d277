"""Small hand-made graphs for tests."""

from __future__ import annotations

from bonsai_core.graph import Graph


def chain(n: int, mem: int = 10, cost: float = 1.0, fixed_mem: int = 0) -> Graph:
    """A forward chain of n ops and its mirrored backward chain (2n nodes): the textbook remat case.

    Forward f_i reads f_{i-1}; backward b_i reads b_{i+1} and f_i (as a real backward pass does)."""
    nodes = [dict(name=f"f{i}", op="f", phase="forward", cost=cost, mem=mem, deps=[i - 1] if i else [])
             for i in range(n)]
    for i in reversed(range(n)):
        deps = [i] + ([len(nodes) - 1] if i < n - 1 else [])
        nodes.append(dict(name=f"b{i}", op="b", phase="backward", cost=cost, mem=mem, deps=sorted(deps)))
    return Graph.from_nodes(f"chain{n}", fixed_mem, nodes)
