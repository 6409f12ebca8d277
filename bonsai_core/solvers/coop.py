"""The ``coop`` method: Coop's allocator-aware eviction (Zhang et al., NeurIPS 2023), simulated.

Coop's observation: memory is not a commodity. DTR evicts the tensors of lowest heuristic one by
one until the request fits, but tensors freed at scattered addresses do not add up to one block:
it keeps evicting (and later recomputing) until some of them happen to be neighbours. Coop runs
dynamic rematerialization *inside* the allocator, as OneFlow's DTR allocator does
(``oneflow/core/vm/dtr_ep_allocator.cpp``): one pre-reserved pool of ``budget`` bytes
(:class:`bonsai_core.allocator.Allocator`, arena policy), and

* **sliding-window eviction** (``EvictAndFindPieceOnce``): when no free block fits a request, walk
  the pool's blocks in address order keeping a window of free blocks and evictable tensors whose
  size covers the request (a pinned tensor ends the window), and evict the window of least total
  cost: one pass, two pointers. A tensor's cost is OneFlow's (``RematableTensorStorage::cost``):
  its cost plus its evicted neighbourhood's (DTR's e*, ``eviction.Runtime.estar_cost``) divided by
  its staleness, with no size term since the window already covers the request;
  ``window_cost="recompute"`` uses its plain compute cost instead.
* **cheap tensor partitioning**: cheap tensors are placed at the low end of the free block best-fit
  picks, the others at the high end, so cheap tensors cluster next to each other and a window of
  cheap tensors is contiguous. Which tensors are cheap (``partition=``): ``"op_type"`` is the
  reference's classification (OneFlow's ``FindPiece``: outputs of conv, matmul, batched matmul and
  add_n, and their backward kernels, are expensive); ``"cost_density"`` puts tensors whose cost per
  byte is above the graph's median on the expensive side; ``"none"`` turns it off.
* **the full arena** (``full_arena=True``, the default): the step's parameters, gradients, batch
  and optimizer state sit in the same pool, in a training loop's allocation order
  (:func:`bonsai_core.allocator.full_arena`), so windows must work around pinned blocks: the setting
  Coop's paper is about.
* **recomputable in-place** (``inplace_writes=True``, the default): an op eager runs in place
  (``relu_``, ``x += y``: the graph's ``inplace_of``, recorded by the tracer) writes its output into
  its input's block when nothing else needs the input, so the block keeps its address and no second
  block is asked for; the overwritten input stays rebuildable from its own inputs, so the output is
  recomputable too (the input is rebuilt, then overwritten again). ``False`` is copy-on-write: a
  fresh block while the input still holds its own. The optimizer's writes between steps are
  ``inplace_updates``. BatchNorm's running statistics are buffers, fixed tensors pinned in the full
  arena and written where they are either way.

The run is emitted as compute/free ops, a static schedule validated by the simulator, with its event
log in ``extra["evictions"]`` (per request that found no room: the ops emitted before it, the node,
the tensors evicted). The pool's high-water mark (the bytes of the pool that placement really
touched) is reported as ``stats["pool_high_water"]``; the pool itself, and its fragmentation (the
allocator model's, the project's one definition), come from replaying the schedule in it
(:func:`bonsai_core.solvers.pool.pool_replay`, ``bonsai simulate --allocator --arena``).
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import numpy as np

from bonsai_core.allocator import Optimizer, round_size
from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.solvers.eviction import (DEALLOCATIONS, Deallocation, Runtime, arena_pool, finish,
                                          run_policy)

WindowCost = Literal["stale", "recompute"]


# -- cheap tensor partitioning: which end of a free block a tensor is placed at ---------------------
# (bonsai_core.solvers.pool.pool_replay replays the placement)

Partition = Literal["op_type", "cost_density", "none"]
PARTITIONS = ("op_type", "cost_density", "none")
# OneFlow's high-compute-cost op types (dtr_ep_allocator.cpp, FindPiece), as aten names
EXPENSIVE_OPS = ("aten.convolution.", "aten.convolution_backward.", "aten.mm.", "aten.addmm.", "aten.bmm.",
                 "aten.baddbmm.", "aten._scaled_dot_product", "aten.add_n")


def cost_density_sides(graph: Graph) -> Callable[[int], str]:
    """Cheap tensor partitioning by cost density: 'left' for tensors of cost/byte at or below the
    median, else 'right'."""
    holds = (graph.mem > 0) & ~graph.is_view
    density = np.where(holds, graph.cost / np.maximum(graph.mem, 1), 0.0)
    median = float(np.median(density[holds])) if holds.any() else 0.0
    sides = np.where(density <= median, "left", "right")
    return lambda v: str(sides[v])


def op_type_sides(graph: Graph) -> Callable[[int], str]:
    """Cheap tensor partitioning by op type, as the reference does: outputs of conv / matmul-like
    ops (and their backward kernels) 'right', everything else 'left'."""
    sides = ["right" if op.startswith(EXPENSIVE_OPS) else "left" for op in graph.ops]
    return lambda v: sides[v]


def partition_sides(graph: Graph, partition: Partition) -> Callable[[int], str] | None:
    """The side of a free block each node's output is placed at under ``partition`` (None: off)."""
    if partition == "op_type":
        return op_type_sides(graph)
    if partition == "cost_density":
        return cost_density_sides(graph)
    return None



def min_cost_window(sizes: list[int], costs: list[float], request: int) -> tuple[int, int, float] | None:
    """The contiguous run ``[i, j)`` of blocks with total size >= ``request`` and least total cost,
    where a cost of ``inf`` marks a block that no window may contain. Costs are nonnegative, so for
    each end the best start is the last one that still covers the request: two pointers, O(len).

    >>> min_cost_window([4, 4, 4, 4], [3.0, 1.0, 1.0, 0.5], 8)
    (2, 4, 1.5)
    """
    best: tuple[int, int, float] | None = None
    start, size, cost = 0, 0, 0.0
    for end in range(len(sizes)):
        if math.isinf(costs[end]):
            start, size, cost = end + 1, 0, 0.0
            continue
        size += sizes[end]
        cost += costs[end]
        while start < end and size - sizes[start] >= request:
            size -= sizes[start]
            cost -= costs[start]
            start += 1
        if size >= request and (best is None or cost < best[2]):
            best = (start, end + 1, cost)
    return best


def coop_policy(window_cost: WindowCost = "stale") -> Callable[[Runtime, int], bool]:
    """Evict the least-cost contiguous window that covers the request; O(blocks + n + edges)."""

    def policy(rt: Runtime, v: int) -> bool:
        request = round_size(rt.mem[v])
        best = None
        for blocks in rt.alloc.segments():
            sizes = [b.size for b in blocks]
            costs = []
            for b in blocks:
                t = b.owner
                if t < 0:
                    costs.append(0.0)
                elif not rt.evictable(t):
                    costs.append(math.inf)
                elif window_cost == "stale":
                    costs.append(rt.eviction_cost(t) / rt.staleness(t))
                else:
                    costs.append(min(rt.cost[t], rt.eviction_cost(t)))
            found = min_cost_window(sizes, costs, request)
            if found is not None and (best is None or found[2] < best[1]):
                best = ([b.owner for b in blocks[found[0]:found[1]] if b.owner >= 0], found[2])
        if best is None or not best[0]:
            return False
        for t in best[0]:
            rt.evict(t)
        return True

    return policy


def solve_coop(graph: Graph, budget: int | None, *, time_limit: float | None = None,
               window_cost: WindowCost = "stale", partition: Partition = "op_type", full_arena: bool = True,
               optimizer: Optimizer = "adam", deallocation: Deallocation = "free",
               budget_hint: bool = True, inplace_updates: bool = True, inplace_writes: bool = True,
               offload: bool = False) -> Schedule:
    """Coop in a pool of ``budget`` bytes (``fixed_mem`` included; with the full arena, the
    optimizer state on top); see the module docstring.

    time_limit: seconds for the whole call, the budget bisection included.
    window_cost: "stale" (e* cost / staleness, OneFlow's) or "recompute" (plain compute cost).
    partition: cheap tensor partitioning, "op_type" (the reference's), "cost_density" or "none".
    full_arena: place params, grads, batch and optimizer state in the pool.
    optimizer: whose state the full arena holds: "adam" (two moments per parameter) or "sgd" (none).
    deallocation: when the program frees a tensor: "free" (rebuildable, outside e*), "evict" (DTR's
        eager eviction) or "banish" (DTR's banishing); see ``eviction.py``.
    budget_hint: on failure, bisect (up to 8 more runs) for a budget that works and name it.
    inplace_updates: with the full arena, Coop's recomputable in-place: the optimizer updates
        parameters and its state in place, so the pinned blocks keep their addresses (False: copy-on-write
        updates, which move them; see ``allocator.pin_fixed``).
    inplace_writes: Coop's recomputable in-place during the step: an op eager runs in place writes its
        input's block when nothing else needs the input (False: copy-on-write, a fresh block).
    offload: an evicted tensor may be copied to host memory instead of discarded, when the round trip
        costs less than rebuilding it (simulator rule 9; not in Coop's paper; ``eviction.py``).

    O(evictions * (blocks + n + edges) + len(ops)) per run."""
    if window_cost not in ("stale", "recompute"):
        raise SolverError(f"Unknown Coop window cost {window_cost!r}; use 'stale' or 'recompute'.")
    if partition not in PARTITIONS:
        raise SolverError(f"Unknown Coop partition {partition!r}; use one of {', '.join(PARTITIONS)}.")
    if deallocation not in DEALLOCATIONS:
        raise SolverError(f"Unknown deallocation {deallocation!r}; use one of {', '.join(DEALLOCATIONS)}.")
    if budget is None:
        # no pressure: nothing is ever evicted; size the pool so that the plain run fits
        budget = graph.fixed_mem + int(sum(round_size(m) for m in graph.mem.tolist() if m > 0))
    if budget <= graph.fixed_mem:
        raise BudgetError(f"A pool of {budget} bytes cannot hold {graph.name!r}'s fixed memory "
                          f"({graph.fixed_mem} bytes); raise the budget.")
    deadline = Deadline(time_limit)
    sides = partition_sides(graph, partition)

    def run_once(b: int) -> Schedule:
        rt = Runtime(graph, b, arena_pool(graph, b, full_arena, optimizer, inplace_updates), sides, deallocation,
                     deadline, inplace_writes, offload)
        rt.run(coop_policy(window_cost))
        return finish(rt, graph, "coop", {"window_cost": window_cost, "partition": partition, "allocator": "arena",
                                          "full_arena": full_arena, "inplace_updates": inplace_updates,
                                          "inplace_writes": inplace_writes, "optimizer": optimizer})

    return run_policy(graph, budget, run_once, budget_hint, deadline)
