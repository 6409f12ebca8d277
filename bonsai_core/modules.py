"""Module calls of a training step, located in its traced graph.

The AOTAutograd joint graph carries no module metadata, so the structure of the user's model (a
transformer block, a ResNet stage, an MLP) is recovered by running the step's forward + loss once more
on fake tensors: a dispatch mode records the aten ops (as selective activation checkpointing sees
them) and global module hooks record the op range of every module call. ``difflib`` aligns that op
sequence with the traced graph's forward nodes (same ops in the same order, up to views of parameters
and ``_unsafe_view``/``view``).

Two users: the trace stores each module call's span of forward nodes in the graph
(``Graph.modules``), which Bonsai turns into candidate segments and per-block seed plans; the
``checkpoint`` export back-end maps a plan's regions onto submodules.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

# Run-time ops and the names the traced (functionalized) graph gives them, one name for both on both
# sides: ``view`` where eager runs ``_unsafe_view``, batch norm's functional forms.
_SAME_OP = {"aten._unsafe_view.default": "aten.view.default",
            "aten._native_batch_norm_legit_functional.default": "aten.native_batch_norm.default",
            "aten._native_batch_norm_legit.default": "aten.native_batch_norm.default",
            "aten._native_batch_norm_legit_no_training.default": "aten.native_batch_norm.default"}


def _same_op(op: str) -> str:
    """The name both sides of :func:`align` compare: an in-place op (``aten.add_.Tensor``, BatchNorm's
    ``num_batches_tracked += 1``) is traced as its functional form (``aten.add.Tensor``)."""
    op = _SAME_OP.get(op, op)
    parts = op.split(".")
    if len(parts) == 3 and parts[1].endswith("_") and not parts[1].startswith("_"):
        parts[1] = parts[1][:-1]
    return ".".join(parts)


@dataclass(frozen=True)
class RecordedStep:
    """The aten ops of one forward + loss as SAC's policy sees them, and each module call's op range."""

    ops: list[str]
    calls: list[tuple[str, int, int]]  # (module path, first op, one past the last op), model modules only
    call_counts: Counter


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        from torch.utils.checkpoint import SAC_IGNORED_OPS

        self.ignored = SAC_IGNORED_OPS
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        if func not in self.ignored:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def record_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor]) -> RecordedStep:
    """Run ``loss_fn(model(*inputs))`` once (with grad, as in training) and record it. Cheap on fake tensors."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    names = {id(m): name for name, m in model.named_modules()}
    recorder = _OpRecorder()
    open_calls: list[tuple[str, int]] = []
    calls: list[tuple[str, int, int]] = []
    counts: Counter = Counter()

    def pre(module: nn.Module, _args: Any) -> None:
        if id(module) in names:
            open_calls.append((names[id(module)], len(recorder.ops)))

    def post(module: nn.Module, _args: Any, _out: Any) -> None:
        if id(module) in names and open_calls:
            path, start = open_calls.pop()
            calls.append((path, start, len(recorder.ops)))
            counts[path] += 1

    hooks = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        with torch.enable_grad(), recorder:
            loss_fn(model(*inputs))
    finally:
        for h in hooks:
            h.remove()
    return RecordedStep(recorder.ops, calls, counts)


def align(runtime_ops: list[str], traced_ops: list[str]) -> np.ndarray:
    """int64[len(runtime_ops)]: the traced forward position each run-time op is, or -1.

    Matches ops in order (``difflib``): run-time-only ops (views of parameters, casts) stay -1."""
    at = np.full(len(runtime_ops), -1, dtype=np.int64)
    matcher = difflib.SequenceMatcher(None, [_same_op(op) for op in runtime_ops],
                                      [_same_op(op) for op in traced_ops], autojunk=False)
    for block in matcher.get_matching_blocks():
        at[block.a:block.a + block.size] = np.arange(block.b, block.b + block.size)
    return at


def module_spans(step: RecordedStep, forward_ops: list[str]) -> list[tuple[str, int, int]]:
    """(module path, first, last) forward positions (inclusive) of every submodule called once in
    ``step`` (not the whole model), in call order, for the ops the alignment with ``forward_ops`` (the
    graph's forward ops in listed order) places. A call none of whose ops is placed is left out."""
    at = align(step.ops, forward_ops)
    spans = []
    for path, a, b in step.calls:
        if not path or step.call_counts[path] != 1:
            continue
        placed = at[a:b][at[a:b] >= 0]
        if len(placed):
            spans.append((path, int(placed.min()), int(placed.max())))
    return sorted(spans, key=lambda s: (s[1], -s[2]))
