"""A MILP given as scipy.sparse matrices, solved on HiGHS (highspy) or SCIP (PySCIPOpt) directly,
with a MIP start.

CVXPY (:mod:`bonsai_core.solvers.milp`) cannot hand a backend a starting solution of the caller's
(it only reuses its own previous solve), and an op-level MILP without one may find no incumbent in
a minute where another method finds a schedule in seconds (docs/results/checkmate_moccasin.md). Here
the model goes to the backend as whole arrays: HiGHS takes the column-wise matrix in one call; SCIP
reads the MPS file that HiGHS writes of it (PySCIPOpt has no sparse-matrix input). The start goes in
as HiGHS' ``setSolution`` or SCIP's ``createSol``/``addSol``. A model built in CVXPY (bonsai's) comes
here through :func:`from_cvxpy`: CVXPY's own canonical matrices, with each variable's columns, so the
caller can give its start per variable and read the solution back the same way.

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
import scipy.sparse as sp

from bonsai_core.errors import SolverError
from bonsai_core.solvers.deadline import backend_seconds
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


@dataclass(frozen=True)
class CanonicalMilp:
    """A CVXPY MILP as CVXPY canonicalises it for HiGHS (at its parameters' current values): the
    sparse model, and the first column of each CVXPY variable (a variable's entries are consecutive
    columns, in column-major order)."""

    milp: SparseMilp
    offsets: dict[int, int]  # CVXPY variable id -> its first column

    def vector(self, values: dict[Any, np.ndarray]) -> np.ndarray:
        """The column vector holding ``values`` (CVXPY variable -> its values); every column must be given."""
        x = np.full(len(self.milp.cost), np.nan)
        for variable, value in values.items():
            if variable.size == 0:  # CVXPY drops empty variables from the canonical form
                continue
            first = self.offsets[variable.id]
            x[first:first + variable.size] = np.asarray(value, dtype=np.float64).ravel(order="F")
        if np.isnan(x).any():
            raise ValueError("a start must give every column of the canonical MILP")
        return x

    def value_of(self, x: np.ndarray, variable: Any) -> np.ndarray:
        """``variable``'s entries in the column vector ``x``, in its shape."""
        if variable.size == 0:
            return np.zeros(variable.shape)
        first = self.offsets[variable.id]
        return np.asarray(x[first:first + variable.size]).reshape(variable.shape, order="F")


def from_cvxpy(problem: Any) -> CanonicalMilp:
    """``problem`` (a CVXPY problem with a linear objective, linear constraints and boolean or integer
    variables) as a :class:`SparseMilp`, so that a backend can take a MIP start (which CVXPY cannot
    hand it). CVXPY's conic form ``A x + s = b`` puts the equalities (``s`` in the zero cone) first and
    the inequalities (``s >= 0``: ``A x <= b``) after them. The objective's constant, if any, is left out."""
    import cvxpy as cp

    data, _, inverse = problem.get_problem_data(cp.HIGHS)
    dims = data["dims"]
    if dims.exp or dims.soc or dims.psd or dims.p3d:
        raise SolverError("The problem is not a MILP: CVXPY canonicalised it with non-linear cones.")
    matrix, b, columns = data["A"], np.asarray(data["b"], dtype=np.float64), data["A"].shape[1]
    integer = np.zeros(columns, dtype=bool)
    integer[list(data["bool_vars_idx"]) + list(data["int_vars_idx"])] = True
    col_lower = np.full(columns, -np.inf) if data.get("lower_bounds") is None else np.asarray(data["lower_bounds"], dtype=np.float64)
    col_upper = np.full(columns, np.inf) if data.get("upper_bounds") is None else np.asarray(data["upper_bounds"], dtype=np.float64)
    booleans = list(data["bool_vars_idx"])
    col_lower[booleans] = np.maximum(col_lower[booleans], 0.0)
    col_upper[booleans] = np.minimum(col_upper[booleans], 1.0)
    row_lower = np.concatenate((b[:dims.zero], np.full(len(b) - dims.zero, -np.inf)))
    offsets = next(step.var_offsets for step in inverse if hasattr(step, "var_offsets"))
    milp = SparseMilp(cost=np.asarray(data["c"], dtype=np.float64), matrix=sp.csc_matrix(matrix), row_lower=row_lower,
                      row_upper=b, col_lower=col_lower, col_upper=col_upper, integer=integer)
    return CanonicalMilp(milp, dict(offsets))


def satisfies(milp: SparseMilp, x: np.ndarray, tolerance: float = 1e-6) -> bool:
    """Whether ``x`` meets every row, bound and integrality of ``milp`` within ``tolerance`` (absolute,
    scaled by the row's magnitude): a start a backend will accept."""
    rows = milp.matrix @ x
    scale = tolerance * np.maximum(1.0, np.abs(rows))
    whole = np.abs(x[milp.integer] - np.round(x[milp.integer])) <= tolerance
    return bool(np.all(rows >= milp.row_lower - scale) and np.all(rows <= milp.row_upper + scale)
                and np.all(x >= milp.col_lower - tolerance) and np.all(x <= milp.col_upper + tolerance)
                and whole.all())


def relative_gap(incumbent: float, bound: float) -> float:
    """(incumbent - bound) / |incumbent|, HiGHS' definition, within [0, 1] for a nonnegative
    objective (whose bound is then at least 0); 0 when both are 0."""
    bound = max(bound, 0.0) if math.isfinite(bound) else 0.0
    if incumbent <= bound:
        return 0.0
    return min((incumbent - bound) / abs(incumbent), 1.0)


def proven_within(incumbent: float, bound: float, gap: float, abs_gap: float = 0.0) -> bool:
    """Whether ``incumbent`` is proven within the relative ``gap`` or the absolute ``abs_gap`` of the lower
    bound ``bound`` (objective units): where a backend given both stops."""
    if relative_gap(incumbent, bound) <= gap:
        return True
    return math.isfinite(bound) and incumbent - max(bound, 0.0) <= abs_gap


def solve_sparse_milp(milp: SparseMilp, backend: str, start: np.ndarray | None = None,
                      time_limit: float | None = None, whole_limit: float | None = None,
                      gap: float = OPTIMAL_GAP, abs_gap: float = 0.0) -> SparseOutcome:
    """Solve ``milp`` on ``backend`` ("highs" or "scip") from the MIP start ``start`` (a feasible value
    per column, or None), within ``time_limit`` seconds (what is left of the method's
    ``whole_limit``, the one named in messages; none left: the start is the result), stopping at the
    relative ``gap`` or, when ``abs_gap`` is positive, at that absolute gap (objective units), whichever comes
    first. The objective is assumed nonnegative (a recomputation cost), so the gap is within [0, 1].

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
        status, values, objective, bound = solve(milp, start, time_limit, gap, abs_gap)
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
                    gap: float, abs_gap: float) -> tuple[str, np.ndarray | None, float | None, float]:
    """(status, incumbent or None, its objective, proven lower bound) from HiGHS."""
    import highspy

    h = _highs_model(milp)
    h.setOptionValue("mip_rel_gap", float(gap))
    if abs_gap > 0:  # HiGHS' own default (1e-6) otherwise
        h.setOptionValue("mip_abs_gap", float(abs_gap))
    if time_limit is not None:
        h.setOptionValue("time_limit", max(float(backend_seconds(time_limit)), 0.0))
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
                   gap: float, abs_gap: float) -> tuple[str, np.ndarray | None, float | None, float]:
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
    model.setParam("limits/absgap", float(abs_gap))
    if time_limit is not None:
        model.setParam("limits/time", max(float(backend_seconds(time_limit)), 0.0))
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
