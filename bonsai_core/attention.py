"""How ``F.scaled_dot_product_attention`` (SDPA) with dropout is recorded in a traced step.

The trace runs on CPU fake tensors, where torch picks SDPA's kernel as the CPU does: without dropout
the fused CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``: it keeps the output
and the logsumexp of each row for the backward pass), which the exported program maps to the kernel
of the device it runs on (``sdpa_forward`` in ``export_runtime/runtime.py``). With dropout the CPU
has no fused kernel: eager runs SDPA's math path, which materialises the attention probabilities and
a dropout mask of ``batch x heads x seq x seq`` and keeps them for the backward pass. A GPU runs a
fused kernel there too (flash or memory-efficient attention): it keeps the output, the logsumexp and
the random generator's seed and offset, and draws the mask again in the backward pass.

So that a plan is made for the memory a GPU training step holds, whichever device traced it, SDPA
calls with dropout are recorded as the memory-efficient attention kernel
(``aten._scaled_dot_product_efficient_attention``: output, logsumexp padded to a multiple of 32 rows,
philox seed and offset), with what ``F.scaled_dot_product_attention`` does before calling it on a GPU:
a boolean mask becomes an additive one, a mask whose strides the kernel cannot read is padded, and
the mask is expanded to ``batch x heads x seq x seq`` (a view). Grouped-query attention
(``enable_gqa``) with fewer key/value heads than query heads repeats the keys and values for every
query head first, as SDPA's math path does (the memory-efficient kernel takes equal head counts).
The exported program runs this kernel on CUDA and, on the CPU, draws the same dropout mask as eager's
math path (``efficient_attention_forward`` in ``export_runtime/runtime.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# F.scaled_dot_product_attention's parameters in order, with their defaults (a builtin: no signature)
_SDPA_PARAMETERS = (("query", None), ("key", None), ("value", None), ("attn_mask", None), ("dropout_p", 0.0),
                    ("is_causal", False), ("scale", None), ("enable_gqa", False))
MASK_ALIGNMENT = 8  # elements: the memory-efficient kernel reads a mask whose strides are multiples of this
EFFICIENT_ATTENTION = "aten._scaled_dot_product_efficient_attention.default"


def sdpa_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of one ``F.scaled_dot_product_attention`` call, by name, defaults filled in."""
    named = {name: default for name, default in _SDPA_PARAMETERS}
    named.update(zip((name for name, _ in _SDPA_PARAMETERS), args))
    named.update(kwargs)
    return named


class FusedAttentionWithDropout(TorchFunctionMode):
    """Within: ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` runs the memory-efficient
    attention kernel (module docstring); every other call runs as usual. For tracing only: the CPU has
    no kernel for it, so this runs on fake tensors (and the ``meta`` device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = sdpa_arguments(args, kwargs)
            if call["dropout_p"] > 0:
                return efficient_attention(**call)
        return func(*args, **kwargs)


def efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                        dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention(...)`` through ``aten._scaled_dot_product_efficient_attention``,
    prepared as SDPA prepares its inputs for that kernel: the attention output."""
    query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    bias = None if attn_mask is None else _kernel_bias(attn_mask, query, key)
    keep_logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out, _, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, keep_logsumexp, dropout_p, is_causal, scale=scale)
    return out


def _autocast_inputs(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors as autocast hands them to SDPA (which runs in the autocast type): floating ones cast."""
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device)
    return [t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors]


def _kernel_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """An SDPA mask as the memory-efficient kernel takes it: additive (a boolean mask's False is
    -inf), padded when its strides are not multiples of :data:`MASK_ALIGNMENT`, and expanded to
    (batch, heads, queries, keys)."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=query.dtype, device=mask.device))
    if mask.stride(-1) != 1 or any(s % MASK_ALIGNMENT for s in mask.stride()[:-1]):
        last = mask.size(-1)
        mask = F.pad(mask, (0, MASK_ALIGNMENT - last % MASK_ALIGNMENT))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def records_attention_dropout(graph: Any) -> bool:
    """Whether a traced graph holds SDPA with dropout (recorded as the memory-efficient kernel)."""
    return EFFICIENT_ATTENTION in graph.ops
