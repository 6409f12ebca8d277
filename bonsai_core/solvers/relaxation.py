"""A MILP's plan proven within the gap from its LP relaxation, without branch and bound.

Bonsai's segment ILP is nearly integral: on torchtitan's Llama 3 8B step its LP relaxation leaves a
handful of fractional columns out of ~15,000 and its bound is within a fraction of a percent of the
optimum, while HiGHS spends seconds in its root heuristics before it has an incumbent. So a solve
first (1) re-solves the LP relaxation, kept per built model: a budget moves only the memory rows'
upper bounds, so HiGHS re-solves it from the last basis in a few dual simplex iterations; then (2)
fixes every integer column the LP left whole to its value and solves the small MILP left over (RENS,
relaxation enforced neighbourhood search). The LP's objective is a lower bound of the MILP's optimum,
so the plan found is within ``(incumbent - LP bound) / incumbent`` of it, and within ``incumbent - LP bound``
in the objective's units. When neither is within the gap asked for (the relative one, or the absolute one
when set: on a tiny overhead 1% of it is a distance no user sees), (3) the MILP restricted to the columns
the LP or the last few plans found (the neighbouring budgets' in a sweep) set is solved; still over, (4) the
full MILP is solved from that plan as its MIP start (:func:`solve_from`: HiGHS then skips the seconds its
root heuristics take to find an incumbent; on the 8B step at 94% and 98% of the no-remat peak 1.2 s and
0.9 s instead of 6.3 s and 6.5 s, the same optimum). Every plan a backend answers is checked against the
MILP's rows and bounds, its cost recomputed from its values; an answer that fails the check leaves the full
MILP to the caller, from scratch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bonsai_core.errors import SolverError
from bonsai_core.solvers.deadline import backend_seconds, now
from bonsai_core.solvers.milp import MilpOutcome
from bonsai_core.solvers.sparse_milp import (SparseMilp, _highs_model, proven_within, relative_gap, satisfies,
                                             solve_sparse_milp)

WHOLE = 1e-6  # an LP value this close to an integer counts as whole
PLANS_KEPT = 4  # plans of earlier solves whose columns widen the next rounding's neighbourhood


@dataclass
class Relaxation:
    """The LP relaxation of one MILP on HiGHS, kept between solves whose models differ only in row bounds."""

    highs: Any
    matrix_data: np.ndarray  # the constraint matrix's values it was built from (a changed matrix: build anew)
    row_lower: np.ndarray
    row_upper: np.ndarray
    plans: list = dataclasses.field(default_factory=list)  # the last few plans found (values), newest first


def relaxation_of(milp: SparseMilp) -> Relaxation:
    lp = dataclasses.replace(milp, integer=np.zeros_like(milp.integer))
    return Relaxation(_highs_model(lp), milp.matrix.data.copy(), milp.row_lower.copy(), milp.row_upper.copy())


def same_structure(relaxation: Relaxation, milp: SparseMilp) -> bool:
    """Whether ``milp`` differs from the relaxation's model in its row bounds at most."""
    data = milp.matrix.data
    return data.shape == relaxation.matrix_data.shape and np.array_equal(data, relaxation.matrix_data) \
        and len(milp.row_upper) == len(relaxation.row_upper)


def solve_relaxation(relaxation: Relaxation, milp: SparseMilp,
                     time_limit: float | None) -> tuple[np.ndarray, float] | None:
    """(values, objective) of ``milp``'s LP relaxation, from the relaxation's last basis; None when it is
    infeasible or not solved within ``time_limit``."""
    import highspy

    h = relaxation.highs
    moved = np.flatnonzero((milp.row_upper != relaxation.row_upper) | (milp.row_lower != relaxation.row_lower))
    if moved.size:
        inf = h.getInfinity()
        h.changeRowsBounds(int(moved.size), moved.astype(np.int32),
                           np.clip(milp.row_lower[moved], -inf, inf), np.clip(milp.row_upper[moved], -inf, inf))
        relaxation.row_lower, relaxation.row_upper = milp.row_lower.copy(), milp.row_upper.copy()
    h.setOptionValue("time_limit", max(float(backend_seconds(time_limit)), 0.0) if time_limit is not None else math.inf)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return np.asarray(h.getSolution().col_value, dtype=np.float64), float(h.getInfo().objective_function_value)


def proven_infeasible(relaxation: Relaxation, milp: SparseMilp, time_limit: float | None) -> bool:
    """Whether the relaxation's last solve found ``milp``'s LP relaxation infeasible and a second, independent
    solve agrees: the LP built afresh and solved without presolve by the interior point method (the relaxation's
    own solve is the dual simplex from the last budget's basis, after presolve; on the 8B step at 23% of the
    no-remat peak about 1 s, where the primal simplex takes over 20 s). The MILP, whose solutions the LP's
    include, then has none. One verdict alone is not trusted: HiGHS has called a feasible LP infeasible (issue
    56's bound). (HiGHS's dual ray proves nothing here: the model's free columns leave its product with the
    rows nonzero by rounding.)"""
    import highspy

    if relaxation.highs.getModelStatus() != highspy.HighsModelStatus.kInfeasible:
        return False
    h = _highs_model(dataclasses.replace(milp, integer=np.zeros_like(milp.integer)))
    h.setOptionValue("presolve", "off")
    h.setOptionValue("solver", "ipm")
    h.setOptionValue("time_limit", max(float(backend_seconds(time_limit)), 0.0) if time_limit is not None else math.inf)
    h.run()
    return h.getModelStatus() == highspy.HighsModelStatus.kInfeasible


def _checked(milp: SparseMilp, found: Any) -> tuple[np.ndarray, float] | None:
    """(values, objective) of a backend's answer when the values meet every row and bound of ``milp``, its
    objective recomputed from them (HiGHS handed a start has been seen to answer a point that is not a
    solution); None otherwise."""
    if found.values is None or not satisfies(milp, found.values):
        return None
    values = np.where(milp.integer, np.round(found.values), found.values)
    return values, float(milp.cost @ values)


def _among_neighbours(milp: SparseMilp, relaxation: Relaxation, x: np.ndarray, rounded: tuple[np.ndarray, float],
                      time_limit: float | None, gap: float, abs_gap: float) -> tuple[np.ndarray, float]:
    """A plan at least as cheap as ``rounded`` from the MILP restricted to the integer columns that the LP
    (``x``) or one of the last plans (at nearby budgets, in a sweep) sets: a neighbourhood a few times the
    rounding's. ``rounded`` when it finds none better in ``time_limit``."""
    used = np.abs(x) > WHOLE
    for plan in relaxation.plans:
        used |= np.abs(plan) > WHOLE
    upper = milp.col_upper.copy()
    upper[milp.integer & ~used & (milp.col_lower == 0)] = 0.0
    try:
        found = _checked(milp, solve_sparse_milp(dataclasses.replace(milp, col_upper=upper), "highs",
                                                 time_limit=time_limit, gap=gap, abs_gap=abs_gap))
    except SolverError:
        return rounded
    return found if found is not None and found[1] < rounded[1] else rounded


def round_relaxation(milp: SparseMilp, relaxation: Relaxation, time_limit: float | None, gap: float,
                     offset: float = 0.0, abs_gap: float = 0.0) -> tuple[MilpOutcome, np.ndarray, float] | None:
    """(outcome, values, the LP bound) of the rounding's plan of ``milp`` (module docstring), its gap the one
    the LP bound proves (within ``gap`` or ``abs_gap`` or not); None when it finds no plan within ``time_limit``.
    ``offset``: the objective's constant, which the sparse form leaves out; gaps and objectives here count it."""
    start, begun = time.perf_counter(), now()
    solved = solve_relaxation(relaxation, milp, time_limit)
    if solved is None:
        return None
    x, bound = solved
    bound += offset
    whole = milp.integer & (np.abs(x - np.round(x)) <= WHOLE)
    lower, upper = milp.col_lower.copy(), milp.col_upper.copy()
    lower[whole] = upper[whole] = np.round(x[whole])
    left = None if time_limit is None else time_limit - (now() - begun)
    if left is not None and left <= 0:
        return None
    try:
        found = _checked(milp, solve_sparse_milp(dataclasses.replace(milp, col_lower=lower, col_upper=upper), "highs",
                                                 time_limit=left, gap=gap, abs_gap=abs_gap))
    except SolverError:  # no incumbent in the time left
        return None
    if found is None:
        return None
    left = None if time_limit is None else time_limit - (now() - begun)
    if not proven_within(found[1] + offset, bound, gap, abs_gap) and relaxation.plans and (left is None or left > 0):
        found = _among_neighbours(milp, relaxation, x, found, left, gap, abs_gap)
    proven = relative_gap(found[1] + offset, bound)
    relaxation.plans = [found[0], *relaxation.plans][:PLANS_KEPT]
    status, shown = ("optimal", 0.0) if proven <= 1e-4 else ("feasible", proven)
    outcome = MilpOutcome(status, found[1] + offset, shown, time.perf_counter() - start,
                          len(milp.cost), milp.matrix.shape[0])
    return outcome, found[0], bound


def solve_from(milp: SparseMilp, relaxation: Relaxation, start: np.ndarray, lp_bound: float, time_limit: float | None,
               gap: float, offset: float = 0.0, abs_gap: float = 0.0) -> tuple[MilpOutcome, np.ndarray] | None:
    """(outcome, values) of the full ``milp`` solved from the plan ``start`` (the rounding's, which meets every
    row and bound), its gap proven by the larger of the LP bound ``lp_bound`` and the backend's; past
    ``time_limit``, the best plan by then (never worse than ``start``) with its gap. None when the backend's
    answer fails the check (:func:`_checked`), or is not proven within ``gap`` (or ``abs_gap``) though time was
    left (HiGHS handed a start has been seen to stop at once, "optimal" at objective 0, on test_bonsai's viewed2).
    ``offset``: as in :func:`round_relaxation`."""
    clock, begun, given = time.perf_counter(), now(), backend_seconds(time_limit)  # given: the backend's own limit
    try:
        found = solve_sparse_milp(milp, "highs", start, time_limit=time_limit, gap=gap, abs_gap=abs_gap)
    except SolverError:
        return None
    checked = _checked(milp, found)
    if checked is None:
        return None
    values, objective = checked
    # the backend's bound counts only when the objective it claims is the plan's
    claimed = found.outcome.objective is not None and math.isclose(found.outcome.objective, objective,
                                                                   rel_tol=1e-9, abs_tol=1e-12)
    bound = max(lp_bound, found.bound + offset) if claimed else lp_bound
    proven = relative_gap(objective + offset, bound)
    out_of_time = time_limit is not None and (now() - begun >= time_limit or time.perf_counter() - clock >= given)
    if not proven_within(objective + offset, bound, gap, abs_gap) and not out_of_time:
        return None
    relaxation.plans = [values, *relaxation.plans[1:]] if relaxation.plans else [values]
    status, shown = ("optimal", 0.0) if proven <= 1e-4 else ("feasible", proven)
    return MilpOutcome(status, objective + offset, shown, time.perf_counter() - clock, len(milp.cost),
                       milp.matrix.shape[0]), values
