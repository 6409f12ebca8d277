"""Measure the memory a real training step uses, to hold the simulator's predictions to account.

On CPU, :class:`LiveBytes` is a ``TorchDispatchMode`` that follows tensor storages: every storage an
op creates is counted when it appears and uncounted when its last reference dies (a weakref
finalizer on the storage). Views and in-place results share an input's storage and are not counted
again. On CUDA, ``torch.cuda.max_memory_allocated`` is the measure.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, TypeVar

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from bonsai_core.tensors import storage_bytes, tensors_in

T = TypeVar("T")


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created by ops run inside it, while they are alive.

    ``live`` is the current count and ``peak`` the largest it has been; storages that existed before
    the mode (parameters, the batch) are not counted. A storage tagged as a host copy
    (:meth:`count_on_host`: an export's offloaded tensor, simulator rule 9, which on the CPU lives in the
    same memory) is counted apart, in ``host_live`` and ``host_peak``. ``held`` returns the bytes of storages
    the step holds that no op creates (FSDP2 resizes its all-gather outputs in place:
    :func:`bonsai_core.measure_parallel.fsdp_held_bytes`); it is polled after every op and its bytes added to
    ``live`` there for the peak.
    """

    def __init__(self, held: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.host_live = 0
        self.host_peak = 0
        self._sizes: dict[int, int] = {}
        self._host: set[int] = set()
        self._held = held

    def count_on_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (created inside the mode) as host memory from now on."""
        key = tensor.untyped_storage()._cdata
        if key in self._sizes and key not in self._host:
            self._host.add(key)
            self.live -= self._sizes[key]
            self.host_live += self._sizes[key]
            self.host_peak = max(self.host_peak, self.host_live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = self._count(func, types, args, kwargs)
        if self._held is not None:
            self.peak = max(self.peak, self.live + self._held())
        return out

    def _count(self, func, types, args, kwargs):  # noqa: ANN001
        """Run ``func``, counting the storages its outputs hold that are new."""
        if any(issubclass(t, _distributed_wrappers()) for t in types):
            # a DTensor's (tensor parallel) or a pending collective's op: handed on to the subclass, whose
            # own dispatch runs the local ops through this mode, so their storages are counted
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
        wrappers = _distributed_wrappers()
        for t in tensors_in(out):
            if isinstance(t, wrappers):  # a pending collective's wrapper (``_wrap_tensor_autograd``'s): its
                continue  # storage has no bytes; the tensor it wraps was counted where it was made
            st = t.untyped_storage()
            key = st._cdata
            if key in inputs or key in self._sizes or st.device.type == "meta":
                continue
            self._sizes[key] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._release, key)
        return out

    def _release(self, key: int) -> None:
        if key in self._host:
            self._host.discard(key)
            self.host_live -= self._sizes.pop(key, 0)
        else:
            self.live -= self._sizes.pop(key, 0)


def _distributed_wrappers() -> tuple[type, ...]:
    """torch.distributed's wrapper tensors, which hold no storage of their own: DTensor and the
    functional collectives' AsyncCollectiveTensor."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    return DTensor, AsyncCollectiveTensor


@dataclass(frozen=True)
class MeasuredStep:
    """One real training step: its peak bytes (fixed memory included) and the loss it computed."""

    peak: int
    fixed: int
    loss: float | None  # None on a pipeline rank without the last stage
    device: str
    host_peak: int = 0  # offloaded copies, counted apart (LiveBytes.count_on_host; not measured on CUDA)


def allocate_fixed(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any,
                   frozen: Collection[str] = ()) -> int:
    """Allocate every gradient buffer (as steady-state training keeps ``.grad``) and return the bytes
    that live through the whole step: parameters, gradients, buffers, the loss's targets, the batch
    (a traced graph's ``fixed_mem``). ``frozen`` names parameters the loss gives no gradient
    (``Traced.frozen_params``): their ``.grad`` stays ``None``, as eager leaves it."""
    params = [p for n, p in model.named_parameters() if p.requires_grad and n not in frozen]
    for p in params:
        p.grad = torch.zeros_like(p)
    loss_buffers = list(loss_fn.buffers()) if isinstance(loss_fn, nn.Module) else []
    return storage_bytes([*model.parameters(), *(p.grad for p in params), *model.buffers(), *loss_buffers, *inputs])


def eager_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
               autocast: str | None = None) -> Callable[[], torch.Tensor]:
    """The plain training step ``loss_fn(model(*inputs)).backward()`` as a function returning the loss;
    with ``autocast`` ("bf16" | "fp16") its forward pass and loss run under ``torch.autocast`` on the
    inputs' device, its backward pass outside (as autocast's recipe has it)."""
    from bonsai_core.trace import autocast_context

    device_type = inputs[0].device.type if inputs else "cpu"

    def step() -> torch.Tensor:
        with autocast_context(autocast, device_type):
            loss = loss_fn(model(*inputs))
        loss.backward()
        return loss
    return step


def peak_of(step: Callable[[], T], device: torch.device, held: Callable[[], int] | None = None) -> tuple[T, int, int]:
    """(what ``step`` returns, the most bytes it allocated at once, those of host copies) on
    ``device``: on CUDA ``torch.cuda.max_memory_allocated`` (everything allocated, what existed before
    the step included; host copies not measured), else what :class:`LiveBytes` counts of the storages
    made inside the step, with ``held``'s bytes (see :class:`LiveBytes`)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = step()
        torch.cuda.synchronize(device)
        return result, int(torch.cuda.max_memory_allocated(device)), 0
    tracker = LiveBytes(held)
    with tracker:
        result = step()
    return result, tracker.peak, tracker.host_peak


def measured(run: Callable[[], float | None], fixed: int, device: torch.device,
             held: Callable[[], int] | None = None) -> MeasuredStep:
    """The step ``run`` (returning its loss) measured on ``device`` (:func:`peak_of`) above ``fixed`` bytes."""
    loss, peak, host_peak = peak_of(run, device, held)
    if device.type == "cuda":  # max_memory_allocated counts the fixed bytes too
        return MeasuredStep(peak, fixed, loss, "cuda")
    return MeasuredStep(fixed + peak, fixed, loss, str(device), host_peak)


def measure_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
                 step: Callable[[], torch.Tensor] | None = None, frozen: Collection[str] = (),
                 optimizer: torch.optim.Optimizer | None = None, allocate_grads: bool = True) -> MeasuredStep:
    """Run one forward + loss + backward of ``model`` and measure its peak memory.

    Gradient buffers are allocated first (as in steady-state training, where ``.grad`` persists), so
    the fixed memory is parameters + gradients + buffers + the batch, as in a traced graph's
    ``fixed_mem``; ``allocate_grads=False`` leaves ``.grad`` as it is (None after
    ``optimizer.zero_grad()``: the step allocates the gradients). ``step`` replaces the default
    :func:`eager_step` (for example an exported, checkpointed model's step); it must return the loss.
    ``frozen``: see :func:`allocate_fixed`. BatchNorm statistics are updated in place (their buffers
    are fixed memory) and dropout masks are counted like any other tensor. With ``optimizer``, its
    state is allocated first (fixed memory, :func:`bonsai_core.optimizer.init_state`) and its
    ``step()`` runs after the backward pass, inside the measurement.
    """
    from bonsai_core.optimizer import init_state

    if allocate_grads:
        fixed = allocate_fixed(model, inputs, loss_fn, frozen)
    else:
        loss_buffers = list(loss_fn.buffers()) if isinstance(loss_fn, nn.Module) else []
        fixed = storage_bytes([*model.parameters(), *model.buffers(), *inputs, *loss_buffers])
    if optimizer is not None:
        fixed += init_state(optimizer)
    train = step or eager_step(model, inputs, loss_fn)

    def run() -> float:
        loss = float(train().detach())
        if optimizer is not None:
            optimizer.step()
        return loss

    return measured(run, fixed, inputs[0].device if inputs else torch.device("cpu"))


class OpOutputs(TorchDispatchMode):
    """Records, for every call of the ops in ``ops`` (aten names as a graph writes them, compared with
    ``bonsai_core.modules._same_op``), the bytes of the new storages its outputs hold: what a fused
    kernel makes (and what its autograd formula may save), to hold a graph's bytes of that kernel to
    account (:func:`predicted_op_outputs`). ``calls`` maps op -> bytes per call, in call order."""

    def __init__(self, ops: Collection[str]) -> None:
        super().__init__()
        from bonsai_core.modules import _same_op as same_op

        self._same_op = same_op
        self._ops = {same_op(op) for op in ops}
        self.calls: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = self._same_op(str(func))
        if name in self._ops:
            inputs = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
            storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors_in(out)}
            self.calls.setdefault(name, []).append(sum(b for k, b in storages.items() if k not in inputs))
        return out


def predicted_op_outputs(graph: Any, op: str) -> list[int]:
    """The bytes a graph gives each call of ``op`` (in listed order): its node's outputs and those of
    its separated outputs (``getitem`` nodes reading it)."""
    from bonsai_core.modules import _same_op as same_op

    out = []
    for v in range(graph.n):
        if same_op(graph.ops[v]) == same_op(op):
            parts = [int(u) for u in graph.users(v) if graph.ops[u] == "getitem"]
            out.append(int(graph.mem[v]) + sum(int(graph.mem[u]) for u in parts))
    return out


@dataclass(frozen=True)
class CompiledStep:
    """A real compiled training step, measured at the CPU allocator (:mod:`bonsai_core.allocations`):
    ``transient`` the most bytes it held above what was allocated when it began (``base``: parameters,
    gradients, buffers, the batch, whatever the process holds), and the loss."""

    transient: int
    base: int
    loss: float


def compiled_step(spec: str, options: dict[str, Any], compile: str, save: dict | None = None,
                  checkpointing: str | None = None, seed: int = 0, autocast: str | None = None) -> CompiledStep:
    """Build ``spec`` (:func:`bonsai_core.models.build`, real tensors), apply ``save``'s checkpoints (a
    plan's, :func:`bonsai_core.export_runtime.checkpointing.apply_saves`) or ``checkpointing``
    (:func:`bonsai_core.trace.compiled.checkpointed`), compile it as ``compile`` says with inductor for
    real, run one step (it compiles, and allocates the gradients), then measure the next. Runs in a
    process with the allocation hook (:func:`bonsai_core.allocations.run_hooked`)."""
    import gc

    from bonsai_core import allocations, models
    from bonsai_core.export_runtime.checkpointing import apply_saves
    from bonsai_core.trace import autocast_context
    from bonsai_core.trace.compiled import checkpointed, compiled

    model, inputs, loss_fn = models.build(spec, seed=seed, **options)
    if save:
        apply_saves(model, save, spec)
    device_type = inputs[0].device.type if inputs else "cpu"
    with checkpointed(model, checkpointing), compiled(model, compile) as runnable:
        def step() -> float:
            with autocast_context(autocast, device_type):
                loss = loss_fn(runnable(*inputs))
            loss.backward()
            return float(loss.detach())

        step()
        gc.collect()
        base = allocations.live_bytes()
        allocations.reset_peak()
        loss = step()
        transient = allocations.peak_bytes() - base
    return CompiledStep(transient, base, loss)


def measure_compiled(spec: str, options: dict[str, Any], compile: str, save: dict | None = None,
                     checkpointing: str | None = None, seed: int = 0, autocast: str | None = None) -> CompiledStep:
    """:func:`compiled_step` in a fresh process with the allocation hook preloaded."""
    from bonsai_core.allocations import run_hooked

    return run_hooked(compiled_step, spec, options, compile, save, checkpointing, seed, autocast)
