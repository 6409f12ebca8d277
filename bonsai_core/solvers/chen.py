"""The ``chen`` method: Chen et al.'s √n checkpointing (arXiv:1604.06174) as checkpoint regions.

The forward pass is cut at *articulation points* of its (undirected) graph: a node whose removal
disconnects the forward graph is the only thing later segments read from earlier ones, so keeping
it is enough to rebuild the segment after it. Two ways to choose the cuts:

* ``variant="sqrt"``: about every n/k forward ops for k segments, the classic k = √n;
* ``variant="greedy"``: Chen's memory-balanced greedy: walk the forward pass adding up output
  bytes, and cut at the next articulation point once the running total exceeds ``B`` bytes, so
  segments hold similar activation memory rather than similar op counts.

Every segment but the last is recomputed (the last one's backward runs right after the forward
pass, so dropping it saves nothing). The schedule is :func:`bonsai_core.regions.plan_schedule`'s.

Under a budget, the method tries both variants over a range of segment counts / byte thresholds and
returns the cheapest plan that fits (least recomputation, then lowest peak): a plan's computes are
counted before it is simulated, and one that costs more than a plan found to fit is not simulated. If
none fits it raises BudgetError naming the smallest peak it reached.
"""

from __future__ import annotations

import math
from typing import Iterable, Literal, Sequence

import numpy as np

from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import COMPUTE, Schedule, simulate
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.units import format_bytes

Variant = Literal["sqrt", "greedy", "auto"]
MAX_CANDIDATES = 48  # plans tried per variant under a budget: each costs one simulation, O(n + edges)


def forward_articulation_points(graph: Graph) -> list[int]:
    """Articulation points of the undirected forward graph (views merged into nothing special), in
    listed order. O(n + edges) (networkx's Hopcroft-Tarjan)."""
    import networkx as nx

    fwd = np.flatnonzero(graph.is_forward)
    g = nx.Graph()
    g.add_nodes_from(fwd.tolist())
    for v in fwd.tolist():
        g.add_edges_from((int(d), v) for d in graph.deps(v) if graph.is_forward[d])
    # a view cannot be a cut on its own: the exporter checkpoints real tensors, and a dropped base of
    # a kept view is kept anyway (regions.dropped_nodes), so prefer the base
    return sorted(v for v in nx.articulation_points(g) if not graph.is_view[v])


def plan_from_cuts(graph: Graph, cuts: Iterable[int]) -> CheckpointPlan:
    """Segments of listed-order forward nodes ending at each cut (inclusive); all but the last
    recomputed."""
    fwd = np.flatnonzero(graph.is_forward).tolist()
    cut_set = set(int(c) for c in cuts)
    segments: list[list[int]] = [[]]
    for v in fwd:
        segments[-1].append(v)
        if v in cut_set:
            segments.append([])
    segments = [s for s in segments if s]
    return CheckpointPlan.of(segments, range(len(segments) - 1))


def sqrt_cuts(graph: Graph, segments: int | None = None, points: Sequence[int] | None = None) -> list[int]:
    """Cuts for about ``segments`` segments of equal op count (default √n of the forward ops): the
    first articulation point at or after each multiple of n/segments."""
    pts = forward_articulation_points(graph) if points is None else list(points)
    fwd = np.flatnonzero(graph.is_forward)
    nf = len(fwd)
    k = max(1, round(math.sqrt(nf))) if segments is None else max(1, int(segments))
    rank = {int(v): i for i, v in enumerate(fwd)}
    ranks = np.array([rank[p] for p in pts], dtype=np.int64)
    cuts: list[int] = []
    for i in range(1, k):
        j = int(np.searchsorted(ranks, i * nf / k))
        if j < len(pts) and (not cuts or pts[j] != cuts[-1]):
            cuts.append(pts[j])
    return cuts


def greedy_cuts(graph: Graph, segment_bytes: int, points: Sequence[int] | None = None) -> list[int]:
    """Chen's memory-balanced greedy: cut at the first articulation point after the running sum of
    forward output bytes passes ``segment_bytes``, then start over. O(n)."""
    candidates = set(forward_articulation_points(graph) if points is None else points)
    cuts, running = [], 0
    for v in np.flatnonzero(graph.is_forward).tolist():
        running += int(graph.mem[v])
        if running > segment_bytes and v in candidates:
            cuts.append(v)
            running = 0
    return cuts


def candidate_plans(graph: Graph, variant: Variant) -> list[tuple[str, CheckpointPlan]]:
    """The plans tried under a budget: segment counts 1..(points + 1) for ``sqrt`` and a geometric
    range of byte thresholds for ``greedy``, at most MAX_CANDIDATES each, duplicates removed."""
    pts = forward_articulation_points(graph)
    out: dict[tuple, tuple[str, CheckpointPlan]] = {}
    if variant in ("sqrt", "auto"):
        counts = np.unique(np.geomspace(1, len(pts) + 1, MAX_CANDIDATES).round().astype(int))
        for k in counts.tolist():
            cuts = tuple(sqrt_cuts(graph, k, pts))
            out.setdefault(cuts, (f"sqrt k={k}", plan_from_cuts(graph, cuts)))
    if variant in ("greedy", "auto"):
        total = max(1, graph.activation_bytes)
        smallest = max(1, int(graph.mem[graph.is_forward].max()))
        for b in np.unique(np.geomspace(smallest, total, MAX_CANDIDATES).astype(np.int64)).tolist():
            cuts = tuple(greedy_cuts(graph, b, pts))
            out.setdefault(cuts, (f"greedy B={b}", plan_from_cuts(graph, cuts)))
    return list(out.values())


def _computed_seconds(graph: Graph, schedule: Schedule) -> float:
    """Rule 6's seconds of ``schedule``'s computes, as the simulator sums them, without the stalls of host copies:
    a lower bound of its ``compute_cost``, equal where it copies nothing (a Chen plan). O(len(ops))."""
    computed = [v for kind, v in schedule.ops if kind == COMPUTE]
    return math.fsum(np.repeat(graph.cost, np.bincount(computed, minlength=graph.n)).tolist())


def solve_chen(graph: Graph, budget: int | None, *, time_limit: float | None = None,
               variant: Variant = "auto", segments: int | None = None) -> Schedule:
    """√n or memory-balanced checkpointing; see the module docstring.

    time_limit: seconds for the whole call: past it, the best plan that fits so far (status
    "time_limit"), or a SolverError if none does yet.
    variant: "sqrt", "greedy" or "auto" (both) under a budget.
    segments: with it, the sqrt variant uses exactly that many segments whatever the budget.

    O(candidates * (n + edges))."""
    deadline = Deadline(time_limit)
    if variant not in ("sqrt", "greedy", "auto"):
        raise SolverError(f"Unknown chen variant {variant!r}; use 'sqrt', 'greedy' or 'auto'.")
    if not graph.is_forward.any():
        raise SolverError(f"{graph.name!r} has no forward nodes: there is nothing to checkpoint.")
    if segments is not None and segments < 1:
        raise SolverError(f"segments={segments}: give a positive number of segments (or leave it out).")
    if segments is not None or budget is None:
        label = f"sqrt k={segments or 'sqrt(n)'}"
        plans = [(label, plan_from_cuts(graph, sqrt_cuts(graph, segments)))]
    else:
        plans = candidate_plans(graph, variant)
    best: tuple[tuple[float, int], str, Schedule] | None = None
    lowest = None
    timed_out, tried = False, 0
    for label, plan in plans:
        if deadline.passed():
            timed_out = True
            break
        schedule = plan_schedule(graph, plan, "chen")
        if best is not None and _computed_seconds(graph, schedule) > best[0][0]:
            continue  # its computes alone cost more than a plan that fits: not simulated
        tried += 1
        sim = simulate(graph, schedule)
        lowest = sim.peak if lowest is None else min(lowest, sim.peak)
        key = (sim.compute_cost, sim.peak)
        if sim.feasible(budget) and (best is None or key < best[0]):
            best = (key, label, schedule)
    if best is None and timed_out:
        raise SolverError(f"Chen checkpointing of {graph.name!r} found no plan within {format_bytes(budget)} in its "
                          f"time limit of {time_limit} s: raise the time limit or the budget.", timed_out=True)
    if best is None:
        raise BudgetError(f"Chen checkpointing cannot fit {graph.name!r} in {format_bytes(budget)}: the lowest peak "
                          f"of its {len(plans)} plans is {format_bytes(lowest)} ({lowest} bytes). Raise the budget "
                          "to at least that, or use an optimal method (bonsai, checkmate).", smallest=lowest)
    _, label, schedule = best
    schedule.stats = {"status": "time_limit" if timed_out else "heuristic", "plan": label, "plans_tried": tried,
                      "segments": len(schedule.extra["segments"])}
    return schedule
