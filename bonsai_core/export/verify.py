"""The original and the exported step side by side on one device, for both back-ends.

What ``verify_export`` (replay back-end) checks, each one a field of :class:`Verification`:

* loss, gradients and buffers (BatchNorm statistics) after one step, against the original model's
  step under the same ``torch.manual_seed`` (so dropout draws the same masks);
* the peak, both ways: measured against predicted, with ``.grad`` pre-allocated (the simulator's
  ``fixed_mem``) and again with ``.grad`` None (after ``optimizer.zero_grad()``), where the gradients
  must match too and the peak must not exceed the prediction;
* wall time of the exported step against the original's (the measured overhead, next to the
  simulator's predicted one).

``verify_checkpoint`` (checkpoint back-end, :class:`CheckpointVerification`) compares loss, gradients,
peak and time of the user's module with and without ``apply``, at any batch size. Both judge the
differences with the same tolerances (:func:`loss_problem`, :func:`gradient_problem`).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from bonsai_core.errors import ModelError
from bonsai_core.export.folder import ExportError, load_export
from bonsai_core.trace.patches import AUTOCAST, autocast_context

PEAK_TOLERANCE = 0.10  # |measured / predicted - 1| beyond this is a mismatch, above or below
# Under autocast a fused kernel (CPU flash attention) may block its sums differently from eager's call
# and round one bit apart in the low-precision type: a gradient matches within two of its units in the
# last place at that tensor's scale (measured on HF Llama and GPT-2 in bf16: at most 0.91 of one).
ROUNDING = {"bf16": 2 * torch.finfo(torch.bfloat16).eps, "fp16": 2 * torch.finfo(torch.float16).eps}
# With parameters in a low-precision type (``--dtype bf16``) every op rounds to it, and the program and
# eager round some of the same sums differently (the CPU attention in blocks, kernels called with other
# strides). Measured on HF GPT-2 and Llama in bf16 against the reference below: up to 2 units in the
# last place at a tensor's scale; a wrong mask or a missed term is tens of units. A gradient (and the
# loss) matches within four units.
PARAMETER_ROUNDING = {"bf16": 4 * torch.finfo(torch.bfloat16).eps, "fp16": 4 * torch.finfo(torch.float16).eps}
LOW_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# A float32 gradient summed in another order (a decomposed kernel, another blocking of the same sum)
# rounds differently: summing N terms adds a rounding error per addition, and these errors, of either
# sign, grow like sqrt(N) * eps of the sum's scale. A weight gradient sums up to about 1e6 terms
# (batch x positions), so sqrt(1e6) * 1.19e-7 = 1.2e-4 of the tensor's largest magnitude. A gradient
# matches when it is within the absolute tolerance (--atol) or within this fraction of its scale.
GRAD_RTOL = 1e-4
TIMING_REPEATS = 3


def gradient_problem(absolute: float, scaled: float, atol: float, autocast: str | None = None,
                     precision: str | None = None) -> str | None:
    """The mismatch of a largest gradient difference (``absolute``; ``scaled``: relative to that
    tensor's largest magnitude) in words, or None when it is within ``atol`` or within the
    rounding of its scale (:data:`GRAD_RTOL`, wider under autocast: :data:`ROUNDING`, and with
    parameters in ``precision`` "bf16" / "fp16": :data:`PARAMETER_ROUNDING`)."""
    rtol = max(GRAD_RTOL, ROUNDING.get(autocast or "", 0.0), PARAMETER_ROUNDING.get(precision or "", 0.0))
    if absolute <= atol or scaled <= rtol:
        return None
    return f"a gradient differs by {absolute:.3g} (> {atol:g}), {scaled:.3g} of its tensor's scale (> {rtol:.3g})"


def loss_problem(original: float, exported: float, atol: float, precision: str | None = None) -> str | None:
    """The loss mismatch in words, or None when the losses are within ``atol`` or, for a loss computed
    in ``precision`` "bf16" / "fp16", within :data:`PARAMETER_ROUNDING` of its size."""
    diff = abs(exported - original)
    rtol = PARAMETER_ROUNDING.get(precision or "", 0.0)
    if diff <= atol or diff <= rtol * abs(original):
        return None
    return f"the loss differs by {diff:.3g} (> {atol:g}" + (f" and > {rtol:.3g} of its size)" if rtol else ")")


def precision_of(tensors: Any) -> str | None:
    """"bf16" or "fp16" when any of ``tensors`` (gradients) is in that type, else None."""
    names = {LOW_PRECISION.get(t.dtype) for t in tensors} - {None}
    return "fp16" if "fp16" in names else next(iter(names), None)


class StepVerification:
    """What the verification of either back-end shares: the original step and the exported one side by
    side (``loss_original``, ``loss_exported``, ``max_grad_diff``, ``max_grad_scaled_diff``,
    ``autocast``, ``precision``: fields of each subclass), judged with the same tolerances."""

    DERIVED: ClassVar[tuple[str, ...]] = ("loss_diff",)  # the properties :meth:`to_dict` adds

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_exported - self.loss_original)

    def largest_grad_diff(self) -> float:
        """The largest absolute gradient difference of every run compared."""
        return self.max_grad_diff

    def problems(self, atol: float = 1e-5, peak_tolerance: float = PEAK_TOLERANCE) -> list[str]:
        """What is wrong, in words; empty when the export is verified."""
        loss = loss_problem(self.loss_original, self.loss_exported, atol, self.precision)
        grads = gradient_problem(self.largest_grad_diff(), self.max_grad_scaled_diff, atol, self.autocast,
                                 self.precision)
        return [p for p in (loss, grads) if p] + self.step_problems(atol, peak_tolerance)

    def step_problems(self, atol: float, peak_tolerance: float) -> list[str]:
        """The problems beyond loss and gradients (buffers, peak) of this back-end's step: none here."""
        return []

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **{name: getattr(self, name) for name in self.DERIVED}}


@dataclass(frozen=True)
class Verification(StepVerification):
    """The original and the exported step, side by side on one device."""

    device: str
    loss_original: float
    loss_exported: float
    max_grad_diff: float
    predicted_peak: int
    measured_peak: int
    original_peak: int
    max_buffer_diff: float = 0.0  # model buffers (BatchNorm statistics) after the step
    max_grad_diff_grads_none: float = 0.0  # the exported step again, starting from .grad None
    measured_peak_grads_none: int = 0
    grads_none_mismatch: tuple[str, ...] = ()  # parameters whose .grad is None in one run only
    seconds_original: float = 0.0  # median wall time of one step (no memory tracking)
    seconds_exported: float = 0.0
    predicted_overhead: float = 0.0  # the simulator's compute overhead of the schedule
    autocast: str | None = None
    max_grad_scaled_diff: float = 0.0  # largest gradient difference / that tensor's largest magnitude
    precision: str | None = None  # "bf16" / "fp16" when the parameters (their gradients) are in that type
    measured_host_peak: int = 0  # offloaded copies (rule 9), counted apart from the peak (CPU only)

    DERIVED: ClassVar[tuple[str, ...]] = ("loss_diff", "peak_error", "peak_error_grads_none", "measured_overhead")

    @property
    def peak_error(self) -> float:
        """(measured - predicted) / predicted, with ``.grad`` pre-allocated: negative when the real
        step used less than predicted (as much a model or tracker error as using more)."""
        return self.measured_peak / self.predicted_peak - 1.0

    @property
    def peak_error_grads_none(self) -> float:
        return self.measured_peak_grads_none / self.predicted_peak - 1.0

    @property
    def measured_overhead(self) -> float:
        """Exported step time / original step time - 1."""
        return self.seconds_exported / self.seconds_original - 1.0 if self.seconds_original > 0 else 0.0

    def largest_grad_diff(self) -> float:
        return max(self.max_grad_diff, self.max_grad_diff_grads_none)

    def step_problems(self, atol: float, peak_tolerance: float) -> list[str]:
        out = []
        if self.grads_none_mismatch:
            out.append(f".grad is None in one run only for {', '.join(self.grads_none_mismatch[:3])}")
        if self.max_buffer_diff > atol:
            out.append(f"a buffer (e.g. a BatchNorm statistic) differs by {self.max_buffer_diff:.3g} after the step")
        if self.peak_error > peak_tolerance:
            out.append(f"the measured peak is {self.peak_error:+.1%} above the prediction (tolerance {peak_tolerance:.0%})")
        elif self.peak_error < -peak_tolerance:
            out.append(f"the measured peak is {self.peak_error:+.1%} below the prediction (tolerance {peak_tolerance:.0%}): "
                       "the simulator's graph or the memory tracker is wrong for this model; report it")
        if self.peak_error_grads_none > peak_tolerance:
            out.append(f"with .grad None the measured peak is {self.peak_error_grads_none:+.1%} above the prediction")
        return out


def measuring_device(device: str) -> torch.device:
    """``torch.device(device)`` for a device whose peak verify can measure: the CPU (a live-bytes
    tracker) or a CUDA device (``torch.cuda.max_memory_allocated``). ModelError for anything else."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ModelError(f"--device {device!r}: verify measures the peak on cpu or cuda (cuda:N for one GPU).")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for, but this PyTorch sees no CUDA device.")
    return dev


def build_on(model: str, options: dict[str, Any], seed: int, dev: torch.device
             ) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    """A fresh ``(net, inputs, loss_fn)`` of ``model`` with ``options`` and ``seed``, moved to ``dev``."""
    from bonsai_core import models

    net, inputs, loss_fn = models.build(model, seed=seed, **options)
    if isinstance(loss_fn, nn.Module):
        loss_fn = loss_fn.to(dev)
    return net.to(dev), tuple(x.to(dev) for x in inputs), loss_fn


def verify_export(model: str, options: dict[str, Any], out_dir: str | Path, *, device: str = "cpu",
                  seed: int = 0, grads: str = "autograd", autocast: str | None = None,
                  repeats: int = TIMING_REPEATS) -> Verification:
    """Run one step of the original model and of the export on ``device`` (one after the other, so
    only one copy is resident) and compare loss, gradients, buffers, peak memory and time.

    ``autocast`` ("bf16" | "fp16") runs the original under ``torch.autocast``; the default is the
    one the export was traced with. ``repeats`` untracked steps of each are timed (0: no timing)."""
    exported = load_export(out_dir)
    predicted = int(exported.INFO["predicted_peak"])
    # the graph's optimizer (bonsai trace --optimizer): its step runs after the measured backward pass
    optimizer = exported.INFO.get("optimizer") or "none"
    traced_autocast = exported.INFO.get("autocast")
    if autocast is None:
        autocast = traced_autocast
    elif autocast != traced_autocast:
        raise ModelError(f"This export was traced with autocast {traced_autocast or 'off'}, not {autocast}: export "
                         "again with --autocast, or verify without it.")
    run = _ReplayRun(model, options, out_dir, measuring_device(device), seed, grads, autocast, exported)
    reference, ref_buffers, original, seconds_original = _original_steps(run, optimizer, repeats)
    measured, grad_diff, grad_scaled, buffer_diff, seconds_exported = _exported_steps(run, optimizer, repeats,
                                                                                     reference, ref_buffers)
    peak_none, mismatch, grad_diff_none, scaled_none = _exported_step_from_grads_none(run, reference)
    return Verification(device=measured.device, loss_original=original.loss, loss_exported=measured.loss,
                        max_grad_diff=grad_diff, predicted_peak=predicted, measured_peak=measured.peak,
                        original_peak=original.peak, max_buffer_diff=buffer_diff,
                        max_grad_diff_grads_none=grad_diff_none, measured_peak_grads_none=peak_none,
                        grads_none_mismatch=mismatch, seconds_original=seconds_original,
                        seconds_exported=seconds_exported, predicted_overhead=float(exported.INFO.get("overhead", 0.0)),
                        autocast=autocast, max_grad_scaled_diff=max(grad_scaled, scaled_none),
                        precision=precision_of(reference.values()), measured_host_peak=measured.host_peak)


@dataclass(frozen=True)
class _ReplayRun:
    """What every step of :func:`verify_export` shares: the model, the device, the seed and the export."""

    model: str
    options: dict[str, Any]
    out_dir: str | Path
    dev: torch.device
    seed: int
    grads: str
    autocast: str | None
    exported: ModuleType

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
        """A fresh model, batch and loss on the device."""
        return build_on(self.model, self.options, self.seed, self.dev)

    def seeded(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """``step`` under the seed (the same random numbers, dropout masks, in both steps) and the autocast."""
        def run() -> torch.Tensor:
            torch.manual_seed(self.seed)
            with autocast_context(self.autocast, self.dev.type):
                return step()
        return run

    def load(self, net: nn.Module) -> Any:
        """The export's ``load(net)``; a model it does not fit is a ModelError."""
        try:
            return self.exported.load(net, grads=self.grads)
        except ValueError as e:
            raise ModelError(f"The export in {str(self.out_dir)!r} does not fit {self.model!r} with these options: "
                             f"{e}") from None

    def exported_step(self, ck: Any, inputs: tuple[torch.Tensor, ...], loss_fn: Any) -> Callable[[], torch.Tensor]:
        """One seeded step of the checkpointed module ``ck``."""
        def step() -> torch.Tensor:
            loss = ck(*inputs, loss_fn=loss_fn)
            loss.backward()
            return loss
        return self.seeded(step)


def _original_steps(run: _ReplayRun, optimizer: str, repeats: int) -> tuple[dict[str, torch.Tensor],
                                                                             dict[str, torch.Tensor], Any, float]:
    """(reference gradients, reference buffers, measured step, median seconds) of the original model:
    one step from .grad None (which parameters get a gradient, the buffers after one step), then the
    same step again from the same buffers for its peak."""
    from bonsai_core.measure import eager_step, measure_step
    from bonsai_core.optimizer import make as make_optimizer

    net, inputs, loss_fn = run.build()
    step = run.seeded(eager_step(net, inputs, loss_fn))
    before = {n: b.detach().clone() for n, b in net.named_buffers()}
    reference_dropout = NativeDropout() if precision_of(net.parameters()) else contextlib.nullcontext()
    try:
        with reference_dropout:
            step()
    except Exception as e:  # the user's model on real values, which the trace (shapes only) never ran
        from bonsai_core.user_code import user_code

        raise ModelError(f"One training step of {run.model!r} with these options fails on real tensors, before the "
                         f"export is run: {user_code(e, net)}: {type(e).__name__}: {e}. Tracing runs on shapes "
                         "only and cannot see this; fix the model or its options (a sequence longer than its "
                         "position table, an index out of range) and trace again.") from None
    reference = {n: p.grad.detach().cpu() for n, p in net.named_parameters() if p.grad is not None}
    ref_buffers = {n: b.detach().cpu().clone() for n, b in net.named_buffers()}
    with torch.no_grad():
        for n, b in net.named_buffers():
            b.copy_(before[n])
    net.zero_grad(set_to_none=True)
    original = measure_step(net, inputs, loss_fn, step=step, optimizer=make_optimizer(net.parameters(), optimizer))
    seconds = _median_seconds(step, run.dev, repeats)
    return reference, ref_buffers, original, seconds


def _exported_steps(run: _ReplayRun, optimizer: str, repeats: int, reference: dict[str, torch.Tensor],
                    ref_buffers: dict[str, torch.Tensor]) -> tuple[Any, float, float, float, float]:
    """(measured step, largest gradient difference, largest scaled one, largest buffer difference,
    median seconds) of the export with ``.grad`` pre-allocated (steady-state training)."""
    from bonsai_core.measure import measure_step
    from bonsai_core.optimizer import make as make_optimizer

    net, inputs, loss_fn = run.build()
    ck = run.load(net)
    try:
        measured = measure_step(net, inputs, loss_fn, step=run.exported_step(ck, inputs, loss_fn),
                                optimizer=make_optimizer(net.parameters(), optimizer))
    except (TypeError, ValueError) as e:  # the runtime's own checks: shapes, dtypes, loss buffers
        raise ModelError(f"The export in {str(run.out_dir)!r} does not fit {run.model!r} with these options: "
                         f"{e}") from None
    exported_grads = {n: p.grad for n, p in net.named_parameters() if n in reference}
    grad_diff, grad_scaled = largest_differences(exported_grads, reference)
    buffer_diff = largest_differences(dict(net.named_buffers()), ref_buffers)[0]
    seconds = _median_seconds(run.exported_step(ck, inputs, loss_fn), run.dev, repeats)
    return measured, grad_diff, grad_scaled, buffer_diff, seconds


def _exported_step_from_grads_none(run: _ReplayRun, reference: dict[str, torch.Tensor]
                                   ) -> tuple[int, tuple[str, ...], float, float]:
    """(peak, parameters whose .grad is None in one run only, largest gradient difference, largest scaled
    one) of the export starting from ``.grad`` None (after ``optimizer.zero_grad()``)."""
    from bonsai_core.measure import measure_step

    net, inputs, loss_fn = run.build()
    ck = run.load(net)
    peak = measure_step(net, inputs, loss_fn, step=run.exported_step(ck, inputs, loss_fn), allocate_grads=False).peak
    got = {n: p.grad for n, p in net.named_parameters()}
    mismatch = tuple(n for n, g in got.items() if (g is None) != (n not in reference))
    exported_grads = {n: g for n, g in got.items() if g is not None and n in reference}
    return (peak, mismatch, *largest_differences(exported_grads, reference))


class NativeDropout(TorchFunctionMode):
    """Within: ``F.dropout`` in training runs ``torch.native_dropout``, the kernel CUDA eager runs and the
    trace records. The reference gradients of a model with low-precision parameters come from eager
    under it: CPU eager's own dropout multiplies by ``1 / (1 - p)`` rounded to the parameters' type
    (1.109375 in bf16 for p = 0.1, 0.16% below 1 / 0.9), where ``native_dropout`` scales in float,
    and that systematic difference, summed with cancellation into LayerNorm gradients, reached 8 bf16
    units at their scale on hf:gpt2 at seq 512. The forward pass draws and computes the same either way
    (same mask, equal outputs), and the measured original step runs eager's own dropout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        if func is F.dropout:
            names = ("input", "p", "training", "inplace")
            call = {**dict(zip(names, args)), **kwargs}
            p, training = call.get("p", 0.5), call.get("training", True)
            if training and 0 < p < 1 and not call.get("inplace", False):
                return torch.native_dropout(call["input"], p, True)[0]
        return func(*args, **kwargs)


def largest_differences(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(largest absolute difference, largest difference relative to its reference's largest magnitude)
    between same-named tensors, compared on the CPU in float64; relative is inf where a reference is
    all zeros and the tensors differ."""
    absolute = scaled = 0.0
    for n in got:
        if n in reference and reference[n].numel():
            diff = float((got[n].detach().cpu().double() - reference[n].double()).abs().max())
            scale = float(reference[n].double().abs().max())
            absolute = max(absolute, diff)
            scaled = max(scaled, diff / scale if scale > 0 else (math.inf if diff > 0 else 0.0))
    return absolute, scaled


def _median_seconds(step: Callable[[], torch.Tensor], dev: torch.device, repeats: int) -> float:
    """Median wall time of ``repeats`` steps (after one warm-up step), without memory tracking."""
    if repeats <= 0:
        return 0.0
    return statistics.median(_step_seconds(step, dev, repeats + 1)[1:])


def _step_seconds(step: Callable[[], torch.Tensor], dev: torch.device, count: int) -> list[float]:
    """The wall time of each of ``count`` steps run one after the other (the device synchronised)."""
    times = []
    for _ in range(count):
        _sync(dev)
        start = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - start)
    return times


def _sync(dev: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA), so wall time covers them."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- the checkpoint back-end ---------------------------------------------------------------------

# Why the checkpoint back-end's peak is not judged under autocast.
CHECKPOINT_AUTOCAST = (
    "under autocast the checkpointed submodules run casts whose lifetimes the back-end's simulation of "
    "them does not follow (docs/results/export.md measures how far); the replay back-end meets its "
    "prediction under autocast")
# Why the checkpoint back-end's peak is not judged on the CPU for a step with SDPA dropout.
CPU_ATTENTION_DROPOUT = (
    "on the CPU, SDPA with dropout runs its math path, which keeps every layer's batch x heads x seq x seq "
    "attention probabilities and dropout mask for the backward pass, where the plan counts what the fused "
    "kernel of a GPU keeps (output, logsumexp, generator seed); measure the peak with --device cuda, or "
    "check the plan on the CPU with --backend replay, which runs the fused kernel's equivalent")


def load_checkpointed(out_dir: str | Path) -> ModuleType:
    """Import ``out_dir/checkpointed.py`` with the standard importlib recipe (not put in sys.modules)."""
    module = load_export(out_dir)
    path = Path(out_dir) / "checkpointed.py"
    if not hasattr(module, "apply") or not hasattr(module, "SAVE"):
        raise ExportError(f"{str(path)!r} is not a checkpoint back-end export (no apply/SAVE): verify it with "
                          "--backend replay.")
    return module


@dataclass(frozen=True)
class CheckpointVerification(StepVerification):
    """The original model and the checkpointed one, one step each on one device at one batch size."""

    device: str
    batch: int | None
    traced_size: bool  # the export's own options: the prediction applies
    loss_original: float
    loss_exported: float
    max_grad_diff: float
    predicted_peak: int | None  # the schedule's peak; None away from the traced size or under autocast
    realised_peak: int | None  # the simulator's peak of what the checkpoints really run (same conditions)
    measured_peak: int
    original_peak: int
    seconds_original: float
    seconds_exported: float
    predicted_overhead: float
    max_grad_scaled_diff: float = 0.0  # largest gradient difference / that tensor's largest magnitude
    autocast: str | None = None
    precision: str | None = None  # "bf16" / "fp16" when the parameters (their gradients) are in that type
    unpredicted: str | None = None  # why no peak is predicted for this run, when the traced size has one

    DERIVED: ClassVar[tuple[str, ...]] = ("loss_diff", "peak_error", "judged_on_realised", "realised_peak_error",
                                          "time_overhead")

    @property
    def peak_error(self) -> float | None:
        """(measured - predicted) / predicted, at the traced size."""
        return None if not self.predicted_peak else self.measured_peak / self.predicted_peak - 1.0

    @property
    def judged_on_realised(self) -> bool:
        """Whether the checkpoints run another plan than the schedule (their simulated peak more than 1%
        off the schedule's, as the export's README said): the measured peak is judged against theirs.
        A boundary view's bytes apart, as in module-region plans, is not worth it."""
        return bool(self.predicted_peak and self.realised_peak
                    and abs(self.realised_peak / self.predicted_peak - 1.0) > 0.01)

    @property
    def realised_peak_error(self) -> float | None:
        """(measured - realised) / realised, at the traced size."""
        return None if not self.predicted_peak or not self.realised_peak else self.measured_peak / self.realised_peak - 1.0

    @property
    def time_overhead(self) -> float:
        """Measured wall time of the checkpointed step over the original's, minus one."""
        return self.seconds_exported / self.seconds_original - 1.0

    def step_problems(self, atol: float, peak_tolerance: float) -> list[str]:
        if self.judged_on_realised:
            if abs(self.realised_peak_error) > peak_tolerance:
                return [f"the measured peak is {self.realised_peak_error:+.1%} off what the checkpoints run, "
                        f"simulated (tolerance {peak_tolerance:.0%}, above or below)"]
        elif self.peak_error is not None and abs(self.peak_error) > peak_tolerance:
            return [f"the measured peak is {self.peak_error:+.1%} off the prediction "
                    f"(tolerance {peak_tolerance:.0%}, above or below)"]
        return []


def verify_checkpoint(model: str, options: dict[str, Any], out_dir: str | Path, *, device: str = "cpu",
                      seed: int = 0, batch: int | None = None, autocast: str | None = None,
                      repeats: int = 3) -> CheckpointVerification:
    """One training step of the original model and of the model with ``apply`` from ``out_dir``:
    loss, gradients (``.grad`` compared), peak memory (``measure.measure_step``) and wall time
    (median of ``repeats`` further steps). ``batch`` runs another batch size than the traced one
    (no predicted peak there); ``autocast`` ("bf16" / "fp16") runs both under ``torch.autocast``
    (default: the autocast the export's step was traced with). A run under autocast has no predicted
    peak (:data:`CHECKPOINT_AUTOCAST`), nor has a step with SDPA dropout on the CPU
    (:data:`CPU_ATTENTION_DROPOUT`): ``unpredicted`` says why."""
    exported = load_checkpointed(out_dir)
    dev = measuring_device(device)
    if autocast is not None and autocast not in AUTOCAST:
        raise ModelError(f"--autocast {autocast!r}: use bf16 or fp16.")
    autocast = exported.INFO.get("autocast") if autocast is None else autocast
    opts = dict(options)
    traced_size = batch is None or batch == exported.INFO.get("batch")
    unpredicted = _unpredicted(exported.INFO, traced_size, autocast, dev)
    predicted = traced_size and unpredicted is None
    if batch is not None:
        opts["batch"] = batch

    def run(checkpointed: bool) -> tuple[Any, dict[str, torch.Tensor], float]:
        net, inputs, loss_fn = build_on(model, opts, seed, dev)
        if checkpointed:
            try:
                exported.apply(net)
            except ValueError as e:
                raise ModelError(f"The export in {str(out_dir)!r} does not fit {model!r}: {e}") from None
        return _checkpoint_steps(net, inputs, loss_fn, dev, autocast, repeats)

    original, reference, t_original = run(False)
    measured, grads, t_exported = run(True)
    diff, scaled = largest_differences({n: g for n, g in grads.items() if n in reference}, reference)
    return CheckpointVerification(
        device=measured.device, batch=opts.get("batch"), traced_size=traced_size,
        loss_original=original.loss, loss_exported=measured.loss, max_grad_diff=diff,
        predicted_peak=int(exported.INFO["predicted_peak"]) if predicted else None,
        realised_peak=int(exported.INFO["realised_peak"]) if predicted else None,
        measured_peak=measured.peak, original_peak=original.peak, seconds_original=t_original,
        seconds_exported=t_exported, predicted_overhead=float(exported.INFO["overhead"]),
        max_grad_scaled_diff=scaled, autocast=autocast, precision=precision_of(reference.values()),
        unpredicted=unpredicted)


def _unpredicted(info: dict[str, Any], traced_size: bool, autocast: str | None, dev: torch.device) -> str | None:
    """Why a run at the traced size has no predicted peak (another autocast than traced, autocast at all,
    SDPA dropout on the CPU), or None; None away from the traced size too."""
    traced_autocast = info.get("autocast")
    if traced_size and autocast != traced_autocast:
        return f"the schedule was traced with autocast {traced_autocast or 'off'}, this run has {autocast}"
    if traced_size and autocast:
        return CHECKPOINT_AUTOCAST
    if traced_size and dev.type == "cpu" and info.get("attention_dropout"):
        return CPU_ATTENTION_DROPOUT
    return None


def _checkpoint_steps(net: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any, dev: torch.device,
                      autocast: str | None, repeats: int) -> tuple[Any, dict[str, torch.Tensor], float]:
    """(measured step, gradients on the CPU, median seconds of ``repeats`` further steps) of ``net``'s
    plain training step, its forward and loss under ``autocast``."""
    from bonsai_core.measure import eager_step, measure_step

    step = eager_step(net, inputs, loss_fn, autocast)
    measured = measure_step(net, inputs, loss_fn, step=step)
    grads = {n: p.grad.detach().cpu().clone() for n, p in net.named_parameters() if p.grad is not None}
    return measured, grads, statistics.median(_step_seconds(step, dev, max(1, repeats)))
