"""Replay: a schedule's ops applied to an allocator block by block, as a GPU allocator would serve
them: the reserved bytes after each op, the address picture at one op (:func:`layout_at`), and the
fragmentation at the reserved peak."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from bonsai_core.allocator.blocks import DEFAULT_STREAM
from bonsai_core.allocator.fixed import Optimizer, Updates, full_arena
from bonsai_core.allocator.pipelined import action_ops, per_op, rank_length, run_pipeline_step
from bonsai_core.allocator.policies import Allocator, Policy
from bonsai_core.allocator.step import FSDP_OWNERS, blocks_taken_and_given, optimizer_step, out_of_pool
from bonsai_core.errors import BonsaiError, BudgetError
from bonsai_core.graph import Graph
from bonsai_core.schedule import FREE, Residency, Schedule, simulate, simulated
from bonsai_core.units import format_bytes

@dataclass(frozen=True)
class AllocResult:
    """Per-op allocator state of a replayed schedule (all byte counts include ``fixed_mem``, and with
    ``full`` the optimizer state).

    ``live[i]``: bytes of live tensors after op i (the simulator's timeline, plus the optimizer
    state with ``full``); ``reserved[i]``: bytes
    the allocator holds after op i; ``largest_free[i]``: its largest free block after op i.
    ``fragmentation`` = 1 - live / reserved at the reserved peak (see :func:`fragmentation_at_peak`).
    """

    live: np.ndarray
    reserved: np.ndarray
    largest_free: np.ndarray
    peak: int
    reserved_peak: int
    fragmentation: float
    policy: str = "caching"
    segments: int = 0
    full: bool = False

    def stats(self) -> dict[str, Any]:
        return {"peak": self.peak, "reserved_peak": self.reserved_peak, "fragmentation": self.fragmentation,
                "waste": self.reserved_peak - self.peak, "segments": self.segments, "allocator": self.policy,
                "full_arena": self.full}


def fragmentation_at_peak(live: np.ndarray, reserved: np.ndarray) -> float:
    """1 - live / reserved at the reserved peak: the share of the reserved bytes that the tensors
    cannot use when they need the most of them. ``reserved`` never shrinks in this model, so the
    peak is a plateau from the op that first reaches it to the end; the live bytes taken are the
    most live bytes on that plateau (0 for an empty schedule)."""
    if len(reserved) == 0 or reserved.max() <= 0:
        return 0.0
    i = int(np.argmax(reserved))
    top = reserved[i]
    on_plateau = reserved[i:] == top
    return float(1.0 - live[i:][on_plateau].max() / top)



def run_step(alloc: Allocator, graph: Graph, ops: list[tuple[str, int]], residency: Residency, capacity: int | None,
             trace: tuple[np.ndarray, np.ndarray] | None = None, outside: int = 0, upto: int | None = None,
             side_of: Callable[[int], str] | None = None, inplace: bool = True) -> None:
    """Apply a schedule's ops to ``alloc`` (footprint and largest free block after each op into
    ``trace``); then the step is over and its tensors are freed. With ``upto``, stop right after op
    ``upto`` instead, leaving the pool as it is at that moment. ``side_of(v)``: the end of the
    best-fit block node v's output goes to ("left" for all when None), as an eviction run placed it.
    The blocks follow the simulator's live set (``residency``, ``SimResult.residency``): a copy takes a
    block at its compute or reload and gives it back where its bytes stop counting (its free; for a free an
    offload copy still reads, rule 9, just before the op where the copy has ended). ``inplace``: an op
    written in place (rule 8) takes its input's block; False: copy-on-write, a block of its own while the
    input keeps its block to its free (a pool run with ``inplace_writes=False``).
    On an FSDP rank, FSDP2's own buffers (:func:`bonsai_core.fsdp.buffer_events`) are allocated and freed
    before each op on their streams, and a gradient FSDP holds keeps its block past the graph's free;
    with an optimizer, its step's temporaries (:data:`bonsai_core.optimizer.STEP_TEMPORARIES`: AdamW's
    ``_foreach_sqrt``, one tensor per parameter) are allocated after the last op, then freed."""
    mem = graph.mem.tolist()
    holds = ((graph.mem > 0) & ~graph.is_view).tolist()
    starts, ends = blocks_taken_and_given(ops, residency, holds, inplace)
    fsdp = _FsdpBuffers(alloc, graph, ops, capacity, outside)

    def malloc(owner: int, nbytes: int, what: str, i: int, side: str = "left", stream: str = DEFAULT_STREAM) -> None:
        if alloc.malloc(owner, nbytes, side, stream) is None and (side == "left" or alloc.malloc(owner, nbytes, stream=stream) is None):
            raise out_of_pool(alloc, capacity, outside, i, what, nbytes)

    fsdp.malloc = malloc
    to_step = to_the_optimizer_step(graph)
    for i, (kind, v) in enumerate(ops):
        fsdp.before(i)
        for u in ends.get(i, ()):
            # a gradient FSDP holds keeps its block past the graph's free, and one the optimizer steps from
            if kind != FREE or not (fsdp.keeps(u) or u in to_step):
                alloc.free(u)
        if i in starts:
            if starts[i] >= 0:
                alloc.hand_over(starts[i], v)
            else:
                side = "left" if side_of is None else side_of(v)
                malloc(v, mem[v], f"computing node {v}, {graph.names[v]!r}", i, side)
        if trace is not None:
            trace[0][i] = alloc.footprint + outside
            trace[1][i] = alloc.largest_free
        if i == upto:
            return
    fsdp.before(len(ops))  # the post-backward of the units still holding gradients
    optimizer_step(alloc, graph, malloc, len(ops) - 1)
    if trace is not None and ops:
        trace[0][-1] = max(trace[0][-1], alloc.footprint + outside)
    for v in [o for o in alloc.by_owner if o < graph.n or o >= FSDP_OWNERS]:  # the step is over: its tensors go
        alloc.free(v)


def to_the_optimizer_step(graph: Graph) -> set[int]:
    """The nodes whose blocks live past the step's last op to its optimizer step: the gradients, where they
    are set to None between steps (no buffer of theirs is fixed; on an FSDP rank the sharded gradients are
    FSDP's buffers instead, kept to the step's end)."""
    from bonsai_core.optimizer import gradient_nodes

    if not graph.grads_set_to_none or graph.fsdp is not None:
        return set()
    return {graph.storage_of(v) for v in gradient_nodes(graph)}  # a view's block is its base's


class _FsdpBuffers:
    """FSDP2's buffers of one replayed step, placed as :func:`bonsai_core.fsdp.buffer_events` says."""

    def __init__(self, alloc: Allocator, graph: Graph, ops: list[tuple[str, int]], capacity: int | None, outside: int) -> None:
        from bonsai_core.fsdp import buffer_events

        self.alloc, self.graph = alloc, graph
        self.events = buffer_events(graph, ops) if graph.fsdp is not None else None
        self.owners: dict[str, int] = {}
        self.made = 0  # buffers allocated so far: each gets an owner id of its own
        self.held: set[int] = set()  # gradient nodes FSDP holds
        self.dropped: set[int] = set()  # held gradients the graph has freed: their block waits for FSDP's free
        self.malloc: Callable[..., None] | None = None

    def keeps(self, v: int) -> bool:
        """Whether the graph's free of node ``v`` leaves its block to FSDP (a held gradient)."""
        if v in self.held:
            self.dropped.add(v)
            return True
        return False

    def before(self, i: int) -> None:
        if self.events is None or i >= len(self.events):
            return
        for b in self.events[i]:
            if b.key.startswith("grad:"):
                v = int(b.key[5:])
                if b.nbytes > 0:
                    self.held.add(v)
                else:
                    self.held.discard(v)
                    if v in self.dropped:
                        self.dropped.discard(v)
                        self.alloc.free(v)
            elif b.nbytes > 0:
                owner = self.owners[b.key] = FSDP_OWNERS + self.made
                self.made += 1
                self.malloc(owner, b.nbytes, f"FSDP's {b.key.partition(':')[0]}", i, stream=b.stream)
            else:
                self.alloc.free(self.owners.pop(b.key))


@dataclass(frozen=True)
class Placed:
    """One block of the address picture: ``kind`` is a fixed tensor's kind (param, grad, batch,
    optimizer), "activation" (a node's output: evictable) or "free"; ``addr`` is relative to the
    pool's first byte (segments are laid end to end, one 512-B gap apart)."""

    addr: int
    size: int
    kind: str
    name: str
    segment: int


def layout_at(graph: Graph, schedule: Schedule | list[tuple[str, int]], op: int, capacity: int | None = None,
              policy: Policy = "caching", optimizer: Optimizer = "adam") -> list[Placed]:
    """The full arena's address space right after op ``op`` of the (steady-state) step: every
    block, in address order, with what holds it. The placement is this model's replay (best fit,
    lowest address), not a pool method's own. O(len(ops) * blocks)."""
    if (graph.parallel or {}).get("pipeline"):
        raise BonsaiError(f"{graph.name!r} is a pipeline rank: its step replays every microbatch's ops, so one op "
                          "of its schedule is no one moment of it; the address picture is drawn for a rank without "
                          "pipeline parallel.")
    residency = simulate(graph, schedule).residency
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    if not 0 <= op < len(ops):
        raise ValueError(f"op {op} is outside the schedule's {len(ops)} ops")
    if policy == "arena" and capacity is None:
        raise BudgetError("The arena allocator is one pre-reserved pool: give it a capacity (a budget).")
    alloc, _ = full_arena(graph, capacity, policy, optimizer,
                          warmup=None if policy == "arena" else (lambda a: run_step(a, graph, ops, residency, capacity)))
    run_step(alloc, graph, ops, residency, capacity, upto=op)
    held = alloc.pinned
    out = []
    for b in alloc.blocks():
        if b.owner < 0:
            kind, name = "free", "free"
        elif b.owner >= FSDP_OWNERS:
            kind, name = "fsdp", "an FSDP buffer"
        elif b.owner >= graph.n:
            kind, name = held[b.owner].kind, held[b.owner].name
        else:
            kind, name = "activation", graph.names[b.owner]
        out.append(Placed(b.addr, b.size, kind, name, b.segment))
    return out


def replay(graph: Graph, schedule: Schedule | list[tuple[str, int]], capacity: int | None = None,
           policy: Policy = "caching", full: bool = True, optimizer: Optimizer = "adam",
           updates: Updates = "inplace", side_of: Callable[[int], str] | None = None,
           inplace_writes: bool = True, largest_free: bool = True, stop_above: int | None = None) -> AllocResult:
    """Replay a schedule (validated by the simulator first) through the allocator model.

    ``capacity`` is the pool's size in the budget's terms (``fixed_mem`` included): with the caching
    policy no segment may take ``reserved`` past it; the arena policy needs it. ``full`` places the
    fixed tensors and the ``optimizer``'s state in the pool (the full arena; module docstring): the
    schedule runs once as the first step, the optimizer state is allocated, and the second step is
    the one measured; ``updates`` says how the optimizer wrote the fixed tensors in between (module
    docstring). ``side_of`` places each output at one end of its best-fit block (the arena's
    cheap-tensor partitioning; :func:`run_step`); ``inplace_writes=False`` gives an op written in place a
    block of its own (copy-on-write) instead of its input's. Raises BudgetError at the first request that cannot
    be served within it, and ScheduleError for an invalid schedule. O(len(ops) * blocks).

    A pipeline rank (``parallel.pipeline``) replays its whole step, every microbatch's actions in its schedule's
    order (:mod:`bonsai_core.allocator.pipelined`); its arrays give, per op of the one microbatch's schedule, the
    most over the actions that run it, as rule 11's timeline does, and ``live`` is the bytes its blocks hold
    (so it is the simulator's timeline, and its peak the simulator's). ``largest_free=False``: a pipeline rank's
    ``largest_free`` is left out (zeros), for a caller that reads the reserved bytes only. ``stop_above``: a pipeline
    rank's replay without a capacity and not ``full`` may stop where its reserved bytes pass it, raising
    :class:`~bonsai_core.allocator.pipelined.ReservedPast` (the reserved bytes there, less than the peak).
    """
    sim = simulated(graph, schedule) if isinstance(schedule, Schedule) else simulate(graph, schedule)
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    fixed = graph.fixed_mem
    if capacity is not None and capacity < fixed:
        raise BudgetError(f"A pool of {format_bytes(capacity)} cannot even hold {graph.name!r}'s fixed memory "
                          f"({format_bytes(fixed)}); raise it.")
    if policy == "arena" and capacity is None:
        raise BudgetError("The arena allocator is one pre-reserved pool: give it a capacity (a budget).")
    pipeline = bool((graph.parallel or {}).get("pipeline"))
    length = rank_length(graph, ops) if pipeline else len(ops)
    reserved = np.empty(length, dtype=np.int64)
    largest = np.empty(length, dtype=np.int64)
    held = np.zeros(length, dtype=np.int64)  # a pipeline rank's live bytes (beyond the fixed ones when full)
    acts = action_ops(graph, ops) if pipeline else None

    def step(alloc: Allocator, trace: tuple[np.ndarray, np.ndarray] | None = None, outside: int = 0) -> None:
        if pipeline:  # the rank's whole schedule, every microbatch (bonsai_core.allocator.pipelined)
            run_pipeline_step(alloc, graph, ops, sim.residency, capacity, trace, outside, side_of=side_of,
                              inplace=inplace_writes, live=held if trace is not None else None,
                              reuse=capacity is None and not full, largest=largest_free, acts=acts,
                              stop_above=None if full else stop_above)
        else:
            run_step(alloc, graph, ops, sim.residency, capacity, trace, outside, side_of=side_of, inplace=inplace_writes)

    live = sim.timeline
    if full:
        alloc, extra = full_arena(graph, capacity, policy, optimizer, warmup=None if policy == "arena" else step,
                                  updates=updates)
        step(alloc, (reserved, largest))
        live = (held + fixed if pipeline else sim.timeline) + extra
    else:
        alloc = Allocator(None if capacity is None else capacity - fixed, policy)
        step(alloc, (reserved, largest), outside=fixed)
        live = held if pipeline else sim.timeline
    fragmentation = fragmentation_at_peak(live, reserved)  # a pipeline rank's over its whole step, in order
    if pipeline:  # per op of the one microbatch's schedule, the most over its actions (rule 11's timeline)
        live, reserved, largest = (per_op(a, graph, ops, acts) for a in (live, reserved, largest))
    base = live[0] if len(live) else fixed
    return AllocResult(live=live, reserved=reserved, largest_free=largest, peak=int(live.max()) if len(live) else base,
                       reserved_peak=int(reserved.max()) if len(reserved) else int(base),
                       fragmentation=fragmentation, policy=policy,
                       segments=sum(h is not None for h in alloc.heads), full=full)


def bounded_replay(graph: Graph, schedule: Schedule | list[tuple[str, int]], policy: Policy = "caching",
                   largest_free: bool = True, stop_above: int | None = None) -> AllocResult:
    """The replay whose reserved peak a reserved budget bounds (``--reserved``:
    :func:`bonsai_core.solvers.solve_reserved`, ``bonsai fit``): ``policy``'s allocator with the fixed tensors as
    one block outside the pool (``largest_free``, ``stop_above``: :func:`replay`'s)."""
    return replay(graph, schedule, policy=policy, full=False, largest_free=largest_free, stop_above=stop_above)


def solved_within(schedule: Schedule | list[tuple[str, int]]) -> Policy | None:
    """The allocator whose reserved bytes a plan was solved within (:func:`bonsai_core.solvers.solve_reserved`
    records its live budget), None for a plan solved for live bytes."""
    stats = schedule.stats if isinstance(schedule, Schedule) else {}
    return stats.get("allocator") if "live_budget" in stats else None


def replay_as_solved(graph: Graph, schedule: Schedule | list[tuple[str, int]], policy: Policy | None = None) -> AllocResult:
    """A schedule's allocator replay, one meaning wherever it is shown: a plan solved for reserved bytes as
    its budget bounded it (:func:`bounded_replay`, by ``policy`` or the allocator it was solved within), any
    other schedule in the full arena of ``policy`` (default the caching allocator)."""
    within = solved_within(schedule)
    if within is not None:
        return bounded_replay(graph, schedule, policy or within)
    return replay(graph, schedule, policy=policy or "caching")
