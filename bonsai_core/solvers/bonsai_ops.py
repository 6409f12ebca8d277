"""Bonsai's op-level plans (``space="ops"``): which tensors are resident at a few memory points of the
listed order, solved as a small MILP, and run lazily (docs/BONSAI.md, "Op-level plans").

A checkpoint plan rebuilds whole regions once; the cheapest schedules of a real step do more: drop a
residual stream at the backward pass's first peak and rebuild it once the loss's tensors are gone,
keep the matmuls' outputs and rebuild the cheap ops between them one block at a time. Here the step
runs in its listed order, and at a few **points** of that order (first computations where the memory
is tightest) a MILP decides, per tensor computed before the point, whether it is resident there (``p``)
or recomputed in the window up to the next point (``z``), at the least recomputation cost:

* the memory at each point (the fixed memory, FSDP's unsharded block, the op's output, the resident
  tensors) stays within the budget;
* a tensor read in a window is resident at its start or recomputed in it; one resident at a point was
  resident at the previous one or recomputed since; recomputing a tensor needs its inputs resident at
  the window's start or recomputed in it too (the same rules as the lower bound, :mod:`bonsai_core.bound`).

The plan runs as a compute sequence (:func:`lazy_sequence`): the listed order, where at each point the
tensors the MILP leaves out become unavailable (their copies freed after their last read before it),
and a missing input is rebuilt, with its missing inputs, right before the op that reads it; a rebuilt
tensor stays while a later op or a later rebuild reads it. The simulator judges the result: where it
peaks over the budget at a position that is not a point yet, that position becomes one; where it
peaks at a point (memory between points the MILP does not see), that point's budget in the MILP is
lowered by the excess, and the model solved again, until the plan fits or the time runs out. On a
large step, once a MILP is slow, the rounds after it repair its plan greedily instead (:func:`plan_ops`).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from bonsai_core.bound import GIB, Tensors
from bonsai_core.errors import SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, Schedule, SimResult, hold_separated_outputs, schedule_ops, simulate
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.solvers.sparse_milp import SparseMilp, solve_sparse_milp

MAX_ROUNDS = 16  # MILP solves per plan: points added or the budget tightened between them
NEW_POINTS = 4  # over-budget stretches of a simulated plan that become points, per round
ROUND_SHARE = 0.25  # of the time left, what one round's MILP may take (at least ROUND_SECONDS)
ROUND_SECONDS = 2.0
MILP_SHARE = 0.1  # a MILP slower than this share of the time limit: the rounds after it repair its plan
REPAIR_AFTER_SECONDS = 10.0  # ... or slower than this without a time limit


def read_between(tensors: Tensors, s: int, lo: int, hi: int) -> bool:
    """Whether a position in (lo, hi] reads storage s."""
    r = tensors.readers[s]
    i = bisect.bisect_right(r, lo)
    return i < len(r) and r[i] <= hi


@dataclass(frozen=True)
class PointModel:
    """The MILP at a set of points (sorted positions): ``milp`` and where each point's columns start
    (``p`` then ``z`` over the storages listed before the point)."""

    points: tuple[int, ...]
    milp: SparseMilp
    starts: tuple[int, ...]
    counts: tuple[int, ...]


def point_model(tensors: Tensors, budget: int | dict[int, int], points: tuple[int, ...]) -> PointModel:
    """The MILP of the module docstring at ``points``, memory rows in GiB against ``budget`` (bytes, or
    bytes per point)."""
    g = tensors.graph
    n = g.n
    rows_r, rows_c, rows_v, lower, upper = [], [], [], [], []
    cost_parts, starts, counts, forced = [], [], [], []
    column = 0

    def add(r: np.ndarray, c: np.ndarray, v: np.ndarray) -> None:
        rows_r.append(r), rows_c.append(c), rows_v.append(v)

    for k, t in enumerate(points):
        vs = tensors.storages[tensors.storages < t]
        m = len(vs)
        starts.append(column), counts.append(m)
        cost_parts += [np.zeros(m), g.cost[vs]]
        column += 2 * m
    col_of = lambda k, v, kind: starts[k] + kind * counts[k] + np.searchsorted(  # noqa: E731
        tensors.storages[tensors.storages < points[k]], v)
    nrow = 0
    for k, t in enumerate(points):
        vs = tensors.storages[tensors.storages < t]
        m = len(vs)
        p0, z0 = starts[k], starts[k] + m
        held = vs[g.mem[vs] > 0]
        add(np.full(len(held), nrow), p0 + np.searchsorted(vs, held), g.mem[held] / GIB)
        limit = budget[t] if isinstance(budget, dict) else budget
        lower.append(-np.inf), upper.append((limit - tensors.base(t)) / GIB)
        nrow += 1
        forced += (p0 + np.searchsorted(vs, tensors.reads[t])).tolist()
        pairs = [(i, u) for i, v in enumerate(vs.tolist()) for u in tensors.reads[v]]  # z_v <= p_u + z_u
        if pairs:
            i, u = (np.array(x, dtype=np.int64) for x in zip(*pairs))
            j = np.searchsorted(vs, u)
            r = nrow + np.arange(len(i))
            add(np.repeat(r, 3), np.stack([z0 + i, p0 + j, z0 + j], 1).ravel(),
                np.tile([1.0, -1.0, -1.0], len(i)))
            lower += [-np.inf] * len(i)
            upper += [0.0] * len(i)
            nrow += len(i)
        nxt = points[k + 1] if k + 1 < len(points) else n - 1
        if k + 1 < len(points):  # p_{v,k+1} <= p_{v,k} + z_{v,k}
            r = nrow + np.arange(m)
            add(np.repeat(r, 3), np.stack([col_of(k + 1, vs, 0), p0 + np.arange(m), z0 + np.arange(m)], 1).ravel(),
                np.tile([1.0, -1.0, -1.0], m))
            lower += [-np.inf] * m
            upper += [0.0] * m
            nrow += m
        needed = np.array([read_between(tensors, int(v), t, nxt) for v in vs.tolist()], dtype=bool)
        idx = np.flatnonzero(needed)
        r = nrow + np.arange(len(idx))
        add(np.repeat(r, 2), np.stack([p0 + idx, z0 + idx], 1).ravel(), np.ones(2 * len(idx)))
        lower += [1.0] * len(idx)
        upper += [np.inf] * len(idx)
        nrow += len(idx)
    matrix = sp.csr_matrix((np.concatenate(rows_v), (np.concatenate(rows_r), np.concatenate(rows_c))),
                           shape=(nrow, column))
    low, high = np.zeros(column), np.ones(column)
    low[forced] = 1.0
    milp = SparseMilp(np.concatenate(cost_parts), matrix, np.asarray(lower), np.asarray(upper), low, high,
                      np.ones(column, dtype=bool))
    return PointModel(tuple(points), milp, tuple(starts), tuple(counts))


def absent_at(tensors: Tensors, model: PointModel, values: np.ndarray) -> dict[int, np.ndarray]:
    """Per point, the storages the MILP's solution leaves out there."""
    out = {}
    for k, t in enumerate(model.points):
        vs = tensors.storages[tensors.storages < t]
        present = values[model.starts[k]:model.starts[k] + model.counts[k]] > 0.5
        out[t] = vs[~present]
    return out


def lazy_sequence(tensors: Tensors, absent: dict[int, np.ndarray]) -> list[int]:
    """The plan's compute sequence (module docstring). O((n + edges) · depth of the rebuilds)."""
    g = tensors.graph
    n = g.n
    views: list[list[int]] = [[] for _ in range(n)]
    for v in np.flatnonzero(g.is_view).tolist():
        views[int(tensors.storage[v])].append(v)
    users = [g.users(v).tolist() for v in range(n)]
    available = np.zeros(n, dtype=bool)
    computed = np.zeros(n, dtype=bool)
    seq: list[int] = []
    rebuilt: set[int] = set()

    def rebuild(v: int) -> None:  # v and its missing inputs, inputs first (an explicit stack: deep chains)
        stack = [(v, False)]
        while stack:
            u, ready = stack.pop()
            if available[u]:
                continue
            if ready:
                seq.append(u)
                available[u] = True
                rebuilt.add(u)
                continue
            stack.append((u, True))
            stack.extend((d, False) for d in g.deps(u).tolist() if not available[d])

    def read_later(s: int, x: int) -> bool:
        r = tensors.readers[s]
        i = bisect.bisect_right(r, x)
        return i < len(r)

    def still_needed(x: int) -> set[int]:
        """The rebuilt tensors a later op or a later rebuild reads: those with a later reader, and the
        inputs of missing tensors that are (transitively) needed later."""
        wanted: dict[int, bool] = {}

        def pending(u: int) -> bool:  # computed, missing now, and read later or by a pending user
            stack, order = [u], []
            while stack:
                w = stack.pop()
                if w in wanted:
                    continue
                wanted[w] = False
                order.append(w)
                if computed[w] and not available[w]:
                    stack.extend(users[w])
            for w in sorted(order, reverse=True):  # users come later in the listed order
                later = read_later(int(tensors.storage[w]), x) or any(wanted.get(y, False) for y in users[w])
                wanted[w] = bool(computed[w] and not available[w] and later)
            return wanted[u]

        return {t for t in rebuilt if read_later(int(tensors.storage[t]), x) or any(pending(w) for w in users[t])}

    for x in range(n):
        if x in absent:
            for s in absent[x].tolist():
                available[s] = False
                available[views[s]] = False
            rebuilt = {t for t in rebuilt if available[t]}
        for d in g.deps(x).tolist():
            if not available[d]:
                rebuild(d)
        seq.append(x)
        available[x] = computed[x] = True
        if rebuilt:
            keep = still_needed(x)
            for t in rebuilt - keep:
                available[t] = False
            rebuilt = keep
    return seq


@dataclass
class OpsOutcome:
    """What the op-level search ended with: its best plan within the budget (None: none found), the
    rounds (MILP solves), the points, the last model's size and its MILP's outcome."""

    schedule: Schedule | None
    sim: SimResult | None
    rounds: int
    points: tuple[int, ...]
    variables: int
    constraints: int
    milp_seconds: float
    note: str


def _peak_positions(graph: Graph, ops: list[tuple[str, int]], timeline: np.ndarray, budget: int,
                    count: int) -> list[tuple[int, int, int]]:
    """(excess, position, op) of the highest op of each stretch of ops over ``budget``, the position the
    listed position of the next first computation (the op whose inputs a rebuild was for), the ``count``
    highest."""
    first_at = np.full(len(ops) + 1, graph.n - 1, dtype=np.int64)
    seen = np.zeros(graph.n, dtype=bool)
    nxt = graph.n - 1
    firsts = []
    for i, (kind, v) in enumerate(ops):
        if kind == COMPUTE and not seen[v]:
            seen[v] = True
            firsts.append((i, v))
    j = len(firsts) - 1
    for i in range(len(ops) - 1, -1, -1):
        while j >= 0 and firsts[j][0] >= i:
            nxt = firsts[j][1]
            j -= 1
        first_at[i] = nxt if ops[i][0] == COMPUTE else first_at[i + 1] if i + 1 < len(ops) else nxt
    over = timeline > budget
    found = []
    i = 0
    while i < len(ops):
        if not over[i]:
            i += 1
            continue
        j = i
        while j < len(ops) and over[j]:
            j += 1
        top = i + int(np.argmax(timeline[i:j]))
        found.append((int(timeline[top] - budget), int(first_at[top]), top))
        i = j
    return sorted(found, reverse=True)[:count]


def plan_ops(graph: Graph, budget: int, clock: Deadline, backend: str = "highs", gap: float = 0.01,
             points: tuple[int, ...] = (), tensors: Tensors | None = None) -> OpsOutcome:
    """The cheapest op-level plan within ``budget`` this search finds before ``clock`` runs out (the
    module docstring), starting from ``points`` (positions; the simulated peaks of the first plans add
    more). Once a round's MILP takes more than MILP_SHARE of the time (a large step), the rounds after it
    keep its solution and repair the plan instead: at each position where it peaks over the budget, the
    resident tensors that op does not read are left out there, cheapest per byte first, until the excess
    is covered."""
    tensors = tensors or Tensors(graph)
    points = tuple(sorted(set(int(p) for p in points))) or (int(np.argmax(tensors.held + _plain_need(tensors))),)
    target = {p: budget for p in points}  # each point's budget in the model: lowered where the plan peaks over
    absent: dict[int, np.ndarray] | None = None  # the last MILP's solution, then repaired
    best: tuple[Schedule, SimResult] | None = None
    rounds, seconds, size, note = 0, 0.0, (0, 0), "no round ran"
    repairing = False
    while rounds < MAX_ROUNDS and not clock.passed():
        rounds += 1
        if not repairing:
            model = point_model(tensors, {p: target.get(p, budget) for p in points}, points)
            size = (len(model.milp.cost), model.milp.matrix.shape[0])
            start, left = time.perf_counter(), clock.remaining()
            try:  # a round's MILP gets a share of what is left: its plan is judged and refined by the next rounds
                found = solve_sparse_milp(model.milp, backend, gap=gap,
                                          time_limit=None if left is None else max(ROUND_SECONDS, ROUND_SHARE * left))
            except SolverError:
                found = None
            spent = time.perf_counter() - start
            seconds += spent
            if found is None or found.values is None:
                if absent is None:
                    note = "the MILP found no plan" + (" in time" if found is None else f" at {len(points)} point(s)")
                    break
                repairing = True  # keep the last plan and repair it
            else:
                absent = absent_at(tensors, model, found.values)
                repairing = spent > MILP_SHARE * (clock.time_limit or REPAIR_AFTER_SECONDS / MILP_SHARE)
        ops = hold_separated_outputs(graph, schedule_ops(graph, lazy_sequence(tensors, absent)))
        sim = simulate(graph, ops)
        if sim.peak <= budget:
            if best is None or sim.compute_cost < best[1].compute_cost:
                best = (Schedule(graph=graph.name, method="bonsai", ops=ops, graph_hash=graph.hash,
                                 extra={"points": sorted(int(p) for p in absent)}), sim)
            note = "fits"
            break
        over = _peak_positions(graph, ops, sim.timeline, budget, NEW_POINTS)
        if repairing:
            for excess, position, at in over:
                absent[position] = _left_out(tensors, sim, position, at, excess, absent.get(position))
            note = "repaired"
            continue
        new = [p for _, p, _ in over if p not in points]
        if new:
            points = tuple(sorted(set(points) | set(new)))
            note = "points added"
        else:  # the peak is inside a window the MILP sees only at its point: that point's budget goes down
            for excess, p, _ in over:
                target[p] = target.get(p, budget) - excess
            note = "budget tightened"
    return OpsOutcome(best[0] if best else None, best[1] if best else None, rounds,
                      tuple(sorted(absent)) if absent else points, size[0], size[1], seconds, note)


def _left_out(tensors: Tensors, sim: SimResult, position: int, at: int, excess: int,
              already: np.ndarray | None) -> np.ndarray:
    """``already`` and more storages to leave out at ``position``: of those resident at op ``at`` (where the
    plan peaks ``excess`` bytes over), computed before ``position`` and not read by it, the cheapest per
    byte, until their bytes cover the excess."""
    g = tensors.graph
    live = np.unique(tensors.storage[sim.residency.live_at(at)])
    live = live[(live < position) & (g.mem[live] > 0) & ~np.isin(live, tensors.reads[position])]
    if already is not None:
        live = live[~np.isin(live, already)]
    order = live[np.argsort(g.cost[live] / g.mem[live], kind="stable")]
    taken = order[:int(np.searchsorted(np.cumsum(g.mem[order]), excess)) + 1]
    return taken if already is None else np.union1d(already, taken)


def _plain_need(tensors: Tensors) -> np.ndarray:
    """Bytes of the storages computed before each position and read at or after it, in listed order: the
    plain schedule's memory there less what :attr:`Tensors.held` counts."""
    g = tensors.graph
    delta = np.zeros(g.n + 1)
    for s in tensors.storages.tolist():
        readers = tensors.readers[s]
        if readers and g.mem[s] > 0 and readers[-1] > s:
            delta[s + 1] += g.mem[s]
            delta[readers[-1] + 1] -= g.mem[s]
    return np.cumsum(delta)[:g.n]
