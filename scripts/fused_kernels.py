"""Fused kernels, predicted against measured: writes docs/results/fused_kernels.md.

1. Per kernel: for each fused op a model's traced step holds (the recurrent kernel, fused norms, fused
   attention, dropout's fused kernel) the bytes the graph gives each call (its outputs, what the
   autograd formula may save) against the bytes the eager CPU step's call makes
   (``bonsai_core.measure.OpOutputs``).
2. Recurrent language models (tests/recurrent_models.py), whole steps: the no-remat peak as traced
   through torch's decomposition of ``nn.LSTM`` and as `bonsai trace` records it (the fused kernel,
   ``bonsai_core.recurrent``) against the measured eager step; then bonsai at 80% of the no-remat
   peak exported with the checkpoint back-end: its own prediction (``realised_peak``) against the
   measured step (``verify_checkpoint``).
3. The optimizer step: the bytes the graph gives AdamW's step (``optimizer.step_bytes``: the foreach
   implementation) against the measured step, foreach and fused (``fused=True``, one in-place kernel).

``PYTHONPATH=. python scripts/fused_kernels.py [-o docs/results/fused_kernels.md]``
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

from bonsai_core import models
from bonsai_core.bench.common import page_header
from bonsai_core.errors import BonsaiError
from bonsai_core.export.checkpoint import export_checkpoint
from bonsai_core.export.verify import verify_checkpoint
from bonsai_core.measure import OpOutputs, measure_step, predicted_op_outputs
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import solve
from bonsai_core.trace import trace_model

FUSED_OPS = ["aten.mkldnn_rnn_layer.default", "aten.mkldnn_rnn_layer_backward.default",
             "aten.native_layer_norm.default", "aten.native_batch_norm.default", "aten._fused_rms_norm.default",
             "aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten._scaled_dot_product_efficient_attention.default", "aten.native_dropout.default"]
TEXT = dict(batch=2, seq=16, width=32, layers=2, heads=2, vocab=64)
KERNEL_MODELS = {
    "tests.recurrent_models:make_lstm_lm": {}, "tests.recurrent_models:make_bilstm_lm": {},
    "gpt": TEXT, "hf:gpt2": TEXT, "hf:bert": TEXT, "hf:llama": TEXT,
    "tests.real_models:resnet18_bn": dict(batch=2, image=32, width=8),
}
RECURRENT = ["make_lstm_lm", "make_bilstm_lm", "make_gru_lm", "make_packed_lstm_lm"]


def kernel_rows(spec: str, options: dict) -> list[str]:
    graph = trace_model(spec, **options).graph
    model, inputs, loss_fn = models.build(spec, **options)
    recorder = OpOutputs(FUSED_OPS)
    with recorder:
        loss_fn(model(*inputs)).backward()
    rows = []
    for op in FUSED_OPS:
        predicted = predicted_op_outputs(graph, op)
        measured = recorder.calls.get(op, [])
        if not predicted and not measured:
            continue
        same = predicted == measured
        rows.append(f"| `{spec}` | `{op.removeprefix('aten.')}` | {len(predicted)} / {len(measured)} | "
                    f"{_bytes_list(predicted)} | {_bytes_list(measured)} | {'equal' if same else 'differ'} |")
    return rows


def _bytes_list(values: list[int]) -> str:
    distinct = sorted(set(values))
    return ", ".join(f"{v:,}" for v in distinct) if distinct else "-"


def recurrent_row(factory: str) -> str:
    spec = f"tests.recurrent_models:{factory}"
    graph = trace_model(spec).graph
    try:
        with mock.patch("bonsai_core.recurrent.runs_fused_kernel", lambda *a: False), \
                mock.patch("bonsai_core.recurrent.runs_step_by_step", lambda *a: False):
            decomposed = no_remat_peak(trace_model(spec).graph)
    except BonsaiError as e:
        return _recurrent_row(factory, spec, f"does not trace ({type(e).__name__})", graph)
    return _recurrent_row(factory, spec, f"{decomposed:,} ({decomposed / eager_peak(spec) - 1:+.1%})", graph)


def eager_peak(spec: str) -> int:
    model, inputs, loss_fn = models.build(spec)
    return measure_step(model, inputs, loss_fn).peak


def _recurrent_row(factory: str, spec: str, decomposed: str, graph) -> str:  # noqa: ANN001
    model, inputs, loss_fn = models.build(spec)
    eager = measure_step(model, inputs, loss_fn).peak
    predicted = no_remat_peak(graph)
    schedule = solve(graph, int(0.8 * predicted), method="bonsai")
    out = Path(tempfile.mkdtemp()) / "ck"
    export_checkpoint(spec, {}, schedule, out)
    v = verify_checkpoint(spec, {}, out, repeats=1)
    return (f"| `{factory}` | {decomposed} | {predicted:,} ({predicted / eager - 1:+.1%}) "
            f"| {eager:,} | {schedule.stats['peak']:,} | {v.realised_peak:,} | {v.measured_peak:,} "
            f"| {v.realised_peak_error:+.2%} |")


def optimizer_rows(spec: str, options: dict) -> list[str]:
    from bonsai_core import optimizer as optim
    from bonsai_core.measure import LiveBytes, allocate_fixed

    graph = optim.with_optimizer(trace_model(spec, **options).graph, "adamw")
    rows = []
    for implementation in ("foreach", "fused"):
        model, inputs, loss_fn = models.build(spec, **options)
        step = torch.optim.AdamW(model.parameters(), lr=1e-3, **{implementation: True})
        allocate_fixed(model, inputs, loss_fn)
        optim.init_state(step)
        loss_fn(model(*inputs)).backward()
        tracker = LiveBytes()
        with tracker:
            step.step()
        rows.append(f"| `{spec}` | AdamW, {implementation} | {graph.optimizer['step_bytes']:,} | {tracker.peak:,} |")
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-o", "--out", default="docs/results/fused_kernels.md")
    args = parser.parse_args(argv)
    kernels = [row for spec, options in KERNEL_MODELS.items() for row in kernel_rows(spec, options)]
    recurrent = [recurrent_row(f) for f in RECURRENT]
    optimizers = optimizer_rows("gpt", TEXT)
    command = "PYTHONPATH=. python scripts/fused_kernels.py"
    text = TEMPLATE.format(header=page_header(command, ["scripts/fused_kernels.py"]), command=command,
                           optimizers="\n".join(optimizers), date=datetime.date.today().isoformat(),
                           machine=f"{platform.machine()} CPU, torch {torch.__version__}",
                           kernels="\n".join(kernels), recurrent="\n".join(recurrent))
    Path(args.out).write_text(text)
    print(text)


TEMPLATE = """{header}
# Fused kernels: predicted against measured

Written by `PYTHONPATH=. python scripts/fused_kernels.py` on {date} ({machine}; the project's shared
development machine, no GPU: every number is CPU live bytes, exact, from `bonsai_core.measure`). How the
trace records each kernel: [EXPORT.md](../EXPORT.md#recurrent-layers), `bonsai_core/recurrent.py`.

## Per kernel

For each fused op a model's traced step holds, the bytes the graph gives each call (the op's node and
its separated outputs: what the kernel makes, and what its autograd formula may keep for the backward
pass) against the bytes of the new storages the eager CPU step's call makes (`measure.OpOutputs`).
Calls: in the graph / in eager. A kernel the trace records as a GPU runs it (SDPA with dropout as the
memory-efficient kernel, dropout as `native_dropout`) has no call in a CPU eager step; those models' CPU
gap is in [predicted_vs_measured.md](predicted_vs_measured.md).

| model | kernel | calls | predicted bytes per call | measured bytes per call | |
| --- | --- | --- | --- | --- | --- |
{kernels}

## Recurrent language models, whole steps

Command: `{command}`, {date}.
An embedding, a 2-layer `nn.LSTM`/`nn.GRU` (width 64, dropout 0.1 between layers), a linear head;
batch 8, 32 tokens, vocabulary 256 (`tests/recurrent_models.py`). No-remat peak as traced through
torch's decomposition of the layer and as `bonsai trace` records it (the fused kernel), each against the measured
eager step; then bonsai at 80% of the no-remat peak, `export --backend checkpoint`: the plan's peak,
the back-end's own prediction (`realised_peak`) and the measured peak of the exported step.

| model | no-remat, decomposition | no-remat, kernel | measured | plan at 80% | realised_peak | measured (checkpoint) | error |
| --- | --- | --- | --- | --- | --- | --- | --- |
{recurrent}

The GRU and the packed-sequence LSTM (8 sequences of 32 down to 17 tokens, `pack_padded_sequence`
into the LSTM, `pad_packed_sequence` after it) are not fused kernels on the CPU: ATen runs them as
per-step cells, which the trace now records as ATen writes them (`bonsai_core/recurrent_steps.py`: the
input projected once per layer, CPU dropout between layers, each cell keeping the bytes eager's in-place
cell keeps). "decomposition" is torch's Python decomposition of the layer, as traced before; the packed
LSTM did not trace before (at `aten._pack_padded_sequence`, which reads the lengths' values): its
decomposition column is torch's, traced with the batch sizes now read from one real forward pass of the
model (`bonsai_core/packed.py`). A packed step's plan is made for the traced batch's lengths.

## The optimizer step

What the graph gives AdamW's step after the backward pass (`optimizer.step_bytes`, the foreach
implementation a CUDA run uses by default: one `sqrt` per parameter) against the measured step alone
(`LiveBytes` around `step()`), foreach and `fused=True` (`_fused_adamw_`, one in-place kernel that
allocates nothing the dispatcher sees). A fused step is over-predicted by the step bytes: `--optimizer`
has no fused variant yet.

| model | optimizer | predicted step bytes | measured step peak |
| --- | --- | --- | --- |
{optimizers}
"""

if __name__ == "__main__":
    main(sys.argv[1:])
