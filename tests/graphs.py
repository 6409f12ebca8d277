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


def mask_far_from_use(fixed_mem: int = 0) -> Graph:
    """A dropout (a multi-output op) whose mask, a node of its own (``getitem``, 40 bytes), is read only
    by the last backward node, while the dropout's output is read until the one before. Freeing the
    mask and taking it again from the resident dropout would lower the peak by its 40 bytes at a
    nanosecond's cost, but its bytes come only from the dropout kernel (DESIGN rule 5): the peak
    without it is 341; 301 needs the dropout recomputed after its last backward reader, with the mask."""
    nodes = [dict(name="x", op="aten.mm", phase="forward", cost=1.0, mem=10, deps=[]),
             dict(name="dropout", op="aten.native_dropout", phase="forward", cost=1.0, mem=100, deps=[0]),
             dict(name="mask", op="getitem", phase="forward", cost=1e-9, mem=40, deps=[1]),
             dict(name="h", op="aten.mm", phase="forward", cost=1.0, mem=100, deps=[1]),
             dict(name="loss", op="aten.sum", phase="forward", cost=1.0, mem=1, deps=[3]),
             dict(name="grad_h", op="aten.mm", phase="backward", cost=1.0, mem=100, deps=[3, 4]),
             dict(name="grad_dropout", op="aten.mm", phase="backward", cost=1.0, mem=100, deps=[1, 5]),
             dict(name="grad_x", op="aten.mul", phase="backward", cost=1.0, mem=10, deps=[2, 6])]
    return Graph.from_nodes("mask-far-from-use", fixed_mem, nodes)
