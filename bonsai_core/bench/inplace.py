"""Coop's recomputable in-place against copy-on-write, for coop and for DTR in the same full-arena pool: the
optimizer's updates between steps (``--study updates``, the zoo models) and the ops eager runs in place during
the step (``--study writes``, ResNet-18 and ``hf:resnet``). Prints a JSON line per model and variant as
measured (:func:`bonsai_core.bench.heuristics.inplace_rows`): the smallest budget met and, at 80% of the
no-remat peak, the overhead and fragmentation in its own pool; ``bonsai bench heuristics --page`` writes them
into docs/results/heuristics.md."""

from __future__ import annotations

import argparse
import json

from bonsai_core.bench import common, heuristics


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--study", choices=("updates", "writes", "both"), default="both",
                    help="the optimizer's updates between steps, the ops' in-place writes during the step, or both")
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"models, options after a last colon as in `bonsai bench --models` (hf:resnet:batch=64) "
                         f"(default: {' '.join(heuristics.UPDATES_MODELS)} for updates; ResNet-18 and hf:resnet for "
                         f"writes)")
    ap.add_argument("--time-limit", type=float, default=20.0)


def main(args: argparse.Namespace) -> int:
    common.import_test_models()
    studies = {"updates": ([(name, {}) for name in heuristics.UPDATES_MODELS], heuristics.UPDATES),
               "writes": (heuristics.WRITES_MODELS, heuristics.WRITES)}
    for study, (models, variants) in studies.items():
        if args.study in (study, "both"):
            for row in heuristics.inplace_rows(models_of(args.models) if args.models else models, variants,
                                               args.time_limit):
                print(json.dumps({"study": study, **row}), flush=True)
    return 0


def models_of(texts: list[str]) -> list[tuple[str, dict[str, int]]]:
    """``--models`` as name and options, read as ``bonsai bench --models`` reads them."""
    from bonsai_core.bench.methods import ModelSpec

    return [(spec.name, dict(spec.options)) for spec in map(ModelSpec.parse, texts)]
