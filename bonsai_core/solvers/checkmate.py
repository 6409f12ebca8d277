"""The ``checkmate`` method: Checkmate's op-level MILP (Jain et al., MLSys 2020), solved on HiGHS or SCIP.

The model itself (the stage model's R, S, FREE and U matrices and their rows) is built in
:mod:`bonsai_core.solvers.checkmate_model`; the views are contracted away first and put back after
(:mod:`bonsai_core.solvers.views`). Here: the per-graph model cache, the whole-call time limit, and
reading the schedule back.

The schedule is replayed from R alone: R read stage by stage is a compute sequence, and
:func:`bonsai_core.schedule.schedule_ops` frees every copy right after its last use, so the
simulated peak is never above the MILP's U and the compute cost is the objective.

The model is built from scipy.sparse matrices with the budget as a ``cp.Parameter``, and cached per
graph, so a re-solve at another budget skips canonicalisation. Op-level MILPs do not scale: graphs
above :data:`MAX_NODES` nodes are refused (use ``bonsai``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, schedule_ops
from bonsai_core.solvers.checkmate_model import CheckmateMilp, build_milp, recomputed_from_r
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.solvers.milp import DEFAULT_BACKEND, canonicalise, solve_milp
from bonsai_core.solvers.stages import check_size, infeasible_message, stage_feasible_budget, stage_sequence
from bonsai_core.solvers.views import contract_views, expand_views

# Above this many nodes (views excepted) the MILP has over 400k variables and 900k constraints
# (measured on a 400-node chain) and neither backend finds a solution in minutes; the segment ILP
# (``bonsai``) is the tool there. docs/SOLVERS_CHECKMATE_MOCCASIN.md has the measurements.
MAX_NODES = 400
_CACHE_SIZE = 4
# Memory is whole bytes, so U <= budget + half a byte admits exactly the schedules that fit (a tight
# budget, such as the no-remat peak itself, must stay feasible).
_HALF_BYTE = 0.5

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
                    backend: str = DEFAULT_BACKEND, max_nodes: int = MAX_NODES) -> Schedule:
    """Checkmate's optimal schedule within the stage model, under ``budget`` bytes.

    Raises SolverError for a graph above ``max_nodes`` nodes or when no solution is found within
    ``time_limit`` seconds, and BudgetError when the model is infeasible at this budget.
    Stats: status, gap, variables, constraints, build_seconds (0 when the model was cached),
    solve_seconds, objective (the MILP's total compute cost, seconds).

    Options:
        time_limit: seconds for the whole call (building the MILP included); past it, the best schedule found and its gap
        backend: MILP backend, highs or scip
        max_nodes: refuse graphs with more nodes than this (views excepted)
    """
    import cvxpy  # noqa: F401  (seconds on a busy machine, once per process: not the solve's time)

    deadline = Deadline(time_limit)
    small, kept = contract_views(graph)
    check_size(small, "checkmate", max_nodes, "nodes that are not views")
    model, cached = cached_model(small)
    limit = budget if budget is not None else graph.fixed_mem + int(graph.mem.sum())
    with model.lock:  # one cached problem, possibly shared by the explorer's threads
        model.budget.value = max((limit - graph.fixed_mem + _HALF_BYTE) / model.mem_scale, 0.0)
        if backend not in model.canonical:
            canonicalise(model.problem, backend)
            model.canonical.add(backend)
        left = deadline.left("checkmate", "building and canonicalising its MILP")
        outcome = solve_milp(model.problem, backend=backend, time_limit=left, whole_limit=time_limit)
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
