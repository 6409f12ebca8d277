import numpy as np
import pytest

from bonsai_core.errors import ScheduleError
from bonsai_core.regions import CheckpointPlan, checkpoint_sequence, dropped_nodes, plan_schedule
from bonsai_core.schedule import Schedule, no_remat_peak, schedule_ops, simulate
from tests.graphs import chain


def test_recomputed_segment_keeps_its_boundary_and_rebuilds_the_rest():
    g = chain(4)  # f0..f3 = 0..3, b3..b0 = 4..7
    plan = CheckpointPlan.of([[0, 1], [2, 3]], recomputed=[0])
    assert dropped_nodes(g, plan).tolist() == [True, False] + [False] * 6
    assert checkpoint_sequence(g, plan) == [0, 1, 2, 3, 4, 5, 6, 0, 7]
    sim = simulate(g, plan_schedule(g, plan, "test"))
    assert sim.recomputes == 1 and sim.peak < no_remat_peak(g)


def test_no_recomputation_is_the_plain_schedule():
    g = chain(5)
    sim = simulate(g, plan_schedule(g, CheckpointPlan.of([[0, 1, 2, 3, 4]]), "test"))
    assert sim.peak == no_remat_peak(g) and sim.recomputes == 0


@pytest.mark.parametrize("segments, recomputed, words", [
    ([[0, 1], [1, 2, 3]], [], "disjoint"),
    ([[0, 1], [2]], [], "no segment"),
    ([[0, 1, 2, 3, 4]], [], "not a forward node"),
    ([[0, 1, 2, 3]], [3], "does not exist"),
])
def test_bad_plans_are_refused(segments, recomputed, words):
    with pytest.raises(ScheduleError, match=words):
        checkpoint_sequence(chain(4), CheckpointPlan.of(segments, recomputed))


def test_every_random_plan_on_a_traced_gpt_is_a_valid_schedule(traced_zoo):
    g = traced_zoo["gpt"].graph
    forward = np.flatnonzero(g.is_forward)
    rng = np.random.default_rng(0)
    for _ in range(20):
        cuts = np.sort(rng.choice(np.arange(1, len(forward)), size=8, replace=False))
        segments = np.split(forward, cuts)
        recomputed = [i for i in range(len(segments)) if rng.random() < 0.5]
        plan = CheckpointPlan.of(segments, recomputed)
        sim = simulate(g, plan_schedule(g, plan, "random"))  # raises if any rule is broken
        assert sim.recomputes > 0 or not recomputed
        assert CheckpointPlan.from_extra(plan.to_extra()) == plan


def test_hold_saved_keeps_saved_outputs_until_their_segment_s_rebuild():
    """SAC's storage holds every MUST_SAVE output until the recomputation: with torchtitan's selective
    plan on a Llama, a saved output only the forward read (the block's last projection, down_proj) is freed
    right before its block's rebuild (:func:`plan_schedule` applies it); the schedule stays valid and its
    peak can only rise."""
    pytest.importorskip("transformers")
    from bonsai_core.regions import hold_saved
    from bonsai_core.solvers.torchtitan import selective_plan
    from bonsai_core.trace import trace_model

    graph = trace_model("hf:llama", batch=2, seq=16, width=32, layers=2, heads=2, vocab=64).graph
    plan = selective_plan(graph)
    freed_at_last_use = schedule_ops(graph, checkpoint_sequence(graph, plan))
    held = plan_schedule(graph, plan, "torchtitan-selective").ops  # every plan's schedule holds them
    assert held == hold_saved(graph, plan, freed_at_last_use)
    assert sorted(held) == sorted(freed_at_last_use) and held != freed_at_last_use
    plain = Schedule(graph=graph.name, method="at last use", ops=freed_at_last_use, graph_hash=graph.hash)
    assert simulate(graph, Schedule(graph=graph.name, method="held", ops=held, graph_hash=graph.hash)).peak \
        >= simulate(graph, plain).peak
    first_backward = next(i for i, (k, v) in enumerate(held) if k == "compute" and not graph.is_forward[v])
    freed = {v: i for i, (k, v) in enumerate(held) if k == "free"}
    later = [v for v in plan.saved if freed.get(v, len(held)) > first_backward]
    assert len(later) == len(plan.saved)  # none of them freed in the forward pass any more
