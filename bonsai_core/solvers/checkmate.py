"""The ``checkmate`` method: Checkmate's op-level MILP (Jain et al., MLSys 2020), solved on HiGHS or SCIP.

The model itself (the stage model's R, S, FREE and U matrices and their rows) is built in
:mod:`bonsai_core.solvers.checkmate_model`; the views are contracted away first and put back after
(:mod:`bonsai_core.solvers.views`). Here: the per-graph model cache, the whole-call time limit, and
reading the schedule back.

The schedule is replayed from R alone: R read stage by stage is a compute sequence, and
:func:`bonsai_core.schedule.schedule_ops` frees every copy right after its last use, so the
simulated peak is never above the MILP's U and the compute cost is the objective.

The model is built from scipy.sparse matrices and cached per graph. By default (option
``warm_start``) the backend is driven directly (:mod:`bonsai_core.solvers.sparse_milp`) from a MIP
start: the cheapest schedule another method finds within the budget, converted into R, S, FREE and U
(:mod:`bonsai_core.solvers.checkmate_start`); the result is never worse than that start. With
``warm_start=False`` the CVXPY problem is solved with no start, the budget a ``cp.Parameter``, so a
re-solve at another budget skips canonicalisation. Op-level MILPs do not scale: graphs above
:data:`MAX_NODES` nodes are refused (use ``bonsai``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, schedule_ops
from bonsai_core.solvers.checkmate_model import CheckmateMatrices, CheckmateMilp, build_milp, recomputed_from_r
from bonsai_core.solvers.checkmate_start import find_start
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.solvers.milp import DEFAULT_BACKEND, canonicalise, check_backend, problem_size, solve_milp
from bonsai_core.solvers.sparse_milp import SparseMilp, solve_sparse_milp
from bonsai_core.solvers.stages import check_size, infeasible_message, stage_feasible_budget, stage_sequence
from bonsai_core.solvers.views import contract_views, expand_views

# Above this many nodes (views excepted) the MILP has over 400k variables and 900k constraints
# (measured on a 400-node chain) and neither backend finds a solution in minutes; the segment ILP
# (``bonsai``) is the tool there. docs/results/checkmate_moccasin.md has the measurements.
MAX_NODES = 400
_CACHE_SIZE = 4
# The search for a warm start may take this share of the time limit, and at most this many seconds
# (also without a limit): moccasin, the start that counts, proves its optimum in seconds where it can.
START_SHARE = 0.25
START_MAX_SECONDS = 30.0

_models: "OrderedDict[str, CheckmateMilp]" = OrderedDict()
_models_lock = threading.Lock()


def cached_model(graph: Graph) -> tuple[CheckmateMilp, bool]:
    """The graph's MILP from the module cache (keyed by graph hash), built on a miss; and whether
    it was cached. The cache keeps the last few graphs: the explorer's budget slider re-solves one."""
    with _models_lock:
        model = _models.get(graph.hash)
        if model is not None:
            _models.move_to_end(graph.hash)
            return model, True
    model = build_milp(graph)
    with _models_lock:
        _models[graph.hash] = model
        while len(_models) > _CACHE_SIZE:
            _models.popitem(last=False)
    return model, False


def solve_checkmate(graph: Graph, budget: int | None, *, time_limit: float | None = None,
                    backend: str = DEFAULT_BACKEND, max_nodes: int = MAX_NODES, warm_start: bool = True) -> Schedule:
    """Checkmate's optimal schedule within the stage model, under ``budget`` bytes.

    Raises SolverError for a graph above ``max_nodes`` nodes or when no solution is found within
    ``time_limit`` seconds, and BudgetError when the model is infeasible at this budget.
    Stats: status, gap, variables, constraints, build_seconds (0 when the model was cached),
    solve_seconds, objective (the MILP's total compute cost, seconds), warm_start (the start and its
    cost, why there is none, or "off"), warm_start_cost (its compute cost, seconds), warm_start_seconds,
    warm_start_tried (a note per method tried).

    Options:
        time_limit: seconds for the whole call (building the MILP included); past it, the best schedule found and its gap
        backend: MILP backend, highs or scip
        max_nodes: refuse graphs with more nodes than this (views excepted)
        warm_start: start the MILP from the cheapest schedule of none, chen, dtr, moccasin or bonsai that fits
            (a quarter of time_limit at most goes to finding it); false: no start, the CVXPY model with
            the budget a Parameter
    """
    import cvxpy  # noqa: F401  (seconds on a busy machine, once per process: not the solve's time)

    deadline = Deadline(time_limit)
    small, kept = contract_views(graph)
    check_size(small, "checkmate", max_nodes, "nodes that are not views")
    model, cached = cached_model(small)
    limit = budget if budget is not None else graph.fixed_mem + int(graph.mem.sum())
    try:
        if warm_start:
            r_off, stats = _solve_from_start(graph, budget, limit, small, kept, model, backend, deadline)
        else:
            r_off, stats = _solve_with_cvxpy(graph, limit, small, model, backend, deadline)
    except (BudgetError, SolverError) as e:  # the model was built: a report still gets its size
        variables, constraints = problem_size(model.problem)
        e.stats = {"variables": variables, "constraints": constraints, "build_seconds": model.build_seconds}
        raise
    schedule = schedule_from_r(graph, kept, r_off)
    schedule.budget = budget
    schedule.stats = {**stats, "build_seconds": 0.0 if cached else model.build_seconds, "backend": backend,
                      "model_nodes": small.n}
    return schedule


def schedule_from_r(graph: Graph, kept: np.ndarray, r_off: np.ndarray) -> Schedule:
    """The schedule of ``graph`` that R's strictly-lower part (of the model of the graph without its
    views; ``kept`` maps its ids to ``graph``'s) describes: stage by stage, the views put back, every
    copy freed right after its last use."""
    recomputes = recomputed_from_r(len(kept), r_off)
    seq = expand_views(graph, [int(v) for v in kept[stage_sequence(recomputes)]])
    schedule = Schedule(graph=graph.name, method="checkmate", ops=schedule_ops(graph, seq), graph_hash=graph.hash)
    # Stage t of the model (the t-th non-view node) recomputes these nodes (original ids) first.
    schedule.extra = {"stage_recomputes": [kept[s].tolist() for s in recomputes]}
    return schedule


def _solve_with_cvxpy(graph: Graph, limit: int, small: Graph, model: CheckmateMilp, backend: str,
                      deadline: Deadline) -> tuple[np.ndarray, dict]:
    """R's strictly-lower part and the stats, from the cached CVXPY problem with no start."""
    with model.lock:  # one cached problem, possibly shared by the explorer's threads
        model.budget.value = model.matrices.budget_units(limit, graph.fixed_mem)
        if backend not in model.canonical:
            canonicalise(model.problem, backend)
            model.canonical.add(backend)
        left = deadline.left("checkmate", "building and canonicalising its MILP")
        outcome = solve_milp(model.problem, backend=backend, time_limit=left, whole_limit=deadline.time_limit)
        if outcome.status == "infeasible":
            raise BudgetError(infeasible_message(graph, limit, "checkmate", stage_feasible_budget(small)))
        r_off = np.asarray(model.x.value[: small.n * (small.n - 1) // 2])
    stats = outcome.stats()
    if stats["gap"] is not None:  # the recomputation cost is >= 0, so a bound below 0 proves nothing more
        stats["gap"] = min(stats["gap"], 1.0)
    stats["objective"] = (outcome.objective + model.base_cost) * model.cost_scale
    stats["warm_start"] = "off"
    return r_off, stats


def start_seconds(deadline: Deadline) -> float:
    """Seconds the search for a start may take: :data:`START_SHARE` of the time limit, at most
    :data:`START_MAX_SECONDS`."""
    left = deadline.remaining()
    return START_MAX_SECONDS if left is None else min(START_SHARE * max(left, 0.0), START_MAX_SECONDS)


def checkmate_milp(m: CheckmateMatrices, budget_units: float) -> SparseMilp:
    """The MILP as one sparse matrix over [x, u]: the memory rows (equalities), then the others;
    U <= budget as U's upper bound. Binaries x, continuous u (unbounded below, as in the CVXPY model)."""
    import scipy.sparse as sp

    nx, p = m.nx, m.p
    ineq = m.ineq_x.shape[0]
    matrix = sp.vstack([sp.hstack([m.eq_x, m.eq_u]), sp.hstack([m.ineq_x, sp.csr_matrix((ineq, p))])]).tocsc()
    return SparseMilp(cost=np.concatenate((m.objective, np.zeros(p))), matrix=matrix,
                      row_lower=np.concatenate((m.eq_rhs, np.full(ineq, -np.inf))),
                      row_upper=np.concatenate((m.eq_rhs, m.ineq_rhs)),
                      col_lower=np.concatenate((np.zeros(nx), np.full(p, -np.inf))),
                      col_upper=np.concatenate((np.ones(nx), np.full(p, budget_units))),
                      integer=np.concatenate((np.ones(nx, dtype=bool), np.zeros(p, dtype=bool))))


def _solve_from_start(graph: Graph, budget: int | None, limit: int, small: Graph, kept: np.ndarray,
                      model: CheckmateMilp, backend: str, deadline: Deadline) -> tuple[np.ndarray, dict]:
    """R's strictly-lower part and the stats, from the backend driven directly with a MIP start
    (:func:`~bonsai_core.solvers.checkmate_start.find_start`). The result is never worse than the
    start: when the backend ends with nothing better, the start is the result, with the backend's
    bound for its gap."""
    m = model.matrices
    check_backend(backend)
    units = m.budget_units(limit, graph.fixed_mem)
    search = find_start(graph, budget, small, kept, m, units, start_seconds(deadline))
    start = search.start
    if start is None:
        left = deadline.left("checkmate", "building its MILP and looking for a start")
    else:  # with a start, no time left only means the start is the result
        left = None if deadline.time_limit is None else max(deadline.remaining(), 0.0)
    try:
        found = solve_sparse_milp(checkmate_milp(m, units), backend, None if start is None else start.values(),
                                  time_limit=left, whole_limit=deadline.time_limit)
    except SolverError as e:  # no start and no solution: say why there was no start
        raise SolverError(f"{e} No warm start either: {search.describe()}.") from None
    outcome = found.outcome
    if outcome.status == "infeasible":
        raise BudgetError(infeasible_message(graph, limit, "checkmate", stage_feasible_budget(small)))
    note = search.describe() + (f"; {found.start_note}" if found.start_note else "")
    stats = {**outcome.stats(), "objective": (outcome.objective + model.base_cost) * model.cost_scale,
             "variables": m.nx + m.p, "constraints": outcome.constraints + m.p,  # U <= budget: rows in CVXPY's count
             "warm_start": note, "warm_start_cost": None if start is None else start.compute_cost,
             "warm_start_seconds": search.seconds, "warm_start_tried": search.notes}
    return np.asarray(found.values[: m.q]), stats
