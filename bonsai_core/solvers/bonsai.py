"""The ``bonsai`` method: Bonsai's segment ILP (OOPSLA 2026) in CVXPY.

The forward pass is cut into candidate segments (:mod:`bonsai_core.segment`); the ILP picks a
cover of the forward pass out of them and decides which picked segments to recompute. Its schedule
space is exactly :class:`bonsai_core.regions.CheckpointPlan`: a recomputed segment keeps its
boundary, drops the rest after the forward pass and is rebuilt once right before the first
backward node that reads a dropped node.

**Variables** (per ILP candidate ``s``): ``select[s]``, ``recompute[s]`` and their product
``y[s] = select[s] * recompute[s]`` (linearised: ``y <= select``, ``y <= recompute``,
``y >= select + recompute - 1``); plus one continuous ``delta[k]`` per interval of the memory axis
on which the recomputed segments change the memory (below).

**Cover.** Candidates are runs of consecutive atoms, so "every forward op in exactly one selected
segment" is a path from the first cut to the last: at every atom boundary, the selected segments
ending there equal those starting there (a flow: 2 non-zeros per candidate instead of one per op).

**Memory.** The memory axis has one point per forward step and two per backward node ``b``: "the
rebuilds right before b" and "b computed". ``P[k]`` is the memory of the plan with nothing
recomputed at point k (measured with the simulator). Every node's lifetime in a plan depends only
on its own segment (dropped or kept) and on the rebuilds that read it, so the memory of any plan is
``P[k] + sum_s y[s] * D[s, k]`` up to the conservative bounds below, where ``D[s]`` is a step
function with a handful of steps:

* from the first point where a rebuild input of s (a kept node it reads) would be freed in the plain
  schedule: ``+ext[s]``, the bytes of those inputs, which must now stay alive until the rebuild;
* at up to ``_SAVE_STEPS`` points inside and right after the segment, as the forward copies of
  dropped nodes are freed: minus the savings so far (a staircase under the savings curve; in total
  ``saved[s]``, the dropped nodes the plain schedule would keep for the backward pass);
* at "rebuilds before r[s]" (r[s]: the first backward reader of a dropped node): ``peak[s]`` replaces
  ``ext[s]``: the most bytes of rebuilt copies and kept inputs alive at once during the rebuild;
* from "r[s] computed" on: 0 again (rebuilt copies live exactly as long as plain ones).

So ``delta = cumsum(G @ y)`` over the event points (``G``: the step heights, at most
``_SAVE_STEPS + 3`` non-zeros per candidate), and ``delta[k] + max(P over interval k) <= budget``:
one constraint per interval, which covers every point where a peak can occur. Conservative where it
is not exact: savings inside the segment are a staircase, inputs are counted alive from the earliest
of their plain frees, rebuild peaks of segments rebuilt before the same node are added, and two
rebuilds reading the same input both count it. The simulator judges the result; should the simulated
peak ever exceed the budget, the budget given to the model is tightened by the excess and the ILP
re-solved (``stats["tightened_by"]``).

A candidate is worth recomputing only if what it saves exceeds the inputs it must keep
(``saved > ext``, the paper's rule); multi-atom candidates that are not worth it are dropped from
the ILP (a kept segment changes nothing, so single atoms cover for them).

**Objective**: the recomputation time, ``sum cost[s] * y[s]`` with ``cost[s]`` the cost of the nodes
actually rebuilt, divided by the graph's total cost: the objective is the predicted overhead.

**Re-solve**: the built problem is cached per (graph hash, granularity) with the budget a
``cp.Parameter``, so a budget change skips canonicalisation.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from bonsai_core.budget import format_bytes
from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import Schedule, simulate
from bonsai_core.segment import Segmentation, segment
from bonsai_core.solvers.milp import DEFAULT_BACKEND, solve_milp

# The model counts memory in units of a thousandth of the plain peak: raw byte counts near 1e10 (or near
# 1e1 on toy graphs) would strain the solvers' tolerances, and 1e-7 of a unit is under a byte up to 10 GB.
_UNITS_PER_PEAK = 1000.0
_CACHE_SIZE = 8
_MAX_TIGHTEN = 4
_SAVE_STEPS = 4  # steps of a segment's savings curve the ILP sees (more: tighter model, more non-zeros)


# -- per-candidate coefficients ------------------------------------------------------------------

@dataclass(frozen=True)
class Coefficients:
    """What each candidate segment does when recomputed (arrays over the segmentation's candidates)."""

    cost: np.ndarray  # float64: seconds of the nodes rebuilt
    saved: np.ndarray  # int64: dropped bytes the plain schedule keeps past the segment
    ext: np.ndarray  # int64: kept inputs of the rebuild the plain schedule frees before it
    ext_start: np.ndarray  # int64: sequence position from which ext counts
    peak: np.ndarray  # int64: most bytes of rebuilt copies and late inputs alive during the rebuild
    rebuild_at: np.ndarray  # int64: sequence position of the backward node the rebuild precedes (-1: none)
    # The savings as a staircase over the segment's own forward steps (CSR over candidates): from
    # sequence position save_pos[k] on, save_step[k] more bytes are saved. At most _SAVE_STEPS steps;
    # the last is at the latest point where a dropped node's forward copy is freed.
    save_ptr: np.ndarray
    save_pos: np.ndarray
    save_step: np.ndarray

    @property
    def worth(self) -> np.ndarray:
        """bool: recomputing saves more than it keeps (the paper's rule)."""
        return (self.rebuild_at >= 0) & (self.saved > self.ext)


@dataclass(frozen=True)
class PlainProfile:
    """The plain plan (nothing recomputed) on the sequence order: forward nodes, then the rest."""

    order: np.ndarray  # int64[n]: node id at each sequence position
    seq_pos: np.ndarray  # int64[n]: sequence position of each node
    release: np.ndarray  # int64[n]: sequence position after whose compute the node is freed (n: never)
    memory: np.ndarray  # int64[T]: memory at each point of the memory axis


def plain_profile(graph: Graph) -> PlainProfile:
    """Simulate the plan with nothing recomputed and read off lifetimes and the memory axis.
    Points: forward step t -> t; backward (sequence position q >= m) -> 2q - m (its rebuilds) and
    2q - m + 1 (its compute). O(n + edges)."""
    forward = np.flatnonzero(graph.is_forward)
    order = np.concatenate([forward, np.flatnonzero(~graph.is_forward)]).astype(np.int64)
    seq_pos = np.empty(graph.n, dtype=np.int64)
    seq_pos[order] = np.arange(graph.n)
    plan = CheckpointPlan.of([forward.tolist()] if len(forward) else [])
    schedule = plan_schedule(graph, plan, "bonsai")
    sim = simulate(graph, schedule)
    kinds = np.array([k == "compute" for k, _ in schedule.ops])
    step = np.cumsum(kinds) - 1  # sequence position of the latest compute at each op
    release = np.full(graph.n, graph.n, dtype=np.int64)
    frees = np.flatnonzero(~kinds)
    release[[schedule.ops[i][1] for i in frees]] = step[frees]
    at_compute = sim.timeline[kinds]  # memory at each compute step, in sequence order
    m = len(forward)
    backward_mem = at_compute[m:]
    memory = np.empty(m + 2 * (graph.n - m), dtype=np.int64)
    memory[:m] = at_compute[:m]
    memory[m::2] = backward_mem - graph.mem[order[m:]]  # before b's output exists
    memory[m + 1::2] = backward_mem
    return PlainProfile(order=order, seq_pos=seq_pos, release=release, memory=memory)


def point_of(q: np.ndarray | int, m: int, rebuild: bool = False) -> np.ndarray | int:
    """Memory-axis point of sequence position q: a forward step, or a backward node's compute (or,
    with ``rebuild``, the rebuilds before it)."""
    q = np.asarray(q)
    out = np.where(q < m, q, 2 * q - m + (0 if rebuild else 1))
    return out if out.ndim else int(out)


def coefficients(graph: Graph, seg: Segmentation, plain: PlainProfile) -> Coefficients:
    """Per-candidate recomputation cost, savings, kept inputs and rebuild peak.

    For a fixed segment end j, which nodes are dropped (``keep_until <= j``), which must be rebuilt
    (dropped and read by the backward pass, or by a rebuilt node at a position <= j) and how long each
    rebuilt copy lives do not depend on the start; so one sweep from j down to the smallest start
    yields every candidate ending at j. O(sum over ends of the longest candidate * degree).
    """
    forward, m, n = seg.forward, len(seg.forward), graph.n
    fpos = np.full(n, n, dtype=np.int64)  # forward position, n for non-forward nodes
    fpos[forward] = np.arange(m)
    mem, cost, release, seq_pos = graph.mem, graph.cost, plain.release, plain.seq_pos
    # Per-node facts, vectorised over the edge list.
    src = graph.dep_idx
    dst = np.repeat(np.arange(n), np.diff(graph.dep_ptr))
    fwd_edge = graph.is_forward[dst]
    last_fwd_user = np.full(n, -1, dtype=np.int64)
    np.maximum.at(last_fwd_user, src[fwd_edge], fpos[dst[fwd_edge]])
    first_bwd_user = np.full(n, n + 1, dtype=np.int64)
    np.minimum.at(first_bwd_user, src[~fwd_edge], seq_pos[dst[~fwd_edge]])
    has_bwd = first_bwd_user <= n
    keep_until = last_fwd_user.copy()  # a node is kept by segment end j iff keep_until > j
    for v in forward[::-1]:  # a kept forward view keeps its base (views come after their bases)
        a = graph.alias_of[v]
        if a >= 0:
            keep_until[a] = max(keep_until[a], keep_until[v])
    fwd_users = [graph.users(v)[graph.is_forward[graph.users(v)]].tolist() for v in forward]
    fwd_deps = [graph.deps(v).tolist() for v in forward]
    alias = graph.alias_of.tolist()
    mem_l, cost_l, rel_l, fpos_l = mem.tolist(), cost.tolist(), release.tolist(), fpos.tolist()
    keep_l, has_bwd_l, first_bwd_l = keep_until[forward].tolist(), has_bwd[forward].tolist(), \
        first_bwd_user[forward].tolist()

    count = seg.count
    out_cost = np.zeros(count)
    out_saved, out_ext, out_peak = (np.zeros(count, dtype=np.int64) for _ in range(3))
    out_ext_start = np.zeros(count, dtype=np.int64)
    out_rebuild = np.full(count, -1, dtype=np.int64)
    save_pos: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * count
    save_step: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * count
    order = np.lexsort((-seg.starts, seg.ends))  # by end, then start descending
    ends = seg.ends[order]
    groups = np.split(order, np.flatnonzero(np.diff(ends)) + 1) if count else []
    for group in groups:
        j = int(seg.ends[group[0]]) - 1
        lo = int(seg.starts[group[-1]])
        need = {}  # forward position -> rebuilt copy's last position in the window (absent: not rebuilt)
        live = np.zeros(j - lo + 1, dtype=np.int64)  # bytes of rebuilt copies at each window position
        save_at = np.zeros(j - lo + 2, dtype=np.int64)  # bytes whose forward copy is gone from here on
        inputs: dict[int, int] = {}  # kept node read by the rebuild -> its last reader's position
        total_cost, saved, peak, first = 0.0, 0, 0, n + 1
        gi = 0
        for p in range(j, lo - 1, -1):
            v = int(forward[p])
            if keep_l[p] <= j:  # dropped
                if rel_l[v] > j:
                    saved += mem_l[v]
                    save_at[max(p, keep_l[p]) + 1 - lo] += mem_l[v]
                first = min(first, first_bwd_l[p])
                last = j if has_bwd_l[p] else -1
                for u in fwd_users[p]:
                    pu = fpos_l[u]
                    if pu <= j and pu in need:
                        last = max(last, need[pu] if alias[u] == v else pu)
                if last >= 0:
                    need[p] = last
                    live[p - lo:last - lo + 1] += mem_l[v]
                    peak = max(peak, int(live[p - lo:last - lo + 1].max()))
                    total_cost += cost_l[v]
                    inputs.pop(v, None)
                    for d in fwd_deps[p]:
                        while d >= 0 and d not in inputs:
                            inputs[d] = p  # the sweep goes down: the first reader seen is the last
                            d = alias[d]  # a kept view keeps its base alive with it
            while gi < len(group) and seg.starts[group[gi]] == p:
                c = group[gi]
                gi += 1
                if not need:
                    continue
                out_cost[c], out_saved[c], out_peak[c] = total_cost, saved, peak
                out_rebuild[c] = first
                save_pos[c], save_step[c] = _staircase(save_at[p - lo:], p)
                late = [d for d in inputs if rel_l[d] < first]  # alive longer than plain
                if late:
                    out_ext[c] = sum(mem_l[d] for d in late)
                    out_ext_start[c] = min(rel_l[d] for d in late) + 1
                    # During the rebuild such an input lives until its last rebuilt reader.
                    during = live[p - lo:].copy()
                    for d in late:
                        during[:inputs[d] - p + 1] += mem_l[d]
                    out_peak[c] = int(during.max())
    save_ptr = np.zeros(count + 1, dtype=np.int64)
    save_ptr[1:] = np.cumsum([len(a) for a in save_pos])
    return Coefficients(cost=out_cost, saved=out_saved, ext=out_ext, ext_start=out_ext_start, peak=out_peak,
                        rebuild_at=out_rebuild, save_ptr=save_ptr,
                        save_pos=np.concatenate(save_pos) if count else np.zeros(0, dtype=np.int64),
                        save_step=np.concatenate(save_step) if count else np.zeros(0, dtype=np.int64))


def _staircase(jumps: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """At most _SAVE_STEPS steps under the savings curve ``cumsum(jumps)`` (position ``first + i``):
    the last non-zero jump and the largest others. Each step takes every saving up to its position,
    so the staircase never claims a saving before it happens (conservative), and ends at the total."""
    nz = np.flatnonzero(jumps)
    if len(nz) > _SAVE_STEPS:
        rest = nz[:-1]
        top = rest[np.argpartition(jumps[rest], -(_SAVE_STEPS - 1))[-(_SAVE_STEPS - 1):]]
        nz = np.sort(np.append(top, nz[-1]))
    cum = np.cumsum(jumps)[nz]
    return nz + first, np.diff(cum, prepend=0)


# -- the ILP -------------------------------------------------------------------------------------

@dataclass
class BuiltModel:
    """A built segment ILP for one (graph, granularity), reused across budgets."""

    graph_hash: str
    seg: Segmentation
    coef: Coefficients
    plain: PlainProfile
    candidates: np.ndarray  # int64[C']: segmentation candidates that are in the ILP
    events: sp.csr_matrix  # (K, C') bytes: step heights of the memory change at each event point
    interval_peak: np.ndarray  # int64[K]: the plain memory's maximum from each event point to the next
    problem: Any
    select: Any
    recompute: Any
    product: Any
    delta: Any
    budget: Any  # cp.Parameter, in units
    unit: float  # bytes per unit of the model's memory rows
    build_seconds: float
    _min_peak: Any = None

    def predicted_peak(self, product: np.ndarray) -> int:
        """The model's bound on the peak of the plan whose recomputed ILP candidates are
        ``product`` (0/1 over the ILP candidates)."""
        delta = np.cumsum(self.events @ np.asarray(product, dtype=np.float64))
        return int(np.ceil((self.interval_peak + delta).max()))

    def plan(self, select: np.ndarray, product: np.ndarray) -> CheckpointPlan:
        """The checkpoint plan of an ILP solution. Consecutive kept segments are merged up to the
        granularity (merging kept segments changes nothing in the schedule) so that the explorer
        shows recomputed regions and kept stretches, not a confetti of atoms."""
        chosen = self.candidates[np.asarray(select) > 0.5]
        recomputed = set(self.candidates[np.asarray(product) > 0.5].tolist())
        chosen = chosen[np.argsort(self.seg.starts[chosen])]
        spans: list[tuple[int, int, bool]] = []
        for c in chosen.tolist():
            start, end, rec = int(self.seg.starts[c]), int(self.seg.ends[c]), c in recomputed
            if (spans and not rec and not spans[-1][2]
                    and end - spans[-1][0] <= self.seg.granularity):
                spans[-1] = (spans[-1][0], end, False)
            else:
                spans.append((start, end, rec))
        segments = [self.seg.forward[a:b].tolist() for a, b, _ in spans]
        return CheckpointPlan.of(segments, [i for i, (_, _, rec) in enumerate(spans) if rec])

    def min_peak_problem(self) -> tuple[Any, Any]:
        """(problem, z): the smallest budget the model can meet, for the infeasible-budget message."""
        if self._min_peak is None:
            import cvxpy as cp

            z = cp.Variable()
            cons = [c for c in self.problem.constraints[:-1]]  # all but the budget row
            cons.append(self.delta + self.interval_peak / self.unit <= z)
            self._min_peak = (cp.Problem(cp.Minimize(z / _UNITS_PER_PEAK), cons), z)
        return self._min_peak


_cache: "OrderedDict[tuple[str, int], BuiltModel]" = OrderedDict()
_lock = threading.RLock()


def build(graph: Graph, granularity: int | None = None) -> BuiltModel:
    """The segment ILP of ``graph`` at ``granularity``, built once per (graph hash, granularity)
    and cached (the last few), so a budget change only sets the Parameter."""
    seg = segment(graph, granularity)
    key = (graph.hash, seg.granularity)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    built = _build(graph, seg)
    _cache[key] = built
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return built


def _build(graph: Graph, seg: Segmentation) -> BuiltModel:
    import cvxpy as cp

    start = time.perf_counter()
    plain = plain_profile(graph)
    coef = coefficients(graph, seg, plain)
    m = len(seg.forward)
    worth = coef.worth
    single_atom = np.searchsorted(seg.atom_ptr, seg.starts) + 1 == np.searchsorted(seg.atom_ptr, seg.ends)
    candidates = np.flatnonzero(worth | single_atom)  # a kept multi-atom segment is its atoms, kept
    count = len(candidates)
    w = worth[candidates]

    # Events: step heights of each worth candidate's memory change (bytes), at points of the axis.
    cw = candidates[w]
    cols = np.flatnonzero(w)
    at = coef.rebuild_at[cw]
    ext, saved, peak = coef.ext[cw], coef.saved[cw], coef.peak[cw]
    lengths = np.diff(coef.save_ptr)[cw]
    take = np.concatenate([np.arange(coef.save_ptr[c], coef.save_ptr[c + 1]) for c in cw]) if len(cw) else \
        np.zeros(0, dtype=np.int64)
    rows = np.concatenate([point_of(coef.ext_start[cw], m, rebuild=True), point_of(coef.save_pos[take], m, rebuild=True),
                           point_of(at, m, rebuild=True), point_of(at, m)])
    heights = np.concatenate([ext, -coef.save_step[take], peak - ext, saved - peak]).astype(np.float64)
    col_idx = np.concatenate([cols, np.repeat(cols, lengths), cols, cols])
    keep = heights != 0
    rows, heights, col_idx = rows[keep], heights[keep], col_idx[keep]
    points = np.union1d([0], rows)  # point 0 always opens an interval, so the whole axis is covered
    events = sp.csr_matrix((heights, (np.searchsorted(points, rows), col_idx)), shape=(len(points), count))
    memory = plain.memory
    interval_peak = np.maximum.reduceat(memory, points)

    # Cover: a path through the atom boundaries (flow conservation at every inner boundary).
    atoms = seg.atoms
    a_start = np.searchsorted(seg.atom_ptr, seg.starts[candidates])
    a_end = np.searchsorted(seg.atom_ptr, seg.ends[candidates])
    flow = sp.csr_matrix((np.concatenate([np.ones(count), -np.ones(count)]),
                          (np.concatenate([a_start, a_end]), np.tile(np.arange(count), 2))),
                         shape=(atoms + 1, count))[:atoms]  # the last row is implied by the others
    rhs = np.zeros(atoms)
    if atoms:
        rhs[0] = 1.0

    k = len(points)
    diff = sp.eye(k, format="csr") - sp.eye(k, k=-1, format="csr")
    select = cp.Variable(count, boolean=True, name="select")
    recompute = cp.Variable(count, boolean=True, name="recompute")
    product = cp.Variable(count, boolean=True, name="product")
    delta = cp.Variable(k, name="delta")
    budget = cp.Parameter(nonneg=True, name="budget")
    unit = max(1.0, float(memory.max()) / _UNITS_PER_PEAK)
    budget.value = float(memory.max()) / unit
    cost = coef.cost[candidates] / graph.total_cost if graph.total_cost > 0 else coef.cost[candidates]
    constraints = [
        flow @ select == rhs,
        product <= select, product <= recompute, product >= select + recompute - 1,
        recompute <= w.astype(np.float64),
        diff @ delta == (events / unit) @ product,
        delta + interval_peak / unit <= budget,
    ]
    problem = cp.Problem(cp.Minimize(cost @ product), constraints)
    return BuiltModel(graph_hash=graph.hash, seg=seg, coef=coef, plain=plain, candidates=candidates,
                      events=events, interval_peak=interval_peak, problem=problem,
                      select=select, recompute=recompute, product=product, delta=delta, budget=budget, unit=unit,
                      build_seconds=time.perf_counter() - start)


def solve_bonsai(graph: Graph, budget: int | None, *, time_limit: float | None = None,
                 granularity: int | None = None, backend: str = DEFAULT_BACKEND, **_: object) -> Schedule:
    """Bonsai's segment ILP: the cheapest checkpoint plan whose modelled peak fits ``budget``.

    Raises BudgetError (naming the smallest budget the model can meet) when none fits, SolverError
    when the backend fails."""
    if not graph.is_forward.any():  # nothing to checkpoint
        schedule = plan_schedule(graph, CheckpointPlan.of([]), "bonsai")
        schedule.stats = {"status": "optimal", "gap": 0.0, "variables": 0, "constraints": 0,
                          "build_seconds": 0.0, "solve_seconds": 0.0, "candidates": 0, "segments": 0}
        return schedule
    with _lock:  # the cached problems are shared (explorer sessions run in threads)
        return _solve(graph, budget, time_limit, granularity, backend)


def _solve(graph: Graph, budget: int | None, time_limit: float | None, granularity: int | None,
           backend: str) -> Schedule:
    cached = (graph.hash, segment(graph, granularity).granularity) in _cache
    built = build(graph, granularity)
    target = int(budget) if budget is not None else int(built.plain.memory.max())
    tightened = 0
    solve_seconds = 0.0
    for _attempt in range(_MAX_TIGHTEN + 1):
        effective = target - tightened
        built.budget.value = effective / built.unit
        outcome = solve_milp(built.problem, backend=backend, time_limit=time_limit)
        solve_seconds += outcome.solve_seconds
        if outcome.status == "infeasible":
            raise _infeasible(graph, built, target, backend, time_limit)
        select, product = built.select.value, built.product.value
        plan = built.plan(select, product)
        schedule = plan_schedule(graph, plan, "bonsai")
        peak = simulate(graph, schedule).peak
        if peak <= target:
            break
        tightened += peak - target  # the model was not conservative here: ask it for the excess less
    schedule.stats = {
        **outcome.stats(), "solve_seconds": solve_seconds, "build_seconds": built.build_seconds,
        "cached": cached, "backend": backend,
        "granularity": built.seg.granularity, "candidates": built.seg.count,
        "ilp_candidates": len(built.candidates), "segments": len(plan.segments),
        "recomputed_segments": len(plan.recomputed), "model_peak": built.predicted_peak(np.round(product)),
        "tightened_by": tightened,
    }
    return schedule


def _infeasible(graph: Graph, built: BuiltModel, budget: int, backend: str,
                time_limit: float | None) -> BudgetError:
    problem, z = built.min_peak_problem()
    outcome = solve_milp(problem, backend=backend, time_limit=time_limit)
    # The model's own peak of the plan found (exact bytes) is a budget the main problem accepts even
    # at the solvers' tolerances; and it is above the budget just refused.
    smallest = max(int(np.ceil(float(z.value) * built.unit)), built.predicted_peak(np.round(built.product.value)),
                   budget + 1)
    proven = "" if outcome.status == "optimal" else " (the search for it stopped early; it may be lower)"
    return BudgetError(
        f"bonsai (granularity {built.seg.granularity}) found no checkpoint plan of {graph.name!r} within "
        f"{format_bytes(budget)}: the smallest budget its segment model can guarantee is "
        f"{format_bytes(smallest)} ({smallest} bytes){proven}. Raise the budget to at least that, try a larger "
        "--granularity, or another method.")
