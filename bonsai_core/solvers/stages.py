"""Checkmate's stage model, shared by the op-level methods (``checkmate``, ``moccasin``).

The schedule runs in n stages over the graph's listed node order; stage t recomputes some earlier
nodes in listed order, then computes node t for the first time. Here: who keeps a node resident,
the compute sequence of a stage schedule, a budget the stage model surely meets, and the messages
for a budget it cannot meet or a graph too large for an op-level model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bonsai_core.errors import SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import schedule_ops, simulate
from bonsai_core.units import format_bytes


def effective_users(graph: Graph) -> list[np.ndarray]:
    """For each node, the nodes that keep it resident: its consumers and, since a resident view
    keeps its base resident, the consumers of its views (transitively). Sorted. O(n * degree)."""
    out: list[set[int]] = [set(graph.users(v).tolist()) for v in range(graph.n)]
    for v in reversed(range(graph.n)):  # a view comes after its base, so its set is complete here
        a = int(graph.alias_of[v])
        if a >= 0:
            out[a] |= out[v]
    return [np.array(sorted(s), dtype=np.int64) for s in out]


def stage_sequence(recomputed: Sequence[Sequence[int]]) -> list[int]:
    """The compute sequence of a stage schedule: stage t recomputes ``recomputed[t]`` (nodes < t)
    in listed order, then computes node t. O(length)."""
    seq: list[int] = []
    for t, nodes in enumerate(recomputed):
        seq.extend(sorted(int(i) for i in nodes))
        seq.append(t)
    return seq


def stage_feasible_budget(graph: Graph) -> int:
    """A budget the stage model surely meets: the least of the plain schedule's peak and that of
    the schedule that keeps nothing between stages (stage t recomputes all of node t's ancestors).
    O(n * (n + edges))."""
    ancestors: list[set[int]] = []
    for v in range(graph.n):
        s: set[int] = set()
        for d in graph.deps(v).tolist():
            s.add(d)
            s |= ancestors[d]
        ancestors.append(s)
    peaks = [simulate(graph, schedule_ops(graph, range(graph.n))).peak]
    if graph.n <= 2000:  # the sequence is O(n^2) long
        peaks.append(simulate(graph, schedule_ops(graph, stage_sequence(ancestors))).peak)
    return min(peaks)


def infeasible_message(graph: Graph, budget: int, method: str, feasible: int | None = None) -> str:
    """What to tell a user whose budget the stage model cannot meet: the proven lower bound of every
    schedule, and a budget this method surely meets (``feasible``, else :func:`stage_feasible_budget`)."""
    feasible = stage_feasible_budget(graph) if feasible is None else feasible
    return (f"Method {method!r} proves that no schedule of its model fits {graph.name!r} in "
            f"{format_bytes(budget)} ({budget} bytes). No schedule at all fits below "
            f"{format_bytes(graph.peak_lower_bound)} ({graph.peak_lower_bound} bytes), and {method!r} surely "
            f"fits in {format_bytes(feasible)} ({feasible} bytes): raise the budget into that range, or try "
            "another method (bonsai, chen) whose schedules are not restricted to this stage model.")


def check_size(graph: Graph, method: str, limit: int, counted: str = "nodes") -> None:
    """Refuse a graph of more than ``limit`` nodes, saying what to do instead."""
    if limit < 1:
        raise SolverError(f"max_nodes={limit}: give a positive number of nodes.")
    if graph.n > limit:
        raise SolverError(
            f"Method {method!r} refuses {graph.name!r}: it has {graph.n} {counted} and the op-level model is "
            f"limited to {limit} nodes (its size grows with the square of the node count, and beyond that "
            "no backend finds a solution in useful time). Use method 'bonsai', whose segment ILP scales, "
            f"or pass max_nodes={graph.n} to try anyway.")
