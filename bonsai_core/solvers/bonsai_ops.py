"""Bonsai's op-level plans (``space="ops"``): which tensors are resident at a few memory points of the
listed order, solved as a small MILP, and run lazily (docs/BONSAI.md, "Op-level plans").

A checkpoint plan rebuilds whole regions once; the cheapest schedules of a real step do more: drop a
residual stream at the backward pass's first peak and rebuild it once the loss's tensors are gone,
keep the matmuls' outputs and rebuild the cheap ops between them one block at a time. Here the step
runs in its listed order, and at a few **points** of that order (first computations where the memory
is tightest) a MILP decides, per tensor computed before the point, whether it is resident there (``p``)
or recomputed in the window up to the next point (``z``), at the least recomputation cost:

* the memory at each point (the fixed memory, FSDP's unsharded block, the op's output, the resident
  tensors; on a pipeline rank, the other microbatches in flight: :class:`InFlight`) stays within the budget;
* a tensor read in a window is resident at its start or recomputed in it; one resident at a point was
  resident at the previous one or recomputed since; recomputing a tensor needs its inputs resident at
  the window's start or recomputed in it too (the same rules as the lower bound, :mod:`bonsai_core.bound`).

The plan runs as a compute sequence (:func:`lazy_sequence`): the listed order, where at each point the
tensors the MILP leaves out become unavailable (their copies freed after their last read before it),
and a missing input is rebuilt, with its missing inputs, right before the op that reads it; a rebuilt
tensor stays while a later op or a later rebuild reads it. The simulator judges the result: the
positions where it peaks over the budget become points, a point where it peaks gets a lower budget in
the MILP (memory inside a window the MILP does not see), and the model is solved again, until the plan
fits or the time runs out (:func:`plan_ops`: also a run that counts its bytes, and a greedy repair once
the MILP is slow). Where such a peak is a chain of rebuilt tensors held whole (a residual stream left
out block after block), about √k of its links must be resident at the window's point instead
(:func:`_anchors`); the next round runs that and the plain refinement both, and the simulator judges.
With host copies (``offload``) a saved tensor may instead be copied to host memory after its compute and
brought back once where the run would rebuild it (:func:`point_model`'s ``o`` and ``h``, :func:`lazy_run`).
"""

from __future__ import annotations

import bisect
import copy
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import scipy.sparse as sp

from bonsai_core.bound import GIB, Tensors
from bonsai_core.errors import SolverError
from bonsai_core.graph import Graph
from bonsai_core.offload import offloadable, with_reloads
from bonsai_core.schedule import (COMPUTE, Schedule, SimResult, hold_separated_outputs, host_link, schedule_ops,
                                  simulate)
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.solvers.sparse_milp import SparseMilp, SparseOutcome, solve_sparse_milp

MAX_ROUNDS = 16  # MILP solves per plan: points added or the budget tightened between them
NEW_POINTS = 4  # over-budget stretches of a simulated plan that become points, per round
ROUND_SHARE = 0.25  # of the time left, what one round's MILP may take (at least ROUND_SECONDS)
ROUND_SECONDS = 2.0
EXTRA_ROUNDS = 3  # rounds after a plan that fits is found, while the lazy run itself does not fit yet
IMPROVE_SHARE = 0.5  # of the time left, for solving a fitting plan's MILP once more from its solution
MILP_SHARE = 0.25  # a MILP slower than this share of the time left: the rounds after it repair its plan
REPAIR_AFTER_SECONDS = 30.0  # ... or slower than this without a time limit


def read_between(tensors: Tensors, s: int, lo: int, hi: int) -> bool:
    """Whether a position in (lo, hi] reads storage s."""
    r = tensors.readers[s]
    i = bisect.bisect_right(r, lo)
    return i < len(r) and r[i] <= hi


@dataclass(frozen=True)
class HostLink:
    """Rule 9 as the op-level MILP sees it: the link's bytes per second each way, the pinned host bytes
    allowed (None: no limit) and the storages that may go to host memory (sorted; ``offload.offloadable``)."""

    bytes_per_s: float
    host_bytes: int | None
    candidates: np.ndarray


@dataclass(frozen=True)
class PointModel:
    """The MILP at a set of points (sorted positions): ``milp`` and where each point's columns start
    (``p`` then ``z`` over the storages listed before the point); with host copies, where each point's
    ``h`` columns start (over ``host.candidates`` listed before it) and the ``o`` columns (one per
    candidate listed before the last point)."""

    points: tuple[int, ...]
    milp: SparseMilp
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    host_starts: tuple[int, ...] = ()
    host_counts: tuple[int, ...] = ()
    offload_start: int = -1


@dataclass(frozen=True)
class InFlight:
    """Rule 11 as the op-level MILP sees it (a pipeline rank): at each listed position, the copies of each
    stage's held bytes in flight beyond the one microbatch's (:func:`bonsai_core.in_flight.copies` of the
    listed order); the point right after each stage's forward ends, where the storages of that stage resident
    there are its held bytes (a point of every model); each node's stage."""

    copies: np.ndarray  # int64[n, stages]
    points: np.ndarray  # int64[stages]
    stage_of: np.ndarray  # int64[n]


def in_flight_of(graph: Graph) -> InFlight | None:
    """The microbatches in flight of ``graph``'s listed order (None: no pipeline rank)."""
    from bonsai_core.in_flight import copies, stages_of

    found = copies(graph, [(COMPUTE, v) for v in range(graph.n)])
    if found is None:
        return None
    per_position, ends = found
    return InFlight(per_position, ends + 1, stages_of(graph))


LINK_CUTS = 32  # per point, the start positions of the copy-out rows (evenly spaced on the plain clock)
OFFLOAD_PRICE = 0.01  # an offload's price in the objective, a share of its round trip: a tie-break


def point_model(tensors: Tensors, budget: int | dict[int, int], points: tuple[int, ...],
                anchors: dict[int, np.ndarray] | None = None, host: HostLink | None = None,
                in_flight: InFlight | None = None) -> PointModel:
    """The MILP of the module docstring at ``points``, memory rows in GiB against ``budget`` (bytes, or
    bytes per point); ``anchors``: per point, storages (computed before it) that must be resident there;
    ``host``: a candidate may also be copied to host memory after its compute (``o``) and brought back
    once, in one window (``h``, no compute) (:func:`_host_rows`); ``in_flight``: each row also holds the
    pipeline's other microbatches in flight (:func:`_in_flight_terms`)."""
    g = tensors.graph
    n = g.n
    rows_r, rows_c, rows_v, lower, upper, forced = [], [], [], [], [], []
    starts, counts, host_starts, host_counts, offload_start, cost_parts = _columns(tensors, points, host)
    column = sum(len(c) for c in cost_parts)

    def add(r: np.ndarray, c: np.ndarray, v: np.ndarray) -> None:
        rows_r.append(r), rows_c.append(c), rows_v.append(v)

    col_of = lambda k, v, kind: starts[k] + kind * counts[k] + np.searchsorted(  # noqa: E731
        tensors.storages[tensors.storages < points[k]], v)

    host_cols = lambda k, v: _host_columns(host, host_starts, host_counts, k, v)  # noqa: E731

    nrow = 0
    for k, t in enumerate(points):
        vs = tensors.storages[tensors.storages < t]
        m = len(vs)
        p0, z0 = starts[k], starts[k] + m
        held = vs[g.mem[vs] > 0]
        add(np.full(len(held), nrow), p0 + np.searchsorted(vs, held), g.mem[held] / GIB)
        if in_flight is not None:
            add(*_in_flight_terms(tensors, in_flight, points, starts, t, nrow))
        limit = budget[t] if isinstance(budget, dict) else budget
        lower.append(-np.inf), upper.append((limit - tensors.base(t)) / GIB)
        nrow += 1
        forced += (p0 + np.searchsorted(vs, tensors.reads[t])).tolist()
        if anchors and t in anchors:
            forced += (p0 + np.searchsorted(vs, anchors[t])).tolist()
        pairs = [(i, u) for i, v in enumerate(vs.tolist()) for u in tensors.reads[v]]  # z_v <= p_u + z_u (+ h_u)
        if pairs:
            i, u = (np.array(x, dtype=np.int64) for x in zip(*pairs))
            j = np.searchsorted(vs, u)
            r = nrow + np.arange(len(i))
            add(np.repeat(r, 3), np.stack([z0 + i, p0 + j, z0 + j], 1).ravel(),
                np.tile([1.0, -1.0, -1.0], len(i)))
            at, hc = host_cols(k, u)
            add(r[at], hc, -np.ones(len(at)))
            lower += [-np.inf] * len(i)
            upper += [0.0] * len(i)
            nrow += len(i)
        nxt = points[k + 1] if k + 1 < len(points) else n - 1
        if k + 1 < len(points):  # p_{v,k+1} <= p_{v,k} + z_{v,k} (+ h_{v,k})
            r = nrow + np.arange(m)
            add(np.repeat(r, 3), np.stack([col_of(k + 1, vs, 0), p0 + np.arange(m), z0 + np.arange(m)], 1).ravel(),
                np.tile([1.0, -1.0, -1.0], m))
            at, hc = host_cols(k, vs)
            add(r[at], hc, -np.ones(len(at)))
            lower += [-np.inf] * m
            upper += [0.0] * m
            nrow += m
        needed = np.array([read_between(tensors, int(v), t, nxt) for v in vs.tolist()], dtype=bool)
        idx = np.flatnonzero(needed)
        r = nrow + np.arange(len(idx))
        add(np.repeat(r, 2), np.stack([p0 + idx, z0 + idx], 1).ravel(), np.ones(2 * len(idx)))
        at, hc = host_cols(k, vs[idx])
        add(r[at], hc, np.ones(len(at)))
        lower += [1.0] * len(idx)
        upper += [np.inf] * len(idx)
        nrow += len(idx)
    if host is not None and points and len(host.candidates):
        nrow = _host_rows(tensors, host, points, host_starts, host_counts, offload_start, nrow, add, lower, upper)
    matrix = sp.csr_matrix((np.concatenate(rows_v), (np.concatenate(rows_r), np.concatenate(rows_c))),
                           shape=(nrow, column))
    low, high = np.zeros(column), np.ones(column)
    low[forced] = 1.0
    milp = SparseMilp(np.concatenate(cost_parts), matrix, np.asarray(lower), np.asarray(upper), low, high,
                      np.ones(column, dtype=bool))
    return PointModel(tuple(points), milp, tuple(starts), tuple(counts), tuple(host_starts), tuple(host_counts),
                      offload_start)


def _host_columns(host: HostLink | None, starts: list[int], counts: list[int], k: int,
                  v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the indices into ``v`` of host candidates, their h columns at point ``k``; ``starts``, ``counts``: each
    point's first h column and how many)."""
    if host is None or len(host.candidates) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    j = np.searchsorted(host.candidates, v)
    ok = (j < counts[k]) & (host.candidates[np.minimum(j, len(host.candidates) - 1)] == v)
    return np.flatnonzero(ok), starts[k] + j[ok]


def _in_flight_terms(tensors: Tensors, in_flight: InFlight, points: tuple[int, ...], starts: list[int], t: int,
                     row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Point ``t``'s memory row's terms (rows, columns, GiB) for the other microbatches in flight: per stage,
    its copies at ``t`` times the bytes of its storages resident at the point after its forward's end (their
    ``p`` there: what the plan leaves each microbatch holding for its backward)."""
    g = tensors.graph
    cols, values = [], []
    for j, end in enumerate(in_flight.points.tolist()):
        count = int(in_flight.copies[t, j])
        if count == 0 or end not in points:
            continue
        vs = tensors.storages[tensors.storages < end]
        mine = vs[(in_flight.stage_of[vs] == j) & (g.mem[vs] > 0)]
        cols.append(starts[points.index(end)] + np.searchsorted(vs, mine))
        values.append(count * g.mem[mine] / GIB)
    cols_all = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
    return np.full(len(cols_all), row), cols_all, np.concatenate(values) if values else np.zeros(0)


def _columns(tensors: Tensors, points: tuple[int, ...], host: HostLink | None
             ) -> tuple[list[int], list[int], list[int], list[int], int, list[np.ndarray]]:
    """The point MILP's column layout: per point, the first column and count of its p columns (its z
    columns follow), then with ``host`` per point the first h column and count, and the o columns' start;
    and the objective's parts in column order (z priced at compute cost, o at :data:`OFFLOAD_PRICE`)."""
    g = tensors.graph
    starts, counts, cost_parts, column = [], [], [], 0
    for t in points:
        vs = tensors.storages[tensors.storages < t]
        starts.append(column), counts.append(len(vs))
        cost_parts += [np.zeros(len(vs)), g.cost[vs]]
        column += 2 * len(vs)
    host_starts, host_counts, offload_start = [], [], -1
    if host is not None:
        for t in points:
            host_starts.append(column), host_counts.append(int(np.searchsorted(host.candidates, t)))
            cost_parts.append(np.zeros(host_counts[-1]))
            column += host_counts[-1]
        offload_start = column
        offloads = host.candidates[:host_counts[-1]] if points else host.candidates[:0]
        cost_parts.append(OFFLOAD_PRICE * 2 * g.mem[offloads] / host.bytes_per_s)
    return starts, counts, host_starts, host_counts, offload_start, cost_parts


def _host_rows(tensors: Tensors, host: HostLink, points: tuple[int, ...], host_starts: list[int],
               host_counts: list[int], offload_start: int, nrow: int, add: Callable[..., None],
               lower: list[float], upper: list[float]) -> int:
    """The rows of the host copies (rule 9, on the plain schedule's compute clock, which a plan's
    recomputation only lengthens): a candidate is brought back at most once, and only if offloaded
    (``sum_k h[v,k] <= o[v]``); per point, the copies out of candidates computed from a cut on, each issued
    right after its compute on one stream, end by the point (their bytes at most the link's bandwidth times
    the compute between the cut and the point); the copies back in the windows from a point on fit in the
    time left after it; the offloaded bytes fit the host memory. Returns the next row."""
    g = tensors.graph
    cands = host.candidates[:host_counts[-1]]
    gib = g.mem[cands] / GIB
    per_gib = GIB / host.bytes_per_s  # seconds to copy a GiB one way
    clock = np.concatenate([[0.0], np.cumsum(g.cost)])  # clock[x]: the plain compute before position x
    o = offload_start + np.arange(len(cands))
    for k in range(len(points)):  # sum_k h[v,k] - o[v] <= 0
        c = host_counts[k]
        add(nrow + np.arange(c), host_starts[k] + np.arange(c), np.ones(c))
    add(nrow + np.arange(len(cands)), o, -np.ones(len(cands)))
    lower += [-np.inf] * len(cands)
    upper += [0.0] * len(cands)
    nrow += len(cands)
    for k, t in enumerate(points):
        c = host_counts[k]
        if c == 0:
            continue
        cuts = np.unique(np.searchsorted(clock[cands[:c]], np.linspace(0.0, clock[cands[c - 1]], LINK_CUTS)))
        for first in cuts.tolist():  # copies out of candidates cands[first:c] end by point k
            span = slice(first, c)
            add(np.full(c - first, nrow), o[span], gib[span])
            lower.append(-np.inf), upper.append((clock[t] - clock[cands[first] + 1]) / per_gib)
            nrow += 1
        later = [(host_starts[j], host_counts[j]) for j in range(k, len(points))]
        cols = np.concatenate([s + np.arange(m) for s, m in later])
        vals = np.concatenate([gib[:m] for _, m in later])
        add(np.full(len(cols), nrow), cols, vals)
        lower.append(-np.inf), upper.append((clock[-1] - clock[t + 1]) / per_gib)
        nrow += 1
    if host.host_bytes is not None:
        add(np.full(len(cands), nrow), o, gib)
        lower.append(-np.inf), upper.append(host.host_bytes / GIB)
        nrow += 1
    return nrow


def absent_at(tensors: Tensors, model: PointModel, values: np.ndarray) -> dict[int, np.ndarray]:
    """Per point, the storages the MILP's solution leaves out there."""
    out = {}
    for k, t in enumerate(model.points):
        vs = tensors.storages[tensors.storages < t]
        present = values[model.starts[k]:model.starts[k] + model.counts[k]] > 0.5
        out[t] = vs[~present]
    return out


def host_link_of(graph: Graph) -> HostLink:
    """The default device profile's host link and memory (rule 9) and the graph's offloadable storages."""
    link, host_bytes = host_link([])
    return HostLink(link, host_bytes, np.flatnonzero(offloadable(graph)))


def reloaded_at(model: PointModel, values: np.ndarray, host: HostLink | None) -> np.ndarray:
    """The candidates the MILP's solution brings back from host memory in some window (sorted)."""
    if host is None or not model.points:
        return np.zeros(0, dtype=np.int64)
    back = np.zeros(model.host_counts[-1], dtype=bool)
    for start, count in zip(model.host_starts, model.host_counts):
        back[:count] |= values[start:start + count] > 0.5
    return host.candidates[:model.host_counts[-1]][back]


def lazy_sequence(tensors: Tensors, absent: dict[int, np.ndarray], budget: int | None = None) -> list[int]:
    """The plan's compute sequence (module docstring): :func:`lazy_run` without host copies."""
    return lazy_run(tensors, absent, budget)[0]


def lazy_run(tensors: Tensors, absent: dict[int, np.ndarray], budget: int | None = None,
             offloaded: Iterable[int] = ()) -> tuple[list[int], set[int]]:
    """The plan's sequence (module docstring) and the positions in it that are reloads. With ``budget``,
    the run also keeps count of the bytes it holds (the storages available and read later, the rebuilt
    ones kept, and what every schedule holds at the next op) and, where that passes the budget, lets go
    of kept rebuilt tensors, the one read last first (rebuilt again when read). ``offloaded``: storages
    copied to host memory after their first compute; once such a storage is left out, its first later
    need brings it back from the host instead of rebuilding it (its inputs unread), once.
    O((n + edges) · depth of the rebuilds)."""
    g = tensors.graph
    offloaded = set(int(v) for v in offloaded)
    on_host: set[int] = set()
    reloads: set[int] = set()
    n = g.n
    views: list[list[int]] = [[] for _ in range(n)]
    for v in np.flatnonzero(g.is_view).tolist():
        views[int(tensors.storage[v])].append(v)
    users = [g.users(v).tolist() for v in range(n)]
    available = np.zeros(n, dtype=bool)
    computed = np.zeros(n, dtype=bool)
    seq: list[int] = []
    rebuilt: set[int] = set()
    held = _Held(tensors)

    def rebuild(v: int) -> None:  # v and its missing inputs, inputs first (an explicit stack: deep chains)
        stack = [(v, False)]
        while stack:
            u, ready = stack.pop()
            if available[u]:
                continue
            if ready or u in on_host:
                if u in on_host:
                    on_host.discard(u)
                    reloads.add(len(seq))
                seq.append(u)
                available[u] = True
                rebuilt.add(u)
                held.add(u)
                continue
            stack.append((u, True))
            stack.extend((d, False) for d in g.deps(u).tolist() if not available[d])

    def let_go(nodes: Iterable[int]) -> None:
        for t in nodes:
            if t in offloaded and available[t]:
                offloaded.discard(t)  # its host copy serves one reload
                on_host.add(t)
            available[t] = False
            available[views[t]] = False
            held.drop(t)

    for x in range(n):
        if x in absent:
            let_go(absent[x].tolist())
            rebuilt = {t for t in rebuilt if available[t]}
        for d in g.deps(x).tolist():
            if not available[d]:
                rebuild(d)
        seq.append(x)
        available[x] = computed[x] = True
        if _read_later(tensors, int(tensors.storage[x]), x):
            held.add(x)
        for s in tensors.reads[x]:
            if s not in rebuilt and not _read_later(tensors, s, x):
                held.drop(s)
        if rebuilt:
            keep = _still_needed(tensors, rebuilt, users, computed, available, x)
            let_go(rebuilt - keep)
            rebuilt = keep
            if budget is not None and x + 1 < n:
                excess = held.bytes + int(tensors.held[x + 1]) - budget
                if excess > 0:
                    gone = _farthest(tensors, rebuilt, x, excess)
                    let_go(gone)
                    rebuilt -= set(gone)
    return seq, reloads


class _Held:
    """The bytes of the storages a lazy run holds (its count: an estimate, the simulator judges)."""

    def __init__(self, tensors: Tensors) -> None:
        self.tensors, self.nodes, self.bytes = tensors, set(), 0

    def add(self, v: int) -> None:
        mem = int(self.tensors.graph.mem[v])
        if mem > 0 and v not in self.nodes and not self.tensors.graph.is_view[v]:
            self.nodes.add(v)
            self.bytes += mem

    def drop(self, v: int) -> None:
        if v in self.nodes:
            self.nodes.discard(v)
            self.bytes -= int(self.tensors.graph.mem[v])


def _read_later(tensors: Tensors, s: int, x: int) -> bool:
    r = tensors.readers[s]
    return bisect.bisect_right(r, x) < len(r)


def _next_read(tensors: Tensors, s: int, x: int) -> int:
    r = tensors.readers[s]
    i = bisect.bisect_right(r, x)
    return r[i] if i < len(r) else -1


def _farthest(tensors: Tensors, rebuilt: set[int], x: int, excess: int) -> list[int]:
    """Rebuilt tensors to let go of after position x, read last first (those only a later rebuild reads
    before any), until their bytes cover ``excess``; none the next position reads."""
    g = tensors.graph
    wanted = set(tensors.reads[x + 1])
    order = sorted((t for t in rebuilt if g.mem[t] > 0 and not g.is_view[t] and t not in wanted),
                   key=lambda t: -(_next_read(tensors, t, x) % (g.n + 1)))
    gone, freed = [], 0
    for t in order:
        if freed >= excess:
            break
        gone.append(t)
        freed += int(g.mem[t])
    return gone


def _still_needed(tensors: Tensors, rebuilt: set[int], users: list[list[int]], computed: np.ndarray,
                  available: np.ndarray, x: int) -> set[int]:
    """The rebuilt tensors a later op or a later rebuild reads: those with a later reader, and the inputs
    of missing tensors that are (transitively) needed later."""
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
            later = _read_later(tensors, int(tensors.storage[w]), x) or any(wanted.get(y, False) for y in users[w])
            wanted[w] = bool(computed[w] and not available[w] and later)
        return wanted[u]

    return {t for t in rebuilt if _read_later(tensors, int(tensors.storage[t]), x) or any(pending(w) for w in users[t])}


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
             points: tuple[int, ...] = (), tensors: Tensors | None = None, offload: bool = False) -> OpsOutcome:
    """The cheapest op-level plan within ``budget`` this search finds before ``clock`` runs out (the
    module docstring), starting from ``points`` (positions; the simulated peaks of the first plans add
    more). Each round runs the plan lazily and, where that peaks over the budget, counting its bytes too
    (:func:`_runs`); a plan that fits is kept, and the rounds go on (at most EXTRA_ROUNDS more once one
    fits) until the lazy run fits. Where a peak is mostly a rebuilt chain, its window's point gets
    anchors instead (:func:`_anchors`), resident there and at later points until read; the round after
    solves the plain refinement too and keeps what fits of both (:meth:`_Search._judged`). When the points
    a round added inside windows make its MILP stop short of the gap, they are taken back and those
    windows' budgets lowered instead (and so from then on). Once a round's MILP takes more than MILP_SHARE of the time left (a large
    step, a short limit), the rounds after it keep its solution and repair the plan instead: at each
    position where it peaks over the budget, the resident tensors that op does not read are left out there,
    cheapest per byte first, until the excess is covered. A plan that fits from a MILP stopped short of
    ``gap`` is solved once more from its solution with half the time left. ``offload``: a saved tensor
    may also be copied to host memory after its compute and brought back once instead of rebuilt (the
    MILP's ``o`` and ``h``, :func:`point_model`; the default device profile's host link and memory)."""
    search = _Search(graph, budget, clock, backend, gap, tensors or Tensors(graph), points,
                     host_link_of(graph) if offload else None)
    search.run()
    best = search.best
    return OpsOutcome(best[0] if best else None, best[1] if best else None, search.rounds,
                      tuple(sorted(search.absent)) if search.absent else search.points, search.size[0],
                      search.size[1], search.seconds, search.note)


class _Search:
    """The rounds of :func:`plan_ops` and what they carry from one to the next."""

    def __init__(self, graph: Graph, budget: int, clock: Deadline, backend: str, gap: float, tensors: Tensors,
                 points: tuple[int, ...], host: HostLink | None = None) -> None:
        self.graph, self.budget, self.clock, self.backend, self.gap = graph, budget, clock, backend, gap
        self.tensors, self.host = tensors, host
        self.offloaded = np.zeros(0, dtype=np.int64)  # the last MILP's storages brought back from the host
        self.in_flight = in_flight_of(graph)
        self.points = tuple(sorted(set(int(p) for p in points))) or (
            int(np.argmax(tensors.held + _plain_need(tensors))),)
        if self.in_flight is not None:  # the held bytes of each stage with copies in flight, at its forward's end
            ends = self.in_flight.points[self.in_flight.copies.any(axis=0) & (self.in_flight.points > 0)]
            self.points = tuple(sorted(set(self.points) | set(ends.tolist())))
        self.target = {p: budget for p in self.points}  # each point's budget in the model, lowered where it peaks
        self.anchors: dict[int, np.ndarray] = {}  # per point, rebuilt tensors made resident there (chains cut)
        self.absent: dict[int, np.ndarray] | None = None  # the last MILP's solution, then repaired
        self.best: tuple[Schedule, SimResult] | None = None
        self.rounds, self.seconds, self.size, self.note = 0, 0.0, (0, 0), "no round ran"
        self.repairing = self.improving = self.repaired = False
        self.model: PointModel | None = None
        self.found: SparseOutcome | None = None
        self.extra = EXTRA_ROUNDS
        self.added: dict[int, tuple[int, int]] = {}  # points the last refine added inside a window: (window, excess)
        self.tighten_only = False  # set once added points made the MILP stop short of the gap
        self.plain: dict | None = None  # where the last refine cut chains: the state its plain refinement gives

    STATE = ("points", "target", "anchors", "added", "tighten_only", "absent", "offloaded", "found", "model", "size",
             "repairing", "repaired", "note")  # what a refinement and its round change

    def _state(self) -> dict:
        return {k: copy.copy(getattr(self, k)) for k in self.STATE}

    def _restore(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def _attempt(self) -> tuple[list[tuple[str, int]], SimResult, float] | None:
        """The round's plan run lazily (solved first unless repairing), its fitting runs kept: (ops, sim,
        the cheapest fitting run's compute cost, inf if none); None: nothing more to run."""
        if not self.repairing and not self.solve():
            return None
        (ops, sim), counted = _runs(self.tensors, self.absent, self.budget, self.offloaded, self.host)
        fitting = [s for s in ((ops, sim), counted) if s is not None and s[1].peak <= self.budget]
        for schedule in fitting:
            self.keep(*schedule)
        return ops, sim, min((s[1].compute_cost for s in fitting), default=math.inf)

    def _judged(self) -> tuple[list[tuple[str, int]], SimResult, float] | None:
        """The round's attempt; where the last refine cut chains, its plain refinement's attempt too (its
        fitting runs kept: the simulator judges both). The search goes on from the plain one where the
        anchored round gives nothing or fits at a higher cost; else from the anchored one, which still has
        rounds to go when it does not fit yet (a plain plan that fits is kept meanwhile)."""
        anchored = self._attempt()
        if self.plain is None:
            return anchored
        kept, plain_state, self.plain = self._state(), self.plain, None
        self._restore(plain_state)
        plain = self._attempt()
        if plain is not None and (anchored is None or math.isfinite(anchored[2]) and plain[2] < anchored[2]):
            return plain
        self._restore(kept)
        return anchored

    def run(self) -> None:
        while self.rounds < MAX_ROUNDS and not self.clock.passed():
            self.rounds += 1
            attempt = self._judged()
            if attempt is None:
                return
            ops, sim, _ = attempt
            if sim.peak <= self.budget:
                self.note = "fits"
                if self.improving or self.repaired or (self.found.outcome.gap or 0.0) <= self.gap:
                    return
                self.improving, self.repairing = True, False  # its MILP stopped short of the gap: once more
                continue
            if self.improving or (self.best is not None and self.extra <= 0):
                return
            if self.best is not None:
                self.extra -= 1
            self.refine(ops, sim)

    def solve(self) -> bool:
        """The round's MILP (or the last one again, from its solution); False: nothing more to run."""
        start = self.found.values if self.improving else None
        if not self.improving:
            self.model = point_model(self.tensors, {p: self.target.get(p, self.budget) for p in self.points},
                                     self.points, self._anchored(), self.host, self.in_flight)
            self.size = (len(self.model.milp.cost), self.model.milp.matrix.shape[0])
        share = IMPROVE_SHARE if self.improving else ROUND_SHARE
        found, spent = _milp_round(self.model, self.backend, self.gap, self.clock, start, share)
        self.seconds += spent
        if self.added and not self.improving and (found is None or found.values is None
                                                   or (found.outcome.gap or 0.0) > self.gap):
            self._take_back_points()  # the larger model does not solve in its share: the windows' budgets instead
            return self.solve()
        self.added = {}
        if found is None or found.values is None:
            if self.absent is None:
                self.note = "the MILP found no plan" + (
                    " in time" if found is None else f" at {len(self.points)} point(s)")
                return False
            if self.improving:
                return False
            self.repairing = True  # keep the last plan and repair it
            return True
        self.found, self.repaired = found, False
        self.absent = absent_at(self.tensors, self.model, found.values)
        self.offloaded = reloaded_at(self.model, found.values, self.host)
        left = self.clock.remaining()  # another MILP like this one would not leave enough time: repair
        self.repairing = spent > (REPAIR_AFTER_SECONDS if left is None else MILP_SHARE * left)
        return True

    def keep(self, ops: list[tuple[str, int]], sim: SimResult) -> None:
        if self.best is None or sim.compute_cost < self.best[1].compute_cost:
            self.best = (Schedule(graph=self.graph.name, method="bonsai", ops=ops, graph_hash=self.graph.hash,
                                  extra={"points": sorted(int(p) for p in self.absent),
                                         **({"offloaded": sorted({v for kind, v in ops if kind == "reload"})}
                                            if self.host is not None else {})}), sim)

    def refine(self, ops: list[tuple[str, int]], sim: SimResult) -> None:
        """Points added and tightened where the lazy run peaks over, or the plan repaired there. Where
        rebuilt chains get anchors, the refinement without them is kept too (:attr:`plain`): the next
        round solves both and the simulator judges."""
        before = self._state()
        if self._refine(ops, sim, anchors=True):
            after = self._state()
            self._restore(before)
            self._refine(ops, sim, anchors=False)
            self.plain = self._state()
            self._restore(after)

    def _refine(self, ops: list[tuple[str, int]], sim: SimResult, anchors: bool) -> bool:
        """:meth:`refine` with or without anchors; True: chains were cut."""
        over = _peak_positions(self.graph, ops, sim.timeline, self.budget, NEW_POINTS)
        if self.repairing:
            for excess, position, at in over:
                self.absent[position] = _left_out(self.tensors, sim, position, at, excess, self.absent.get(position))
            self.repaired, self.note = True, "repaired"
            return False
        seen: set[int] = set()  # windows with cut chains refined this round (at their highest peak only)
        added, cut = set(), False
        for excess, p, at in over:  # highest first
            window = self._window_of(p)
            if window in seen:
                continue
            cut_at = None if window is None or not anchors else _anchors(self.tensors, sim, at, window, excess,
                                                                         self.anchors.get(window))
            if cut_at is not None:  # rebuilt chains explain the excess: cut them
                self.anchors[window], cut = cut_at, True
                seen.add(window)
            elif p in self.points:  # a peak inside a window the MILP sees only at its point: its budget goes down
                self.target[p] = self.target.get(p, self.budget) - excess
            elif window is not None and self.tighten_only:
                self.target[window] = self.target.get(window, self.budget) - excess
                seen.add(window)
            else:
                added.add(p)
                if window is not None:
                    self.added[p] = (window, excess)
        self.points = tuple(sorted(set(self.points) | added))
        self.note = "rebuild chains cut" if cut else "points added or tightened"
        return cut

    def _take_back_points(self) -> None:
        """Drop the points the last refine added inside windows, lower each of those windows' budget by its
        highest such peak's excess instead, and from now on tighten rather than add points inside windows."""
        lower: dict[int, int] = {}
        for window, excess in self.added.values():
            lower[window] = max(lower.get(window, 0), excess)
        for window, excess in lower.items():
            self.target[window] = self.target.get(window, self.budget) - excess
        self.points = tuple(p for p in self.points if p not in self.added)
        self.added, self.tighten_only = {}, True

    def _anchored(self) -> dict[int, np.ndarray]:
        """Per point, the anchors that must be resident there: those set at it or at an earlier point and
        read at or after it (a later point that could leave them out would rebuild the chain whole)."""
        out = {}
        for t in self.points:
            held = [a[(a < t) & np.array([_read_later(self.tensors, int(v), t - 1) for v in a.tolist()], dtype=bool)]
                    for p, a in self.anchors.items() if p <= t and len(a)]
            if held:
                out[t] = np.unique(np.concatenate(held))
        return out

    def _window_of(self, position: int) -> int | None:
        """The point whose window holds ``position`` (the last point at or before it; None: none)."""
        i = bisect.bisect_right(self.points, position)
        return self.points[i - 1] if i else None


def _runs(tensors: Tensors, absent: dict[int, np.ndarray], budget: int, offloaded: np.ndarray | None = None,
          host: HostLink | None = None
          ) -> tuple[tuple[list[tuple[str, int]], SimResult], tuple[list[tuple[str, int]], SimResult] | None]:
    """The plan's lazy run and its simulation; where that peaks over the budget, also the run that counts
    its bytes against the budget (:func:`lazy_run`), else None. ``offloaded``: the storages it brings back
    from host memory (copied out after their compute, each reload prefetched: ``offload.with_reloads``)."""
    g = tensors.graph

    def run(limit: int | None) -> tuple[list[tuple[str, int]], SimResult]:
        seq, reloads = lazy_run(tensors, absent, limit, () if offloaded is None else offloaded.tolist())
        ops = hold_separated_outputs(g, schedule_ops(g, seq, reloads))
        if reloads:
            ops = with_reloads(g, ops, host.bytes_per_s)
        return ops, simulate(g, ops)

    ops, sim = run(None)
    if sim.peak <= budget:
        return (ops, sim), None
    return (ops, sim), run(budget)


def _milp_round(model: PointModel, backend: str, gap: float, clock: Deadline, start: np.ndarray | None,
                share: float) -> tuple[SparseOutcome | None, float]:
    """One round's MILP with ``share`` of the time left (at least ROUND_SECONDS), from ``start``; (None:
    no solution in time, seconds spent)."""
    begin, left = time.perf_counter(), clock.remaining()
    try:
        found = solve_sparse_milp(model.milp, backend, start, gap=gap,
                                  time_limit=None if left is None else max(ROUND_SECONDS, share * left))
    except SolverError:
        found = None
    return found, time.perf_counter() - begin


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


def _anchors(tensors: Tensors, sim: SimResult, at: int, point: int, excess: int,
             already: np.ndarray | None) -> np.ndarray | None:
    """Where the lazy run peaks ``excess`` bytes over at op ``at`` because of rebuilt tensors: ``already``
    and about √k of the k rebuilt storages held there that were computed before ``point``, evenly spaced
    in the listed order, to be resident at ``point``. A missing tensor is rebuilt with its missing inputs
    and each stays until its last read, so a chain of k missing tensors (a residual stream dropped block
    after block) is held whole at once; resident anchors every √k links leave about √k of them held at a
    time, for about √k resident ones (Chen's √n on the chain), at no more recomputation: of the chain's
    R bytes, about R·(1 - 2/√k) are saved. None when that does not cover the excess (the peak has
    another cause)."""
    g = tensors.graph
    r = sim.residency
    copies = (r.start <= at) & (at < r.end) & r.recomputed
    rebuilt = np.unique(tensors.storage[r.node[copies]])
    rebuilt = rebuilt[(rebuilt < point) & (g.mem[rebuilt] > 0)]
    if already is not None:
        rebuilt = rebuilt[~np.isin(rebuilt, already)]
    k = math.isqrt(len(rebuilt))
    if k == 0 or float(g.mem[rebuilt].sum()) * (1 - 2 / math.sqrt(len(rebuilt))) < excess:
        return None
    picked = rebuilt[np.unique(np.linspace(0, len(rebuilt) - 1, k + 2)[1:-1].round().astype(np.int64))]
    return picked if already is None else np.union1d(already, picked)


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
