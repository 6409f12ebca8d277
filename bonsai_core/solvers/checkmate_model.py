"""Checkmate's op-level MILP (Jain et al., MLSys 2020): its sparse matrices (:func:`build_matrices`),
and the CVXPY problem made of them (:func:`build_milp`).

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
recomputed while resident; a separated output (``Graph.output_of``, whose bytes only its op's kernel
makes) is recomputed only in a stage that recomputes its op; a resident view keeps its base resident;
``FREE[t, i, k]`` may be 1 only when k is computed, i is not kept for stage t+1 and no later
consumer of i is computed in stage t (one row per such hazard: a tighter LP relaxation than Checkmate's one aggregated row per FREE,
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
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bonsai_core.graph import Graph
from bonsai_core.solvers.sparse_rows import Rows, lower_offset, ranges, tri_offset
from bonsai_core.solvers.stages import effective_users

# Memory is scaled so the largest node is this many units: keeps the MILP's coefficients near 1.
_MEM_UNITS = 1000.0
# Memory is whole bytes, so U <= budget + half a byte admits exactly the schedules that fit (a tight
# budget, such as the no-remat peak itself, must stay feasible).
_HALF_BYTE = 0.5


@dataclass
class CheckmateMatrices:
    """The MILP as sparse matrices over ``x`` = [R strictly lower (q), S strictly lower (q), FREE (nf)]
    (binary) and ``u`` = U's lower triangle, row-major (p, continuous):

    minimise ``objective @ x``  subject to  ``ineq_x @ x <= ineq_rhs``,
    ``eq_x @ x + eq_u @ u == eq_rhs``  and  ``u <= budget`` (memory units, fixed_mem excluded).

    ``free_stage``, ``free_node``, ``free_after``: the (t, i, k) of each FREE column, in column order.
    ``ineq_families``: (name, first row) of each family of ``ineq_x``'s rows, in row order."""

    n: int
    q: int
    p: int
    ineq_x: Any  # scipy.sparse csr
    ineq_rhs: np.ndarray
    ineq_families: list[tuple[str, int]]
    eq_x: Any
    eq_u: Any
    eq_rhs: np.ndarray
    objective: np.ndarray
    free_stage: np.ndarray
    free_node: np.ndarray
    free_after: np.ndarray
    mem_scale: float  # bytes per memory unit
    cost_scale: float  # seconds per cost unit
    base_cost: float  # the scaled cost of the diagonal (every node once): a constant of the objective

    @property
    def nx(self) -> int:
        """Binary variables: R, S and FREE."""
        return 2 * self.q + len(self.free_stage)

    def r_col(self, t: np.ndarray, i: np.ndarray) -> np.ndarray:
        """Column of R[t, i], i < t."""
        return _Columns(self.q).r(t, i)

    def s_col(self, t: np.ndarray, i: np.ndarray) -> np.ndarray:
        """Column of S[t, i], i < t."""
        return _Columns(self.q).s(t, i)

    def budget_units(self, budget_bytes: float, fixed_mem: int) -> float:
        """U's upper bound for a budget in bytes: (budget - fixed_mem + half a byte) in memory units.
        Memory is whole bytes, so the half byte admits exactly the schedules that fit."""
        return max((budget_bytes - fixed_mem + _HALF_BYTE) / self.mem_scale, 0.0)


@dataclass
class CheckmateMilp:
    """A built Checkmate MILP for one graph: its matrices, and the CVXPY problem made of them
    (``budget`` is the parameter a re-solve changes)."""

    matrices: CheckmateMatrices
    problem: Any
    budget: Any  # cp.Parameter: (budget - fixed_mem) in memory units
    x: Any  # cp.Variable: [R strictly lower (Q), S strictly lower (Q), FREE (nf)], boolean
    mem_scale: float
    cost_scale: float
    base_cost: float  # the scaled cost of the diagonal (every node once): a constant of the objective
    build_seconds: float
    lock: threading.Lock
    canonical: set[str] = field(default_factory=set)  # backends whose matrices the problem caches


def build_milp(graph: Graph) -> CheckmateMilp:
    """Build the MILP from sparse matrices (:func:`build_matrices`) as a CVXPY problem with the budget
    as a parameter. O(n * (n + edges)) memory and time."""
    import cvxpy as cp

    start = time.perf_counter()  # after the import: cvxpy takes seconds to load on a busy machine
    m = build_matrices(graph)
    x = cp.Variable(m.nx, boolean=True, name="R_S_FREE")
    u = cp.Variable(m.p, name="U")
    budget = cp.Parameter(nonneg=True, name="budget", value=float(graph.mem.sum()) / m.mem_scale)
    constraints = [m.eq_x @ x + m.eq_u @ u == m.eq_rhs, u <= budget]
    if m.ineq_x.shape[0]:
        constraints.append(m.ineq_x @ x <= m.ineq_rhs)
    # The objective leaves out the constant (every node once), so that the backends' relative gap is
    # the gap on the recomputation cost, as moccasin reports it.
    problem = cp.Problem(cp.Minimize(m.objective @ x), constraints)
    return CheckmateMilp(m, problem, budget, x, m.mem_scale, m.cost_scale, m.base_cost,
                         time.perf_counter() - start, threading.Lock())


def build_matrices(graph: Graph) -> CheckmateMatrices:
    """The MILP's sparse matrices (:class:`CheckmateMatrices`), every family of rows vectorised.
    O(n * (n + edges)) memory and time."""
    n = graph.n
    q = n * (n - 1) // 2  # strictly-lower pairs: R and S
    p = n * (n + 1) // 2  # lower pairs: U
    mem_scale = max(float(graph.mem.max()), 1.0) / _MEM_UNITS
    positive = graph.cost[graph.cost > 0]
    cost_scale = float(positive.mean()) if len(positive) else 1.0
    cols = _Columns(q)
    free = _free_variables(graph, q)
    nx = 2 * q + len(free.col)

    rows = Rows()
    families: list[tuple[str, int]] = []  # (name, first row), for saying which rows a start breaks
    for name, add_rows in _FAMILIES:
        families.append((name, rows.rows))
        add_rows(graph, cols, rows)
    _add_free_rows(graph, cols, free, rows, families)
    a_ineq, _, b_ineq = rows.matrices(nx, p)
    a_eqx, a_u, b_eq = _memory_equalities(graph, graph.mem.astype(np.float64) / mem_scale, cols, free, nx, p)

    cost = graph.cost / cost_scale
    c = np.zeros(nx)
    t_r, i_r = ranges(np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64))  # R[t, i], i < t
    c[cols.r(t_r, i_r)] = cost[i_r]
    return CheckmateMatrices(n, q, p, a_ineq, b_ineq, families, a_eqx, a_u, b_eq, c, free.t, free.i, free.k,
                             mem_scale, cost_scale, float(cost.sum()))


@dataclass(frozen=True)
class _Columns:
    """Where R and S live in ``x``: R's strictly lower triangle, then S's (``q`` pairs each)."""

    q: int

    def r(self, t: np.ndarray, i: np.ndarray) -> np.ndarray:  # R[t, i], i < t
        return lower_offset(t, i)

    def s(self, t: np.ndarray, i: np.ndarray) -> np.ndarray:  # S[t, i], i < t
        return self.q + lower_offset(t, i)


def _dependency_rows(graph: Graph, cols: _Columns, rows: Rows) -> None:
    """Dependencies: R[t, j] <= R[t, i] + S[t, i] for each edge i -> j and stage t >= j."""
    n = graph.n
    src = graph.dep_idx
    dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(graph.dep_ptr))
    e, t = ranges(dst, np.full(len(dst), n, dtype=np.int64))
    i, j = src[e], dst[e]
    first = rows.add(len(e), np.where(j == t, -1.0, 0.0))  # R[t, t] = 1 moves to the right
    row = first + np.arange(len(e))
    off = j < t
    rows.x_terms(row[off], cols.r(t[off], j[off]), 1.0)
    rows.x_terms(row, cols.r(t, i), -1.0)
    rows.x_terms(row, cols.s(t, i), -1.0)


def _retention_rows(graph: Graph, cols: _Columns, rows: Rows) -> None:
    """Retention: S[t+1, i] <= S[t, i] + R[t, i] for i < t <= n-2 (S[i+1, i] <= R[i, i] = 1 is free)."""
    nodes = np.arange(graph.n, dtype=np.int64)
    v, t = ranges(nodes + 1, np.full(graph.n, graph.n - 1, dtype=np.int64))
    row = rows.add(len(v), 0.0) + np.arange(len(v))
    rows.x_terms(row, cols.s(t + 1, v), 1.0)
    rows.x_terms(row, cols.s(t, v), -1.0)
    rows.x_terms(row, cols.r(t, v), -1.0)


def _resident_rows(graph: Graph, cols: _Columns, rows: Rows) -> None:
    """No recomputation of a resident node: R[t, i] + S[t, i] <= 1."""
    nodes = np.arange(graph.n, dtype=np.int64)
    v, t = ranges(nodes + 1, np.full(graph.n, graph.n, dtype=np.int64))
    row = rows.add(len(v), 1.0) + np.arange(len(v))
    rows.x_terms(row, cols.r(t, v), 1.0)
    rows.x_terms(row, cols.s(t, v), 1.0)


def _separated_output_rows(graph: Graph, cols: _Columns, rows: Rows) -> None:
    """A separated output (Graph.output_of) is recomputed only with its op in the same stage: its bytes
    come with the op's kernel, which a getitem alone does not run. R[t, out] <= R[t, op] for t > out."""
    outs = np.flatnonzero(graph.output_of >= 0)
    w, t = ranges(outs + 1, np.full(len(outs), graph.n, dtype=np.int64))
    row = rows.add(len(w), 0.0) + np.arange(len(w))
    rows.x_terms(row, cols.r(t, outs[w]), 1.0)
    rows.x_terms(row, cols.r(t, graph.output_of[outs[w]]), -1.0)


def _view_rows(graph: Graph, cols: _Columns, rows: Rows) -> None:
    """A resident view keeps its base resident: S[t, view] <= S[t, base]."""
    views = np.flatnonzero(graph.alias_of >= 0)
    w, t = ranges(views + 1, np.full(len(views), graph.n, dtype=np.int64))
    vw, base = views[w], graph.alias_of[views[w]]
    row = rows.add(len(w), 0.0) + np.arange(len(w))
    rows.x_terms(row, cols.s(t, vw), 1.0)
    rows.x_terms(row, cols.s(t, base), -1.0)


# The families of inequality rows on R and S, in row order (the FREE rows follow them).
_FAMILIES = (("inputs resident", _dependency_rows), ("retention", _retention_rows),
             ("no recomputation of a resident node", _resident_rows),
             ("separated output only with its op", _separated_output_rows),
             ("resident view keeps its base", _view_rows))


@dataclass(frozen=True)
class _FreeVariables:
    """The FREE[t, i, k] columns: stage ``t``, node ``i`` freed after node ``k``, column ``col``; and the
    graph's (owner, user) pairs sorted by ``key`` = owner * n + user."""

    t: np.ndarray
    i: np.ndarray
    k: np.ndarray
    col: np.ndarray
    key: np.ndarray
    users: np.ndarray  # the user of each key


def _free_variables(graph: Graph, q: int) -> _FreeVariables:
    """FREE[t, i, k] for each "free edge" (i, k), k < t: k is i or one of its effective users, and
    mem_i > 0. (A free after node t itself, the stage's last compute, changes no U: the next stage's
    memory is S[t+1].)"""
    n = graph.n
    nodes = np.arange(n, dtype=np.int64)
    users = effective_users(graph)
    owner = np.concatenate([np.full(len(us), a, dtype=np.int64) for a, us in enumerate(users)])
    flat_users = np.concatenate(users)
    heavy = graph.mem > 0
    fe_i = np.concatenate((nodes[heavy], owner[heavy[owner]]))
    fe_k = np.concatenate((nodes[heavy], flat_users[heavy[owner]]))
    order = np.argsort(fe_k, kind="stable")  # stage t has the free edges with k < t: a prefix
    fe_i, fe_k = fe_i[order], fe_k[order]
    count = np.searchsorted(fe_k, nodes, side="left")
    t_f, e_f = ranges(np.zeros(n, dtype=np.int64), count)
    col = 2 * q + np.arange(int(count.sum()), dtype=np.int64)
    return _FreeVariables(t_f, fe_i[e_f], fe_k[e_f], col, owner * n + flat_users, flat_users)


def _add_free_rows(graph: Graph, cols: _Columns, free: _FreeVariables, rows: Rows,
                   families: list[tuple[str, int]]) -> None:
    """One row per hazard of a free: F <= R[t, k];  F + S[t+1, i] <= 1;  F + R[t, j] <= 1 for each later
    user j of i in stage t (F <= 0 if j = t)."""
    n, nf = graph.n, len(free.col)
    # The users of i computed later in stage t are j in users[i] with k < j <= t: a slice of the
    # flat (owner, user)-sorted list, found by binary search on its key.
    lo = np.searchsorted(free.key, free.i * n + free.k, side="right")
    hi = np.searchsorted(free.key, free.i * n + free.t, side="right")
    pf, jj = ranges(lo, hi)
    jj = free.users[jj]
    at_t = jj == free.t[pf]
    families.append(("free only after a computation", rows.rows))
    row = rows.add(nf, 0.0) + np.arange(nf)
    rows.x_terms(row, free.col, 1.0)
    rows.x_terms(row, cols.r(free.t, free.k), -1.0)
    kept = np.flatnonzero(free.t < n - 1)
    families.append(("free only what the next stage drops", rows.rows))
    row = rows.add(len(kept), 1.0) + np.arange(len(kept))
    rows.x_terms(row, free.col[kept], 1.0)
    rows.x_terms(row, cols.s(free.t[kept] + 1, free.i[kept]), 1.0)
    families.append(("free only after the stage's last reader", rows.rows))
    row = rows.add(len(pf), np.where(at_t, 0.0, 1.0)) + np.arange(len(pf))
    rows.x_terms(row, free.col[pf], 1.0)
    rows.x_terms(row[~at_t], cols.r(free.t[pf[~at_t]], jj[~at_t]), 1.0)


def _memory_equalities(graph: Graph, mem: np.ndarray, cols: _Columns, free: _FreeVariables, nx: int,
                       p: int) -> tuple[Any, Any, np.ndarray]:
    """Memory (in units), as (x's matrix, U's matrix, right-hand side):
    U[t, 0] = sum_i mem_i S[t, i] + mem_0 R[t, 0];  U[t, k] = U[t, k-1] + mem_k R[t, k] - sum mem_i FREE[t, i, k-1]."""
    nodes = np.arange(graph.n, dtype=np.int64)
    eq = Rows()
    first = eq.add(p, 0.0)
    t_u, k_u = ranges(np.zeros(graph.n, dtype=np.int64), nodes + 1)
    row = first + tri_offset(t_u, k_u)
    eq.u_terms(row, tri_offset(t_u, k_u), 1.0)
    diag = k_u == t_u
    eq.rhs[-1][tri_offset(t_u[diag], k_u[diag])] = mem[k_u[diag]]  # R[t, t] = 1
    eq.x_terms(row[~diag], cols.r(t_u[~diag], k_u[~diag]), -mem[k_u[~diag]])
    nz = k_u > 0
    eq.u_terms(row[nz], tri_offset(t_u[nz], k_u[nz] - 1), -1.0)
    t_s, i_s = ranges(np.zeros(graph.n, dtype=np.int64), nodes)  # S[t, i], i < t, into U[t, 0]
    eq.x_terms(first + tri_offset(t_s, np.zeros_like(t_s)), cols.s(t_s, i_s), -mem[i_s])
    eq.x_terms(first + tri_offset(free.t, free.k + 1), free.col, mem[free.i])
    return eq.matrices(nx, p)


def recomputed_from_r(n: int, r_off: np.ndarray) -> list[list[int]]:
    """The R matrix's strictly-lower part (row-major, as in the model) as per-stage node lists."""
    t, i = ranges(np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64))
    chosen = r_off > 0.5
    stages: list[list[int]] = [[] for _ in range(n)]
    for tt, ii in zip(t[chosen].tolist(), i[chosen].tolist()):
        stages[tt].append(ii)
    return stages
