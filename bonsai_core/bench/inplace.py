"""Coop's recomputable in-place, measured: the optimizer writing parameters and Adam's state in place
(the pinned blocks keep their addresses) against copy-on-write (each a new block, then the old one
freed: the layout a rematerializing runtime without recomputable in-place leaves), for coop and for
DTR in the same full-arena pool (``allocator.pin_fixed``'s ``updates``).

Per zoo model at its default size: the smallest budget each variant meets (the bisection of
``bonsai bench heuristics``) and, at 80% of the no-remat peak, the overhead and the fragmentation
of its schedule in its own pool (the allocator model's one definition, 1 - live / reserved at the
reserved peak: ``allocator.pool_replay``, ``bonsai simulate --allocator --arena``).

    bonsai bench inplace [--models gpt resnet ...] [--time-limit 20]

prints a markdown table (docs/results/heuristics.md has the measured one).
"""

from __future__ import annotations

import argparse
import os

from bonsai_core.bench import heuristics as bench  # the shared runner and bisection
from bonsai_core.schedule import no_remat_peak

VARIANTS = {
    "coop in place": ("coop", {}),
    "coop copy": ("coop", {"inplace_updates": False}),
    "dtr-pool in place": ("dtr", {"allocator": True, "full_arena": True}),
    "dtr-pool copy": ("dtr", {"allocator": True, "full_arena": True, "inplace_updates": False}),
}
MODELS = ("gpt", "resnet", "unet", "mlp", "vgg")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite's options."""
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--time-limit", type=float, default=20.0)


def main(args: argparse.Namespace) -> int:
    """One row per model and variant, printed as a markdown table."""
    from bonsai_core.trace import trace_model

    bench.VARIANTS.update(VARIANTS)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| model | variant | smallest budget | overhead at 80% | pool fragmentation at 80% |")
    print("|---|---|---|---|---|")
    for name in args.models:
        g = trace_model(name).graph
        ref = no_remat_peak(g)
        for label in VARIANTS:
            smallest = bench.smallest_budget(g, label, args.time_limit)
            row = bench.run(g, int(0.8 * ref), label, args.time_limit, measure=True)
            at80 = (f"{row['overhead']:+.2%} | {row['own_fragmentation']:.1%}" if row["ok"]
                    else f"- ({row['error']}) | -")
            print(f"| {name} | {label} | {smallest / ref:.1%} | {at80} |" if smallest else
                  f"| {name} | {label} | - | {at80} |", flush=True)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0
