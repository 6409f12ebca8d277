"""The ``checkmate`` method: Checkmate's op-level MILP (Jain et al., MLSys 2020), in CVXPY.

The stage model ("frontier advancing", over the graph's listed node order): the schedule runs in n
stages; stage t computes node t for the first time, after recomputing any earlier nodes it chooses,
in listed order. Decision matrices (lower triangular, t = stage, i = node):

* ``R[t, i]``: node i is computed in stage t (``R[t, t] = 1``; ``R[t, i] = 0`` for i > t);
* ``S[t, i]``: node i is resident at the start of stage t (strictly lower triangular, ``S[0] = 0``);
* ``FREE[t, i, k]``: node i is freed right after node k < t is computed in stage t (k is i itself
  or a consumer of i; a consumer of a view of i counts as a consumer of i, since a resident view
  keeps its base resident);
* ``U[t, k]``: memory when node k is computed in stage t (continuous).

Constraints: a node computed in stage t has each input resident or computed earlier in the stage;
a node resident at the start of stage t+1 was resident or computed in stage t; a node is not
recomputed while resident; a resident view keeps its base resident; ``FREE[t, i, k]`` may be 1 only
when k is computed, i is not kept for stage t+1 and no later consumer of i is computed in stage t
(one row per such hazard: a tighter LP relaxation than Checkmate's one aggregated row per FREE,
which measured no faster on HiGHS); ``U[t, 0] = sum_i S[t, i] mem_i + R[t, 0] mem_0``,
``U[t, k] = U[t, k-1] + R[t, k] mem_k - sum_i mem_i FREE[t, i, k-1]``, ``U <= budget - fixed_mem``.
Objective: ``sum R * cost``, the schedule's total compute cost (``gap`` is relative to its
recomputation part, the objective less one computation of every node).

FREE only has an upper bound here (Checkmate also forces it to 1 when nothing prevents freeing):
the solver frees whenever memory is short, and U is then an upper bound on the true memory, which
is all the budget constraint needs. The schedule is replayed from R alone: R read stage by stage is
a compute sequence, and :func:`bonsai_core.schedule.schedule_ops` frees every copy right after its
last use, so the simulated peak is never above the MILP's U and the compute cost is the objective.

Size: ``n(n-1)`` binaries for R and S, one binary per (stage, node, consumer) for FREE, ``n(n+1)/2``
continuous U: O(n * (n + edges)). The model is built from scipy.sparse matrices with the budget as
a ``cp.Parameter``, and cached per graph, so a re-solve at another budget skips canonicalisation.
Op-level MILPs do not scale: graphs above :data:`MAX_NODES` nodes are refused (use ``bonsai``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from bonsai_core.budget import format_bytes
from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, schedule_ops, simulate

# Above this many nodes (views excepted) the MILP has over 400k variables and 900k constraints
# (measured on a 400-node chain) and neither backend finds a solution in minutes; the segment ILP
# (``bonsai``) is the tool there. docs/SOLVERS_CHECKMATE_MOCCASIN.md has the measurements.
MAX_NODES = 400
_CACHE_SIZE = 4
# Memory is scaled so the largest node is this many units: keeps the MILP's coefficients near 1.
_MEM_UNITS = 1000.0
# Memory is whole bytes, so U <= budget + half a byte admits exactly the schedules that fit (a tight
# budget, such as the no-remat peak itself, must stay feasible).
_HALF_BYTE = 0.5


# -- the stage model, shared with moccasin -----------------------------------------------------


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
    if graph.n > limit:
        raise SolverError(
            f"Method {method!r} refuses {graph.name!r}: it has {graph.n} {counted} and the op-level model is "
            f"limited to {limit} nodes (its size grows with the square of the node count, and beyond that "
            "no backend finds a solution in useful time). Use method 'bonsai', whose segment ILP scales, "
            f"or pass max_nodes={graph.n} to try anyway.")


def contract_views(graph: Graph) -> tuple[Graph, np.ndarray]:
    """The graph without its views, and the original id of each node it keeps (in order).

    A view costs nothing and holds no bytes: all it does is keep its base resident while it is. So a
    consumer of a view may as well read the view's root base (the first non-view up its alias chain)
    directly, which keeps the base resident for exactly as long. Traced transformers are half views,
    and the op-level models grow with the square of the node count. O(n + edges)."""
    alias = graph.alias_of.tolist()
    root = list(range(graph.n))
    for v in range(graph.n):
        if alias[v] >= 0:
            root[v] = root[alias[v]]
    kept = np.flatnonzero(~graph.is_view)
    if len(kept) == graph.n:
        return graph, kept
    new_id = {int(v): i for i, v in enumerate(kept.tolist())}
    nodes = [dict(name=graph.names[v], op=graph.ops[v], phase=graph.phases[v], cost=float(graph.cost[v]),
                  mem=int(graph.mem[v]), deps=sorted({new_id[root[d]] for d in graph.deps(v).tolist()}))
             for v in kept.tolist()]
    return Graph.from_nodes(graph.name, graph.fixed_mem, nodes), kept


def expand_views(graph: Graph, sequence: Sequence[int]) -> list[int]:
    """Put the views back into a compute sequence of :func:`contract_views`'s graph (in original
    ids): a view is (re)computed right before a node that reads it, unless its copy still belongs to
    its base's current copy, and a view nobody reads right after its base's first computation. Views
    cost nothing and hold no bytes, so the sequence's cost and memory are unchanged. O(length)."""
    alias = graph.alias_of.tolist()
    generation = [0] * graph.n  # how many times each node has been computed
    bound_to = [-1] * graph.n  # for a view: the generation of its base when its copy was computed
    root = list(range(graph.n))
    unread_views: dict[int, list[int]] = {}  # root base -> views that nothing reads
    for v in range(graph.n):
        if alias[v] >= 0:
            root[v] = root[alias[v]]
            if not len(graph.users(v)):
                unread_views.setdefault(root[v], []).append(v)
    out: list[int] = []

    def ensure(v: int) -> None:  # make v's resident copy belong to its base's current copy
        a = alias[v]
        if alias[a] >= 0:
            ensure(a)
        if generation[v] and bound_to[v] == generation[a]:
            return
        out.append(v)
        generation[v] += 1
        bound_to[v] = generation[a]

    def compute(u: int) -> None:
        for d in graph.deps(u).tolist():
            if alias[d] >= 0:
                ensure(d)
        out.append(u)
        generation[u] += 1
        if generation[u] == 1:
            for v in unread_views.get(u, ()):
                ensure(v)

    for u in sequence:
        compute(int(u))
    return out


# -- building the MILP -------------------------------------------------------------------------


def _ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items with half-open ranges ``[lo, hi)``: (item index, value) of every value in every
    range, item by item. O(total length), vectorised."""
    lengths = np.maximum(hi - lo, 0)
    item = np.repeat(np.arange(len(lo), dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return item, np.arange(len(item), dtype=np.int64) - starts + np.repeat(lo, lengths)


def _off(t: np.ndarray, i: np.ndarray) -> np.ndarray:
    """Index of the strictly-lower pair (t, i), i < t, in row-major order."""
    return t * (t - 1) // 2 + i


def _tri(t: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Index of the lower pair (t, k), k <= t, in row-major order."""
    return t * (t + 1) // 2 + k


class _Rows:
    """Sparse rows ``A_x @ x + A_u @ u  (<= or ==)  b``, collected as COO triples."""

    def __init__(self) -> None:
        self.rows = 0
        self.x: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.u: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rhs: list[np.ndarray] = []

    def add(self, count: int, rhs: np.ndarray | float) -> int:
        """Reserve ``count`` rows with right-hand side ``rhs``; returns the first row's index."""
        first = self.rows
        self.rows += count
        self.rhs.append(np.broadcast_to(np.asarray(rhs, dtype=np.float64), (count,)).copy())
        return first

    def x_terms(self, row: np.ndarray, col: np.ndarray, val: np.ndarray | float) -> None:
        self.x.append((row, col, np.broadcast_to(np.asarray(val, dtype=np.float64), row.shape)))

    def u_terms(self, row: np.ndarray, col: np.ndarray, val: np.ndarray | float) -> None:
        self.u.append((row, col, np.broadcast_to(np.asarray(val, dtype=np.float64), row.shape)))

    def matrices(self, nx: int, nu: int):
        import scipy.sparse as sp

        def mat(parts, ncols):
            if not parts:
                return sp.csr_matrix((self.rows, ncols))
            r, c, v = (np.concatenate(p) for p in zip(*parts))
            return sp.csr_matrix((v, (r, c)), shape=(self.rows, ncols))  # duplicates are summed

        return mat(self.x, nx), mat(self.u, nu), np.concatenate(self.rhs) if self.rhs else np.zeros(0)


@dataclass
class _Model:
    """A built Checkmate MILP for one graph; ``budget`` is the parameter a re-solve changes."""

    problem: Any
    budget: Any  # cp.Parameter: (budget - fixed_mem) in memory units
    x: Any  # cp.Variable: [R strictly lower (Q), S strictly lower (Q), FREE (nf)], boolean
    mem_scale: float
    cost_scale: float
    base_cost: float  # the scaled cost of the diagonal (every node once): a constant of the objective
    build_seconds: float
    lock: threading.Lock


def _build(graph: Graph) -> _Model:
    """Build the MILP from sparse matrices. O(n * (n + edges)) memory and time."""
    import cvxpy as cp

    start = time.perf_counter()  # after the import: cvxpy takes seconds to load on a busy machine
    n = graph.n
    q = n * (n - 1) // 2  # strictly-lower pairs: R and S
    p = n * (n + 1) // 2  # lower pairs: U
    mem_scale = max(float(graph.mem.max()), 1.0) / _MEM_UNITS
    mem = graph.mem.astype(np.float64) / mem_scale
    positive = graph.cost[graph.cost > 0]
    cost_scale = float(positive.mean()) if len(positive) else 1.0
    cost = graph.cost / cost_scale

    def r_col(t: np.ndarray, i: np.ndarray) -> np.ndarray:  # R[t, i], i < t
        return _off(t, i)

    def s_col(t: np.ndarray, i: np.ndarray) -> np.ndarray:  # S[t, i], i < t
        return q + _off(t, i)

    rows = _Rows()

    # Dependencies: R[t, j] <= R[t, i] + S[t, i] for each edge i -> j and stage t >= j.
    src = graph.dep_idx
    dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(graph.dep_ptr))
    e, t = _ranges(dst, np.full(len(dst), n, dtype=np.int64))
    i, j = src[e], dst[e]
    first = rows.add(len(e), np.where(j == t, -1.0, 0.0))  # R[t, t] = 1 moves to the right
    row = first + np.arange(len(e))
    off = j < t
    rows.x_terms(row[off], r_col(t[off], j[off]), 1.0)
    rows.x_terms(row, r_col(t, i), -1.0)
    rows.x_terms(row, s_col(t, i), -1.0)

    # Retention: S[t+1, i] <= S[t, i] + R[t, i] for i < t <= n-2 (S[i+1, i] <= R[i, i] = 1 is free).
    nodes = np.arange(n, dtype=np.int64)
    v, t = _ranges(nodes + 1, np.full(n, n - 1, dtype=np.int64))
    row = rows.add(len(v), 0.0) + np.arange(len(v))
    rows.x_terms(row, s_col(t + 1, v), 1.0)
    rows.x_terms(row, s_col(t, v), -1.0)
    rows.x_terms(row, r_col(t, v), -1.0)

    # No recomputation of a resident node: R[t, i] + S[t, i] <= 1.
    v, t = _ranges(nodes + 1, np.full(n, n, dtype=np.int64))
    row = rows.add(len(v), 1.0) + np.arange(len(v))
    rows.x_terms(row, r_col(t, v), 1.0)
    rows.x_terms(row, s_col(t, v), 1.0)

    # A resident view keeps its base resident: S[t, view] <= S[t, base].
    views = np.flatnonzero(graph.alias_of >= 0)
    w, t = _ranges(views + 1, np.full(len(views), n, dtype=np.int64))
    vw, base = views[w], graph.alias_of[views[w]]
    row = rows.add(len(w), 0.0) + np.arange(len(w))
    rows.x_terms(row, s_col(t, vw), 1.0)
    rows.x_terms(row, s_col(t, base), -1.0)

    # FREE[t, i, k] for each "free edge" (i, k), k < t: k is i or one of its effective users, and
    # mem_i > 0. (A free after node t itself, the stage's last compute, changes no U: the next
    # stage's memory is S[t+1].)
    users = effective_users(graph)
    owner = np.concatenate([np.full(len(us), a, dtype=np.int64) for a, us in enumerate(users)])
    flat_users = np.concatenate(users)
    heavy = graph.mem > 0
    fe_i = np.concatenate((nodes[heavy], owner[heavy[owner]]))
    fe_k = np.concatenate((nodes[heavy], flat_users[heavy[owner]]))
    order = np.argsort(fe_k, kind="stable")  # stage t has the free edges with k < t: a prefix
    fe_i, fe_k = fe_i[order], fe_k[order]
    count = np.searchsorted(fe_k, nodes, side="left")
    nf = int(count.sum())
    nx = 2 * q + nf
    t_f, e_f = _ranges(np.zeros(n, dtype=np.int64), count)
    f_i, f_k = fe_i[e_f], fe_k[e_f]
    f_col = 2 * q + np.arange(nf, dtype=np.int64)
    # The users of i computed later in stage t are j in users[i] with k < j <= t: a slice of the
    # flat (owner, user)-sorted list, found by binary search on the key owner * n + user.
    key = owner * n + flat_users
    lo = np.searchsorted(key, f_i * n + f_k, side="right")
    hi = np.searchsorted(key, f_i * n + t_f, side="right")
    has_next = t_f < n - 1
    pf, jj = _ranges(lo, hi)
    jj = flat_users[jj]
    at_t = jj == t_f[pf]
    # One row per hazard:
    # F <= R[t, k];  F + S[t+1, i] <= 1;  F + R[t, j] <= 1 for each later user j (F <= 0 if j = t).
    row = rows.add(nf, 0.0) + np.arange(nf)
    rows.x_terms(row, f_col, 1.0)
    rows.x_terms(row, r_col(t_f, f_k), -1.0)
    kept = np.flatnonzero(has_next)
    row = rows.add(len(kept), 1.0) + np.arange(len(kept))
    rows.x_terms(row, f_col[kept], 1.0)
    rows.x_terms(row, s_col(t_f[kept] + 1, f_i[kept]), 1.0)
    row = rows.add(len(pf), np.where(at_t, 0.0, 1.0)) + np.arange(len(pf))
    rows.x_terms(row, f_col[pf], 1.0)
    rows.x_terms(row[~at_t], r_col(t_f[pf[~at_t]], jj[~at_t]), 1.0)
    a_ineq, _, b_ineq = rows.matrices(nx, p)

    # Memory: U[t, 0] = sum_i mem_i S[t, i] + mem_0 R[t, 0];
    #         U[t, k] = U[t, k-1] + mem_k R[t, k] - sum mem_i FREE[t, i, k-1].
    eq = _Rows()
    first = eq.add(p, 0.0)
    t_u, k_u = _ranges(np.zeros(n, dtype=np.int64), nodes + 1)
    row = first + _tri(t_u, k_u)
    eq.u_terms(row, _tri(t_u, k_u), 1.0)
    diag = k_u == t_u
    eq.rhs[-1][_tri(t_u[diag], k_u[diag])] = mem[k_u[diag]]  # R[t, t] = 1
    eq.x_terms(row[~diag], r_col(t_u[~diag], k_u[~diag]), -mem[k_u[~diag]])
    nz = k_u > 0
    eq.u_terms(row[nz], _tri(t_u[nz], k_u[nz] - 1), -1.0)
    t_s, i_s = _ranges(np.zeros(n, dtype=np.int64), nodes)  # S[t, i], i < t, into U[t, 0]
    eq.x_terms(first + _tri(t_s, np.zeros_like(t_s)), s_col(t_s, i_s), -mem[i_s])
    eq.x_terms(first + _tri(t_f, f_k + 1), f_col, mem[f_i])
    a_eqx, a_u, b_eq = eq.matrices(nx, p)

    x = cp.Variable(nx, boolean=True, name="R_S_FREE")
    u = cp.Variable(p, name="U")
    budget = cp.Parameter(nonneg=True, name="budget", value=float(mem.sum()))
    c = np.zeros(nx)
    t_r, i_r = _ranges(np.zeros(n, dtype=np.int64), nodes)  # R[t, i], i < t
    c[r_col(t_r, i_r)] = cost[i_r]
    base = float(cost.sum())
    constraints = [a_eqx @ x + a_u @ u == b_eq, u <= budget]
    if a_ineq.shape[0]:
        constraints.append(a_ineq @ x <= b_ineq)
    # The objective leaves out the constant (every node once), so that the backends' relative gap is
    # the gap on the recomputation cost, as moccasin reports it.
    problem = cp.Problem(cp.Minimize(c @ x), constraints)
    return _Model(problem, budget, x, mem_scale, cost_scale, base, time.perf_counter() - start,
                  threading.Lock())


_models: "OrderedDict[str, _Model]" = OrderedDict()
_models_lock = threading.Lock()


def _model(graph: Graph) -> tuple[_Model, bool]:
    """The graph's MILP from the module cache (keyed by graph hash), built on a miss; and whether
    it was cached. The cache keeps the last few graphs: the explorer's budget slider re-solves one."""
    with _models_lock:
        model = _models.get(graph.hash)
        if model is not None:
            _models.move_to_end(graph.hash)
            return model, True
    model = _build(graph)
    with _models_lock:
        _models[graph.hash] = model
        while len(_models) > _CACHE_SIZE:
            _models.popitem(last=False)
    return model, False


def recomputed_from_r(n: int, r_off: np.ndarray) -> list[list[int]]:
    """The R matrix's strictly-lower part (row-major, as in the model) as per-stage node lists."""
    t, i = _ranges(np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64))
    chosen = r_off > 0.5
    stages: list[list[int]] = [[] for _ in range(n)]
    for tt, ii in zip(t[chosen].tolist(), i[chosen].tolist()):
        stages[tt].append(ii)
    return stages


def solve_checkmate(graph: Graph, budget: int | None, *, time_limit: float | None = None,
                    backend: str = "highs", max_nodes: int = MAX_NODES, **_: object) -> Schedule:
    """Checkmate's optimal schedule within the stage model, under ``budget`` bytes.

    Raises SolverError for a graph above ``max_nodes`` nodes or when the backend finds no solution
    within ``time_limit`` seconds, and BudgetError when the model is infeasible at this budget.
    Stats: status, gap, variables, constraints, build_seconds (0 when the model was cached),
    solve_seconds, objective (the MILP's total compute cost, seconds)."""
    from bonsai_core.solvers.milp import solve_milp

    small, kept = contract_views(graph)
    check_size(small, "checkmate", max_nodes, "nodes that are not views")
    model, cached = _model(small)
    limit = budget if budget is not None else graph.fixed_mem + int(graph.mem.sum())
    with model.lock:  # one cached problem, possibly shared by the explorer's threads
        model.budget.value = max((limit - graph.fixed_mem + _HALF_BYTE) / model.mem_scale, 0.0)
        outcome = solve_milp(model.problem, backend=backend, time_limit=time_limit)
        if outcome.status == "infeasible":
            raise BudgetError(infeasible_message(graph, limit, "checkmate", stage_feasible_budget(small)))
        r_off = np.asarray(model.x.value[: small.n * (small.n - 1) // 2])
    stages = [kept[s].tolist() for s in recomputed_from_r(small.n, r_off)]
    seq = expand_views(graph, [int(v) for v in kept[stage_sequence(recomputed_from_r(small.n, r_off))]])
    schedule = Schedule(graph=graph.name, method="checkmate", ops=schedule_ops(graph, seq), budget=budget,
                        graph_hash=graph.hash)
    stats = outcome.stats()
    if stats["gap"] is not None:  # the recomputation cost is >= 0, so a bound below 0 proves nothing more
        stats["gap"] = min(stats["gap"], 1.0)
    schedule.stats = {**stats, "objective": (outcome.objective + model.base_cost) * model.cost_scale,
                      "build_seconds": 0.0 if cached else model.build_seconds, "backend": backend,
                      "model_nodes": small.n}
    # Stage t of the model (the t-th non-view node) recomputes these nodes (original ids) first.
    schedule.extra = {"stage_recomputes": stages}
    return schedule
