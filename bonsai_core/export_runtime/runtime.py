# ---- bonsai export runtime (copied from bonsai_core/export_runtime/runtime.py; plain PyTorch only) ----
"""Run one training step (forward, loss, backward) of a model in the order a rematerialization
schedule prescribes.

The step is the AOTAutograd joint graph that ``bonsai trace`` traced: aten ops, one generated line per
scheduled ``compute`` and a ``del`` per scheduled ``free``, so Python frees each tensor exactly where
the schedule does and a recomputed tensor is simply computed again. ``forward_part`` runs the ops up to
the loss inside ``torch.autograd.Function.forward``; ``backward_part`` runs the rest (the recomputations
and the gradients) when autograd calls the Function's ``backward``.
"""

from __future__ import annotations

import math  # noqa: F401  (the generated program writes inf / nan as math.inf / math.nan)
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

GRAD_MODES = ("autograd", "direct")


@dataclass(frozen=True)
class Program:
    """A generated training step: the placeholders it reads and its two scheduled halves."""

    params: Sequence[tuple[str, tuple[int, ...], str, bool]]  # model parameter name, shape, dtype, requires_grad
    buffers: Sequence[tuple[str, str, tuple[int, ...], str]]  # owner ("model" | "loss_fn"), name, shape, dtype
    inputs: Sequence[tuple[tuple[int, ...], str]]  # shape, dtype of each model input
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    info: dict[str, Any]


class _ScheduledStep(torch.autograd.Function):
    """Forward: the scheduled ops up to the loss. Backward: the rest of the schedule.

    The tensors alive at the split are kept in a plain list on ``ctx`` (not ``save_for_backward``) so
    that ``backward_part`` can drop each one where the schedule frees it; the placeholders (parameters,
    buffers, the batch) live for the whole step anyway and are saved the usual way.
    """

    @staticmethod
    def forward(ctx, program: Program, mode: str, params: list[nn.Parameter], *tensors: torch.Tensor):  # noqa: ANN001
        dev = tensors[-1].device if program.inputs else tensors[0].device
        loss, alive = program.forward(tensors, dev)
        ctx.program, ctx.mode, ctx.dev, ctx.params, ctx.alive = program, mode, dev, params, alive
        ctx.save_for_backward(*tensors)
        # a new tensor object: ctx holds the schedule's own loss tensor, and an output held by ctx
        # would be a reference cycle that keeps the whole step alive
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # noqa: ANN001
        tensors = ctx.saved_tensors
        alive, ctx.alive = ctx.alive, None
        if alive is None:
            raise RuntimeError("The scheduled backward frees the step's tensors as it goes, so it runs once per "
                               "forward (retain_graph is not supported): call ck(...) again for another backward.")
        params, mode = ctx.params, ctx.mode
        # loss.backward() seeds 1; anything else (a scaled loss, AMP's GradScaler) scales every gradient
        scale = None if bool((grad_loss == 1).all()) else grad_loss

        def emit(j: int, g: torch.Tensor) -> None:
            if scale is not None:
                g = g * scale
            if mode == "direct":
                _accumulate(params[j], g)
            else:
                # a reentrant backward from the parameter itself: autograd accumulates g and runs the
                # parameter's hooks (DDP's all-reduce among them) now, not when this backward ends
                torch.autograd.backward(params[j], g)

        ctx.program.backward(tensors, alive, ctx.dev, emit)
        del alive
        return (None, None, None, *([None] * len(tensors)))


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    """Add a gradient into ``p.grad`` as autograd's AccumulateGrad does: in place when ``p.grad``
    exists, else by taking over ``g``'s storage (a copy only if ``g`` is a view or strided unlike p)."""
    if p.grad is None:
        p.grad = g if (g._base is None and g.stride() == p.stride()) else g.clone(memory_format=torch.preserve_format)
    else:
        p.grad.add_(g)


class Checkpointed(nn.Module):
    """``model``'s training step, run in the order of a rematerialization schedule.

    Shares ``model``'s parameters (it holds ``model`` as ``self.model``). ``ck(*inputs, loss_fn=loss_fn)``
    returns the same loss as ``loss_fn(model(*inputs))``; ``loss.backward()`` runs the schedule's
    backward part and the gradients land in ``model``'s ``.grad``. Under ``torch.no_grad()``,
    ``ck(*inputs)`` returns ``model(*inputs)`` (nothing to recompute without a backward pass).

    ``grads="autograd"`` (default) hands each parameter gradient to autograd the moment the schedule
    computes it (a reentrant ``torch.autograd.backward`` from the parameter), so parameter hooks and
    ``DistributedDataParallel``'s all-reduce run as in eager training. ``grads="direct"`` adds it into
    ``.grad`` itself, bypassing autograd (and its hooks). Both free each gradient where the schedule
    does; with ``.grad`` already allocated both reach the predicted peak. When ``.grad`` is None,
    ``direct`` takes the gradient's storage over where autograd may copy it (one gradient at a time).
    """

    def __init__(self, model: nn.Module, program: Program, grads: str = "autograd") -> None:
        super().__init__()
        if grads not in GRAD_MODES:
            raise ValueError(f"grads={grads!r}; choose one of {GRAD_MODES}.")
        self.model = model
        self.program = program
        self.grads = grads
        named = dict(model.named_parameters(remove_duplicate=False))
        missing = [name for name, *_ in program.params if name not in named]
        if missing or len(named) != len(program.params):
            raise ValueError(f"This export was made for a model with parameters {[n for n, *_ in program.params][:5]}... "
                             f"({len(program.params)} in all); the given model has {len(named)} "
                             f"({', '.join(missing[:3]) or 'others'} missing). Load it with the model you exported.")
        for name, shape, dtype, _ in program.params:
            _check(f"parameter {name!r}", named[name], shape, dtype)
        self._param_names = [name for name, *_ in program.params]

    def forward(self, *inputs: torch.Tensor, loss_fn: nn.Module | None = None) -> torch.Tensor:
        if loss_fn is None:
            if torch.is_grad_enabled():
                raise TypeError("The schedule covers the whole training step, loss included: call "
                                "ck(*inputs, loss_fn=loss_fn) and .backward() the loss it returns. For evaluation "
                                "run ck(*inputs) under torch.no_grad(), or call ck.model directly.")
            return self.model(*inputs)
        if len(inputs) != len(self.program.inputs):
            raise TypeError(f"This export takes {len(self.program.inputs)} model input(s); got {len(inputs)}.")
        named = dict(self.model.named_parameters(remove_duplicate=False))
        params = [named[name] for name in self._param_names]
        owners = {"model": dict(self.model.named_buffers(remove_duplicate=False)),
                  "loss_fn": dict(loss_fn.named_buffers(remove_duplicate=False)) if isinstance(loss_fn, nn.Module) else {}}
        buffers = []
        for owner, name, shape, dtype in self.program.buffers:
            if name not in owners[owner]:
                raise TypeError(f"The traced {owner} has a buffer {name!r} that the given one lacks: pass the loss "
                                "module the step was exported with (an nn.Module holding its targets as buffers).")
            buffers.append(_check(f"{owner} buffer {name!r}", owners[owner][name], shape, dtype))
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self.program.inputs)):
            _check(f"input {i}", x, shape, dtype)
        return _ScheduledStep.apply(self.program, self.grads, params, *params, *buffers, *inputs)

    def extra_repr(self) -> str:
        info = self.program.info
        return (f"method={info.get('method')!r}, graph={info.get('graph')!r}, "
                f"predicted_peak={info.get('predicted_peak')}, grads={self.grads!r}")


def _check(what: str, t: torch.Tensor, shape: Sequence[int], dtype: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or str(t.dtype) != dtype:
        raise ValueError(f"{what} is {str(t.dtype)}{list(t.shape)}, but the export was traced with {dtype}{list(shape)}. "
                         "A schedule (and the memory it predicts) is made for one set of shapes: export again "
                         "with the model options (--batch, --seq, ...) you train with.")
    return t
# ---- end of runtime ----
