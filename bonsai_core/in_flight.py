"""Simulator rule 11 (docs/DESIGN.md): the microbatches a pipeline rank holds in flight, and FSDP's gradients
and unsharded parameters under pipeline parallel, at each op of the one microbatch's schedule, and the order of
a rank's actions that they follow (:func:`actions`). What the rank holds and why:
:mod:`bonsai_core.pipeline`, which traces the rank and writes the graph's ``parallel.pipeline`` field read here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

FORWARD, BACKWARD = "F", "B"  # an action's phase in ``parallel.pipeline.actions``
FREE_OP = "free"  # bonsai_core.schedule.FREE
STAGES_PER_RANK = {"1f1b": 1, "interleaved-1f1b": 2}  # torchtitan's default without layers_per_stage


def actions(layout: Any) -> list[tuple[str, int, int]]:
    """The rank's compute actions in the order its schedule runs them: (``"F"`` or ``"B"``, the local stage
    (0 for 1F1B), the microbatch). From torch 2.13's schedules
    (:mod:`bonsai_core.pipeline`'s module doc)."""
    m, p, r = layout.microbatches, layout.pp, layout.rank
    if layout.pp_schedule == "1f1b":  # Schedule1F1B._step_microbatches
        warmup = min(m, p - r)
        out = [(FORWARD, 0, j) for j in range(warmup)]
        forward, backward = warmup, 0
        while True:
            out.append((BACKWARD, 0, backward))
            backward += 1
            if forward == m:
                break
            out.append((FORWARD, 0, forward))
            forward += 1
        return out + [(BACKWARD, 0, j) for j in range(backward, m)]
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    local = STAGES_PER_RANK[layout.pp_schedule]
    rounds = max(1, m // p)
    state = SimpleNamespace(n_local_stages=local, microbatches_per_round=m // rounds, pp_group_size=p,
                            _n_microbatches=m)
    order = ScheduleInterleaved1F1B._calculate_single_rank_operations(state, r)
    return [(FORWARD if a.computation_type == _ComputationType.FORWARD else BACKWARD, a.stage_index // p,
             a.microbatch_index) for a in order if a is not None]


def _staged(graph: Any, ops: Sequence[tuple[str, int]]) -> tuple | None:
    """A pipeline rank's schedule by stage: (its pipeline field, each stage's node span, each node's stage, each
    op's segment, 2 stage + phase); None for a graph that is no pipeline rank."""
    pipeline = (graph.parallel or {}).get("pipeline")
    if pipeline is None or not ops:
        return None
    spans = [(int(a), int(b)) for _, a, b in pipeline["stages"]]
    stage_of = stages_of(graph)
    return pipeline, spans, stage_of, _segments(graph, ops, stage_of)


def stages_of(graph: Any) -> np.ndarray:
    """int64[n]: each node's local stage on a pipeline rank (its index in ``parallel.pipeline.stages``; 0 elsewhere)."""
    out = np.zeros(graph.n, dtype=np.int64)
    for k, (_, a, b) in enumerate(((graph.parallel or {}).get("pipeline") or {}).get("stages", [])):
        out[int(a):int(b) + 1] = k
    return out


def working(graph: Any, ops: Sequence[tuple[str, int]], residency: Any) -> np.ndarray | None:
    """Rule 11: at each op of the one microbatch's schedule, the bytes the rank holds beyond that microbatch's
    tensors and ``fixed_mem``: the other microbatches in flight in the action it runs in (their stages'
    resident bytes at the end of their forward), the largest over the actions of its stage and phase, and
    under FSDP the gradients accumulated and held, less the parameters of the stages already reduced, resharded
    (:class:`_Accumulated`). None for a graph that is no pipeline rank."""
    staged = _staged(graph, ops)
    if staged is None:
        return None
    pipeline, spans, stage_of, segment = staged
    own = np.stack([residency.bytes_held(graph.mem, stage_of == k) for k in range(len(spans))])
    held = np.zeros(len(spans), dtype=np.int64)  # each stage's bytes at the end of its forward
    for k in range(len(spans)):
        forward_ops = np.flatnonzero(segment == 2 * k)
        held[k] = own[k, forward_ops[-1]] if len(forward_ops) else 0
    grads = _Accumulated(graph, ops, stage_of, segment, len(spans)) if graph.fsdp is not None else None
    lowest = np.iinfo(np.int64).min
    extra = np.full(len(ops), lowest, dtype=np.int64)
    others_copies = own.sum(axis=0) - own[np.clip(segment // 2, 0, len(spans) - 1), np.arange(len(ops))]
    for (phase, k, others, first, accumulated, last, reduced) in _action_states(pipeline, len(spans)):
        ids = np.flatnonzero(segment == 2 * k + (phase == BACKWARD))
        if not len(ids):
            continue
        in_flight = int(np.dot(others, held))
        value = in_flight + (grads.held(k, phase, first, accumulated, ids) - grads.resharded(reduced) if grads else 0)
        # the one microbatch's copies of other stages' nodes are no tensors of this action
        extra[ids] = np.maximum(extra[ids], value - others_copies[ids])
        if grads is not None and last:  # the stage's perform_reduce_grad, right after its last backward
            end = int(ids[-1])
            reducing = grads.reducing(k, accumulated) - grads.resharded(reduced)
            extra[end] = max(int(extra[end]), in_flight + reducing - int(others_copies[end]))
    extra[extra == lowest] = 0
    return extra


def holds_others(graph: Any) -> bool:
    """Whether ``graph`` is a pipeline rank that holds another microbatch in flight beside the one running, in
    some action of its schedule (the last rank of 1F1B never does)."""
    pipeline = (graph.parallel or {}).get("pipeline")
    return pipeline is not None and any(
        others.any() for _, _, others, *_ in _action_states(pipeline, len(pipeline["stages"])))


def _segments(graph: Any, ops: Sequence[tuple[str, int]], stage_of: np.ndarray) -> np.ndarray:
    """int64[len(ops)]: each op's stage and phase, ``2 stage + 1`` in the backward: a compute's node's stage,
    backward from the stage's first backward compute on, or earlier from the first compute after the stage's
    forward computed its last node for the first time (a checkpoint rebuilding what the first backward node
    reads runs in the backward action, before that node); any other op that of the compute before it (the
    first compute's before it)."""
    stages = int(stage_of.max()) + 1 if len(stage_of) else 1
    forward_ends = np.full(stages, -1, dtype=np.int64)  # each stage's last first-time forward compute
    first_backward = np.full(stages, len(ops), dtype=np.int64)
    computed = np.zeros(graph.n, dtype=bool)
    for i, (kind, v) in enumerate(ops):
        if kind != "compute":
            continue
        k = int(stage_of[v])
        if not graph.is_forward[v]:
            first_backward[k] = min(first_backward[k], i)
        elif not computed[v] and i < first_backward[k]:
            forward_ends[k] = i
        computed[v] = True
    starts = np.minimum(first_backward, forward_ends + 1)
    out = np.zeros(len(ops), dtype=np.int64)
    current = -1
    for i, (kind, v) in enumerate(ops):
        if kind == "compute":
            k = int(stage_of[v])
            current = 2 * k + (i >= starts[k])
        out[i] = current
    first = next((i for i, s in enumerate(out) if s >= 0), len(out))
    out[:first] = out[first] if first < len(out) else 0
    return out


def _action_states(pipeline: dict[str, Any], stages: int) -> list[tuple[str, int, np.ndarray, bool, np.ndarray,
                                                                     bool, np.ndarray]]:
    """For each action of the rank: its phase and stage, the other microbatches in flight per stage, whether it
    is its stage's first backward in the step, which stages have run their first backward before it (their
    accumulated gradients exist) and not yet their last (not yet reduce-scattered), whether it is its
    stage's last backward (after which the stage's gradients are reduce-scattered), and which stages have been
    reduce-scattered before it (their parameters resharded)."""
    in_flight = np.zeros(stages, dtype=np.int64)
    backwards = np.zeros(stages, dtype=np.int64)
    total = np.zeros(stages, dtype=np.int64)
    for phase, k, _ in pipeline["actions"]:
        total[int(k)] += phase == BACKWARD
    out = []
    for phase, k, _ in pipeline["actions"]:
        k = int(k)
        others = in_flight.copy()
        if phase == BACKWARD:
            others[k] -= 1  # this microbatch's own bytes are the one microbatch's timeline
        accumulated = (backwards > 0) & (backwards < total)
        out.append((phase, k, others, phase == BACKWARD and backwards[k] == 0, accumulated,
                    phase == BACKWARD and backwards[k] == total[k] - 1, (total > 0) & (backwards == total)))
        if phase == FORWARD:
            in_flight[k] += 1
        else:
            in_flight[k] -= 1
            backwards[k] += 1
    return out


class _Accumulated:
    """FSDP's gradients under pipeline parallel (module doc): each unit's accumulated unsharded gradients in
    reduce_dtype, from its first backward in the step to its stage's last. Where ``param_dtype`` is
    ``reduce_dtype``, autograd's ``AccumulateGrad`` keeps each gradient of the stage's first backward as the
    parameter's ``.grad`` and adds the later ones into it, so the accumulated gradients grow gradient by gradient
    (counted from the graph's free of their storage: until then they are the graph's bytes); else each backward's
    gradients stay the running unit's until its post-backward, which allocates the unit's accumulated ones in
    ``reduce_dtype`` the first time and adds them in. Each stage's ``perform_reduce_grad`` reshards its units'
    parameters, unit by unit before each one's reduce-scatter, to the end of the step."""

    def __init__(self, graph: Any, ops: Sequence[tuple[str, int]], stage_of: np.ndarray, segment: np.ndarray,
                 stages: int) -> None:
        from bonsai_core.fsdp import DTYPE_BYTES, _backward_unit, _forward_owner

        fsdp = graph.fsdp
        ratio = DTYPE_BYTES[fsdp.get("reduce_dtype") or "fp32"] / DTYPE_BYTES[fsdp.get("param_dtype") or "fp32"] \
            if fsdp.get("param_dtype") else 1.0
        self.unit_grads = [int(u[3] * ratio) for u in fsdp["units"]]  # a unit's reduce-scatter input
        self.unsharded = [int(u[3]) for u in fsdp["units"]]
        self.world = int(fsdp["world"])
        self.stage_units: list[list[int]] = [[] for _ in range(stages)]  # in the order perform_reduce_grad runs them
        for u, unit in enumerate(fsdp["units"]):
            self.stage_units[int(stage_of[int(unit[1])])].append(u)
        self.stage_unsharded = np.array([sum(self.unsharded[u] for u in units) for units in self.stage_units],
                                        dtype=np.int64)
        reads = _backward_unit(graph, _forward_owner(graph, fsdp["units"]))
        cast = ratio != 1.0
        kept = {} if cast else kept_gradients(graph, stage_of)
        self.accumulated = list(self.unit_grads) if cast else [0] * len(self.unit_grads)
        n = len(ops)
        self.running = np.zeros(n, dtype=np.int64)  # the running unit's gradients held (param dtype)
        self.done = np.zeros(n, dtype=np.int64)  # accumulated bytes made in this segment so far
        current, held, finished, where, waiting, made = -1, 0, set(), None, set(), 0
        for i, (kind, v) in enumerate(ops):
            if segment[i] != where:  # a stage's forward or backward begins
                current, held, finished, where, waiting, made = -1, 0, set(), segment[i], set(), 0
            if kind == "compute" and not graph.is_forward[v]:
                u = int(reads[v])
                if u >= 0 and u != current:
                    if current >= 0:  # its post-backward: its gradients accumulated, then freed
                        finished.add(current)
                    current, held, waiting = u, 0, set()
                if graph.is_output[v] and cast:
                    waiting.add(graph.storage_of(v))
            elif kind == FREE_OP and v in waiting:  # the graph's free: the unit holds the gradient's bytes from here
                waiting.discard(v)
                held += int(graph.mem[v])
            elif kind == FREE_OP and v in kept and segment[i] % 2:  # the gradient stays the parameter's .grad
                made += int(graph.mem[v])
                self.accumulated[kept[v]] += int(graph.mem[v])
            self.running[i] = held
            self.done[i] = sum(self.unit_grads[u] for u in finished) if cast else made
        self.stage_total = np.array([sum(self.accumulated[u] for u in units) for units in self.stage_units],
                                    dtype=np.int64)

    def held(self, k: int, phase: str, first: bool, accumulated: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The gradient bytes at the ops ``ids`` of an action of stage ``k``: the accumulated gradients of the
        stages ``accumulated`` marks, and in a backward the running unit's, with this stage's accumulated
        ones growing in its first backward."""
        other = int(np.dot(accumulated, self.stage_total)) - (int(self.stage_total[k]) if accumulated[k] else 0)
        if phase == FORWARD:
            return np.full(len(ids), other + (int(self.stage_total[k]) if accumulated[k] else 0), dtype=np.int64)
        mine = self.done[ids] if first else int(self.stage_total[k])
        return other + mine + self.running[ids]

    def resharded(self, reduced: np.ndarray) -> int:
        """The unsharded parameter bytes (fixed memory) the stages ``reduced`` marks have given back."""
        return int(np.dot(reduced, self.stage_unsharded))

    def reducing(self, k: int, accumulated: np.ndarray) -> int:
        """The gradient bytes while stage ``k``'s ``perform_reduce_grad`` runs, after its last backward (whose
        running unit's post-backward has run): the other stages' accumulated gradients (``accumulated``), and
        the stage's own as each unit in turn is resharded and gets its reduce-scatter input and output
        (``foreach_reduce``: the previous unit's input and accumulated gradients freed first, its own before the
        output), at the most over its units."""
        other = int(np.dot(accumulated, self.stage_total)) - (int(self.stage_total[k]) if accumulated[k] else 0)
        return other + int(self.stage_total[k]) + self._reduce_rise(k)

    def _reduce_rise(self, k: int) -> int:
        """The most stage ``k``'s reduce-scatter inputs add above its accumulated gradients and unsharded
        parameters: over its units in order, a unit's input less the gradients of the units reduced before it
        and the parameters of the units resharded up to it (all freed)."""
        freed = rise = 0
        for u in self.stage_units[k]:
            freed += self.unsharded[u]
            output = -(-self.unit_grads[u] // self.world)
            rise = max(rise, self.unit_grads[u] - freed, self.unit_grads[u] - freed - self.accumulated[u] + output)
            freed += self.accumulated[u]
        return rise


def kept_gradients(graph: Any, stage_of: np.ndarray) -> dict[int, int]:
    """The storages of the parameters' gradients on a pipeline rank under FSDP, each with its unit: the backward
    pass's outputs (:func:`bonsai_core.optimizer.gradient_nodes`) but a receiving stage's input gradient, its last
    node (sent to the stage before it). A stage's gradients, in the order its backward makes them, fill its units
    from the last (the backward runs them last to first), each up to its parameters' bytes."""
    from bonsai_core.optimizer import gradient_nodes

    pipeline = graph.parallel["pipeline"]
    sent = {int(b) for stage, _, b in pipeline["stages"] if int(stage) > 0}
    storages = sorted({graph.storage_of(g) for g in gradient_nodes(graph) if g not in sent})
    units = graph.fsdp["units"]
    out = {}
    for k in range(len(pipeline["stages"])):
        order = [u for u in range(len(units)) if stage_of[int(units[u][1])] == k][::-1]
        if not order:
            continue
        j = filled = 0
        for v in (v for v in storages if stage_of[v] == k and graph.mem[v] > 0):
            out[v] = order[j]
            filled += int(graph.mem[v])
            if filled >= int(units[order[j]][3]) and j + 1 < len(order):
                j, filled = j + 1, 0
    return out


def _on_timeline(segment: np.ndarray, stages: int) -> np.ndarray:
    """bool[len(segment), stages]: at each op, whether the one microbatch's own timeline holds what stage j
    held at the end of its forward (that forward ended before the op, its backward has not begun): those bytes
    are counted there already, one copy fewer of them in flight (``working``'s ``others_copies``)."""
    index = np.arange(len(segment))
    out = np.zeros((len(segment), stages), dtype=bool)
    for j in range(stages):
        forward, backward = np.flatnonzero(segment == 2 * j), np.flatnonzero(segment == 2 * j + 1)
        if len(forward):
            out[:, j] = (index > forward[-1]) & (index < (backward[0] if len(backward) else len(segment)))
    return out


def copies(graph: Any, ops: Sequence[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray] | None:
    """Rule 11 as a linear function of what each stage holds at the end of its forward, for the segment ILP
    (:mod:`bonsai_core.solvers.bonsai_model`): (int64[len(ops), stages]: at each op, how many copies of each
    stage's held bytes the rank holds for the other microbatches in flight, those of the action of the op's
    stage and phase with the most microbatches in flight, less this microbatch's own where its timeline holds
    them (:func:`_on_timeline`: the stages whose forward ended and whose backward has not begun, in whatever
    order ``ops`` runs the stages); int64[stages]: the op after which each stage's
    forward ends, where its held bytes are read). A plan that holds X bytes less at a stage's forward end holds
    ``copies * X`` less at each op in flight. None for a graph that is no pipeline rank."""
    staged = _staged(graph, ops)
    if staged is None:
        return None
    pipeline, spans, stage_of, segment = staged
    fullest: dict[int, np.ndarray] = {}  # per segment (2 stage + phase): the others of its fullest action
    for phase, k, others, *_ in _action_states(pipeline, len(spans)):
        key = 2 * k + (phase == BACKWARD)
        if key not in fullest or others.sum() > fullest[key].sum():
            fullest[key] = others
    out = np.zeros((len(ops), len(spans)), dtype=np.int64)
    own = _on_timeline(segment, len(spans))
    for key, others in fullest.items():
        out[segment == key] = others - own[segment == key]
    ends = np.array([(np.flatnonzero(segment == 2 * k)[-1:] if (segment == 2 * k).any() else np.array([-1]))[0]
                     for k in range(len(spans))], dtype=np.int64)
    return out, ends
