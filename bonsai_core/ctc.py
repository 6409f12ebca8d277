"""CTC loss (``F.ctc_loss``, ``nn.CTCLoss``) on fake tensors: traced by its shapes.

``F.ctc_loss`` with its lengths given as tensors, as CTC recipes give them, runs ``aten._ctc_loss.Tensor``
(and ``aten._ctc_loss_backward.Tensor`` in the backward pass). PyTorch's kernel reads the lengths' values,
and its fake tensor support refuses the op whole (it is tagged ``dynamic_output_shape``): fake tensors
have no values. The user's code reads no value there; the kernel does, for two things:

* the loss per sequence, ``neg_log_likelihood``: one value per sequence, whatever the lengths;
* ``log_alpha``, which the autograd formula saves for the backward pass: ``batch x input steps x
  (2 * L + 1)`` floats, ``L`` the longest target length in the batch (ATen's ``ctc_loss_cpu_template``;
  its CUDA kernel sizes it the same way).

So only ``log_alpha``'s last dimension depends on a value, and through one number, ``L``, which is
bounded by the targets' own shape: a batch of padded targets (``batch x S``, the form CTC recipes pad
to the batch's longest target) has ``L <= S``, and concatenated targets (1-D) ``L <= len(targets)``.
:func:`register_ctc_shapes` gives fake tensors these outputs, with ``L`` the bound (or the value where
the fake lengths carry one: the ``int`` list overload, a fake tensor holding a constant). The traced
step then holds what eager holds where the targets are padded to the batch's longest target, and more
(never less) where they are padded further or concatenated: ``log_alpha`` for the bound, against the
batch's longest target at run time.

The backward kernel's output is the gradient of ``log_probs``: its shape. Registered with torch's fake
tensor implementations (``torch._subclasses.fake_impls``), which come before the ``dynamic_output_shape``
refusal; only fake tensors see them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_registered = threading.Lock()
_state = {"done": False}


def _bound(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in op._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def longest_target(targets: torch.Tensor, target_lengths: torch.Tensor | list[int]) -> int:
    """``L``, the longest target length: from the lengths' values where they are known (an ``int`` list,
    a fake tensor holding a constant), else its bound from the targets' shape (padded targets ``batch x
    S``: ``S``; concatenated: their number)."""
    if isinstance(target_lengths, (list, tuple)):
        return max((int(n) for n in target_lengths), default=0)
    constant = getattr(target_lengths, "constant", None)
    if constant is not None:
        from torch.utils._mode_utils import no_dispatch

        with no_dispatch():
            return int(constant.max()) if constant.numel() else 0
    return int(targets.shape[1] if targets.dim() == 2 else targets.shape[0])


def _ctc_loss(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    a = _bound(func, args, kwargs)
    log_probs = a["log_probs"]
    steps, batch = int(log_probs.shape[0]), int(log_probs.shape[1])
    width = 2 * longest_target(a["targets"], a["target_lengths"]) + 1
    return log_probs.new_empty((batch,)), log_probs.new_empty((batch, steps, width))


def _ctc_loss_backward(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    log_probs = _bound(func, args, kwargs)["log_probs"]
    return log_probs.new_empty(log_probs.shape)


def register_ctc_shapes() -> None:
    """Give fake tensors ``_ctc_loss``'s and ``_ctc_loss_backward``'s outputs (see the module doc), once
    per process."""
    with _registered:
        if _state["done"]:
            return
        from torch._subclasses.fake_impls import _is_op_registered_to_fake_rule, register_op_impl

        aten = torch.ops.aten
        for op, impl in ((aten._ctc_loss.Tensor, _ctc_loss), (aten._ctc_loss.default, _ctc_loss),
                         (aten._ctc_loss_backward.Tensor, _ctc_loss_backward),
                         (aten._ctc_loss_backward.default, _ctc_loss_backward)):
            if not _is_op_registered_to_fake_rule(op):
                register_op_impl(op)(impl)
        _state["done"] = True
