"""Checkmate warm-started: another method's schedule as the MILP's first incumbent."""

import math

import numpy as np
import pytest

from bonsai_core.errors import BudgetError
from bonsai_core.schedule import no_remat_peak, schedule_ops, simulate
from bonsai_core import solvers
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule
from bonsai_core.solvers import checkmate, checkmate_start, solve, sparse_milp
from bonsai_core.solvers.checkmate_model import build_matrices, recomputed_from_r
from bonsai_core.solvers.sparse_rows import tri_offset
from bonsai_core.solvers.stages import stage_sequence
from bonsai_core.solvers.views import contract_views
from tests.graphs import chain, mask_far_from_use
from tests.test_checkmate import GRAPHS, budgets, stage_optimum, view_dag


def _convert(graph, budget, schedule):
    """(x, u, matrices, kept) of ``schedule`` as a start of graph's MILP under ``budget``."""
    small, kept = contract_views(graph)
    m = build_matrices(small)
    x, u = checkmate_start.convert_schedule(graph, small, kept, m, schedule, m.budget_units(budget, graph.fixed_mem))
    return x, u, m, kept


@pytest.mark.parametrize("graph", GRAPHS + [mask_far_from_use(), chain(8)], ids=lambda g: g.name)
def test_a_converted_start_reads_back_as_the_schedule_it_came_from(graph):
    """moccasin's and the plain schedule are stage-model schedules: converted to R, S, FREE and U and
    read back from R as checkmate reads any solution, they keep their compute cost and peak, and the
    model's objective is their cost."""
    checked = 0
    for budget in budgets(graph):
        for method in ("moccasin", "none"):
            try:
                start = solve(graph, budget, method, time_limit=20)
            except BudgetError:
                continue
            x, u, m, kept = _convert(graph, budget, start)
            assert u.max(initial=0.0) <= m.budget_units(budget, graph.fixed_mem)
            back = simulate(graph, checkmate.schedule_from_r(graph, kept, x[: m.q]))
            assert back.compute_cost == pytest.approx(start.stats["compute_cost"], rel=1e-9)
            assert back.peak == start.stats["peak"]
            assert (m.objective @ x + m.base_cost) * m.cost_scale == pytest.approx(back.compute_cost, rel=1e-9)
            checked += 1
    assert checked >= 2  # at least the no-remat peak, where both fit


def _tightest_moccasin(graph):
    """(budget, moccasin's schedule) at the lowest of :func:`budgets` where moccasin finds one."""
    for budget in budgets(graph):
        try:
            return budget, solve(graph, budget, "moccasin", time_limit=20)
        except BudgetError:
            continue
    raise AssertionError("moccasin meets no budget")


@pytest.mark.parametrize("graph", GRAPHS + [mask_far_from_use(fixed_mem=5), chain(8)], ids=lambda g: g.name)
def test_the_model_memory_of_a_start_is_the_simulated_memory(graph):
    """U[t, k] of a converted start is the simulator's memory when node k is computed in stage t
    (fixed_mem aside), at every computation: no free is lost in the conversion, which would push U
    over a budget the schedule meets."""
    budget, start = _tightest_moccasin(graph)
    small, kept = contract_views(graph)
    x, u, m, _ = _convert(graph, budget, start)
    recomputes = recomputed_from_r(small.n, x[: m.q])
    ops = schedule_ops(small, stage_sequence(recomputes))
    timeline = simulate(small, ops).timeline
    computes = [i for i, (kind, _) in enumerate(ops) if kind == "compute"]
    stage_of = [t for t, again in enumerate(recomputes) for _ in range(len(again) + 1)]
    node = [v for kind, v in ops if kind == "compute"]
    memory = u[tri_offset(np.array(stage_of), np.array(node))] * m.mem_scale + graph.fixed_mem
    assert memory == pytest.approx(timeline[computes], abs=1e-6)


def test_a_start_that_breaks_a_row_is_refused_naming_it():
    g = view_dag()
    budget = budgets(g)[1]
    x, u, m, _ = _convert(g, budget, solve(g, budget, "moccasin", time_limit=20))
    assert checkmate_start.broken_rows(m, x, u, m.budget_units(budget, g.fixed_mem)) is None
    bad = x.copy()
    bad[m.s_col(np.array([1]), np.array([0]))] = 0.0  # node 0 not resident when stage 1 reads it
    assert "inputs resident" in checkmate_start.broken_rows(m, bad, checkmate_start.start_memory(m, bad), 1e9)
    assert "over the budget" in checkmate_start.broken_rows(m, x, u, u.max() - 1.0)


def test_a_schedule_outside_the_stage_model_is_not_a_start():
    with pytest.raises(checkmate_start.NotConvertible, match="node 2 before node 1"):
        checkmate_start.stage_recomputes([0, 2, 1], 3)
    with pytest.raises(checkmate_start.NotConvertible, match="node 0 twice before node 2"):
        checkmate_start.stage_recomputes([0, 1, 0, 0, 2], 3)
    assert checkmate_start.stage_recomputes([0, 1, 0, 2, 1, 0, 3], 4) == [[], [], [0], [0, 1]]


@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_the_backend_takes_the_start_as_its_incumbent(backend):
    """With no time to search, the backend's own incumbent is the start it was handed; without one
    it has none (chain(30) at half its peak: HiGHS finds nothing alone in 10 s)."""
    g = chain(30)
    budget = int(0.5 * no_remat_peak(g))
    x, u, m, _ = _convert(g, budget, solve(g, budget, "chen"))
    milp = checkmate.checkmate_milp(m, m.budget_units(budget, g.fixed_mem))
    run = sparse_milp._solve_on_highs if backend == "highs" else sparse_milp._solve_on_scip
    start = np.concatenate((x, u))
    _, values, objective, _ = run(milp, start, 1e-6, 1e-4, 0.0)
    assert objective == pytest.approx(float(milp.cost @ start)) and values is not None
    assert run(milp, None, 1e-6, 1e-4, 0.0)[1] is None


def test_the_warm_started_result_fits_and_is_no_worse_than_its_start():
    g = chain(30)
    budget = int(0.5 * no_remat_peak(g))
    s = solve(g, budget, "checkmate", time_limit=6)
    sim = simulate(g, s)
    assert sim.peak <= budget and sim.compute_cost == pytest.approx(s.stats["compute_cost"])
    assert s.stats["warm_start"].startswith(("chen", "dtr", "moccasin", "bonsai")), s.stats["warm_start"]
    assert sim.compute_cost <= s.stats["warm_start_cost"] * (1 + 1e-9)
    assert s.stats["status"] in ("optimal", "feasible") and 0.0 <= s.stats["gap"] <= 1.0
    assert s.stats["objective"] == pytest.approx(sim.compute_cost, rel=1e-6)


def _backend_ends_with(monkeypatch, incumbent_above_start, bound):
    """Make HiGHS end at once with no incumbent (None) or one ``incumbent_above_start`` above the start's
    objective, proving ``bound`` (with no incumbent for a MILP without a start: bonsai's op-level plans,
    asked for a start, fall back on checkpoint regions)."""
    def fake(milp, start, time_limit, gap, abs_gap):
        if incumbent_above_start is None or start is None:
            return "Time limit reached", None, None, bound
        return "Time limit reached", start, float(milp.cost @ start) + incumbent_above_start, bound
    monkeypatch.setattr(sparse_milp, "_solve_on_highs", fake)


@pytest.mark.parametrize("incumbent_above_start, bound, gap", [(None, -math.inf, 1.0), (5.0, None, 0.5)])
def test_when_the_backend_ends_with_nothing_better_the_start_is_the_result(monkeypatch, incumbent_above_start,
                                                                          bound, gap):
    g = chain(8)
    budget = int(0.6 * no_remat_peak(g))
    start = solve(g, budget, "moccasin", time_limit=20)
    small, _ = contract_views(g)
    m = build_matrices(small)
    start_objective = start.stats["compute_cost"] / m.cost_scale - m.base_cost
    _backend_ends_with(monkeypatch, incumbent_above_start, start_objective / 2 if bound is None else bound)
    s = solve(g, budget, "checkmate", time_limit=20)
    assert "so the start is the result" in s.stats["warm_start"]
    assert s.stats["compute_cost"] == pytest.approx(s.stats["warm_start_cost"])
    assert s.stats["peak"] <= budget
    assert s.stats["status"] == "feasible" and s.stats["gap"] == pytest.approx(gap)


def test_with_no_start_the_stats_say_why(monkeypatch):
    monkeypatch.setattr(checkmate_start, "START_METHODS", ("none",))
    g = chain(8)
    budget = int(0.6 * no_remat_peak(g))
    s = solve(g, budget, "checkmate", time_limit=20)
    assert s.stats["warm_start"].startswith("none (none: no schedule within the budget)")
    assert s.stats["warm_start_cost"] is None and s.stats["peak"] <= budget


def test_a_schedule_that_is_no_start_is_named_with_the_reason(monkeypatch):
    """Two independent sources computed in reverse order: a valid schedule, but not one of the stage
    model, whose stage t computes node t first."""
    g = Graph.from_nodes("two-sources", 0, [dict(name="a", cost=1.0, mem=8, deps=[]),
                                            dict(name="b", cost=1.0, mem=8, deps=[]),
                                            dict(name="c", cost=1.0, mem=8, deps=[0, 1])])
    real_solve = solvers.solve

    def reversed_sources(graph, budget, method, **options):
        return Schedule(graph.name, method, [("compute", 1), ("compute", 0), ("compute", 2)], graph_hash=graph.hash)

    monkeypatch.setattr(checkmate_start, "START_METHODS", ("none",))
    monkeypatch.setattr(solvers, "solve", reversed_sources)
    s = real_solve(g, None, "checkmate", time_limit=20)
    assert s.stats["warm_start_tried"] == {"none": "not a start: computes node 1 before node 0: not in the listed order"}
    assert s.stats["warm_start"].startswith("none (none: not a start") and s.stats["status"] == "optimal"


def test_the_plain_schedule_is_the_start_when_it_fits():
    g = chain(6)
    s = solve(g, no_remat_peak(g), "checkmate", time_limit=20)
    assert s.stats["warm_start"].startswith("none,") and s.stats["warm_start_tried"] == {"none": s.stats["warm_start_tried"]["none"]}
    assert s.stats["status"] == "optimal" and s.stats["compute_cost"] == pytest.approx(g.total_cost)


@pytest.mark.parametrize("graph", GRAPHS[:3], ids=lambda g: g.name)
def test_switched_off_it_solves_the_cvxpy_model_with_no_start(monkeypatch, graph):
    """warm_start=false: no method is asked for a start, and the model is the CVXPY one of before,
    which reaches the exhaustive optimum."""
    def no_search(*args, **kwargs):
        raise AssertionError("a start was looked for")
    monkeypatch.setattr(checkmate, "find_start", no_search)
    budget = budgets(graph)[1]
    best = stage_optimum(contract_views(graph)[0], budget)
    if math.isinf(best):
        with pytest.raises(BudgetError):
            solve(graph, budget, "checkmate", time_limit=30, warm_start=False)
        return
    s = solve(graph, budget, "checkmate", time_limit=30, warm_start=False)
    assert s.stats["warm_start"] == "off" and "warm_start_cost" not in s.stats
    assert s.stats["status"] == "optimal" and s.stats["objective"] == pytest.approx(best, rel=1e-6)
    assert checkmate.cached_model(contract_views(graph)[0])[0].canonical == {"highs"}


def test_the_option_parses_from_the_command_line():
    from bonsai_core.solvers import method_options, parse_option

    assert parse_option("checkmate", "warm_start=false") == ("warm_start", False)
    option = next(o for o in method_options("checkmate") if o.name == "warm_start")
    assert option.default is True and "false" in option.help
