"""The dynamic-rematerialization runtime that ``dtr`` and ``coop`` share.

A :class:`Runtime` runs the training step's program (every node in listed order, each input freed
after its last program read) and calls an *eviction policy* whenever an output does not fit. The
policies differ (``dtr``: one tensor of least heuristic at a time; ``coop``: one contiguous window of
the pool); what they evict from, how evicted tensors are rebuilt, and how the program's own frees
work is the same, and lives here.

What a run emits (compute/free ops) is a static schedule the simulator validates and the exporter
treats like any other. Inputs of the op being run (and of recomputations under way) are pinned (the
resident ones before any missing one is rebuilt, so rebuilding cannot evict them); a base is evicted
together with its resident views (views free first, as the simulator requires).

**In-place writes** (``inplace_writes``, the default): an op the model runs in place (``Graph.inplace_of``)
takes its input's bytes, and its block in a pool, when nothing else needs the input any more
(:meth:`Runtime.written_in_place`); the input is then freed as the program frees, right after the op
(the simulator's rule 8 reads that pair as the in-place write), and stays rebuildable from its own
inputs, so the output can be evicted and rebuilt like any other: Coop's recomputable in-place.

**Evicted neighbourhoods (DTR's e*).** DTR's heuristic charges a tensor t for what evicting it would
make expensive: its own cost plus the cost of every evicted tensor connected to it through evicted
tensors (its *evicted neighbourhood* e*(t): rebuilding t needs its evicted ancestors, rebuilding an
evicted descendant needs t). Two ways to know the connected groups, both DTR's:

* ``exact``: the connected components of the evicted tensors now, recomputed (O(n + edges)) only
  when the evicted set changes; e*(t) is the union of the components adjacent to t, each counted
  once, so its cost is linear in the size of those components however they branch (a shared
  ancestor of a diamond is counted once, not once per path).
* ``eq``: DTR's equivalence classes, a union-find that merges an evicted tensor with its evicted
  neighbours and never splits: a rebuilt tensor's cost leaves its class, the class stays merged (an
  over-approximation that is O(alpha(n)) per update).

**Deallocation** (the DTR paper's deallocation policies): when the program is done with a tensor,

* ``"free"`` (the default): it is freed, stays rebuildable if an evicted tensor needs it, but is
  not part of anyone's e* (which holds only what the policy evicted). Measured on the zoo GPT at
  80% of the no-remat peak, DTR's overhead is +9.6% with it against +30.1% with eager eviction
  (``bonsai bench dtr-variants``).
* ``"evict"`` (DTR's eager eviction): it is freed but stays rebuildable, as if evicted; its cost
  counts in its neighbours' e*, so e* grows over everything the program has freed.
* ``"banish"`` (DTR's banishing): it is freed for good, and can never be rebuilt. That is only safe
  when no evicted tensor still needs it to be rebuilt, so until then it stays resident (and
  evictable, an ordinary eviction); once banished, its resident users are *locked* (never
  evicted), since nothing could rebuild them; a locked tensor is still freed when the program is
  done with it.

**Eviction to host** (``offload=True``; neither paper does it: DTR and Coop evict only by discarding,
and rebuild by recomputing): an evicted tensor is copied to host memory instead of discarded when
the round trip over the host link (simulator rule 9, the device profile's bandwidth, both ways) costs
less than rebuilding it (its cost and its evicted neighbourhood's), and the pinned host buffers stay
within the profile's host memory. The copy is synchronous, as an eviction is: ``offload t``, ``free t``,
``wait t``, compute stalling until the bytes are free; its rebuild is ``reload t``, the reader stalling
until the copy is back. Both stalls are priced by the simulator in ``compute_cost``, and the runtime's
clock (staleness) advances by them. An offloaded tensor is not evicted in DTR's sense (no part of any
e*: nothing is recomputed to get it back). A host copy the program no longer needs stays until the
end of the step (the schedule format has no op to drop one).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Literal

import numpy as np

from bonsai_core.allocator import Allocator, Optimizer, full_arena, round_size
from bonsai_core.budget import smallest_meeting
from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, FREE, OFFLOAD, RELOAD, WAIT, Schedule, hold_separated_outputs
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.units import format_bytes

Deallocation = Literal["free", "evict", "banish"]
DEALLOCATIONS = ("free", "evict", "banish")
MAX_WORK = 50  # give up (thrashing) after this many times the graph's node count in computes


class TimeLimitReached(SolverError):
    """The run passed its deadline (``time_limit`` of the whole solve call)."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message, timed_out=True)


Policy = Callable[["Runtime", int], bool]


class Runtime:
    """The state of one dynamic-rematerialization run: which tensors are resident, pinned, evicted,
    banished, the memory they hold (plain byte count or address-level pool), and the ops emitted so
    far. Pool blocks owned by ids >= n are the fixed tensors of a full arena: never evictable.

    An eviction policy is a callable ``policy(runtime, v) -> bool`` that evicts something to make
    room for node ``v``'s output and says whether it evicted anything.
    """

    def __init__(self, graph: Graph, budget: int | None, allocator: Allocator | None = None,
                 side_of: Callable[[int], str] | None = None, deallocation: Deallocation = "free",
                 deadline: Deadline | None = None, inplace_writes: bool = True, offload: bool = False) -> None:
        if deallocation not in DEALLOCATIONS:
            raise SolverError(f"Unknown deallocation {deallocation!r}; use one of {', '.join(DEALLOCATIONS)}.")
        self.g = graph
        self.budget = budget
        self.alloc = allocator
        self.side_of = side_of or (lambda v: "left")
        self.deallocation = deallocation
        self.deadline = deadline
        n = graph.n
        self.n = n
        self.deps = graph.dep_lists
        self.users = [graph.users(v).tolist() for v in range(n)]
        self.neighbours = [sorted(set(self.deps[v]) | set(self.users[v])) for v in range(n)]
        self.mem = graph.mem.tolist()
        self.cost = graph.cost.tolist()
        self.alias = graph.alias_of.tolist()
        self.output_of = graph.output_of.tolist()
        # recomputable in-place: the input whose block an op eager runs in place writes (-1: a fresh block)
        self.inplace_of = graph.inplace_of.tolist() if inplace_writes else [-1] * n
        self.holds = ((graph.mem > 0) & ~graph.is_view).tolist()  # takes a block in the allocator
        self.views: list[list[int]] = [[] for _ in range(n)]
        for v, a in enumerate(self.alias):
            if a >= 0:
                self.views[a].append(v)
        self.resident = [False] * n
        self.ever = [False] * n  # computed at least once: a non-resident one is evicted (or banished)
        self.banished = [False] * n  # freed for good by the program: never rebuilt
        self.freed = [False] * n  # freed by the program (deallocation "free"): rebuildable, not in e*
        self.locked = [False] * n  # an input was banished: it could not be rebuilt, so never evict it
        self.pinned = [0] * n
        self.uses_left = [len(u) for u in self.users]  # program reads still to come
        self.last_access = [0.0] * n
        self.clock = 0.0
        self.live = graph.fixed_mem
        # eviction to host (rule 9, offload=True): the default device's link, the host bytes pinned
        from bonsai_core.schedule import host_link

        self.offload = offload
        self.link, self.host_limit = host_link([])
        self.on_host = [False] * n
        self.host = 0
        self.offloads = 0
        self.ops: list[tuple[str, int]] = []
        self.computes = 0
        self.evictions = 0
        self.evicted_version = 0  # bumps whenever the set of evicted tensors changes
        self.free_at_failure: list[float] = []
        self.free_after_eviction: list[float] = []
        self.search_seconds: list[float] = []  # wall time of each eviction search (policy call)
        # the run's event log: per request that found no room, [ops emitted before it, the node whose
        # output needed room, the tensors evicted for it (views included), in eviction order]
        self.log: list[list] = []
        self._evicting: list[int] | None = None
        # DTR's equivalence classes of evicted tensors (union-find, never split)
        self.uf_parent = list(range(n))
        self.uf_cost = [0.0] * n
        self._components: tuple[int, np.ndarray, np.ndarray] | None = None

    # -- state ---------------------------------------------------------------------------------

    def is_evicted(self, t: int) -> bool:
        """Computed before, not resident now, rebuildable, and counted in e*."""
        return (self.ever[t] and not self.resident[t] and not self.banished[t] and not self.freed[t]
                and not self.on_host[t])

    def check_deadline(self) -> None:
        if self.deadline is not None and self.deadline.passed():
            raise TimeLimitReached(f"Dynamic rematerialization of {self.g.name!r} ran past its time limit.")

    # -- memory --------------------------------------------------------------------------------

    def fits(self, v: int) -> bool:
        if self.alloc is not None:
            return not self.holds[v] or self.alloc.find_block(round_size(self.mem[v]), "left") is not None
        return self.budget is None or self.live + self.mem[v] <= self.budget

    def evictable(self, t: int) -> bool:
        """A tensor of the graph, resident, holding memory, not pinned, not locked, no pinned resident
        view (it would go with it), and not a separated output of a resident op (its bytes come only
        from the op's kernel: rebuilt from the op's node it would be the same copy)."""
        return (t < self.n and self.resident[t] and self.holds[t] and not self.pinned[t] and not self.locked[t]
                and not (self.output_of[t] >= 0 and self.resident[self.output_of[t]])
                and not any(self.resident[u] and not self._view_evictable(u) for u in self.views[t]))

    def _view_evictable(self, u: int) -> bool:
        return not self.pinned[u] and not any(self.resident[w] and not self._view_evictable(w) for w in self.views[u])

    def evict(self, t: int) -> None:
        """Evict t (rebuildable, or copied to host: :meth:`offloads`) and, first, its resident views
        (recursively)."""
        for u in self.views[t]:
            if self.resident[u]:
                self.evict(u)
        self.evictions += 1
        if self._evicting is not None:
            self._evicting.append(t)
        if self.offloads_to_host(t):
            self._to_host(t)
            return
        self._free(t)
        self.evicted_version += 1
        self._uf_add(t)

    def copy_seconds(self, t: int) -> float:
        return self.mem[t] / self.link

    def eviction_cost(self, t: int, exact: bool = True) -> float:
        """What evicting t costs later: rebuilding it (:meth:`estar_cost`), or with ``offload`` the
        round trip over the host link when that is cheaper and the host has room."""
        rebuild = self.estar_cost(t, exact)
        if self._host_fits(t):
            return min(rebuild, 2 * self.copy_seconds(t))
        return rebuild

    def offloads_to_host(self, t: int) -> bool:
        """Whether evicting t copies it to host memory rather than discarding it."""
        return self._host_fits(t) and 2 * self.copy_seconds(t) < self.estar_cost(t)

    def _host_fits(self, t: int) -> bool:
        return (self.offload and self.alias[t] < 0 and not self.on_host[t]
                and (self.host_limit is None or self.host + self.mem[t] <= self.host_limit))

    def _to_host(self, t: int) -> None:
        """Rule 9, synchronously: the copy, the free, and compute waiting until the bytes are free."""
        self.ops.append((OFFLOAD, t))
        self._free(t)
        self.ops.append((WAIT, t))
        self.on_host[t] = True
        self.host += self.mem[t]
        self.offloads += 1
        self.clock += self.copy_seconds(t)

    def _reload(self, v: int, policy: Policy) -> None:
        """Bring v back from host memory: room first, then the copy, the reader stalling until it ends."""
        self.make_room(v, policy)
        if self.alloc is not None and self.holds[v]:
            if self.alloc.malloc(v, self.mem[v], self.side_of(v)) is None:
                self.alloc.malloc(v, self.mem[v], "left")
        self.ops.append((RELOAD, v))
        self.resident[v], self.on_host[v] = True, False
        self.host -= self.mem[v]
        self.live += self.mem[v]
        self.clock += self.copy_seconds(v)
        self.last_access[v] = self.clock

    def _overwritten(self, u: int) -> None:
        """u's block now holds an output written in place: u is gone, freed as the program frees (the
        ``free`` op right after the compute, which rule 8 reads as handing the bytes over), and
        rebuildable from its inputs."""
        self.resident[u] = False
        self.live -= self.mem[u]
        self.ops.append((FREE, u))
        if self.deallocation == "evict":
            self.evicted_version += 1
            self._uf_add(u)
        else:
            self.freed[u] = True

    def _free(self, t: int) -> None:
        self.resident[t] = False
        self.live -= self.mem[t]
        if self.alloc is not None and self.holds[t]:
            self.alloc.free(t)
        self.ops.append((FREE, t))

    # -- evicted neighbourhoods (e*) -----------------------------------------------------------

    def _uf_find(self, t: int) -> int:
        root = t
        while self.uf_parent[root] != root:
            root = self.uf_parent[root]
        while self.uf_parent[t] != root:  # path compression
            self.uf_parent[t], t = root, self.uf_parent[t]
        return root

    def _uf_add(self, t: int) -> None:
        self.uf_parent[t], self.uf_cost[t] = t, self.cost[t]
        for u in self.neighbours[t]:
            if self.is_evicted(u):
                a, b = self._uf_find(t), self._uf_find(u)
                if a != b:
                    self.uf_parent[b] = a
                    self.uf_cost[a] += self.uf_cost[b]

    def _uf_remove_cost(self, t: int) -> None:
        """t was rebuilt: its cost leaves its class; the class stays merged (DTR's approximation)."""
        root = self._uf_find(t)
        self.uf_cost[root] = max(0.0, self.uf_cost[root] - self.cost[t])

    def evicted_components(self) -> tuple[np.ndarray, np.ndarray]:
        """Connected components of the evicted tensors now (edges between evicted deps/users):
        (component label per node, -1 if not evicted; total cost per component). Recomputed only
        when the evicted set has changed; O(n + edges)."""
        if self._components is None or self._components[0] != self.evicted_version:
            from scipy.sparse import csr_matrix
            from scipy.sparse.csgraph import connected_components

            g = self.g
            evicted = np.fromiter((self.is_evicted(t) for t in range(self.n)), dtype=bool, count=self.n)
            src = np.repeat(np.arange(g.n), np.diff(g.dep_ptr))
            keep = evicted[src] & evicted[g.dep_idx]
            adj = csr_matrix((np.ones(int(keep.sum())), (src[keep], g.dep_idx[keep])), shape=(g.n, g.n))
            _, labels = connected_components(adj, directed=False)
            labels = np.where(evicted, labels, -1)
            costs = np.bincount(labels[evicted], weights=g.cost[evicted], minlength=g.n)
            self._components = (self.evicted_version, labels, costs)
        return self._components[1], self._components[2]

    def estar_cost(self, t: int, exact: bool = True) -> float:
        """c(t) plus the cost of t's evicted neighbourhood e*(t): every evicted component adjacent to
        t, each once. ``exact``: components of the evicted set now; otherwise DTR's union-find
        equivalence classes. O(degree of t) after the components are known."""
        if exact:
            labels, costs = self.evicted_components()
            seen = {int(labels[u]) for u in self.neighbours[t] if labels[u] >= 0}
            return self.cost[t] + sum(float(costs[c]) for c in seen)
        roots = {self._uf_find(u) for u in self.neighbours[t] if self.is_evicted(u)}
        return self.cost[t] + sum(self.uf_cost[r] for r in roots)

    def staleness(self, t: int) -> float:
        return max(self.clock - self.last_access[t], 1e-12)

    # -- execution -----------------------------------------------------------------------------

    def free_share(self) -> float:
        """The pool's free share (an empty pool has nothing free)."""
        reserved = self.alloc.reserved
        return 1.0 - self.alloc.allocated / reserved if reserved else 0.0

    def make_room(self, v: int, policy: Policy) -> None:
        failed = self.alloc is not None and not self.fits(v)
        if failed:
            # the pool's free share when a request finds no block; the project's fragmentation is
            # allocator.fragmentation_at_peak alone
            self.free_at_failure.append(self.free_share())
        if not self.fits(v):
            self._evicting = []
            self.log.append([len(self.ops), v, self._evicting])
        while not self.fits(v):
            self.check_deadline()
            start = time.perf_counter()
            evicted = policy(self, v)
            self.search_seconds.append(time.perf_counter() - start)
            if not evicted:
                pinned = sum(self.mem[t] for t in range(self.n)
                             if self.resident[t] and (self.pinned[t] or self.locked[t]))
                raise BudgetError(
                    f"Dynamic rematerialization of {self.g.name!r} cannot run node {v} ({self.g.names[v]!r}, "
                    f"{format_bytes(self.mem[v])}) within {format_bytes(self.budget)}: nothing left to evict "
                    f"({format_bytes(pinned)} pinned by the op's inputs or locked by banishing, "
                    f"{format_bytes(self.g.fixed_mem)} fixed"
                    + (", and no contiguous free range large enough" if self.alloc is not None else "")
                    + "). Raise the budget.")
        if failed:
            # and once the eviction search has made room, before the request takes its block: what OneFlow
            # records as its memory fragmentation rate (ONEFLOW_REMAT_RECORD_MEM_FRAG_RATE, after
            # EvictAndFindPieceOnce / EvictAndFindPieceLoop), the rate Coop's paper reports
            self.free_after_eviction.append(self.free_share())

    def written_in_place(self, v: int) -> int:
        """The input whose block v's output takes (simulator rule 8), or -1: v is an op eager runs in place
        (``Graph.inplace_of``), and nothing but this compute still needs that input: the program's reads
        of it are done (v is its last reader), no other rebuild needs it, no view of it is resident, and
        only this compute pins it. Then v is written where u was (Coop's recomputable in-place: the block
        keeps its address, and u stays rebuildable from its own inputs); else v gets a fresh block."""
        u = self.inplace_of[v]
        if u < 0 or not self.resident[u] or self.pinned[u] != 1:
            return -1
        if self.uses_left[u] != (0 if self.ever[v] else 1) or any(self.resident[w] for w in self.views[u]):
            return -1
        if any(w != v and (self.is_evicted(w) or (self.freed[w] and not self.resident[w] and self.uses_left[w] > 0))
               for w in self.users[u]):
            return -1
        return u

    def compute(self, v: int, policy: Policy) -> None:
        """Compute v (its deps resident and pinned by the caller), making room first, or in place."""
        if self.banished[v]:  # banishing keeps this from happening; a bug if it does
            raise SolverError(f"Internal error: banished node {v} ({self.g.names[v]!r}) was to be rebuilt.")
        into = self.written_in_place(v)
        if into >= 0:
            if self.alloc is not None:
                self.alloc.hand_over(into, v)
        else:
            self.make_room(v, policy)
            if self.alloc is not None and self.holds[v]:
                if self.alloc.malloc(v, self.mem[v], self.side_of(v)) is None:  # fits() checked a left fit
                    self.alloc.malloc(v, self.mem[v], "left")
        if self.ever[v]:
            self.evicted_version += 1
            self._uf_remove_cost(v)
        self.resident[v] = self.ever[v] = True
        self.freed[v] = False
        self.live += self.mem[v]
        self.ops.append((COMPUTE, v))
        if into >= 0:
            self._overwritten(into)
        self.computes += 1
        self.clock += max(self.cost[v], 1e-12)
        self.last_access[v] = self.clock
        if self.computes > MAX_WORK * self.n:
            raise BudgetError(f"Dynamic rematerialization of {self.g.name!r} thrashes under "
                              f"{format_bytes(self.budget)} (over {MAX_WORK}x the node count in computes): "
                              "raise the budget.")

    def materialize(self, v: int, policy: Policy) -> None:
        """Make v resident, recomputing its evicted inputs first (recursively)."""
        if self.resident[v]:
            return
        if self.on_host[v]:
            self._reload(v, policy)
            return
        self.acquire(self.deps[v], policy)
        self.compute(v, policy)
        for d in self.deps[v]:
            self.pinned[d] -= 1
            self.last_access[d] = self.clock

    def acquire(self, deps: list[int], policy: Policy) -> None:
        """Pin every input: the resident ones first, so that recomputing a missing one cannot evict
        them, then each missing one as soon as it is rebuilt."""
        missing = [d for d in deps if not self.resident[d]]
        for d in deps:
            if self.resident[d]:
                self.pinned[d] += 1
        for d in missing:
            self.materialize(d, policy)
            self.pinned[d] += 1

    def needed_for_rebuild(self, t: int) -> bool:
        """Some evicted user of t exists (or a freed one the program still reads): rebuilding it
        may need t."""
        return any(self.is_evicted(u) or (self.freed[u] and not self.resident[u] and self.uses_left[u] > 0)
                   for u in self.users[t])

    def release(self, t: int) -> None:
        """The program no longer reads t: deallocate it (see the module docstring) once none of its
        views is resident and nothing evicted needs it; then its base may go too."""
        while t >= 0 and self.uses_left[t] == 0 and not self.pinned[t] and not self.banished[t]:
            if any(self.resident[u] for u in self.views[t]) or self.needed_for_rebuild(t):
                return  # stays (resident and evictable, or evicted and rebuildable)
            if self.deallocation == "free":
                if not self.resident[t]:
                    return
                self._free(t)
                self.freed[t] = True
            elif self.deallocation == "evict":
                if not self.resident[t]:
                    return
                self._free(t)
                self.evicted_version += 1
                self._uf_add(t)
            else:
                if self.resident[t]:
                    self._free(t)
                else:
                    self.evicted_version += 1  # leaves the evicted set for good
                self.banished[t] = True
                for u in self.users[t]:  # they can no longer be rebuilt
                    if self.resident[u]:
                        self.locked[u] = True
            t = self.alias[t]

    def run(self, policy: Policy) -> None:
        """The program: every node in listed order, each freed after its last program read."""
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 4 * self.n + 1000))
        try:
            for v in range(self.n):
                self.check_deadline()
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


def finish(rt: Runtime, graph: Graph, method: str, extra_stats: dict) -> Schedule:
    """The run's ops as a Schedule, with its counters in ``stats``."""
    stats = {"status": "heuristic", "evictions": rt.evictions, "deallocation": rt.deallocation,
             **({"offload": True, "offloads": rt.offloads} if rt.offload else {}),
             "eviction_searches": len(rt.search_seconds),
             "search_seconds_median": float(np.median(rt.search_seconds)) if rt.search_seconds else 0.0,
             **extra_stats}
    if rt.alloc is not None:
        stats["pool_high_water"] = rt.alloc.high_water + (0 if rt.alloc.pinned_bytes else graph.fixed_mem)
        stats["alloc_failures"] = len(rt.free_at_failure)
        stats["free_at_failure"] = float(np.mean(rt.free_at_failure)) if rt.free_at_failure else 0.0
        stats["free_after_eviction"] = float(np.mean(rt.free_after_eviction)) if rt.free_after_eviction else 0.0
        # fragmentation is the allocator model's alone: solvers.pool.pool_replay(graph, schedule) replays
        # this run's pool block for block (bonsai simulate --allocator --arena)
    # A separated output released while its op stays resident and rebuilt from it later (an evicted
    # reader's rebuild) is the same copy: held instead (rare: evictable() never evicts one). The pool
    # statistics above are the run's as decided; solve() simulates the held ops for the peak.
    ops = hold_separated_outputs(graph, rt.ops)
    if len(ops) != len(rt.ops):
        stats["outputs_held"] = (len(rt.ops) - len(ops)) // 2
    return Schedule(graph=graph.name, method=method, ops=ops, graph_hash=graph.hash, stats=stats,
                    extra={"evictions": rt.log})


def arena_pool(graph: Graph, budget: int, full: bool, optimizer: Optimizer, inplace_updates: bool = True) -> Allocator:
    """The arena pool of ``budget`` bytes a pool run works in: with ``full``, the step's fixed
    tensors and the optimizer state placed in it (and the state's bytes added to it), written by the
    optimizer in place or copy-on-write (``inplace_updates``), else ``budget - fixed_mem`` bytes of
    activations only."""
    if full:
        return full_arena(graph, budget, "arena", optimizer, updates="inplace" if inplace_updates else "copy")[0]
    return Allocator(budget - graph.fixed_mem, policy="arena")


def run_policy(graph: Graph, budget: int | None, run_once: Callable[[int | None], Schedule], budget_hint: bool,
               deadline: Deadline | None = None) -> Schedule:
    """Run an eviction method once under ``budget``; with ``budget_hint`` (and a budget), a failure names
    a budget at which it does run (:func:`with_budget_hint`)."""
    if budget is not None and budget_hint:
        return with_budget_hint(graph, budget, run_once, deadline=deadline)
    try:
        return run_once(budget)
    except TimeLimitReached as e:
        raise SolverError(f"{e} No schedule was found within it: raise the time limit or the budget.",
                          timed_out=True) from None


def with_budget_hint(graph: Graph, budget: int, run_once: Callable[[int], Schedule], steps: int = 8,
                     deadline: Deadline | None = None) -> Schedule:
    """Run under ``budget``; if that fails, bisect (at most ``steps`` runs, between the budget and
    twice the no-remat peak, stopping at ``deadline``) for a budget at which the method does run,
    and name it in the BudgetError. A heuristic's success is not monotone in the budget, so the named
    budget is one that works, not a proven minimum. Past the deadline, the first run raises
    :class:`TimeLimitReached`; the bisection names the best budget found by then, if any."""
    from bonsai_core.schedule import no_remat_peak

    try:
        return run_once(budget)
    except TimeLimitReached as e:
        raise SolverError(f"{e} No schedule was found within it under {format_bytes(budget)}: raise the time "
                          "limit or the budget.", timed_out=True) from None
    except BudgetError as first:
        lo, hi = budget, 2 * no_remat_peak(graph)

        def works(b: int) -> bool:
            try:
                run_once(b)
                return True
            except BudgetError:
                return False

        try:
            if hi <= lo or not works(hi):
                raise first from None
        except TimeLimitReached:
            raise first from None
        works_at = smallest_meeting(works, lo, hi, steps, stop=TimeLimitReached)
        raise BudgetError(f"{first} It does run under {format_bytes(works_at)} ({works_at} bytes; found by "
                          "bisection, not a proven minimum).") from None
