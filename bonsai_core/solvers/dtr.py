"""The ``dtr`` method: Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021), simulated.

The program runs in listed order on :class:`bonsai_core.solvers.eviction.Runtime`; whenever an
output does not fit, DTR evicts the one evictable tensor of least heuristic score, and repeats. The
paper's heuristics (``heuristic=``), with c the compute cost, m the bytes, s the staleness (compute
seconds since the last access) and e* the evicted neighbourhood (see ``eviction.py``):

* ``"dtr"`` (h_DTR, the default): (c(t) + c(e*(t))) / (m(t) · s(t)), e* from the exact connected
  components of the evicted tensors;
* ``"dtr_eq"`` (h_DTR^eq): the same with e* from union-find equivalence classes (merged on
  eviction, never split: what DTR's prototype runs);
* ``"local"``: c(t) / (m(t) · s(t)), no neighbourhood;
* ``"lru"``: 1 / s(t), the least recently used tensor goes;
* ``"size"``: 1 / m(t), the largest tensor goes;
* ``"dte"`` (pool runs only): h_DTR with m(t) replaced by the bytes evicting t would free as one
  range, t's block plus the free blocks next to it (the DTE baseline of Coop's paper: OneFlow's
  ``EvictAndFindPieceLoop`` with ``GetSizeIncludingNeighborhood``).

The budget caps live bytes, or (``allocator=True``) DTR runs inside an arena pool of ``budget`` bytes
and evicts until the request fits one free block (the baseline Coop is compared with); ``full_arena``
puts the step's parameters, gradients, batch and optimizer state in that pool too
(:func:`bonsai_core.allocator.full_arena`). ``deallocation`` chooses DTR's banishing or eager eviction.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

from bonsai_core.allocator import Optimizer
from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.solvers.eviction import (DEALLOCATIONS, Deallocation, Runtime, arena_pool, finish,
                                          run_policy)

Heuristic = Literal["dtr", "dtr_eq", "local", "lru", "size", "dte"]
HEURISTICS = ("dtr", "dtr_eq", "local", "lru", "size", "dte")


def free_range(rt: Runtime, t: int) -> int:
    """Bytes of the contiguous free range evicting t would leave: t's block and the free blocks
    next to it (free neighbours are always merged, so one each side at most)."""
    block = rt.alloc.by_owner[t]
    return block.size + sum(b.size for b in (block.prev, block.next) if b is not None and b.usable)


def score(rt: Runtime, t: int, heuristic: Heuristic) -> float:
    """The heuristic score of evicting t (lowest goes first)."""
    if heuristic == "lru":
        return 1.0 / rt.staleness(t)
    if heuristic == "size":
        return 1.0 / rt.mem[t]
    cost = rt.cost[t] if heuristic == "local" else rt.eviction_cost(t, exact=heuristic != "dtr_eq")
    size = free_range(rt, t) if heuristic == "dte" else rt.mem[t]
    return cost / (size * rt.staleness(t))


def dtr_policy(heuristic: Heuristic = "dtr") -> Callable[[Runtime, int], bool]:
    """Evict the one evictable tensor of lowest score; O(n + edges) per eviction."""

    def policy(rt: Runtime, _: int) -> bool:
        best, best_h = -1, math.inf
        for t in range(rt.n):
            if rt.evictable(t):
                h = score(rt, t, heuristic)
                if h < best_h:
                    best, best_h = t, h
        if best < 0:
            return False
        rt.evict(best)
        return True

    return policy


def solve_dtr(graph: Graph, budget: int | None, *, time_limit: float | None = None, heuristic: Heuristic = "dtr",
              allocator: bool = False, full_arena: bool = False, optimizer: Optimizer = "adam",
              deallocation: Deallocation = "free", budget_hint: bool = True, inplace_updates: bool = True,
              inplace_writes: bool = True, offload: bool = False) -> Schedule:
    """DTR under ``budget`` live bytes, or in a pool of ``budget`` bytes; see the module docstring.

    time_limit: seconds for the whole call, the budget bisection included.
    heuristic: "dtr" (h_DTR, exact e*), "dtr_eq" (union-find e*), "local", "lru", "size" or "dte"
        (h_DTR over the free range evicting a tensor leaves; with ``allocator`` only).
    allocator: run inside an arena pool of ``budget`` bytes (address-level eviction).
    full_arena: with ``allocator``, place params, grads, batch and optimizer state in the pool.
    optimizer: whose state the full arena holds: "adam" (two moments per parameter) or "sgd" (none).
    deallocation: when the program frees a tensor: "free" (rebuildable, outside e*), "evict" (DTR's
        eager eviction) or "banish" (DTR's banishing); see ``eviction.py``.
    budget_hint: on failure, bisect (up to 8 more runs) for a budget that works and name it.
    inplace_updates: with the full arena, whether the optimizer updates parameters and its state in
        place (True) or copy-on-write (False, moving them; see ``allocator.pin_fixed``).
    inplace_writes: an op eager runs in place (``relu_``, ``x += y``) writes its input's bytes when
        nothing else needs the input, as eager does (False: a fresh output, the input freed after it).
    offload: an evicted tensor may be copied to host memory instead of discarded, when the round trip
        costs less than rebuilding it (simulator rule 9; not in DTR's paper; ``eviction.py``).

    O(evictions * (n + edges) + len(ops)) per run."""
    if heuristic not in HEURISTICS:
        raise SolverError(f"Unknown DTR heuristic {heuristic!r}; use one of {', '.join(HEURISTICS)}.")
    if deallocation not in DEALLOCATIONS:
        raise SolverError(f"Unknown deallocation {deallocation!r}; use one of {', '.join(DEALLOCATIONS)}.")
    if allocator and budget is None:
        raise BudgetError("DTR under the allocator model needs a budget: the pool's capacity.")
    if heuristic == "dte" and not allocator:
        raise SolverError("The dte heuristic scores the free range an eviction leaves in the pool: set allocator=True.")
    if full_arena and not allocator:
        raise SolverError("full_arena places the fixed tensors in the allocator's pool: set allocator=True too.")
    deadline = Deadline(time_limit)

    def run_once(b: int | None) -> Schedule:
        pool = arena_pool(graph, b, full_arena, optimizer, inplace_updates) if allocator else None
        rt = Runtime(graph, b, pool, deallocation=deallocation, deadline=deadline, inplace_writes=inplace_writes,
                     offload=offload)
        rt.run(dtr_policy(heuristic))
        return finish(rt, graph, "dtr", {"heuristic": heuristic, "allocator": "arena" if allocator else "none",
                                         "full_arena": full_arena, "inplace_updates": inplace_updates,
                                         "inplace_writes": inplace_writes, "optimizer": optimizer})

    return run_policy(graph, budget, run_once, budget_hint, deadline)
