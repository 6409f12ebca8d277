"""Views contracted away and put back, for the op-level methods (``checkmate``, ``moccasin``).

A view costs nothing and holds no bytes: all it does is keep its base resident while it is. The
op-level models grow with the square of the node count and traced transformers are half views, so
both methods solve the graph without its views (:func:`contract_views`) and put the views back into
the compute sequence they find (:func:`expand_views`), which changes neither its cost nor its memory.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bonsai_core.graph import Graph


def contractible(graph: Graph) -> np.ndarray:
    """bool[n]: the views that read nothing but their base (traced views: ``view``, ``t``, ...).
    A view computed from other tensors too (possible in a graph file) stays a node of its own, a
    view in the contracted graph, so that those tensors are resident whenever it is recomputed."""
    return graph.is_view & (np.diff(graph.dep_ptr) == 1)


def _roots(graph: Graph, contracted: np.ndarray) -> list[int]:
    """Each node's first ancestor up its alias chain that is not contracted (itself if kept)."""
    alias = graph.alias_of.tolist()
    root = list(range(graph.n))
    for v in np.flatnonzero(contracted).tolist():  # a base comes before its views
        root[v] = root[alias[v]]
    return root


def contract_views(graph: Graph) -> tuple[Graph, np.ndarray]:
    """The graph without its (:func:`contractible`) views, and the original id of each node it keeps.

    A view costs nothing and holds no bytes: all it does is keep its base resident while it is. So a
    consumer of a view may as well read the view's root base (the first kept node up its alias chain)
    directly, which keeps the base resident for exactly as long. Traced transformers are half views,
    and the op-level models grow with the square of the node count. O(n + edges)."""
    contracted = contractible(graph)
    if not contracted.any():
        return graph, np.arange(graph.n)
    root = _roots(graph, contracted)
    kept = np.flatnonzero(~contracted)
    new_id = {int(v): i for i, v in enumerate(kept.tolist())}
    alias = graph.alias_of.tolist()
    nodes = [dict(name=graph.names[v], op=graph.ops[v], phase=graph.phases[v], cost=float(graph.cost[v]),
                  mem=int(graph.mem[v]), deps=sorted({new_id[root[d]] for d in graph.deps(v).tolist()}),
                  alias_of=None if alias[v] < 0 else new_id[root[alias[v]]])
             for v in kept.tolist()]
    return Graph.from_nodes(graph.name, graph.fixed_mem, nodes), kept


def expand_views(graph: Graph, sequence: Sequence[int]) -> list[int]:
    """Put the views back into a compute sequence of :func:`contract_views`'s graph (in original
    ids): a view is (re)computed right before a node that reads it, unless its copy still belongs to
    its base's current copy, and a view nobody reads right after its base's first computation. Views
    cost nothing and hold no bytes, so the sequence's cost and memory are unchanged. O(length)."""
    alias = graph.alias_of.tolist()
    contracted = contractible(graph).tolist()
    generation = [0] * graph.n  # how many times each node has been computed
    bound_to = [-1] * graph.n  # for a view: the generation of its base when its copy was computed
    root = _roots(graph, np.asarray(contracted, dtype=bool))
    unread_views: dict[int, list[int]] = {}  # root base -> contracted views that nothing reads
    for v in range(graph.n):
        if contracted[v] and not len(graph.users(v)):
            unread_views.setdefault(root[v], []).append(v)
    out: list[int] = []

    def ensure(v: int) -> None:  # make v's resident copy belong to its base's current copy
        a = alias[v]
        if contracted[a]:
            ensure(a)
        if generation[v] and bound_to[v] == generation[a]:
            return
        out.append(v)
        generation[v] += 1
        bound_to[v] = generation[a]

    def compute(u: int) -> None:
        for d in graph.deps(u).tolist():
            if contracted[d]:
                ensure(d)
        out.append(u)
        generation[u] += 1
        if generation[u] == 1:
            for v in unread_views.get(u, ()):
                ensure(v)

    for u in sequence:
        compute(int(u))
    return out
