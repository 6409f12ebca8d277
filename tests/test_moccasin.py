"""Moccasin's CP model against the exhaustive stage-model search (with and without a copy limit)."""

import math
import time

import pytest

from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import solve
from bonsai_core.solvers.views import contract_views
from tests.graphs import chain, mask_far_from_use
from tests.test_checkmate import budgets, fan_in, random_dag, stage_optimum, view_dag, weighted_chain

GRAPHS = [weighted_chain([1.0, 3.0, 2.0], [10, 30, 20]),
          weighted_chain([2.0, 1.0, 4.0, 1.0], [20, 10, 10, 30], fixed_mem=5),
          view_dag(), random_dag(1), random_dag(2)]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.name)
def test_moccasin_with_two_copies_reaches_the_two_copy_stage_model_optimum(graph):
    small, _ = contract_views(graph)  # the model's stages are the nodes that are not views
    for budget in budgets(graph, 3):
        best = stage_optimum(small, budget, copies=2)
        if math.isinf(best):
            with pytest.raises(BudgetError, match="copies"):
                solve(graph, budget, "moccasin", time_limit=30)
            continue
        schedule = solve(graph, budget, "moccasin", time_limit=30)
        assert schedule.stats["status"] == "optimal" and schedule.stats["gap"] == 0.0
        assert schedule.stats["compute_cost"] == pytest.approx(best, rel=1e-5)
        assert schedule.stats["objective"] == pytest.approx(schedule.stats["compute_cost"], rel=1e-5)
        assert schedule.stats["peak"] <= budget


def test_enough_copies_reach_checkmates_optimum_where_two_copies_cannot():
    g = chain(4)  # at 30 bytes f0 must be computed three times
    assert math.isinf(stage_optimum(g, 30, copies=2))
    with pytest.raises(BudgetError, match="copies") as refused:
        solve(g, 30, "moccasin", time_limit=30)
    assert refused.value.stats["variables"] > 0 and refused.value.stats["constraints"] > 0  # the model it built
    schedule = solve(g, 30, "moccasin", copies=3, time_limit=30)
    assert schedule.stats["compute_cost"] == pytest.approx(stage_optimum(g, 30)) and schedule.stats["peak"] <= 30


def test_an_infeasible_budget_names_the_lower_bound_and_the_no_remat_peak():
    g = fan_in()
    with pytest.raises(BudgetError, match=rf"below 110 B .* fits in {no_remat_peak(g)} B"):
        solve(g, 120, "moccasin", time_limit=30)


def test_integer_variables_grow_linearly_with_the_graph():
    small = solve(chain(5), None, "moccasin", time_limit=30).stats
    large = solve(chain(10), None, "moccasin", time_limit=30).stats
    assert large["variables"] <= 2.2 * small["variables"]
    for key in ("status", "gap", "constraints", "build_seconds", "solve_seconds"):
        assert key in small


def test_past_the_time_limit_the_best_schedule_found_comes_with_its_gap():
    g, limit = chain(18), 4.0  # CP-SAT finds schedules at once here, and needs far longer to prove one optimal
    budget = int(0.7 * no_remat_peak(g))
    start = time.perf_counter()
    schedule = solve(g, budget, "moccasin", time_limit=limit)
    assert time.perf_counter() - start < limit + 10  # the model's build counts; slack for a loaded machine
    status, gap = schedule.stats["status"], schedule.stats["gap"]
    assert (status, gap) == ("optimal", 0.0) or (status == "feasible" and 0 < gap <= 1)
    assert schedule.stats["peak"] <= budget


def test_a_time_limit_too_short_for_any_schedule_says_none_was_found():
    g, limit = chain(30), 0.05
    start = time.perf_counter()
    with pytest.raises(SolverError, match="within the time limit of 0.05 s"):
        solve(g, int(0.5 * no_remat_peak(g)), "moccasin", time_limit=limit)
    assert time.perf_counter() - start < limit + 10


@pytest.mark.parametrize("graph", [view_dag(), random_dag(1), random_dag(3)], ids=lambda g: g.name)
def test_the_model_itself_handles_views_as_stages_with_a_reservoir_per_view(graph):
    from ortools.sat.python import cp_model

    from bonsai_core.solvers.moccasin import build_model

    for budget in budgets(graph, 3):
        best = stage_optimum(graph, budget, copies=2)  # views as stages of their own
        built = build_model(graph, budget)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = 30
        status = solver.solve(built.model)
        if math.isinf(best):
            assert status == cp_model.INFEASIBLE
        else:
            assert status == cp_model.OPTIMAL
            assert graph.total_cost + solver.objective_value * built.cost_unit == pytest.approx(best, rel=1e-5)


@pytest.mark.parametrize("copies", [0, 1.5, "two"])
def test_a_bad_copies_option_is_a_clear_error(copies):
    with pytest.raises(SolverError, match="copies"):
        solve(chain(2), None, "moccasin", copies=copies)


@pytest.mark.slow
def test_a_traced_model_with_views_gets_a_valid_schedule(traced_zoo):
    g = traced_zoo["resnet"].graph
    budget = int(0.9 * no_remat_peak(g))
    schedule = solve(g, budget, "moccasin", time_limit=120)  # generous: a schedule must come back
    assert schedule.stats["peak"] <= budget and schedule.stats["status"] in ("optimal", "feasible")
    assert simulate(g, schedule).peak == schedule.stats["peak"]


def test_a_separated_output_is_recomputed_only_right_after_its_op():
    """As checkmate (test_checkmate): under 301 bytes the mask comes from a second run of the dropout."""
    g = mask_far_from_use()
    s = solve(g, 301, "moccasin", copies=2)
    sim = simulate(g, s)
    recomputed = sorted(v for v in range(g.n) if sum(1 for k, u in s.ops if k == "compute" and u == v) > 1)
    assert sim.peak <= 301 and recomputed == [0, 1, 2], (sim.peak, s.ops)
