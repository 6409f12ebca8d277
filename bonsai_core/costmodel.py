"""Device profiles: how long an operator takes, from its FLOPs and the bytes it moves.

A roofline: ``cost = launch + max(flops / flops_per_s, bytes / bytes_per_s)``. The rates are
datasheet peaks times 0.8, a typical achieved fraction for large kernels; ``launch`` is the fixed
per-kernel cost that dominates small ops. Relative costs are what the solvers need: they choose
*what* to recompute, and a profile only has to rank operators the way the device would.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProfile:
    """A roofline cost model: ``cost = launch + max(flops / flops_per_s, bytes / bytes_per_s)``.

    Rates are datasheet peaks times 0.8, a typical achieved fraction for large kernels.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    launch: float
    description: str

    def cost(self, flops: float, nbytes: float) -> float:
        return self.launch + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in [
    DeviceProfile("h100", 0.8 * 495e12, 0.8 * 3.35e12, 4e-6,
                  "NVIDIA H100 SXM: 495 TFLOP/s dense TF32, 3.35 TB/s HBM3"),
    DeviceProfile("a100", 0.8 * 156e12, 0.8 * 2.04e12, 5e-6,
                  "NVIDIA A100 80GB SXM: 156 TFLOP/s dense TF32, 2.04 TB/s HBM2e"),
    DeviceProfile("cpu", 0.8 * 200e9, 0.8 * 25e9, 2e-6,
                  "a laptop/server CPU core complex: 200 GFLOP/s fp32, 25 GB/s DRAM"),
]}
DEFAULT_PROFILE = "h100"
