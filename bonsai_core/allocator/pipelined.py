"""A pipeline rank's step through the allocator model: its whole schedule, every microbatch.

The simulator judges a pipeline rank with one microbatch's schedule and rule 11's envelope (the other
microbatches in flight, :func:`bonsai_core.in_flight.working`): enough for the live bytes, not for the
addresses, which depend on the order the microbatches' blocks come and go. So the replay here runs the
rank's actions in the order its schedule runs them (``parallel.pipeline.actions``: 1F1B or interleaved
1F1B), each action replaying the ops of its stage's forward (backward) of the one microbatch's schedule
with that microbatch's own blocks: a tensor a stage's forward leaves for its backward keeps its block
from the microbatch's forward action to its backward action, while the other microbatches' blocks come
and go around it. The receive buffers and, under FSDP, the unsharded parameters are fixed tensors (the
graph's ``fixed_tensors``, :func:`bonsai_core.pipeline.with_pipeline`), the latter given back unit by unit at
their stage's ``perform_reduce_grad`` (outside the pool: the pool does not reuse their bytes).

FSDP under pipeline parallel (:mod:`bonsai_core.pipeline`'s module doc, torch 2.13's
``backward_maybe_with_nosync``): where ``param_dtype`` differs from ``reduce_dtype``, in each backward the running
unit's gradients keep their blocks until its post-backward (``FSDPParam.to_accumulated_grad_if_needed`` casts
them), and a unit's first post-backward in the step allocates its accumulated gradients in ``reduce_dtype``; else
the stage's first backward's gradients keep their blocks as the accumulated ones (``AccumulateGrad``'s ``.grad``).
They are kept to the stage's last backward, after which ``perform_reduce_grad`` reshards each unit and
reduce-scatters it as ``foreach_reduce`` does (:meth:`bonsai_core.fsdp._Walk.reduce_scatter`: the previous input
freed, this one's allocated on the compute stream, the accumulated gradients freed, the sharded output allocated
on the reduce-scatter stream and freed), the last input freed at the end (the stage's final callback), all counted
at the action's last op. The simulator's rule 11 counts the same bytes, so the replay's live peak is the simulator's
(:func:`bonsai_core.schedule.simulate`).

The steady phase is not replayed microbatch by microbatch once it repeats (:func:`periodic_regions`,
:func:`_skip_repeats`): the replay is deterministic, and it sees a microbatch only through its owner ids, so a
run of actions that is an earlier run with every microbatch index shifted by ``d`` (same phases, stages,
and no stage's last backward), started from the earlier run's state with the same shift, does what the
earlier run did, shifted: the same blocks at the same addresses, the same bytes after every op. Where the
state at a window's end (the allocator's segments and blocks, the held bytes and FSDP's gradients, each
microbatch's owners named relative to the window's first microbatch) equals the state at an earlier
window's end, every later window of the run repeats the windows between, so their trace is copied and the
state shifted to the run's end instead of replayed; the cool-down phase is replayed. Exact, not a bound:
``tests/test_parallel.py`` checks the whole trace against the full replay.

The first rank's placement never repeats (its in-flight microbatches' blocks keep moving in the pool), but a run
with more microbatches begins with a shorter run's actions: without a capacity nothing is refused, so those
actions replay block for block, and a replay starts from the state a shorter run of the same stages and plan kept
where the two runs part (:class:`_Prefix`; a layout's batch search doubles the microbatches).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from bonsai_core.allocator.blocks import DEFAULT_STREAM
from bonsai_core.allocator.policies import Allocator
from bonsai_core.allocator.step import blocks_taken_and_given, optimizer_step, out_of_pool
from bonsai_core.errors import BudgetError, ScheduleError

MICROBATCH_OWNERS = 2**36  # microbatch j's copy of node v is owner v + j * MICROBATCH_OWNERS (j = 0: v)
GRADIENT_OWNERS = 2**49  # FSDP's accumulated gradients (+ unit; + 2**22 + node: a first backward's gradient
# kept as .grad), reduce-scatter buffers (+ 2**20 + unit, ...)
UNSHARDED_OWNERS = 2**51  # a unit's unsharded parameters given back (+ unit): fixed bytes, no block
SCATTER_STREAM = "reduce_scatter"  # bonsai_core.fsdp.REDUCE_SCATTER_STREAM


class ReservedPast(BudgetError):
    """A replay stopped where its reserved bytes passed a limit (:func:`run_pipeline_step`'s ``stop_above``)."""

    def __init__(self, reserved: int, limit: int) -> None:
        super().__init__(f"The replay's reserved bytes reached {reserved} bytes, past {limit}; it stopped there.")
        self.reserved = reserved


def rank_length(graph: Any, ops: list[tuple[str, int]]) -> int:
    """How many ops the rank's whole step replays: each op of the one microbatch's schedule once per
    microbatch (every stage runs every microbatch's forward and backward)."""
    return len(ops) * int(graph.parallel["pipeline"]["microbatches"])


def per_op(values: np.ndarray, graph: Any, ops: list[tuple[str, int]],
           acts: list[tuple[int, list[int]]] | None = None) -> np.ndarray:
    """``values`` over the rank's whole step (:func:`rank_length` entries, action after action) as one entry per op
    of the one microbatch's schedule: the most over the actions that replay the op, as rule 11's timeline is.
    ``acts``: :func:`action_ops` of the graph and ops, when the caller has them."""
    acts = action_ops(graph, ops) if acts is None else acts
    arrays: dict[int, np.ndarray] = {}  # the actions of a stage and phase share one list of positions
    for _, ids in acts:
        if id(ids) not in arrays:
            arrays[id(ids)] = np.asarray(ids, dtype=np.int64)
    order = np.concatenate([arrays[id(ids)] for _, ids in acts] or
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
    m = int(graph.parallel["pipeline"]["microbatches"])
    replayed = np.bincount(np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in out] or
                                          [np.zeros(0, dtype=np.int64)]), minlength=len(ops))
    if len(replayed) != len(ops) or (replayed != m).any():
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
    """FSDP's gradients under pipeline parallel as allocator events (module doc), and the unsharded parameters each
    stage's ``perform_reduce_grad`` gives back (fixed bytes, outside the pool: held as negative bytes)."""

    def __init__(self, graph: Any, malloc: Callable[..., None], alloc: Allocator, held: _Held) -> None:
        from bonsai_core.fsdp import DTYPE_BYTES, _backward_unit, _forward_owner
        from bonsai_core.in_flight import kept_gradients, stages_of

        fsdp = graph.fsdp
        self.graph, self.malloc, self.alloc, self.held = graph, malloc, alloc, held
        self.cast = bool(fsdp.get("param_dtype")) and (fsdp.get("reduce_dtype") or "fp32") != fsdp["param_dtype"]
        ratio = DTYPE_BYTES[fsdp.get("reduce_dtype") or "fp32"] / DTYPE_BYTES[fsdp["param_dtype"]] \
            if fsdp.get("param_dtype") else 1.0
        self.unit_grads = [int(u[3] * ratio) for u in fsdp["units"]]
        self.unsharded = [int(u[3]) for u in fsdp["units"]]
        self.world = int(fsdp["world"])
        self.reads = _backward_unit(graph, _forward_owner(graph, fsdp["units"]))
        self.stage_units: dict[int, list[int]] = {}  # each stage's units, by the span their first node is in
        for k, (_, a, b) in enumerate(graph.parallel["pipeline"]["stages"]):
            self.stage_units[k] = [u for u, unit in enumerate(fsdp["units"]) if int(a) <= int(unit[1]) <= int(b)]
        # without a cast the stage's first backward's gradients are the accumulated ones (AccumulateGrad's .grad)
        self.kept = {} if self.cast else kept_gradients(graph, stages_of(graph))
        self.accumulated: set[int] = set()
        self.grad_owners: dict[int, list[int]] = {}  # each unit's accumulated gradients' blocks
        self.running: list[int] = []  # owners of the running unit's gradients
        self.dropped: set[int] = set()  # of those, the ones the graph has freed (their blocks wait for FSDP)
        self.current = -1
        self.stage = -1
        self.first_done: set[int] = set()  # the stages whose first backward has run
        self.scatter_input: int | None = None

    def begin(self, k: int) -> None:
        self.current, self.stage = -1, k

    def state(self) -> tuple:
        """What changes over the step (a prefix keeps it, :class:`_Prefix`)."""
        return (self.accumulated, self.grad_owners, self.running, self.dropped, self.current, self.first_done,
                self.scatter_input)

    def restore(self, state: tuple) -> None:
        (self.accumulated, self.grad_owners, self.running, self.dropped, self.current, self.first_done,
         self.scatter_input) = state

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

    def acts_on(self, op: tuple[str, int]) -> bool:
        """Whether :meth:`compute` or :meth:`keeps` does anything for ``op`` in a backward: a backward compute that
        reads a unit's forward tensors (a post-backward may follow) or makes a gradient FSDP holds, or the graph's
        free of a gradient that stays the parameter's ``.grad``."""
        kind, v = op
        if kind != "compute":
            return v in self.kept
        return not self.graph.is_forward[v] and (
            int(self.reads[v]) >= 0 or (self.cast and bool(self.graph.is_output[v])))

    def keeps(self, base: int, v: int) -> bool:
        """Whether the graph's free of node ``v`` (of the microbatch whose owners start at ``base``) leaves its
        block to FSDP: the running unit's gradient, or in the stage's first backward without a cast the gradient
        ``AccumulateGrad`` keeps as ``.grad`` (its block handed to the unit's accumulated gradients)."""
        owner = base + v
        if owner in self.running:
            self.dropped.add(owner)
            return True
        if v in self.kept and self.stage not in self.first_done:
            kept = GRADIENT_OWNERS + 2**22 + v
            self.alloc.hand_over(owner, kept)
            self.held.drop(owner)
            self.held.add(kept, int(self.graph.mem[v]))
            self.grad_owners.setdefault(self.kept[v], []).append(kept)
            return True
        return False

    def post_backward(self, u: int, i: int) -> None:
        """Unit ``u``'s post-backward in a no-sync backward: its gradients accumulated (with a cast allocated the
        first time in the step), the running ones freed."""
        if u not in self.accumulated:
            self.accumulated.add(u)
            if self.cast:
                self.grad_owners[u] = [GRADIENT_OWNERS + u]
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
        self.first_done.add(k)

    def reduce(self, k: int, i: int) -> None:
        """``perform_reduce_grad`` after stage ``k``'s last backward: each unit resharded (its unsharded
        parameters given back) and its accumulated gradients reduce-scattered (``foreach_reduce``, module doc),
        then the last reduce-scatter input freed (its ``_root_post_backward_final_callback`` clears the inputs
        FSDP retains)."""
        for u in self.stage_units.get(k, []):
            self.held.add(UNSHARDED_OWNERS + u, -self.unsharded[u])
            if u not in self.accumulated:
                continue
            if self.scatter_input is not None:
                self._free(self.scatter_input)
            self.scatter_input = GRADIENT_OWNERS + 2**20 + u
            self.malloc(self.scatter_input, self.unit_grads[u], f"FSDP's reduce-scatter input of unit {u}", i)
            self.accumulated.discard(u)
            for owner in self.grad_owners.pop(u, []):
                self._free(owner)
            output = GRADIENT_OWNERS + 2**21 + u
            self.malloc(output, -(-self.unit_grads[u] // self.world), f"FSDP's reduce-scatter output of unit {u}", i,
                        stream=SCATTER_STREAM)
            self._free(output)
        if self.scatter_input is not None:
            self._free(self.scatter_input)
            self.scatter_input = None

    def _free(self, owner: int) -> None:
        self.alloc.free(owner)
        self.held.drop(owner)


def periodic_regions(actions: list, longest_period: int = 64) -> list[tuple[int, int, int, int]]:
    """The runs of ``actions`` (each ``(phase, stage, microbatch)``) that repeat: ``(start, period, shift,
    windows)``, ``windows`` >= 3 windows of ``period`` actions each, window w being the first with every
    microbatch index plus ``w * shift``, the same phases and stages, and none a stage's last backward (its
    reduce-scatter makes it differ). Found left to right, at each start the period covering the most actions
    (the shorter on a tie); ``longest_period`` only bounds the search (interleaved 1F1B's steady phase repeats
    every 2 x stages per rank x pipeline degree actions: 32 at degree 8)."""
    from bonsai_core.in_flight import BACKWARD

    last = {int(k): n for n, (phase, k, _) in enumerate(actions) if phase == BACKWARD}
    sig = [(phase, int(k), phase == BACKWARD and n == last.get(int(k))) for n, (phase, k, _) in enumerate(actions)]
    mb = [int(j) for _, _, j in actions]
    out, a, n = [], 0, len(actions)

    def windows(a: int, p: int) -> int:
        if a + p >= n:
            return 0
        d, i = mb[a + p] - mb[a], 0
        while a + i < n and not sig[a + i][2] and sig[a + i] == sig[a + i % p] \
                and mb[a + i] == mb[a + i % p] + (i // p) * d:
            i += 1
        return i // p

    while a < n:
        best = max(((windows(a, p) * p, -p) for p in range(1, min(longest_period, (n - a) // 3) + 1)), default=(0, 0))
        p = -best[1]
        if p and best[0] >= 3 * p:
            out.append((a, p, mb[a + p] - mb[a], best[0] // p))
            a += best[0]
        else:
            a += 1
    return out


def _microbatch_of(owner: int, n: int) -> tuple[int, int] | None:
    """(microbatch, node) of a microbatch's owner id; None for an owner of the step (fixed tensors, FSDP's)."""
    if owner < n:
        return 0, owner
    if MICROBATCH_OWNERS <= owner < GRADIENT_OWNERS:
        return owner // MICROBATCH_OWNERS, owner % MICROBATCH_OWNERS
    return None


def _relative(owner: int, n: int, first: int) -> Any:
    """An owner named relative to microbatch ``first``: the same for the shifted copy of a shifted run."""
    of = _microbatch_of(owner, n)
    return owner if of is None or owner < 0 else (of[0] - first, of[1], "microbatch")


def _state(alloc: Allocator, held: _Held, grads: "_Gradients | None", n: int, first: int) -> tuple:
    """Everything the rest of the replay reads, each microbatch's owners relative to microbatch ``first``: the
    segments' blocks (address, size, mapped, owner), the free blocks of each pool, the counters, the exact bytes
    held and FSDP's gradient state."""
    chains = []
    for head in alloc.heads:
        chain, b = [], head
        while b is not None:
            chain.append((b.addr, b.size, b.mapped, _relative(b.owner, n, first)))
            b = b.next
        chains.append(tuple(chain) if head is not None else None)
    free = tuple(sorted((pool, b.addr, b.size) for pool, blocks in alloc.free_blocks.items() for b in blocks))
    counters = (alloc.reserved, alloc.allocated, alloc.high_water, alloc._next_addr, tuple(alloc.pools),
                tuple(sorted(getattr(alloc, "expandable", {}).items())))
    kept = tuple(sorted((repr(_relative(o, n, first)), b) for o, b in held.bytes.items()))
    fsdp = None if grads is None else (tuple(sorted(grads.accumulated)), grads.current, grads.scatter_input,
                                       tuple(_relative(o, n, first) for o in grads.running),
                                       tuple(sorted(repr(_relative(o, n, first)) for o in grads.dropped)),
                                       tuple(sorted(grads.first_done)),
                                       tuple(sorted((u, tuple(o)) for u, o in grads.grad_owners.items())))
    return tuple(chains), free, counters, kept, held.total, fsdp


def _shift(alloc: Allocator, held: _Held, grads: "_Gradients | None", n: int, by: int) -> None:
    """Rename every microbatch's owners to microbatch index + ``by``: the state the skipped windows end in."""
    def moved(owner: int) -> int:
        of = _microbatch_of(owner, n)
        return owner if of is None else (of[0] + by) * MICROBATCH_OWNERS + of[1]

    alloc.by_owner = {moved(o): b for o, b in alloc.by_owner.items()}
    for o, b in alloc.by_owner.items():
        b.owner = o
    held.bytes = {moved(o): b for o, b in held.bytes.items()}
    if grads is not None:
        grads.running = [moved(o) for o in grads.running]
        grads.dropped = {moved(o) for o in grads.dropped}


@dataclass
class _Prefix:
    """A pipeline replay's state at the start of action ``len(actions)``, with the traces up to there: a later replay
    of the same structure (:func:`_structure_key`) whose actions begin with ``actions`` starts from it. Without a
    capacity the pool never refuses a request, and the replay reads a microbatch's count only through its actions
    and the bytes outside the pool (the traces are kept without them), so the later replay's first ops are these,
    block for block."""

    actions: list
    position: int
    skipped: int
    alloc: Allocator
    held: tuple[dict, int]
    grads: tuple | None
    traces: tuple[np.ndarray, np.ndarray, np.ndarray]  # reserved (less outside), largest free, live (less outside)

    @classmethod
    def taken(cls, actions: list, position: int, skipped: int, alloc: Allocator, held: "_Held",
              grads: "_Gradients | None", traces: tuple, outside: int) -> "_Prefix":
        kept = (traces[0][:position] - outside, traces[1][:position].copy(), traces[2][:position] - outside)
        return cls([tuple(a) for a in actions], position, skipped, alloc.clone(), (dict(held.bytes), held.total),
                   None if grads is None else copy.deepcopy(grads.state()), kept)

    def continues(self, actions: list, last_backward: dict[int, int]) -> bool:
        """Whether ``actions`` begin with this prefix's and none of those is a stage's last backward there."""
        n = len(self.actions)
        return (len(actions) > n and all(tuple(a) == b for a, b in zip(actions[:n], self.actions))
                and all(at >= n for at in last_backward.values()))

    def restore(self, alloc: Allocator, held: "_Held", grads: "_Gradients | None", trace: tuple, live: np.ndarray,
                outside: int) -> tuple[int, int, int]:
        """The state and traces put back; returns (action, position, actions skipped) to go on from."""
        alloc.__dict__.update(self.alloc.clone().__dict__)
        held.bytes, held.total = dict(self.held[0]), self.held[1]
        if grads is not None:
            grads.restore(copy.deepcopy(self.grads))
        p = self.position
        trace[0][:p], trace[1][:p], live[:p] = self.traces[0] + outside, self.traces[1], self.traces[2] + outside
        return len(self.actions), p, self.skipped


class _Prefixes:
    """The latest prefix of each structure, the few most recent structures (a layout's batch search replays a rank
    and a plan at doubling microbatch counts, one layout after another)."""

    def __init__(self, size: int = 8) -> None:
        self.size, self.entries = size, OrderedDict()

    def get(self, key: str) -> _Prefix | None:
        if key in self.entries:
            self.entries.move_to_end(key)
        return self.entries.get(key)

    def put(self, key: str, prefix: _Prefix) -> None:
        self.entries[key] = prefix
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


_PREFIXES = _Prefixes()


def _structure_key(graph: Any, ops: list[tuple[str, int]], residency: Any, policy: str, inplace: bool,
                   largest: bool = True) -> str:
    """What a pipeline replay depends on besides its microbatches: the graph less its fixed tensors, name, op costs
    (timed again by each trace) and microbatch count, the plan, its live set, the allocator policy, and whether
    its trace holds the largest free block."""
    data = graph.to_dict()
    for field in ("name", "fixed_tensors", "fixed_mem"):
        data.pop(field, None)
    data["nodes"] = [{k: v for k, v in node.items() if k != "cost"} for node in data["nodes"]]
    parallel = json.loads(json.dumps(data.get("parallel") or {}))
    parallel.get("layout", {}).pop("microbatches", None)
    for field in ("microbatches", "actions"):
        parallel.get("pipeline", {}).pop(field, None)
    data["parallel"] = parallel
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode())
    digest.update(json.dumps([list(op) for op in ops]).encode())
    for a in (residency.node, residency.start, residency.end, residency.taken):
        digest.update(np.ascontiguousarray(a).tobytes())
    digest.update(f"{policy} {inplace}{'' if largest else ' no largest'}".encode())
    return digest.hexdigest()


def _snapshot_point(graph: Any, last_backward: dict[int, int]) -> int:
    """The action where this run and the run of twice its microbatches part (the next local batch a layout's search
    asks for), and before any stage's last backward: where a prefix is kept."""
    from bonsai_core.parallel import layout_of
    from bonsai_core.in_flight import actions

    pipeline = graph.parallel["pipeline"]
    m = int(pipeline["microbatches"])
    layout = dataclasses.replace(layout_of(**graph.parallel["layout"]), microbatches=2 * m)
    these, longer = [tuple(a) for a in pipeline["actions"]], actions(layout)
    n = 0
    while n < min(len(these), len(longer)) and these[n] == tuple(longer[n]):
        n += 1
    return min([n, *last_backward.values()])


def run_pipeline_step(alloc: Allocator, graph: Any, ops: list[tuple[str, int]], residency: Any,
                      capacity: int | None, trace: tuple[np.ndarray, np.ndarray] | None = None, outside: int = 0,
                      side_of: Callable[[int], str] | None = None, inplace: bool = True,
                      live: np.ndarray | None = None, shortcut: bool = True, reuse: bool = False,
                      largest: bool = True, acts: list[tuple[int, list[int]]] | None = None,
                      stop_above: int | None = None) -> int:
    """A pipeline rank's whole step applied to ``alloc`` (module doc): :func:`run_step`'s contract, over
    :func:`rank_length` ops (each action's ops in turn; ``trace`` and ``live``, the exact bytes held, after each),
    then the optimizer step; at the end the step's blocks are freed. With ``shortcut``, the windows of the steady
    phase that repeat an earlier window's state are not replayed (module doc). With ``reuse`` (a fresh pool without a
    capacity, both traces), a run of the same stages and plan with fewer microbatches whose actions begin as these
    do is not replayed again: its state where the two runs part (:class:`_Prefix`) is the start. Returns the
    actions skipped. ``largest=False`` leaves the largest free block out of ``trace`` (zeros; a solve reads the
    reserved bytes only, and the largest free block is a walk over the pools after every op); ``acts``:
    :func:`action_ops` of the graph and ops, when the caller has them. ``stop_above``: without a capacity, raise
    :class:`ReservedPast` after the first action whose reserved bytes (plus ``outside``) pass it (they never shrink
    without a capacity, so the step's peak is past it too), instead of replaying the rest.

    Long: one loop over the rank's actions whose state (the allocator, FSDP's gradients, the window the
    shortcut watches, the position in the traces) every part of it reads and writes."""
    from bonsai_core.in_flight import BACKWARD
    from bonsai_core.schedule import FREE

    mem = graph.mem.tolist()
    holds = ((graph.mem > 0) & ~graph.is_view).tolist()
    starts, ends = blocks_taken_and_given(ops, residency, holds, inplace)
    held = _Held()

    between = [0, 0]  # the most reserved and held bytes since it was reset: the reduce-scatters between two ops

    def malloc(owner: int, nbytes: int, what: str, i: int, side: str = "left", stream: str = DEFAULT_STREAM) -> None:
        if alloc.malloc(owner, nbytes, side, stream) is None and (side == "left" or alloc.malloc(owner, nbytes, stream=stream) is None):
            raise out_of_pool(alloc, capacity, outside, i, what, nbytes)
        held.add(owner, nbytes)
        between[:] = max(between[0], alloc.footprint), max(between[1], held.total)

    grads = _Gradients(graph, malloc, alloc, held) if graph.fsdp is not None else None
    acts = action_ops(graph, ops) if acts is None else acts
    pipeline = graph.parallel["pipeline"]
    last_backward = {int(k): n for n, (phase, k, _) in enumerate(pipeline["actions"]) if phase == BACKWARD}
    regions = {a: (p, d, w) for a, p, d, w in (periodic_regions(pipeline["actions"]) if shortcut else [])}
    by_segment: dict[int, tuple[list[tuple[int, int]], np.ndarray]] = {}

    def action_events(n: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        """Action ``n``'s ops that change the allocator, the held bytes or FSDP's gradients, as (offset in the
        action, op), and for each op of the action the index of the last event up to it (0: none yet), the same
        for every action of its stage and phase."""
        phase, k, _ = pipeline["actions"][n]
        key = 2 * int(k) + (phase == BACKWARD)
        if key not in by_segment:
            ids = acts[n][1]
            gradient_events = grads is not None and phase == BACKWARD
            events = [(offset, i) for offset, i in enumerate(ids)
                      if i in ends or i in starts or (gradient_events and grads.acts_on(ops[i]))]
            offsets = np.asarray([offset for offset, _ in events], dtype=np.int64)
            by_segment[key] = events, np.searchsorted(offsets, np.arange(len(ids)), side="right")
        return by_segment[key]

    seen: dict[tuple, tuple[int, int]] = {}  # a window-end state -> (its window, its position)
    region: tuple[int, int, int, int] | None = None  # (start, period, shift, windows) being watched
    position = n = skipped = 0
    reuse = reuse and trace is not None and live is not None and side_of is None and not alloc.heads
    structure = _structure_key(graph, ops, residency, alloc.policy, inplace, largest) if reuse else None
    resumed = _PREFIXES.get(structure) if structure is not None else None
    if resumed is not None and resumed.continues(pipeline["actions"], last_backward):
        n, position, skipped = resumed.restore(alloc, held, grads, trace, live, outside)
        region = next(((a, p, d, w) for a, (p, d, w) in regions.items() if a < n < a + p * w), None)
    snapshot_at = _snapshot_point(graph, last_backward) if structure is not None else -1
    while n < len(acts):
        if n == snapshot_at:
            _PREFIXES.put(structure, _Prefix.taken(pipeline["actions"][:n], position, skipped, alloc, held, grads,
                                             (trace[0], trace[1], live), outside))
        if n in regions:
            region, seen = (n, *regions[n]), {}
        if region is not None and (n - region[0]) % region[1] == 0:
            start, period, shift, count = region
            w = (n - start) // period
            key = _state(alloc, held, grads, graph.n, int(acts[n][0]))
            if w < count and key in seen:
                earlier, at = seen[key]
                cycles = (count - w) // (w - earlier)
                block = position - at  # the ops of the repeating windows
                for c in range(cycles):
                    for a in ((trace or ()) + ((live,) if live is not None else ())):
                        a[position + c * block:position + (c + 1) * block] = a[at:position]
                _shift(alloc, held, grads, graph.n, cycles * (w - earlier) * shift)
                jump = cycles * (w - earlier) * period
                n, position, skipped, region = n + jump, position + cycles * block, skipped + jump, None
                continue
            seen[key] = (w, position)
            if w >= count:
                region = None
        (phase, k, _), (j, ids) = pipeline["actions"][n], acts[n]
        base = j * MICROBATCH_OWNERS
        backward = phase == BACKWARD
        if grads is not None:
            grads.begin(int(k))
        events, fill = action_events(n)
        recorded = [(alloc.footprint, alloc.largest_free if largest else 0, held.total)]  # before its first event
        for offset, i in events:
            kind, v = ops[i]
            for u in ends.get(i, ()):
                if kind == FREE and grads is not None and backward and grads.keeps(base, u):
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
                grads.compute(v, base, position + offset)
            if trace is not None or live is not None:
                recorded.append((alloc.footprint, alloc.largest_free if trace is not None and largest else 0,
                                 held.total))
        if trace is not None or live is not None:  # an op that is no event holds what the event before it left
            values = np.asarray(recorded, dtype=np.int64)[fill]
            span = slice(position, position + len(ids))
            if trace is not None:
                trace[0][span] = values[:, 0] + outside
                trace[1][span] = values[:, 1]
            if live is not None:
                live[span] = values[:, 2] + outside
        position += len(ids)
        if grads is not None and backward:
            grads.end_action(int(k), position - 1)
            if last_backward[int(k)] == n:  # counted at the action's last op, as rule 11 counts it
                between[:] = alloc.footprint, held.total
                grads.reduce(int(k), position - 1)
                if trace is not None:
                    trace[0][position - 1] = max(trace[0][position - 1], between[0] + outside)
                if live is not None:
                    live[position - 1] = max(live[position - 1], between[1] + outside)
        n += 1
        if stop_above is not None and capacity is None and alloc.footprint + outside > stop_above:
            raise ReservedPast(alloc.footprint + outside, stop_above)
    # the optimizer step's temporaries, allocated together, then freed: counted at the last op
    before = set(alloc.by_owner)
    optimizer_step(alloc, graph, malloc, position - 1)
    if position:
        if trace is not None:
            trace[0][position - 1] = max(trace[0][position - 1], alloc.footprint + outside)
        if live is not None:
            live[position - 1] = max(live[position - 1], held.total + outside)
    for owner in [o for o in held.bytes if o not in before and o not in alloc.by_owner]:
        held.drop(owner)
    for owner in [o for o in alloc.by_owner if o < graph.n or o >= MICROBATCH_OWNERS]:  # the step is over
        alloc.free(owner)
    return skipped
