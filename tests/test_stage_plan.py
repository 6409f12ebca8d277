"""A plan per transformer block made for a stage of torchtitan's 405B pipeline (FSDP 8 x TP 8 x PP 8, 1F1B, the
layout of the published table's row 5) and applied to the debugmodel's pipeline stages on gloo
(``bonsai_core.stage_plan``)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

pytest.importorskip("torchtitan")

from bonsai_core import stage_plan as sp  # noqa: E402
from bonsai_core.errors import BudgetError  # noqa: E402
from bonsai_core.parallel import layout_of, with_batch  # noqa: E402
from bonsai_core.schedule import no_remat_peak, simulate  # noqa: E402

GIB = 2**30
DEBUG = "torchtitan:llama3:debugmodel"
STAGE_405B = dict(fsdp=8, tp=8, pp=8, microbatches=8, rank=1)  # a middle stage: 16 of the 126 blocks
BUDGET_405B = 80 * GIB  # live bytes of the stage on an 80 GiB H100


@functools.cache
def _debug_rank(rank: int, layout: str = "pp2"):
    """Pipeline rank ``rank`` of the debugmodel in ``layout`` (traced once per module: the tests only read it)."""
    from bonsai_core.bench import parallel as bench

    spec = with_batch(dataclasses.replace(bench.parse_layout(layout), rank=rank), bench.SIZES[DEBUG]["batch"],
                      bench.SIZES[DEBUG]["seq"])
    return bench.rank_graph(DEBUG, bench.SIZES[DEBUG], spec)


def _near_full_checkpointing(graph) -> int:
    """A budget a tenth of the way from full checkpointing's peak to the peak without recomputation."""
    full = simulate(graph, sp.block_saves_schedule(graph, {}))
    return full.peak + (no_remat_peak(graph) - full.peak) // 10


def test_a_block_plan_of_torchtitan_s_save_list_is_torchtitan_s_selective_plan():
    from bonsai_core.solvers.torchtitan import selective_plan

    graph = _debug_rank(1)
    assert sp.block_calls(graph) == {sp.MM: 7, sp.ATTENTION: 1}
    mine = sp.block_saves_plan(graph, {sp.MM: [0, 2, 4, 6], sp.ATTENTION: [0]})
    assert mine == selective_plan(graph)  # an fp32 block without tensor parallel: no reduce-scatter to save
    assert len(sp.candidates(graph)) == 2 ** 8


def test_the_stage_plan_is_the_least_recomputation_within_the_budget():
    graph = _debug_rank(1)
    nothing = simulate(graph, sp.block_saves_schedule(graph, {}))
    saves, sim = sp.plan_stage(graph, nothing.peak)
    assert saves == {} and sim.peak == nothing.peak
    everything = {sp.MM: list(range(7)), sp.ATTENTION: [0]}
    most = simulate(graph, sp.block_saves_schedule(graph, everything))
    saves, sim = sp.plan_stage(graph, no_remat_peak(graph))
    assert sim.compute_cost == most.compute_cost and sim.peak <= most.peak
    assert all(set(ks) <= set(everything[name]) for name, ks in saves.items())
    assert 6 not in saves[sp.MM]  # w2's output: read by the residual add alone, never rebuilt, so not worth saving
    with pytest.raises(BudgetError, match="every block recomputed whole peaks"):
        sp.plan_stage(graph, nothing.peak - 1)


def test_bonsai_on_a_pipeline_rank_counts_the_microbatches_in_flight_and_recomputes_less_than_the_stage_plan():
    """Rank 0 of PP 2 (1F1B, 4 microbatches) holds a second microbatch's saved activations: the segment ILP
    counts that copy of what its plan holds at the stage's forward end (rule 11), so near full checkpointing's
    peak it finds its own plan, within the budget and recomputing less than the best block plan."""
    from bonsai_core.in_flight import copies
    from bonsai_core.solvers import solve

    graph = _debug_rank(0)
    budget = _near_full_checkpointing(graph)
    in_flight, ends = copies(graph, sp.block_saves_schedule(graph, {}).ops)
    assert in_flight.max() == 1 and len(ends) == 1  # one stage, one other microbatch in flight
    _, stage = sp.plan_stage(graph, budget)
    schedule = solve(graph, budget, "bonsai", space="regions", reuse=False)
    planned = simulate(graph, schedule)
    assert schedule.stats["plan_source"] == "ilp" and planned.peak <= budget
    assert planned.compute_cost < stage.compute_cost


def test_the_op_level_search_counts_the_microbatches_in_flight():
    """Rank 0 of PP 2 (1F1B) holds a second microbatch's saved activations: a storage of the stage resident at
    its forward's end counts once more in every memory row of the op-level MILP, so its plan fits the rank's
    budget as the simulator judges it (rule 11) on its own, with no solve again under a tighter budget."""
    from bonsai_core.bound import GIB as ROW_UNIT, Tensors
    from bonsai_core.solvers.bonsai_ops import in_flight_of, plan_ops, point_model
    from bonsai_core.solvers.deadline import Deadline

    graph = _debug_rank(0)
    budget = _near_full_checkpointing(graph)
    in_flight = in_flight_of(graph)
    [end] = in_flight.points.tolist()
    assert in_flight.copies.max() == 1 and in_flight.copies[end].tolist() == [1]
    tensors = Tensors(graph)
    model = point_model(tensors, budget, (end,), in_flight=in_flight)
    stored = tensors.storages[tensors.storages < end]
    held = int(stored[np.argmax(graph.mem[stored])])
    column = model.starts[0] + int(np.searchsorted(stored, held))
    assert model.milp.matrix[0, column] == pytest.approx(2 * graph.mem[held] / ROW_UNIT)  # its own and one copy
    found = plan_ops(graph, budget, Deadline(None))
    assert found.schedule is not None and simulate(graph, found.schedule).peak <= budget


def test_the_default_search_on_a_rank_holding_other_microbatches_is_the_segment_ilp():
    """The default space on a pipeline rank holding other microbatches in flight is checkpoint regions alone
    (``bonsai_core.solvers.bonsai``'s module doc); the last rank of 1F1B holds none and searches both."""
    from bonsai_core.solvers import solve

    first, last = _debug_rank(0), _debug_rank(1)
    assert solve(first, _near_full_checkpointing(first), "bonsai", reuse=False).stats["spaces"] == ["regions"]
    assert solve(last, _near_full_checkpointing(last), "bonsai", reuse=False).stats["spaces"][0] == "ops"


def test_an_interleaved_rank_s_stages_are_planned_by_the_segment_ilp():
    """Rank 0 of PP 2 interleaved 1F1B runs stages 0 and 2, each from its own data (so no block of stage 0 is
    self-contained), and in the ILP's order (every forward, then every backward) stage 2's forward is on the
    one microbatch's timeline while stage 0's backward runs: one copy fewer of it in flight there. The ILP then
    plans the rank itself, within the budget and below every fallback plan that fits."""
    from bonsai_core.solvers import solve
    from bonsai_core.solvers.bonsai import fallback_plans
    from bonsai_core.solvers.bonsai_coef import self_contained

    graph = _debug_rank(0, "pp2.interleaved")
    forward = np.flatnonzero(graph.is_forward)
    first_stage = forward <= graph.parallel["pipeline"]["stages"][0][2]
    matmuls = np.array([graph.ops[v] == sp.MM for v in forward])
    assert not self_contained(graph)[first_stage & matmuls].any()
    budget = _near_full_checkpointing(graph)
    schedule = solve(graph, budget, "bonsai", space="regions", reuse=False)
    planned = simulate(graph, schedule)
    assert schedule.stats["plan_source"] == "ilp" and planned.peak <= budget
    fallback = fallback_plans(graph).best(graph, budget)
    assert fallback is not None and planned.compute_cost < fallback[1]


@pytest.fixture(scope="module")
def stage_405b():
    from bonsai_core.fit import RankGraphs
    from bonsai_core.fsdp import Sharding

    model = "torchtitan:llama3:405B"
    graphs = RankGraphs(model, 8192, {}, Sharding.of(8, None, None, model=model), {})
    [(rank, graph)] = [(r, g) for r, g in graphs.ranks(layout_of(**STAGE_405B), 32, "adamw") if r == 1]
    return graph


@pytest.mark.slow
def test_a_405b_stage_s_block_plan_trains_the_debugmodel_s_stages_as_predicted(stage_405b):
    """The 405B stage's plan (least recomputation within 80 GiB) on every block of the debugmodel's two stages
    (PP 2, 1F1B, gloo): the same loss and gradients as without it, and each rank's peak within 2% of the
    simulator's peak of its planned stage."""
    from bonsai_core.bench import parallel as bench

    saves, sim = sp.plan_stage(stage_405b, BUDGET_405B)
    assert saves and sim.peak <= BUDGET_405B  # it saves some calls: more than torchtitan's full checkpointing
    full = simulate(stage_405b, sp.block_saves_schedule(stage_405b, {}))
    assert sim.compute_cost < full.compute_cost

    spec = bench.parse_layout("pp2")
    plain = bench.measure(DEBUG, bench.SIZES[DEBUG], spec)
    planned = bench.measure(DEBUG, bench.SIZES[DEBUG], spec, saves=saves)
    for rank, (with_plan, without) in enumerate(zip(planned, plain)):
        graph = _debug_rank(rank)
        predicted = simulate(graph, sp.block_saves_schedule(graph, saves)).peak
        assert abs(with_plan["peak"] / predicted - 1) <= 0.02, (rank, with_plan["peak"], predicted)
        assert with_plan["peak"] < without["peak"]
        assert with_plan["loss"] == (pytest.approx(without["loss"], rel=1e-6) if without["loss"] is not None else None)
        assert with_plan["grads"].keys() == without["grads"].keys() and with_plan["grads"]
        for name, norm in without["grads"].items():
            assert with_plan["grads"][name] == pytest.approx(norm, rel=1e-6), name
