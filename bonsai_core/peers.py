"""What practitioners already have, measured on the same models and the same scale as our methods.

* ``torch-budget``: PyTorch's own min-cut rematerialization partitioner
  (``torch._functorch.partitioners.min_cut_rematerialization_partition``) with
  ``torch._functorch.config.activation_memory_budget`` set, as a run uses it: ``torch.compile(model)``
  with inductor, compiled and run for real on the CPU, its peak counted at the CPU allocator
  (:func:`bonsai_core.measure.measure_compiled`: inductor's buffers included), its overhead the compiled
  step's compute under the budget over the compiled step's without one, both from the compiled trace
  (:mod:`bonsai_core.trace.compiled`: inductor's fused kernels, each priced once).
* ``per-block``: ``torch.utils.checkpoint`` (non-reentrant) around every block of the model's
  largest stack of blocks, the ``checkpoint_sequential`` habit.

Nothing here trusts a model of what the peer does: each runs a real training step on CPU, its peak
measured (``per-block``: by the live-bytes tracker; its compute by :class:`OpCost`, which prices every
aten op executed with the same roofline that costs our graphs; its overhead is its cost over the plain
eager step's, minus one).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from bonsai_core import models
from bonsai_core.costmodel import DEFAULT_PROFILE, PROFILES, op_cost
from bonsai_core.measure import LiveBytes, allocate_fixed
from bonsai_core.tensors import tensors_in

PEERS = ("torch-budget", "per-block")
# The knob settings tried for each peer; for a budget, the cheapest setting whose measured peak fits wins.
TORCH_BUDGET_FRACTIONS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0)
PER_BLOCK_EVERY = (4, 2, 1)


class OpCost(TorchDispatchMode):
    """Sums the roofline cost of every aten op executed inside it (views cost nothing)."""

    def __init__(self, profile: str = DEFAULT_PROFILE) -> None:
        super().__init__()
        self.profile = PROFILES[profile]
        self.total = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
        outs = tensors_in(out)
        if outs and not all(t.untyped_storage()._cdata in ins for t in outs):
            self.total += op_cost(self.profile, func, args, kwargs, out)
        return out


@dataclass(frozen=True)
class PeerRun:
    """One measured training step of a peer at one knob setting."""

    peer: str
    setting: str
    peak: int
    compute_cost: float
    loss: float
    overhead: float | None = None  # over the peer's own reference step (a compiled peer's: the compiled step's)


class _Step(nn.Module):
    def __init__(self, model: nn.Module, loss_fn: nn.Module) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs))


def measure_eager(model_name: str, options: dict[str, int], profile: str = DEFAULT_PROFILE,
                  wrap: Callable[[nn.Module], None] | None = None) -> tuple[int, float, float]:
    """(peak bytes, compute cost, loss) of one real eager step, after ``wrap(model)`` if given."""
    model, inputs, loss_fn = models.build(model_name, **options)
    if wrap is not None:
        wrap(model)
    fixed = allocate_fixed(model, inputs, loss_fn)
    with LiveBytes() as live, OpCost(profile) as cost:
        loss = loss_fn(model(*inputs))
        loss.backward()
    return fixed + live.peak, cost.total, float(loss.detach())


def measure_torch_budget(model_name: str, options: dict[str, int], fraction: float,
                         profile: str = DEFAULT_PROFILE) -> PeerRun:
    """One step of ``torch.compile(model)`` (inductor) with ``activation_memory_budget = fraction``, run
    for real and measured at the CPU allocator; its compute and its overhead over the compiled step
    without a budget from the compiled traces of both."""
    from bonsai_core.measure import measure_compiled
    from bonsai_core.trace import trace_model

    graph = trace_model(model_name, profile=profile, compile="model", ac=f"budget:{fraction:g}", **options).graph
    plain = trace_model(model_name, profile=profile, compile="model", **options).graph
    measured = measure_compiled(model_name, options, "model", checkpointing=f"budget:{fraction:g}")
    return PeerRun("torch-budget", f"activation_memory_budget={fraction:g}", graph.fixed_mem + measured.transient,
                   graph.total_cost, measured.loss, graph.total_cost / plain.total_cost - 1)


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of the model's largest ModuleList/Sequential of blocks (its repeated layers); the
    graph's own record of them is :func:`bonsai_core.graph.block_stack`."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            blocks = [m for m in module.children() if any(True for _ in m.parameters())]
            if len(blocks) > len(best):
                best = blocks
    return best


def checkpoint_blocks(model: nn.Module, every: int) -> None:
    """Wrap every ``every``-th block of the model's block stack in non-reentrant checkpointing."""
    from torch.utils.checkpoint import checkpoint

    for i, block in enumerate(block_modules(model)):
        if i % every == 0:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def measure_per_block(model_name: str, options: dict[str, int], every: int,
                      profile: str = DEFAULT_PROFILE) -> PeerRun:
    peak, cost, loss = measure_eager(model_name, options, profile, wrap=lambda m: checkpoint_blocks(m, every))
    return PeerRun("per-block", f"checkpoint every {every} block(s)", peak, cost, loss)


def peer_runs(peer: str, model_name: str, options: dict[str, int], profile: str = DEFAULT_PROFILE) -> list[PeerRun]:
    """Every knob setting of a peer, measured."""
    if peer == "torch-budget":
        return [measure_torch_budget(model_name, options, f, profile) for f in TORCH_BUDGET_FRACTIONS]
    if peer == "per-block":
        return [measure_per_block(model_name, options, k, profile) for k in PER_BLOCK_EVERY]
    raise ValueError(f"unknown peer {peer!r}; choose one of {PEERS}")


def best_within(runs: list[PeerRun], budget: int) -> PeerRun | None:
    """The cheapest measured setting whose peak fits the budget, or None."""
    fitting = [r for r in runs if r.peak <= budget]
    return min(fitting, key=lambda r: (r.overhead if r.overhead is not None else r.compute_cost, r.peak)) if fitting else None
