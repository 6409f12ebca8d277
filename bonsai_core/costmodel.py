"""Device profiles: how long an operator takes, from its FLOPs and the bytes it moves.

A roofline: ``cost = launch + max(flops / rate, bytes / bytes_per_s)``. The rates are datasheet peaks
times 0.8, a typical achieved fraction for large kernels; ``launch`` is the fixed per-kernel cost that
dominates small ops. Relative costs are what the solvers need: they choose *what* to recompute, and a
profile only has to rank operators the way the device would.

The FLOP rate depends on the dtype where the device's matrix units do: a matmul, convolution or
attention kernel (the ops ``torch.utils.flop_counter`` counts) runs at ``matmul_flops_per_s`` of its
inputs' dtype (an H100's tensor cores: 989 TFLOP/s dense in bf16 or fp16, 1,979 in fp8, 495 in TF32,
which is how fp32 matmuls are counted here); other ops run at ``flops_per_s`` and are, in practice,
bound by their bytes. A kernel that fuses a chain of ops (inductor's) is priced once, for the bytes it
reads and writes (:mod:`bonsai_core.trace.recorder`).

A trace records attention as the CPU's flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and
its backward), which stands for the GPU's flash kernel (:mod:`bonsai_core.attention`); torch's FLOP
counter counts the GPU kernels only, so :func:`count_cpu_flash_attention` registers the same formulas for
the CPU's. That prices attention at its FLOPs here, and AOTAutograd's partitioner, whose memory-budget
knapsack weighs what to recompute by the FLOPs that counter gives, then sees attention's cost as it does
on the GPU (the CPU kernel counted nothing: attention looked free to recompute).

A profile also has the link to host memory that offloaded tensors cross (simulator rule 9):
``host_link_bytes_per_s`` per direction (datasheet peak times the same 0.8) and ``host_bytes``, the
host memory one device may pin (the server's memory over its devices; None: no limit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceProfile:
    """A roofline cost model: ``cost = launch + max(flops / rate, bytes / bytes_per_s)``, ``rate`` the
    matrix units' for a matmul-like op's dtype (``matmul_flops_per_s``, by ``torch.dtype`` name; a
    dtype not listed runs at ``flops_per_s``), else ``flops_per_s``.

    Rates are datasheet peaks times 0.8, a typical achieved fraction for large kernels.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    launch: float
    description: str
    host_link_bytes_per_s: float
    host_bytes: int | None
    matmul_flops_per_s: dict[str, float] = field(default_factory=dict, hash=False)

    def cost(self, flops: float, nbytes: float, matmul_dtype: str | None = None) -> float:
        """Seconds for ``flops`` and ``nbytes``; ``matmul_dtype``: the dtype of a matmul-like op's inputs."""
        rate = self.matmul_flops_per_s.get(matmul_dtype, self.flops_per_s) if matmul_dtype else self.flops_per_s
        return self.launch + max(flops / rate, nbytes / self.bytes_per_s)


def _tensor_cores(tf32: float, half: float, fp8: float | None) -> dict[str, float]:
    """Matrix-unit rates (datasheet dense peaks, times 0.8) by dtype: fp32 as TF32, bf16 and fp16, fp8."""
    rates = {"float32": 0.8 * tf32, "bfloat16": 0.8 * half, "float16": 0.8 * half}
    if fp8 is not None:
        rates.update({"float8_e4m3fn": 0.8 * fp8, "float8_e5m2": 0.8 * fp8})
    return rates


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in [
    DeviceProfile("h100", 0.8 * 495e12, 0.8 * 3.35e12, 4e-6,
                  "NVIDIA H100 SXM: dense tensor cores 495 TFLOP/s TF32, 989 bf16/fp16, 1,979 fp8; 3.35 TB/s HBM3; "
                  "host link PCIe Gen5 x16, 64 GB/s per direction; DGX H100: 2 TB of host memory for 8 GPUs",
                  0.8 * 64e9, 2 * 1024**4 // 8, _tensor_cores(495e12, 989e12, 1979e12)),
    DeviceProfile("a100", 0.8 * 156e12, 0.8 * 2.04e12, 5e-6,
                  "NVIDIA A100 80GB SXM: dense tensor cores 156 TFLOP/s TF32, 312 bf16/fp16 (no fp8); 2.04 TB/s "
                  "HBM2e; host link PCIe Gen4 x16, 32 GB/s per direction; DGX A100: 2 TB of host memory for 8 GPUs",
                  0.8 * 32e9, 2 * 1024**4 // 8, _tensor_cores(156e12, 312e12, None)),
    DeviceProfile("gh200", 0.8 * 495e12, 0.8 * 4.0e12, 4e-6,
                  "NVIDIA GH200 (H100 GPU, 96 GB HBM3): dense tensor cores 495 TFLOP/s TF32, 989 bf16/fp16, 1,979 "
                  "fp8; 4 TB/s; host link NVLink-C2C, 450 GB/s per direction, to the Grace CPU's 480 GB of LPDDR5X",
                  0.8 * 450e9, 480 * 1000**3, _tensor_cores(495e12, 989e12, 1979e12)),
    DeviceProfile("cpu", 0.8 * 200e9, 0.8 * 25e9, 2e-6,
                  "a laptop/server CPU core complex: 200 GFLOP/s fp32, 25 GB/s DRAM; host and device are "
                  "the same DRAM, so a copy runs at its bandwidth and nothing limits the host",
                  0.8 * 25e9, None),
]}
DEFAULT_PROFILE = "h100"


def count_cpu_flash_attention() -> None:
    """Register in ``torch.utils.flop_counter`` the FLOPs of the CPU's flash attention kernel and its
    backward as those of the GPU's flash kernel, whose arguments they begin with (module doc); nothing
    where torch counts them already."""
    import torch
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    for cpu, gpu in ((aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention),
                     (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                      aten._scaled_dot_product_flash_attention_backward)):
        flop_registry.setdefault(cpu, flop_registry[gpu])


def _inner_op(func: Any, args: Any) -> tuple[Any, Any]:
    """The op a random-state wrapper runs and its arguments (a checkpointed region under compile runs a
    random op as ``run_and_save_rng_state(op, *args)`` in the forward, ``run_with_rng_state(state, op,
    *args)`` in the recomputation); else ``func`` and ``args``."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    if func is run_and_save_rng_state:
        return args[0], args[1:]
    if func is run_with_rng_state:
        return args[1], args[2:]
    return func, args


def op_cost(profile: DeviceProfile, func: Any, args: Any, kwargs: Any, out: Any) -> float:
    """Roofline cost of one aten op call on real or fake tensors: FLOPs from
    ``torch.utils.flop_counter``'s registry (matmuls, convolutions, attention; at the matrix units' rate
    for their first floating input's dtype), else about one op per output element; bytes moved are the
    distinct input and output storages. A random-state wrapper costs what the op it runs costs."""
    from torch.utils.flop_counter import flop_registry

    from bonsai_core.tensors import storage_bytes, tensors_in

    func, args = _inner_op(func, args)
    counter = flop_registry.get(getattr(func, "overloadpacket", None))
    nbytes = storage_bytes((args, kwargs)) + storage_bytes(out)
    if counter is None:
        return profile.cost(float(sum(t.numel() for t in tensors_in(out))), nbytes)
    floats = [t for t in tensors_in(args) if t.is_floating_point()]
    return profile.cost(float(counter(*args, **kwargs, out_val=out)), nbytes,
                        str(floats[0].dtype).removeprefix("torch.") if floats else None)


count_cpu_flash_attention()  # before any trace prices attention or compiles (module doc)
