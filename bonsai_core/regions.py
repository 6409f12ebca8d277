"""Checkpoint regions: the schedule space of Bonsai's segment ILP and of Chen's √n checkpointing.

A :class:`CheckpointPlan` splits the forward pass into disjoint segments and marks some of them
recomputed. Its schedule, the one every method of this family returns and the exporter maps onto
``torch.utils.checkpoint``, is:

* the forward pass runs once, in listed order;
* a recomputed segment keeps only its *boundary*, the nodes read by forward nodes outside it (its
  outputs, which are the next segments' inputs; and the base of any kept view). Its other nodes
  are freed after their last forward use;
* a recomputed segment that **drops its outputs** (``CheckpointPlan.drop_outputs``) keeps only the
  nodes that a forward view outside it aliases: its outputs are freed too, after their last forward
  reader, and rebuilt with the rest. Every forward reader outside such a segment must be in a kept
  segment (its forward pass has run by then; a rebuild reading the output would have nothing to read).
  This is not a ``torch.utils.checkpoint`` region (an op after the region would hold the output for
  its own backward): the ``checkpoint`` export back-end only approximates it, ``replay`` follows it;
* nodes the plan **saves** (``CheckpointPlan.saved``, selective activation checkpointing's "must
  save") are kept even inside a recomputed segment, like a boundary: until their last reader, and at
  least until the segment's rebuild, as SAC's storage holds them (:func:`hold_saved`; a saved output
  only a forward op reads, a block's last projection added to the residual, lives to the block's
  backward). Bonsai saves a segment's self-contained nodes this way (an attention mask built inside
  it), which are cheaper to keep than to rebuild, and with ``save_ops`` the outputs of its costliest
  ops (matmuls, attention);
* right before the first backward node that reads a dropped node of the segment, the segment is
  rebuilt once from its inputs: the dropped nodes the backward pass reads, and what they need.

The schedule stores the plan in ``Schedule.extra`` as ``{"segments": [[ids...], ...],
"recomputed": [segment index, ...], "drop_outputs": [segment index, ...], "saved": [node id, ...]}``
(the last two only when not empty).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from bonsai_core.errors import ScheduleError
from bonsai_core.graph import Graph, block_stack
from bonsai_core.schedule import COMPUTE, FREE, Schedule, none_schedule, schedule_ops


@dataclass(frozen=True)
class CheckpointPlan:
    """Disjoint segments of forward node ids covering the forward pass, which are recomputed, which of
    those drop their outputs too, and which nodes are saved inside them (module docstring)."""

    segments: tuple[tuple[int, ...], ...]
    recomputed: frozenset[int]
    drop_outputs: frozenset[int] = frozenset()
    saved: frozenset[int] = frozenset()  # node ids kept inside recomputed segments (SAC's "must save")
    offloaded: frozenset[int] = frozenset()  # kept node ids offloaded to host memory (simulator rule 9)

    @classmethod
    def of(cls, segments: Sequence[Sequence[int]], recomputed: Sequence[int] = (),
           drop_outputs: Sequence[int] = (), saved: Sequence[int] = (), offloaded: Sequence[int] = ()) -> "CheckpointPlan":
        return cls(tuple(tuple(sorted(int(v) for v in s)) for s in segments), frozenset(int(i) for i in recomputed),
                   frozenset(int(i) for i in drop_outputs), frozenset(int(v) for v in saved),
                   frozenset(int(v) for v in offloaded))

    def to_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"segments": [list(s) for s in self.segments], "recomputed": sorted(self.recomputed)}
        if self.drop_outputs:
            extra["drop_outputs"] = sorted(self.drop_outputs)
        if self.saved:
            extra["saved"] = sorted(self.saved)
        if self.offloaded:
            extra["offloaded"] = sorted(self.offloaded)
        return extra

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "CheckpointPlan":
        if "segments" not in extra:
            raise ScheduleError("This schedule holds no checkpoint regions ('extra.segments'); it is a general "
                                "schedule, not a bonsai/chen checkpoint plan.")
        return cls.of(extra["segments"], extra.get("recomputed", ()), extra.get("drop_outputs", ()),
                      extra.get("saved", ()), extra.get("offloaded", ()))


def segment_of(graph: Graph, plan: CheckpointPlan) -> np.ndarray:
    """int64[n]: each forward node's segment index (-1 for backward nodes). Checks the cover."""
    seg = np.full(graph.n, -1, dtype=np.int64)
    for i, members in enumerate(plan.segments):
        for v in members:
            if not (0 <= v < graph.n and graph.is_forward[v]):
                raise ScheduleError(f"Segment {i} names node {v}, which is not a forward node of {graph.name!r}.")
            if seg[v] >= 0:
                raise ScheduleError(f"Node {v} ({graph.names[v]!r}) is in segments {seg[v]} and {i}; segments "
                                    "must be disjoint.")
            seg[v] = i
    missing = np.flatnonzero(graph.is_forward & (seg < 0))
    if len(missing):
        raise ScheduleError(f"Forward node {missing[0]} ({graph.names[missing[0]]!r}) is in no segment; the "
                            "segments must cover the forward pass.")
    bad = [i for i in plan.recomputed if not 0 <= i < len(plan.segments)]
    if bad:
        raise ScheduleError(f"Recomputed segment {bad[0]} does not exist (there are {len(plan.segments)}).")
    not_forward = [v for v in plan.saved if not (0 <= v < graph.n and graph.is_forward[v])]
    if not_forward:
        raise ScheduleError(f"Saved node {not_forward[0]} is not a forward node of {graph.name!r}.")
    kept_outputs = sorted(plan.drop_outputs - plan.recomputed)
    if kept_outputs:
        raise ScheduleError(f"Segment {kept_outputs[0]} drops its outputs but is not recomputed; only a "
                            "recomputed segment can drop its outputs.")
    return seg


def dropped_nodes(graph: Graph, plan: CheckpointPlan) -> np.ndarray:
    """bool[n]: nodes of recomputed segments that are not kept after the forward pass. Refuses a plan
    whose segment drops an output that a recomputed segment reads."""
    seg = segment_of(graph, plan)
    in_recomputed = np.isin(seg, list(plan.recomputed)) if plan.recomputed else np.zeros(graph.n, dtype=bool)
    dropped = in_recomputed.copy()
    for v in np.flatnonzero(in_recomputed):
        outside = [u for u in graph.users(v).tolist() if graph.is_forward[u] and seg[u] != seg[v]]
        if seg[v] in plan.drop_outputs:  # kept only for a view outside (then the base of a boundary)
            outside = [u for u in outside if graph.alias_of[u] == v]
        if outside or v in plan.saved:
            dropped[v] = False  # a boundary (later segments read it), or saved by the plan
    for v in reversed(range(graph.n)):  # a kept view keeps its base
        a = graph.alias_of[v]
        if a >= 0 and graph.is_forward[v] and not dropped[v]:
            dropped[a] = False
    outs = np.flatnonzero(graph.output_of >= 0)  # a kept op keeps its separated outputs (the simulator's separated-output rule)
    dropped[outs] &= dropped[graph.output_of[outs]]
    for v in np.flatnonzero(dropped & np.isin(seg, list(plan.drop_outputs))):
        for u in graph.users(v).tolist():
            if graph.is_forward[u] and seg[u] != seg[v] and seg[u] in plan.recomputed:
                raise ScheduleError(
                    f"Segment {seg[v]} drops its outputs, but node {v} ({graph.names[v]!r}) is read by node {u} "
                    f"({graph.names[u]!r}) of the recomputed segment {seg[u]}, whose rebuild would need it. A "
                    "segment may drop its outputs only when every forward reader outside it is kept.")
    return dropped


def checkpoint_sequence(graph: Graph, plan: CheckpointPlan) -> list[int]:
    """The compute sequence of a plan: forward once, each recomputed segment rebuilt right before
    the first backward node that reads one of its dropped nodes. O(n + edges)."""
    seg = segment_of(graph, plan)
    dropped = dropped_nodes(graph, plan)
    order = list(range(graph.n))
    seq = [v for v in order if graph.is_forward[v]]
    rebuilt: set[int] = set()
    for b in order:
        if graph.is_forward[b]:
            continue
        for d in graph.deps(b).tolist():
            if dropped[d] and seg[d] not in rebuilt:
                rebuilt.add(int(seg[d]))
                seq.extend(_rebuild(graph, plan.segments[seg[d]], dropped))
        seq.append(b)
    return seq


def _rebuild(graph: Graph, members: Sequence[int], dropped: np.ndarray) -> list[int]:
    """The dropped nodes of one segment that the backward pass reads, with their dropped ancestors
    in the segment, in topological order."""
    need: set[int] = set()
    stack = [v for v in members if dropped[v] and any(not graph.is_forward[u] for u in graph.users(v))]
    while stack:
        v = stack.pop()
        if v not in need:
            need.add(v)
            stack.extend(d for d in graph.deps(v).tolist() if dropped[d])
    return sorted(need)


def useful_saved(graph: Graph, plan: CheckpointPlan) -> CheckpointPlan:
    """``plan`` saving, inside its recomputed segments, only what is read after the forward pass: by the
    backward pass, by a rebuilt node, by a forward node of another segment, or through a saved view of
    it. Another saved node (an attention mask's ``ones`` once its ``tril`` is saved) is dropped and
    never rebuilt: saving it would only hold it in SAC's storage until the rebuild (:func:`hold_saved`).
    Bonsai's plans save by this rule, and its segment ILP counts them so. O(n + edges)."""
    if not plan.saved or not plan.recomputed:
        return plan
    seg = segment_of(graph, plan)
    dropped = dropped_nodes(graph, plan)
    need: set[int] = set()
    for s in plan.recomputed:
        need.update(_rebuild(graph, plan.segments[s], dropped))
    recomputed = np.isin(seg, list(plan.recomputed))
    useful: set[int] = set()
    for v in sorted(plan.saved, reverse=True):  # views (later ids) before the nodes they are views of
        if not recomputed[v] or any(
                not graph.is_forward[u] or u in need or seg[u] != seg[v] or (graph.alias_of[u] == v and u in useful)
                for u in graph.users(v).tolist()):
            useful.add(v)
    return plan if len(useful) == len(plan.saved) else dataclasses.replace(plan, saved=frozenset(useful))


def hold_saved(graph: Graph, plan: CheckpointPlan, ops: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``ops`` with each saved node of a recomputed segment that the forward pass frees held until right
    before its segment's rebuild: selective checkpointing keeps every MUST_SAVE output in its storage
    until the recomputation consumes it, read or not (``torch/utils/checkpoint.py``,
    ``_CachingTorchDispatchMode``, then ``_CachedTorchDispatchMode``), so a saved output only a forward op
    read (a block's last projection, added to the residual) lives to the block's backward. The nodes
    it is a view of are held with it (a base outlives its views). O(len(ops)). :func:`plan_schedule`
    applies it, so every method's plans and bonsai's segment ILP count it."""
    if not plan.saved:
        return ops
    seg = segment_of(graph, plan)
    first_backward = next((i for i, (k, v) in enumerate(ops) if k == COMPUTE and not graph.is_forward[v]), len(ops))
    rebuild: dict[int, int] = {}  # segment -> op index of its first recomputed node
    for i in range(first_backward, len(ops)):
        kind, v = ops[i]
        if kind == COMPUTE and graph.is_forward[v] and seg[v] in plan.recomputed:
            rebuild.setdefault(int(seg[v]), i)
    hold: dict[int, int] = {}
    for v in plan.saved:
        at = rebuild.get(int(seg[v]))
        for u in graph.view_chain(v) if at is not None else ():  # a view holds its base
            hold[u] = max(hold.get(u, -1), at)
    out: list[tuple[str, int]] = []
    later: dict[int, list[int]] = {}
    for i, (kind, v) in enumerate(ops):
        out.extend((FREE, w) for w in later.pop(i, ()))
        if kind == FREE and i < hold.get(v, -1):
            later.setdefault(hold[v], []).append(v)
        else:
            out.append((kind, v))
    return out


def plan_schedule(graph: Graph, plan: CheckpointPlan, method: str) -> Schedule:
    """The validated-by-construction schedule of a plan, carrying the plan in ``extra``; its offloaded
    nodes copied to host and reloaded ahead of their backward readers (:func:`offload.with_offloads`,
    on the default device's host link)."""
    ops = hold_saved(graph, plan, schedule_ops(graph, checkpoint_sequence(graph, plan)))
    if plan.offloaded:
        from bonsai_core.offload import with_offloads
        from bonsai_core.schedule import host_link

        ops = with_offloads(graph, ops, plan.offloaded, host_link([])[0])
    return Schedule(graph=graph.name, method=method, ops=ops, graph_hash=graph.hash, extra=plan.to_extra())


class RegionBound(NamedTuple):
    """The least peak of any checkpoint plan (:func:`region_peak_bound`) and where it is."""

    peak: int  # bytes, fixed_mem included
    node: int  # the backward node whose computation sets it (-1: a graph without a backward pass)
    backward_bytes: int  # of it, the backward tensors live then (the node's output included)


def region_peak_bound(graph: Graph) -> RegionBound:
    """A memory no checkpoint plan's schedule goes below, whatever its segments.

    A plan rebuilds forward nodes only: the backward pass computes each backward node once, in listed
    order, and frees it after its last reader, as the plain schedule does. So when backward node b is
    computed, the backward nodes the plain schedule holds then, b's inputs and the bases of every view
    among them are resident under every plan. On a graph whose plain peak is in the backward pass and
    made mostly of backward tensors (a U-Net's skip gradient, held by a slice until the encoder's
    backward adds it), this is close to the no-remat peak; an op-level schedule (checkmate, moccasin)
    goes lower by recomputing backward nodes too. O(ops + edges)."""
    best = RegionBound(graph.fixed_mem, -1, 0)
    resident: set[int] = set()
    for kind, v in none_schedule(graph).ops:
        if kind == FREE:
            resident.discard(v)
            continue
        resident.add(v)
        if graph.is_forward[v]:
            continue
        backward = {u for u in resident if not graph.is_forward[u]}
        live = graph.with_view_bases(backward | set(graph.deps(v).tolist()))
        peak = graph.fixed_mem + int(graph.mem[list(live)].sum())
        if peak > best.peak:
            best = RegionBound(peak, v, int(graph.mem[list(backward)].sum()))
    return best


def forward_positions(graph: Graph) -> np.ndarray:
    """int64[n]: each forward node's position in the listed forward order, -1 for the others."""
    pos = np.full(graph.n, -1, dtype=np.int64)
    forward = np.flatnonzero(graph.is_forward)
    pos[forward] = np.arange(len(forward))
    return pos


def block_plans(graph: Graph, every: Sequence[int] = (1, 2, 4)) -> list[tuple[str, CheckpointPlan]]:
    """Per-block checkpointing (``torch.utils.checkpoint`` around every k-th block, as the per-block
    peer runs it) as checkpoint plans: each block of :func:`block_stack` its own segment, every
    ``k``-th of them recomputed, the forward ops between blocks in kept segments."""
    blocks = block_stack(graph)
    if not blocks:
        return []
    forward = np.flatnonzero(graph.is_forward)
    pos = forward_positions(graph)
    plans = []
    for k in every:
        segments: list[list[int]] = []
        recomputed: list[int] = []
        at = 0
        for i, (_, first, last) in enumerate(blocks):
            a, b = int(pos[first]), int(pos[last]) + 1
            if a < at:  # overlapping calls (not a block stack): no plan
                return plans
            if a > at:
                segments.append(forward[at:a].tolist())
            if i % k == 0:
                recomputed.append(len(segments))
            segments.append(forward[a:b].tolist())
            at = b
        if at < len(forward):
            segments.append(forward[at:].tolist())
        plans.append((f"per-block every {k}", CheckpointPlan.of(segments, recomputed)))
    return plans
