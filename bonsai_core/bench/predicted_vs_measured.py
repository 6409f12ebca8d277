"""Predicted (simulator, no-remat schedule) vs measured (real eager CPU step) peak memory of every zoo
model at its default size, of the real models in tests/real_models.py (BatchNorm CNNs, a ViT with
``torch._assert``, Hugging Face GPT-2 and BERT from configs) and of the ``hf:`` architectures at their
default sizes: ``bonsai bench predicted-vs-measured`` (``--zoo``, ``--real`` or ``--hf`` for one part;
``-o PAGE`` writes the markdown page, docs/results/predicted_vs_measured.md, instead of printing rows).

Each model is traced twice: with the CPU's kernels, the ones the measured eager step runs (dropout's
float noise, SDPA on its math path), and with CUDA's (``native_dropout``'s bool mask, fused attention),
the default of ``bonsai trace``: the second column shows what a plan made for a GPU would mispredict
on the CPU."""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path

from bonsai_core.bench import common

# name -> options; the transformers twice: with the configs' dropout 0.1 and without
REAL = [("tests.real_models:resnet18_bn", {}), ("tests.real_models:mobilenet_v3_small", {}),
        *((f"tests.real_models:{m}", {"dropout": p}) for m in ("vit_assert", "gpt2", "bert_mlm") for p in (0.1, 0.0))]
COMMAND = "bonsai bench predicted-vs-measured -o docs/results/predicted_vs_measured.md"
COLUMNS = ("| model | ops | predicted peak | measured peak (CPU live bytes) | predicted / measured | traced with CUDA's "
           "kernels: predicted / measured |\n|---|---:|---:|---:|---:|---:|")
PAGE = """{header}
# Predicted vs measured memory (no rematerialization)

`{command}` on {date}, {machine}. The simulator's peak for the no-remat schedule against a real eager
training step on CPU, measured by `bonsai_core.measure.LiveBytes` (a `TorchDispatchMode` that follows
tensor storages and their release; gradient buffers allocated up front, as in steady-state training,
except for parameters the loss does not use). Zoo models at their default sizes, then models as users
bring them (`tests/real_models.py`: BatchNorm CNNs in train mode, a ViT with `torch._assert`, SDPA and
dropout, Hugging Face `GPT2LMHeadModel` / `BertForMaskedLM` from small configs, each with dropout 0.1
and 0.0), then the `hf:` architectures at their default sizes.

Each model is traced with the CPU's kernels, those the measured step runs (dropout keeps a 4-byte
float noise per element; SDPA takes its math path and keeps the attention probabilities), as
`bonsai.checkpoint` plans a CPU model. The last column traces it with CUDA's kernels instead
(`native_dropout`'s 1-byte mask, fused attention), the default of `bonsai trace` for a GPU run: its
gap is the kernels' alone, not the simulator's. With the CPU's kernels the largest deviation here is
{worst}. A CNN's prediction a little above its measurement is the multi-output rule for backward ops
(docs/DESIGN.md): `convolution_backward` returns the input gradient with the weight gradient, and the
node keeps both until the input gradient is consumed, where eager PyTorch moves the weight gradient
into `.grad` at once. `tests/test_trace.py`, `tests/test_real_models.py` and `tests/test_hf.py` hold the
simulator to these numbers. Not measured on a GPU.

{columns}
{rows}
"""


def measure_row(name: str, options: dict) -> tuple[str, float]:
    """The markdown row of one model, and its predicted / measured ratio with the CPU's kernels."""
    from bonsai_core import models
    from bonsai_core.measure import measure_step
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.trace import trace_model
    from bonsai_core.units import format_bytes

    traced = trace_model(name, kernels="cpu", **options)
    g = traced.graph
    predicted = no_remat_peak(g)
    for_cuda = no_remat_peak(trace_model(name, **options).graph)
    model, inputs, loss_fn = models.build(name, **options)
    measured = measure_step(model, inputs, loss_fn, frozen=traced.frozen_params).peak
    label = name.removeprefix("tests.real_models:") + "".join(f" {k}={v}" for k, v in options.items())
    return (f"| {label} | {g.n} ({int(g.is_forward.sum())} forward) | {format_bytes(predicted)} | "
            f"{format_bytes(measured)} | {predicted / measured:.4f} | {for_cuda / measured:.4f} |"), predicted / measured


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The parts to run (default: all three), and the page to write."""
    parser.add_argument("--zoo", action="store_true", help="the zoo models at their default sizes")
    parser.add_argument("--real", action="store_true", help="the real models in tests/real_models.py")
    parser.add_argument("--hf", action="store_true", help="the hf: architectures at their default sizes")
    parser.add_argument("-o", "--out", help="write the markdown page here (all three parts) instead of printing rows")


def models_of(parts: list[str]) -> list[tuple[str, dict]]:
    """(spec, options) of every model the parts (``zoo``, ``real``, ``hf``) name, in that order."""
    from bonsai_core import models
    from bonsai_core.models.hf import ARCHS

    return [*((name, {}) for name in models.zoo.ZOO if "zoo" in parts), *(REAL if "real" in parts else ()),
            *((f"hf:{arch}", {}) for arch in ARCHS if "hf" in parts)]


def main(args: argparse.Namespace) -> int:
    """One markdown row per model, printed as measured; with ``--out``, the page written."""
    common.import_test_models()
    parts = [part for part in ("zoo", "real", "hf") if getattr(args, part)] or ["zoo", "real", "hf"]
    if args.out is None:
        print(COLUMNS, flush=True)
    rows, ratios = [], []
    for name, options in models_of(parts):
        line, ratio = measure_row(name, options)
        print(line, flush=True)
        rows.append(line)
        ratios.append(ratio)
    if args.out is not None:
        import torch

        worst = max(ratios, key=lambda r: abs(r - 1))
        Path(args.out).write_text(PAGE.format(
            header=common.page_header(COMMAND, ["bonsai_core/bench/predicted_vs_measured.py", "tests/real_models.py"]),
            command=COMMAND, date=datetime.date.today(), machine=f"{platform.machine()} CPU, torch {torch.__version__}",
            worst=f"{worst - 1:+.2%} (predicted / measured {worst:.4f})", columns=COLUMNS, rows="\n".join(rows)))
    return 0
