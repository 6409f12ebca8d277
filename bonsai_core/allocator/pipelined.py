"""A pipeline rank's step through the allocator model: its whole schedule, every microbatch.

The simulator judges a pipeline rank with one microbatch's schedule and rule 11's envelope (the other
microbatches in flight, :func:`bonsai_core.in_flight.working`): enough for the live bytes, not for the
addresses, which depend on the order the microbatches' blocks come and go. So the replay here runs the
rank's actions in the order its schedule runs them (``parallel.pipeline.actions``: 1F1B or interleaved
1F1B), each action replaying the ops of its stage's forward (backward) of the one microbatch's schedule
with that microbatch's own blocks: a tensor a stage's forward leaves for its backward keeps its block
from the microbatch's forward action to its backward action, while the other microbatches' blocks come
and go around it. The receive buffers and, under FSDP, the unsharded parameters are fixed tensors (the
graph's ``fixed_tensors``, :func:`bonsai_core.pipeline.with_pipeline`).

FSDP under pipeline parallel (:mod:`bonsai_core.pipeline`'s module doc, torch 2.13's
``backward_maybe_with_nosync``): in each backward the running unit's gradients keep their blocks until its
post-backward (where ``param_dtype`` differs from ``reduce_dtype``: ``FSDPParam.to_accumulated_grad_if_needed``
casts them); a unit's first post-backward in the step allocates its accumulated gradients in ``reduce_dtype``,
kept to its stage's last backward, after which ``perform_reduce_grad`` reduce-scatters the stage's units as
``foreach_reduce`` does (:meth:`bonsai_core.fsdp._Walk.reduce_scatter`: the previous input freed, this one's
allocated on the compute stream, the accumulated gradients freed, the sharded output allocated on the
reduce-scatter stream and freed). The simulator's rule 11 counts the same bytes, so the replay's live peak is
the simulator's (:func:`bonsai_core.schedule.simulate`), less where its end-of-step bound is the larger.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from bonsai_core.allocator.blocks import DEFAULT_STREAM
from bonsai_core.allocator.policies import Allocator
from bonsai_core.errors import ScheduleError

MICROBATCH_OWNERS = 2**36  # microbatch j's copy of node v is owner v + j * MICROBATCH_OWNERS (j = 0: v)
GRADIENT_OWNERS = 2**49  # FSDP's accumulated gradients (+ unit), reduce-scatter buffers (+ 2**20 + unit, ...)
SCATTER_STREAM = "reduce_scatter"  # bonsai_core.fsdp.REDUCE_SCATTER_STREAM


def rank_length(graph: Any, ops: list[tuple[str, int]]) -> int:
    """How many ops the rank's whole step replays: each op of the one microbatch's schedule once per
    microbatch (every stage runs every microbatch's forward and backward)."""
    return len(ops) * int(graph.parallel["pipeline"]["microbatches"])


def per_op(values: np.ndarray, graph: Any, ops: list[tuple[str, int]]) -> np.ndarray:
    """``values`` over the rank's whole step (:func:`rank_length` entries, action after action) as one entry per op
    of the one microbatch's schedule: the most over the actions that replay the op, as rule 11's timeline is."""
    order = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in action_ops(graph, ops)] or
                           [np.zeros(0, dtype=np.int64)])
    out = np.full(len(ops), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(out, order, np.asarray(values, dtype=np.int64))
    return out


def op_segments(graph: Any, ops: list[tuple[str, int]]) -> np.ndarray:
    """int64[len(ops)]: each op's stage (local) and phase, ``2 stage + 1`` in the backward (rule 11's)."""
    from bonsai_core.in_flight import _segments

    pipeline = graph.parallel["pipeline"]
    stage_of = np.zeros(graph.n, dtype=np.int64)
    for k, (_, a, b) in enumerate(pipeline["stages"]):
        stage_of[int(a):int(b) + 1] = k
    return _segments(graph, ops, stage_of)


def action_ops(graph: Any, ops: list[tuple[str, int]]) -> list[tuple[int, list[int]]]:
    """The rank's actions in schedule order, each as (its microbatch, the positions in ``ops`` it replays)."""
    from bonsai_core.in_flight import BACKWARD

    segment = op_segments(graph, ops)
    by_segment: dict[int, list[int]] = {}
    for i, s in enumerate(segment.tolist()):
        by_segment.setdefault(s, []).append(i)
    out = [(int(j), by_segment.get(2 * int(k) + (phase == BACKWARD), []))
           for phase, k, j in graph.parallel["pipeline"]["actions"]]
    replayed = sorted(i for _, ids in out for i in ids)
    m = int(graph.parallel["pipeline"]["microbatches"])
    if replayed != sorted(list(range(len(ops))) * m):
        raise ScheduleError(f"{graph.name!r}: the pipeline's actions do not replay each op of the schedule once per "
                            "microbatch (a stage's forward or backward without an action?)")
    return out


class _Held:
    """The exact bytes of the blocks the step holds (not rounded), by owner, and their total."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}
        self.total = 0

    def add(self, owner: int, nbytes: int) -> None:
        self.bytes[owner] = nbytes
        self.total += nbytes

    def drop(self, owner: int) -> None:
        self.total -= self.bytes.pop(owner, 0)


class _Gradients:
    """FSDP's gradients under pipeline parallel as allocator events (module doc)."""

    def __init__(self, graph: Any, malloc: Callable[..., None], alloc: Allocator, held: _Held) -> None:
        from bonsai_core.fsdp import DTYPE_BYTES, _backward_unit, _forward_owner

        fsdp = graph.fsdp
        self.graph, self.malloc, self.alloc, self.held = graph, malloc, alloc, held
        self.cast = bool(fsdp.get("param_dtype")) and (fsdp.get("reduce_dtype") or "fp32") != fsdp["param_dtype"]
        ratio = DTYPE_BYTES[fsdp.get("reduce_dtype") or "fp32"] / DTYPE_BYTES[fsdp["param_dtype"]] \
            if fsdp.get("param_dtype") else 1.0
        self.unit_grads = [int(u[3] * ratio) for u in fsdp["units"]]
        self.world = int(fsdp["world"])
        self.reads = _backward_unit(graph, _forward_owner(graph, fsdp["units"]))
        self.stage_units: dict[int, list[int]] = {}  # each stage's units, by the span their first node is in
        for k, (_, a, b) in enumerate(graph.parallel["pipeline"]["stages"]):
            self.stage_units[k] = [u for u, unit in enumerate(fsdp["units"]) if int(a) <= int(unit[1]) <= int(b)]
        self.accumulated: set[int] = set()
        self.running: list[int] = []  # owners of the running unit's gradients
        self.dropped: set[int] = set()  # of those, the ones the graph has freed (their blocks wait for FSDP)
        self.current = -1
        self.scatter_input: int | None = None

    def begin(self) -> None:
        self.current = -1

    def compute(self, v: int, base: int, i: int) -> None:
        """A backward compute of node ``v`` (of the microbatch whose owners start at ``base``): a unit boundary
        is a post-backward; a gradient (an output) is held by the running unit, in its storage's block."""
        u = int(self.reads[v])
        if u >= 0 and u != self.current:
            if self.current >= 0:
                self.post_backward(self.current, i)
            self.current = u
        if self.cast and self.graph.is_output[v]:
            self.running.append(base + self.graph.storage_of(v))

    def keeps(self, owner: int) -> bool:
        """Whether the graph's free of ``owner`` leaves its block to FSDP (the running unit's gradient)."""
        if owner in self.running:
            self.dropped.add(owner)
            return True
        return False

    def post_backward(self, u: int, i: int) -> None:
        """Unit ``u``'s post-backward in a no-sync backward: its gradients accumulated (allocated the first
        time in the step), the running ones freed."""
        if u not in self.accumulated:
            self.accumulated.add(u)
            self.malloc(GRADIENT_OWNERS + u, self.unit_grads[u], f"FSDP's accumulated gradients of unit {u}", i)
        self._release_running()

    def _release_running(self) -> None:
        for owner in self.running:
            if owner in self.dropped:
                self._free(owner)
        self.running, self.dropped = [], set()

    def end_action(self, k: int, i: int) -> None:
        """The end of a backward of stage ``k``: the running unit's post-backward, and every unit of the stage
        has gradients accumulated (a unit whose backward reads none of its forward tensors, the embedding's,
        has its post-backward run by the root's final callback)."""
        if self.current >= 0:
            self.post_backward(self.current, i)
        self.current = -1
        for u in self.stage_units.get(k, []):
            if u not in self.accumulated:
                self.post_backward(u, i)
        self._release_running()  # gradients of no unit's (read no unit's forward tensors): the graph's to free

    def reduce(self, k: int, i: int) -> None:
        """``perform_reduce_grad`` after stage ``k``'s last backward: each unit's accumulated gradients
        reduce-scattered (``foreach_reduce``, module doc)."""
        for u in self.stage_units.get(k, []):
            if u not in self.accumulated:
                continue
            if self.scatter_input is not None:
                self._free(self.scatter_input)
            self.scatter_input = GRADIENT_OWNERS + 2**20 + u
            self.malloc(self.scatter_input, self.unit_grads[u], f"FSDP's reduce-scatter input of unit {u}", i)
            self.accumulated.discard(u)
            self._free(GRADIENT_OWNERS + u)
            output = GRADIENT_OWNERS + 2**21 + u
            self.malloc(output, -(-self.unit_grads[u] // self.world), f"FSDP's reduce-scatter output of unit {u}", i,
                        stream=SCATTER_STREAM)
            self._free(output)

    def _free(self, owner: int) -> None:
        self.alloc.free(owner)
        self.held.drop(owner)


def run_pipeline_step(alloc: Allocator, graph: Any, ops: list[tuple[str, int]], residency: Any,
                      capacity: int | None, trace: tuple[np.ndarray, np.ndarray] | None = None, outside: int = 0,
                      side_of: Callable[[int], str] | None = None, inplace: bool = True,
                      live: np.ndarray | None = None) -> None:
    """A pipeline rank's whole step applied to ``alloc`` (module doc): :func:`run_step`'s contract, over
    :func:`rank_length` ops (each action's ops in turn; ``trace`` and ``live``, the exact bytes held, after each),
    then the optimizer step; at the end the step's blocks are freed."""
    from bonsai_core.allocator.replaying import _blocks_taken_and_given, _optimizer_step, out_of_pool
    from bonsai_core.in_flight import BACKWARD
    from bonsai_core.schedule import FREE

    mem = graph.mem.tolist()
    holds = ((graph.mem > 0) & ~graph.is_view).tolist()
    starts, ends = _blocks_taken_and_given(ops, residency, holds, inplace)
    held = _Held()

    def malloc(owner: int, nbytes: int, what: str, i: int, side: str = "left", stream: str = DEFAULT_STREAM) -> None:
        if alloc.malloc(owner, nbytes, side, stream) is None and (side == "left" or alloc.malloc(owner, nbytes, stream=stream) is None):
            raise out_of_pool(alloc, capacity, outside, i, what, nbytes)
        held.add(owner, nbytes)

    grads = _Gradients(graph, malloc, alloc, held) if graph.fsdp is not None else None
    acts = action_ops(graph, ops)
    pipeline = graph.parallel["pipeline"]
    last_backward = {int(k): n for n, (phase, k, _) in enumerate(pipeline["actions"]) if phase == BACKWARD}
    position = 0
    for n, ((phase, k, _), (j, ids)) in enumerate(zip(pipeline["actions"], acts)):
        base = j * MICROBATCH_OWNERS
        backward = phase == BACKWARD
        if grads is not None:
            grads.begin()
        for i in ids:
            kind, v = ops[i]
            for u in ends.get(i, ()):
                if kind == FREE and grads is not None and backward and grads.keeps(base + u):
                    continue
                alloc.free(base + u)
                held.drop(base + u)
            if i in starts:
                if starts[i] >= 0:
                    alloc.hand_over(base + starts[i], base + v)
                    held.drop(base + starts[i])
                    held.add(base + v, mem[v])
                else:
                    side = "left" if side_of is None else side_of(v)
                    malloc(base + v, mem[v], f"computing node {v}, {graph.names[v]!r} (microbatch {j})", i, side)
            if grads is not None and backward and kind == "compute" and not graph.is_forward[v]:
                grads.compute(v, base, position)
            if trace is not None:
                trace[0][position] = alloc.footprint + outside
                trace[1][position] = alloc.largest_free
            if live is not None:
                live[position] = held.total + outside
            position += 1
        if grads is not None and backward:
            grads.end_action(int(k), position - 1)
            if last_backward[int(k)] == n:
                grads.reduce(int(k), position - 1)
    # the optimizer step's temporaries, allocated together, then freed: counted at the last op
    before = set(alloc.by_owner)
    _optimizer_step(alloc, graph, malloc, position - 1)
    if position:
        if trace is not None:
            trace[0][position - 1] = max(trace[0][position - 1], alloc.footprint + outside)
        if live is not None:
            live[position - 1] = max(live[position - 1], held.total + outside)
    for owner in [o for o in held.bytes if o not in before and o not in alloc.by_owner]:
        held.drop(owner)
    for owner in [o for o in alloc.by_owner if o < graph.n or o >= MICROBATCH_OWNERS]:  # the step is over
        alloc.free(owner)
