"""The cost model (bonsai_core/costmodel.py): attention priced at its FLOPs on the kernel a trace records."""

from __future__ import annotations

import torch
from torch._prims.rng_prims import run_and_save_rng_state
from torch._subclasses.fake_tensor import FakeTensorMode

from bonsai_core.costmodel import PROFILES, op_cost

H100 = PROFILES["h100"]
FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def test_the_cpu_flash_kernel_costs_attentions_flops_at_the_tensor_cores_rate() -> None:
    """A Llama 3 8B layer's attention (batch 2, 32 heads, seq 8192, head dim 128, bf16): two matmuls of
    2·b·h·s²·d FLOPs forward, five backward, compute-bound on an H100's bf16 tensor cores."""
    b, h, s, d = 2, 32, 8192, 128
    with FakeTensorMode():
        q, k, v = (torch.empty(b, h, s, d, dtype=torch.bfloat16) for _ in range(3))
        out, logsumexp = FLASH_CPU(q, k, v, 0.0, True)
        forward = op_cost(H100, FLASH_CPU, (q, k, v, 0.0, True), {}, (out, logsumexp))
        grads = FLASH_CPU_BACKWARD(out, q, k, v, out, logsumexp, 0.0, True)
        backward = op_cost(H100, FLASH_CPU_BACKWARD, (out, q, k, v, out, logsumexp, 0.0, True), {}, grads)
        wrapped = op_cost(H100, run_and_save_rng_state, (FLASH_CPU, q, k, v, 0.0, True), {},
                          (torch.empty(2, dtype=torch.int64), (out, logsumexp)))
    rate = H100.matmul_flops_per_s["bfloat16"]
    assert forward == H100.launch + 2 * 2 * b * h * s * s * d / rate
    assert backward == H100.launch + 5 * 2 * b * h * s * s * d / rate
    assert wrapped == forward  # a checkpointed region's random-state wrapper costs the op it runs
