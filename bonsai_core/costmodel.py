"""Device profiles: how long an operator takes, from its FLOPs and the bytes it moves.

A roofline: ``cost = launch + max(flops / flops_per_s, bytes / bytes_per_s)``. The rates are
datasheet peaks times 0.8, a typical achieved fraction for large kernels; ``launch`` is the fixed
per-kernel cost that dominates small ops. Relative costs are what the solvers need: they choose
*what* to recompute, and a profile only has to rank operators the way the device would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def op_cost(profile: DeviceProfile, func: Any, args: Any, kwargs: Any, out: Any) -> float:
    """Roofline cost of one aten op call on real or fake tensors: FLOPs from
    ``torch.utils.flop_counter``'s registry (matmuls, convolutions, attention), else about one op per
    output element; bytes moved are the distinct input and output storages."""
    from torch.utils.flop_counter import flop_registry

    from bonsai_core.tensors import storage_bytes, tensors_in

    counter = flop_registry.get(getattr(func, "overloadpacket", None))
    if counter is not None:
        flops = float(counter(*args, **kwargs, out_val=out))
    else:
        flops = float(sum(t.numel() for t in tensors_in(out)))
    return profile.cost(flops, storage_bytes((args, kwargs)) + storage_bytes(out))
