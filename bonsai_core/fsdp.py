"""FSDP2 per rank: the memory one of N processes holds when ``fully_shard`` shards the model by block.

``torch.distributed.fsdp.fully_shard`` applied to each block of the model (a transformer's layers, as
torchtitan wraps them) and then to the whole model (the *root* unit: embeddings, final norm, head)
keeps on every rank 1/N of each parameter, of its gradient and of the optimizer's state. Around that
sharded state a rank holds whole (*unsharded*) tensors for a while. The simulator's rules (docs/DESIGN.md):

* **Fixed per rank**: the sharded parameters, gradients and optimizer state (1/N each, rounded up),
  and the root unit's unsharded parameters, gathered at the first forward op and kept through the
  backward pass (FSDP does not reshard the root after its forward: its head runs first backwards).
* **Forward**: while an op of block *u* runs, *u*'s parameters are unsharded, and the flat output of
  the last all-gather is kept until the next all-gather (the root's first); with
  ``reshard_after_forward`` (the default) *u* is resharded when an op outside it runs, else it stays
  unsharded until its backward ends.
* **Backward**: once the gradient reaches the model's output (the first backward op reading a forward
  tensor of the model rather than of the loss function), the last block's all-gather is prefetched.
  Block *u*'s backward runs from the first backward op that reads a tensor of *u*'s forward (the latest
  block such an op reads) until an op of an earlier block runs; meanwhile *u*'s parameters are
  unsharded, the block before it is prefetched (its flat all-gather output held), *u*'s gradients are
  held as they are computed (the graph frees a gradient at once) until its reduce-scatter, whose input
  (the gradients flattened, copied while they are still held) is kept until the next reduce-scatter.
  A recomputed forward op of block *u* runs inside *u*'s backward. The root's gradients are held from
  their computation to the end of the step.

These are FSDP2's own allocations (``torch/distributed/fsdp/_fully_shard``: ``all_gather_state``,
``reduce_scatter_states``, implicit backward prefetching), measured against gloo processes with
``bonsai bench fsdp`` (docs/REAL_RUNS.md). :func:`working_profile` gives those unsharded bytes per schedule op; ``simulate`` adds them to the
timeline, so every schedule's peak is the rank's, and :func:`bonsai_core.solvers.solve` tightens a
method's budget by what they add where they set the peak. Measured against gloo processes:
docs/REAL_RUNS.md.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch.nn as nn

from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph, block_stack

SHARDED_KINDS = ("param", "grad", "optimizer")  # fixed tensors each rank holds 1/N of


def unit_bytes(model: nn.Module, blocks: Sequence[str]) -> tuple[list[int], int]:
    """The parameter bytes of each block (by path in ``model.named_modules()``) and of the rest of the
    model (the root unit), each parameter counted once (tied ones in the first unit that has them)."""
    seen: set[int] = set()

    def own(module: nn.Module) -> int:
        total = 0
        for p in module.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    per_block = [own(model.get_submodule(path)) for path in blocks]
    return per_block, own(model)


def shard_by_blocks(graph: Graph, model: nn.Module, world: int, reshard_after_forward: bool = True) -> Graph:
    """:func:`with_fsdp` with ``fully_shard`` on each block of the graph's block stack
    (:func:`bonsai_core.graph.block_stack`) of ``model`` (the traced module) and on the whole model."""
    stack = block_stack(graph)
    sizes, root = unit_bytes(model, [path for path, _, _ in stack])
    model_last = max((last for _, _, last in graph.modules), default=graph.n - 1)
    return with_fsdp(graph, world, [(p, first, last, b) for (p, first, last), b in zip(stack, sizes)], root,
                     reshard_after_forward, model_last)


def with_fsdp(graph: Graph, world: int, blocks: Sequence[tuple[str, int, int, int]], root: int,
              reshard_after_forward: bool = True, model_last: int | None = None) -> Graph:
    """``graph`` as one of ``world`` FSDP ranks holds it (see the module doc). ``blocks``: each block's
    (path, first, last forward node, parameter bytes), in order; ``root``: the other parameters' bytes;
    ``model_last``: the model's last forward node (the loss function's ops follow; default: all are the
    model's), where the root's backward begins.
    Apply it before :func:`bonsai_core.optimizer.with_optimizer`, whose state is then sharded too."""
    if world < 1:
        raise BonsaiError(f"--fsdp {world}: the number of ranks must be at least 1.")
    if graph.fsdp is not None:
        raise BonsaiError(f"{graph.name!r} is already sharded over {graph.fsdp['world']} ranks; trace it again.")
    if graph.optimizer is not None:
        raise BonsaiError(f"{graph.name!r} already has its optimizer's state: shard the graph first, then add the "
                          "optimizer (bonsai trace --fsdp N --optimizer NAME does).")
    if world == 1:
        return graph
    if not blocks:
        raise BonsaiError(f"{graph.name!r} records no repeated blocks (its 'modules' field has no "
                          "<parent>.<index> calls), so its FSDP units are unknown: FSDP per rank needs a model "
                          "with a block stack (a transformer's layers, a ResNet's blocks).")
    sharded = [(name, math.ceil(nbytes / world) if kind in SHARDED_KINDS else nbytes, kind)
               for name, nbytes, kind in graph.fixed_tensors]
    fixed = [*sharded, ("fsdp.root_unsharded", root, "fsdp")]
    data: dict[str, Any] = graph.to_dict()
    data["fixed_tensors"] = [list(t) for t in fixed]
    data["fixed_mem"] = graph.fixed_mem - sum(t[1] for t in graph.fixed_tensors) + sum(t[1] for t in fixed)
    data["fsdp"] = {"world": world, "reshard_after_forward": bool(reshard_after_forward), "root_bytes": root,
                    "model_last": graph.n - 1 if model_last is None else int(model_last),
                    "units": [[path, int(first), int(last), int(nbytes)] for path, first, last, nbytes in blocks]}
    return Graph.from_dict(data)


WORKING_PARTS = ("all-gathered blocks", "gradients held", "collective buffers")


def working_profile(graph: Graph, ops: Sequence[tuple[str, int]]) -> np.ndarray:
    """int64[len(ops)]: the bytes FSDP holds at each op of a schedule beyond ``fixed_mem`` and the graph's
    own tensors (the module doc's rules); zeros for a graph without ``fsdp``."""
    return sum(working_parts(graph, ops).values(), np.zeros(len(ops), dtype=np.int64))


def working_parts(graph: Graph, ops: Sequence[tuple[str, int]]) -> dict[str, np.ndarray]:
    """:func:`working_profile` by what holds the bytes (``WORKING_PARTS``): the unsharded parameters of
    the blocks all-gathered (and the flat all-gather output held for the next copy-out), the gradients
    held until their reduce-scatter, and the collective buffers (the reduce-scatter's input, the
    previous all-gather output during a copy-out). int64[len(ops)] each; zeros without ``fsdp``."""
    parts = {name: np.zeros(len(ops), dtype=np.int64) for name in WORKING_PARTS}
    if graph.fsdp is None:
        return parts
    blocks_out, grads_out, buffers_out = (parts[name] for name in WORKING_PARTS)
    units = graph.fsdp["units"]
    size = [int(u[3]) for u in units]
    owner = _forward_owner(graph, units)
    reads = _backward_unit(graph, owner)
    reshard = graph.fsdp["reshard_after_forward"]
    model_last = int(graph.fsdp["model_last"])
    root_backward = False  # the gradient reached the model's output: the last block is prefetched
    gathered: set[int] = set()  # blocks whose parameters are unsharded
    gather_output = int(graph.fsdp["root_bytes"])  # a flat all-gather output FSDP holds: the root's, first
    scatter_input = 0  # the last reduce-scatter's input (a block's gradients), held until the next one
    in_backward, current = False, -1  # the block whose backward runs
    block_grads = root_grads = 0  # gradients computed and held until their reduce-scatter
    for i, (kind, v) in enumerate(ops):
        held = transient = 0
        if kind == "compute":
            forward = bool(graph.is_forward[v])
            if not forward and not in_backward:  # the forward's last all-gather output was freed at its end
                in_backward, gather_output = True, 0
                gathered = set() if reshard else gathered
            u = int(owner[v] if forward else reads[v])
            if not in_backward:
                if u >= 0 and u not in gathered:  # all-gathered; the previous flat output is freed after the copy-out
                    transient, gather_output = gather_output, size[u]
                    gathered = {u} if reshard else gathered | {u}
                elif u < 0 and reshard:
                    gathered = set()  # between blocks: the last one was resharded after its forward
            elif u >= 0 and u != current:
                if current >= 0:  # its backward ended: resharded, its gradients copied out and reduce-scattered
                    gathered.discard(current)
                    transient, scatter_input = block_grads, block_grads
                gathered.add(u)  # copied out of its prefetched all-gather; the block before it is prefetched
                current, block_grads = u, 0
                gather_output = size[u - 1] if u > 0 else 0
            if in_backward and not root_backward and not forward and current < 0 and size \
                    and any(graph.is_forward[d] and d <= model_last for d in graph.deps(v).tolist()):
                root_backward, gather_output = True, size[-1]
            if graph.is_output[v] and not forward:  # a gradient: FSDP holds it, the graph frees it at once
                held = int(graph.mem[_storage_node(graph, v)])
        blocks_out[i] = sum(size[g] for g in gathered) + gather_output
        grads_out[i] = block_grads + root_grads
        buffers_out[i] = scatter_input + transient
        if current >= 0:
            block_grads += held
        else:
            root_grads += held
    return parts


def _storage_node(graph: Graph, v: int) -> int:
    """The node whose bytes ``v`` (a view of a view ...) shares."""
    while graph.alias_of[v] >= 0:
        v = int(graph.alias_of[v])
    return v


def _forward_owner(graph: Graph, units: Sequence[Sequence[Any]]) -> np.ndarray:
    """int64[n]: the block whose forward span holds each forward node, or -1."""
    owner = np.full(graph.n, -1, dtype=np.int64)
    for k, (_, first, last, _) in enumerate(units):
        span = np.arange(int(first), int(last) + 1)
        owner[span[graph.is_forward[span]]] = k
    return owner


def _backward_unit(graph: Graph, owner: np.ndarray) -> np.ndarray:
    """int64[n]: for each backward node, the latest block (in forward order) among the forward tensors it
    reads, or -1 (an op reading none keeps the block whose backward runs)."""
    reads = np.full(graph.n, -1, dtype=np.int64)
    for b in np.flatnonzero(~graph.is_forward).tolist():
        forward = [int(owner[d]) for d in graph.deps(b).tolist() if graph.is_forward[d]]
        reads[b] = max(forward, default=-1)
    return reads
