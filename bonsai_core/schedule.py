"""Schedules (ordered compute/free ops), their bonsai-schedule JSON format, and the simulator.

The simulator is the single judge of every method. Its rules (DESIGN.md):

1. ``compute v`` needs every dep of v resident (a view's base is one of its deps); computing a
   resident node is an error. Afterwards v is resident.
2. ``free v`` needs v resident and no resident view of v.
3. Memory at a compute step is ``fixed_mem`` + the bytes of all resident nodes, the new one included;
   ``peak`` is the largest such value.
4. Every node is computed at least once.
5. A separated output (``Graph.output_of``) freed earlier is computed again only after its op's node
   is: its bytes come from the op's kernel, not from the ``getitem`` (:func:`hold_separated_outputs`).
6. ``compute_cost`` is the sum of the computed nodes' costs; ``overhead`` is
   ``compute_cost / graph.total_cost - 1``.
7. (FSDP2 working memory: :mod:`bonsai_core.fsdp`.)
8. A node v with ``inplace_of`` u is written into u's bytes when the schedule frees u right after
   computing v (before the next compute): that step counts u's bytes once (:func:`inplace_writes`).
9. ``offload v`` copies a resident v to a pinned host buffer on the device-to-host stream, ``reload v``
   (v freed since) copies it back on the host-to-device stream, ``wait v`` makes compute wait for v's
   offload copy; a ``free v`` releases v's device bytes only once its copy has ended, a reload takes
   them back when issued, and a reader of v waits for the reload: the waits are stalls added to
   ``compute_cost`` (:func:`copy_timing`); the pinned bytes stay within ``host_budget``.

What rule 3 counts at each op, the live set, comes back as :class:`Residency`: the interval over which
each copy of a node holds its device bytes (from its compute or reload to its free, cut short by an
in-place write of rule 8, carried on by an offload copy of rule 9).
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import json

import numpy as np

from bonsai_core.errors import GraphError, ScheduleError
from bonsai_core.graph import Graph, check_header, read_json_file

FORMAT = "bonsai-schedule"
VERSION = 1
COMPUTE, FREE = "compute", "free"
OFFLOAD, RELOAD, WAIT = "offload", "reload", "wait"  # rule 9
KINDS = (COMPUTE, FREE, OFFLOAD, RELOAD, WAIT)


@dataclass
class Schedule:
    """An ordered list of ``("compute", v)`` / ``("free", v)`` ops for one graph.

    ``stats`` holds what the method reports (peak, compute_cost, overhead, solve_seconds, variables,
    status, gap, ...); ``extra`` holds method-specific structure (for example the checkpoint regions
    of a segment schedule), kept in the JSON for the explorer and the exporter. ``device`` (a
    ``costmodel.PROFILES`` name, default the trace's default) and ``host_budget`` (bytes of pinned host
    memory, default the device's) are what rule 9 times and limits offloads by.
    """

    graph: str
    method: str
    ops: list[tuple[str, int]]
    budget: int | None = None
    graph_hash: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    host_budget: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"format": FORMAT, "version": VERSION, "graph": self.graph, "graph_hash": self.graph_hash,
             "method": self.method, "budget": self.budget, "ops": [[k, int(v)] for k, v in self.ops],
             "stats": self.stats}
        if self.extra:
            d["extra"] = self.extra
        if self.device is not None:
            d["device"] = self.device
        if self.host_budget is not None:
            d["host_budget"] = self.host_budget
        return d

    @classmethod
    def from_dict(cls, data: Any) -> "Schedule":
        check_header(data, ScheduleError, FORMAT, VERSION, fields="'format', 'version', 'graph' and 'ops'",
                     other="a graph file? pass it as the graph instead")
        raw_ops = data.get("ops")
        if not isinstance(raw_ops, list):
            raise ScheduleError("'ops' must be a list of [kind, node id] pairs, kind one of "
                                + ", ".join(f'"{k}"' for k in KINDS) + ".")
        ops = []
        for i, op in enumerate(raw_ops):
            if (not isinstance(op, list) or len(op) != 2 or op[0] not in KINDS
                    or isinstance(op[1], bool) or not isinstance(op[1], int)):
                raise ScheduleError(f"Op {i} is {op!r}; each op is [kind, node id], kind one of "
                                    + ", ".join(f'"{k}"' for k in KINDS) + ".")
            ops.append((op[0], op[1]))
        budget, host_budget = data.get("budget"), data.get("host_budget")
        for name, value in (("budget", budget), ("host_budget", host_budget)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or not 0 <= value <= 2**62):
                raise ScheduleError(f"'{name}' is {value!r}; it must be a byte count or null.")
        device = data.get("device")
        if device is not None:
            from bonsai_core.costmodel import PROFILES

            if device not in PROFILES:
                raise ScheduleError(f"'device' is {device!r}; use one of {', '.join(PROFILES)} or leave it out.")
        stats, extra = data.get("stats", {}), data.get("extra", {})
        if not isinstance(stats, dict) or not isinstance(extra, dict):
            raise ScheduleError("'stats' and 'extra' must be JSON objects.")
        gh = data.get("graph_hash")
        return cls(graph=str(data.get("graph", "")), method=str(data.get("method", "")), ops=ops,
                   budget=None if budget is None else int(budget), graph_hash=None if gh is None else str(gh),
                   stats=stats, extra=extra, device=device,
                   host_budget=None if host_budget is None else int(host_budget))


@dataclass(frozen=True)
class RecomputeEvent:
    """One rebuild in a schedule: a run of consecutive ops that compute nodes again (frees between them
    allowed), from position ``start`` to ``end`` (the last recompute); ``before``: the node whose first
    compute ends the run, the op that needs what it rebuilt (-1: the run ends the schedule).
    ``bytes``: the recomputed tensors still resident when the run ends (what it brings back);
    ``cost``: the seconds the run's recomputes take."""

    start: int
    end: int
    nodes: tuple[int, ...]
    before: int
    bytes: int
    cost: float


def held_bytes(start: np.ndarray, end: np.ndarray, size: np.ndarray, n_ops: int) -> np.ndarray:
    """int64[n_ops]: the bytes of the intervals held after each op, interval k held after ops
    ``start[k]`` to ``end[k] - 1`` (a difference array). O(n_ops + intervals)."""
    delta = np.zeros(n_ops + 1, dtype=np.int64)
    np.add.at(delta, start, size)
    np.add.at(delta, end, -size)
    return np.cumsum(delta)[:n_ops]


@dataclass(frozen=True)
class Residency:
    """The per-step live set of a schedule: one interval per copy of a node, in order of its compute or
    reload. Copy k is node ``node[k]``, whose device bytes count in the timeline after ops ``start[k]``
    to ``end[k] - 1``: from its compute (or reload) up to its free (``n_ops`` when it stays), except that
    an input written in place (rule 8) ends at the compute that takes its bytes, and a free an offload
    copy still reads (rule 9) ends when that copy's bytes are released. Views and other nodes without
    bytes are in it too, from compute to free. ``recomputed``: the copy comes from a second or later
    compute of its node (a reload's copy is not). So ``fixed_mem`` + the bytes of ``live_at(i)`` (+
    FSDP's working memory) is ``timeline[i]``."""

    node: np.ndarray  # int64
    start: np.ndarray  # int64, the position of the compute or reload op
    end: np.ndarray  # int64, the first op after which the bytes no longer count
    recomputed: np.ndarray  # bool
    n_ops: int

    def live_at(self, i: int) -> np.ndarray:
        """int64: the nodes whose copies hold bytes right after op ``i``, sorted. O(copies)."""
        return np.sort(self.node[(self.start <= i) & (i < self.end)])

    def bytes_held(self, mem: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
        """int64[n_ops]: the bytes (``mem`` per node) held after each op by the copies of the nodes
        ``among`` selects (bool per node; None: all). O(n_ops + copies)."""
        keep = slice(None) if among is None else among[self.node]
        return held_bytes(self.start[keep], self.end[keep], mem[self.node[keep]].astype(np.int64), self.n_ops)


@dataclass(frozen=True)
class SimResult:
    """What the simulator measured of a valid schedule.

    ``timeline[i]`` is the memory (bytes, fixed_mem included) right after op i; at a compute op it is
    the step's memory of rule 3, so ``peak == timeline.max()``, unless the graph's optimizer step
    (``Graph.optimizer_peak``, after the last op) is higher: then ``peak`` is that and ``peak_op`` the
    last op.
    """

    peak: int
    peak_op: int
    compute_cost: float
    overhead: float
    computes: int
    recomputes: int
    timeline: np.ndarray
    residency: Residency  # the live set after each op: rule 3's bytes, node by node
    times_computed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # int64[n]
    events: tuple[RecomputeEvent, ...] = ()  # the schedule's rebuilds in order (:func:`recompute_events`)
    offloaded_bytes: int = 0  # rule 9: bytes of every offload op
    host_timeline: np.ndarray | None = None  # rule 9: pinned host bytes after each op (None: nothing offloaded)
    host_peak: int = 0  # the most pinned host bytes held at once
    stall: float = 0.0  # seconds compute waited for copies (in compute_cost)

    def feasible(self, budget: int | None) -> bool:
        return budget is None or self.peak <= budget

    def stats(self) -> dict[str, Any]:
        out = {"peak": self.peak, "compute_cost": self.compute_cost, "overhead": self.overhead,
               "recomputes": self.recomputes, "offloaded_bytes": self.offloaded_bytes}
        if self.offloaded_bytes:
            out.update(host_peak=self.host_peak, offload_stall=self.stall)
        return out


@dataclass(frozen=True)
class CopyTiming:
    """Rule 9's clock for a schedule's copies: when freed bytes that a copy still reads are released,
    and how long compute waits. Positions are indices into the ops."""

    deferred: set[int]  # positions of frees whose bytes an offload copy in flight still reads
    device_released: dict[int, list[int]]  # op position -> deferred frees whose bytes go just before it
    host_released: dict[int, list[int]]  # op position -> reloads whose pinned host buffer goes just before it
    stalls: dict[int, float]  # compute or wait position -> seconds the compute stream waited there

    @property
    def stall(self) -> float:
        return math.fsum(self.stalls.values())


NO_COPIES = CopyTiming(set(), {}, {}, {})


def copy_timing(graph: Graph, ops: Sequence[tuple[str, int]], link_bytes_per_s: float) -> CopyTiming:
    """Rule 9: time a schedule's copies against its compute. Compute ops run back to back on one
    stream, each for its ``cost``; each direction of the host link is one copy stream running its
    copies in schedule order at ``link_bytes_per_s``. A copy starts when it is issued (the clock at
    its position) or when its stream is free, whichever is later; a reload also not before its
    offload's copy ends. A ``free v`` issued before v's offload copy ends releases nothing then: the
    bytes go before the first compute, ``wait`` or reload that starts at or after the copy's end. A reload's
    pinned host buffer goes likewise after its copy. A compute reading a node whose reload is in
    flight, and a ``wait v``, start when that copy ends. The pure clock of any op list (validity is
    :func:`simulate`'s). O(len(ops) log copies)."""
    mem, cost = graph.mem.tolist(), graph.cost.tolist()
    clock = d2h_free = h2d_free = 0.0
    offload_end: dict[int, float] = {}  # node -> end of the copy of its current offload
    reload_end: dict[int, float] = {}  # node -> end of its reload copy in flight
    device_pending: list[tuple[float, int]] = []  # (copy end, position of the free it defers), a heap
    host_pending: list[tuple[float, int]] = []  # (copy end, reload position), a heap
    deferred: set[int] = set()
    device_released: dict[int, list[int]] = {}
    host_released: dict[int, list[int]] = {}
    stalls: dict[int, float] = {}

    def release(i: int, start: float) -> None:
        for pending, released in ((device_pending, device_released), (host_pending, host_released)):
            while pending and pending[0][0] <= start:
                released.setdefault(i, []).append(heapq.heappop(pending)[1])

    for i, (kind, v) in enumerate(ops):
        if kind == OFFLOAD:
            d2h_free = offload_end[v] = max(clock, d2h_free) + mem[v] / link_bytes_per_s
        elif kind == FREE and offload_end.get(v, 0.0) > clock:
            deferred.add(i)
            heapq.heappush(device_pending, (offload_end[v], i))
        elif kind == RELOAD:
            start = max(clock, h2d_free, offload_end.pop(v, 0.0))
            release(i, start)  # v's own deferred free among them: its old bytes go before the new come
            h2d_free = reload_end[v] = start + mem[v] / link_bytes_per_s
            heapq.heappush(host_pending, (h2d_free, i))
        elif kind == WAIT:
            end = offload_end.get(v, 0.0)
            if end > clock:
                stalls[i], clock = end - clock, end
            release(i, clock)
        elif kind == COMPUTE:
            start = max([clock] + [reload_end.pop(d) for d in graph.deps(v).tolist() if d in reload_end])
            if start > clock:
                stalls[i] = start - clock
            release(i, start)
            clock = start + cost[v]
    return CopyTiming(deferred, device_released, host_released, stalls)


def inplace_writes(graph: Graph, ops: Sequence[tuple[str, int]]) -> dict[int, int]:
    """Rule 8: {position of ``compute v``: position of ``free u``} for every compute of a node v with
    ``inplace_of`` u after which the schedule frees u before the next compute. Eager runs such an op in
    place (``relu_``, ``x += y``): v's output takes u's bytes, and freeing u then releases nothing. A
    schedule that keeps u longer (a later recomputation reads it) gets a fresh output, as the
    functional op would. O(len(ops))."""
    inplace_of = graph.inplace_of
    if not (inplace_of >= 0).any():
        return {}
    writes: dict[int, int] = {}
    for i, (kind, v) in enumerate(ops):
        if kind != COMPUTE or not 0 <= v < graph.n or inplace_of[v] < 0:
            continue
        u = int(inplace_of[v])
        for j in range(i + 1, len(ops)):
            if ops[j][0] == COMPUTE:
                break
            if ops[j][1] == u:
                if ops[j][0] == FREE:
                    writes[i] = j
                break
    return writes


def host_link(schedule: Schedule | Sequence[tuple[str, int]]) -> tuple[float, int | None]:
    """Rule 9's host link for a schedule: (bytes/s per direction, pinned host bytes allowed), from its
    ``device`` profile (default ``costmodel.DEFAULT_PROFILE``) and its ``host_budget``."""
    from bonsai_core.costmodel import DEFAULT_PROFILE, PROFILES

    device = getattr(schedule, "device", None) or DEFAULT_PROFILE
    profile = PROFILES[device]
    limit = getattr(schedule, "host_budget", None)
    return profile.host_link_bytes_per_s, profile.host_bytes if limit is None else limit


def timing_of(graph: Graph, schedule: Schedule | Sequence[tuple[str, int]]) -> CopyTiming:
    """:func:`copy_timing` of a schedule on its device's host link (``NO_COPIES`` when it offloads nothing)."""
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    if all(kind == COMPUTE or kind == FREE for kind, _ in ops):
        return NO_COPIES
    return copy_timing(graph, ops, host_link(schedule)[0])


def simulate(graph: Graph, schedule: Schedule | Sequence[tuple[str, int]]) -> SimResult:
    """Replay a schedule on a graph under the rules above; raise ScheduleError at the first broken
    rule, naming the op and the node. O(len(ops) + edges).
    Long: one pass over the ops with each rule's check inline; every method's schedule goes through this
    loop, which per-op function calls would slow down."""
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    _, host_limit = host_link(schedule)
    if isinstance(schedule, Schedule) and schedule.graph_hash and schedule.graph_hash != graph.hash:
        raise ScheduleError(
            f"This schedule was made for graph {schedule.graph!r} (hash {schedule.graph_hash}), not for "
            f"{graph.name!r} (hash {graph.hash}): solve again for this graph.")
    n = graph.n
    deps = [graph.deps(v).tolist() for v in range(n)]
    alias = graph.alias_of.tolist()
    mem = graph.mem.tolist()
    cost = graph.cost.tolist()
    resident = [False] * n
    computed = [0] * n
    live_views = [0] * n  # resident views of each node
    output_of = graph.output_of.tolist()
    inplace_of = graph.inplace_of.tolist()
    outputs = _separated_outputs(graph)
    stale = [False] * n  # a separated output freed since its op last ran: no bytes to take it from
    live = graph.fixed_mem
    peak, peak_op = live, -1
    computed_costs: list[float] = []
    timeline = np.empty(len(ops), dtype=np.int64)
    written = inplace_writes(graph, ops)  # rule 8: compute position -> the free that releases nothing
    handed_over = set(written.values())
    timing = timing_of(graph, schedule)
    on_host = [False] * n  # rule 9: a host copy, from its offload to its reload
    host = host_peak = offloaded = 0
    host_timeline = None if timing is NO_COPIES else np.zeros(len(ops), dtype=np.int64)
    ever_offloaded: set[int] = set()
    starts: list[int] = []  # Residency: the position of each copy's compute or reload
    ends = [len(ops)] * len(ops)  # by a copy's start: the op after which its bytes no longer count
    copy_of = [0] * n  # each node's current copy, by its start
    pending: dict[int, int] = {}  # rule 9: position of a free an offload copy still reads -> its copy's start
    again: list[int] = []  # the copies (by index) of a second or later compute
    for i, (kind, v) in enumerate(ops):
        if not (isinstance(v, (int, np.integer)) and 0 <= v < n):
            raise ScheduleError(f"Op {i} ({kind} {v!r}) names no node of graph {graph.name!r} "
                                f"(ids are 0..{n - 1}): is this schedule for another graph?")
        for pos in timing.device_released.get(i, ()):  # rule 9: frees an offload copy was still reading
            live -= mem[ops[pos][1]]
            ends[pending.pop(pos)] = i
        for pos in timing.host_released.get(i, ()):
            host -= mem[ops[pos][1]]
        if kind == COMPUTE:
            if on_host[v] and not resident[v]:
                raise ScheduleError(f"Op {i} computes node {v} ({graph.names[v]!r}), which is offloaded to host "
                                    "memory: reload it instead.")
            if resident[v]:
                raise ScheduleError(f"Op {i} computes node {v} ({graph.names[v]!r}), which is already resident.")
            for d in deps[v]:
                if not resident[d]:
                    raise ScheduleError(f"Op {i} computes node {v} ({graph.names[v]!r}) but its input "
                                        f"{d} ({graph.names[d]!r}) is not resident"
                                        + (": it is offloaded, reload it first." if on_host[d] else "."))
            if stale[v]:
                op = output_of[v]
                raise ScheduleError(f"Op {i} computes node {v} ({graph.names[v]!r}), an output of node {op} "
                                    f"({graph.names[op]!r}), again after freeing it, but {op} has not run since: "
                                    "that output's bytes come only from its op's kernel. Keep it resident, or "
                                    "recompute its op first.")
            for out in outputs.get(v, ()):
                stale[out] = False
            resident[v] = True
            computed[v] += 1
            if alias[v] >= 0:
                live_views[alias[v]] += 1
            if i in written:
                live -= mem[inplace_of[v]]
                ends[copy_of[inplace_of[v]]] = i
            live += mem[v]
            copy_of[v] = i
            if computed[v] > 1:
                again.append(len(starts))
            starts.append(i)
            computed_costs.append(cost[v])
            if live > peak:
                peak, peak_op = live, i
        elif kind == FREE:
            if not resident[v]:
                raise ScheduleError(f"Op {i} frees node {v} ({graph.names[v]!r}), which is not resident.")
            if live_views[v]:
                raise ScheduleError(f"Op {i} frees node {v} ({graph.names[v]!r}) while {live_views[v]} view(s) "
                                    "of it are resident: free the views first.")
            if i in handed_over and i in timing.deferred:
                raise ScheduleError(f"Op {i} frees node {v} ({graph.names[v]!r}) for an in-place write (rule 8) "
                                    "while its offload copy still reads it: wait for the copy first.")
            resident[v] = False
            stale[v] = output_of[v] >= 0 and not on_host[v]
            if alias[v] >= 0:
                live_views[alias[v]] -= 1
            if i in timing.deferred:
                pending[i] = copy_of[v]
            elif i not in handed_over:
                live -= mem[v]
                ends[copy_of[v]] = i
        elif kind == OFFLOAD:
            what = f"Op {i} offloads node {v} ({graph.names[v]!r})"
            if not resident[v] or on_host[v]:
                raise ScheduleError(f"{what}, which is " + ("already offloaded." if on_host[v] else "not resident."))
            if alias[v] >= 0:
                raise ScheduleError(f"{what}, a view: offload the node whose storage it shares "
                                    f"({alias[v]}, {graph.names[alias[v]]!r}).")
            on_host[v] = True
            ever_offloaded.add(v)
            host += mem[v]
            offloaded += mem[v]
            host_peak = max(host_peak, host)
            if host_limit is not None and host > host_limit:
                raise ScheduleError(f"{what}: the pinned host buffers would hold {host} bytes, over the "
                                    f"host budget of {host_limit} bytes. Offload less, or raise the host budget.")
        elif kind == RELOAD:
            if not on_host[v] or resident[v]:
                raise ScheduleError(f"Op {i} reloads node {v} ({graph.names[v]!r}), which is "
                                    + ("still resident: free it first." if on_host[v] else "not offloaded."))
            resident[v], on_host[v] = True, False
            live += mem[v]  # the bytes come back when the reload starts
            copy_of[v] = i
            starts.append(i)
            if live > peak:
                peak, peak_op = live, i
        elif kind == WAIT:
            if v not in ever_offloaded:
                raise ScheduleError(f"Op {i} waits for node {v} ({graph.names[v]!r}), which was never offloaded.")
        else:
            raise ScheduleError(f"Op {i} has kind {kind!r}; use one of {', '.join(KINDS)}.")
        timeline[i] = live
        if host_timeline is not None:
            host_timeline[i] = host
    never = [v for v in range(n) if not computed[v]]
    if never:
        v = never[0]
        raise ScheduleError(f"The schedule never computes node {v} ({graph.names[v]!r})"
                            + (f" and {len(never) - 1} other node(s)" if len(never) > 1 else "")
                            + ": every node must be computed at least once.")
    timeline, peak, peak_op = _beyond_the_graph(graph, ops, timeline, peak, peak_op)
    stall = timing.stall
    base, total = graph.total_cost, math.fsum(computed_costs) + stall
    events = recompute_events(graph, ops)
    start = np.asarray(starts, dtype=np.int64)
    recomputed = np.zeros(len(starts), dtype=bool)
    recomputed[again] = True
    residency = Residency(node=np.asarray([ops[i][1] for i in starts], dtype=np.int64), start=start,
                          end=np.asarray(ends, dtype=np.int64)[start], recomputed=recomputed, n_ops=len(ops))
    return SimResult(peak=int(peak), peak_op=peak_op, compute_cost=total,
                     overhead=(total / base - 1.0) if base > 0 else 0.0,
                     computes=len([1 for k, _ in ops if k == COMPUTE]), recomputes=int(sum(computed) - n),
                     timeline=timeline, residency=residency, times_computed=np.asarray(computed, dtype=np.int64),
                     events=events, offloaded_bytes=offloaded, host_peak=host_peak,
                     stall=stall, host_timeline=host_timeline)


def recompute_events(graph: Graph, ops: Sequence[tuple[str, int]]) -> tuple[RecomputeEvent, ...]:
    """The rebuilds of a valid schedule, in order: each maximal run of computes of nodes computed
    before (frees inside the run allowed), with what it brings back and costs. O(len(ops))."""
    seen = bytearray(graph.n)  # a Python loop over the ops: bytes index faster than a numpy array
    events: list[RecomputeEvent] = []
    run: list[int] = []  # positions of the current run's recomputes
    resident: set[int] = set()  # its recomputed nodes not freed since

    def close(before: int) -> None:
        if run:
            nodes = tuple(int(ops[j][1]) for j in run)
            events.append(RecomputeEvent(start=run[0], end=run[-1], nodes=nodes, before=before,
                                         bytes=int(graph.mem[sorted(resident)].sum()) if resident else 0,
                                         cost=math.fsum(graph.cost[list(nodes)].tolist())))
            run.clear()
            resident.clear()

    for i, (kind, v) in enumerate(ops):
        if kind == COMPUTE:
            if seen[v]:
                run.append(i)
                resident.add(v)
            else:
                close(int(v))
                seen[v] = 1
        elif kind == FREE and resident:
            resident.discard(v)
    close(-1)
    return tuple(events)


def recomputes(ops: Sequence[tuple[str, int]], events: Sequence[RecomputeEvent]) -> np.ndarray:
    """bool[len(ops)]: the compute ops that compute their node a second or later time, those of the
    rebuilds ``events`` (:func:`recompute_events` of ``ops``, or ``SimResult.events``). O(len(ops))."""
    flags = np.zeros(len(ops), dtype=bool)
    for e in events:
        flags[e.start:e.end + 1] = True
    return flags & np.fromiter((kind == COMPUTE for kind, _ in ops), dtype=bool, count=len(ops))


def _beyond_the_graph(graph: Graph, ops: Sequence[tuple[str, int]], timeline: np.ndarray, peak: int,
                      peak_op: int) -> tuple[np.ndarray, int, int]:
    """The timeline and peak with what the step holds beyond the graph's tensors: on an FSDP rank the
    unsharded blocks and held gradients, and the optimizer step after the backward pass."""
    if graph.fsdp is not None:
        from bonsai_core.fsdp import working_profile

        timeline = timeline + working_profile(graph, ops)
        peak_op = int(np.argmax(timeline)) if len(timeline) else -1
        peak = max(int(timeline.max(initial=graph.fixed_mem)), graph.fixed_mem)
    if graph.optimizer_peak > peak:  # the optimizer step after the backward pass sets the peak
        peak, peak_op = graph.optimizer_peak, len(ops) - 1
    return timeline, peak, peak_op


def _separated_outputs(graph: Graph) -> dict[int, list[int]]:
    """op node -> its outputs that are nodes of their own (``Graph.output_of``)."""
    outputs: dict[int, list[int]] = {}
    for s in np.flatnonzero(graph.output_of >= 0).tolist():
        outputs.setdefault(int(graph.output_of[s]), []).append(s)
    return outputs


def hold_separated_outputs(graph: Graph, ops: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """``ops`` with every output of a multi-output op that is a node of its own (``Graph.output_of``:
    batch norm's statistics, dropout's mask) kept resident where it was freed and computed again
    while its op did not run in between: that free and that compute are dropped.

    Such an output is cheap to compute from its op's node (a ``getitem``), but its bytes come only
    from the op's kernel: taken again without running the op, it is the same copy, which a real run
    (and the export) must have kept. The simulator refuses the pair; a method that does not model
    it (every method's schedule builder) passes its ops through here. O(len(ops))."""
    output_of = graph.output_of
    if not (output_of >= 0).any():
        return list(ops)
    outputs = _separated_outputs(graph)
    kept: list[tuple[str, int] | None] = []
    freed_at: dict[int, int] = {}  # separated output -> position in kept of its free since its op last ran
    for kind, v in ops:
        if kind == COMPUTE:
            if v in freed_at:
                kept[freed_at.pop(v)] = None  # never freed: the compute reads the copy still held
                continue
            for out in outputs.get(v, ()):
                freed_at.pop(out, None)  # the op ran again: its outputs' next copy is a new one
        elif output_of[v] >= 0:
            freed_at[v] = len(kept)
        kept.append((kind, v))
    return [op for op in kept if op is not None]


def schedule_ops(graph: Graph, sequence: Iterable[int]) -> list[tuple[str, int]]:
    """Turn a compute sequence (node ids, repeats meaning recomputation) into compute/free ops that
    free every copy of a node right after its last use, the least memory that sequence allows.

    Each read binds to the node's latest copy; a copy is freed after its last reader, or right after
    it is computed if nobody reads it (an output's buffer is part of ``fixed_mem``). A resident view
    keeps its base's copy alive, and views are freed before their bases. O(len(sequence) + edges).

    Raises ScheduleError if the sequence reads a node before computing it, or recomputes a node
    whose previous copy is still needed (by a reader or by a live view).
    """
    seq = [int(v) for v in sequence]
    latest = [-1] * graph.n  # position of each node's current copy
    release = list(range(len(seq)))  # position after which each copy is freed
    base_copy = [-1] * len(seq)  # for a view's copy: its base's copy
    for p, v in enumerate(seq):
        for d in graph.deps(v).tolist():
            if latest[d] < 0:
                raise ScheduleError(f"The sequence computes node {v} ({graph.names[v]!r}) at step {p} before "
                                    f"its input {d} ({graph.names[d]!r}).")
            release[latest[d]] = p
        a = int(graph.alias_of[v])
        if a >= 0:
            base_copy[p] = latest[a]
        latest[v] = p
    for p in reversed(range(len(seq))):  # views come after their bases
        if base_copy[p] >= 0:
            release[base_copy[p]] = max(release[base_copy[p]], release[p])
    last_copy: dict[int, int] = {}
    for p, v in enumerate(seq):
        prev = last_copy.get(v)
        if prev is not None and release[prev] >= p:
            raise ScheduleError(f"The sequence recomputes node {v} ({graph.names[v]!r}) at step {p} while its "
                                "previous copy is still needed.")
        last_copy[v] = p
    frees_at: dict[int, list[int]] = {}
    for p in range(len(seq)):
        frees_at.setdefault(release[p], []).append(p)
    ops: list[tuple[str, int]] = []
    for p, v in enumerate(seq):
        ops.append((COMPUTE, v))
        for q in sorted(frees_at.get(p, ()), reverse=True):  # later copies (views) first
            ops.append((FREE, seq[q]))
    return hold_separated_outputs(graph, ops)


def none_schedule(graph: Graph) -> Schedule:
    """No rematerialization: every node once, in listed order, freed after its last use."""
    return Schedule(graph=graph.name, method="none", ops=schedule_ops(graph, range(graph.n)),
                    graph_hash=graph.hash)


def no_remat_peak(graph: Graph) -> int:
    """The peak of the plain schedule: the reference a ``60%`` budget is a share of."""
    return simulate(graph, none_schedule(graph)).peak


def load_schedule(path: str | os.PathLike) -> Schedule:
    try:
        data = read_json_file(path, "schedule file")
    except GraphError as e:  # the same reader, but the user should hear "schedule"
        raise ScheduleError(str(e)) from None
    return Schedule.from_dict(data)


def save_schedule(schedule: Schedule, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(schedule.to_dict(), separators=(",", ":")) + "\n")
