"""An exhaustive search of Checkmate's stage model, for checking the op-level solvers on tiny graphs.

Independent of the solvers' code: a dynamic programme over stages whose state is the set of nodes
kept resident from one stage to the next (and, to check Moccasin, how often each node was computed).
Stage t computes a subset of the nodes before t in listed order, then node t; within a stage a node
is freed as soon as nothing later in the stage reads it (directly or through a resident view) and it
is not kept for the next stage. Exponential: for graphs of at most about 8 nodes.
"""

from __future__ import annotations

import itertools
import math

from bonsai_core.graph import Graph


def _keepers(graph: Graph) -> list[set[int]]:
    """Nodes whose computation needs v resident: its consumers, and those of its views."""
    out = [set(graph.users(v).tolist()) for v in range(graph.n)]
    for v in reversed(range(graph.n)):
        if graph.alias_of[v] >= 0:
            out[int(graph.alias_of[v])] |= out[v]
    return out


def _stage_peak(graph: Graph, kept: frozenset[int], computed: list[int], keep_next: frozenset[int],
                keepers: list[set[int]]) -> int:
    mem = graph.mem.tolist()

    def needed(i: int, rest: list[int]) -> bool:
        return i in keep_next or any(j in keepers[i] for j in rest)

    resident = {i for i in kept if needed(i, computed)}
    peak = 0
    for pos, k in enumerate(computed):
        resident.add(k)
        peak = max(peak, graph.fixed_mem + sum(mem[i] for i in resident))
        resident = {i for i in resident if needed(i, computed[pos + 1:])}
    return peak


def stage_optimum(graph: Graph, budget: int, copies: int | None = None) -> float:
    """The least total compute cost of a stage-model schedule peaking at most ``budget`` (with at
    most ``copies`` computations of each node, if given); ``math.inf`` if none fits."""
    n = graph.n
    deps = [set(graph.deps(v).tolist()) for v in range(n)]
    keepers = _keepers(graph)
    alias = graph.alias_of.tolist()
    cost = graph.cost.tolist()
    states: dict[tuple[frozenset[int], tuple[int, ...]], float] = {(frozenset(), (0,) * n): 0.0}
    for t in range(n):
        nxt: dict[tuple[frozenset[int], tuple[int, ...]], float] = {}
        for (kept, counts), so_far in states.items():
            candidates = [i for i in range(t) if i not in kept]
            for r in range(len(candidates) + 1):
                for chosen in itertools.combinations(candidates, r):
                    computed = list(chosen) + [t]
                    if copies is not None and any(counts[i] >= copies for i in chosen):
                        continue
                    have, ok = set(kept), True
                    for k in computed:
                        if not deps[k] <= have:
                            ok = False
                            break
                        have.add(k)
                    if not ok:
                        continue
                    new_counts = list(counts)
                    for k in computed:
                        new_counts[k] += 1
                    cost_here = so_far + sum(cost[k] for k in computed)
                    pool = sorted(i for i in have if keepers[i]) if t < n - 1 else []
                    for m in range(len(pool) + 1):
                        for keep in itertools.combinations(pool, m):
                            keep_next = frozenset(keep)
                            if any(alias[v] >= 0 and alias[v] not in keep_next for v in keep_next):
                                continue  # a kept view keeps its base
                            if _stage_peak(graph, kept, computed, keep_next, keepers) > budget:
                                continue
                            key = (keep_next, tuple(new_counts) if copies is not None else (0,) * n)
                            if cost_here < nxt.get(key, math.inf):
                                nxt[key] = cost_here
        states = nxt
    return min(states.values(), default=math.inf)
