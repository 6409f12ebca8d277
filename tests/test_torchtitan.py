"""torchtitan's Llama 3 as a model source (``torchtitan:llama3:FLAVOUR``), its activation checkpointing as
methods (``torchtitan-full``, ``torchtitan-selective``), and a bonsai plan applied to its model before
its ``fully_shard`` on 2 gloo ranks (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

from bonsai_core.errors import BonsaiError, BudgetError, ModelError, SolverError  # noqa: E402
from bonsai_core.graph import block_stack  # noqa: E402
from bonsai_core.schedule import no_remat_peak, simulate  # noqa: E402
from bonsai_core.solvers import solve  # noqa: E402
from bonsai_core.solvers.torchtitan import selective_plan  # noqa: E402
from bonsai_core.trace import trace_model  # noqa: E402
from tests.graphs import chain  # noqa: E402

TITAN = "torchtitan:llama3:debugmodel"
SMALL = dict(batch=2, seq=64, layers=2)  # debugmodel: dim 256, 16 heads, vocab 2048
FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


@pytest.fixture(scope="module")
def titan():
    return trace_model(TITAN, **SMALL).graph


def test_torchtitan_llama_traces_its_blocks_flash_attention_and_float32_loss(titan):
    assert [path for path, _, _ in block_stack(titan)] == ["layers.0", "layers.1"]
    ops = [titan.ops[v] for v in range(titan.n) if titan.is_forward[v]]
    assert ops.count(FLASH) == 2  # SDPA recorded as the fused kernel: output and logsumexp, no seq x seq
    assert ops.count("aten.mm.default") == 2 * 7 + 1  # wq wk wv wo w1 w3 w2 per block, and the output
    # torchtitan's loss: cross-entropy on the logits upcast to float32 (2 x 64 tokens x 2048 vocabulary)
    logsoftmax = [v for v in range(titan.n) if titan.ops[v] == "aten._log_softmax.default"]
    assert len(logsoftmax) == 1 and titan.mem[logsoftmax[0]] == 2 * 64 * 2048 * 4


def test_sizes_apply_and_bad_specs_are_refused_clearly():
    grouped = trace_model("torchtitan:llama3:8B", batch=1, seq=32, layers=1, width=256, heads=8, vocab=128).graph
    assert len(block_stack(grouped)) == 1
    for spec, options, match in [("torchtitan:llama3:9B", {}, "no flavour '9B'"),
                                 ("torchtitan:gpt:8B", {}, "llama3:FLAVOUR"),
                                 (TITAN, {"image": 32}, "no option 'image'"),
                                 (TITAN, {"heads": 3}, "multiple of 3"),
                                 (TITAN, {"seq": 0}, "positive whole number")]:
        with pytest.raises(ModelError, match=match):
            trace_model(spec, **options)


def test_selective_saves_every_other_matmul_and_the_attention_of_each_block(titan):
    plan = selective_plan(titan)
    blocks = block_stack(titan)
    assert len(plan.recomputed) == len(blocks) and len(plan.segments) == len(blocks) + 2
    for i in sorted(plan.recomputed):
        mms = [v for v in plan.segments[i] if titan.ops[v] == "aten.mm.default"]
        saved = sorted(v for v in plan.saved if v in set(plan.segments[i]))
        # wq, wv, w1, w2 saved (the 1st, 3rd, 5th and 7th mm); wk, wo, w3 recomputed; the attention saved
        assert saved == sorted([*mms[0::2], *(v for v in plan.segments[i] if titan.ops[v] == FLASH)])
    # the Dec-2024 list makes the same plan on this model (it differs in ops a Llama step does not run)
    assert selective_plan(titan, "2024-12") == plan


def test_full_recomputes_more_than_selective_and_both_are_fixed_plans(titan):
    none, full, selective = (solve(titan, None, m) for m in ("none", "torchtitan-full", "torchtitan-selective"))
    assert full.stats["peak"] < selective.stats["peak"] < none.stats["peak"]
    assert full.stats["overhead"] > selective.stats["overhead"] > 0
    assert solve(titan, no_remat_peak(titan), "torchtitan-selective").ops == selective.ops  # the budget changes nothing
    with pytest.raises(BudgetError, match=str(selective.stats["peak"])):
        solve(titan, selective.stats["peak"] - 1, "torchtitan-selective")


@pytest.mark.parametrize("model, options", [("hf:llama", {}), ("gpt", {})])
def test_the_methods_plan_any_block_stack_and_refuse_a_graph_without_one(model, options):
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    graph = trace_model(model, **options).graph
    for method in ("torchtitan-full", "torchtitan-selective"):
        schedule = solve(graph, None, method)
        assert simulate(graph, schedule).peak == schedule.stats["peak"] < no_remat_peak(graph)
    with pytest.raises(SolverError, match="block stack"):
        solve(chain(5), None, "torchtitan-selective")


def test_cli_traces_torchtitan_and_solves_and_fits_with_its_methods(tmp_path, capsys):
    from bonsai_core.cli import main

    graph, schedule = tmp_path / "g.json", tmp_path / "s.json"
    assert main(["trace", TITAN, "--batch", "1", "--seq", "32", "--layers", "2", "--fsdp", "2", "--optimizer", "adamw",
                 "-o", str(graph)]) == 0
    capsys.readouterr()
    assert main(["solve", str(graph), "--method", "torchtitan-selective", "--budget", "100%", "--json",
                 "-o", str(schedule)]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["status"] == "fixed"
    from bonsai_core.fit import attempt
    from bonsai_core.graph import load_graph

    below = attempt(load_graph(graph), 1, "torchtitan-selective", fixed["peak"] - 1, 1.0, None, {})
    assert not below.fits and below.reason == "its fixed plan peaks over the limit"  # not "no schedule" found
    assert main(["fit", TITAN, "--seq", "32", "--layers", "2", "--gpu", "60MiB", "--methods", "torchtitan-full",
                 "torchtitan-selective", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert "torchtitan-selective" in json.dumps(fitted)
    assert main(["trace", "torchtitan:llama3:nope", "-o", str(graph)]) != 0
    assert "flavours" in capsys.readouterr().err


def test_a_torchtitan_step_sets_its_gradients_to_none_wherever_its_graph_gets_its_optimizer(tmp_path):
    """torchtitan's trainer calls optimizers.zero_grad() (set_to_none=True): a debugmodel rank's graph with its
    optimizer has no gradient buffers, whichever way it is built (the ranks fit and the published rows plan,
    ``bonsai trace``, ``plan_for``), and the published page predicts its peak from it: the peak of the traced rank
    with its optimizer and gradients set to None, below the peak with them fixed (the peak is in the loss's backward,
    before any sharded gradient is made). A model of any other library keeps its gradients as traced."""
    import dataclasses

    from bonsai_core.bench.published import predict_rank
    from bonsai_core.cli import main
    from bonsai_core.fit import RankGraphs
    from bonsai_core.fsdp import Sharding
    from bonsai_core.graph import load_graph
    from bonsai_core.optimizer import grads_of, with_grads_set_to_none, with_optimizer
    from bonsai_core.parallel import layout_of
    from bonsai_core.torchtitan import plan_for
    from torchtitan.models.llama3 import Transformer

    from bonsai_core.models import torchtitan as tt

    layout = layout_of(fsdp=2)
    graphs = RankGraphs(TITAN, 64, {"layers": 2}, Sharding.of(2, None, None, model=TITAN), {})
    [(_, graph)] = graphs.ranks(layout, 2, "adamw")
    zeroed = with_optimizer(graphs.graph(dataclasses.replace(layout, rank=0), 2), "adamw")
    assert graph.grads_set_to_none == sum(b for _, b, kind in zeroed.fixed_tensors if kind == "grad") > 0
    assert not [t for t in graph.fixed_tensors if t[2] == "grad"]

    def full_peak(g):
        return simulate(g, solve(g, None, "torchtitan-full")).peak

    [row] = predict_rank(graphs, {"fsdp": 2}, 2)
    assert row["live_peak"] == full_peak(with_grads_set_to_none(zeroed)) == full_peak(graph) < full_peak(zeroed)

    out = tmp_path / "g.json"
    for extra, set_to_none in (([], True), (["--grads", "zeroed"], False)):
        assert main(["trace", TITAN, "--batch", "2", "--seq", "64", "--layers", "2", "--fsdp", "2",
                     "--optimizer", "adamw", *extra, "-o", str(out)]) == 0
        assert bool(load_graph(out).grads_set_to_none) is set_to_none
    with torch.device("meta"):
        model = Transformer(tt.model_args("llama3:debugmodel", layers=2, seq=64))
    assert plan_for(model, 2, 64, "100%", fsdp=2, optimizer="adamw", cache=False).graph.grads_set_to_none > 0
    assert (grads_of(TITAN), grads_of("hf:llama"), grads_of(TITAN, "zeroed")) == ("none", "zeroed", "zeroed")


def test_a_plan_is_made_for_a_model_torchtitan_built_on_the_meta_device():
    from torchtitan.models.llama3 import Transformer

    from bonsai_core.models import torchtitan as tt
    from bonsai_core.torchtitan import plan_for

    with torch.device("meta"):
        model = Transformer(tt.model_args("llama3:debugmodel", layers=2, seq=128))
    made = plan_for(model, 2, 128, "90%", fsdp=2, optimizer="none", cache=False)  # bf16, as torchtitan shards
    # the blocks' parts, and in bf16 also the final norm (recomputing its fp32 upcast)
    assert made.save and {path.split(".")[0] for path in made.save} <= {"layers", "norm"}
    assert any(path.startswith("layers.") for path in made.save)
    made.apply(model)
    assert all(path in dict(model.named_modules()) for path in made.save)
    with pytest.raises(BonsaiError, match="already checkpointed"):
        made.apply(model)


@pytest.mark.slow
def test_the_8b_flavour_at_its_published_size_per_rank():
    """Llama 3 8B's blocks at batch 2, seq 8192 on one of 8 ranks (2 of its 32 blocks, to stay quick):
    flash attention keeps no seq x seq tensor, selective saves 5 nodes per block and lies between full
    and no recomputation, and bonsai at selective's peak recomputes no more than selective."""
    graph = trace_model("torchtitan:llama3:8B", batch=2, seq=8192, layers=2, fsdp=8).graph
    assert int(graph.mem.max()) < 2 * 8192 * 128256 * 4 + 1  # the largest tensor: the float32 logits
    selective = solve(graph, None, "torchtitan-selective")
    assert selective.stats["saved"] == 2 * 5
    full = solve(graph, None, "torchtitan-full")
    assert full.stats["peak"] < selective.stats["peak"] < no_remat_peak(graph)
    bonsai = solve(graph, selective.stats["peak"], "bonsai", time_limit=60)
    assert bonsai.stats["overhead"] <= selective.stats["overhead"] + 1e-9


# -- a bonsai plan in torchtitan's run, on 2 gloo ranks -------------------------------------------

GLOO = dict(batch=2, seq=128, layers=3)
BUDGET = "85%"  # fully_shard on each block (fp32) meets no less than 80.03% of its no-remat peak


@pytest.mark.slow
@pytest.mark.parametrize("grads,loop", [(None, "none"), ("zeroed", "zeroed")])
def test_a_rank_sharded_in_torchtitan_s_units_and_run_in_its_loop_is_predicted_to_the_byte(grads, loop):
    """torchtitan's units (``fully_shard`` on each as its apply_fsdp makes them, bf16 parameters, fp32 reduce) on 2
    gloo ranks, a first step, the gradients then set to None as torchtitan's loop leaves them (``grads`` None: the
    model's own loop) or kept, then one measured: its peak is the prediction's within 0.01% (512 bytes measured)."""
    from bonsai_core.bench import fsdp as fsdp_check
    from bonsai_core.optimizer import with_training_loop

    _, graph, units = fsdp_check.fsdp_graph(TITAN, GLOO, 2, "torchtitan", "bf16")
    measured = max(r["peak"] for r in fsdp_check.measure(TITAN, GLOO, 2, units, None, "torchtitan", "bf16", grads=loop))
    predicted = no_remat_peak(with_training_loop(graph, TITAN, "none", grads))
    assert abs(measured / predicted - 1) <= 1e-4, (measured, predicted)


def _run_ways(rank: int, out_dir: str, store: str, results: str, mixed_precision: str | None = None) -> None:
    """One rank: the same step (a first one, its gradients then set to None as torchtitan's loop leaves them, then
    one measured) three ways: torchtitan's own selective
    checkpointing and FSDP (``apply_ac``, ``apply_fsdp``); bonsai's plan for torchtitan's sharding applied
    in place of ``apply_ac``, then torchtitan's ``apply_fsdp``; in fp32 also bonsai's plan for
    ``fully_shard`` on each block and on the model, sharded so. ``mixed_precision``: apply_fsdp's
    param_dtype (reduce_dtype fp32), as torchtitan's default is "bf16". Rank 0 writes the losses,
    gradients, peaks and predictions."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_fsdp

    from bonsai_core import models
    from bonsai_core.measure_parallel import steady_step_peak
    from bonsai_core.torchtitan import plan_for
    from tests.distributed import WORLD, join_group

    join_group(rank, store)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        _, inputs, loss_fn = models.build(TITAN, seed=100 + rank, **GLOO)  # each rank its own batch
        made = {way: plan_for(models.build(TITAN, seed=0, **GLOO)[0], GLOO["batch"], GLOO["seq"], BUDGET,
                              fsdp=WORLD, optimizer="none", reshard_after_forward=reshard,
                              mixed_precision=mixed_precision or "none", cache=False)
                for way, reshard in (("bonsai", "torchtitan"), ("bonsai-blocks", True))
                if way == "bonsai" or not mixed_precision}  # fully_shard's own sharding: in fp32 only
        out = {"predicted": {way: m.report.predicted_peak for way, m in made.items()},
               "regions": {way: m.report.regions for way, m in made.items()}}
        for way in ("torchtitan", *made):
            net = models.build(TITAN, seed=0, **GLOO)[0]
            if way == "torchtitan":
                apply_ac(net, ActivationCheckpoint(mode="selective", selective_ac_option="op"),
                         op_sac_save_list=_op_sac_save_list)
            else:
                made[way].apply(net)
            if way == "bonsai-blocks":
                for block in net.layers.values():
                    fully_shard(block, mesh=mesh)
                fully_shard(net, mesh=mesh)
            else:
                apply_fsdp(net, mesh, param_dtype=torch.bfloat16 if mixed_precision else torch.float32,
                           reduce_dtype=torch.float32, pp_enabled=False)
                for module in net.modules():  # its gradient divide factor 1 reduces with PREMUL_SUM, which gloo
                    if isinstance(module, FSDPModule):  # lacks: a plain SUM, the same sum
                        module.set_force_sum_reduction_for_comms(True)
            step = steady_step_peak(net, inputs, loss_fn, grads="none")
            grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()  # apply_ac's wrapper
                     for name, p in net.named_parameters()}
            out[way] = {"peak": step.peak, "loss": step.loss}
            if rank == 0:
                torch.save(grads, Path(results, f"{way}.pt"))
        if rank == 0:
            Path(results, "out.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_torchtitan_s_run_and_bonsai_s_plans_in_it_match_gradients_and_predicted_peaks(tmp_path):
    from tests.distributed import WORLD, run_ranks

    run_ranks(_run_ways, tmp_path, tmp_path, "torchtitan", timeout=600)
    out = json.loads((tmp_path / "out.json").read_text())
    reference = torch.load(tmp_path / "torchtitan.pt")
    for way, scale in (("bonsai", 1), ("bonsai-blocks", WORLD)):  # fully_shard averages; torchtitan sums
        assert out[way]["loss"] == pytest.approx(out["torchtitan"]["loss"], rel=1e-6)
        grads = torch.load(tmp_path / f"{way}.pt")
        for name, g in reference.items():
            torch.testing.assert_close(grads[name] * scale, g, rtol=1e-4, atol=1e-6, msg=f"{way}: {name}")
    assert set(reference) == set(grads)
    assert_predicted(out, trace_model(TITAN, fsdp=WORLD, mixed_precision="none", **GLOO).graph)  # the run is fp32


def assert_predicted(out: dict, graph) -> None:
    """Each run's measured peak within 5% of its prediction: torchtitan's own run by its selective plan on
    ``graph`` (its model sharded as its apply_fsdp shards), bonsai's by the plans' reports."""
    from bonsai_core.optimizer import with_training_loop

    graph = with_training_loop(graph, TITAN, "none")  # its gradients set to None, as the run's loop does
    out["predicted"]["torchtitan"] = solve(graph, None, "torchtitan-selective").stats["peak"]
    print(json.dumps(out))
    for way in out["predicted"]:  # each plan predicted for the sharding it runs under
        measured, predicted = out[way]["peak"], out["predicted"][way]
        assert abs(measured / predicted - 1) <= 0.05, (way, measured, predicted)


@pytest.mark.slow
def test_torchtitan_s_bf16_run_and_bonsai_s_plan_in_it_are_predicted(tmp_path):
    """As above under torchtitan's default mixed precision (bf16 parameters all-gathered, fp32 reduce):
    torchtitan's selective run and bonsai's plan, both under its apply_fsdp, within 5% of prediction."""
    import functools

    from tests.distributed import WORLD, run_ranks

    run_ranks(functools.partial(_run_ways, mixed_precision="bf16"), tmp_path, tmp_path, "torchtitan", timeout=600)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["bonsai"]["loss"] == pytest.approx(out["torchtitan"]["loss"], rel=1e-2)  # bf16 kernels
    assert_predicted(out, trace_model(TITAN, fsdp=WORLD, **GLOO).graph)  # torchtitan's default: bf16
