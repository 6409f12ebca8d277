"""Predicted (simulator, no-remat schedule) vs measured (real eager CPU step) peak memory of every zoo
model at its default size and of the real models in tests/real_models.py (BatchNorm CNNs, a ViT with
``torch._assert``, Hugging Face GPT-2 and BERT from configs)
and of the ``hf:`` architectures at their default sizes, as a markdown table:
``bonsai bench predicted-vs-measured`` (``--zoo``, ``--real`` or ``--hf`` for one part)."""

from __future__ import annotations

import argparse

from bonsai_core.bench import common

# name -> options; the transformers twice: with the configs' dropout 0.1 and without
REAL = [("tests.real_models:resnet18_bn", {}), ("tests.real_models:mobilenet_v3_small", {}),
        *((f"tests.real_models:{m}", {"dropout": p}) for m in ("vit_assert", "gpt2", "bert_mlm") for p in (0.1, 0.0))]


def row(name: str, options: dict) -> str:
    from bonsai_core import models
    from bonsai_core.units import format_bytes
    from bonsai_core.measure import measure_step
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.trace import trace_model

    traced = trace_model(name, **options)
    g = traced.graph
    predicted = no_remat_peak(g)
    model, inputs, loss_fn = models.build(name, **options)
    measured = measure_step(model, inputs, loss_fn, frozen=traced.frozen_params).peak
    label = name.removeprefix("tests.real_models:") + "".join(f" {k}={v}" for k, v in options.items())
    return (f"| {label} | {g.n} ({int(g.is_forward.sum())} forward) | {format_bytes(predicted)} | "
            f"{format_bytes(measured)} | {predicted / measured:.4f} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The parts to run (default: all three)."""
    parser.add_argument("--zoo", action="store_true", help="the zoo models at their default sizes")
    parser.add_argument("--real", action="store_true", help="the real models in tests/real_models.py")
    parser.add_argument("--hf", action="store_true", help="the hf: architectures at their default sizes")


def main(args: argparse.Namespace) -> int:
    """One markdown row per model, printed."""
    from bonsai_core import models

    common.import_test_models()
    which = [f"--{part}" for part in ("zoo", "real", "hf") if getattr(args, part)] or ["--zoo", "--real", "--hf"]
    print("| model | ops | predicted peak | measured peak (CPU live bytes) | predicted / measured |")
    print("|---|---:|---:|---:|---:|")
    if "--zoo" in which:
        for name in models.zoo.ZOO:
            print(row(name, {}), flush=True)
    if "--real" in which:
        for name, options in REAL:
            print(row(name, options), flush=True)
    if "--hf" in which:
        from bonsai_core.models.hf import ARCHS

        for arch in ARCHS:
            print(row(f"hf:{arch}", {}), flush=True)
    return 0
