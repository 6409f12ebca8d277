"""Coop's recomputable in-place, measured in two places, each against copy-on-write (a new block, then
the old one freed: the layout a rematerializing runtime without recomputable in-place leaves), for
coop and for DTR in the same full-arena pool:

* ``--study updates``: the optimizer writing parameters and Adam's state in place between steps (the
  pinned blocks keep their addresses; ``allocator.pin_fixed``'s ``updates``), on the zoo models;
* ``--study writes``: the ops eager runs in place during the step (``relu_``, ``x += y``: the graph's
  ``inplace_of``; option ``inplace_writes``), on the models that have them: a torchvision-style
  ResNet-18 (``tests.real_models:resnet18_bn``) and transformers' ResNet (``hf:resnet``), two sizes each.

Per model: the smallest budget each variant meets (the bisection of ``bonsai bench heuristics``) and,
at 80% of the no-remat peak, the overhead and the fragmentation of its schedule in its own pool (the
allocator model's one definition, 1 - live / reserved at the reserved peak: ``solvers.pool.pool_replay``,
``bonsai simulate --allocator --arena``).

    bonsai bench inplace [--study updates|writes|both] [--models gpt hf:resnet:batch=64 ...] [--time-limit 20]

prints markdown tables (``bonsai bench heuristics --page`` writes them into docs/results/heuristics.md).
"""

from __future__ import annotations

import argparse
import os
from typing import Iterator

from bonsai_core.bench import common
from bonsai_core.bench import heuristics as bench  # the shared runner and bisection
from bonsai_core.schedule import no_remat_peak

VARIANTS = {
    "coop in place": ("coop", {}),
    "coop copy": ("coop", {"inplace_updates": False}),
    "dtr-pool in place": ("dtr", {"allocator": True, "full_arena": True}),
    "dtr-pool copy": ("dtr", {"allocator": True, "full_arena": True, "inplace_updates": False}),
}
MODELS = ("gpt", "resnet", "unet", "mlp", "vgg")
WRITES = {
    "coop writes in place": ("coop", {}),
    "coop copy-on-write": ("coop", {"inplace_writes": False}),
    "dtr-pool writes in place": ("dtr", {"allocator": True, "full_arena": True}),
    "dtr-pool copy-on-write": ("dtr", {"allocator": True, "full_arena": True, "inplace_writes": False}),
}
# the models with in-place writes (the zoo and the other hf: models have none), two sizes each
WRITES_MODELS: list[tuple[str, dict[str, int]]] = [
    ("tests.real_models:resnet18_bn", {"batch": 64}), ("tests.real_models:resnet18_bn", {"batch": 128}),
    ("hf:resnet", {"batch": 64}), ("hf:resnet", {"batch": 128, "image": 64}),
]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite's options."""
    ap.add_argument("--study", choices=("updates", "writes", "both"), default="both",
                    help="the optimizer's updates between steps, the ops' in-place writes during the step, or both")
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"models, options after a last colon as in `bonsai bench --models` (hf:resnet:batch=64) "
                         f"(default: {' '.join(MODELS)} for updates; ResNet-18 and hf:resnet for writes)")
    ap.add_argument("--time-limit", type=float, default=20.0)


def main(args: argparse.Namespace) -> int:
    """One markdown table per study: a row per model and variant."""
    common.import_test_models()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    if args.study in ("updates", "both"):
        print("### The optimizer's updates between steps\n")
        _table(_models(args.models) if args.models else [(name, {}) for name in MODELS], VARIANTS, args.time_limit)
    if args.study in ("writes", "both"):
        print("\n### In-place writes during the step\n")
        _table(_models(args.models) if args.models else WRITES_MODELS, WRITES, args.time_limit)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def _models(texts: list[str]) -> list[tuple[str, dict[str, int]]]:
    """``--models`` as name and options, read as ``bonsai bench --models`` reads them."""
    from bonsai_core.bench.methods import ModelSpec

    specs = [ModelSpec.parse(text) for text in texts]
    return [(spec.name, dict(spec.options)) for spec in specs]


def measure(models: list[tuple[str, dict[str, int]]], variants: dict[str, tuple[str, dict]],
            time_limit: float) -> Iterator[dict]:
    """One row per model and variant, as measured: the model's label and in-place ops, the smallest budget
    met (a share of the no-remat peak, None when none up to 1.5x), and the run at 80%
    (:func:`heuristics.run`, measured)."""
    from bonsai_core.trace import trace_model

    for name, options in models:
        g = trace_model(name, **options).graph
        ref = no_remat_peak(g)
        for variant in variants:
            smallest = bench.smallest_budget(g, variant, time_limit, variants=variants)
            yield {"model": bench.label_of(name, options), "inplace_ops": int((g.inplace_of >= 0).sum()),
                   "variant": variant, "smallest": smallest / ref if smallest else None,
                   "at80": bench.run(g, int(0.8 * ref), variant, time_limit, measure=True, variants=variants)}


def _table(models: list[tuple[str, dict[str, int]]], variants: dict[str, tuple[str, dict]], time_limit: float) -> None:
    """Print one row per model and variant: smallest budget, and overhead and pool fragmentation at 80%."""
    print("| model | variant | smallest budget | overhead at 80% | pool fragmentation at 80% |")
    print("|---|---|---|---|---|")
    for row in measure(models, variants, time_limit):
        run = row["at80"]
        label = row["model"] + (f" ({row['inplace_ops']} in-place ops)" if variants is WRITES else "")
        at80 = f"{run['overhead']:+.2%} | {run['own_fragmentation']:.1%}" if run["ok"] else f"- ({run['error']}) | -"
        smallest = f"{row['smallest']:.1%}" if row["smallest"] else "-"
        print(f"| {label} | {row['variant']} | {smallest} | {at80} |", flush=True)
