"""Coop's recomputable in-place, measured in two places, each against copy-on-write (a new block, then
the old one freed: the layout a rematerializing runtime without recomputable in-place leaves), for
coop and for DTR in the same full-arena pool:

* ``--study updates``: the optimizer writing parameters and Adam's state in place between steps (the
  pinned blocks keep their addresses; ``allocator.pin_fixed``'s ``updates``), on the zoo models;
* ``--study writes``: the ops eager runs in place during the step (``relu_``, ``x += y``: the graph's
  ``inplace_of``; option ``inplace_writes``), on the models that have them: a torchvision-style
  ResNet-18 (``tests.real_models:resnet18_bn``) and transformers' ResNet (``hf:resnet``), two sizes each.

Per model and variant (:func:`bonsai_core.bench.heuristics.inplace_rows`): the smallest budget met and, at
80% of the no-remat peak, the overhead and the fragmentation of its schedule in its own pool.

    bonsai bench inplace [--study updates|writes|both] [--models gpt hf:resnet:batch=64 ...] [--time-limit 20]

prints each row as measured (``bonsai bench heuristics --page`` writes them into docs/results/heuristics.md).
"""

from __future__ import annotations

import argparse
import json

from bonsai_core.bench import common, heuristics


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite's options."""
    ap.add_argument("--study", choices=("updates", "writes", "both"), default="both",
                    help="the optimizer's updates between steps, the ops' in-place writes during the step, or both")
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"models, options after a last colon as in `bonsai bench --models` (hf:resnet:batch=64) "
                         f"(default: {' '.join(heuristics.UPDATES_MODELS)} for updates; ResNet-18 and hf:resnet for "
                         f"writes)")
    ap.add_argument("--time-limit", type=float, default=20.0)


def main(args: argparse.Namespace) -> int:
    """A JSON line per model and variant of each study, as measured."""
    common.import_test_models()
    studies = {"updates": ([(name, {}) for name in heuristics.UPDATES_MODELS], heuristics.UPDATES),
               "writes": (heuristics.WRITES_MODELS, heuristics.WRITES)}
    for study, (models, variants) in studies.items():
        if args.study in (study, "both"):
            for row in heuristics.inplace_rows(_models(args.models) if args.models else models, variants,
                                               args.time_limit):
                print(json.dumps({"study": study, **row}), flush=True)
    return 0


def _models(texts: list[str]) -> list[tuple[str, dict[str, int]]]:
    """``--models`` as name and options, read as ``bonsai bench --models`` reads them."""
    from bonsai_core.bench.methods import ModelSpec

    specs = [ModelSpec.parse(text) for text in texts]
    return [(spec.name, dict(spec.options)) for spec in specs]
