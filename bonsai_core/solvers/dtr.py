"""The ``dtr`` method: Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021), simulated.

DTR runs the training step as written (the graph's listed order, each tensor freed after its last
use) and only reacts to memory pressure: when a new output does not fit, it evicts the resident
tensor of lowest heuristic

    h(t) = cost(t) / (memory(t) * staleness(t))

(cheap to recompute, large, long unused), and when an evicted tensor is read again it is recomputed,
recursively through whatever of its own inputs was evicted too. The *evicted-neighbourhood* variant
(DTR's h_DTR, the default) replaces cost(t) by what evicting t really puts at stake: its rebuild
cost (its own cost plus rebuilding its non-resident inputs, recursively) and the cost of each
region of evicted tensors that reads it (they would need t rebuilt). As in DTR's "equivalence
class" approximation, the regions are the connected components of the evicted tensors.

The budget limits live bytes (``fixed_mem`` included, as the simulator counts them). With
``allocator=True`` the budget is instead the capacity of an address-level pool
(:class:`bonsai_core.allocator.Allocator`, arena policy, like Coop's setting) and DTR evicts by the
same heuristic, one tensor at a time, until the request fits in one free block: the baseline that
Coop's contiguous eviction is measured against.

What DTR executed is emitted as compute/free ops: a static schedule the simulator validates and the
exporter treats like any other. Inputs of the op being run (and of recomputations under way) are
pinned (the resident ones before any missing one is rebuilt, so rebuilding cannot evict them); a
base is evicted together with its resident views (views free first, as the simulator requires).
Output-less tensors (the loss, gradients) are freed right after they are computed. A tensor the
program has freed for good stays rebuildable, at a cost the heuristic counts.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Literal

import numpy as np

from bonsai_core.allocator import Allocator, round_size
from bonsai_core.budget import format_bytes
from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, FREE, Schedule

Heuristic = Literal["neighbourhood", "local"]
MAX_WORK = 50  # give up (thrashing) after this many times the graph's node count in computes


class Runtime:
    """The state of one dynamic-rematerialization run: which tensors are resident, pinned, evicted,
    the memory they hold (plain byte count or address-level pool), and the ops emitted so far.

    An eviction policy is a callable ``policy(runtime, nbytes) -> bool`` that evicts something to
    make room for a request of ``nbytes`` and says whether it evicted anything.
    """

    def __init__(self, graph: Graph, budget: int | None, allocator: Allocator | None = None,
                 side_of: Callable[[int], str] | None = None) -> None:
        self.g = graph
        self.budget = budget
        self.alloc = allocator
        self.side_of = side_of or (lambda v: "left")
        n = graph.n
        self.deps = [graph.deps(v).tolist() for v in range(n)]
        self.users = [graph.users(v).tolist() for v in range(n)]
        self.mem = graph.mem.tolist()
        self.cost = graph.cost.tolist()
        self.alias = graph.alias_of.tolist()
        self.holds = ((graph.mem > 0) & ~graph.is_view).tolist()  # takes a block in the allocator
        self.views: list[list[int]] = [[] for _ in range(n)]
        for v, a in enumerate(self.alias):
            if a >= 0:
                self.views[a].append(v)
        self.resident = [False] * n
        self.ever = [False] * n  # computed at least once: a non-resident one is evicted (or freed)
        self.pinned = [0] * n
        self.uses_left = [len(u) for u in self.users]  # program reads still to come
        self.last_access = [0.0] * n
        self.clock = 0.0
        self.live = graph.fixed_mem
        self.ops: list[tuple[str, int]] = []
        self.computes = 0
        self.evictions = 0
        self.evicted_version = 0  # bumps whenever the set of evicted tensors changes
        self.free_at_failure: list[float] = []
        # freed by the program after its last read (DTR's "banished"); unlike DTR's, it can still be
        # rebuilt if an evicted tensor needs it, at a cost the heuristic counts (rebuild_cost)
        self.banished = [False] * n

    # -- memory --------------------------------------------------------------------------------

    def fits(self, v: int) -> bool:
        if self.alloc is not None:
            return not self.holds[v] or self.alloc.find_block(round_size(self.mem[v]), "left") is not None
        return self.budget is None or self.live + self.mem[v] <= self.budget

    def evictable(self, t: int) -> bool:
        """Resident, holding memory, not pinned, and no pinned resident view (it would go with it)."""
        return (self.resident[t] and self.holds[t] and not self.pinned[t]
                and not any(self.resident[u] and (self.pinned[u] or not self.evictable_view(u)) for u in self.views[t]))

    def evictable_view(self, u: int) -> bool:
        return not any(self.resident[w] and (self.pinned[w] or not self.evictable_view(w)) for w in self.views[u])

    def evict(self, t: int) -> None:
        """Free t and, first, its resident views (recursively)."""
        for u in self.views[t]:
            if self.resident[u]:
                self.evict(u)
        self._free(t)
        self.evictions += 1
        self.evicted_version += 1

    def _free(self, t: int) -> None:
        self.resident[t] = False
        self.live -= self.mem[t]
        if self.alloc is not None and self.holds[t]:
            self.alloc.free(t)
        self.ops.append((FREE, t))

    # -- execution -----------------------------------------------------------------------------

    def make_room(self, v: int, policy: Callable[["Runtime", int], bool]) -> None:
        if self.alloc is not None and not self.fits(v):
            # OneFlow's fragmentation rate: the pool's free share when a request finds no block
            self.free_at_failure.append(1.0 - self.alloc.allocated / self.alloc.reserved)
        while not self.fits(v):
            if not policy(self, v):
                pinned = sum(self.mem[t] for t in range(self.g.n) if self.resident[t] and self.pinned[t])
                raise BudgetError(
                    f"Dynamic rematerialization of {self.g.name!r} cannot run node {v} ({self.g.names[v]!r}, "
                    f"{format_bytes(self.mem[v])}) within {format_bytes(self.budget)}: nothing left to evict "
                    f"({format_bytes(pinned)} pinned by the op's inputs, {format_bytes(self.g.fixed_mem)} fixed"
                    + (", and no contiguous free range large enough" if self.alloc is not None else "")
                    + "). Raise the budget.")

    def compute(self, v: int, policy: Callable[["Runtime", int], bool]) -> None:
        """Compute v (its deps resident and pinned by the caller), making room first."""
        self.make_room(v, policy)
        if self.alloc is not None and self.holds[v]:
            if self.alloc.malloc(v, self.mem[v], self.side_of(v)) is None:  # fits() checked a left fit
                self.alloc.malloc(v, self.mem[v], "left")
        if self.ever[v]:
            self.evicted_version += 1
        self.resident[v] = self.ever[v] = True
        self.banished[v] = False
        self.live += self.mem[v]
        self.ops.append((COMPUTE, v))
        self.computes += 1
        self.clock += max(self.cost[v], 1e-12)
        self.last_access[v] = self.clock
        if self.computes > MAX_WORK * self.g.n:
            raise BudgetError(f"Dynamic rematerialization of {self.g.name!r} thrashes under "
                              f"{format_bytes(self.budget)} (over {MAX_WORK}x the node count in computes): "
                              "raise the budget.")

    def materialize(self, v: int, policy: Callable[["Runtime", int], bool]) -> None:
        """Make v resident, recomputing its evicted inputs first (recursively)."""
        if self.resident[v]:
            return
        self.acquire(self.deps[v], policy)
        self.compute(v, policy)
        for d in self.deps[v]:
            self.pinned[d] -= 1
            self.last_access[d] = self.clock

    def acquire(self, deps: list[int], policy: Callable[["Runtime", int], bool]) -> None:
        """Pin every input: the resident ones first, so that recomputing a missing one cannot evict
        them, then each missing one as soon as it is rebuilt."""
        missing = [d for d in deps if not self.resident[d]]
        for d in deps:
            if self.resident[d]:
                self.pinned[d] += 1
        for d in missing:
            self.materialize(d, policy)
            self.pinned[d] += 1

    def release(self, t: int) -> None:
        """Free t for good (banish it) if the program no longer reads it, none of its views is
        resident and no evicted tensor that the program still reads needs it to be rebuilt; then
        its base may go too. A tensor kept by the last rule stays evictable."""
        while (t >= 0 and self.resident[t] and self.uses_left[t] == 0 and not self.pinned[t]
               and not any(self.resident[u] for u in self.views[t])
               and not any(self.ever[u] and not self.resident[u] and self.uses_left[u] > 0 for u in self.users[t])):
            self._free(t)
            self.banished[t] = True
            t = self.alias[t]

    def run(self, policy: Callable[["Runtime", int], bool]) -> None:
        """The program: every node in listed order, each freed after its last program read."""
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 4 * self.g.n + 1000))
        try:
            for v in range(self.g.n):
                self.acquire(self.deps[v], policy)
                self.compute(v, policy)
                for d in self.deps[v]:
                    self.pinned[d] -= 1
                    self.last_access[d] = self.clock
                    self.uses_left[d] -= 1
                for d in self.deps[v]:
                    self.release(d)
                self.release(v)  # an output: its buffer is part of fixed_mem
        finally:
            sys.setrecursionlimit(old)

    # -- heuristics ----------------------------------------------------------------------------

    def evicted_regions(self) -> tuple[np.ndarray, np.ndarray]:
        """Connected components of the tensors evicted by the policy and not yet rebuilt (edges
        between evicted deps/users): (component label per node, -1 if not evicted; total cost per
        component). DTR's equivalence-class approximation of evicted regions."""
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import connected_components

        g = self.g
        evicted = np.array([e and not r and not b for e, r, b in zip(self.ever, self.resident, self.banished)],
                           dtype=bool)
        src = np.repeat(np.arange(g.n), np.diff(g.dep_ptr))
        keep = evicted[src] & evicted[g.dep_idx]
        adj = csr_matrix((np.ones(int(keep.sum())), (src[keep], g.dep_idx[keep])), shape=(g.n, g.n))
        _, labels = connected_components(adj, directed=False)
        labels = np.where(evicted, labels, -1)
        costs = np.bincount(labels[evicted], weights=g.cost[evicted], minlength=g.n)
        return labels, costs

    def rebuild_cost(self, t: int, memo: dict[int, float]) -> float:
        """cost(t) plus what rebuilding its non-resident inputs costs, recursively (DTR's evicted
        ancestor region, with banished ancestors included since this runtime can rebuild them).
        Shared ancestors are counted once per path: an upper bound, O(n + edges) per memo."""
        if t not in memo:
            memo[t] = self.cost[t] + sum(self.rebuild_cost(d, memo) for d in self.deps[t] if not self.resident[d])
        return memo[t]

    def projected_cost(self, t: int, labels: np.ndarray, region_cost: np.ndarray, memo: dict[int, float]) -> float:
        """h_DTR's numerator: t's rebuild cost plus the cost of each distinct region of evicted
        tensors that reads t (they would need t rebuilt too)."""
        seen = {int(labels[u]) for u in self.users[t] if labels[u] >= 0}
        return self.rebuild_cost(t, memo) + sum(float(region_cost[c]) for c in seen)

    def staleness(self, t: int) -> float:
        return max(self.clock - self.last_access[t], 1e-12)


def dtr_policy(heuristic: Heuristic = "neighbourhood") -> Callable[[Runtime, int], bool]:
    """Evict the one evictable tensor of lowest h; O(n + edges) per eviction."""
    cache: dict[str, object] = {"version": -1}

    def policy(rt: Runtime, _: int) -> bool:
        if heuristic == "neighbourhood" and cache["version"] != rt.evicted_version:
            cache["regions"], cache["version"] = rt.evicted_regions(), rt.evicted_version
        best, best_h = -1, math.inf
        memo: dict[int, float] = {}
        for t in range(rt.g.n):
            if not rt.evictable(t):
                continue
            c = rt.projected_cost(t, *cache["regions"], memo) if heuristic == "neighbourhood" else rt.cost[t]
            h = c / (rt.mem[t] * rt.staleness(t))
            if h < best_h:
                best, best_h = t, h
        if best < 0:
            return False
        rt.evict(best)
        return True

    return policy


def finish(rt: Runtime, graph: Graph, method: str, extra_stats: dict) -> Schedule:
    stats = {"status": "heuristic", "evictions": rt.evictions, **extra_stats}
    if rt.alloc is not None:
        stats["pool_high_water"] = rt.alloc.high_water + graph.fixed_mem
        stats["alloc_failures"] = len(rt.free_at_failure)
        stats["free_at_failure"] = float(np.mean(rt.free_at_failure)) if rt.free_at_failure else 0.0
    return Schedule(graph=graph.name, method=method, ops=rt.ops, graph_hash=graph.hash, stats=stats)


def with_budget_hint(graph: Graph, budget: int, run_once: Callable[[int], Schedule], steps: int = 8) -> Schedule:
    """Run under ``budget``; if that fails, bisect (``steps`` runs, between the budget and twice the
    no-remat peak) for a budget at which the method does run, and name it in the BudgetError.
    A heuristic's success is not monotone in the budget, so the named budget is one that works,
    not a proven minimum."""
    from bonsai_core.schedule import no_remat_peak

    try:
        return run_once(budget)
    except BudgetError as first:
        lo, hi = budget, 2 * no_remat_peak(graph)

        def works(b: int) -> bool:
            try:
                run_once(b)
                return True
            except BudgetError:
                return False

        if hi <= lo or not works(hi):
            raise
        for _ in range(steps):
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if works(mid) else (mid, hi)
        raise BudgetError(f"{first} It does run under {format_bytes(hi)} ({hi} bytes; found by bisection, "
                          "not a proven minimum).") from None


def solve_dtr(graph: Graph, budget: int | None, *, time_limit: float | None = None,
              heuristic: Heuristic = "neighbourhood", allocator: bool = False, budget_hint: bool = True,
              **_: object) -> Schedule:
    """DTR under ``budget`` live bytes, or (``allocator=True``) in a pool of ``budget`` bytes.
    On failure, ``budget_hint`` bisects for a budget that works (8 more runs) to name it.
    O(evictions * (n + edges) + len(ops)) per run."""
    if heuristic not in ("neighbourhood", "local"):
        raise SolverError(f"Unknown DTR heuristic {heuristic!r}; use 'neighbourhood' or 'local'.")
    if allocator and budget is None:
        raise BudgetError("DTR under the allocator model needs a budget: the pool's capacity.")

    def run_once(b: int | None) -> Schedule:
        rt = Runtime(graph, b, Allocator(b - graph.fixed_mem, policy="arena") if allocator else None)
        rt.run(dtr_policy(heuristic))
        return finish(rt, graph, "dtr", {"heuristic": heuristic, "allocator": "arena" if allocator else "none"})

    if budget is None or not budget_hint:
        return run_once(budget)
    return with_budget_hint(graph, budget, run_once)
