"""``verify_export``: the original and the exported step side by side on one device."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bonsai_core.errors import ModelError
from bonsai_core.export.folder import load_export


@dataclass(frozen=True)
class Verification:
    """The original and the exported step, side by side on one device."""

    device: str
    loss_original: float
    loss_exported: float
    max_grad_diff: float
    predicted_peak: int
    measured_peak: int
    original_peak: int

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_exported - self.loss_original)

    @property
    def peak_error(self) -> float:
        """(measured - predicted) / predicted."""
        return self.measured_peak / self.predicted_peak - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "loss_diff": self.loss_diff, "peak_error": self.peak_error}


def verify_export(model: str, options: dict[str, Any], out_dir: str | Path, *, device: str = "cpu",
                  seed: int = 0, grads: str = "autograd") -> Verification:
    """Run one step of the original model and of the export on ``device`` (one after the other, so
    only one copy is resident) and compare loss, gradients and peak memory (``measure_step``)."""
    from bonsai_core import zoo
    from bonsai_core.measure import measure_step

    exported = load_export(out_dir)
    predicted = int(exported.INFO["predicted_peak"])
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for, but this PyTorch sees no CUDA device.")

    def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], Any]:
        net, inputs, loss_fn = zoo.build(model, seed=seed, **options)
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn = loss_fn.to(dev)
        return net.to(dev), tuple(x.to(dev) for x in inputs), loss_fn

    net, inputs, loss_fn = build()
    original = measure_step(net, inputs, loss_fn)
    reference = {n: p.grad.detach().cpu() for n, p in net.named_parameters() if p.grad is not None}
    del net, inputs, loss_fn

    net, inputs, loss_fn = build()
    try:
        ck = exported.load(net, grads=grads)
    except ValueError as e:
        raise ModelError(f"The export in {str(out_dir)!r} does not fit {model!r} with these options: {e}") from None

    def step() -> torch.Tensor:
        loss = ck(*inputs, loss_fn=loss_fn)
        loss.backward()
        return loss

    try:
        measured = measure_step(net, inputs, loss_fn, step=step)
    except (TypeError, ValueError) as e:  # the runtime's own checks: shapes, dtypes, loss buffers
        raise ModelError(f"The export in {str(out_dir)!r} does not fit {model!r} with these options: {e}") from None
    diff = max((float((p.grad.detach().cpu() - reference[n]).abs().max()) for n, p in net.named_parameters()
                if n in reference), default=0.0)
    return Verification(device=measured.device, loss_original=original.loss, loss_exported=measured.loss,
                        max_grad_diff=diff, predicted_peak=predicted, measured_peak=measured.peak,
                        original_peak=original.peak)
