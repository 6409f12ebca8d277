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

:func:`simulate` is a loop over the ops calling one named function per rule: the device side
(:class:`_Device`: rules 1, 2, 5 and 8, which record the copies) and the host side (:class:`_HostCopies`:
rule 9's state); after the loop, rule 4 (:func:`_every_node_computed`), the bytes (:func:`_memory`,
:func:`_peak`: rules 3 and 7, as sums over the copies recorded) and the cost (:func:`_compute_cost`).
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Iterable, Sequence

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
    # what simulated() found, with what it simulated: (graph hash, ops, device, host_budget, SimResult)
    simulation: tuple | None = field(default=None, repr=False, compare=False)

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
        """Parse a bonsai-schedule document (already JSON-decoded): each field against the format's JSON
        Schema (:mod:`bonsai_core.schema`), then ``device`` against the cost model's profiles; the ops'
        rules are the simulator's."""
        from bonsai_core.costmodel import PROFILES
        from bonsai_core.schema import check

        check_header(data, ScheduleError, FORMAT, VERSION, fields="'format', 'version' and 'ops'",
                     other="a graph file? pass it as the graph instead")
        check(data, "schedule", ScheduleError)
        device = data.get("device")
        if device is not None and device not in PROFILES:
            raise ScheduleError(f"'device' is {device!r}; use one of {', '.join(PROFILES)} or leave it out.")
        budget, host_budget, gh = data.get("budget"), data.get("host_budget"), data.get("graph_hash")
        return cls(graph=data.get("graph", ""), method=data.get("method", ""), ops=[(kind, v) for kind, v in data["ops"]],
                   budget=None if budget is None else int(budget), graph_hash=gh, stats=data.get("stats", {}),
                   extra=data.get("extra", {}), device=device, host_budget=None if host_budget is None else int(host_budget))


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
    compute of its node (a reload's copy is not). ``taken``: its bytes go to the output of the compute at
    ``end``, written in place (rule 8). So ``fixed_mem`` + the bytes of ``live_at(i)`` (+ FSDP's working
    memory) is ``timeline[i]``."""

    node: np.ndarray  # int64
    start: np.ndarray  # int64, the position of the compute or reload op
    end: np.ndarray  # int64, the first op after which the bytes no longer count
    recomputed: np.ndarray  # bool
    taken: np.ndarray  # bool
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


def simulated(graph: Graph, schedule: Schedule) -> SimResult:
    """:func:`simulate`, once per schedule: a solve's checks (the method's own, ``solvers.solve``'s, the
    explorer's) then share one simulation (on the largest steps each takes a good part of a second). The
    result is kept on the schedule with the graph's hash, the ops (compared by content) and the settings
    rule 9 reads; a schedule changed since is simulated again."""
    _made_for(graph, schedule)
    ops = tuple(schedule.ops)
    kept = schedule.simulation
    if kept is not None and kept[:4] == (graph.hash, ops, schedule.device, schedule.host_budget):
        return kept[4]
    sim = simulate(graph, schedule)
    schedule.simulation = (graph.hash, ops, schedule.device, schedule.host_budget, sim)
    return sim


def simulate(graph: Graph, schedule: Schedule | Sequence[tuple[str, int]]) -> SimResult:
    """Replay a schedule on a graph under the rules above. One loop over the ops checks each op by the
    rules that govern its kind and records the copies it makes and ends (:class:`_Device`, rule 9's
    host side :class:`_HostCopies`); the bytes (rules 3, 7 and 9) and the cost (rule 6) are then sums
    over that record. Raises ScheduleError naming the op and the node: at the first op a rule forbids,
    else at the first bound a total breaks (coverage, pinned host bytes). O(len(ops) + edges).

    A new rule is one more function: a check of an op called in the loop for the kinds it governs,
    with its state on the object of the rules it shares state with; bytes a step holds beyond the
    graph's tensors (rule 7's kind) are one more entry of :data:`BEYOND_THE_GRAPH`."""
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    _made_for(graph, schedule)
    nodes = _node_ids(graph, ops)
    timing = timing_of(graph, schedule)
    host = _HostCopies(graph, timing, host_link(schedule)[1])
    device = _Device(graph, ops, timing, host.on_host)
    for i, (kind, v) in enumerate(ops):
        if kind == COMPUTE:
            device.inputs_resident(i, v)  # rule 1
            device.from_its_op(i, v)  # rule 5
            device.compute(i, v)  # rules 1 and 8
        elif kind == FREE:
            device.free(i, v)  # rules 2, 5, 8 and 9
        elif kind == OFFLOAD:
            host.offload(i, v, device.resident)  # rule 9
        elif kind == RELOAD:
            host.reload(i, v, device.resident)  # rule 9
            device.reload(i, v)
        elif kind == WAIT:
            host.wait(i, v)  # rule 9
        else:
            raise ScheduleError(f"Op {i} has kind {kind!r}; use one of {', '.join(KINDS)}.")
    times_computed = _every_node_computed(graph, device.computed)  # rule 4
    residency = device.residency(nodes)
    timeline = _memory(graph, ops, residency)  # rules 3 and 7
    peak, peak_op = _peak(graph, timeline)  # rule 3
    host_timeline, host_peak = host.timeline(len(ops))  # rule 9
    compute_cost = _compute_cost(graph, times_computed, timing.stall)  # rule 6
    base = graph.total_cost
    return SimResult(peak=peak, peak_op=peak_op, compute_cost=compute_cost,
                     overhead=(compute_cost / base - 1.0) if base > 0 else 0.0,
                     computes=int(times_computed.sum()), recomputes=int(times_computed.sum()) - graph.n,
                     timeline=timeline, residency=residency, times_computed=times_computed,
                     events=recompute_events(graph, ops), offloaded_bytes=host.offloaded, host_peak=host_peak,
                     stall=timing.stall, host_timeline=host_timeline)


def _made_for(graph: Graph, schedule: Schedule | Sequence[tuple[str, int]]) -> None:
    """A schedule that names its graph's hash is judged on that graph only."""
    if isinstance(schedule, Schedule) and schedule.graph_hash and schedule.graph_hash != graph.hash:
        raise ScheduleError(
            f"This schedule was made for graph {schedule.graph!r} (hash {schedule.graph_hash}), not for "
            f"{graph.name!r} (hash {graph.hash}): solve again for this graph.")


def _node_ids(graph: Graph, ops: Sequence[tuple[str, int]]) -> np.ndarray:
    """int64[len(ops)]: the node each op names; every op names a node of the graph."""
    ids = np.array([v for _, v in ops])
    if len(ops) and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= graph.n):
        i, (kind, v) = next((i, op) for i, op in enumerate(ops)
                            if not (isinstance(op[1], (int, np.integer)) and 0 <= op[1] < graph.n))
        raise ScheduleError(f"Op {i} ({kind} {v!r}) names no node of graph {graph.name!r} "
                            f"(ids are 0..{graph.n - 1}): is this schedule for another graph?")
    return ids.astype(np.int64, copy=False)


class _Device:
    """Rules 1, 2, 5 and 8 as the loop keeps them: which nodes are resident on the device, and the copies
    :class:`Residency` records, each from its compute or reload (``starts``) to the op before which its
    bytes stop counting (``ends``, by the copy's start)."""

    def __init__(self, graph: Graph, ops: Sequence[tuple[str, int]], timing: CopyTiming, on_host: list[bool]):
        n = graph.n
        self.graph, self.on_host = graph, on_host
        self.deps, self.alias, self.output_of = graph.dep_lists, graph.alias_of.tolist(), graph.output_of.tolist()
        self.inplace_of, self.outputs = graph.inplace_of.tolist(), _separated_outputs(graph)
        self.resident = [False] * n
        self.computed = [0] * n
        self.live_views = [0] * n  # resident views of each node
        self.stale = [False] * n  # rule 5: a separated output freed since its op last ran
        self.copy_of = [0] * n  # each node's current copy, by its start
        self.starts: list[int] = []
        self.again: list[int] = []  # the copies (by index) of a second or later compute
        self.taken: list[int] = []  # rule 8: the copies (by start) whose bytes an in-place write took
        self.ends = [len(ops)] * len(ops)
        self.written = inplace_writes(graph, ops)  # rule 8: compute position -> the free that releases nothing
        self.handed_over = set(self.written.values())
        self.deferred, self.device_released = timing.deferred, timing.device_released  # rule 9
        self.kept_past_free = self.handed_over | self.deferred
        self.pending: dict[int, int] = {}  # rule 9: position of a free an offload copy still reads -> its copy

    def _name(self, v: int) -> str:
        return f"node {v} ({self.graph.names[v]!r})"

    def inputs_resident(self, i: int, v: int) -> None:
        """Rule 1: v is not resident (nor only on the host), and every dep of v is (a view's base is one)."""
        resident = self.resident
        if resident[v] or self.on_host[v]:
            raise ScheduleError(f"Op {i} computes {self._name(v)}, which is " + (
                "already resident." if resident[v] else "offloaded to host memory: reload it instead."))
        for d in self.deps[v]:
            if not resident[d]:
                raise ScheduleError(f"Op {i} computes {self._name(v)} but its input {d} ({self.graph.names[d]!r}) is not resident"
                                    + (": it is offloaded, reload it first." if self.on_host[d] else "."))

    def from_its_op(self, i: int, v: int) -> None:
        """Rule 5: a separated output freed since its op last ran is not computed again; computing an op
        makes its separated outputs computable."""
        if self.stale[v]:
            op = self.output_of[v]
            raise ScheduleError(f"Op {i} computes {self._name(v)}, an output of {self._name(op)}, again after "
                                f"freeing it, but {op} has not run since: that output's bytes come only from its "
                                "op's kernel. Keep it resident, or recompute its op first.")
        for out in self.outputs.get(v, ()):
            self.stale[out] = False

    def compute(self, i: int, v: int) -> None:
        """Rule 1: v becomes resident, a new copy (a view keeps its base resident)."""
        self.resident[v] = True
        self.computed[v] += 1
        if self.computed[v] > 1:
            self.again.append(len(self.starts))
        if self.alias[v] >= 0:
            self.live_views[self.alias[v]] += 1
        if i in self.written:
            self.write_in_place(i, v)
        self.copy_of[v] = i
        self.starts.append(i)

    def write_in_place(self, i: int, v: int) -> None:
        """Rule 8: v takes its input's bytes, whose copy ends here (the free after it releases nothing)."""
        self.ends[self.copy_of[self.inplace_of[v]]] = i
        self.taken.append(self.copy_of[self.inplace_of[v]])

    def reload(self, i: int, v: int) -> None:
        """Rule 9: v's bytes are back on the device, a new copy (no compute)."""
        self.resident[v] = True
        self.copy_of[v] = i
        self.starts.append(i)

    def free(self, i: int, v: int) -> None:
        """Rule 2: v is resident and no view of it is; its copy ends here, unless an in-place write took its
        bytes (rule 8) or an offload copy still reads them (rule 9). Rule 5: a separated output freed
        without a host copy is stale until its op runs again."""
        if not self.resident[v]:
            raise ScheduleError(f"Op {i} frees {self._name(v)}, which is not resident.")
        if self.live_views[v]:
            raise ScheduleError(f"Op {i} frees {self._name(v)} while {self.live_views[v]} view(s) "
                                "of it are resident: free the views first.")
        self.resident[v] = False
        if self.alias[v] >= 0:
            self.live_views[self.alias[v]] -= 1
        if self.output_of[v] >= 0:
            self.stale[v] = not self.on_host[v]
        if i not in self.kept_past_free:
            self.ends[self.copy_of[v]] = i
        elif i in self.deferred:
            if i in self.handed_over:
                raise ScheduleError(f"Op {i} frees {self._name(v)} for an in-place write (rule 8) "
                                    "while its offload copy still reads it: wait for the copy first.")
            self.pending[i] = self.copy_of[v]

    def residency(self, nodes: np.ndarray) -> Residency:
        """The copies recorded, a deferred free's copy ending where rule 9's clock releases its bytes."""
        for at, positions in self.device_released.items():
            for pos in positions:
                self.ends[self.pending.pop(pos)] = at
        start = np.asarray(self.starts, dtype=np.int64)
        recomputed = np.zeros(len(start), dtype=bool)
        recomputed[self.again] = True
        taken = np.zeros(len(self.ends), dtype=bool)  # by position
        taken[self.taken] = True
        return Residency(node=nodes[start], start=start, end=np.asarray(self.ends, dtype=np.int64)[start],
                         recomputed=recomputed, taken=taken[start], n_ops=len(nodes))


class _HostCopies:
    """Rule 9's state: which nodes have a host copy, the pinned buffers held (each from its offload until
    its reload's copy ends, :func:`copy_timing`'s clock) and their bytes within the host budget."""

    def __init__(self, graph: Graph, timing: CopyTiming, limit: int | None):
        self.graph, self.mem, self.limit = graph, graph.mem.tolist(), limit
        self.on_host = [False] * graph.n  # from its offload to its reload
        self.offload_at: dict[int, int] = {}  # node -> position of its latest offload
        self.buffers: list[tuple[int, int, int]] = []  # (offload position, reload position or -1, node)
        self.releases = sorted(timing.host_released.items())  # (position, reloads whose buffers go just before it)
        self.released = 0  # how many of them the pinned bytes have given back
        self.reloaded: dict[int, int] = {}  # reload position -> its node
        self.pinned = 0  # bytes of the buffers held, as of the latest offload
        self.offloaded = 0  # bytes of every offload op

    def offload(self, i: int, v: int, resident: list[bool]) -> None:
        """v is resident, not a view, and has no host copy yet; its buffer keeps the pinned bytes within the
        host budget."""
        what = f"Op {i} offloads node {v} ({self.graph.names[v]!r})"
        if not resident[v] or self.on_host[v]:
            raise ScheduleError(f"{what}, which is " + ("already offloaded." if self.on_host[v] else "not resident."))
        a = int(self.graph.alias_of[v])
        if a >= 0:
            raise ScheduleError(f"{what}, a view: offload the node whose storage it shares ({a}, {self.graph.names[a]!r}).")
        while self.released < len(self.releases) and self.releases[self.released][0] <= i:
            self.pinned -= sum(self.mem[self.reloaded[r]] for r in self.releases[self.released][1])
            self.released += 1
        self.on_host[v] = True
        self.offload_at[v] = i
        self.pinned += self.mem[v]
        self.offloaded += self.mem[v]
        if self.limit is not None and self.pinned > self.limit:
            raise ScheduleError(f"{what}: the pinned host buffers would hold {self.pinned} bytes, over the host "
                                f"budget of {self.limit} bytes. Offload less, or raise the host budget.")

    def reload(self, i: int, v: int, resident: list[bool]) -> None:
        """v has a host copy and was freed since; its bytes come back."""
        if not self.on_host[v] or resident[v]:
            raise ScheduleError(f"Op {i} reloads node {v} ({self.graph.names[v]!r}), which is "
                                + ("still resident: free it first." if self.on_host[v] else "not offloaded."))
        self.on_host[v] = False
        self.reloaded[i] = v
        self.buffers.append((self.offload_at[v], i, v))

    def wait(self, i: int, v: int) -> None:
        """v was offloaded (compute waits for its copy: :func:`copy_timing`)."""
        if v not in self.offload_at:
            raise ScheduleError(f"Op {i} waits for node {v} ({self.graph.names[v]!r}), which was never offloaded.")

    def timeline(self, n_ops: int) -> tuple[np.ndarray | None, int]:
        """The pinned host bytes after each op (None: nothing offloaded) and their most."""
        if not self.offload_at:
            return None, 0
        buffers = self.buffers + [(at, -1, v) for v, at in self.offload_at.items() if self.on_host[v]]
        released = {r: at for at, reloads in self.releases for r in reloads}
        start = np.array([b[0] for b in buffers], dtype=np.int64)
        end = np.array([released.get(b[1], n_ops) for b in buffers], dtype=np.int64)
        timeline = held_bytes(start, end, np.array([self.mem[b[2]] for b in buffers], dtype=np.int64), n_ops)
        return timeline, int(timeline.max())


def _every_node_computed(graph: Graph, computed: list[int]) -> np.ndarray:
    """Rule 4: every node is computed at least once. Returns int64[n], the times each node is."""
    times = np.asarray(computed, dtype=np.int64)
    never = np.flatnonzero(times == 0)
    if len(never):
        v = int(never[0])
        raise ScheduleError(f"The schedule never computes node {v} ({graph.names[v]!r})"
                            + (f" and {len(never) - 1} other node(s)" if len(never) > 1 else "")
                            + ": every node must be computed at least once.")
    return times


def _fsdp_working_memory(graph: Graph, ops: Sequence[tuple[str, int]], residency: Residency) -> np.ndarray | None:
    """Rule 7: on an FSDP rank, the unsharded blocks, held gradients and collective buffers after each op
    (under pipeline parallel, rule 11's)."""
    if graph.fsdp is None or (graph.parallel or {}).get("pipeline"):
        return None
    from bonsai_core.fsdp import working_profile

    return working_profile(graph, ops)


def _microbatches_in_flight(graph: Graph, ops: Sequence[tuple[str, int]], residency: Residency) -> np.ndarray | None:
    """Rule 11: on a pipeline rank, the other microbatches in flight (and FSDP's gradients under it)."""
    if not (graph.parallel or {}).get("pipeline"):
        return None
    from bonsai_core.in_flight import working

    return working(graph, ops, residency)


# What a step holds beyond the graph's tensors and fixed_mem, each a function of the graph, the ops and the
# live set giving the bytes held after each op (or None where the graph has none of it), added to the timeline.
BEYOND_THE_GRAPH = (_fsdp_working_memory, _microbatches_in_flight)


def _memory(graph: Graph, ops: Sequence[tuple[str, int]], residency: Residency) -> np.ndarray:
    """Rule 3: the bytes after each op, ``fixed_mem`` + the live set's, + what :data:`BEYOND_THE_GRAPH`
    holds."""
    timeline = graph.fixed_mem + residency.bytes_held(graph.mem)
    for working in BEYOND_THE_GRAPH:
        extra = working(graph, ops, residency)
        if extra is not None:
            timeline = timeline + extra
    return timeline


def _peak(graph: Graph, timeline: np.ndarray) -> tuple[int, int]:
    """Rule 3: the peak and the first op at it (-1: nothing above ``fixed_mem``), the optimizer step after
    the last op included (``Graph.optimizer_peak``, then the last op)."""
    peak, peak_op = graph.fixed_mem, -1
    if len(timeline) and timeline.max() > peak:
        peak_op = int(timeline.argmax())
        peak = int(timeline[peak_op])
    if graph.optimizer_peak > peak:
        peak, peak_op = graph.optimizer_peak, len(timeline) - 1
    return peak, peak_op


def _compute_cost(graph: Graph, times_computed: np.ndarray, stall: float) -> float:
    """Rule 6: the seconds of every compute, + the stalls rule 9's copies cause."""
    return math.fsum(np.repeat(graph.cost, times_computed).tolist()) + stall


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


def schedule_ops(graph: Graph, sequence: Iterable[int], reloads: AbstractSet[int] = frozenset()
                 ) -> list[tuple[str, int]]:
    """Turn a compute sequence (node ids, repeats meaning recomputation) into compute/free ops that
    free every copy of a node right after its last use, the least memory that sequence allows.

    Each read binds to the node's latest copy; a copy is freed after its last reader, or right after
    it is computed if nobody reads it (an output's buffer is part of ``fixed_mem``). A resident view
    keeps its base's copy alive, and views are freed before their bases. O(len(sequence) + edges).

    ``reloads``: positions of the sequence that bring a node back from its host copy (rule 9) instead
    of computing it: a ``reload`` op there, which reads no input.

    Raises ScheduleError if the sequence reads a node before computing it, or recomputes a node
    whose previous copy is still needed (by a reader or by a live view).
    """
    return hold_separated_outputs(graph, sequence_ops(graph, sequence, reloads))


def sequence_ops(graph: Graph, sequence: Iterable[int], reloads: AbstractSet[int] = frozenset()
                 ) -> list[tuple[str, int]]:
    """:func:`schedule_ops` before :func:`hold_separated_outputs`: one compute op per entry of ``sequence``
    (a reload at the positions ``reloads``), in its order, each followed by the frees its reads end."""
    seq = [int(v) for v in sequence]
    latest = [-1] * graph.n  # position of each node's current copy
    release = list(range(len(seq)))  # position after which each copy is freed
    base_copy = [-1] * len(seq)  # for a view's copy: its base's copy
    for p, v in enumerate(seq):
        for d in ([] if p in reloads else graph.deps(v).tolist()):
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
        ops.append((RELOAD if p in reloads else COMPUTE, v))
        for q in sorted(frees_at.get(p, ()), reverse=True):  # later copies (views) first
            ops.append((FREE, seq[q]))
    return ops


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
