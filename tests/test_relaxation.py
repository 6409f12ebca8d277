"""Bonsai's ILP answered from its LP relaxation's rounding (bonsai_core/solvers/relaxation.py): the plan's
gap is the one the LP bound proves, measured here against the proven optimum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bonsai_core.graph import load_graph
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import bonsai
from bonsai_core.solvers.milp import solve_milp
from bonsai_core.solvers import relaxation
from bonsai_core.solvers.milp import MilpOutcome
from bonsai_core.solvers.relaxation import relaxation_of, round_relaxation, solve_from
from bonsai_core.solvers.sparse_milp import SparseOutcome, from_cvxpy, relative_gap, satisfies

GPT = Path(__file__).resolve().parent.parent / "assets" / "gpt-default.json"


@pytest.mark.parametrize("share", [0.7, 0.8, 0.9])
def test_the_rounded_plan_is_feasible_and_its_proven_gap_holds_against_the_optimum(share):
    """(Below 70% of its peak the default GPT's rounding finds no plan: fixing the LP's whole columns leaves
    no feasible completion, and the solve runs the MILP; None is then the answer.)"""
    graph = load_graph(GPT)
    built = bonsai.build(graph)
    built.budget.value = int(share * no_remat_peak(graph)) / built.unit
    milp = from_cvxpy(built.problem).milp
    found = round_relaxation(milp, relaxation_of(milp), time_limit=None, gap=0.01)
    assert found is not None
    outcome, values, bound = found
    assert satisfies(milp, values)
    optimum = solve_milp(built.problem, gap=1e-6).objective
    assert bound <= optimum + 1e-9  # the LP's objective bounds the MILP's optimum from below
    assert outcome.objective >= optimum - 1e-9
    assert relative_gap(outcome.objective, optimum) <= (outcome.gap or 0.0) + 1e-9


def test_the_relaxation_moves_with_the_budget_from_its_last_basis():
    """One relaxation re-solved at a lower budget gives what a fresh one gives there."""
    graph = load_graph(GPT)
    built = bonsai.build(graph)
    reference = no_remat_peak(graph)
    built.budget.value = int(0.9 * reference) / built.unit
    kept = relaxation_of(from_cvxpy(built.problem).milp)
    round_relaxation(from_cvxpy(built.problem).milp, kept, None, 0.01)
    built.budget.value = int(0.7 * reference) / built.unit
    milp = from_cvxpy(built.problem).milp
    moved, fresh = round_relaxation(milp, kept, None, 0.01), round_relaxation(milp, relaxation_of(milp), None, 0.01)
    assert moved[2] == pytest.approx(fresh[2], rel=1e-7)


@pytest.mark.parametrize("share", [0.6, 0.8])
def test_an_absolute_gap_stops_the_search_within_it_of_the_optimum(share):
    """With the relative gap out of reach (1e-9), the absolute one ends the search: the plan costs at most
    ``abs_gap`` (shares of the step's compute, the objective's unit) more than the proven optimum."""
    graph = load_graph(GPT)
    budget = int(share * no_remat_peak(graph))
    abs_gap = 2e-3
    schedule = bonsai.solve_bonsai(graph, budget, space="regions", reuse=False, gap=1e-9, abs_gap=abs_gap)
    built = bonsai.build(graph, schedule.stats["granularity"])
    built.budget.value = budget / built.unit
    optimum = solve_milp(built.problem, gap=1e-9).objective
    assert schedule.stats["plan_source"] == "ilp"
    assert optimum - 1e-9 <= schedule.stats["objective"] <= optimum + abs_gap + 1e-9
    assert bonsai._reusable(schedule, bonsai.Gaps(1e-9, abs_gap))  # its interval of budgets answered by it


def test_a_bonsai_solve_says_its_gap_and_stays_within_the_gap_asked():
    graph = load_graph(GPT)
    schedule = bonsai.solve_bonsai(graph, int(0.55 * no_remat_peak(graph)), space="regions", reuse=False)
    assert schedule.stats["gap"] is not None and schedule.stats["gap"] <= bonsai.DEFAULT_GAP
    assert np.isfinite(schedule.stats["objective"])


def _milp_at(share: float):
    """The GPT's segment MILP at ``share`` of its no-remat peak: (the cvxpy build, the MILP, its relaxation)."""
    graph = load_graph(GPT)
    built = bonsai.build(graph)
    built.budget.value = int(share * no_remat_peak(graph)) / built.unit
    milp = from_cvxpy(built.problem).milp
    return built, milp, relaxation_of(milp)


def _rounded_at(share: float):
    built, milp, kept = _milp_at(share)
    outcome, values, bound = round_relaxation(milp, kept, None, 1e-9)
    assert relative_gap(outcome.objective, bound) > 1e-6  # the rounding alone proves no optimum here
    return built, milp, kept, values, bound


def test_the_full_milp_from_the_rounding_reaches_the_optimum():
    built, milp, kept, values, bound = _rounded_at(0.7)
    outcome, found = solve_from(milp, kept, values, bound, None, gap=1e-6)
    assert satisfies(milp, found) and outcome.objective == pytest.approx(float(milp.cost @ found))
    assert outcome.objective <= float(milp.cost @ values) + 1e-12  # never worse than its start
    assert outcome.objective == pytest.approx(solve_milp(built.problem, gap=1e-6).objective, rel=1e-5)


def test_a_backend_answer_it_cannot_account_for_is_no_proof(monkeypatch):
    """The backend claims objective 0, optimal, for the start it hands back (as HiGHS given a start did on
    test_bonsai's viewed2), with a bound that would prove the start optimal: that bound is not trusted,
    and with time left the answer is refused."""
    built, milp, kept, values, bound = _rounded_at(0.7)
    monkeypatch.setattr(relaxation, "solve_sparse_milp", lambda milp, backend, start, **kw: SparseOutcome(
        MilpOutcome("optimal", 0.0, 0.0, 0.0, len(milp.cost), milp.matrix.shape[0]), start, float(milp.cost @ start),
        "claimed"))
    assert solve_from(milp, kept, values, bound, None, gap=1e-6) is None


def _relaxed_at(share: float):
    built, milp, kept = _milp_at(share)
    return built, milp, kept, round_relaxation(milp, kept, None, 0.01)


def test_an_infeasible_relaxation_is_proven_twice_and_the_milp_agrees():
    built, milp, kept, found = _relaxed_at(0.05)
    assert found is None and relaxation.proven_infeasible(kept, milp, None)
    assert solve_milp(built.problem).status == "infeasible"  # what the from-scratch MILP it saves would say


def test_a_feasible_relaxation_is_never_proven_infeasible():
    _, milp, kept, found = _relaxed_at(0.7)
    assert found is not None and not relaxation.proven_infeasible(kept, milp, None)


def test_one_infeasible_verdict_on_a_feasible_lp_proves_nothing():
    """HiGHS has called a feasible LP infeasible (issue 56's bound): the second solve overrules it."""
    import highspy

    _, milp, kept, _ = _relaxed_at(0.7)

    class Wrong:
        def getModelStatus(self):
            return highspy.HighsModelStatus.kInfeasible

    kept.highs = Wrong()
    assert not relaxation.proven_infeasible(kept, milp, None)


def test_a_proven_infeasible_relaxation_ends_the_rung_at_once():
    built, _, _, _ = _relaxed_at(0.05)
    outcome = bonsai._rounded(built, "highs", None, bonsai.Gaps(0.01))
    assert outcome is not None and outcome.status == "infeasible"
