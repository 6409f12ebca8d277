"""Rule 9, offload to host: the simulator by hand, the allocator and the methods that follow it, and the
export's saved copies on CPU."""

from __future__ import annotations

import pytest

from bonsai_core.costmodel import PROFILES
from bonsai_core.errors import ScheduleError, SolverError
from bonsai_core.schedule import Schedule, copy_timing, simulate
from tests.graphs import chain

LINK = PROFILES["cpu"].host_link_bytes_per_s
M = int(LINK * 1.5)  # a tensor whose copy takes 1.5 s; every op of the chain takes 1 s


def cpu(ops: list[tuple[str, int]], host_budget: int | None = None) -> Schedule:
    g = chain(3, mem=M)
    return Schedule(graph=g.name, method="hand", ops=ops, graph_hash=g.hash, device="cpu", host_budget=host_budget)


# chain(3): f0 f1 f2 (ids 0-2), b2 (3, reads f2), b1 (4, reads f1 b2), b0 (5, reads f0 b1)
FORWARD = [("compute", 0), ("offload", 0), ("compute", 1), ("free", 0), ("compute", 2)]
BACKWARD_TO_B1 = [("compute", 3), ("free", 2), ("compute", 4), ("free", 1), ("free", 3)]
LAST = [("compute", 5), ("free", 0), ("free", 4), ("free", 5)]


def test_offloaded_bytes_leave_the_device_when_the_copy_ends_and_a_late_reload_stalls():
    sim = simulate(chain(3, mem=M), cpu([*FORWARD, *BACKWARD_TO_B1, ("reload", 0), *LAST]))
    # f0's copy runs from 1 s to 2.5 s: freed at 2 s, its bytes stay for f2 (2 s) and go before b2 (3 s)
    assert sim.timeline[:6].tolist() == [M, M, 2 * M, 2 * M, 3 * M, 2 * M + M]
    assert sim.timeline[4] == 3 * M and sim.timeline[5] == 3 * M  # f2 counted f0 still; b2 did not
    # the reload is issued at 5 s and takes 1.5 s, so b0 waits for it: priced as compute time
    assert sim.stall == pytest.approx(1.5)
    assert sim.compute_cost == pytest.approx(7.5) and sim.overhead == pytest.approx(0.25)
    assert sim.offloaded_bytes == M and sim.host_peak == M
    reload = len(FORWARD) + len(BACKWARD_TO_B1)
    assert sim.timeline[reload] == sim.timeline[reload - 1] + M  # the bytes come back when the reload starts


def test_a_prefetched_reload_is_hidden_by_compute():
    ops = [*FORWARD, ("reload", 0), *BACKWARD_TO_B1, *LAST]  # issued at 3 s, done at 4.5 s, read at 5 s
    sim = simulate(chain(3, mem=M), cpu(ops))
    assert sim.stall == 0 and sim.compute_cost == pytest.approx(6.0)


def test_wait_makes_compute_wait_for_the_copy_and_frees_the_bytes_then():
    ops = [("compute", 0), ("offload", 0), ("compute", 1), ("free", 0), ("wait", 0), ("compute", 2)]
    timing = copy_timing(chain(3, mem=M), ops, LINK)
    assert timing.deferred == {3} and timing.device_released == {4: [3]}
    assert timing.stalls == {4: pytest.approx(0.5)}
    sim = simulate(chain(3, mem=M), cpu([*ops, *BACKWARD_TO_B1, ("reload", 0), *LAST]))
    assert sim.timeline[:6].tolist() == [M, M, 2 * M, 2 * M, M, 2 * M]


def test_one_copy_stream_per_direction_runs_copies_in_order():
    ops = [("compute", 0), ("offload", 0), ("compute", 1), ("offload", 1), ("free", 0), ("compute", 2),
           ("free", 1), ("compute", 3), ("compute", 4), ("compute", 5)]
    # f0's copy runs 1-2.5 s, f1's is issued at 2 s but waits for it: 2.5-4 s
    timing = copy_timing(chain(3, mem=M), ops, LINK)
    assert timing.deferred == {4, 6} and timing.device_released == {7: [4], 8: [6]}


def test_the_host_budget_limits_pinned_buffers():
    ops = [("compute", 0), ("offload", 0), ("compute", 1), ("offload", 1), ("free", 0), ("compute", 2),
           ("free", 1), *BACKWARD_TO_B1[:1], ("free", 2), ("reload", 1), ("compute", 4), ("free", 1), ("free", 3),
           ("reload", 0), *LAST]
    assert simulate(chain(3, mem=M), cpu(ops, host_budget=2 * M)).host_peak == 2 * M
    with pytest.raises(ScheduleError, match="host budget"):
        simulate(chain(3, mem=M), cpu(ops, host_budget=M + M // 2))


@pytest.mark.parametrize("ops, message", [
    ([*FORWARD[:4], ("compute", 1)], "already resident"),
    ([("compute", 0), ("offload", 0), ("free", 0), ("compute", 1)], "offloaded, reload it first"),
    ([("compute", 0), ("offload", 0), ("free", 0), ("compute", 0)], "offloaded to host"),
    ([("compute", 0), ("reload", 0)], "not offloaded"),
    ([("compute", 0), ("offload", 0), ("reload", 0)], "still resident"),
    ([("compute", 0), ("offload", 0), ("offload", 0)], "already offloaded"),
    ([("offload", 0)], "not resident"),
    ([("compute", 0), ("wait", 0)], "never offloaded"),
])
def test_broken_offloads_are_refused(ops, message):
    with pytest.raises(ScheduleError, match=message):
        simulate(chain(3, mem=M), cpu(ops))


def test_offload_fields_round_trip_through_json():
    s = cpu([("compute", 0), ("offload", 0)], host_budget=123)
    back = Schedule.from_dict(s.to_dict())
    assert back.ops == s.ops and back.device == "cpu" and back.host_budget == 123
    with pytest.raises(ScheduleError, match="'device'"):
        Schedule.from_dict({**s.to_dict(), "device": "tpu"})


def test_the_allocator_follows_offloads():
    from bonsai_core.allocator import layout_at

    g = chain(3, mem=M)
    schedule = cpu([*FORWARD, *BACKWARD_TO_B1, ("reload", 0), *LAST])

    def held(op: int) -> list[str]:
        return sorted(b.name for b in layout_at(g, schedule, op) if b.kind == "activation")

    assert held(4) == ["f0", "f1", "f2"]  # f0 freed at op 3, but its copy runs until 2.5 s
    assert held(5) == ["b2", "f1", "f2"]  # b2 starts at 3 s: f0's block was given back
    reload = len(FORWARD) + len(BACKWARD_TO_B1)
    assert held(reload) == ["b1", "f0"]  # the reload takes a block as a compute does


# -- the replay export on CPU: host copies counted apart ------------------------------------------

ATOL = 1e-5
# a dropout MLP (random ops, fast to trace) in the default run; transformers' Llama (slow to trace) marked slow
EXPORT_MODELS = ["tests.export_models:dropout_mlp",
                 pytest.param("tests.export_models:hf_llama", marks=pytest.mark.slow)]


def offloaded(graph, synchronous: bool) -> Schedule:
    """Every saved tensor of the plain schedule offloaded, timed on the CPU's link."""
    import numpy as np

    from bonsai_core.offload import offloadable, with_offloads
    from bonsai_core.schedule import none_schedule

    ops = with_offloads(graph, none_schedule(graph).ops, np.flatnonzero(offloadable(graph)), LINK, synchronous)
    return Schedule(graph=graph.name, method="test-offload", ops=ops, graph_hash=graph.hash, device="cpu")


@pytest.mark.parametrize("synchronous", [True, False])
@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_an_offloading_export_computes_eagers_step_with_the_predicted_device_and_host_bytes(model, tmp_path,
                                                                                             synchronous):
    from bonsai_core.export import export_traced, step_signature, verify_export
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.trace import trace_model

    traced, signature = trace_model(model), step_signature(model, {})
    g = traced.graph
    schedule = offloaded(g, synchronous)
    sim = simulate(g, schedule)
    assert sim.offloaded_bytes > 0 and sim.peak < no_remat_peak(g)
    export_traced(traced, signature, schedule, tmp_path)
    v = verify_export(model, {}, tmp_path, repeats=0)
    assert v.loss_diff <= ATOL and v.max_grad_diff <= ATOL and v.max_grad_diff_grads_none <= ATOL
    assert v.measured_host_peak == sim.host_peak  # each offloaded copy lives from its offload to its reload
    if synchronous:  # the CPU's copies end when issued, as the waits make the simulator time them
        assert abs(v.measured_peak - v.predicted_peak) <= 64  # the autograd engine's loss seed, rounded
    else:  # the simulator holds a freed tensor until its copy ends; the CPU frees it at once
        assert v.measured_peak <= v.predicted_peak + 64


# -- dtr and coop: eviction to host ----------------------------------------------------------------

@pytest.mark.parametrize("method", ["dtr", "coop"])
def test_eviction_to_host_replaces_expensive_recomputation(method):
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve

    g = chain(6, mem=2**20, cost=1e-3)  # 1 MiB per op: a round trip over PCIe (41 us) beats a 1 ms rebuild
    budget = g.fixed_mem + int(0.6 * (no_remat_peak(g) - g.fixed_mem))
    discard = simulate(g, solve(g, budget, method=method))
    to_host = solve(g, budget, method=method, offload=True)
    sim = simulate(g, to_host)
    kinds = {kind for kind, _ in to_host.ops}
    assert {"offload", "wait", "reload"} <= kinds and sim.offloaded_bytes > 0
    assert sim.peak <= budget and sim.recomputes < discard.recomputes
    assert sim.overhead < discard.overhead
    assert sim.stall == pytest.approx(2 * sim.offloaded_bytes / PROFILES["h100"].host_link_bytes_per_s)


# -- bonsai: keep, recompute or offload ----------------------------------------------------------------

def test_bonsai_offloads_where_a_hidden_copy_beats_a_recomputation():
    from bonsai_core.regions import CheckpointPlan
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve

    g = chain(8, mem=2**24, cost=1e-3)  # 16 MiB per op: each copy (0.33 ms) hides behind one op (1 ms)
    budget = g.fixed_mem + int(0.75 * (no_remat_peak(g) - g.fixed_mem))
    recompute = solve(g, budget, method="bonsai", space="regions")
    both = solve(g, budget, method="bonsai", offload=True, space="regions")
    sim = simulate(g, both)
    plan = CheckpointPlan.from_extra(both.extra)
    assert plan.offloaded and sim.offloaded_bytes == len(plan.offloaded) * 2**24
    assert sim.peak <= budget and sim.stall == 0  # the model's copies are hidden, and so are the simulator's
    assert both.stats["offloaded_bytes"] == sim.offloaded_bytes
    assert sim.overhead < simulate(g, recompute).overhead
    assert both.stats["model_peak"] >= sim.peak  # the model's bound holds on the simulated plan


def test_the_offload_model_starts_from_the_plan_without_offload_and_is_never_costlier(monkeypatch):
    """Its own search can go minutes without an incumbent on the largest steps (the torchtitan 8B step:
    none in 300 s before the start), so it starts from the plan bonsai finds without offload and returns
    that plan when it finds nothing better that fits."""
    from bonsai_core.solvers import bonsai as bonsai_solver
    from bonsai_core.solvers import solve
    from bonsai_core.trace import trace_model

    g = trace_model("gpt").graph
    budget = int(0.6 * bonsai_solver._plain(g).memory.max())
    recompute = simulate(g, solve(g, budget, method="bonsai", reuse=False, space="regions"))
    both = solve(g, budget, method="bonsai", offload=True, reuse=False, space="regions")
    assert both.stats["offloaded"] > 0 and simulate(g, both).compute_cost < recompute.compute_cost
    assert both.stats["offload_start"] == "highs improved on it"

    def no_plan(*args, **kwargs):
        raise SolverError("no incumbent")

    monkeypatch.setattr(bonsai_solver, "_solve_from", no_plan)
    fallen = solve(g, budget, method="bonsai", offload=True, reuse=False, space="regions")
    assert fallen.stats["offloaded"] == 0 and fallen.stats["status"] == "feasible" and fallen.stats["gap"] is None
    assert "the plan without offload" in fallen.stats["offload_start"]
    assert simulate(g, fallen).compute_cost == pytest.approx(recompute.compute_cost)


def test_the_one_call_takes_offload():
    """The one call plans with offload=True (tests/test_one_call_offload.py runs what it does)."""
    import torch

    from bonsai_core import plan

    made = plan(torch.nn.Linear(4, 4), torch.randn(2, 4), lambda out: out.sum(), "100%", cache=False, offload=True)
    assert made.report.predicted_peak <= made.report.budget


def test_reloads_are_prefetched_back_to_back_on_their_copy_stream():
    """``with_reloads``: f0 and f1 both brought back for b1 (as a rebuild would be): their copies (1.5 s each)
    are queued on one stream to end when b1 starts, so compute never waits; each offload follows its compute."""
    from bonsai_core.offload import with_reloads

    g = chain(4, mem=M)  # f0-f3 (0-3), b3 (4), b2 (5), b1 (6), b0 (7): every op 1 s
    ops = [("compute", 0), ("compute", 1), ("compute", 2), ("free", 0), ("compute", 3), ("free", 1),
           ("compute", 4), ("free", 3), ("compute", 5), ("free", 2), ("free", 4),
           ("reload", 1), ("compute", 6), ("free", 5), ("reload", 0), ("compute", 7)]
    placed = with_reloads(g, ops, LINK)
    assert placed[:3] == [("compute", 0), ("offload", 0), ("compute", 1)] and placed[3] == ("offload", 1)
    # b0 starts at 7 s: f0's copy runs 5.5-7 s (issued at b2's start, 5 s); so f1's, for b1 at 6 s, must end
    # by 5.5 s on the same stream: it runs 4-5.5 s, issued at b3's start, ahead of f0's
    timing = copy_timing(g, placed, LINK)
    sim = simulate(g, Schedule(graph=g.name, method="hand", ops=placed, graph_hash=g.hash, device="cpu"))
    assert placed.index(("reload", 1)) == placed.index(("compute", 4)) - 1
    assert placed.index(("reload", 0)) == placed.index(("compute", 5)) - 1
    assert timing.stall == 0 and sim.stall == 0 and sim.compute_cost == pytest.approx(8.0)


def test_a_node_reloaded_twice_is_refused():
    from bonsai_core.offload import with_reloads

    g = chain(3, mem=M)
    ops = [("compute", 0), ("free", 0), ("reload", 0), ("free", 0), ("reload", 0)]
    with pytest.raises(ValueError, match="more than once"):
        with_reloads(g, ops, LINK)
