"""Predicted (simulator, no-remat schedule) against measured (a real eager CPU step) peak memory of every zoo
model, of the real models in tests/real_models.py and of the ``hf:`` architectures, at their default sizes:
``--out``/results.json and, with ``--page``, docs/results/predicted_vs_measured.md. Each model is traced with
the CPU's kernels, the ones the measured step runs, and with CUDA's (the default of ``bonsai trace``): what a
plan made for a GPU would mispredict on the CPU."""

from __future__ import annotations

import argparse
from typing import Any

from bonsai_core.bench import common
from bonsai_core.schedule import no_remat_peak

# name -> options; the transformers twice: with the configs' dropout 0.1 and without
REAL = [("tests.real_models:resnet18_bn", {}), ("tests.real_models:mobilenet_v3_small", {}),
        *((f"tests.real_models:{m}", {"dropout": p}) for m in ("vit_assert", "gpt2", "bert_mlm") for p in (0.1, 0.0))]
PARTS = {"zoo": "the zoo models at their default sizes", "real": "the real models in tests/real_models.py",
         "hf": "the hf: architectures at their default sizes"}
OUT = "docs/bench/predicted_vs_measured"
PAGE = "docs/results/predicted_vs_measured.md"
SOURCES = ["bonsai_core/bench/predicted_vs_measured.py", "tests/real_models.py",
           common.template_source("predicted_vs_measured")]


def measure_row(name: str, options: dict) -> dict[str, Any]:
    """One model's ops and no-remat peaks: predicted with the CPU's kernels and with CUDA's, and measured."""
    from bonsai_core import models
    from bonsai_core.measure import measure_step
    from bonsai_core.trace import trace_model

    traced = trace_model(name, kernels="cpu", **options)
    g = traced.graph
    model, inputs, loss_fn = models.build(name, **options)
    return {"model": name.removeprefix("tests.real_models:") + "".join(f" {k}={v}" for k, v in options.items()),
            "ops": g.n, "forward": int(g.is_forward.sum()), "predicted": no_remat_peak(g),
            "predicted_cuda_kernels": no_remat_peak(trace_model(name, **options).graph),
            "measured": measure_step(model, inputs, loss_fn, frozen=traced.frozen_params).peak}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for part, models in PARTS.items():
        parser.add_argument(f"--{part}", action="store_true", help=models)
    common.add_page_arguments(parser, OUT, PAGE)


def models_of(parts: list[str]) -> list[tuple[str, dict]]:
    """(spec, options) of every model the parts (``zoo``, ``real``, ``hf``) name, in that order."""
    from bonsai_core import models
    from bonsai_core.models.hf import ARCHS

    return [*((name, {}) for name in models.zoo.ZOO if "zoo" in parts), *(REAL if "real" in parts else ()),
            *((f"hf:{arch}", {}) for arch in ARCHS if "hf" in parts)]


def measure(parts: list[str]) -> dict[str, Any]:
    """Every model's row, printed as measured."""
    common.import_test_models()
    return {"meta": common.run_meta(parts=parts),
            "rows": [common.progress(measure_row(name, options)) for name, options in models_of(parts)]}


def page(results: dict[str, Any], header: str) -> str:
    ratios = [r["predicted"] / r["measured"] for r in results["rows"]]
    return common.fill("predicted_vs_measured", header=header, meta=results["meta"], rows=results["rows"],
                       worst=max(ratios, key=lambda r: abs(r - 1)))


def main(args: argparse.Namespace) -> int:
    parts = [part for part in PARTS if getattr(args, part)] or list(PARTS)
    narrowed = [f"--{part}" for part in parts] if len(parts) < len(PARTS) else []
    return common.run_page_suite("predicted-vs-measured", args, common.page_refusal(args, OUT, PAGE, narrowed=narrowed),
                                 lambda: measure(parts), common.page_writer(page, SOURCES))
