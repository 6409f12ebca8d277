"""Solving the budget slider's other positions in the background (explorer/ahead.py)."""

from __future__ import annotations

import time

import pytest
import streamlit as st

from bonsai_core import solvers
from bonsai_core.errors import BudgetError
from bonsai_core.schedule import no_remat_peak, none_schedule, simulate
from explorer import ahead, compute
from tests.graphs import chain

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


GRAPH = chain(6, mem=10_000)  # every slider position a different budget
REFERENCE = no_remat_peak(GRAPH)


def pct_of(budget: int) -> int:
    return round(100 * budget / REFERENCE)


@pytest.fixture
def fake_method(monkeypatch):
    """``install(fake)``: ``solvers.solve`` replaced by ``fake(budget, **options)``, which returns a
    schedule of GRAPH or raises; Streamlit's cache cleared before and after (the fake's schedules must
    not reach other tests)."""
    def install(fake):
        def fake_solve(g, budget, method, **options):
            fake(budget, **options)
            return none_schedule(g)

        monkeypatch.setattr(solvers, "solve", fake_solve)

    st.cache_resource.clear()
    yield install
    st.cache_resource.clear()


@pytest.fixture
def recorded(fake_method):
    """A fake method that records each budget and meets only budgets >= 40% of the no-remat peak
    (below: BudgetError, as a real method at a budget it cannot meet)."""
    asked: list[int] = []

    def fake(budget, **options):
        asked.append(budget)
        if budget < 0.4 * REFERENCE:
            raise BudgetError(f"no schedule under {budget} B")

    fake_method(fake)
    return GRAPH, REFERENCE, asked


def solved(graph, method: str, seconds: float) -> compute.Outcome:
    """A session's outcome whose solver took ``seconds`` (option x=1)."""
    schedule = none_schedule(graph)
    schedule.stats["solve_seconds"] = seconds
    return compute.Outcome(method, None, (("x", 1),), schedule, simulate(graph, schedule), wall_seconds=seconds)


def wait_for_the_thread() -> None:
    worker = ahead._worker  # None once it has ended
    if worker is not None:
        worker.join(timeout=60)
    assert ahead._worker is None  # it ends with its last job


def test_a_job_solves_every_position_down_to_the_first_unmet_budget(recorded):
    graph, reference, asked = recorded
    ahead._run(graph, "fake", (), reference, 70)
    pcts = sorted(p for p in ahead.SLIDER if ahead.budget_at(p, reference) in asked)
    lowest_met = min(p for p in ahead.SLIDER if ahead.budget_at(p, reference) >= 0.4 * reference)
    assert pcts == [p for p in ahead.SLIDER if p >= lowest_met - 1 and p != 70]  # one unmet, then it stops
    asked.clear()
    for p in (lowest_met, 85, 100):  # what a session's drag asks for now comes from the cache
        assert compute.solve(graph, ahead.budget_at(p, reference), "fake", ()).ok
    assert asked == []


def test_the_side_that_took_less_solver_time_goes_next(fake_method):
    asked: list[int] = []

    def fake(budget, **options):  # below 70%: 0.2 s each, unmet below 60%
        asked.append(pct_of(budget))
        if budget < 0.7 * REFERENCE:
            time.sleep(0.2)
        if budget < 0.6 * REFERENCE:
            raise BudgetError(f"no schedule under {budget} B")

    fake_method(fake)
    ahead._run(GRAPH, "fake", (), REFERENCE, 70)
    # a tie goes below; then every cheap position above before the second costly one below
    assert asked == [69, *range(71, 101), *range(68, 58, -1)]


def test_a_capped_solve_stops_the_side_below_not_the_side_above_and_is_not_kept(fake_method, monkeypatch):
    limits: dict[int, float] = {}

    def fake(budget, time_limit=None, **options):  # below 70% and at 75%: past the cap
        limits[pct_of(budget)] = time_limit
        if budget < 0.7 * REFERENCE or pct_of(budget) == 75:
            time.sleep(0.3)

    fake_method(fake)
    monkeypatch.setattr(ahead, "SLOW_SOLVE_SECONDS", 0.2)
    options = (("time_limit", 20.0),)
    ahead._run(GRAPH, "fake", options, REFERENCE, 70)
    assert sorted(limits) == [69, *range(71, 101)]  # one capped below, then that side stopped; above went on
    assert set(limits.values()) == {0.2}  # the user's 20 s lowered to the cap
    limits.clear()
    for p in (69, 71, 75, 76):
        compute.solve(GRAPH, ahead.budget_at(p, REFERENCE), "fake", options)
    assert limits == {69: 20.0, 75: 20.0}  # the capped solves were not kept; the finished ones were, as the user's


def test_the_background_thread_runs_each_job_once_and_only_when_enabled(recorded, monkeypatch):
    graph, reference, asked = recorded
    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "0")
    ahead.solve_ahead(graph, solved(graph, "fake", 0.1), reference, 70)
    assert ahead._worker is None and asked == []
    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "1")
    ahead.solve_ahead(graph, solved(graph, "fake", ahead.SLOW_SOLVE_SECONDS + 1), reference, 70)
    key = (graph.hash, "fake", (("x", 1),), None)  # no reserved bound
    assert key not in ahead._pending and key not in ahead._started  # after a slow solve: nothing queued
    ahead.solve_ahead(graph, solved(graph, "fake", 0.1), reference, 70)
    wait_for_the_thread()
    assert len(asked) > 30
    done = len(asked)
    ahead.solve_ahead(graph, solved(graph, "fake", 0.1), reference, 50)  # the same job: not queued again
    assert ahead._worker is None and len(asked) == done
    ahead.solve_ahead(graph, solved(graph, "none", 0.1), reference, 70)  # no remat does not depend on the budget
    assert (graph.hash, "none", (("x", 1),)) not in ahead._started
    ahead.solve_ahead(graph, solved(graph, "other", 0.1), reference, 70)  # a new job: a new thread
    wait_for_the_thread()
    assert len(asked) == 2 * done


def test_a_session_asks_for_its_neighbours_only_when_the_slider_sets_the_budget(monkeypatch):
    from streamlit.testing.v1 import AppTest

    asked = []
    monkeypatch.setattr(ahead, "solve_ahead", lambda g, out, reference, pct: asked.append((out.method, pct)))
    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "1")  # (the recording stands in for the thread)
    at = AppTest.from_file(str(ROOT / "explorer" / "app.py"), default_timeout=120)
    at.switch_page(str(ROOT / "pages" / "solve.py"))
    at.run()
    assert any("solved in the background" in c.value for c in at.caption)  # the Solve page says so
    at.sidebar.slider(key="budget_pct").set_value(80).run()
    assert not at.exception and asked[-1] == ("bonsai", 80)
    asked.clear()
    at.sidebar.text_input(key="budget_text").input("75%").run()
    assert not at.exception and asked == []
    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "0")
    at.run()
    assert not any("solved in the background" in c.value for c in at.caption)
