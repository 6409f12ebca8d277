"""Every rank of a parallel run, predicted against measured: tensor, pipeline and tensor x FSDP layouts on gloo
processes on CPU, each rank's peak live bytes over a steady-state step against the simulator's peak of that
rank's graph, traced on the fake process group; without recomputation and with the one call's plan for the
layout. The run is parallelized as the model's library does it, in fp32 (gloo has no bf16 reduce-scatter).

    bonsai bench parallel --model torchtitan:llama3:debugmodel --layout tp2 fsdp2.tp2 pp2 [--budget 70%] [--out FILE]
                          [--batch 2 --seq 16]

A layout is its degrees joined by dots (``fsdp2.tp2``, ``pp2.interleaved``; ``mb4``: 4 microbatches).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from bonsai_core.arguments import positive_int
from bonsai_core.bench import common, fsdp
from bonsai_core.errors import BonsaiError
from bonsai_core.parallel import Layout, cp_inputs, family, layout_of, meshes, parallelize, step_context, with_batch
from bonsai_core.schedule import no_remat_peak
from bonsai_core.units import format_bytes

# small sizes each model runs in a few seconds per step on gloo
SIZES = {"torchtitan:llama3:debugmodel": dict(batch=4, seq=64, layers=4),
         "hf:llama": dict(batch=4, seq=64, layers=4, width=256, heads=4, vocab=2048)}
COLUMNS = ["model", "layout, rank", "plan", "predicted", "measured", "error", "time"]
SCHEDULE_WORDS = {"1f1b": "1f1b", "interleaved": "interleaved-1f1b"}


def parse_layout(text: str) -> Any:
    """``fsdp2.tp2``, ``pp2.interleaved.mb4``, ... as a :class:`bonsai_core.parallel.Layout` (rank 0)."""
    degrees: dict[str, Any] = {}
    for word in text.split("."):
        if word in SCHEDULE_WORDS:
            degrees["pp_schedule"] = SCHEDULE_WORDS[word]
            continue
        name = word.rstrip("0123456789")
        key = {"mb": "microbatches", "hsdp": "dp_replicate"}.get(name, name)
        if key not in ("fsdp", "tp", "cp", "pp", "dp_replicate", "microbatches") or name == word:
            raise argparse.ArgumentTypeError(f"{text!r}: a layout is degrees joined by dots, like fsdp2.tp2 or "
                                             "pp2.interleaved.mb4")
        degrees[key] = int(word[len(name):])
    return layout_of(**degrees)


def rank_graph(model: str, options: dict, layout: Any) -> Any:
    """The graph of ``layout``'s rank (its pipeline rank), traced on the fake process group, in fp32."""
    from bonsai_core.rank import trace

    return trace(model, parallel=layout, mixed_precision="none" if layout.shard_world > 1 else None,
                 **options).graph


def predicted(model: str, options: dict, layout: Any, budget: str | None) -> int:
    """One rank's predicted peak: no recomputation, or what the one call predicts for its plan at ``budget``."""
    if not budget:
        return no_remat_peak(rank_graph(model, options, layout))
    from bonsai_core import models

    net, inputs, loss_fn = models.build(model, seed=0, **options)
    return one_call_plan(net, inputs, loss_fn, layout, budget).report.predicted_peak


def one_call_plan(net: Any, inputs: tuple, loss_fn: Any, layout: Any, budget: str) -> Any:
    """The one call's plan for ``layout``, fp32 (FSDP without mixed precision): ``plan_for`` for torchtitan's
    model (sharded as its ``apply_fsdp``), ``bonsai_core.plan`` for any other (``fully_shard`` on each block)."""
    import bonsai_core as bonsai

    if family(net) == "torchtitan":
        from bonsai_core.torchtitan import plan_for

        batch, seq = inputs[0].shape[:2]
        # grads zeroed: the measured loop keeps the first step's gradients through the measured one
        return plan_for(net, batch, seq, budget, optimizer="none", mixed_precision="none", grads="zeroed",
                        cache=False, **dataclasses.asdict(layout))
    return bonsai.plan(net, inputs, loss_fn, budget, cache=False, **dataclasses.asdict(layout))


def sharded(net: Any, layout: Any, dims: Any) -> None:
    """FSDP over the layout's ``dp_shard x cp`` ranks as the model's library applies it, fp32 (gloo):
    torchtitan's ``apply_fsdp`` (its gradient divide factor 1 reduced as a plain sum: gloo has no
    PREMUL_SUM), or ``fully_shard`` on each block and the model."""
    import torch
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if layout.shard_world == 1:
        return
    if family(net) == "torchtitan":
        from torchtitan.models.llama3.infra.parallelize import apply_fsdp

        mesh = dims.get_mesh(["dp_replicate", "fsdp"] if layout.dp_replicate > 1 else "fsdp")
        apply_fsdp(net, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=layout.pp > 1)
        for module in net.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return
    mesh = dims["dp"]
    blocks = [m for name, m in net.named_modules() if name.rpartition(".")[2].isdigit()
              and name.rpartition(".")[0].endswith("layers")]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)


def pipeline_step_peak(net: Any, inputs: tuple, loss_fn: Any, layout: Any, dims: Any, made: Any = None) -> dict:
    """One pipeline rank's fixed bytes, peak and loss over a steady-state step, as torchtitan runs it
    (:func:`bonsai_core.measure_parallel.pipeline_step_peak`): its stages split off by ``pipeline_module_split``
    (each with ``made``, a plan for the rank, applied where it has the paths, then tensor parallel and FSDP as
    :func:`sharded`), torch's schedule (``scale_grads=False``) stepping the local batch in ``layout.microbatches``
    microbatches; and each parameter's gradient after it (:func:`gradient_norms`)."""
    import torch
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.pipeline_parallel import pipeline_module_split

    from bonsai_core import measure_parallel
    from bonsai_core.pipeline import TORCH_SCHEDULE, stage_modules

    names = stage_modules(layout, net.model_args.n_layers)
    stages, parts = pipeline_module_split(net, dims.get_mesh("pp"), TORCH_SCHEDULE[layout.pp_schedule],
                                          torch.device("cpu"), names)
    for part in parts:
        if made is not None:
            made.apply(part)
        parallelize(part, layout, dims)
        sharded(part, layout, dims)
    schedule_class = get_schedule_class(TORCH_SCHEDULE[layout.pp_schedule])
    schedule = schedule_class(stages if len(stages) > 1 else stages[0], n_microbatches=layout.microbatches,
                              loss_fn=lambda pred, target: cross_entropy_loss(pred, target) / target.numel(),
                              scale_grads=False)
    with step_context(net, layout):
        step = measure_parallel.pipeline_step_peak(schedule, stages, parts, inputs, loss_fn.labels)
    return {"fixed": step.fixed, "peak": step.peak, "loss": step.loss, "grads": gradient_norms(parts)}


def gradient_norms(parts: list) -> dict[str, float]:
    """Each parameter's gradient (this rank's shard), as its sum of squares: what two runs compare."""
    from bonsai_core.tensors import local_tensor

    return {name: float(local_tensor(p.grad).double().pow(2).sum()) for part in parts
            for name, p in part.named_parameters() if p.grad is not None}


def _worker(model: str, options: dict, layout: dict, budget: str | None, saves: dict | None) -> dict:
    from bonsai_core import models
    from bonsai_core.measure_parallel import steady_step_peak

    net, inputs, loss_fn = models.build(model, seed=0, **options)
    spec = with_batch(Layout(**layout), *inputs[0].shape[:2])
    out: dict[str, Any] = {}
    made = None
    if budget:
        made = one_call_plan(net, inputs, loss_fn, spec, budget)
        if spec.pp == 1:  # a pipeline rank's plan goes on each of its stages' model parts
            made.apply(net)
        out["predicted"] = made.report.predicted_peak
    elif saves is not None:  # one block plan on every block of each stage (bonsai_core.stage_plan)
        from bonsai_core.stage_plan import BlockPlan

        made = BlockPlan(saves)
    dims = meshes(net, spec)
    if spec.pp > 1:
        out.update(pipeline_step_peak(net, inputs, loss_fn, spec, dims, made))
    else:
        parallelize(net, spec, dims)
        sharded(net, spec, dims)
        if spec.cp > 1:
            inputs = cp_inputs(net, inputs, loss_fn, dims)
        with step_context(net, spec):
            step = steady_step_peak(net, inputs, loss_fn)
        out.update(fixed=step.fixed, peak=step.peak, loss=step.loss)
    return out


def measure(model: str, options: dict, layout: Any, budget: str | None = None, timeout: float = 600,
            saves: dict | None = None) -> list[dict]:
    """Each rank's fixed bytes and peak over one steady-state step, from ``layout.world`` spawned gloo processes;
    with ``budget`` the one call's plan applied, with ``saves`` (a pipeline layout) that block plan on every block
    (:class:`bonsai_core.stage_plan.BlockPlan`)."""
    if saves is not None and (layout.pp == 1 or budget):
        raise BonsaiError(f"{layout.describe()}: a block plan (saves) is applied to a pipeline layout's stages, "
                          "without a budget's plan; give a pp layout and no budget.")
    return fsdp.spawn_ranks(_worker, layout.world, (model, options, dataclasses.asdict(layout), budget, saves),
                            timeout, layout.describe())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--model", default="torchtitan:llama3:debugmodel", choices=sorted(SIZES))
    parser.add_argument("--layout", type=parse_layout, nargs="+", default=[parse_layout("tp2")])
    parser.add_argument("--budget", default=None, help="also measure with bonsai's plan at this budget (e.g. 70%%)")
    parser.add_argument("--out", type=Path, default=None, help="append the table to this Markdown file")
    parser.add_argument("--batch", type=positive_int, default=None, help="local batch (default 4)")
    parser.add_argument("--seq", type=positive_int, default=None, help="sequence length (default 64)")


def main(args: argparse.Namespace) -> int:
    """One row per layout, pipeline rank and plan: printed and (with ``--out``) appended to a Markdown file."""
    options = {**SIZES[args.model], **{key: getattr(args, key) for key in ("batch", "seq") if getattr(args, key)}}
    meta = common.run_meta()
    rows = []
    for layout in args.layout:
        start = time.perf_counter()
        for budget in (None, args.budget) if args.budget else (None,):
            ranks = measure(args.model, options, layout, budget)
            per_pp = layout.world // layout.pp
            for pp_rank in range(layout.pp):
                spec = with_batch(dataclasses.replace(layout, rank=pp_rank), options["batch"], options["seq"])
                expected = predicted(args.model, options, spec, budget)
                peak = max(r["peak"] for r in ranks[pp_rank * per_pp:(pp_rank + 1) * per_pp])
                rows.append([args.model, spec.describe(), budget or "none", format_bytes(expected), format_bytes(peak),
                             f"{peak / expected - 1:+.2%}", f"{time.perf_counter() - start:.0f} s"])
                print(f"| {' | '.join(rows[-1])} |", flush=True)
    append_table(args.out, meta, rows)
    return 0


def append_table(out: Path | None, meta: dict[str, Any], rows: list[list[str]]) -> None:
    """``rows`` (a table row a list of cells) appended to ``out`` below what ran, where and when it started
    (``meta``: :func:`bonsai_core.bench.common.run_meta`), and the table's head."""
    if out is None:
        return
    head = (f"`{meta['command']}` on {meta['date']}, {meta['machine']}, torch {meta['torch']}, gloo, fp32: each "
            "pipeline rank's peak live bytes (largest over its ranks) against the simulator.\n\n")
    before = "\n" if out.exists() else ""
    with out.open("a") as f:
        f.write(before + head + common.pipe_table(COLUMNS, rows) + "\n")
