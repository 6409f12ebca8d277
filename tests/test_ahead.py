"""The slider's positions swept in the background (explorer/ahead.py) and the plans kept on disk
(explorer/disk.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import streamlit as st

from bonsai_core import solvers
from bonsai_core.errors import BudgetError
from bonsai_core.regions import region_peak_bound
from bonsai_core.schedule import no_remat_peak, none_schedule, simulate
from explorer import ahead, background, compute, disk
from tests.graphs import chain

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


GRAPH = chain(6, mem=10_000)  # every slider position a different budget
REFERENCE = no_remat_peak(GRAPH)


def pct_of(budget: int) -> int:
    return round(100 * budget / REFERENCE)


@pytest.fixture
def fake_method(monkeypatch):
    """``install(fake)``: ``solvers.solve`` replaced by ``fake(budget, **options)``, which returns a
    schedule of GRAPH or raises; Streamlit's cache and the sweeps cleared before and after (the fake's
    schedules must not reach other tests)."""
    def install(fake):
        def fake_solve(g, budget, method, **options):
            fake(budget, **options)
            return none_schedule(g)

        monkeypatch.setattr(solvers, "solve", fake_solve)

    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "1")  # off for the rest of the test run (tests/conftest.py)
    st.cache_resource.clear()
    ahead._sweeps.clear()
    yield install
    wait_for_the_thread()
    ahead._sweeps.clear()
    st.cache_resource.clear()


@pytest.fixture
def recorded(fake_method):
    """A fake method that records each budget (as a slider %) and meets only budgets >= 40% of the
    no-remat peak (below: BudgetError, as a real method at a budget it cannot meet)."""
    asked: list[int] = []

    def fake(budget, **options):
        asked.append(pct_of(budget))
        if budget < 0.4 * REFERENCE:
            raise BudgetError(f"no schedule under {budget} B")

    fake_method(fake)
    return asked


def session_solve(pct: int, method: str = "fake", options=()) -> compute.Outcome:
    """What a session's own solve at slider position ``pct`` returns."""
    return compute.solve(GRAPH, ahead.budget_at(pct, REFERENCE), method, tuple(options))


def wait_for_the_thread() -> None:
    worker = ahead._worker  # None once it has ended
    if worker is not None:
        worker.join(timeout=60)
    assert ahead._worker is None  # it ends with its last sweep


def test_positions_go_coarse_to_fine_around_the_sessions_nearest_first():
    got = ahead.order(list(ahead.SLIDER), 70)
    assert sorted(got) == [p for p in ahead.SLIDER if p != 70]  # each once, the session's own left out
    assert got[:5] == [86, 54, 38, 22, 6]  # every 16th position: nearest first, above first at a tie
    assert got[5:11] == [78, 62, 94, 46, 30, 14]  # then every 8th between them
    assert got[-30:] == sorted((p for p in ahead.SLIDER if p % 2), key=lambda p: (abs(p - 70), p < 70))[-30:]


def test_a_sweep_solves_every_position_down_to_the_first_unmet_and_derives_the_rest(recorded):
    first = session_solve(70)
    ahead.start(GRAPH, first, REFERENCE, 70)
    wait_for_the_thread()
    lowest_met = min(p for p in ahead.SLIDER if ahead.budget_at(p, REFERENCE) >= 0.4 * REFERENCE)
    assert {p for p in ahead.SLIDER if p >= lowest_met} <= set(recorded)  # every position the method meets
    assert lowest_met - 1 in recorded and min(recorded) >= lowest_met - 16  # the coarse levels tried a few below
    sweep, _ = ahead.find(GRAPH, "fake", (), None, 70)
    assert sweep.known == len(ahead.SLIDER) and sweep.ended is not None
    recorded.clear()
    for p in (lowest_met, 85, 100):  # what a session's drag asks for now comes from the cache
        assert session_solve(p).ok
    assert recorded == []
    below = ahead.answer(GRAPH, "fake", (), None, 6)  # below the first unmet: answered without a solve
    assert not below.ok and "found no plan at" in below.error and "no schedule under" in below.error
    assert recorded == []


def test_below_every_budget_met_a_sweep_goes_down_one_by_one_after_the_positions_above(recorded):
    ahead.start(GRAPH, session_solve(70), REFERENCE, 70)
    wait_for_the_thread()
    lowest_met = min(p for p in ahead.SLIDER if ahead.budget_at(p, REFERENCE) >= 0.4 * REFERENCE)
    swept = recorded[1:]  # after the session's own solve
    first_below = next(i for i, p in enumerate(swept) if p < 54)  # 54: the coarse level's lowest met
    assert set(swept[:first_below]) == {p for p in ahead.SLIDER if p >= 54 and p != 70}
    assert swept[first_below:] == list(range(53, lowest_met - 2, -1))  # down to the first unmet, which ends it
    sweep, _ = ahead.find(GRAPH, "fake", (), None, 70)
    assert sweep.known == len(ahead.SLIDER)


def test_a_solve_that_ran_out_of_time_says_nothing_of_the_budgets_below(fake_method, monkeypatch):
    asked: list[int] = []

    def fake(budget, time_limit=None, **options):  # 54% runs into its time limit; nothing is unmet
        asked.append(pct_of(budget))
        if pct_of(budget) == 54:
            raise BudgetError("no plan found before the time limit")

    fake_method(fake)
    real_solve = compute.solve

    def timed(graph, budget, method, options=(), reserved=None, _cap=None):  # 54%'s solve took its whole limit
        out = real_solve(graph, budget, method, options, reserved, _cap)
        return dataclasses.replace(out, cpu_seconds=20.0) if pct_of(budget) == 54 else out

    monkeypatch.setattr(compute, "solve", timed)
    options = (("time_limit", 20.0),)
    ahead.start(GRAPH, session_solve(70, options=options), REFERENCE, 70)
    wait_for_the_thread()
    sweep, _ = ahead.find(GRAPH, "fake", options, None, 70)
    assert not sweep.derived and set(asked) >= set(range(5, 54))  # every budget below was solved


def test_an_unsolved_position_is_shown_the_nearest_solved_plan_below_and_goes_next(recorded):
    with ahead._lock:  # a sweep that has solved 70% and 54%, the rest to do (no thread started)
        sweep = ahead.Sweep(GRAPH, "fake", (), None, REFERENCE, ahead.BUDGET, list(ahead.SLIDER),
                            ahead.order(list(ahead.SLIDER), 70))
        ahead._sweeps[sweep.key] = sweep
    for p in (70, 54):
        sweep.solved[p] = session_solve(p).ok
        sweep.todo.remove(p) if p in sweep.todo else None
    shown = ahead.answer(GRAPH, "fake", (), None, 66)
    assert shown.stand_in_for == 66 and shown.budget == ahead.budget_at(54, REFERENCE)  # it fits 66%'s budget
    assert sweep.todo[0] == 66  # solved next
    assert ahead.answer(GRAPH, "fake", (), None, 70) is None  # a solved position: the session's solve reads it
    above = ahead.answer(GRAPH, "fake", (), None, 40)  # nothing solved below: the nearest above, marked too
    assert above.stand_in_for == 40 and above.budget == ahead.budget_at(54, REFERENCE)


def test_the_granularities_offered_are_swept_at_the_sessions_budget_after_its_budgets(recorded, monkeypatch):
    seen: list[tuple[int, int]] = []

    def fake_solve(g, budget, method, granularity=None, **options):
        seen.append((pct_of(budget), granularity))
        return none_schedule(g)

    monkeypatch.setattr(solvers, "solve", fake_solve)
    first = session_solve(80, options=(("granularity", 8),))
    ahead.start(GRAPH, first, REFERENCE, 80, granularities=[1, 2, 4, 8, 16])
    wait_for_the_thread()
    budgets = [i for i, (_, k) in enumerate(seen) if k == 8]
    others = [i for i, (p, k) in enumerate(seen) if k != 8]
    assert {k for _, k in seen} == {1, 2, 4, 8, 16}
    assert all(seen[i][0] == 80 for i in others) and max(budgets) < min(others)  # budgets first, then the rest at 80%
    sweep, p = ahead.find(GRAPH, "fake", (("granularity", 2),), None, 80)
    assert sweep.axis == ahead.GRANULARITY and p == 2 and sweep.known == 5


def test_sweeps_run_once_per_graph_method_and_options_and_only_when_enabled(recorded, monkeypatch):
    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "0")
    ahead.start(GRAPH, session_solve(70), REFERENCE, 70)
    assert ahead._worker is None and recorded == [70] and not ahead._sweeps
    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "1")
    ahead.start(GRAPH, session_solve(70), REFERENCE, 70)
    wait_for_the_thread()
    done = len(recorded)
    assert done > 50
    ahead.start(GRAPH, session_solve(50), REFERENCE, 50)  # the same sweep: not started again
    assert ahead._worker is None and len(recorded) == done
    ahead.start(GRAPH, compute.solve(GRAPH, None, "none"), REFERENCE, 70)  # no remat does not depend on the budget
    assert len(ahead._sweeps) == 1


def test_a_solve_is_kept_on_disk_and_read_back_simulated_by_a_new_server(monkeypatch, tmp_path):
    monkeypatch.setenv("BONSAI_EXPLORER_CACHE", str(tmp_path))
    st.cache_resource.clear()
    budget = ahead.budget_at(80, REFERENCE)
    first = compute.solve(GRAPH, budget, "chen", ())
    unmet = compute.solve(GRAPH, ahead.budget_at(5, REFERENCE), "chen", ())
    assert first.ok and not first.kept and not unmet.ok
    st.cache_resource.clear()  # a new server: only the disk is left

    def no_solve(*args, **kwargs):
        raise AssertionError("solved again")

    monkeypatch.setattr(solvers, "solve", no_solve)
    again = compute.solve(GRAPH, budget, "chen", ())
    assert again.kept and again.schedule.ops == first.schedule.ops and again.sim.peak == first.sim.peak
    assert compute.solve(GRAPH, ahead.budget_at(5, REFERENCE), "chen", ()).error == unmet.error
    assert compute.kept(GRAPH, budget, "chen", ()) and not compute.kept(GRAPH, budget + 1, "chen", ())
    st.cache_resource.clear()


def test_a_replay_is_kept_beside_its_plan_and_read_back_for_that_plan_only(monkeypatch, tmp_path):
    monkeypatch.setenv("BONSAI_EXPLORER_CACHE", str(tmp_path))
    st.cache_resource.clear()
    budget = ahead.budget_at(80, REFERENCE)
    first = compute.solve(GRAPH, budget, "chen", ())
    replayed = compute.replay(GRAPH, first)
    st.cache_resource.clear()  # a new server: only the disk is left
    from bonsai_core import allocator

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed again")

    monkeypatch.setattr(allocator, "replay_as_solved", no_replay)
    again = compute.solve(GRAPH, budget, "chen", ())
    read = compute.replay(GRAPH, again)
    for name in disk.REPLAY_ARRAYS:
        assert np.array_equal(getattr(read, name), getattr(replayed, name))
    assert read.stats() == replayed.stats()
    other = dataclasses.replace(again.schedule, ops=again.schedule.ops[:-1])  # another plan: not this replay
    assert disk.load_replay(GRAPH.hash, "chen", compute.with_defaults("chen", ()), None, budget, other) is None
    st.cache_resource.clear()


def test_only_bonsai_cores_methods_within_their_time_are_kept(monkeypatch, tmp_path, fake_method):
    monkeypatch.setenv("BONSAI_EXPLORER_CACHE", str(tmp_path))
    fake_method(lambda budget, **options: None)
    compute.solve(GRAPH, ahead.budget_at(80, REFERENCE), "fake", ())  # a method of the tests: not kept
    assert not any(tmp_path.rglob("*.json.gz"))
    schedule = none_schedule(GRAPH)
    out = compute.Outcome("chen", 1, (), schedule, simulate(GRAPH, schedule), wall_seconds=30.0, cpu_seconds=19.5)
    assert compute.keepable("chen", out, None) and not compute.keepable("chen", out, 20.0)  # it ran into its limit
    assert disk.code_digest() == disk.code_digest() and len(disk.code_digest()) == 16


def test_a_session_starts_the_sweep_of_its_settings_only_when_the_slider_sets_the_budget(monkeypatch):
    from streamlit.testing.v1 import AppTest

    asked = []
    monkeypatch.setattr(ahead, "start", lambda g, out, reference, pct, granularities=None:
                        asked.append((out.method, pct, granularities)))
    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "1")  # (the recording stands in for the thread)
    at = AppTest.from_file(str(ROOT / "explorer" / "app.py"), default_timeout=120)
    at.switch_page(str(ROOT / "pages" / "solve.py"))
    at.run()
    assert any("solved in the background" in c.value for c in at.caption)  # the Solve page says so
    at.sidebar.slider(key="budget_pct").set_value(80).run()
    assert not at.exception and asked[-1] == ("bonsai", 80, None)
    at.sidebar.toggle(key="granularity_on").set_value(True).run()
    assert asked[-1][2] and 1 in asked[-1][2]  # with the granularity set: the granularities offered too
    asked.clear()
    at.sidebar.text_input(key="budget_text").input("75%").run()
    assert not at.exception and asked == []
    monkeypatch.setenv("BONSAI_SOLVE_AHEAD", "0")
    at.run()
    assert not any("solved in the background" in c.value for c in at.caption)


class FakeChild:
    """A child process (:func:`explorer.background.start`'s) that has not ended until ``end()``."""

    def __init__(self) -> None:
        self.returncode = None

    def poll(self):
        return self.returncode

    def end(self) -> None:
        self.returncode = 0


def test_the_put_off_work_goes_to_a_child_once_every_position_is_answered_and_the_sweep_is_done_after_it(
        recorded, monkeypatch):
    """Bonsai's reach (minutes on a large step) and an FSDP rank's replays go to a child process, started once the
    sweep has answered every position: a session dragging meanwhile finds its plan sooner. The sweep is done only
    once the child has ended."""
    started = []

    def start(graph, method, reserved, replays, reach):
        sweep, _ = ahead.find(GRAPH, "bonsai", (), None, 70)
        started.append((sweep.known, reach, replays))
        return child

    child = FakeChild()
    monkeypatch.setattr(background, "start", start)
    ahead.start(GRAPH, session_solve(70, method="bonsai"), REFERENCE, 70)
    wait_for_the_thread()
    sweep, _ = ahead.find(GRAPH, "bonsai", (), None, 70)
    assert started == [(len(ahead.SLIDER), True, [])]  # GRAPH is no FSDP rank: no replays
    assert sweep.ended is not None and sweep.ready is not None and not sweep.done
    child.end()
    assert sweep.done


def test_a_child_keeps_the_replays_and_the_reach_on_disk_where_the_server_reads_them(monkeypatch, tmp_path):
    """:mod:`explorer.background` in a child process of its own: one replay per distinct plan, kept beside each
    plan; the reach and the regions' bound read back instead of computed."""
    monkeypatch.setenv("BONSAI_EXPLORER_CACHE", str(tmp_path))
    st.cache_resource.clear()
    budgets = [ahead.budget_at(p, REFERENCE) for p in (80, 90)]
    plans = [compute.solve(GRAPH, b, "chen", ()) for b in budgets]
    options = compute.with_defaults("chen", ())
    child = background.start(GRAPH, "chen", None, [(options, b) for b in budgets], reach=True)
    assert child.wait(timeout=300) == 0
    for budget, plan in zip(budgets, plans):
        assert disk.load_replay(GRAPH.hash, "chen", options, None, budget, plan.schedule) is not None
    from bonsai_core.solvers import bonsai

    def not_again(*args, **kwargs):
        raise AssertionError("computed again")

    monkeypatch.setattr(bonsai, "lowest_budget", not_again)
    assert compute.bonsai_reach(GRAPH) == disk.load_reach(GRAPH.hash)[0]
    assert compute.region_bound(GRAPH) == region_peak_bound(GRAPH)
    st.cache_resource.clear()


def test_a_child_whose_code_is_not_the_servers_keeps_nothing(monkeypatch, tmp_path):
    """A server's bonsai_core changed on disk since it started: its child would keep another code's answers."""
    monkeypatch.setenv("BONSAI_EXPLORER_CACHE", str(tmp_path))
    disk.save_graph(GRAPH)
    job = {"code": "0" * 16, "graph": GRAPH.hash, "method": "chen", "reserved": None, "reach": True, "replays": []}
    path = disk.save_job(json.dumps(job).encode())
    assert background.run(path) == 1 and not path.exists() and disk.load_reach(GRAPH.hash) is None


def test_a_solve_that_waits_for_the_cpu_is_not_out_of_its_time_limit(fake_method):
    """The explorer's time limit counts the solving thread's CPU seconds: a solve that spends its time waiting
    (as on a loaded machine) ends within it."""
    from bonsai_core.solvers.deadline import Deadline

    ended_within = []

    def waits(budget, time_limit=None, **options):
        clock = Deadline(time_limit)
        __import__("time").sleep(0.6)  # wall time, no CPU time
        ended_within.append(not clock.passed())

    fake_method(waits)
    out = compute.solve(GRAPH, ahead.budget_at(80, REFERENCE), "fake", (("time_limit", 0.5),))
    assert ended_within == [True] and out.ok
    assert out.wall_seconds >= 0.6 > out.cpu_seconds and not compute.ran_out(out, 0.5)
