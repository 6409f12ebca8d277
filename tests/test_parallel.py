"""One rank of a tensor, context and FSDP/HSDP parallel layout (``bonsai_core.parallel``), traced in one process
on the fake process group: the layout's checks, the rank's local shards and collectives, the CLI and the one
call; and (slow) each rank against gloo processes parallelized as the model's library does it."""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("torchtitan")

from bonsai_core.errors import BonsaiError, BudgetError, ModelError  # noqa: E402
from bonsai_core.graph import Graph  # noqa: E402
from bonsai_core.parallel import ASYNC_TP_REFUSED, layout_of, with_batch  # noqa: E402
from bonsai_core.schedule import no_remat_peak  # noqa: E402
from bonsai_core.rank import trace as trace_model  # noqa: E402
from tests.marks import sweep  # noqa: E402

TITAN = "torchtitan:llama3:debugmodel"
SMALL = dict(batch=2, seq=64, layers=2)  # debugmodel: dim 256, 16 heads, vocab 2048


@pytest.fixture(scope="module")
def titan_tp():
    return trace_model(TITAN, parallel=layout_of(tp=2), **SMALL).graph


@pytest.fixture(scope="module")
def titan():
    return trace_model(TITAN, **SMALL).graph


def test_a_layout_is_checked_as_torchtitan_checks_it():
    layout = layout_of(fsdp=8, tp=8, pp=8, pp_schedule="interleaved-1f1b")
    assert layout.world == 512 and layout.shard_world == 8 and layout.is_parallel
    assert not layout_of(fsdp=8).is_parallel and layout_of(fsdp=4, cp=2).shard_world == 8  # FSDP shards dp_shard x cp
    for kwargs, match in [(dict(tp=0), "whole number"), (dict(async_tp=True), "Inductor pass"),
                          (dict(pp=2, pp_schedule="gpipe"), "1f1b"), (dict(pp=2, rank=2), "0 to 1"),
                          (dict(dp_replicate=2), "DDP"), (dict(pp=2, microbatches=0), "whole number")]:
        with pytest.raises(BonsaiError, match=match):
            layout_of(**kwargs)
    with pytest.raises(BonsaiError, match="divisible by the TP degree and context parallel by 2 x CP"):
        with_batch(layout_of(tp=2, cp=2), 1, 100)
    with pytest.raises(BonsaiError, match="at least as many microbatches as stages"):
        with_batch(layout_of(pp=4), 2, 64)
    assert with_batch(layout_of(pp=2), 8, 64).microbatches == 8  # one sequence each, torchtitan's default
    assert "torch.compile" in ASYNC_TP_REFUSED


def test_a_tensor_parallel_rank_holds_its_shards_and_runs_the_collectives(titan, titan_tp):
    whole = sum(b for _, b, kind in titan.fixed_tensors if kind == "param")
    local = sum(b for _, b, kind in titan_tp.fixed_tensors if kind == "param")
    norms = 5 * 256 * 4  # 2 x 2 block norms and the final norm: replicated (sequence parallel)
    assert local == (whole - norms) // 2 + norms
    ops = [titan_tp.ops[v] for v in range(titan_tp.n)]
    for collective in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):  # SP, and loss parallel
        assert any(collective in op for op in ops), collective
    assert not any("wait_tensor" in op for op in ops)  # a wait is its collective's output (an identity)
    # the embedding's gradient is replicated where its weight is sharded by vocabulary, as DTensor computes it
    grads = dict((name, b) for name, b, kind in titan_tp.fixed_tensors if kind == "grad")
    assert max(grads.values()) == 2048 * 256 * 4
    assert titan_tp.parallel == {"layout": {"fsdp": 1, "dp_replicate": 1, "tp": 2, "cp": 1, "pp": 1}}
    again = Graph.from_dict(json.loads(json.dumps(titan_tp.to_dict())))
    assert again.parallel == titan_tp.parallel and again.hash == titan_tp.hash
    assert no_remat_peak(titan_tp) < no_remat_peak(titan)


def test_tensor_parallel_under_fsdp_shards_the_local_shards_and_hsdp_shards_within_a_replica(titan_tp):
    both = trace_model(TITAN, parallel=layout_of(tp=2, fsdp=2), mixed_precision="none", **SMALL).graph
    hsdp = trace_model(TITAN, parallel=layout_of(tp=2, fsdp=2, dp_replicate=2), mixed_precision="none", **SMALL).graph
    assert both.fsdp["world"] == 2 and [u[0] for u in both.fsdp["units"]] == ["tok_embeddings", "layers.0", "layers.1",
                                                                             "norm,output"]
    local = sum(b for _, b, kind in titan_tp.fixed_tensors if kind == "param")
    assert sum(u[3] for u in both.fsdp["units"]) + both.fsdp["root_bytes"] == local  # FSDP gathers the TP shards
    assert hsdp.fixed_mem == both.fixed_mem and hsdp.parallel["layout"]["dp_replicate"] == 2


def test_hf_models_take_transformers_tp_plan_and_refuse_what_it_does_not_parallelize():
    pytest.importorskip("transformers")
    graph = trace_model("hf:llama", parallel=layout_of(tp=2), **SMALL).graph
    assert any("all_reduce" in graph.ops[v] for v in range(graph.n))  # rowwise o_proj and down_proj
    with pytest.raises(ModelError, match="torchtitan: models"):
        trace_model("hf:llama", parallel=layout_of(cp=2), **SMALL)
    with pytest.raises(ModelError, match="no tensor, context or pipeline parallel plan"):
        trace_model("gpt", parallel=layout_of(tp=2))


def test_a_context_parallel_rank_holds_its_share_of_the_sequence_and_the_ring_s_exchange():
    graph = trace_model(TITAN, parallel=layout_of(cp=2), mixed_precision="none", **SMALL).graph
    ops = [graph.ops[v] for v in range(graph.n)]
    assert "aten._scaled_dot_product_flash_attention.default" in ops  # the GPU kernel ring attention runs
    gathered = [v for v in range(graph.n) if "all_gather_into_tensor" in graph.ops[v]]
    # each block all-gathers its keys and values (torch's default rotate method), in its forward and again in its
    # backward: 2 ranks x (k, v) x batch 2 x 16 heads x 32 positions x 16 wide x 4 B
    assert len(gathered) == 4 and all(graph.mem[v] == 2 * 2 * 2 * 16 * 32 * 16 * 4 for v in gathered)
    logits = [v for v in range(graph.n) if graph.ops[v] == "aten._log_softmax.default"]
    assert graph.mem[logits[0]] == 2 * 32 * 2048 * 4  # 32 of the 64 positions


def test_a_512_gpu_mesh_traces_here():
    layout = layout_of(fsdp=8, tp=8, cp=8)
    graph = trace_model("torchtitan:llama3:8B", parallel=layout, batch=1, seq=1024, layers=1).graph
    assert layout.world == 512 and graph.fsdp["world"] == 64 and graph.parallel["layout"]["cp"] == 8
    # the embedding's gradient is whole on every rank (DTensor's), its reduce-scatter input the rank's shard
    assert int(graph.mem.max()) == 128256 * 4096 * 2


def test_cli_traces_a_layout_and_refuses_async_tp(tmp_path, capsys):
    from bonsai_core.cli import main

    out = tmp_path / "g.json"
    assert main(["trace", TITAN, "--batch", "2", "--seq", "64", "--layers", "2", "--tp", "2", "--fsdp", "2",
                 "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["parallel"]["layout"]["tp"] == 2 and data["fsdp"]["world"] == 2
    capsys.readouterr()
    assert main(["trace", TITAN, "--tp", "2", "--async-tp", "-o", str(out)]) == 1
    assert "Inductor pass" in capsys.readouterr().err


def test_the_one_call_plans_a_tensor_parallel_rank():
    import torch
    from torchtitan.models.llama3 import Transformer

    from bonsai_core.models import torchtitan as tt
    from bonsai_core.torchtitan import plan_for

    with torch.device("meta"):
        model = Transformer(tt.model_args("llama3:debugmodel", layers=2, seq=64))
    # its gradients kept: set to None, the 2-block rank's peak is its largest op's, leaving nothing to plan
    made = plan_for(model, 2, 64, "90%", tp=2, optimizer="none", grads="zeroed", cache=False)
    assert made.graph.parallel["layout"]["tp"] == 2 and made.report.predicted_peak <= made.report.budget
    assert any(path.startswith("layers.") for path in made.save)


# -- against gloo processes parallelized as the model's library does it -----------------------------------

GLOO = [("torchtitan:llama3:debugmodel", "tp2", "70%"), ("torchtitan:llama3:debugmodel", "fsdp2.tp2", "80%"),
        ("hf:llama", "tp2", "70%"), ("hf:llama", "fsdp2.tp2", "70%"),
        ("torchtitan:llama3:debugmodel", "pp2", "90%"), ("torchtitan:llama3:debugmodel", "pp2.interleaved", "97%")]
GLOO_PLAIN = ["tp2.pp2", "fsdp2.pp2", "fsdp2.pp2.interleaved"]  # without a plan: the stage is mostly parameters


@pytest.mark.slow
@pytest.mark.parametrize("model, layout, budget", GLOO)
def test_every_rank_is_predicted_within_2_percent_with_and_without_a_plan(model, layout, budget):
    """Each rank's steady-step peak against its prediction: the rank's graph without recomputation, and the one
    call's plan for the layout applied before the model is parallelized (the same loss)."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    from bonsai_core.bench import parallel as bench

    spec, options = bench.parse_layout(layout), bench.SIZES[model]
    plain = bench.measure(model, options, spec)
    planned = bench.measure(model, options, spec, budget)
    _assert_ranks_predicted(model, spec, plain)
    for rank, without in zip(planned, plain):
        assert abs(rank["peak"] / rank["predicted"] - 1) <= 0.02, (rank["peak"], rank["predicted"])
        assert rank["peak"] < without["peak"]
        if without["loss"] is not None:  # a pipeline rank without the last stage computes no loss
            assert rank["loss"] == pytest.approx(without["loss"], rel=1e-5)


def _assert_ranks_predicted(model: str, spec, measured: list[dict]) -> None:
    """Each process's peak within 2% of its pipeline rank's prediction (ranks are pp-major, as torchtitan's mesh)."""
    import dataclasses

    from bonsai_core.bench import parallel as bench

    per = spec.world // spec.pp
    for pp_rank in range(spec.pp):
        expected = bench.predicted(model, bench.SIZES[model], dataclasses.replace(spec, rank=pp_rank), None)
        for rank in measured[pp_rank * per:(pp_rank + 1) * per]:
            assert abs(rank["peak"] / expected - 1) <= 0.02, (pp_rank, rank["peak"], expected)


@pytest.mark.slow
@pytest.mark.parametrize("layout", GLOO_PLAIN)
def test_tensor_and_fsdp_under_pipeline_parallel_are_predicted_within_2_percent(layout):
    from bonsai_core.bench import parallel as bench

    model = "torchtitan:llama3:debugmodel"
    spec = bench.parse_layout(layout)
    _assert_ranks_predicted(model, spec, bench.measure(model, bench.SIZES[model], spec))


# -- pipeline parallel (bonsai_core.pipeline, the simulator's rule 11) ---------------------------------------

from bonsai_core.in_flight import FORWARD, working  # noqa: E402
from bonsai_core.in_flight import actions  # noqa: E402
from bonsai_core.schedule import none_schedule, simulate  # noqa: E402

PIPE = dict(batch=4, seq=64, layers=4)  # 4 microbatches of one sequence


@functools.cache
def pipe_rank(rank: int, batch: int = PIPE["batch"], **layout) -> Graph:
    """Pipeline rank ``rank`` of the 4-layer debugmodel at ``batch`` (a microbatch a sequence) in a PP 2 layout
    with ``layout``'s other degrees, traced once for the module's tests (which read it and never change it)."""
    return trace_model(TITAN, parallel=layout_of(pp=2, rank=rank, **layout), batch=batch, seq=PIPE["seq"],
                       layers=PIPE["layers"]).graph


def _in_flight(acts, local: int) -> int:
    held = top = 0
    for phase, k, _ in acts:
        if k == local:
            held += 1 if phase == FORWARD else -1
            top = max(top, held)
    return top


def test_1f1b_holds_min_m_p_minus_r_microbatches_and_interleaved_runs_torch_s_order():
    for pp, m in ((4, 4), (4, 8), (8, 32)):
        for rank in range(pp):
            acts = actions(with_batch(layout_of(pp=pp, rank=rank), m, 64))
            assert _in_flight(acts, 0) == min(m, pp - rank)
            assert sorted(j for phase, _, j in acts if phase == FORWARD) == list(range(m))
    # torch 2.13's ScheduleInterleaved1F1B, rank 0 of 4 with 8 microbatches: (v - 1) x 4 + 2 x 3 = 10 warm-up
    # forwards, then a forward and a backward in turn
    acts = actions(with_batch(layout_of(pp=4, pp_schedule="interleaved-1f1b"), 8, 64))
    assert [phase for phase, _, _ in acts[:13]] == [FORWARD] * 11 + ["B", FORWARD]
    assert {(k, sum(1 for p, kk, _ in acts if kk == k and p == FORWARD)) for k in (0, 1)} == {(0, 8), (1, 8)}


@pytest.fixture(scope="module")
def pipe_ranks():
    return [pipe_rank(r) for r in (0, 1)]


def test_a_pipeline_rank_is_its_stage_with_receive_buffers_and_the_microbatches_in_flight(pipe_ranks):
    first, last = pipe_ranks
    for graph, rank in ((first, 0), (last, 1)):
        pipeline = graph.parallel["pipeline"]
        assert pipeline["stages"] == [[rank, 0, graph.n - 1]] and pipeline["microbatches"] == 4
        again = Graph.from_dict(json.loads(json.dumps(graph.to_dict())))
        assert again.parallel == graph.parallel
    hidden = 64 * 256 * 4  # one sequence's fp32 hidden state
    received = {g: {name: b for name, b, kind in g.fixed_tensors if kind == "pipeline"} for g in pipe_ranks}
    assert list(received[first].values()) == [4 * hidden]  # the gradients of its 4 microbatches' outputs
    assert list(received[last].values()) == [3 * hidden]  # the activations of the 3 other microbatches
    # rule 11: stage 0 holds 2 microbatches in flight in 1F1B (min(4, 2 - 0)): a backward runs with one other
    ops = none_schedule(first).ops
    sim = simulate(first, ops)
    extra = working(first, ops, sim.residency)
    backward = [i for i, (kind, v) in enumerate(ops) if kind == "compute" and not first.is_forward[v]]
    own_at_end = int(sim.residency.bytes_held(first.mem)[backward[0] - 1])  # what a microbatch leaves for its backward
    assert own_at_end > 0 and all(extra[i] == own_at_end for i in backward)


def test_cli_traces_a_pipeline_rank(tmp_path):
    from bonsai_core.cli import main

    out = tmp_path / "g.json"
    assert main(["trace", TITAN, "--batch", "4", "--seq", "64", "--layers", "4", "--pp", "2", "--rank", "1",
                 "--pp-schedule", "interleaved-1f1b", "-o", str(out)]) == 0
    pipeline = json.loads(out.read_text())["parallel"]["pipeline"]
    assert [s[0] for s in pipeline["stages"]] == [1, 3] and pipeline["schedule"] == "interleaved-1f1b"


def test_the_one_call_plans_a_pipeline_rank_and_each_model_part_takes_its_paths():
    import torch
    from torchtitan.models.llama3 import Transformer

    from bonsai_core.models import torchtitan as tt
    from bonsai_core.torchtitan import plan_for

    with torch.device("meta"):
        model = Transformer(tt.model_args("llama3:debugmodel", layers=4, seq=64))
    # its gradients kept: set to None, the stage's peak is its largest op's, leaving nothing to plan
    made = plan_for(model, 4, 64, "90%", pp=2, rank=1, optimizer="none", grads="zeroed", cache=False)
    assert made.report.pipeline_stages == [1] and made.report.predicted_peak <= made.report.budget
    assert made.save and all(p.startswith(("layers.2", "layers.3", "norm", "output")) for p in made.save)
    with torch.device("meta"):
        first_stage = Transformer(tt.model_args("llama3:debugmodel", layers=4, seq=64))
    del first_stage.layers["2"], first_stage.layers["3"]
    made.apply(first_stage)  # none of the plan's paths: nothing checkpointed, no error
    assert not any("checkpoint" in type(m).__name__.lower() for m in first_stage.modules())


@pytest.mark.parametrize("tp", sweep([2, 1]))  # a TP rank in the default run, one device in the slow stage
def test_a_deep_model_s_rank_is_three_blocks_repeated_node_for_node(tp):
    from bonsai_core.fit import deepen

    extra = dict(parallel=layout_of(tp=tp)) if tp > 1 else {}
    three = trace_model(TITAN, batch=1, seq=64, layers=3, **extra).graph
    six = trace_model(TITAN, batch=1, seq=64, layers=6, **extra).graph
    block = (sum(b for _, b, k in six.fixed_tensors if k == "param")
             - sum(b for _, b, k in three.fixed_tensors if k == "param")) // 3
    deep = deepen(three, 6, block)
    assert deep.n == six.n and deep.fixed_mem == six.fixed_mem
    assert [deep.ops[v] for v in range(deep.n)] == [six.ops[v] for v in range(six.n)]
    assert all(list(deep.deps(v)) == list(six.deps(v)) for v in range(six.n))
    assert no_remat_peak(deep) == no_remat_peak(six)


def test_fit_s_layouts_are_what_torchtitan_accepts():
    from bonsai_core.fit import candidate_layouts

    layouts = candidate_layouts(256, 80, 64, 8, 8192)  # Llama 3.1 70B
    assert {l.tp for l in layouts} == {1, 2, 4, 8} and {l.pp for l in layouts} == {1, 2, 4, 8}
    assert all(l.world == 256 and l.cp == 1 for l in layouts)  # context parallel for long sequences only
    assert any(l.dp_replicate == 4 and l.fsdp == 8 and l.tp == 8 for l in layouts)  # HSDP within a node
    assert {l.cp for l in candidate_layouts(8, 32, 32, 8, 262144)} == {1, 2, 4, 8}


@pytest.mark.slow
def test_fit_over_layouts_shares_traces_and_matches_whole_traces():
    import dataclasses

    from bonsai_core.fit import RankGraphs, fit_layouts
    from bonsai_core.fsdp import Sharding
    from bonsai_core.optimizer import with_training_loop

    for reshard in ("torchtitan", "all-but-last"):  # all-but-last: the root holds the embedding and the head
        graphs = RankGraphs(TITAN, 64, {"layers": 6}, Sharding.of(2, reshard, None, model=TITAN), {})
        for layout in (layout_of(fsdp=4, tp=2), layout_of(fsdp=2, tp=2, pp=2, pp_schedule="interleaved-1f1b")):
            for rank, graph in graphs.ranks(layout, 4, "adamw"):
                spec = dataclasses.replace(layout, rank=rank)
                whole = with_training_loop(trace_model(TITAN, parallel=spec, batch=4, seq=64, layers=6,
                                                       reshard_after_forward=reshard if layout.pp == 1 else None).graph,
                                           TITAN, "adamw")
                assert (graph.n, no_remat_peak(graph), graph.fixed_mem) == \
                    (whole.n, no_remat_peak(whole), whole.fixed_mem)
    result = fit_layouts(TITAN, 8, 40 * 2**20, seq=64, options={"layers": 6})
    best = result.best()
    assert best and all(f.fits and f.peak <= 40 * 2**20 for f in best)
    assert best[0].tokens_per_gpu == max(f.tokens_per_gpu for f in best)


def test_the_allocator_replays_a_pipeline_rank_s_whole_schedule_at_the_simulator_s_live_peak(pipe_ranks):
    """The allocator model runs every microbatch's actions in the schedule's order (bonsai_core.allocator.
    pipelined); the bytes its blocks hold peak where rule 11's envelope does, FSDP's gradients included."""
    from bonsai_core.allocator import bounded_replay

    ranks = list(pipe_ranks) + [pipe_rank(r, **extra) for extra in (dict(pp_schedule="interleaved-1f1b"), dict(fsdp=2))
                                for r in (0, 1)]
    for graph in ranks:
        ops = none_schedule(graph).ops
        replayed = bounded_replay(graph, ops, "expandable")
        sim = simulate(graph, ops)
        assert replayed.peak == sim.peak
        assert list(replayed.live) == list(sim.timeline)  # op for op, the most over the actions that run it
        assert replayed.reserved_peak >= replayed.peak


def test_an_interleaved_rank_under_hsdp_and_tp_reduce_scatters_each_stage_after_its_last_backward():
    """Interleaved 1F1B under HSDP x FSDP x TP on the fake process group. torch 2.13 runs a stage's
    perform_reduce_grad right after its last backward (``_add_reduce_grad``), so a rank's later stage has its
    gradients reduce-scattered and freed while its earlier stage still runs backwards, and the last input is freed
    by the stage's final callback. Rule 11 and the allocator's replay of the whole step count the same bytes op
    for op, the reduce-scatters included, with and without recompute, and the allocator reserves at least the
    live bytes. (Rule 11 once counted every stage's gradients at the end of the step, and the replay kept the
    last reduce-scatter input to the next stage's: the 70B fit's HSDP 4 x FSDP 8 x TP 2 x PP 4 row reported
    a live peak above its reserved peak.)"""
    from bonsai_core.allocator import bounded_replay
    from bonsai_core.in_flight import BACKWARD
    from bonsai_core.solvers import solve

    for rank in (0, 1):
        layout = layout_of(dp_replicate=2, fsdp=2, tp=2, pp=2, pp_schedule="interleaved-1f1b", rank=rank)
        graph = trace_model(TITAN, parallel=layout, **PIPE).graph
        acts = graph.parallel["pipeline"]["actions"]
        last = {k: n for n, (phase, k, _) in enumerate(acts) if phase == BACKWARD}
        assert graph.fsdp is not None and min(last.values()) < len(acts) - 1  # a stage reduced before the end
        full = solve(graph, None, "torchtitan-full")
        for ops in (none_schedule(graph).ops, full.ops):
            replayed = bounded_replay(graph, ops, "expandable")
            sim = simulate(graph, ops)
            assert list(replayed.live) == list(sim.timeline)
            assert replayed.peak == sim.peak <= replayed.reserved_peak


def test_a_tensor_parallel_rank_s_optimizer_state_has_its_parameters_bytes(titan_tp):
    """Eager tensor parallel (no FSDP): DTensor's embedding backward leaves tok_embeddings' gradient replicated, the
    whole vocabulary on each rank, while torch's AdamW makes its state zeros_like the parameter, sharded by rows
    (gloo, TP 2, the debugmodel: the gradient Replicate, 2 MiB local, exp_avg Shard(0), 1 MiB), and so are the
    step's temporaries."""
    from bonsai_core.optimizer import with_optimizer

    stepped = with_optimizer(titan_tp, "adamw")
    sizes = {(name, kind): nbytes for name, nbytes, kind in stepped.fixed_tensors}
    params = {name: nbytes for (name, kind), nbytes in sizes.items() if kind == "param"}
    replicated = [name for name in params if sizes[f"{name}.grad", "grad"] == 2 * params[name]]
    assert len(replicated) == 1  # the embedding's
    for name, nbytes in params.items():
        assert sizes[f"{name}.exp_avg", "optimizer"] == sizes[f"{name}.exp_avg_sq", "optimizer"] == nbytes
    assert stepped.optimizer["step_bytes"] == sum(params.values())  # _foreach_sqrt(exp_avg_sq)


# gloo's peak live bytes of pipeline ranks 0 and 1: `bonsai bench parallel --layout fsdp2.pp2.interleaved.mb2
# --batch 2 --seq 16` (torch 2.13, docs/bench/parallel.md)
GLOO_INTERLEAVED_FSDP = (23_330_688, 24_282_888)


def test_an_interleaved_fsdp_rank_gives_back_each_stage_s_parameters_and_keeps_its_first_gradients_as_made():
    """fp32 FSDP under interleaved 1F1B, where the gradients dominate (debugmodel, batch 2, seq 16): without a
    cast AccumulateGrad keeps each gradient of a stage's first backward as .grad (no unit counted at once at a
    post-backward the simulator places early), and each stage's perform_reduce_grad reshards its parameters
    through the rank's later actions and the optimizer step. Both ranks' peaks are gloo's within 0.5%, and the
    replay of the whole step counts rule 11's bytes op for op, with and without recompute."""
    import dataclasses

    from bonsai_core.allocator import bounded_replay
    from bonsai_core.bench.parallel import parse_layout, rank_graph
    from bonsai_core.graph import UNSHARDED_TO_REDUCE
    from bonsai_core.optimizer import with_optimizer
    from bonsai_core.solvers import solve

    options = dict(batch=2, seq=16, layers=4)
    for rank, measured in enumerate(GLOO_INTERLEAVED_FSDP):
        layout = with_batch(dataclasses.replace(parse_layout("fsdp2.pp2.interleaved.mb2"), rank=rank), 2, 16)
        graph = rank_graph(TITAN, options, layout)
        assert abs(no_remat_peak(graph) / measured - 1) < 0.005
        for ops in (none_schedule(graph).ops, solve(graph, None, "torchtitan-full").ops):
            replayed = bounded_replay(graph, ops, "expandable")
            sim = simulate(graph, ops)
            assert list(replayed.live) == list(sim.timeline)
            assert replayed.peak == sim.peak <= replayed.reserved_peak
        stepped = with_optimizer(graph, "adamw")
        unsharded = sum(t[1] for t in graph.fixed_tensors if t[0] == UNSHARDED_TO_REDUCE)
        assert stepped.optimizer_peak == stepped.fixed_mem - unsharded + stepped.optimizer["step_bytes"]


def test_fit_judges_pipeline_layouts_by_their_reserved_bytes():
    """Under --reserved a pipeline layout is judged as any other: each rank's plan within the limit of the bytes
    the allocator reserves over its whole schedule."""
    from bonsai_core.allocator import bounded_replay
    from bonsai_core.fit import RankGraphs, _fit_layout, method_variant
    from bonsai_core.fsdp import Sharding

    graphs = RankGraphs(TITAN, 64, {"layers": 6}, Sharding.of(2, None, None, model=TITAN), {})
    layout = layout_of(pp=2)
    ranks = graphs.ranks(layout, 2, "adamw")
    reserved = max(bounded_replay(g, none_schedule(g).ops, "expandable").reserved_peak for _, g in ranks)
    judged = [_fit_layout(graphs, layout, 2, 64, ["none"], {"none": method_variant("none")}, limit, "expandable",
                          1.0, {}, "adamw") for limit in (reserved, reserved - 2**20)]
    assert judged[0].fits and judged[0].reserved_peak == reserved
    assert not judged[1].fits and "none" in judged[1].reason


def test_a_rank_s_stages_sharing_one_trace_keep_their_own_fsdp_units():
    """Interleaved 1F1B on 4 ranks: rank 1 runs stages 1 and 5 of 8, both middle stages, which fit traces once;
    each keeps its own blocks' paths, so FSDP's units (and rule 11's gradients per stage) are the whole trace's."""
    import dataclasses

    from bonsai_core.fit import RankGraphs
    from bonsai_core.fsdp import Sharding

    layout = layout_of(fsdp=2, pp=4, pp_schedule="interleaved-1f1b")
    graphs = RankGraphs(TITAN, 64, {"layers": 14}, Sharding.of(2, None, None, model=TITAN), {})
    graph = dict(graphs.ranks(layout, 4, "adamw"))[1]
    whole = trace_model(TITAN, parallel=dataclasses.replace(layout, rank=1), batch=4, seq=64, layers=14).graph
    assert [u[:3] for u in graph.fsdp["units"]] == [u[:3] for u in whole.fsdp["units"]]
    stages = graph.parallel["pipeline"]["stages"]
    assert {k for k, (_, a, b) in enumerate(stages) for u in graph.fsdp["units"] if a <= u[1] <= b} == {0, 1}


def _whole_step(graph, policy: str, shortcut: bool):
    """The reserved bytes, largest free block and live bytes after every op of a pipeline rank's whole step, and the
    actions the steady-phase shortcut skipped."""
    import numpy as np

    from bonsai_core.allocator.pipelined import rank_length, run_pipeline_step
    from bonsai_core.allocator.policies import Allocator

    ops = none_schedule(graph).ops
    n = rank_length(graph, ops)
    reserved, largest, live = (np.zeros(n, dtype=np.int64) for _ in range(3))
    skipped = run_pipeline_step(Allocator(None, policy), graph, ops, simulate(graph, ops).residency, None,
                                (reserved, largest), live=live, shortcut=shortcut)
    return (reserved, largest, live), skipped


# the pipeline layouts the replay shortcuts are checked on: plain 1F1B in the default run, interleaved 1F1B and FSDP
# in the slow stage (the whole replay of both is checked in the default run by the test above)
PIPE_LAYOUTS = sweep([pytest.param({}, id="1f1b"), pytest.param(dict(pp_schedule="interleaved-1f1b"), id="interleaved"),
                      pytest.param(dict(fsdp=2), id="fsdp")])


@pytest.mark.parametrize("extra", PIPE_LAYOUTS)
def test_the_replay_skips_steady_windows_that_repeat_and_gives_the_full_replay_s_every_byte(extra):
    """Rule 11's steady-phase shortcut (bonsai_core.allocator.pipelined): where a window of the steady phase ends
    in the state an earlier window ended in (microbatches named relative to the window's first), the windows
    between repeat to the end of the run and are copied, not replayed. Op for op the same reserved, largest free
    and live bytes as the full replay, for a schedule and layout, several microbatch counts; 1F1B's last rank
    (one microbatch in flight) reaches its fixed point at once."""
    import numpy as np

    skipped = {}
    for m in (4, 16):
        for r in (0, 1):
            graph = pipe_rank(r, m, **extra)
            for policy in ("caching", "expandable"):
                full, none = _whole_step(graph, policy, shortcut=False)
                short, skipped[m, r, policy] = _whole_step(graph, policy, shortcut=True)
                assert none == 0
                assert all(np.array_equal(a, b) for a, b in zip(full, short)), (m, r, policy)
    if "pp_schedule" not in extra:  # 1F1B's last rank: 26 of its 32 actions skipped
        assert skipped[16, 1, "caching"] == skipped[16, 1, "expandable"] == 26


def test_a_replay_shortcut_whose_key_names_no_state_is_caught(monkeypatch):
    """A key that leaves out the addresses would skip too little (here: nothing) skips windows that do not
    repeat: it takes the first window (where the pool still grows) for every later one, and the comparison
    with the full replay catches it."""
    import numpy as np

    import bonsai_core.allocator.pipelined as pipelined

    graph = pipe_rank(0, 16)
    full, _ = _whole_step(graph, "caching", shortcut=False)
    monkeypatch.setattr(pipelined, "_state", lambda alloc, held, grads, n, first: ())
    blind, skipped_blind = _whole_step(graph, "caching", shortcut=True)
    assert skipped_blind > 0 and not all(np.array_equal(a, b) for a, b in zip(full, blind))


def _bounded(graph, schedule):
    """The bounded replay's bytes (reserved, largest free, live per op) and its peaks."""
    from bonsai_core.allocator import bounded_replay

    r = bounded_replay(graph, schedule, "expandable")
    return (r.reserved, r.largest_free, r.live), (r.reserved_peak, r.peak, r.fragmentation, r.segments)


@pytest.mark.parametrize("extra", PIPE_LAYOUTS)
def test_a_replay_at_more_microbatches_starts_where_the_shorter_one_parts_and_gives_a_fresh_replay_s_bytes(
        extra, monkeypatch):
    """The pipeline replay without a capacity (bonsai_core.allocator.pipelined._Prefix): a run at twice the
    microbatches begins with the shorter run's actions, so it starts from the shorter run's state where they part
    instead of replaying them. Op for op the same bytes as a replay from an empty pool, for a schedule and layout,
    every rank, doubling microbatches as fit's batch search does."""
    import numpy as np

    import bonsai_core.allocator.pipelined as pipelined
    from bonsai_core.solvers import solve

    restored = []
    restore = pipelined._Prefix.restore
    monkeypatch.setattr(pipelined._Prefix, "restore", lambda self, *a: restored.append(1) or restore(self, *a))
    monkeypatch.setattr(pipelined, "_PREFIXES", pipelined._Prefixes())
    for r in (0, 1):
        for m in (2, 4, 8):
            graph = pipe_rank(r, m, **extra)
            plan = solve(graph, 10**12, "torchtitan-full")
            resumed = _bounded(graph, plan)
            kept, pipelined._PREFIXES = pipelined._PREFIXES, pipelined._Prefixes()
            fresh = _bounded(graph, plan)
            pipelined._PREFIXES = kept
            assert resumed[1] == fresh[1] and all(np.array_equal(a, b) for a, b in zip(resumed[0], fresh[0])), (r, m)
    assert len(restored) == 2 * 2  # every run after the first of each rank


def test_a_replay_prefix_kept_for_another_plan_is_caught(monkeypatch):
    """A prefix kept for another plan (a key that leaves the plan out: the plain step's taken up by the
    checkpointed one) gives other bytes, and the comparison with a fresh replay catches it."""
    import bonsai_core.allocator.pipelined as pipelined
    from bonsai_core.solvers import solve

    monkeypatch.setattr(pipelined, "_structure_key", lambda graph, ops, residency, policy, inplace, largest=True: "one")
    monkeypatch.setattr(pipelined, "_PREFIXES", pipelined._Prefixes())
    small = pipe_rank(0, 4)
    _bounded(small, none_schedule(small))
    graph = pipe_rank(0, 8)
    plan = solve(graph, 10**12, "torchtitan-full")
    try:
        wrong = _bounded(graph, plan)[1]
    except ValueError:  # a block the plain step kept is one the checkpointed step allocates again
        wrong = None
    monkeypatch.setattr(pipelined, "_PREFIXES", pipelined._Prefixes())
    assert wrong != _bounded(graph, plan)[1]


def test_a_pipeline_replay_stops_where_its_reserved_bytes_pass_a_limit_and_a_fixed_plan_is_judged_the_same(pipe_ranks):
    """A replay without a capacity never gives bytes back, so one that passes a limit peaks past it: the replay may
    stop there (stop_above), and solve_reserved stops a fixed plan's replay so, refusing what the whole replay
    refuses and keeping what it keeps, with the same reserved peak. Leaving the largest free block out changes no
    other number."""
    from bonsai_core.allocator import bounded_replay
    from bonsai_core.allocator.pipelined import ReservedPast
    from bonsai_core.solvers import solve_reserved

    for graph in pipe_ranks:
        ops = none_schedule(graph).ops
        whole = bounded_replay(graph, ops, "expandable")
        lean = bounded_replay(graph, ops, "expandable", largest_free=False)
        assert (list(lean.reserved), list(lean.live), lean.reserved_peak, lean.peak) == \
            (list(whole.reserved), list(whole.live), whole.reserved_peak, whole.peak) and not lean.largest_free.any()
        assert bounded_replay(graph, ops, "expandable", stop_above=whole.reserved_peak).reserved_peak == whole.reserved_peak
        start = graph.fixed_mem  # passed by the first action's blocks
        with pytest.raises(ReservedPast) as past:
            bounded_replay(graph, ops, "expandable", stop_above=start)
        assert start < past.value.reserved <= whole.reserved_peak
        kept = solve_reserved(graph, whole.reserved_peak, "none", policy="expandable")
        assert kept.stats["reserved_peak"] == whole.reserved_peak
        with pytest.raises(BudgetError, match="reserves at most"):
            solve_reserved(graph, whole.reserved_peak - 1, "none", policy="expandable")
