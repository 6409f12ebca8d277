"""A MILP given as scipy.sparse matrices, solved on HiGHS (highspy) or SCIP (PySCIPOpt) directly,
with a MIP start.

CVXPY (:mod:`bonsai_core.solvers.milp`) cannot hand a backend a starting solution of the caller's
(it only reuses its own previous solve), and an op-level MILP without one may find no incumbent in
minutes where another method finds a schedule in a second (docs/results/checkmate_moccasin.md). Here
the model goes to the backend as whole arrays: HiGHS takes the column-wise matrix in one call; SCIP
reads the MPS file that HiGHS writes of it (PySCIPOpt has no sparse-matrix input). The start goes in
as HiGHS' ``setSolution`` or SCIP's ``createSol``/``addSol``.

:func:`solve_sparse_milp` reports like :func:`~bonsai_core.solvers.milp.solve_milp`: a
:class:`~bonsai_core.solvers.milp.MilpOutcome` (``optimal``, ``feasible`` with its gap, or
``infeasible``), the incumbent's values, and the backend's proven lower bound; SolverError when it
ends with no solution at all.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bonsai_core.errors import SolverError
from bonsai_core.solvers.milp import MilpOutcome, _limit_words, _swallow_highs_banner, check_backend

# The relative gap at which both backends stop and call the incumbent optimal (as solve_milp does).
OPTIMAL_GAP = 1e-4


@dataclass(frozen=True)
class SparseMilp:
    """minimise ``cost @ z`` subject to ``row_lower <= matrix @ z <= row_upper``,
    ``col_lower <= z <= col_upper``, and ``z[j]`` whole where ``integer[j]``. Infinite bounds are
    ``±np.inf``."""

    cost: np.ndarray
    matrix: Any  # scipy.sparse, rows x columns
    row_lower: np.ndarray
    row_upper: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    integer: np.ndarray  # bool per column


@dataclass(frozen=True)
class SparseOutcome:
    """What a backend ended with: the outcome, the incumbent (None when infeasible), the proven lower
    bound of the objective (``-inf`` when the backend proved none), and what became of the start
    (None when there was none)."""

    outcome: MilpOutcome
    values: np.ndarray | None
    bound: float
    start_note: str | None = None


def relative_gap(incumbent: float, bound: float) -> float:
    """(incumbent - bound) / |incumbent|, HiGHS' definition, within [0, 1] for a nonnegative
    objective (whose bound is then at least 0); 0 when both are 0."""
    bound = max(bound, 0.0) if math.isfinite(bound) else 0.0
    if incumbent <= bound:
        return 0.0
    return min((incumbent - bound) / abs(incumbent), 1.0)


def solve_sparse_milp(milp: SparseMilp, backend: str, start: np.ndarray | None = None,
                      time_limit: float | None = None, whole_limit: float | None = None,
                      gap: float = OPTIMAL_GAP) -> SparseOutcome:
    """Solve ``milp`` on ``backend`` ("highs" or "scip") from the MIP start ``start`` (a feasible value
    per column, or None), within ``time_limit`` seconds (what is left of the method's
    ``whole_limit``, the one named in messages; none left: the start is the result), stopping at the
    relative ``gap``. The objective is assumed nonnegative (a recomputation cost), so the gap is
    within [0, 1].

    The result is never worse than the start: when the backend ends with no incumbent or a worse
    one (it did not take the start), the start is the result, its gap taken from the backend's bound,
    and ``start_note`` says so. SolverError when there is no start and no solution."""
    check_backend(backend)
    variables, constraints = len(milp.cost), milp.matrix.shape[0]
    clock = time.perf_counter()
    if start is not None and time_limit is not None and time_limit <= 0:
        status, values, objective, bound = "no time left", None, None, -math.inf
    else:
        solve = _solve_on_highs if backend == "highs" else _solve_on_scip
        status, values, objective, bound = solve(milp, start, time_limit, gap)
    seconds = time.perf_counter() - clock
    if status == "infeasible" and start is None:
        return SparseOutcome(MilpOutcome("infeasible", None, None, seconds, variables, constraints), None, bound)
    note = None
    if start is not None:
        start_objective = float(milp.cost @ start)
        slack = 1e-9 * max(1.0, abs(start_objective))
        if values is None or objective > start_objective + slack:
            ended = "no incumbent" if values is None else "a worse incumbent"
            note = f"{backend} ended ({status}) with {ended}, so the start is the result"
            values, objective = np.asarray(start, dtype=np.float64), start_objective
        else:
            note = f"{backend} {'improved on it' if objective < start_objective - slack else 'found nothing better'}"
    if values is None:
        raise SolverError(f"The {backend} backend stopped with status {status!r} and no solution"
                          f"{_limit_words(time_limit, whole_limit)}. Raise --time-limit or the budget, or try "
                          "the other backend.")
    found_gap = relative_gap(objective, bound)
    kind = "optimal" if found_gap <= gap else "feasible"
    outcome = MilpOutcome(kind, objective, 0.0 if kind == "optimal" else found_gap, seconds, variables, constraints)
    return SparseOutcome(outcome, values, bound, note)


def _highs_model(milp: SparseMilp) -> Any:
    """A highspy.Highs holding ``milp``, passed as whole arrays (the column-wise matrix in one call)."""
    import highspy

    _swallow_highs_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    csc = milp.matrix.tocsc()
    csc.sort_indices()
    integrality = np.where(milp.integer, 1, 0).astype(np.int32)  # HighsVarType: kContinuous 0, kInteger 1
    h.passModel(int(csc.shape[1]), int(csc.shape[0]), int(csc.nnz), 1, 1, 0.0,  # column-wise, minimise
                np.asarray(milp.cost, dtype=np.float64), _finite(milp.col_lower, h), _finite(milp.col_upper, h),
                _finite(milp.row_lower, h), _finite(milp.row_upper, h),
                csc.indptr[:-1].astype(np.int32), csc.indices.astype(np.int32), csc.data.astype(np.float64),
                integrality)
    return h


def _finite(bounds: np.ndarray, h: Any) -> np.ndarray:
    """Bounds with ±inf as HiGHS' infinity."""
    return np.clip(np.asarray(bounds, dtype=np.float64), -h.getInfinity(), h.getInfinity())


def _solve_on_highs(milp: SparseMilp, start: np.ndarray | None, time_limit: float | None,
                    gap: float) -> tuple[str, np.ndarray | None, float | None, float]:
    """(status, incumbent or None, its objective, proven lower bound) from HiGHS."""
    import highspy

    h = _highs_model(milp)
    h.setOptionValue("mip_rel_gap", float(gap))
    if time_limit is not None:
        h.setOptionValue("time_limit", max(float(time_limit), 0.0))
    if start is not None:
        h.setSolution(len(start), np.arange(len(start), dtype=np.int32), np.asarray(start, dtype=np.float64))
    h.run()
    status, info = h.getModelStatus(), h.getInfo()
    bound = float(info.mip_dual_bound) if math.isfinite(info.mip_dual_bound) else -math.inf
    if status == highspy.HighsModelStatus.kInfeasible:
        return "infeasible", None, None, bound
    if int(info.primal_solution_status) != 2:  # 2: a feasible solution (HiGHS' kSolutionStatusFeasible)
        return h.modelStatusToString(status), None, None, bound
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)
    return h.modelStatusToString(status), values, float(info.objective_function_value), bound


def _solve_on_scip(milp: SparseMilp, start: np.ndarray | None, time_limit: float | None,
                   gap: float) -> tuple[str, np.ndarray | None, float | None, float]:
    """(status, incumbent or None, its objective, proven lower bound) from SCIP, which reads the
    model from the MPS file HiGHS writes of it (columns named c0, c1, ... in order)."""
    import pyscipopt

    h = _highs_model(milp)
    names = [f"c{j}" for j in range(len(milp.cost))]  # HiGHS' names for unnamed columns
    model = pyscipopt.Model()
    model.hideOutput()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.mps")
        h.writeModel(path)
        model.readProblem(path)
    by_name = {v.name: v for v in model.getVars()}
    columns = [by_name[name] for name in names]
    model.setParam("limits/gap", float(gap))
    if time_limit is not None:
        model.setParam("limits/time", max(float(time_limit), 0.0))
    if start is not None:
        solution = model.createSol()
        for j in np.flatnonzero(start).tolist():
            model.setSolVal(solution, columns[j], float(start[j]))
        model.addSol(solution)
    model.optimize()
    status = model.getStatus()
    bound = float(model.getDualbound())
    bound = bound if math.isfinite(bound) and abs(bound) < model.infinity() else -math.inf
    if status == "infeasible":
        return "infeasible", None, None, bound
    if model.getNSols() == 0:
        return status, None, None, bound
    best = model.getBestSol()
    values = np.array([model.getSolVal(best, v) for v in columns], dtype=np.float64)
    return status, values, float(model.getSolObjVal(best)), bound
