"""FSDP2 per rank, predicted against measured: ``fully_shard`` on each block and on the whole model, N
gloo processes on CPU, each rank's peak live bytes over one steady-state training step against the
simulator's peak of the graph :func:`bonsai_core.fsdp.with_fsdp` shards, without recomputation and with a
bonsai plan applied by ``bonsai_core.checkpoint`` before sharding.

    bonsai bench fsdp --page docs/bench/fsdp.md          # the page's models (RECORD), 2 and 4 ranks
    bonsai bench fsdp --model hf:llama --world 2 [--mixed-precision bf16] [--grads none] --out DIR
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from bonsai_core.arguments import RESHARD_CHOICES, reshard_arg
from bonsai_core.bench import common
from bonsai_core.optimizer import with_grads
from bonsai_core.schedule import no_remat_peak

# activations set the peak (at the loss) / parameters do (in a block's backward)
SIZES = {"gpt": dict(batch=8, seq=128, width=256, layers=4, heads=4, vocab=2048),
         "gpt-wide": dict(batch=1, seq=32, width=512, layers=4, heads=4, vocab=256),
         "hf:llama": dict(batch=4, seq=128, width=256, layers=4, heads=4, vocab=2048),
         "hf:llama-wide": dict(batch=1, seq=32, width=512, layers=4, heads=4, vocab=256)}
RECORD = {"gpt": "70%", "gpt-wide": None, "hf:llama": "70%", "hf:llama-wide": None}  # the page's models and plans
OUT = "docs/bench/fsdp"
PAGE = "docs/bench/fsdp.md"
SOURCES = ["bonsai_core/bench/fsdp.py", "bonsai_core/bench/templates/fsdp.md"]


def fsdp_graph(model: str, options: dict, world: int, reshard: bool | str = True, mixed_precision: str | None = None):
    """The traced graph (computing as FSDP makes it), that graph as one of ``world`` ranks holds it, and
    the units FSDP shards before the model (:func:`bonsai_core.fsdp.fsdp_units`)."""
    from bonsai_core import models
    from bonsai_core.fsdp import computing_in, fsdp_units, shard_by_units
    from bonsai_core.trace import built_for_tracing, trace_step

    with built_for_tracing(model, 0, **options) as (net, inputs, loss_fn):
        with computing_in(net, mixed_precision):
            graph = trace_step(net, inputs, loss_fn, name=model).graph
    net = models.build(model, seed=0, **options)[0]
    return graph, shard_by_units(graph, net, world, reshard, mixed_precision), fsdp_units(graph, reshard)


def _gloo_rank(rank: int, world: int, folder: str, worker: Callable[..., dict], *args: Any) -> None:
    """This process as rank ``rank`` of ``world`` gloo processes meeting in ``folder`` (one thread each):
    ``worker(*args)``'s result written to ``folder/rankN.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(worker(*args)))
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker: Callable[..., dict], world: int, args: tuple, timeout: float | None = None,
                what: str = "") -> list[dict]:
    """``worker(*args)`` in ``world`` spawned gloo processes (:func:`_gloo_rank`); their results, rank by rank.
    Past ``timeout`` seconds the workers are killed."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(_gloo_rank, args=(world, folder, worker, *args), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + (timeout or float("inf"))
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"the {what} workers did not finish within {timeout:.0f} s")
        return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]


def _worker(model: str, options: dict, world: int, units: list, budget: str | None, reshard: bool | str,
            mixed_precision: str | None, grads: str) -> dict:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import bonsai_core as bonsai
    from bonsai_core import models
    from bonsai_core.fsdp import MIXED_PRECISION
    from bonsai_core.measure_parallel import steady_step_peak

    net, inputs, loss_fn = models.build(model, seed=0, **options)
    if budget:
        bonsai.checkpoint(net, inputs, loss_fn, budget=budget, fsdp=world, reshard_after_forward=reshard,
                          mixed_precision=mixed_precision, grads=grads, cache=False)
    policy = MixedPrecisionPolicy(param_dtype=MIXED_PRECISION[mixed_precision], reduce_dtype=torch.float32) \
        if mixed_precision else MixedPrecisionPolicy()
    for paths, flag in units:  # a unit of several modules is one fully_shard call, as torchtitan's [norm, output]
        modules = [net.get_submodule(p) for p in paths]
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=flag, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    step = steady_step_peak(net, inputs, loss_fn, grads)
    return {"fixed": step.fixed, "peak": step.peak, "loss": step.loss}


def measure(model: str, options: dict, world: int, units: list, budget: str | None, reshard: bool | str = True,
            mixed_precision: str | None = None, grads: str = "zeroed") -> list[dict]:
    """Each rank's fixed bytes and peak over one steady-state step, from ``world`` spawned processes."""
    return spawn_ranks(_worker, world, (model, options, world, units, budget, reshard, mixed_precision, grads))


def predicted(graph, model: str, options: dict, budget: str | None, reshard: bool | str = True,
              mixed_precision: str | None = None, grads: str = "zeroed") -> int:
    """The simulator's peak of ``graph`` (one rank): no recomputation, or what ``bonsai.checkpoint(...,
    fsdp=N)`` predicts for its plan at ``budget`` (a share of the rank's no-remat peak)."""
    if not budget:
        return no_remat_peak(with_grads(graph, grads))
    import bonsai_core as bonsai
    from bonsai_core import models

    net, inputs, loss_fn = models.build(model, seed=0, **options)
    return bonsai.checkpoint(net, inputs, loss_fn, budget=budget, fsdp=graph.fsdp["world"],
                             reshard_after_forward=reshard, mixed_precision=mixed_precision, grads=grads,
                             cache=False).predicted_peak


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--model", nargs="+", choices=sorted(SIZES),
                        help="the models to measure (default the page's: %s)" % ", ".join(RECORD))
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--budget", default=None, help="also measure with bonsai's plan at this budget (e.g. 70%%; "
                                                       "the page's models: 70%% for gpt and hf:llama)")
    parser.add_argument("--mixed-precision", choices=("bf16",), default=None,
                        help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's")
    parser.add_argument("--reshard-after-forward", choices=RESHARD_CHOICES, default="true",
                        help="fully_shard's reshard_after_forward per block; all-but-last: torchtitan's apply_fsdp of "
                             "Dec 2024; torchtitan: 0.2.2's (its own units around the blocks)")
    parser.add_argument("--grads", choices=("zeroed", "none"), default="zeroed",
                        help="the gradients between steps: zeroed (kept allocated) or none (set to None, "
                             "optimizer.zero_grad()'s default)")
    common.add_page_arguments(parser, OUT, PAGE)


def refusal(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, before anything is measured; None when they can."""
    narrowed = common.changed(args, ("model", "world", "mixed_precision", "reshard_after_forward", "grads"))
    return common.page_refusal(args, OUT, PAGE, narrowed=narrowed)


def measure_rows(args: argparse.Namespace) -> dict[str, Any]:
    """One row per model, world size and plan, printed as measured."""
    reshard = reshard_arg(args.reshard_after_forward)
    mp = args.mixed_precision
    setting = ", ".join(x for x in (f"mp {mp}" if mp else "", "" if reshard is True else f"reshard {reshard}",
                                    "grads none" if args.grads == "none" else "") if x)
    rows = []
    studies = RECORD if args.model is None else {model: args.budget for model in args.model}  # model -> its plan
    for label, budget in studies.items():
        model, options = label.removesuffix("-wide"), SIZES[label]
        for world in args.world:
            start = time.perf_counter()
            _, graph, units = fsdp_graph(model, options, world, reshard, mp)
            for plan in (None, budget) if budget else (None,):
                expected = predicted(graph, model, options, plan, reshard, mp, args.grads)
                ranks = measure(model, options, world, units, plan, reshard, mp, args.grads)
                rows.append({"model": label + (f" ({setting})" if setting else ""), "ranks": world, "plan": plan,
                             "fixed": graph.fixed_mem, "predicted": expected, "measured": max(r["peak"] for r in ranks),
                             "seconds": time.perf_counter() - start})
                print(rows[-1], flush=True)
    return {"meta": common.run_meta(), "rows": rows}


page = common.filled("fsdp")


def main(args: argparse.Namespace) -> int:
    return common.run_page_suite("fsdp", args, refusal(args), lambda: measure_rows(args),
                                 common.page_writer(page, SOURCES))
