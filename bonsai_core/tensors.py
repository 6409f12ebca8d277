"""Small helpers over the tensors inside nested args/outputs (shared by tracing and measuring), a DTensor's
local tensor, and fake copies of a model (planning and recording a step on shapes only)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of lists, tuples and dicts."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def storage_bytes(tree: Any) -> int:
    """Bytes of the distinct storages behind the tensors in ``tree`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors_in(tree):
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def local_tensor(t: Any) -> Any:
    """A DTensor's local tensor (a rank's shard, what the traced graph holds); any other value as it is."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def fake_copy(module: nn.Module, mode: Any) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are ``mode``'s fake tensors (ties kept)."""
    import copy

    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(fake_of(p.detach(), mode), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = fake_of(b, mode)
    return copy.deepcopy(module, memo)


def fake_of(t: torch.Tensor, mode: Any) -> torch.Tensor:
    """``mode``'s fake of ``t``; of a ``meta`` tensor (a model built on the meta device, as torchtitan
    builds it before sharding), a fake CPU tensor of its shape, so that the step traces as on CPU."""
    if not t.is_meta:
        return mode.from_tensor(t)
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
