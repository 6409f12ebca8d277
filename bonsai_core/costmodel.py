"""Device profiles: how long an operator takes, from its FLOPs and the bytes it moves.

A roofline: ``cost = launch + max(flops / flops_per_s, bytes / bytes_per_s)``. The rates are
datasheet peaks times 0.8, a typical achieved fraction for large kernels; ``launch`` is the fixed
per-kernel cost that dominates small ops. Relative costs are what the solvers need: they choose
*what* to recompute, and a profile only has to rank operators the way the device would.

A profile also has the link to host memory that offloaded tensors cross (simulator rule 9):
``host_link_bytes_per_s`` per direction (datasheet peak times the same 0.8) and ``host_bytes``, the
host memory one device may pin (the server's memory over its devices; None: no limit).
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
    host_link_bytes_per_s: float
    host_bytes: int | None

    def cost(self, flops: float, nbytes: float) -> float:
        return self.launch + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in [
    DeviceProfile("h100", 0.8 * 495e12, 0.8 * 3.35e12, 4e-6,
                  "NVIDIA H100 SXM: 495 TFLOP/s dense TF32, 3.35 TB/s HBM3; host link PCIe Gen5 x16, "
                  "64 GB/s per direction; DGX H100: 2 TB of host memory for 8 GPUs",
                  0.8 * 64e9, 2 * 1024**4 // 8),
    DeviceProfile("a100", 0.8 * 156e12, 0.8 * 2.04e12, 5e-6,
                  "NVIDIA A100 80GB SXM: 156 TFLOP/s dense TF32, 2.04 TB/s HBM2e; host link PCIe Gen4 x16, "
                  "32 GB/s per direction; DGX A100: 2 TB of host memory for 8 GPUs",
                  0.8 * 32e9, 2 * 1024**4 // 8),
    DeviceProfile("gh200", 0.8 * 495e12, 0.8 * 4.0e12, 4e-6,
                  "NVIDIA GH200 (H100 GPU, 96 GB HBM3): 495 TFLOP/s dense TF32, 4 TB/s; host link "
                  "NVLink-C2C, 450 GB/s per direction, to the Grace CPU's 480 GB of LPDDR5X",
                  0.8 * 450e9, 480 * 1000**3),
    DeviceProfile("cpu", 0.8 * 200e9, 0.8 * 25e9, 2e-6,
                  "a laptop/server CPU core complex: 200 GFLOP/s fp32, 25 GB/s DRAM; host and device are "
                  "the same DRAM, so a copy runs at its bandwidth and nothing limits the host",
                  0.8 * 25e9, None),
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
