"""Fixed-memory placement: the tensors that live through the whole step (parameters, gradients, the
batch, the optimizer's state) placed in the pool in a training loop's order, so that the step's
activations work around them (the full arena; the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from bonsai_core.allocator.policies import Allocator, Policy
from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.units import format_bytes

Optimizer = Literal["adam", "sgd"]
# How the optimizer writes parameters and its state: in place (the tensors keep their addresses; Coop's
# recomputable in-place) or copy-on-write (a new block, then the old one freed: how a rematerializing
# runtime keeps a mutated tensor's old value recomputable without it).
Updates = Literal["inplace", "copy"]
OPTIMIZER_STATES = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ()}  # per parameter, allocation order


@dataclass(frozen=True)
class FixedTensor:
    """One tensor that lives through the whole step: ``kind`` is param, grad, batch or optimizer."""

    name: str
    nbytes: int
    kind: str


def gradient_outputs(graph: Graph) -> list[tuple[int, int]]:
    """The parameter-gradient outputs of the backward pass as (node, bytes), in the model's
    parameter order (the reverse of the order backward computes them). A gradient that is a view
    (a weight's ``mm(...).t()``) has its base's bytes."""
    out = []
    for v in graph.outputs.tolist():
        if graph.phases[v] != "backward":
            continue
        base = graph.storage_of(v)
        if graph.mem[base] > 0:
            out.append((v, int(graph.mem[base])))
    return out[::-1]


def fixed_tensors(graph: Graph, optimizer: Optimizer = "adam") -> list[FixedTensor]:
    """The step's fixed tensors in allocation order: params (and buffers, constants), grads, the
    batch, then the optimizer state (one set per gradient, in parameter order). From the graph's
    optional ``fixed_tensors`` (written by ``bonsai trace``), else derived from its gradient outputs
    (see the module docstring); if those do not fit twice in ``fixed_mem`` (a graph not traced by
    this tool), ``fixed_mem`` is one batch block and there is no optimizer state."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATES)}")
    if graph.optimizer is not None:  # traced with its optimizer: the state is in fixed_mem already
        return [FixedTensor(n, b, "batch" if k == "input" else k) for n, b, k in graph.fixed_tensors if b > 0]
    if graph.fixed_tensors:
        out = [FixedTensor(n, b, "batch" if k == "input" else k) for n, b, k in graph.fixed_tensors if b > 0]
        grads = [(t.name.removesuffix(".grad"), t.nbytes) for t in out if t.kind == "grad"]
    else:
        grads = [(graph.names[v], b) for v, b in gradient_outputs(graph)]
        rest = graph.fixed_mem - 2 * sum(b for _, b in grads)
        if rest < 0:
            return [FixedTensor("fixed_mem", graph.fixed_mem, "batch")] if graph.fixed_mem else []
        out = [FixedTensor(f"param of {n}", b, "param") for n, b in grads]
        out += [FixedTensor(f"grad of {n}", b, "grad") for n, b in grads]
        if rest:
            out.append(FixedTensor("batch, buffers, frozen params", rest, "batch"))
    out += [FixedTensor(f"{state} of {n}", b, "optimizer") for n, b in grads for state in OPTIMIZER_STATES[optimizer]]
    return out


def optimizer_bytes(tensors: list[FixedTensor]) -> int:
    return sum(t.nbytes for t in tensors if t.kind == "optimizer")


def state_beyond_fixed(graph: Graph, tensors: list[FixedTensor]) -> int:
    """Optimizer-state bytes of ``tensors`` that the graph's ``fixed_mem`` does not hold already (all
    of them, unless the graph was traced with its optimizer)."""
    return 0 if graph.optimizer is not None else optimizer_bytes(tensors)


def pin_fixed(alloc: Allocator, first_owner: int, tensors: list[FixedTensor],
              warmup: Callable[[Allocator], None] | None = None, updates: Updates = "inplace") -> dict[int, FixedTensor]:
    """Place the fixed tensors in ``alloc`` in a training loop's order, as owners ``first_owner``,
    ``first_owner + 1``, ...: params, grads and the batch; then the first step (``warmup``, which
    must free every block it takes; skipped when None, which is exact for the arena policy since a
    finished step leaves only merged free space); then the optimizer state, and with ``updates="copy"``
    the optimizer's writes as copy-on-write (each parameter, then each state: a new block, then the old
    one freed); then the next batch, before the first one is freed. Returns owner -> tensor of the
    blocks left in the pool (``alloc.pinned``). Raises BudgetError if they do not fit."""
    held: dict[int, FixedTensor] = alloc.pinned
    owner = first_owner

    def take(t: FixedTensor) -> int:
        nonlocal owner
        if alloc.malloc(owner, t.nbytes) is None:
            raise BudgetError(f"The pool cannot hold the step's fixed tensors: {t.name} ({format_bytes(t.nbytes)}) "
                              f"does not fit after {format_bytes(alloc.pinned_bytes)} of them. Raise the budget.")
        held[owner] = t
        alloc.pinned_bytes += t.nbytes
        owner += 1
        return owner - 1

    batch = [t for t in tensors if t.kind == "batch"]
    for t in tensors:
        if t.kind != "optimizer":
            take(t)
    if warmup is not None:
        warmup(alloc)
    for t in tensors:
        if t.kind == "optimizer":
            take(t)

    def rewrite(t: FixedTensor) -> None:
        """``t`` written out of place: its new block is taken before the old one is freed."""
        old = next(o for o, h in held.items() if h is t)
        take(t)
        alloc.free(old)
        del held[old]
        alloc.pinned_bytes -= t.nbytes

    if updates == "copy":
        for kind in ("param", "optimizer"):
            for t in tensors:
                if t.kind == kind:
                    rewrite(t)
    elif updates != "inplace":
        raise ValueError(f"unknown updates {updates!r}; use 'inplace' or 'copy'")
    for t in batch:  # the next step's batch arrives before the last one is dropped
        rewrite(t)
    return held




def full_arena(graph: Graph, capacity: int | None, policy: Policy = "arena", optimizer: Optimizer = "adam",
               warmup: Callable[[Allocator], None] | None = None, updates: Updates = "inplace") -> tuple[Allocator, int]:
    """A pool whose fixed tensors are placed as in a training loop (:func:`pin_fixed`), and the
    optimizer-state bytes it holds beyond ``fixed_mem``. ``capacity`` is in the budget's terms
    (``fixed_mem`` included, optimizer state not); the pool gets the optimizer state on top."""
    tensors = fixed_tensors(graph, optimizer)
    extra = state_beyond_fixed(graph, tensors)
    alloc = Allocator(None if capacity is None else capacity + extra, policy)
    pin_fixed(alloc, graph.n, tensors, warmup, updates)
    return alloc, extra
