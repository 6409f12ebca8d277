"""Measure one rank's steady-state step of a parallel run (FSDP2, tensor or pipeline parallel) on CPU.

The step is measured as :func:`bonsai_core.measure.measure_step` measures one: :class:`~bonsai_core.measure.LiveBytes`
following the storages the step's ops create, plus the storages FSDP2 holds that no op creates
(:func:`fsdp_held_bytes`). The fixed bytes are this rank's: its shard of each DTensor.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any, Callable, Collection, Sequence

import torch
import torch.nn as nn

from bonsai_core.measure import MeasuredStep, eager_step, measured
from bonsai_core.tensors import local_tensor, storage_bytes


def _fsdp_storages(net: nn.Module) -> tuple[list, list]:
    """What FSDP2 holds in ``net`` that a live-bytes tracker following new storages does not see: the storages it
    resizes instead of allocating (each parameter's all-gather output, which its unsharded parameter views: grown
    before a unit runs, shrunk to 0 bytes when resharded), and the collective buffers left from the previous step
    (the last reduce-scatter's input, the last forward all-gather's output; weak references, gone when FSDP frees
    them)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(net, FSDPModule):  # tensor or pipeline parallel alone: nothing held outside
        return [], []
    resized = {}
    for m in net.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for param in group.fsdp_params if group else ():
            for t in param.all_gather_outputs:
                resized[t.untyped_storage()._cdata] = t.untyped_storage()
    comm = net._get_fsdp_state()._comm_ctx
    held = [s.reduce_scatter_input for s in comm.reduce_scatter_states]
    if comm.all_gather_state is not None:
        held.append(comm.all_gather_state.all_gather_result.all_gather_output)
    left = {t.untyped_storage()._cdata: weakref.ref(t.untyped_storage()) for t in held if isinstance(t, torch.Tensor)}
    return list(resized.values()), list(left.values())


def fsdp_held_bytes(*modules: nn.Module) -> Callable[[], int]:
    """The current bytes of the storages FSDP2 holds in ``modules`` outside the ops a step runs
    (:func:`_fsdp_storages`, found as they are now), for :class:`bonsai_core.measure.LiveBytes` to poll."""
    storages = [_fsdp_storages(m) for m in modules]
    resized, left = [s for r, _ in storages for s in r], [s for _, held in storages for s in held]

    def held() -> int:
        return sum(st.nbytes() for st in resized) + sum(st().nbytes() for st in left if st() is not None)
    return held


def local_tensors(module: nn.Module) -> list:
    """The module's parameters, gradients and buffers, a DTensor as this rank's shard of it."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return [local_tensor(t) for t in (*module.parameters(), *grads, *module.buffers())]


def measure_sharded_step(modules: Sequence[nn.Module], run: Callable[[], float | None],
                         others: Collection[torch.Tensor] = ()) -> MeasuredStep:
    """The step ``run`` (returning its loss) of ``modules``, already run once: its fixed bytes this rank's
    parameters, gradients and buffers (:func:`local_tensors`) and ``others`` (the batch, ...), its peak counted
    on the CPU with FSDP's storages held outside its ops (:func:`fsdp_held_bytes`)."""
    fixed = storage_bytes([*(t for m in modules for t in local_tensors(m)), *others])
    return measured(run, fixed, torch.device("cpu"), fsdp_held_bytes(*modules))


def steady_step_peak(net: nn.Module, inputs: tuple, loss_fn: Any, grads: str = "zeroed") -> MeasuredStep:
    """One rank's steady-state step of ``net`` (sharded by ``fully_shard``, tensor parallel, or both): a first
    step (FSDP's lazy initialisation, ``.grad`` allocated, sharded; with ``grads`` ``"none"`` then set to None,
    as ``optimizer.zero_grad()`` leaves them), then one measured (:func:`measure_sharded_step`)."""
    step = eager_step(net, inputs, loss_fn)
    step()
    if grads == "none":
        net.zero_grad(set_to_none=True)
    loss_buffers = list(loss_fn.buffers()) if isinstance(loss_fn, nn.Module) else []
    return measure_sharded_step([net], lambda: float(step().detach()), [*loss_buffers, *inputs])


def pipeline_step_peak(schedule: Any, stages: list, parts: list, inputs: tuple, labels: torch.Tensor) -> MeasuredStep:
    """One pipeline rank's steady-state step under torch's ``schedule`` of its ``stages`` (their modules ``parts``):
    a first step (receive buffers, gradients allocated), then one measured (:func:`measure_sharded_step`), the
    receive buffers fixed. The loss is the last stage's (its microbatches' losses added up), None on other ranks."""
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses: list = []

    def step() -> None:
        losses.clear()
        args = (inputs[0],) if first else ()
        schedule.step(*args, target=labels if last else None, losses=losses if last else None, return_outputs=False)

    step()
    buffers = [info.buffer for stage in stages  # one per microbatch, kept across steps
               for infos in (*stage.args_recv_info.values(), *getattr(stage, "grad_recv_info", {}).values())
               for info in infos if getattr(info, "buffer", None) is not None]
    made = measure_sharded_step(parts, step, [*buffers, *inputs, labels])
    return replace(made, loss=float(sum(losses)) if last else None)
