"""One rank's step measured (bonsai_core.measure_parallel) as measure_step measures a step: the same tracker,
with the bytes held outside the step's ops polled at each op."""

from __future__ import annotations

import torch
import torch.nn as nn

from bonsai_core.measure import LiveBytes, measure_step
from bonsai_core.measure_parallel import steady_step_peak


def _model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)), (torch.randn(32, 64),)


def test_held_bytes_polled_at_each_op_add_to_the_peak():
    held = {"bytes": 0}
    tracker = LiveBytes(lambda: held["bytes"])
    x = torch.ones(1000)
    with tracker:
        y = x * 2  # 4000 bytes live
        held["bytes"] = 10_000
        z = y + 1  # 8000 live, 10000 held
        del y, z
        held["bytes"] = 0
        torch.ones(10)
    assert tracker.peak == 18_000
    assert tracker.live == 0


def test_a_model_without_fsdp_measures_as_measure_step_measures_it():
    net, inputs = _model()

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    plain = measure_step(net, inputs, loss_fn)
    steady = steady_step_peak(net, inputs, loss_fn)
    assert (steady.fixed, steady.peak) == (plain.fixed, plain.peak)
    assert steady.loss == plain.loss
