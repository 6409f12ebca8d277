"""Bonsai's coefficient sweep: what recomputing each candidate segment does to the memory and the time.

The memory axis has one point per forward step and two per backward node ``b``: "the rebuilds right
before b" and "b computed". ``P[k]`` (:func:`plain_profile`) is the memory of the plan with nothing
recomputed at point k, measured with the simulator. Every node's lifetime in a checkpoint plan
depends only on its own segment (dropped or kept) and on the rebuilds that read it, so the memory of
a plan is ``P[k] + sum_s y[s] * D[s, k]`` up to the conservative bounds below, where ``D[s]`` is a
step function with a handful of steps (:func:`coefficients`):

* from the first point where a rebuild input of s (a kept node it reads) would be freed in the plain
  schedule: ``+ext[s]``, the bytes of those inputs, which must now stay alive until the rebuild;
* at up to ``SAVE_STEPS`` points inside and right after the segment, as the forward copies of
  dropped nodes are freed: minus the savings so far (a staircase under the savings curve; in total
  ``saved[s]``, the dropped nodes the plain schedule would keep for the backward pass);
* at "rebuilds before r[s]" (r[s]: the first backward reader of a dropped node): ``peak[s]`` replaces
  ``ext[s]``: the most bytes of rebuilt copies and kept inputs alive at once during the rebuild;
* from "r[s] computed" on: 0 again (rebuilt copies live exactly as long as plain ones).

Conservative where it is not exact: savings inside the segment are a staircase, inputs are counted
alive from the earliest of their plain frees, rebuild peaks of segments rebuilt before the same node
are added, and two rebuilds reading the same input both count it. :func:`memory_steps` turns the
coefficients into the sparse step matrix the ILP uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import simulate
from bonsai_core.segment import Segmentation
from bonsai_core.solvers.deadline import Deadline, check

SAVE_STEPS = 4  # steps of a segment's savings curve the ILP sees (more: tighter model, more non-zeros)


@dataclass(frozen=True)
class Coefficients:
    """What each candidate segment does when recomputed (arrays over the segmentation's candidates)."""

    cost: np.ndarray  # float64: seconds of the nodes rebuilt
    saved: np.ndarray  # int64: dropped bytes the plain schedule keeps past the segment
    ext: np.ndarray  # int64: kept inputs of the rebuild the plain schedule frees before it
    ext_start: np.ndarray  # int64: sequence position from which ext counts
    peak: np.ndarray  # int64: most bytes of rebuilt copies and late inputs alive during the rebuild
    rebuild_at: np.ndarray  # int64: sequence position of the backward node the rebuild precedes (-1: none)
    # The savings as a staircase over the segment's own forward steps (CSR over candidates): from
    # sequence position save_pos[k] on, save_step[k] more bytes are saved. At most SAVE_STEPS steps;
    # the last is at the latest point where a dropped node's forward copy is freed.
    save_ptr: np.ndarray
    save_pos: np.ndarray
    save_step: np.ndarray
    saving: np.ndarray  # bool[C]: the candidate saves its self-contained nodes (``save_self_contained``)
    # What selective checkpointing's storage holds (CSR over candidates): from memory-axis point
    # hold_point[k] on, hold_step[k] more bytes (a saved node the plain schedule frees before the rebuild:
    # +bytes once freed there, -bytes at the rebuild point, where the recomputation takes it back).
    hold_ptr: np.ndarray
    hold_point: np.ndarray
    hold_step: np.ndarray
    # With ``drop_outputs``: the atoms holding the forward readers of the candidate's dropped outputs
    # (CSR over candidates), which must be kept; none: the candidate drops no output.
    reader_ptr: np.ndarray
    reader_atom: np.ndarray


@dataclass(frozen=True)
class PlainProfile:
    """The plain plan (nothing recomputed) on the sequence order: forward nodes, then the rest."""

    order: np.ndarray  # int64[n]: node id at each sequence position
    seq_pos: np.ndarray  # int64[n]: sequence position of each node
    release: np.ndarray  # int64[n]: sequence position after whose compute the node is freed (n: never)
    memory: np.ndarray  # int64[T]: memory at each point of the memory axis
    # On a pipeline rank (rule 11), the other microbatches in flight as the ILP sees them
    # (:func:`bonsai_core.in_flight.copies`): int64[T, stages], the copies of each stage's held bytes at each
    # point, and int64[stages], the point where each stage's forward ends (its held bytes); None elsewhere.
    in_flight: tuple[np.ndarray, np.ndarray] | None = None


def plain_profile(graph: Graph) -> PlainProfile:
    """Simulate the plan with nothing recomputed and read off lifetimes and the memory axis.
    Points: forward step t -> t; backward (sequence position q >= m) -> 2q - m (its rebuilds) and
    2q - m + 1 (its compute). O(n + edges)."""
    forward = np.flatnonzero(graph.is_forward)
    order = np.concatenate([forward, np.flatnonzero(~graph.is_forward)]).astype(np.int64)
    seq_pos = np.empty(graph.n, dtype=np.int64)
    seq_pos[order] = np.arange(graph.n)
    plan = CheckpointPlan.of([forward.tolist()] if len(forward) else [])
    schedule = plan_schedule(graph, plan, "bonsai")
    sim = simulate(graph, schedule)
    kinds = np.array([k == "compute" for k, _ in schedule.ops])
    step = np.cumsum(kinds) - 1  # sequence position of the latest compute at each op
    release = np.full(graph.n, graph.n, dtype=np.int64)
    frees = np.flatnonzero(~kinds)
    release[[schedule.ops[i][1] for i in frees]] = step[frees]
    at_compute = sim.timeline[kinds]  # memory at each compute step, in sequence order
    m = len(forward)
    backward_mem = at_compute[m:]
    memory = np.empty(m + 2 * (graph.n - m), dtype=np.int64)
    memory[:m] = at_compute[:m]
    memory[m::2] = backward_mem - graph.mem[order[m:]]  # before b's output exists
    memory[m + 1::2] = backward_mem
    return PlainProfile(order=order, seq_pos=seq_pos, release=release, memory=memory,
                        in_flight=_in_flight_on_axis(graph, schedule.ops, kinds, step, m))


def _in_flight_on_axis(graph: Graph, ops: list, kinds: np.ndarray, step: np.ndarray,
                       m: int) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`bonsai_core.in_flight.copies` of the plain plan's ``ops`` on the memory axis: a backward node's
    two points take its compute's copies; a stage's forward ends at the forward step of its last op."""
    from bonsai_core.in_flight import copies

    found = copies(graph, ops)
    if found is None:
        return None
    per_op, ends = found
    at_compute = per_op[kinds]
    axis = np.empty((m + 2 * (len(at_compute) - m), per_op.shape[1]), dtype=np.int64)
    axis[:m] = at_compute[:m]
    axis[m::2] = at_compute[m:]
    axis[m + 1::2] = at_compute[m:]
    return axis, np.where(ends >= 0, step[np.maximum(ends, 0)], -1)


def point_of(q: np.ndarray | int, m: int, rebuild: bool = False) -> np.ndarray | int:
    """Memory-axis point of sequence position q: a forward step, or a backward node's compute (or,
    with ``rebuild``, the rebuilds before it)."""
    q = np.asarray(q)
    out = np.where(q < m, q, 2 * q - m + (0 if rebuild else 1))
    return out if out.ndim else int(out)


def self_contained(graph: Graph) -> np.ndarray:
    """bool[m] over forward positions (forward nodes in listed order): the node is computed from
    parameters and constants only, never from the data (an attention mask built from ``ones``, position
    ids from ``arange``, a weight cast to bf16 or all-gathered by FSDP). The data's path starts at the
    earliest ancestor of the last forward node (the loss; on a rank of several pipeline stages, of each
    stage's: :func:`_path_ends`). A recomputed segment saves such nodes
    instead of rebuilding them: they are cheap to keep, and which they are does not depend on where a
    segment starts, so one sweep per segment end still serves every candidate. O(n + edges)."""
    forward = np.flatnonzero(graph.is_forward)
    if not len(forward):
        return np.zeros(0, dtype=bool)
    fpos = np.full(graph.n, -1, dtype=np.int64)
    fpos[forward] = np.arange(len(forward))
    lowest = np.zeros(graph.n, dtype=np.int64)
    for v in forward.tolist():  # topological: deps come first
        deps = graph.deps(v)
        lowest[v] = min(int(fpos[v]), int(lowest[deps].min())) if len(deps) else fpos[v]
    data = np.zeros(graph.n, dtype=bool)
    for end in _path_ends(graph, forward):
        data[_data_root(graph, forward, end, int(forward[lowest[end]]))] = True
    for v in forward.tolist():
        deps = graph.deps(v)
        if len(deps) and data[deps].any():
            data[v] = True
    return ~data[forward]


# Ops that make a tensor from its shape alone (``ones_like(input_ids)``, ``arange``): never the data's root.
_FACTORIES = ("ones", "zeros", "full", "empty", "arange", "scalar_tensor", "eye", "linspace", "new_ones",
              "new_zeros", "new_full", "new_empty")


def _path_ends(graph: Graph, forward: np.ndarray) -> list[int]:
    """The forward nodes where the data's paths end: the last one (the loss), or on a pipeline rank of several
    stages each stage's last (what it sends on, or the loss): each stage starts from its own data."""
    spans = [(a, b) for _, a, b in ((graph.parallel or {}).get("pipeline") or {}).get("stages", [])]
    ends = [forward[(forward >= a) & (forward <= b)] for a, b in spans]
    return [int(e[-1]) for e in ends if len(e)] or [int(forward[-1])]


def _data_root(graph: Graph, forward: np.ndarray, end: int, earliest: int) -> int:
    """The forward node where the data's path to ``end`` starts: the earliest ancestor of ``end`` that reads
    no node and is no tensor factory (an all-ones attention mask made with ``ones_like(input_ids)`` comes
    before the embedding that reads the ids); ``earliest`` (the earliest ancestor) when every one is."""
    ancestor = np.zeros(graph.n, dtype=bool)
    ancestor[end] = True
    for v in forward[::-1].tolist():  # users before their inputs
        if ancestor[v]:
            ancestor[graph.deps(v)] = True
    for v in forward.tolist():
        if ancestor[v] and not len(graph.deps(v)) and not _is_factory(graph.ops[v]):
            return v
    return earliest


def _is_factory(op: str) -> bool:
    """Whether ``op`` ("aten.ones_like.default") makes a tensor from a shape alone."""
    name = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 1 else op
    return name.removesuffix("_like") in _FACTORIES


def saved_positions(constant: np.ndarray, start: int, end: int) -> np.ndarray:
    """The forward positions a recomputed segment over ``start <= p < end`` saves: its self-contained
    ones (``constant``: :func:`self_contained`), unless it holds nothing else."""
    inside = np.flatnonzero(constant[start:end]) + start
    return inside if len(inside) < end - start else inside[:0]


def saves_self_contained(seg: Segmentation, constant: np.ndarray) -> np.ndarray:
    """bool[C]: the candidate saves some of its nodes when recomputed (:func:`saved_positions`)."""
    count = np.concatenate([[0], np.cumsum(constant)])
    inside = count[seg.ends] - count[seg.starts]
    return (inside > 0) & (inside < seg.ends - seg.starts)


def density_levels(graph: Graph, shares: tuple[float, ...] = (0.5, 0.8, 0.95)) -> list[np.ndarray]:
    """Bool masks over forward positions, one per share in ``shares`` (distinct masks only, fewest saved
    first): the ops with the highest rebuild cost per byte of output that together hold that share of
    the forward compute, with their views and separated outputs. A recomputed segment of such a level
    saves these ops' outputs (SAC's MUST_SAVE: matmuls and attention first, as torchtitan's selective
    recipe does) and recomputes the cheap ops between them. Saving by density is the greedy order of
    each segment's keep-or-recompute knapsack; the ILP picks the level per segment. O(m log m)."""
    forward = np.flatnonzero(graph.is_forward)
    fpos = np.full(graph.n, -1, dtype=np.int64)
    fpos[forward] = np.arange(len(forward))
    outs = np.flatnonzero((graph.output_of >= 0) & graph.is_forward)
    op_bytes = graph.mem.astype(np.float64).copy()  # an op's bytes with its separated outputs'
    np.add.at(op_bytes, graph.output_of[outs], graph.mem[outs])
    ops = forward[(graph.alias_of[forward] < 0) & (graph.output_of[forward] < 0) & (op_bytes[forward] > 0)
                  & (graph.cost[forward] > 0)]
    total = float(graph.cost[ops].sum())
    if not len(ops) or total <= 0:
        return []
    density = graph.cost[ops] / op_bytes[ops]
    order = np.argsort(-density, kind="stable")
    share = np.cumsum(graph.cost[ops][order]) / total
    levels: list[np.ndarray] = []
    for target in sorted(shares):
        cut = density[order][min(int(np.searchsorted(share, target - 1e-12)), len(ops) - 1)]
        node = np.zeros(graph.n, dtype=bool)
        node[ops[density >= cut]] = True
        for v in forward.tolist():  # forward order: an op before its views and separated outputs
            base = graph.alias_of[v] if graph.alias_of[v] >= 0 else graph.output_of[v]
            if base >= 0 and node[base]:
                node[v] = True
        mask = node[forward]
        if not any(np.array_equal(mask, other) for other in levels):
            levels.append(mask)
    return levels


def coefficients(graph: Graph, seg: Segmentation, plain: PlainProfile, drop_outputs: bool = False,
                 save_self_contained: bool = False, pinned: np.ndarray | None = None,
                 clock: Deadline | None = None) -> Coefficients:
    """Per-candidate recomputation cost, savings, kept inputs and rebuild peak; with ``drop_outputs``,
    of the candidate recomputed with its outputs dropped too (:class:`~bonsai_core.regions.CheckpointPlan`):
    only what a forward view outside it aliases is kept, an output's forward copy is freed after its
    last forward reader, and the readers' atoms are recorded (they must be kept). With
    ``save_self_contained``, recomputed candidates save their self-contained nodes
    (:func:`self_contained`) instead of rebuilding them.

    For a fixed segment end j, which nodes are dropped (``keep_until <= j``), which must be rebuilt
    (dropped and read by the backward pass, or by a rebuilt node at a position <= j) and how long each
    rebuilt copy lives do not depend on the start; so one sweep from j down to the smallest start
    yields every candidate ending at j. O(sum over ends of the longest candidate * degree). ``pinned`` (bool over forward positions, :func:`density_levels`): nodes a
    recomputed candidate saves whatever its start (selective checkpointing's "must save"); they do not
    depend on the start, so they keep the shared sweeps. Past ``clock``: :class:`OutOfTime` (a large
    step's sweeps take minutes).
    """
    constant = self_contained(graph)
    saving = saves_self_contained(seg, constant) if save_self_contained else np.zeros(seg.count, dtype=bool)
    kept = np.zeros(len(seg.forward), dtype=bool) if pinned is None else np.asarray(pinned, dtype=bool).copy()
    if save_self_contained:
        kept |= constant
    facts = _forward_facts(graph, seg, plain, drop_outputs, kept)
    out = _Tables.empty(seg.count)
    for group in _sweep_groups(seg):
        check(clock, "building the segment ILP's coefficients")
        _sweep(seg, group, facts, out)
    return out.coefficients(saving)


@dataclass(frozen=True)
class _ForwardFacts:
    """What the sweeps read, per forward position ``p`` (lists: the sweeps run in Python) or per node
    id ``v``."""

    forward: np.ndarray  # node id at each forward position
    drop_until: list[int]  # [p]: dropped by a segment ending at j iff <= j
    keep: list[int]  # [p]: kept by a segment ending at j iff > j (its last forward reader, or a view's)
    has_bwd: list[bool]  # [p]: the backward pass reads it
    first_bwd: list[int]  # [p]: sequence position of its first backward reader (n + 1: none)
    fwd_users: list[list[int]]  # [p]: its forward readers' node ids
    fwd_deps: list[list[int]]  # [p]: its inputs' node ids
    pinned: list[bool]  # [p]: saved inside every recomputed candidate (self-contained, a density level's ops)
    atom_of: np.ndarray  # [p]: the atom holding it
    alias: list[int]  # [v]: the node it is a view of (-1: none)
    mem: list[int]  # [v]
    cost: list[float]  # [v]
    release: list[int]  # [v]: sequence position after which the plain schedule frees it
    fpos: list[int]  # [v]: forward position (n: not a forward node)


def _forward_facts(graph: Graph, seg: Segmentation, plain: PlainProfile, drop_outputs: bool,
                   pinned: np.ndarray | None = None) -> _ForwardFacts:
    """Each forward node's readers, lifetime and when a segment ending at j drops it, vectorised over
    the edge list."""
    forward, m, n = seg.forward, len(seg.forward), graph.n
    fpos = np.full(n, n, dtype=np.int64)  # forward position, n for non-forward nodes
    fpos[forward] = np.arange(m)
    src = graph.dep_idx
    dst = np.repeat(np.arange(n), np.diff(graph.dep_ptr))
    fwd_edge = graph.is_forward[dst]
    last_fwd_user = np.full(n, -1, dtype=np.int64)
    np.maximum.at(last_fwd_user, src[fwd_edge], fpos[dst[fwd_edge]])
    first_bwd_user = np.full(n, n + 1, dtype=np.int64)
    np.minimum.at(first_bwd_user, src[~fwd_edge], plain.seq_pos[dst[~fwd_edge]])
    keep_until = last_fwd_user.copy()  # a node is kept by segment end j iff keep_until > j
    for v in forward[::-1]:  # a kept forward view keeps its base (views come after their bases)
        a = graph.alias_of[v]
        if a >= 0:
            keep_until[a] = max(keep_until[a], keep_until[v])
    view_until = np.full(n, -1, dtype=np.int64)  # the last forward view of a node, through views of views
    for v in forward[::-1]:
        a = graph.alias_of[v]
        if a >= 0:
            view_until[a] = max(view_until[a], fpos[v], view_until[v])
    drop_until = (view_until if drop_outputs else keep_until).copy()  # dropped by end j iff <= j
    for v in forward[graph.output_of[forward] >= 0]:  # dropped with its op only (separated outputs; one atom)
        drop_until[v] = max(drop_until[v], drop_until[graph.output_of[v]])
    return _ForwardFacts(
        forward=forward, drop_until=drop_until[forward].tolist(), keep=keep_until[forward].tolist(),
        has_bwd=(first_bwd_user <= n)[forward].tolist(), first_bwd=first_bwd_user[forward].tolist(),
        fwd_users=[graph.users(v)[graph.is_forward[graph.users(v)]].tolist() for v in forward],
        fwd_deps=[graph.deps(v).tolist() for v in forward],
        pinned=(np.zeros(m, dtype=bool) if pinned is None else np.asarray(pinned, dtype=bool)).tolist(),
        atom_of=np.searchsorted(seg.atom_ptr, np.arange(m), side="right") - 1, alias=graph.alias_of.tolist(),
        mem=graph.mem.tolist(), cost=graph.cost.tolist(), release=plain.release.tolist(), fpos=fpos.tolist())


def _sweep_groups(seg: Segmentation) -> list[np.ndarray]:
    """The candidates one sweep computes: those sharing an end (by start, descending)."""
    order = np.lexsort((-seg.starts, seg.ends))  # by end, then start descending
    return np.split(order, np.flatnonzero(np.diff(seg.ends[order])) + 1) if len(order) else []


@dataclass
class _Tables:
    """The coefficients being filled in, one entry per candidate."""

    cost: np.ndarray
    saved: np.ndarray
    ext: np.ndarray
    ext_start: np.ndarray
    peak: np.ndarray
    rebuild_at: np.ndarray
    save_pos: list[np.ndarray]
    save_step: list[np.ndarray]
    readers: list[np.ndarray]
    hold_point: list[np.ndarray]
    hold_step: list[np.ndarray]

    @classmethod
    def empty(cls, count: int) -> "_Tables":
        none = np.zeros(0, dtype=np.int64)
        return cls(np.zeros(count), *(np.zeros(count, dtype=np.int64) for _ in range(4)),
                   np.full(count, -1, dtype=np.int64), *([none] * count for _ in range(5)))

    def coefficients(self, saving: np.ndarray) -> Coefficients:
        save_ptr, save_pos = _csr(self.save_pos)
        reader_ptr, reader_atom = _csr(self.readers)
        return Coefficients(cost=self.cost, saved=self.saved, ext=self.ext, ext_start=self.ext_start,
                            peak=self.peak, rebuild_at=self.rebuild_at, save_ptr=save_ptr, save_pos=save_pos,
                            save_step=_csr(self.save_step)[1], saving=saving, reader_ptr=reader_ptr,
                            reader_atom=reader_atom, hold_ptr=_csr(self.hold_point)[0],
                            hold_point=_csr(self.hold_point)[1], hold_step=_csr(self.hold_step)[1])


def _sweep(seg: Segmentation, group: np.ndarray, f: _ForwardFacts, out: _Tables) -> None:
    """One sweep from the group's end j down to its smallest start, filling in each candidate of the
    group as the sweep reaches its start."""
    j = int(seg.ends[group[0]]) - 1
    lo = int(seg.starts[group[-1]])
    need = {}  # forward position -> rebuilt copy's last position in the window (absent: not rebuilt)
    live = np.zeros(j - lo + 1, dtype=np.int64)  # bytes of rebuilt copies at each window position
    save_at: dict[int, int] = {}  # sequence position -> bytes whose forward copy is gone from there on
    inputs: dict[int, int] = {}  # kept node read by the rebuild -> its last reader's position
    outside: set[int] = set()  # forward positions after j that read a dropped node
    pinned: list[int] = []  # saved nodes in the window, with the nodes they are views of
    saved_here: set[int] = set()  # forward positions of the saved nodes
    total_cost, saved, peak, first = 0.0, 0, 0, len(f.fpos) + 1
    gi = 0
    for p in range(j, lo - 1, -1):
        v = int(f.forward[p])
        saves = f.pinned[p] and _read_later(p, v, j, need, saved_here, f)
        if saves:
            saved_here.add(p)
            w = v
            while w >= 0:  # a saved view holds its base
                pinned.append(w)
                w = f.alias[w]
        if f.drop_until[p] <= j and not saves:  # dropped
            if f.release[v] > max(j, f.keep[p]):  # the plain schedule keeps it past its forward use
                saved += f.mem[v]
                at = max(p, f.keep[p]) + 1
                save_at[at] = save_at.get(at, 0) + f.mem[v]
            if f.keep[p] > j:
                outside.update(f.fpos[u] for u in f.fwd_users[p] if f.fpos[u] > j)
            first = min(first, f.first_bwd[p])
            last = j if f.has_bwd[p] else -1
            for u in f.fwd_users[p]:
                pu = f.fpos[u]
                if pu <= j and pu in need:
                    last = max(last, need[pu] if f.alias[u] == v else pu)
            if last >= 0:
                need[p] = last
                live[p - lo:last - lo + 1] += f.mem[v]
                peak = max(peak, int(live[p - lo:last - lo + 1].max()))
                total_cost += f.cost[v]
                inputs.pop(v, None)
                for d in f.fwd_deps[p]:
                    while d >= 0 and d not in inputs:
                        inputs[d] = p  # the sweep goes down: the first reader seen is the last
                        d = f.alias[d]  # a kept view keeps its base alive with it
        while gi < len(group) and seg.starts[group[gi]] == p:
            c = group[gi]
            gi += 1
            if need:
                out.cost[c], out.saved[c], out.peak[c], out.rebuild_at[c] = total_cost, saved, peak, first
                out.save_pos[c], out.save_step[c] = _staircase(save_at)
                if outside:
                    out.readers[c] = np.unique(f.atom_of[sorted(outside)])
                _late_inputs(c, p, inputs, first, live[p - lo:], f, out)
                out.hold_point[c], out.hold_step[c] = _held_saved(pinned, inputs, first, f)


def _read_later(p: int, v: int, j: int, need: dict[int, int], saved_here: set[int], f: _ForwardFacts) -> bool:
    """Whether pinned node ``v`` (position ``p``) of a segment ending at ``j`` is read after the forward
    pass, so the segment saves it (:func:`bonsai_core.regions.useful_saved`): by the backward pass, a
    rebuilt node (``need``), a forward node after ``j``, or through a saved view (``saved_here``)."""
    if f.has_bwd[p] or f.keep[p] > j:
        return True
    for u in f.fwd_users[p]:
        pu = f.fpos[u]
        if pu > j or pu in need or (f.alias[u] == v and pu in saved_here):
            return True
    return False


def _late_inputs(c: int, start: int, inputs: dict[int, int], first: int, live: np.ndarray, f: _ForwardFacts,
                 out: _Tables) -> None:
    """Candidate ``c``'s kept inputs that the rebuild keeps alive longer than the plain schedule (freed
    there before the rebuild's first backward reader ``first``): their bytes, from when, and the
    rebuild's peak with them (each lives until its last rebuilt reader; ``live``: from ``start`` on)."""
    late = [d for d in inputs if f.release[d] < first]
    if late:
        out.ext[c] = sum(f.mem[d] for d in late)
        out.ext_start[c] = min(f.release[d] for d in late) + 1
        during = live.copy()
        for d in late:
            during[:inputs[d] - start + 1] += f.mem[d]
        out.peak[c] = int(during.max())


def _held_saved(pinned: list[int], inputs: dict[int, int], first: int, f: _ForwardFacts) -> tuple[np.ndarray, np.ndarray]:
    """(memory-axis points, signed bytes): selective checkpointing keeps each saved node (``pinned``) in
    its storage until the rebuild before ``first`` takes it back (:func:`bonsai_core.regions.hold_saved`),
    so one the plain schedule frees earlier lives on from there. The rebuild's late inputs are counted
    by :func:`_late_inputs` already."""
    m = f.forward.shape[0]
    held = [v for v in set(pinned) if f.release[v] < first and v not in inputs]
    if not held:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    freed = point_of(np.array([f.release[v] + 1 for v in held], dtype=np.int64), m, rebuild=True)
    taken = point_of(first, m, rebuild=True)
    sizes = np.array([f.mem[v] for v in held], dtype=np.int64)
    return (np.concatenate([freed, np.full(len(held), taken)]).astype(np.int64),
            np.concatenate([sizes, -sizes]))


def _csr(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(ptr, values) of a list of int64 arrays."""
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(r) for r in rows])
    return ptr, np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)


def _staircase(jumps: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """At most SAVE_STEPS steps under the savings curve (``jumps``: position -> bytes saved from there
    on): the last jump and the largest others. Each step takes every saving up to its position, so the
    staircase never claims a saving before it happens (conservative), and ends at the total."""
    items = sorted(jumps.items())
    if not items:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    keep = range(len(items))
    if len(items) > SAVE_STEPS:
        top = sorted(range(len(items) - 1), key=lambda i: items[i][1])[-(SAVE_STEPS - 1):]
        keep = sorted(top) + [len(items) - 1]
    running, total, steps, positions = 0, 0, [], []
    chosen = set(keep)
    for i, (pos, amount) in enumerate(items):
        running += amount
        if i in chosen:
            positions.append(pos)
            steps.append(running - total)
            total = running
    return np.asarray(positions, dtype=np.int64), np.asarray(steps, dtype=np.int64)


def memory_steps(coef: Coefficients, columns: np.ndarray, m: int, points: int | None = None) -> sp.coo_matrix:
    """(points, len(columns)) bytes: the step heights of ``D[s]`` for candidates ``columns`` at the
    points of the memory axis (``points``: its length, default just enough; duplicates summed). Row k of ``cumsum`` is the memory
    change at point k when that candidate is recomputed. Candidates with nothing to rebuild change
    nothing."""
    cols = np.flatnonzero(coef.rebuild_at[columns] >= 0)
    cw = np.asarray(columns)[cols]
    at = coef.rebuild_at[cw]
    ext, saved, peak = coef.ext[cw], coef.saved[cw], coef.peak[cw]
    lengths = np.diff(coef.save_ptr)[cw]
    take = (np.concatenate([np.arange(coef.save_ptr[c], coef.save_ptr[c + 1]) for c in cw]) if len(cw)
            else np.zeros(0, dtype=np.int64))
    held = np.diff(coef.hold_ptr)[cw]
    hold = (np.concatenate([np.arange(coef.hold_ptr[c], coef.hold_ptr[c + 1]) for c in cw]) if len(cw)
            else np.zeros(0, dtype=np.int64))
    rows = np.concatenate([point_of(coef.ext_start[cw], m, rebuild=True), point_of(coef.save_pos[take], m, rebuild=True),
                           point_of(at, m, rebuild=True), point_of(at, m), coef.hold_point[hold]]).astype(np.int64)
    heights = np.concatenate([ext, -coef.save_step[take], peak - ext, saved - peak,
                              coef.hold_step[hold]]).astype(np.float64)
    col_idx = np.concatenate([cols, np.repeat(cols, lengths), cols, cols, np.repeat(cols, held)])
    keep = heights != 0
    size = points if points is not None else int(rows.max()) + 1 if len(rows) else 1
    out = sp.coo_matrix((heights[keep], (rows[keep], col_idx[keep])), shape=(size, len(columns)))
    out.sum_duplicates()
    return out


def _running_extremes(steps: sp.spmatrix, extreme: np.ufunc) -> np.ndarray:
    """``extreme`` (np.minimum or np.maximum) over the rows of ``cumsum(steps, axis=0)``, per column,
    from the non-zeros alone (the running sum is 0 above a column's first step, and 0 counts)."""
    steps = sp.csc_matrix(steps)
    steps.sum_duplicates()
    steps.sort_indices()
    running = np.cumsum(steps.data)
    counts = np.diff(steps.indptr)
    before = np.concatenate([[0.0], running])[steps.indptr[:-1]]
    running -= np.repeat(before, counts)  # cumsum within each column (rows sorted)
    out = np.zeros(steps.shape[1])
    nonempty = counts > 0
    if nonempty.any():
        out[nonempty] = extreme(extreme.reduceat(running, steps.indptr[:-1][nonempty]), 0.0)
    return out


def lowers_memory(coef: Coefficients, m: int) -> np.ndarray:
    """bool[C]: recomputing the candidate lowers the modelled memory at some point (``D[s]`` dips
    below 0). The others are never in an optimum of the model: with them kept instead, every memory
    row is as low or lower and the cost no higher, so leaving them out of the ILP loses nothing."""
    return _running_extremes(memory_steps(coef, np.arange(len(coef.cost)), m), np.minimum) < 0


_PAIRS_PER_CHUNK = 200_000  # candidate pairs compared at once (bounds the memory of the comparison)


def dominated(coef: Coefficients, seg: Segmentation, columns: np.ndarray, m: int) -> np.ndarray:
    """bool over ``columns`` (candidates): another of them lies inside it, sharing its first or its last
    op, costs no more and never needs more modelled memory (``cumsum D`` at or below at every point).

    Such a candidate is never needed by an optimum of the model: recompute the inner one instead and
    keep the rest of its atoms (kept atoms cost nothing and change no memory row), and every row is as
    low or lower at no higher cost. Nesting is a strict order and the relation is transitive, so
    dropping all of them at once keeps, for each, an undominated one inside it. Typical case: a run
    that ends with an op whose output the backward pass needs anyway rebuilds it for nothing.
    (1076 of the 1644 candidates that lower the memory on the 4-layer GPT of docs/BONSAI.md.)"""
    columns = np.asarray(columns, dtype=np.int64)
    starts, ends, cost = seg.starts[columns], seg.ends[columns], coef.cost[columns]
    outer, inner = _nested_pairs(starts, ends)
    cheaper = cost[inner] <= cost[outer]
    outer, inner = outer[cheaper], inner[cheaper]
    out = np.zeros(len(columns), dtype=bool)
    if not len(outer):
        return out
    steps = memory_steps(coef, columns, m).tocsc()
    for lo in range(0, len(outer), _PAIRS_PER_CHUNK):
        o, i = outer[lo:lo + _PAIRS_PER_CHUNK], inner[lo:lo + _PAIRS_PER_CHUNK]
        never_above = _running_extremes(steps[:, i] - steps[:, o], np.maximum) <= 0
        out[o[never_above]] = True
    return out


def _nested_pairs(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(outer, inner) index pairs of spans where inner lies strictly inside outer and shares its start
    or its end."""
    outer, inner = [], []
    for key, other in ((starts, ends), (ends, -starts)):  # same start: shorter end; same end: later start
        order = np.lexsort((other, key))
        bounds = np.flatnonzero(np.diff(key[order])) + 1
        for group in np.split(order, bounds):
            if len(group) > 1:
                a, b = np.triu_indices(len(group), k=1)  # group sorted by `other`: a's span inside b's
                outer.append(group[b])
                inner.append(group[a])
    if not outer:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(outer), np.concatenate(inner)
