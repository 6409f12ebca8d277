"""A lower bound on the compute cost of every schedule that fits a memory budget: how far any plan
is from the best possible one (the proof is in docs/BONSAI.md, "A lower bound on the op-level optimum").

Every schedule the simulator accepts computes every node once, in some topological order. Take a
node b and the moment it is first computed: every ancestor of b has been computed before and every
descendant of b comes after. A tensor computed before that moment and read at or after it (by b or a
descendant of b) is then resident, or it is computed again later (a recomputation: its cost at least
once more), or, with host copies, on the host and copied back. Recomputing a tensor needs its inputs
resident when it runs: each of them resident at that moment or recomputed too. The memory at that
moment (the fixed memory, FSDP's unsharded block b needs, b's output and every resident tensor) is
within the budget. The cheapest recomputation this allows is a small LP (:func:`closure_at`); no
schedule costs less, whatever its order.

A second bound follows the nodes of one dependency path (the longest, :func:`spine`) at once: their
first computations come in path order in every schedule, so a tensor missing at several of them,
between two that read it, needs a recomputation per such gap (:func:`interval_bound`, without the
inputs' rule). :func:`lower_bound` is the larger of the two, over the points where the memory is
tightest. Each LP's value is taken from its dual solution (weak duality), so the solver's tolerances
cannot lift it above the LP's optimum.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from bonsai_core.graph import Graph

GIB = float(2**30)  # bytes per GiB (bonsai_ops counts its rows in GiB)
DEFAULT_POINTS = 6  # first computations whose closure LP is solved: the tightest by the spine's count


@dataclass(frozen=True)
class LowerBound:
    """No schedule within ``budget`` bytes has a ``compute_cost`` below ``cost`` (seconds; ``math.inf``:
    no schedule fits). ``recompute``: ``cost`` less one computation of every node. ``node``: the node at
    whose first computation the bound is set (-1: none or the spine's interval bound); ``how`` says
    which bound it is; ``offload``: valid for schedules with host copies (on the default device's link)."""

    cost: float
    recompute: float
    node: int
    how: str
    budget: int
    offload: bool
    seconds: float

    def gap(self, compute_cost: float) -> float:
        """How far a schedule of ``compute_cost`` is above the bound: compute_cost / bound - 1."""
        return compute_cost / self.cost - 1.0 if math.isfinite(self.cost) and self.cost > 0 else math.nan

    def stats(self, compute_cost: float | None = None) -> dict:
        out = {"bound": self.cost if math.isfinite(self.cost) else None, "bound_how": self.how,
               "bound_seconds": self.seconds}
        if compute_cost is not None and math.isfinite(self.cost):
            out["bound_gap"] = self.gap(compute_cost)
        return out


class Tensors:
    """What the bounds and bonsai's op-level plans read of a graph: each node's storage (views
    resolved), the storages each node reads, the positions (listed order) that read each storage, and
    the bytes every schedule holds while a node runs beyond the tensors it reads (:meth:`base`)."""

    def __init__(self, graph: Graph) -> None:
        n = graph.n
        self.graph = graph
        self.storage = graph.storages
        self.reads = [sorted(set(self.storage[graph.deps(v)].tolist())) for v in range(n)]
        readers: list[list[int]] = [[] for _ in range(n)]
        for r in range(n):
            for s in self.reads[r]:
                readers[s].append(r)
        self.readers = readers
        self.storages = np.flatnonzero(graph.alias_of < 0)
        written = np.array([graph.mem[graph.inplace_of[v]] if graph.inplace_of[v] >= 0 else 0 for v in range(n)],
                           dtype=np.int64)
        # the fixed memory, FSDP's unsharded block, the node's output less the input it writes in place (rule 8)
        self.held = graph.fixed_mem + unsharded_at(graph) + graph.mem - written

    def base(self, b: int) -> int:
        """Bytes at b's computation that no schedule avoids, beyond the tensors it reads."""
        return int(self.held[b])


def unsharded_at(graph: Graph) -> np.ndarray:
    """int64[n]: bytes FSDP2 holds unsharded while each node runs, in every schedule (rule 7): the block
    whose forward holds a forward node, or the latest block whose forward tensors a backward node reads
    (zeros without ``fsdp``). Whatever the order, that block's parameters are unsharded when the node runs."""
    out = np.zeros(graph.n, dtype=np.int64)
    if graph.fsdp is None:
        return out
    from bonsai_core.fsdp import _backward_unit, _forward_owner

    owner = _forward_owner(graph, graph.fsdp["units"])
    reads = _backward_unit(graph, owner)
    unit = np.where(graph.is_forward, owner, reads)
    sizes = np.array([int(u[3]) for u in graph.fsdp["units"]], dtype=np.int64)
    out[unit >= 0] = sizes[unit[unit >= 0]]
    return out


def memory_unit(graph: Graph) -> float:
    """Bytes per unit in the LPs' memory rows: the largest storage's, so that every coefficient lies
    in (0, 1] whatever the graph's scale (HiGHS drops coefficients below ``small_matrix_value``)."""
    return float(max(int(graph.mem[graph.alias_of < 0].max(initial=0)), 1))


def _reach(graph: Graph, start: int, forward: bool) -> np.ndarray:
    """bool[n]: the strict descendants (``forward``) or ancestors of ``start``."""
    seen = np.zeros(graph.n, dtype=bool)
    step = graph.users if forward else graph.deps
    stack = step(start).tolist()
    while stack:
        v = stack.pop()
        if not seen[v]:
            seen[v] = True
            stack.extend(step(v).tolist())
    return seen


def spine(graph: Graph) -> np.ndarray:
    """The nodes of a longest dependency path (by node count), in order: each one's first computation
    comes after the previous one's in every schedule."""
    n = graph.n
    length = np.zeros(n, dtype=np.int64)
    before = np.full(n, -1, dtype=np.int64)
    for v in range(n):
        deps = graph.deps(v)
        if len(deps):
            k = int(deps[np.argmax(length[deps])])
            length[v], before[v] = length[k] + 1, k
    path, v = [], int(np.argmax(length))
    while v >= 0:
        path.append(v)
        v = int(before[v])
    return np.asarray(path[::-1], dtype=np.int64)


@dataclass(frozen=True)
class _Intervals:
    """Along the spine: for each storage needed at some of its points, the points (as spine indices,
    inclusive) where it is computed before and read at or after; split at the points that read it (there
    it must be resident). ``lo``/``hi``/``node``: one row per piece between two such reads; ``need``:
    bytes needed at each point; ``base``: :meth:`Tensors.base` of each point."""

    points: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    node: np.ndarray
    need: np.ndarray
    base: np.ndarray


def _intervals(graph: Graph, tensors: Tensors, points: np.ndarray) -> _Intervals:
    n, m = graph.n, len(points)
    index = np.full(n, -1, dtype=np.int64)
    index[points] = np.arange(m)
    never = m + 1
    first = np.full(n, never, dtype=np.int64)  # the first spine point that is a strict descendant
    for v in range(n - 1, -1, -1):
        for u in graph.users(v).tolist():
            first[v] = min(first[v], index[u] if index[u] >= 0 else never, first[u])
    last = np.full(n, -1, dtype=np.int64)  # the last spine point that is an ancestor (or the node itself)
    for v in range(n):
        deps = graph.deps(v)
        last[v] = max(int(index[v]), int(last[deps].max()) if len(deps) else -1)
    until = np.full(n, -1, dtype=np.int64)
    reads_at: dict[int, set[int]] = {}
    for r in range(n):
        for s in tensors.reads[r]:
            until[s] = max(until[s], last[r])
            if index[r] >= 0:
                reads_at.setdefault(s, set()).add(int(index[r]))
    need = np.zeros(m + 1)
    lo, hi, node = [], [], []
    for v in np.flatnonzero((graph.alias_of < 0) & (graph.mem > 0)).tolist():
        a, e = int(first[v]), int(until[v])
        if a > e:
            continue
        need[a] += graph.mem[v]
        need[e + 1] -= graph.mem[v]
        start = a
        for j in sorted(j for j in reads_at.get(v, ()) if a <= j <= e) + [e + 1]:
            if j > start:
                lo.append(start), hi.append(j - 1), node.append(v)
            start = j + 1
    base = np.array([tensors.base(int(b)) for b in points], dtype=np.float64)
    return _Intervals(points, np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64),
                      np.asarray(node, dtype=np.int64), np.cumsum(need)[:m], base)


@dataclass(frozen=True)
class _Lp:
    """minimise ``cost @ x`` subject to ``lower <= matrix @ x <= upper`` and ``low <= x <= high``."""

    cost: np.ndarray
    matrix: sp.csr_matrix
    lower: np.ndarray
    upper: np.ndarray
    low: np.ndarray
    high: np.ndarray


def _solve_lp(lp: _Lp) -> tuple[float, np.ndarray | None]:
    """The LP's optimum as a proven lower bound: the Lagrangian value of HiGHS' dual solution, which
    weak duality makes a lower bound for any dual values (signs clipped to the rows' sides). The callers'
    LPs are feasible by construction (they prove "no schedule fits" themselves, in exact bytes), so an
    infeasible verdict is the solver's numerics on its own reduced model, no proof: it gives the trivial
    bound 0, as does any status short of optimal. With the primal solution (None when there is none)."""
    import highspy

    from bonsai_core.solvers.milp import _swallow_highs_banner

    _swallow_highs_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("small_matrix_value", 1e-12)  # its least: keep a byte-sized tensor's coefficient
    csc = lp.matrix.tocsc()
    csc.sort_indices()
    inf = h.getInfinity()
    clip = lambda a: np.clip(np.asarray(a, dtype=np.float64), -inf, inf)  # noqa: E731
    h.passModel(int(csc.shape[1]), int(csc.shape[0]), int(csc.nnz), 1, 1, 0.0, clip(lp.cost), clip(lp.low),
                clip(lp.high), clip(lp.lower), clip(lp.upper), csc.indptr[:-1].astype(np.int32),
                csc.indices.astype(np.int32), csc.data.astype(np.float64), np.zeros(csc.shape[1], dtype=np.int32))
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return 0.0, None  # no proof: the trivial bound
    solution = h.getSolution()
    return max(0.0, lagrangian(lp, np.asarray(solution.row_dual, dtype=np.float64))), np.asarray(solution.col_value)


def lagrangian(lp: _Lp, y: np.ndarray) -> float:
    """min over the box of cost @ x - y @ (matrix @ x - side): a lower bound on the LP's optimum for any
    ``y`` whose entries are >= 0 on rows with a finite lower side and <= 0 on rows with a finite upper
    side (clipped to that here; a row with neither side gets 0)."""
    has_lower, has_upper = np.isfinite(lp.lower), np.isfinite(lp.upper)
    y = np.where(has_lower, np.maximum(y, 0.0), 0.0) + np.where(has_upper, np.minimum(y, 0.0), 0.0)
    side = np.where(y > 0, np.where(has_lower, lp.lower, 0.0), np.where(has_upper, lp.upper, 0.0))
    reduced = lp.cost - lp.matrix.T @ y
    box = np.minimum(reduced * lp.low, reduced * lp.high)
    box = np.where(reduced == 0, 0.0, box)
    return float(y @ side + box.sum())


def interval_bound(graph: Graph, budget: int, tensors: Tensors, iv: _Intervals, rows_per_round: int = 64,
                   rounds: int = 12) -> float:
    """The least recomputation along the spine, each piece of a needed tensor's interval missing at
    some point (to cover the bytes over the budget there) costing one computation of it. ``math.inf``:
    some point cannot fit at all. The points' rows are added in rounds (the most excess first, then
    the ones the last solution leaves short): the LP over any subset of them is a lower bound too, and
    the last one's value is returned."""
    short_bytes = iv.base + iv.need - budget
    over = np.flatnonzero(short_bytes > 0)
    if len(over) == 0:
        return 0.0
    unit = memory_unit(graph)
    excess = short_bytes / unit
    r, c, v = [], [], []
    for k in range(len(iv.node)):
        js = over[(over >= iv.lo[k]) & (over <= iv.hi[k])]
        r.append(js), c.append(np.full(len(js), k)), v.append(np.full(len(js), float(graph.mem[iv.node[k]])))
    cover_bytes = sp.csr_matrix((np.concatenate(v), (np.concatenate(r), np.concatenate(c))),
                                shape=(len(iv.points), len(iv.node)))
    # every piece missing still leaves a point over: no schedule fits (bytes below 2**53 sum exactly)
    if np.any(np.asarray(cover_bytes[over].sum(axis=1)).ravel() < short_bytes[over]):
        return math.inf
    # otherwise x = 1 covers every row: the LP is feasible
    cover = cover_bytes / unit
    chosen = over[np.argsort(-excess[over], kind="stable")[:rows_per_round]]
    items = len(iv.node)
    value = 0.0
    for _ in range(rounds):
        lp = _Lp(graph.cost[iv.node], cover[chosen], excess[chosen], np.full(len(chosen), np.inf),
                 np.zeros(items), np.ones(items))
        value, x = _solve_lp(lp)
        if x is None:
            break
        short = over[cover[over] @ x < excess[over] - 1e-6]
        short = short[~np.isin(short, chosen)]
        if len(short) == 0:
            break
        worst = short[np.argsort(-(excess[short] - cover[short] @ x), kind="stable")[:rows_per_round]]
        chosen = np.union1d(chosen, worst)
    return value


@dataclass(frozen=True)
class Closure:
    """:func:`closure_at`'s LP at one node b for every budget: only its budget row's upper side (row
    ``budget_row``, the bytes left beside ``base``) depends on the budget."""

    base: int  # the bytes b holds whatever the plan: Tensors.base and the tensors it reads
    lp: _Lp  # with the budget row's upper side at +inf
    budget_row: int
    unit: float  # bytes per unit of the budget row (memory_unit)

    def at(self, budget: int) -> _Lp | None:
        """The LP within ``budget`` (None: b cannot run within it)."""
        if self.base > budget:
            return None
        upper = self.lp.upper.copy()
        upper[self.budget_row] = (budget - self.base) / self.unit
        return dataclasses.replace(self.lp, upper=upper)


def closure_at(graph: Graph, budget: int, b: int, tensors: Tensors, offload: bool = False,
               closure: Closure | None = None) -> float:
    """The least recomputation any schedule within ``budget`` makes after b's first computation
    (:func:`closure_lp`; ``closure``: that LP built before). ``math.inf``: b cannot run within the budget."""
    lp = (closure or closure_lp(graph, b, tensors, offload)).at(budget)
    return math.inf if lp is None else _solve_lp(lp)[0]


def closure_lp(graph: Graph, b: int, tensors: Tensors, offload: bool = False) -> Closure:
    """The LP of the least recomputation any schedule within a budget makes after b's first computation (the
    module docstring; docs/BONSAI.md), for every budget (:meth:`Closure.at` sets it). Per storage v among b's ancestors: ``a`` (resident then, or
    recomputed later, or with ``offload`` on the host), ``r`` (recomputed later, cost(v) each), and with
    ``offload`` ``h`` (on the host, copied back later). Rows: needed storages have ``a = 1``;
    ``r_v <= a_u`` for each input u of v; ``r + h <= a``; the resident bytes ``a - r - h`` fit the budget
    with what b itself holds; with ``offload``, the host link's bytes each way within its bandwidth times
    the step's time before and after b (the stalls ``s`` priced in the cost) and within the host memory.
    Within a budget of at least ``base`` the LP is feasible (a = r = 1 everywhere: every storage
    recomputed leaves no free bytes resident)."""
    g = graph
    ancestors = _reach(g, b, forward=False)
    later = _reach(g, b, forward=True)
    nodes = np.flatnonzero(ancestors & (g.alias_of < 0))
    col = np.full(g.n, -1, dtype=np.int64)
    col[nodes] = np.arange(len(nodes))
    forced = np.zeros(g.n, dtype=bool)
    forced[tensors.reads[b]] = True
    needed = forced.copy()
    for r in np.flatnonzero(later).tolist():
        needed[tensors.reads[r]] = True
    needed &= ancestors
    base = tensors.base(b) + int(g.mem[np.flatnonzero(forced & ancestors)].sum())
    k = len(nodes)
    free = nodes[~forced[nodes]]  # the storages whose bytes the plan may leave out
    # columns: a (k), r (k), then with offload h (k) and the stall s (1)
    width = 3 * k + 1 if offload else 2 * k
    rows: list[np.ndarray] = []
    lower: list[float] = []
    upper: list[float] = []
    entries_r, entries_c, entries_v = [], [], []

    def add(cols: np.ndarray, vals: np.ndarray, lo: float, hi: float) -> None:
        entries_r.append(np.full(len(cols), len(lower))), entries_c.append(cols), entries_v.append(vals)
        lower.append(lo), upper.append(hi)

    for v in nodes.tolist():
        i = col[v]
        if offload:
            add(np.array([k + i, 2 * k + i, i]), np.array([1.0, 1.0, -1.0]), -np.inf, 0.0)
        else:
            add(np.array([k + i, i]), np.array([1.0, -1.0]), -np.inf, 0.0)
        for u in tensors.reads[v]:
            add(np.array([k + i, col[u]]), np.array([1.0, -1.0]), -np.inf, 0.0)
    unit = memory_unit(g)
    mem = g.mem[free] / unit
    cols = [col[free], k + col[free]] + ([2 * k + col[free]] if offload else [])
    vals = [mem, -mem] + ([-mem] if offload else [])
    budget_row = len(lower)
    add(np.concatenate(cols), np.concatenate(vals), -np.inf, np.inf)  # set per budget: Closure.at
    low, high = np.zeros(width), np.ones(width)
    low[col[nodes[needed[nodes]]]] = 1.0
    cost = np.concatenate([np.zeros(k), g.cost[nodes]] + ([np.zeros(k), [1.0]] if offload else []))
    if offload:
        from bonsai_core.schedule import host_link

        link, host_bytes = host_link([])
        high[-1] = np.inf
        seconds_per = unit / link  # seconds to copy one unit of bytes one way
        before = float(g.cost[ancestors].sum())
        after = float(g.cost[later].sum()) + float(g.cost[b])
        hcols = 2 * k + col[nodes]
        rcols = k + col[nodes]
        # bytes copied in after b (by its readers) and out before b, each within the link's time:
        # sum h * mem * seconds_per <= C - before (resp. C - after), C = total + sum r cost + s
        for spent in (before, after):
            add(np.concatenate([hcols, rcols, [width - 1]]),
                np.concatenate([g.mem[nodes] / unit * seconds_per, -g.cost[nodes], [-1.0]]),
                -np.inf, g.total_cost - spent)
        if host_bytes is not None:
            add(hcols, g.mem[nodes] / unit, -np.inf, host_bytes / unit)
    matrix = sp.csr_matrix((np.concatenate(entries_v), (np.concatenate(entries_r), np.concatenate(entries_c))),
                           shape=(len(lower), width))
    return Closure(base, _Lp(cost, matrix, np.asarray(lower), np.asarray(upper), low, high), budget_row, unit)


class BoundParts:
    """What :func:`lower_bound` builds of a graph whatever the budget: the spine, its intervals, the
    points whose closure LP is solved, and those LPs (built when first needed). Kept per graph, a budget
    then costs the interval LP and the closure LPs' solves only."""

    def __init__(self, graph: Graph, tensors: Tensors | None = None, offload: bool = False,
                 points: int = DEFAULT_POINTS) -> None:
        self.graph, self.offload = graph, offload
        self.tensors = tensors or Tensors(graph)
        path = spine(graph)
        self.intervals = _intervals(graph, self.tensors, path)
        order = np.argsort(-(self.intervals.base + self.intervals.need), kind="stable")
        self.candidates = list(dict.fromkeys(int(path[j]) for j in order[:points]))
        self._closures: dict[int, Closure] = {}

    def closure(self, b: int) -> Closure:
        if b not in self._closures:
            self._closures[b] = closure_lp(self.graph, b, self.tensors, self.offload)
        return self._closures[b]


def lower_bound(graph: Graph, budget: int, *, offload: bool = False, points: int = DEFAULT_POINTS,
                tensors: Tensors | None = None, parts: BoundParts | None = None) -> LowerBound:
    """The largest of the bounds above at ``budget``: the spine's interval bound (without ``offload``)
    and the closure LP at the ``points`` first computations where the spine's needed bytes are the
    largest. O(points · (n + edges)) to build, small LPs to solve. ``parts``: what was built for another
    budget (:class:`BoundParts` of the same graph, ``offload`` and ``points``)."""
    start = time.perf_counter()
    done = lambda cost, node, how: LowerBound(cost, cost - graph.total_cost, node, how, budget, offload,  # noqa: E731
                                              time.perf_counter() - start)
    if budget < graph.peak_lower_bound:
        return done(math.inf, -1, "no schedule fits: an operator with its inputs needs more")
    parts = parts or BoundParts(graph, tensors, offload, points)
    if parts.graph.hash != graph.hash or parts.offload != offload:
        raise ValueError("lower_bound: parts built for another graph or offload setting")
    best, node, how = 0.0, -1, "no recomputation needed"
    if not offload:
        extra = interval_bound(graph, budget, parts.tensors, parts.intervals)
        if extra > best:
            best, how = extra, "the spine's intervals"
    for b in parts.candidates:
        extra = closure_at(graph, budget, b, parts.tensors, offload, parts.closure(b))
        if extra > best:
            best, node, how = extra, b, f"recomputation after {graph.names[b]!r}'s first computation"
        if math.isinf(best):
            how = f"no schedule fits: {graph.names[b]!r} cannot run within the budget"
            break
    return done(graph.total_cost + best, node, how)
