"""FSDP2 per rank (``bonsai_core.fsdp``): the sharded graph's fixed memory and the simulator's profile
of unsharded blocks, checked by hand on small graphs, through the CLI, and against gloo processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bonsai_core.errors import BonsaiError, BudgetError
from bonsai_core.fsdp import with_fsdp, working_profile
from bonsai_core.graph import Graph
from bonsai_core.optimizer import with_optimizer
from bonsai_core.schedule import no_remat_peak, none_schedule, simulate
from bonsai_core.trace import trace_model
from tests.marks import sweep

ROOT = Path(__file__).resolve().parent.parent
GPT = dict(batch=2, seq=16, width=32, layers=3, heads=2, vocab=64)


@pytest.fixture(scope="module")
def traced():
    return trace_model("gpt", **GPT).graph


@pytest.fixture(scope="module")
def sharded():
    """The GPT as one of 2 FSDP ranks (fully_shard's defaults), traced once for the tests that read it."""
    return trace_model("gpt", fsdp=2, **GPT).graph


def test_sharded_fixed_memory_is_a_rank_s_share_plus_the_root(traced):
    sharded = trace_model("gpt", fsdp=4, **GPT).graph
    kinds = {}
    for _, nbytes, kind in traced.fixed_tensors:
        kinds[kind] = kinds.get(kind, 0) + nbytes
    expected = sum(math.ceil(b / 4) if k in ("param", "grad") else b for _, b, k in traced.fixed_tensors)
    root = sharded.fsdp["root_bytes"]
    assert sharded.fixed_mem == expected + root
    assert len(sharded.fsdp["units"]) == 3 and [u[0] for u in sharded.fsdp["units"]] == ["blocks.0", "blocks.1", "blocks.2"]
    # every parameter is in one unit or in the root
    assert sum(u[3] for u in sharded.fsdp["units"]) + root == kinds["param"]
    # the optimizer's state is sharded too, when added after
    adam = with_optimizer(sharded, "adamw")
    assert adam.fixed_mem - sharded.fixed_mem == 2 * sum(b for _, b, k in sharded.fixed_tensors if k == "grad")


def test_the_profile_holds_the_running_block_and_its_neighbours(traced, sharded):
    """Forward: the running block's parameters and its flat all-gather output; backward: the running
    block's parameters, the next block's prefetched all-gather, the previous block's reduce-scatter input
    and the running block's gradients so far."""
    units = sharded.fsdp["units"]
    size = units[0][3]
    ops = none_schedule(sharded).ops
    profile = working_profile(sharded, ops)
    first_block = next(i for i, (k, v) in enumerate(ops) if k == "compute" and v == units[0][1])
    assert profile[first_block] >= 2 * size  # unsharded + flat all-gather output (+ the root's, freed at copy-out)
    middle = next(i for i, (k, v) in enumerate(ops) if k == "compute" and v == units[1][1] + 1)
    assert profile[middle] == 2 * size  # block 0 resharded, its all-gather output freed
    backward = [i for i, (k, v) in enumerate(ops) if k == "compute" and not sharded.is_forward[v]]
    assert profile[backward].max() >= 3 * size  # its parameters, the prefetched next block, gradients
    assert profile[backward].max() <= 4 * size + sharded.fsdp["root_bytes"] + 2 * size
    # a graph without fsdp has no profile; the simulator's peak includes it
    assert not working_profile(traced, none_schedule(traced).ops).any()
    sim = simulate(sharded, none_schedule(sharded))
    assert sim.peak == int(sim.timeline.max()) and sim.peak > sharded.fixed_mem + profile.max() - 1


def test_gradients_set_to_none_are_the_reduce_scatter_outputs_fsdp_keeps(sharded):
    """With the gradients set to None between steps a rank holds no sharded gradient buffer: each unit's
    reduce-scatter output is kept from its post-backward on (the sharded gradients), as many bytes as the
    buffers; the unsharded gradients are held by FSDP as before (no held deps)."""
    from bonsai_core.fsdp import buffer_events, working_parts
    from bonsai_core.optimizer import with_grads

    none = with_grads(sharded, "none")
    grads = sum(b for _, b, k in sharded.fixed_tensors if k == "grad")
    assert none.fixed_mem == sharded.fixed_mem - grads and none.grads_set_to_none == grads
    assert none.n == sharded.n and not any(none.held[v] != sharded.held[v] for v in range(none.n))  # FSDP holds them
    ops = none_schedule(none).ops
    kept, before = working_parts(none, ops)["sharded gradients"], working_parts(sharded, ops)
    assert kept[0] == 0 and np.all(np.diff(kept) >= 0) and kept[-1] > 0 and not before["sharded gradients"].any()
    made = sum(b.nbytes for step in buffer_events(none, ops) for b in step if b.key.startswith("sharded_grad"))
    assert made == sum(b.nbytes for step in buffer_events(none, ops) for b in step if b.key.startswith("sharded_grad")
                       and b.nbytes > 0)  # never freed
    assert abs(made / grads - 1) < 0.02, (made, grads)  # the buffers' bytes, a unit's share rounded up, not a tensor's


def test_reshard_after_forward_false_keeps_the_blocks_until_their_backward(sharded):
    keep = trace_model("gpt", fsdp=2, reshard_after_forward=False, **GPT).graph
    ops = none_schedule(keep).ops
    first_backward = next(i for i, (k, v) in enumerate(ops) if k == "compute" and not keep.is_forward[v])
    assert working_profile(keep, ops)[first_backward - 1] >= sum(u[3] for u in keep.fsdp["units"])
    assert no_remat_peak(keep) >= no_remat_peak(sharded)


def test_bad_sharding_is_refused_clearly(traced):
    with pytest.raises(BonsaiError, match="at least 1"):
        with_fsdp(traced, 0, [], 0)
    with pytest.raises(BonsaiError, match="block stack"):
        with_fsdp(traced, 2, [], 0)
    with pytest.raises(BonsaiError, match="optimizer"):
        with_fsdp(with_optimizer(traced, "adamw"), 2, [("blocks.0", 4, 10, 8)], 0)
    assert with_fsdp(traced, 1, [], 0) is traced


def test_the_fsdp_field_round_trips_and_is_checked(sharded):
    again = Graph.from_dict(json.loads(json.dumps(sharded.to_dict())))
    assert again.fsdp == sharded.fsdp and again.hash == sharded.hash
    bad = json.loads(json.dumps(sharded.to_dict()))  # a copy: the fixture's graph is shared
    bad["fsdp"]["units"][0][2] = 10**6
    with pytest.raises(BonsaiError, match="'fsdp' unit"):
        Graph.from_dict(bad)


def test_every_method_s_schedule_is_judged_with_the_profile(sharded):
    from bonsai_core.solvers import solve

    budget = int(0.8 * no_remat_peak(sharded))
    # bonsai's op-level search runs its rounds to optimality with no limit (57 s here): 15 s bound it
    for method, options in (("bonsai", {"time_limit": 15}), ("chen", {}), ("dtr", {})):
        try:
            schedule = solve(sharded, budget, method, **options)
        except BonsaiError:
            continue
        assert simulate(sharded, schedule).peak <= budget


def test_cli_trace_fsdp(tmp_path, capsys):
    from bonsai_core.cli import main

    out = tmp_path / "g.json"
    assert main(["trace", "gpt", "--layers", "2", "--width", "32", "--fsdp", "4", "--reshard-after-forward", "false",
                 "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["fsdp"]["world"] == 4 and data["fsdp"]["reshard_after_forward"] is False
    capsys.readouterr()
    assert main(["trace", "tests.robust_models:make_trunc_normal", "--fsdp", "2", "-o", str(out)]) != 0
    err = capsys.readouterr().err
    assert "block" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("grads", ["zeroed", "none"])
@pytest.mark.parametrize("model", ["gpt", "gpt-wide", "hf:llama"])
def test_per_rank_peak_matches_gloo_processes(model, grads):
    """fully_shard on 2 gloo processes: the largest rank's measured peak within 5% of the prediction, the
    gradients zeroed between steps or set to None (``optimizer.zero_grad()``'s default)."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    from bonsai_core.bench import fsdp as fsdp_check
    from bonsai_core.optimizer import with_grads

    options = fsdp_check.SIZES[model]
    name = model.removesuffix("-wide")
    _, graph, paths = fsdp_check.fsdp_graph(name, options, 2)
    measured = max(r["peak"] for r in fsdp_check.measure(name, options, 2, paths, None, grads=grads))
    predicted = no_remat_peak(with_grads(graph, grads))
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted)
    assert np.isfinite(predicted)


# -- FSDP2's mixed precision (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) and per-block resharding

@pytest.fixture(scope="module")
def mixed():
    return trace_model("gpt", fsdp=2, mixed_precision="bf16", **GPT).graph


def test_mixed_precision_keeps_fp32_shards_and_gathers_bf16(mixed, sharded):
    """fp32 sharded parameters and gradients (twice the bf16 bytes the trace computed with, halved over 2
    ranks), bf16 unsharded units (half the fp32 ones), bf16 gradients and activations in the graph."""
    assert mixed.fsdp["param_dtype"] == "bf16" and mixed.fsdp["reduce_dtype"] == "fp32"
    assert [u[3] * 2 for u in mixed.fsdp["units"]] == [u[3] for u in sharded.fsdp["units"]]
    assert mixed.fsdp["root_bytes"] * 2 == sharded.fsdp["root_bytes"]

    def kind_bytes(graph, kind):
        return sum(b for _, b, k in graph.fixed_tensors if k == kind)
    for kind in ("param", "grad"):
        assert kind_bytes(mixed, kind) == kind_bytes(sharded, kind)  # fp32 shards either way
    bf16 = [s for s in mixed.shapes if s.startswith("bfloat16")]
    assert bf16 and not any(s.startswith("float32[2, 16, 32]") for s in mixed.shapes)  # activations bf16
    adam = with_optimizer(mixed, "adamw")  # fp32 AdamW state, 2x the fp32 gradient shards
    assert adam.fixed_mem - mixed.fixed_mem == 2 * kind_bytes(mixed, "grad")


def test_mixed_precision_reduce_scatters_fp32_and_casts_all_gather_inputs(mixed):
    """foreach_reduce's input is the bf16 gradients copied into fp32 (twice their bytes), on the compute
    stream; the sharded output is on the reduce-scatter stream; each all-gather first makes a bf16 copy of
    the rank's shard on the copy-in stream."""
    from bonsai_core.fsdp import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, buffer_events

    ops = none_schedule(mixed).ops
    events = [b for step in buffer_events(mixed, ops) for b in step]
    scatters = 0
    for k, b in enumerate(events):
        if b.key.startswith("reduce_scatter_input:") and b.nbytes > 0:
            copied = 0  # the gradients copied in, then freed
            for e in events[k + 1:]:
                if not e.key.startswith("grad:"):
                    break
                copied -= e.nbytes
            assert b.nbytes == 2 * copied > 0 and b.stream == "compute"
            scatters += 1
    assert scatters == len(mixed.fsdp["units"]) + 1  # each block and the root
    sizes = {int(u): s for u, s in enumerate(u[3] for u in mixed.fsdp["units"])}
    inputs = [b for b in events if b.key.startswith("all_gather_input:") and b.nbytes > 0]
    assert inputs and all(b.stream == ALL_GATHER_STREAM for b in inputs)
    assert {b.nbytes for b in inputs if b.key != "all_gather_input:-1"} == {math.ceil(s / 2) for s in sizes.values()}
    outputs = [b for b in events if b.key.startswith("reduce_scatter_output:") and b.nbytes > 0]
    assert outputs and all(b.stream == REDUCE_SCATTER_STREAM for b in outputs)
    # every buffer allocated is freed by the end of the step, every held gradient released
    balance: dict[str, int] = {}
    for b in events:
        balance[b.key] = balance.get(b.key, 0) + b.nbytes
    assert not any(balance.values())


def test_reshard_all_but_last_keeps_the_last_block_to_its_backward(sharded):
    """torchtitan's apply_fsdp: every block reshards after forward but the last, which stays unsharded
    into the backward pass and is not all-gathered again."""
    from bonsai_core.fsdp import buffer_events

    graph = trace_model("gpt", fsdp=2, reshard_after_forward="all-but-last", **GPT).graph
    assert graph.fsdp["reshard_after_forward"] == [True, True, False]
    ops = none_schedule(graph).ops
    gathers = [b.key for step in buffer_events(graph, ops) for b in step
               if b.key.startswith("all_gather_output:") and b.nbytes > 0]
    assert gathers.count("all_gather_output:2") == 1 and gathers.count("all_gather_output:0") == 2
    first_backward = next(i for i, (k, v) in enumerate(ops) if k == "compute" and not graph.is_forward[v])
    last = graph.fsdp["units"][2][3]
    kept, resharded = working_profile(graph, ops), working_profile(sharded, ops)
    assert kept[first_backward - 1] - resharded[first_backward - 1] == last
    again = Graph.from_dict(json.loads(json.dumps(graph.to_dict())))
    assert again.fsdp == graph.fsdp


def test_mixed_precision_needs_fsdp_and_fp32_parameters(tmp_path):
    import torch

    from bonsai_core.fsdp import computing_in

    with pytest.raises(BonsaiError, match="--fsdp"):
        trace_model("gpt", mixed_precision="bf16", **GPT)
    with pytest.raises(BonsaiError, match="fp32"):
        trace_model("gpt", fsdp=2, mixed_precision="bf16", dtype="bf16", **GPT)
    model = torch.nn.Linear(4, 4)
    with computing_in(model, "bf16"):
        assert model.weight.dtype == torch.bfloat16
        assert model(torch.ones(2, 4)).dtype == torch.bfloat16  # float inputs cast, as FSDP's root does
    assert model.weight.dtype == torch.float32 and model(torch.ones(2, 4)).dtype == torch.float32
    out = tmp_path / "g.json"
    bad = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "trace", "gpt", "--layers", "2", "--width", "32",
                          "--mixed-precision", "bf16", "-o", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1 and "--fsdp" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "hf:llama"])
def test_mixed_precision_per_rank_peak_matches_gloo_processes(model):
    """fully_shard(..., mp_policy=MixedPrecisionPolicy(bf16, fp32)), the last block kept after forward, on 2
    gloo processes: the largest rank's measured peak within 1% of the prediction."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    from bonsai_core.bench import fsdp as fsdp_check

    options = fsdp_check.SIZES[model]
    _, graph, units = fsdp_check.fsdp_graph(model, options, 2, "all-but-last", "bf16")
    measured = max(r["peak"] for r in fsdp_check.measure(model, options, 2, units, None, "all-but-last", "bf16"))
    assert abs(measured / no_remat_peak(graph) - 1) <= 0.01, (measured, no_remat_peak(graph))


def test_a_torchtitan_model_is_sharded_as_torchtitan_shards_it_unless_told():
    """torchtitan's FSDP2 setting (bf16 mixed precision, its apply_fsdp's units) is the default for
    torchtitan: models; fully_shard's for the others; --mixed-precision none turns it off."""
    from bonsai_core.fsdp import fsdp_defaults

    assert fsdp_defaults("torchtitan:llama3:8B", None, None) == ("torchtitan", "bf16")
    assert fsdp_defaults("torchtitan:llama3:8B", True, "none") == (True, None)
    assert fsdp_defaults("hf:llama", None, None) == (True, None)
    assert fsdp_defaults("gpt", False, "bf16") == (False, "bf16")
    plain = trace_model("gpt", fsdp=2, mixed_precision="none", **GPT).graph
    assert "param_dtype" not in plain.fsdp and plain.fsdp["reshard_after_forward"] is True


@pytest.mark.parametrize("reshard,units,flags", sweep([  # the units torchtitan makes; the other two in the slow stage
    ("torchtitan", ["tok_embeddings", "layers.0", "layers.1", "norm,output"], [True, True, True, False]),
    (True, ["layers.0", "layers.1"], True),
    ("all-but-last", ["layers.0", "layers.1"], [True, False]),
]))
def test_torchtitan_s_model_is_sharded_in_the_units_its_apply_fsdp_makes(reshard, units, flags):
    """torchtitan 0.2.2's apply_fsdp: tok_embeddings, each block and [norm, output] units of their own, the
    last not resharded after forward, the root left with nothing; December 2024's (all-but-last): the
    blocks alone, the last kept, the root holding embeddings, norm and head. Every parameter is in one
    unit or the root, all-gathered in bf16."""
    pytest.importorskip("torchtitan")
    graph = trace_model("torchtitan:llama3:debugmodel", batch=1, seq=32, layers=2, fsdp=2, reshard_after_forward=reshard).graph
    fsdp = graph.fsdp
    assert [u[0] for u in fsdp["units"]] == units and fsdp["reshard_after_forward"] == flags
    params = sum(nbytes for _, nbytes, kind in trace_model("torchtitan:llama3:debugmodel", batch=1, seq=32,
                                                             layers=2).graph.fixed_tensors if kind == "param")
    assert sum(u[3] for u in fsdp["units"]) + fsdp["root_bytes"] == params // 2  # fp32 traced, bf16 gathered
    assert (fsdp["root_bytes"] == 0) == (reshard == "torchtitan")


def test_bonsai_names_a_budget_it_meets_on_a_rank_its_model_leaves_the_unsharded_blocks_out_of():
    """On a rank whose peak the unsharded blocks set (one small block, 4 ranks), no plan below the no-remat
    peak fits; bonsai's error names the smallest budget it can guarantee from its min-peak plan as
    simulated, and meets it (it named the refused budget plus one byte, at every budget)."""
    import re

    from bonsai_core.solvers import solve

    graph = trace_model("gpt", fsdp=4, layers=1, batch=1, seq=16, width=64, heads=2, vocab=512).graph
    budget = int(0.9 * no_remat_peak(graph))
    with pytest.raises(BudgetError) as refused:
        solve(graph, budget, "bonsai", time_limit=30)
    guaranteed = int(re.search(r"guarantee is .*?\((\d+) bytes\)", str(refused.value)).group(1))
    assert guaranteed > budget + 1
    assert solve(graph, guaranteed, "bonsai", time_limit=30).stats["peak"] <= guaranteed
