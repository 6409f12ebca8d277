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

from bonsai_core.errors import BonsaiError
from bonsai_core.fsdp import with_fsdp, working_profile
from bonsai_core.graph import Graph
from bonsai_core.optimizer import with_optimizer
from bonsai_core.schedule import no_remat_peak, none_schedule, simulate
from bonsai_core.trace import trace_model

ROOT = Path(__file__).resolve().parent.parent
GPT = dict(batch=2, seq=16, width=32, layers=3, heads=2, vocab=64)


@pytest.fixture(scope="module")
def traced():
    return trace_model("gpt", **GPT).graph


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


def test_the_profile_holds_the_running_block_and_its_neighbours(traced):
    """Forward: the running block's parameters and its flat all-gather output; backward: the running
    block's parameters, the next block's prefetched all-gather, the previous block's reduce-scatter input
    and the running block's gradients so far."""
    sharded = trace_model("gpt", fsdp=2, **GPT).graph
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


def test_reshard_after_forward_false_keeps_the_blocks_until_their_backward():
    keep = trace_model("gpt", fsdp=2, reshard_after_forward=False, **GPT).graph
    again = trace_model("gpt", fsdp=2, **GPT).graph
    ops = none_schedule(keep).ops
    first_backward = next(i for i, (k, v) in enumerate(ops) if k == "compute" and not keep.is_forward[v])
    assert working_profile(keep, ops)[first_backward - 1] >= sum(u[3] for u in keep.fsdp["units"])
    assert no_remat_peak(keep) >= no_remat_peak(again)


def test_bad_sharding_is_refused_clearly(traced):
    with pytest.raises(BonsaiError, match="at least 1"):
        with_fsdp(traced, 0, [], 0)
    with pytest.raises(BonsaiError, match="block stack"):
        with_fsdp(traced, 2, [], 0)
    with pytest.raises(BonsaiError, match="optimizer"):
        with_fsdp(with_optimizer(traced, "adamw"), 2, [("blocks.0", 4, 10, 8)], 0)
    assert with_fsdp(traced, 1, [], 0) is traced


def test_the_fsdp_field_round_trips_and_is_checked():
    sharded = trace_model("gpt", fsdp=2, **GPT).graph
    again = Graph.from_dict(json.loads(json.dumps(sharded.to_dict())))
    assert again.fsdp == sharded.fsdp and again.hash == sharded.hash
    bad = sharded.to_dict()
    bad["fsdp"]["units"][0][2] = 10**6
    with pytest.raises(BonsaiError, match="'fsdp' unit"):
        Graph.from_dict(bad)


def test_every_method_s_schedule_is_judged_with_the_profile():
    from bonsai_core.solvers import solve

    sharded = trace_model("gpt", fsdp=2, **GPT).graph
    budget = int(0.8 * no_remat_peak(sharded))
    for method in ("bonsai", "chen", "dtr"):
        try:
            schedule = solve(sharded, budget, method)
        except BonsaiError:
            continue
        assert simulate(sharded, schedule).peak <= budget


def test_cli_trace_fsdp(tmp_path):
    out = tmp_path / "g.json"
    done = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "trace", "gpt", "--layers", "2", "--width", "32",
                           "--fsdp", "4", "--reshard-after-forward", "false", "-o", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["fsdp"]["world"] == 4 and data["fsdp"]["reshard_after_forward"] is False
    bad = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "trace", "tests.robust_models:make_trunc_normal", "--fsdp", "2", "-o", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "block" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "gpt-wide", "hf:llama"])
def test_per_rank_peak_matches_gloo_processes(model):
    """fully_shard on 2 gloo processes: the largest rank's measured peak within 5% of the prediction."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    from bonsai_core.bench import fsdp as fsdp_check

    options = fsdp_check.SIZES[model]
    name = model.removesuffix("-wide")
    _, graph, paths = fsdp_check.fsdp_graph(name, options, 2)
    measured = max(r["peak"] for r in fsdp_check.measure(name, options, 2, paths, None))
    predicted = no_remat_peak(graph)
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted)
    assert np.isfinite(predicted)
