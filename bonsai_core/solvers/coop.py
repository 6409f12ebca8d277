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
  its neighbourhood cost (``dtr``'s: rebuild cost plus the evicted regions that read it) divided by
  its staleness, with no size term since the window already covers the request;
  ``window_cost="recompute"`` uses its plain compute cost instead.
* **cheap tensor partitioning**: tensors of low cost density (seconds per byte, below the graph's
  median) are placed at the low end of the free block best-fit picks, the others at the high end, so
  cheap tensors cluster next to each other and a window of cheap tensors is contiguous.
* **recomputable in-place**: not applicable here, and not modelled. Coop's in-place trick keeps a
  tensor recomputable when an in-place op overwrites its buffer. The graphs this tool traces are
  AOTAutograd's *functionalized* joint graphs: every op writes a fresh output, there are no mutating
  ops, so every tensor is already recomputable from its inputs. (What in-place does buy on a real
  GPU, reusing a dying input's block for the output, changes addresses only, and no graph here
  records which ops PyTorch would run in place.)

The run is emitted as compute/free ops, a static schedule validated by the simulator. The pool's
high-water mark (the bytes of the pool that placement really touched) is reported as
``stats["pool_high_water"]``.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import numpy as np

from bonsai_core.allocator import Allocator, round_size
from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule
from bonsai_core.solvers.dtr import Runtime, finish, with_budget_hint

WindowCost = Literal["stale", "recompute"]


def cost_density_sides(graph: Graph) -> Callable[[int], str]:
    """Cheap tensor partitioning: 'left' for tensors of cost/byte below the median, else 'right'."""
    holds = (graph.mem > 0) & ~graph.is_view
    density = np.where(holds, graph.cost / np.maximum(graph.mem, 1), 0.0)
    median = float(np.median(density[holds])) if holds.any() else 0.0
    sides = np.where(density <= median, "left", "right")
    return lambda v: str(sides[v])


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
        labels, region_cost = rt.evicted_regions() if window_cost == "stale" else (None, None)
        memo: dict[int, float] = {}
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
                    costs.append(rt.projected_cost(t, labels, region_cost, memo) / rt.staleness(t))
                else:
                    costs.append(rt.cost[t])
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
               window_cost: WindowCost = "stale", partition: bool = True, budget_hint: bool = True,
               **_: object) -> Schedule:
    """Coop in a pool of ``budget`` bytes (``fixed_mem`` included); see the module docstring. On
    failure, ``budget_hint`` bisects for a budget that works (8 more runs) to name it.
    O(evictions * (blocks + n + edges) + len(ops)) per run."""
    if window_cost not in ("stale", "recompute"):
        raise SolverError(f"Unknown Coop window cost {window_cost!r}; use 'stale' or 'recompute'.")
    if budget is None:
        # no pressure: nothing is ever evicted; size the pool so that the plain run fits
        budget = graph.fixed_mem + int(sum(round_size(m) for m in graph.mem.tolist() if m > 0))
    if budget <= graph.fixed_mem:
        raise BudgetError(f"A pool of {budget} bytes cannot hold {graph.name!r}'s fixed memory "
                          f"({graph.fixed_mem} bytes); raise the budget.")
    sides = cost_density_sides(graph) if partition else None

    def run_once(b: int) -> Schedule:
        rt = Runtime(graph, b, Allocator(b - graph.fixed_mem, policy="arena"), sides)
        rt.run(coop_policy(window_cost))
        return finish(rt, graph, "coop", {"window_cost": window_cost, "partition": partition, "allocator": "arena"})

    return with_budget_hint(graph, budget, run_once) if budget_hint else run_once(budget)
