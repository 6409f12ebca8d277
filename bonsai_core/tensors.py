"""Small helpers over the tensors inside nested args/outputs (shared by tracing and measuring)."""

from __future__ import annotations

from typing import Any

import torch
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
