"""Predicted vs measured memory on a CUDA GPU, for the models and settings a real run uses.

For each case: trace the model (on fake tensors, on this machine's CPU), solve it with bonsai at a
share of its no-remat peak, export the plan (replay back-end), and run the exported step on the GPU.
The live prediction (the simulator's peak) is compared with ``torch.cuda.max_memory_allocated`` and
the reserved prediction (the allocator model, ``allocator.replay``) with ``max_memory_reserved``,
each over the steady-state second step. Prints a markdown table; run it where a GPU is lent:

    python scripts/gpu_check.py [--budget 70] [--expandable-segments] > gpu_check.md

Then torchtitan's Llama 3 step (:data:`TORCHTITAN`: the 8B flavour cut to 4 blocks, seq 8192, batch 2,
bf16 parameters, AdamW; one GPU, no FSDP), two ways: torchtitan's own selective activation
checkpointing (its ``apply_ac``, which on a GPU saves the flash kernel's output) against the
``torchtitan-selective`` method's prediction, and a bonsai plan (``bonsai_core.torchtitan.plan_for``)
at that method's peak against the plan's predicted peak. ``--torchtitan-only`` runs just these.

With ``--expandable-segments`` it sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before
CUDA starts and predicts reserved bytes with the ``expandable`` policy.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

CASES = [  # (model, options, trace --optimizer)
    ("gpt", {}, "none"),
    ("gpt", {"layers": 4, "width": 512, "seq": 512, "heads": 8, "batch": 8}, "adamw"),
    ("hf:gpt2", {"layers": 4, "width": 512, "seq": 512, "heads": 8, "batch": 8}, "none"),
    ("hf:llama", {"layers": 4, "width": 512, "seq": 512, "heads": 8, "batch": 4, "vocab": 8192}, "adamw"),
    # as trained: SDPA (the hf: default) with bf16 parameters
    ("hf:gpt2", {"layers": 4, "width": 512, "seq": 512, "heads": 8, "batch": 8, "dtype": "bf16"}, "none"),
    ("hf:llama", {"layers": 4, "width": 512, "seq": 512, "heads": 8, "batch": 4, "vocab": 8192, "dtype": "bf16"}, "adamw"),
]

# torchtitan's Llama 3 at a size one H200 (139 GiB) holds with room to spare; --device cpu: TORCHTITAN_CPU
TORCHTITAN = ("torchtitan:llama3:8B", {"layers": 4, "seq": 8192, "batch": 2, "dtype": "bf16"}, "adamw")
TORCHTITAN_CPU = ("torchtitan:llama3:debugmodel", {"layers": 2, "seq": 256, "batch": 2, "dtype": "bf16"}, "adamw")


def second_step_peaks(step, dev: "torch.device", fixed_mem: int) -> tuple[int, int | None]:
    """Run ``step`` twice and measure the second (the first sets up the caching allocator's segments, as
    the allocator model's warm-up does): on CUDA max_memory_allocated and max_memory_reserved; on the
    CPU, a dry run of the script, live bytes only (fixed memory counted as traced) and no reserved."""
    import torch

    step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    from bonsai_core.measure import LiveBytes

    with LiveBytes() as tracker:
        step()
    return fixed_mem + tracker.peak, None


def check(model: str, options: dict, optimizer: str, share: float, policy: str, device: str = "cuda") -> str:
    import torch

    from bonsai_core import models
    from bonsai_core.allocator import replay
    from bonsai_core.export import export_model, load_export
    from bonsai_core.optimizer import init_state, make, with_optimizer
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve
    from bonsai_core.trace import trace_model
    from bonsai_core.units import format_bytes

    start = time.perf_counter()
    graph = with_optimizer(trace_model(model, **options).graph, optimizer)
    schedule = solve(graph, int(share * no_remat_peak(graph)), "bonsai", time_limit=60)
    reserved = replay(graph, schedule, policy=policy, full=True, optimizer="sgd").reserved_peak
    with tempfile.TemporaryDirectory() as out:
        export_model(model, options, schedule, out)
        dev = torch.device(device)
        net, inputs, loss_fn = models.build(model, **options)
        net, inputs = net.to(dev), tuple(x.to(dev) for x in inputs)
        loss_fn = loss_fn.to(dev) if isinstance(loss_fn, torch.nn.Module) else loss_fn
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        opt = make(net.parameters(), optimizer)
        if opt is not None:
            init_state(opt)
        ck = load_export(out).load(net)

        def step() -> None:
            ck(*inputs, loss_fn=loss_fn).backward()
            if opt is not None:
                opt.step()

        allocated, held = second_step_peaks(step, dev, graph.fixed_mem)
        del ck, net, inputs, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    peak = schedule.stats["peak"]
    label = model + "".join(f" {k}={v}" for k, v in options.items()) + (f" +{optimizer}" if optimizer != "none" else "")
    return (f"| {label} | {share:.0%} | {format_bytes(peak)} | {format_bytes(allocated)} | {allocated / peak - 1:+.2%} | "
            f"{format_bytes(reserved)} | "
            + (f"{format_bytes(held)} | {held / reserved - 1:+.2%} | " if held is not None else "not measured on CPU | | ")
            + f"{time.perf_counter() - start:.0f} s |")


def check_one_call(model: str, options: dict, share: float, device: str) -> str:
    """``bonsai_core.checkpoint`` on the model built on ``device``: the report's predicted peak against
    ``max_memory_allocated`` over the second training step (live bytes on a CPU dry run)."""
    import torch

    import bonsai_core as bonsai
    from bonsai_core import models
    from bonsai_core.measure import measure_step
    from bonsai_core.units import format_bytes

    start = time.perf_counter()
    dev = torch.device(device)
    net, inputs, loss_fn = models.build(model, **options)
    net, inputs = net.to(dev), tuple(x.to(dev) for x in inputs)
    loss_fn = loss_fn.to(dev) if isinstance(loss_fn, torch.nn.Module) else loss_fn
    report = bonsai.checkpoint(net, inputs, loss_fn, budget=f"{share:.0%}", cache=False)
    loss_fn(net(*inputs)).backward()  # the first step
    measured = measure_step(net, inputs, loss_fn).peak
    label = "bonsai.checkpoint " + model + "".join(f" {k}={v}" for k, v in options.items())
    return (f"| {label} | {share:.0%} | {format_bytes(report.predicted_peak)} | {format_bytes(measured)} | "
            f"{measured / report.predicted_peak - 1:+.2%} | | | | {time.perf_counter() - start:.0f} s |")


def check_torchtitan(model: str, options: dict, optimizer: str, policy: str, device: str) -> list[str]:
    """torchtitan's step two ways (module docstring): one table row each, predicted against measured
    over the second step (live bytes only on a CPU dry run)."""
    import torch
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    from bonsai_core import models
    from bonsai_core.allocator import replay
    from bonsai_core.optimizer import init_state, make, with_optimizer
    from bonsai_core.solvers import solve
    from bonsai_core.torchtitan import plan_for
    from bonsai_core.trace import trace_model
    from bonsai_core.units import format_bytes

    start = time.perf_counter()
    graph = with_optimizer(trace_model(model, **options).graph, optimizer)
    selective = solve(graph, None, "torchtitan-selective")
    rows = []
    for way in ("torchtitan apply_ac selective", "bonsai plan at its peak"):
        dev = torch.device(device)
        net, inputs, loss_fn = models.build(model, **options)
        net, inputs, loss_fn = net.to(dev), tuple(x.to(dev) for x in inputs), loss_fn.to(dev)
        if way.startswith("torchtitan"):
            apply_ac(net, ActivationCheckpoint(mode="selective", selective_ac_option="op"),
                     op_sac_save_list=_op_sac_save_list)
            peak = selective.stats["peak"]
            reserved = replay(graph, selective, policy=policy, full=True, optimizer="sgd").reserved_peak  # as check()
        else:
            made = plan_for(net, options["batch"], options["seq"], selective.stats["peak"], optimizer=optimizer,
                               cache=False, time_limit=120)
            made.apply(net)
            peak, reserved = made.report.predicted_peak, None
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        opt = make(net.parameters(), optimizer)
        if opt is not None:
            init_state(opt)

        def step() -> None:
            loss_fn(net(*inputs)).backward()
            if opt is not None:
                opt.step()

        allocated, held = second_step_peaks(step, dev, graph.fixed_mem)
        del net, inputs, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        label = f"{model} {way}" + "".join(f" {k}={v}" for k, v in options.items()) + f" +{optimizer}"
        budget = "fixed plan" if way.startswith("torchtitan") else format_bytes(selective.stats["peak"])
        rows.append(f"| {label} | {budget} | {format_bytes(peak)} | {format_bytes(allocated)} | {allocated / peak - 1:+.2%} | "
                    + (f"{format_bytes(reserved)} | " if reserved is not None else "| ")
                    + (f"{format_bytes(held)} | {held / reserved - 1:+.2%} | " if held is not None and reserved
                       else f"{format_bytes(held)} | | " if held is not None else "not measured on CPU | | ")
                    + f"{time.perf_counter() - start:.0f} s |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=70, help="share of the no-remat peak, in percent")
    parser.add_argument("--expandable-segments", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the pipeline (live bytes only)")
    parser.add_argument("--torchtitan-only", action="store_true", help="only torchtitan's Llama 3 step")
    args = parser.parse_args()
    if args.expandable_segments:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("No CUDA device: this script measures on a GPU (--device cpu for a dry run).")
    policy = "expandable" if args.expandable_segments else "caching"
    name = torch.cuda.get_device_name() if args.device == "cuda" else "none (CPU dry run)"
    print(f"GPU: {name}, torch {torch.__version__}, allocator {policy}\n")
    print("| model | budget | predicted live | max_memory_allocated | diff | predicted reserved | "
          "max_memory_reserved | diff | time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, options, optimizer in [] if args.torchtitan_only else CASES:
        print(check(model, options, optimizer, args.budget / 100, policy, args.device), flush=True)
    for model, options, _ in [] if args.torchtitan_only else CASES[1:3]:  # the one call, on the user's own module
        print(check_one_call(model, options, args.budget / 100, args.device), flush=True)
    for row in check_torchtitan(*(TORCHTITAN if args.device == "cuda" else TORCHTITAN_CPU), policy, args.device):
        print(row, flush=True)


if __name__ == "__main__":
    main()
