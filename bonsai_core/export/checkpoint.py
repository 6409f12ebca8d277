"""The ``checkpoint`` export back-end: a checkpoint-region schedule applied to the user's own module.

``export_model`` (the ``replay`` back-end) writes the traced aten graph out as a program. This back-end
instead writes a short ``checkpointed.py`` whose ``apply(model)`` wraps some submodules of the user's
model in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` with a selective-activation-
checkpointing (SAC) policy: the model's own Python code runs, at any batch size, under autocast and
``torch.compile``.

How a plan (``regions.CheckpointPlan``: bonsai, chen) becomes checkpoints:

1. **Which tensors.** ``regions.dropped_nodes`` is the set of forward nodes the plan frees after the
   forward pass and rebuilds in the backward pass. Every other forward node that a backward node reads
   is *kept*.
2. **Which ops at run time.** :func:`bonsai_core.modules.record_step` runs one forward + loss on fake
   tensors and records the aten ops (as SAC's policy sees them) and the op range of every module
   call; :func:`bonsai_core.modules.align` places those ops on the traced graph's forward nodes.
3. **Where to checkpoint.** Autograd keeps a tensor because the *reader* of it saved it, so a dropped
   tensor is only dropped if its producer and all its forward readers run inside one checkpoint. For
   each dropped node, the innermost module call holding it and its forward readers is a candidate;
   the outermost candidates (never the whole model) are the first choice of checkpointed submodules
   ("units"). Then the simulator judges: :func:`realised_sequence` writes what the checkpoints will
   really run (each unit rebuilt whole at its first saved-tensor use) as a compute sequence, and a
   unit is replaced by the candidates nested in it, or dropped, while that lowers the simulated peak.
   That peak is ``INFO["realised_peak"]``: the back-end's own prediction.
4. **What to save.** Inside a unit, the SAC policy says ``MUST_SAVE`` for the ops whose outputs are
   kept and read by the backward pass or saved by the plan (``regions.useful_saved``: a matmul only the
   recomputation reads), and the bases of such views, ``PREFER_RECOMPUTE`` for every
   other op (dropped nodes, and ops nothing in the backward pass reads). Ops are named as SAC counts
   them: the k-th call of an aten op inside one forward of the unit, so the policy does not depend on
   shapes (any batch size); the fused attention kernels share one name (``SAME_OP``).
5. **The recomputation runs what the forward ran.** SAC hands the k-th call of an op in the
   recomputation what the forward filed for its k-th call of that op, so a forward that changes state it
   reads (a key/value cache appended to) breaks it mid-backward. ``apply`` hands checkpointed submodules
   no transformers cache (:func:`without_caches`), and the export runs one step on fake tensors with the
   checkpoints applied (:func:`recomputation_mismatches`): a submodule whose recomputation fails
   :func:`recomputation_mismatch` is left out (``INFO["not_checkpointed"]``) and the units chosen again;
   a plan nothing is left to realise is refused with an ExportError.

Where it differs from the plan (the measured peak shows it; docs/EXPORT.md has numbers): a unit is
rebuilt as a whole at its first saved-tensor use in the backward pass (the plan rebuilds a region right
before the first backward reader of a *dropped* node), the rebuild re-runs the unit's ops up to the
last saved one (transient tensors the plan does not rebuild), the unit's inputs are held by the
checkpoint until then, and a dropped node that no module call short of the whole model holds together
with its readers (or that the loss computes) stays saved: ``INFO["unrealised_dropped_bytes"]``.

General schedules (checkmate, moccasin, dtr, coop: several recomputations of one tensor, frees that
are not at last use) have no such form and are refused with a pointer to ``--backend replay``.

The folder is written by :func:`bonsai_core.export.folder.write_folder` with the README of
:func:`bonsai_core.export.readme.checkpoint_readme`, and checked by
:func:`bonsai_core.export.verify.verify_checkpoint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pprint
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from bonsai_core.attention import records_attention_dropout
from bonsai_core.derivatives import saves_own_output
from bonsai_core.errors import ScheduleError
from bonsai_core.export_runtime import checkpointing
from bonsai_core.export_runtime.checkpointing import OpCalls, apply_saves, kv_cache_type, without_caches
from bonsai_core.export.folder import ExportError, schedule_info, trace_for_schedule, write_folder
from bonsai_core.export.readme import checkpoint_readme
from bonsai_core.graph import Graph
from bonsai_core.modules import RecordedStep, align, record_step
from bonsai_core.offload import with_offloads
from bonsai_core.regions import CheckpointPlan, dropped_nodes, useful_saved
from bonsai_core.schedule import COMPUTE, FREE, Schedule, hold_separated_outputs, sequence_ops, simulate
from bonsai_core.trace import autocast_context, built_for_tracing

CHECKPOINT_RUNTIME = Path(checkpointing.__file__)


@dataclass(frozen=True)
class Unit:
    """One checkpointed submodule: its name in ``model.named_modules()`` and, per aten op, which of
    its calls inside one forward of the submodule save their output (the rest are recomputed)."""

    path: str
    saves: dict[str, list[int]]
    ops: int  # aten ops one forward of the submodule runs
    dropped_bytes: int  # bytes of the plan's dropped nodes this unit recomputes


@dataclass(frozen=True)
class CheckpointLayout:
    """How a plan maps onto a model's submodules."""

    units: list[Unit]
    dropped_bytes: int  # all the plan's dropped nodes
    unrealised: list[int]  # dropped nodes that stay saved (no unit holds them with their readers)
    unrealised_bytes: int
    realised_peak: int  # the simulator's peak of what the checkpoints really run (realised_sequence)
    # the plan's offloaded nodes the run offloads (saved-tensor hooks), by (submodule path, aten op, k)
    offloaded: dict[tuple[str, str, int], int] = dataclasses.field(default_factory=dict)
    offloaded_bytes: int = 0
    host_peak: int = 0  # the simulator's pinned host bytes of those offloads

    @property
    def save(self) -> dict[str, dict[str, list[int]]]:
        """The plan as the runtime applies it: submodule path -> its save policy."""
        return {u.path: u.saves for u in self.units}

    @property
    def offload(self) -> dict[str, dict[str, list[int]]]:
        """The offloads as the runtime applies them (``apply_offloads``): submodule path -> {aten op: [k, ...]}."""
        out: dict[str, dict[str, list[int]]] = {}
        for path, op, k in sorted(self.offloaded):
            out.setdefault(path, {}).setdefault(op, []).append(k)
        return out


# -- plan -> units ---------------------------------------------------------------------------------

def layout(graph: Graph, plan: CheckpointPlan, step: RecordedStep, exclude: Collection[str] = (),
           synchronous: bool = True) -> CheckpointLayout:
    """Choose the checkpointed submodules and their save policies for ``plan`` (see the module doc),
    never a submodule named in ``exclude``, and the plan's offloads the run can make (:func:`offload_names`).

    The candidates are the outermost module calls chosen for the dropped nodes; then, while it lowers
    the simulated peak of what the checkpoints will really do (:func:`realised_sequence`, with the
    offloads; ``synchronous``: each offload's copy ends before the next compute, as on the CPU), a unit
    is replaced by the chosen calls nested in it, or removed. O(units * (n + edges)) per pass."""
    node_at, runtime_of = _align_forward(graph, step)
    dropped = dropped_nodes(graph, plan)
    read_by_backward = graph.read_by_backward
    chains = inplace_chains(step)
    calls, chosen = _candidate_calls(graph, step, dropped, runtime_of, exclude, chains)
    # what the checkpoints keep: what the backward pass reads and what the plan saves (a matmul whose
    # output only the recomputation reads: its policy says MUST_SAVE, as the plan does)
    read_later = read_by_backward.copy()
    read_later[list(useful_saved(graph, plan).saved)] = True
    rebuilt = {i: _chain_nodes(graph, node_at, runtime_of, read_later, chains, a, b)
               for i, (_, a, b) in enumerate(calls)}
    names = offload_names(graph, plan, step, runtime_of)
    by_call = dict(zip(step.calls, step.arguments))
    arguments = {i: sorted(_last_placed(node_at, by_call.get(call, ()))) for i, call in enumerate(calls)}
    candidates = _Candidates(graph, node_at, read_later, calls, chosen, rebuilt, names, synchronous, arguments)
    units, _ = candidates.improve(candidates.outermost(list(chosen)))
    parts, realised = candidates.realise(units)
    saved = kept_for_backward(graph, read_later, realised)
    out = [_unit(graph, step, node_at, saved, calls[i], nodes, drops, chains) for i, (nodes, drops) in zip(units, parts)]
    unrealised = np.flatnonzero(dropped & ~realised)
    sim, offloaded = candidates.simulated(parts, units)
    return CheckpointLayout(out, int(graph.mem[dropped].sum()), unrealised.tolist(), int(graph.mem[unrealised].sum()),
                            2**62 if sim is None else sim.peak, {name: v for name, v in names.items() if v in offloaded},
                            int(graph.mem[sorted(offloaded)].sum()) if offloaded else 0, 0 if sim is None else sim.host_peak)


def _last_placed(node_at: np.ndarray, storages: Collection[tuple[int, ...]]) -> set[int]:
    """Per storage (the run-time ops that made and wrote it), the graph node of the last, where it is placed."""
    return {int(node_at[ops[-1]]) for ops in storages if node_at[ops[-1]] >= 0}


def offload_names(graph: Graph, plan: CheckpointPlan, step: RecordedStep, runtime_of: np.ndarray) -> dict[tuple[str, str, int], int]:
    """The plan's offloaded nodes a run can name, by (submodule path, aten op, k): the output of the k-th
    call of the op (SAC's count, ``SAME_OP``'s names) inside one forward of the innermost module call
    holding the node's op that runs once per step (the model's own call: path ""). A separated output
    of a multi-output op (``getitem``) and an op no module call holds (the loss's) have no name: they
    stay on the device."""
    once = [(p, a, b) for p, a, b in step.calls if step.call_counts[p] == 1]
    names: dict[tuple[str, str, int], int] = {}
    for v in sorted(plan.offloaded):
        r = int(runtime_of[v])
        if r < 0 or graph.output_of[v] >= 0 or graph.ops[v] == "getitem":
            continue
        holding = [(p, a) for p, a, b in once if a <= r < b]
        if not holding:
            continue
        path, a = max(holding, key=lambda c: c[1])  # the innermost: the latest start (calls nest)
        calls = OpCalls()
        op, k = [calls(o) for o in step.ops[a:r + 1]][-1]
        names[(path, op, k)] = v
    return names


def _align_forward(graph: Graph, step: RecordedStep) -> tuple[np.ndarray, np.ndarray]:
    """(run-time op -> graph node or -1, graph node -> run-time op or -1): the recorded step's ops placed
    on the graph's forward nodes."""
    forward = np.flatnonzero(graph.is_forward)
    at = align(step.ops, [graph.ops[v] for v in forward])
    node_at = np.where(at >= 0, forward[np.maximum(at, 0)], -1)  # run-time op -> graph node, or -1
    runtime_of = np.full(graph.n, -1, dtype=np.int64)
    runtime_of[node_at[node_at >= 0]] = np.flatnonzero(node_at >= 0)
    for v in forward.tolist():  # a multi-output op's outputs (getitem nodes) are made by their op's run
        if runtime_of[v] < 0 and graph.ops[v] == "getitem" and len(graph.deps(v)):
            runtime_of[v] = runtime_of[graph.deps(v)[0]]
        elif runtime_of[v] < 0 and graph.is_view[v] and graph.alias_of[v] >= 0:
            # a view no run-time op is placed on is made with its base: eager may have made it another
            # way (ATen's CPU GRU cell writes its gates in place into views of its hidden projection)
            runtime_of[v] = runtime_of[graph.alias_of[v]]
    return node_at, runtime_of


def _candidate_calls(graph: Graph, step: RecordedStep, dropped: np.ndarray, runtime_of: np.ndarray,
                     exclude: Collection[str], chains: list[list[int]] = ()) -> tuple[list[tuple[str, int, int]], dict[int, list[int]]]:
    """(module calls that may be units: inside the model, not the whole model, called once per step, not
    in ``exclude``, not writing their input in place (``chains``: its recomputation would write it once
    more); call index -> the dropped nodes whose innermost holding call it is)."""
    calls = [(p, a, b) for p, a, b in step.calls if p and step.call_counts[p] == 1 and p not in exclude
             and not any(c[0] < a and any(a <= r < b for r in c) for c in chains)]
    chosen: dict[int, list[int]] = {}
    for d in np.flatnonzero(dropped).tolist():
        made_by = graph.output_of[d] if graph.output_of[d] >= 0 else d  # a separated output runs as its op
        span = [runtime_of[made_by]] + [runtime_of[u] for u in graph.users(d).tolist() if graph.is_forward[u]]
        if min(span) < 0:
            continue
        holding = [i for i, (_, a, b) in enumerate(calls) if a <= min(span) and max(span) < b]
        if holding:
            chosen.setdefault(min(holding, key=lambda i: calls[i][2] - calls[i][1]), []).append(d)
    return calls, chosen


@dataclass
class _Candidates:
    """The candidate module calls of a layout, and the simulated peak of a choice of units among them."""

    graph: Graph
    node_at: np.ndarray  # run-time op -> graph node, or -1
    read_by_backward: np.ndarray  # bool[n]
    calls: list[tuple[str, int, int]]  # (path, first op, end op) per candidate call
    chosen: dict[int, list[int]]  # call index -> dropped nodes whose innermost holding call it is
    rebuilt: dict[int, list[int]] = None  # call index -> nodes its recomputation rebuilds though kept (in-place chains)
    offloads: dict[tuple[str, str, int], int] = dataclasses.field(default_factory=dict)  # offload_names
    synchronous: bool = True  # an offload's copy ends before the next compute (the CPU's)
    arguments: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # call index -> its tensor arguments' nodes

    def inside(self, j: int, i: int) -> bool:
        """Whether call ``j`` runs within call ``i``."""
        calls = self.calls
        return calls[i][1] <= calls[j][1] and calls[j][2] <= calls[i][2]

    def outermost(self, ids: list[int]) -> list[int]:
        """The calls of ``ids`` no other (different-spanned) call of ``ids`` holds, in run order."""
        calls = self.calls
        return sorted((i for i in ids if not any(j != i and self.inside(i, j) and calls[j][1:] != calls[i][1:]
                                                  for j in ids)), key=lambda i: calls[i][1])

    def realise(self, units: list[int]) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Per unit (its graph nodes, its dropped nodes), and every dropped node realised. A unit's nodes
        no run-time op is placed on (:func:`unplaced_inside`) are dropped too: its policy cannot name them
        to save them."""
        graph, calls, chosen = self.graph, self.calls, self.chosen
        rebuilt = self.rebuilt or {}
        placed = set(self.node_at[self.node_at >= 0].tolist())
        unplaced = {i: unplaced_inside(graph, self.node_at[calls[i][1]:calls[i][2]], placed) for i in units}
        groups = [np.array(sorted({d for j in chosen if self.inside(j, i) for d in chosen[j]}.union(
            rebuilt.get(i, ()), unplaced[i])), dtype=np.int64) for i in units]
        realised = np.zeros(graph.n, dtype=bool)
        for drops in groups:
            realised[drops] = True
        realised &= ~kept_for_backward(graph, self.read_by_backward, realised)  # the base of a kept view stays
        out = []
        separated = np.flatnonzero(graph.output_of >= 0)
        for i, drops in zip(units, groups):
            nodes = self.node_at[calls[i][1]:calls[i][2]]
            nodes = np.union1d(nodes[nodes >= 0], unplaced[i])
            nodes = np.union1d(nodes, separated[np.isin(graph.output_of[separated], nodes)])  # run with their op
            out.append((with_unplaced_views(graph, nodes, placed), drops[realised[drops]]))
        return out, realised

    def offloaded(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> set[int]:
        """The named offloads (``offloads``) the units ``parts`` leave to the saved-tensor hooks: nodes
        outside every unit that no unit reads (a checkpoint holds its inputs, and SAC its saved outputs,
        on the device)."""
        inside = set()
        for nodes, _ in parts:
            inside.update(nodes.tolist())
        graph = self.graph
        return {v for v in self.offloads.values() if v not in inside
                and not any(graph.is_forward[u] and u in inside for u in graph.users(v).tolist())}

    def simulated(self, parts: list[tuple[np.ndarray, np.ndarray]], units: list[int]) -> tuple[Any, set[int]]:
        """The simulation of what the checkpointed ``parts`` (:meth:`realise` of ``units``) really run
        (:func:`realised_ops`), with the offloads they leave (:meth:`offloaded`; each reloaded right
        before its first backward reader, as the unpack hook does), and those offloads; (None, no
        offloads) when the sequence model cannot express it."""
        offloaded = self.offloaded(parts) if self.offloads else set()
        try:
            ops = realised_ops(self.graph, parts, self.read_by_backward, [self.arguments.get(i, ()) for i in units])
            if offloaded:
                ops = with_offloads(self.graph, ops, offloaded, float("inf"), self.synchronous)
            return simulate(self.graph, ops), offloaded
        except ScheduleError:
            return None, set()

    def peak(self, units: list[int]) -> int:
        """The simulated peak of what checkpointing ``units`` really runs (:meth:`simulated`)."""
        sim, _ = self.simulated(self.realise(units)[0], units)
        return 2**62 if sim is None else sim.peak  # a layout the sequence model cannot express: never prefer it

    def improve(self, units: list[int]) -> tuple[list[int], int]:
        """(units, their peak) after replacing a unit by the chosen calls nested in it, or removing it,
        while that lowers the peak (first improvement taken, then start over)."""
        calls = self.calls
        best = self.peak(units)
        improved = True
        while improved:
            improved = False
            for i in units:
                rest = [j for j in units if j != i]
                nested = self.outermost([j for j in self.chosen
                                         if j != i and self.inside(j, i) and calls[j][1:] != calls[i][1:]])
                for alternative in ([*rest, *nested], rest) if nested else (rest,):
                    p = self.peak(sorted(alternative, key=lambda j: calls[j][1]))
                    if p < best:
                        units, best, improved = sorted(alternative, key=lambda j: calls[j][1]), p, True
                        break
                if improved:
                    break
        return units, best


def unplaced_inside(graph: Graph, at: np.ndarray, placed: set[int]) -> list[int]:
    """The forward nodes between a unit's first and last placed node (``at``: the graph nodes of its
    run-time ops, -1 where none) that no run-time op is placed on and that are no view nor separated
    output: ops the call does not run as traced. A transformers key/value cache's ``cat`` is one: a
    checkpointed call gets no cache (:func:`hidden_caches`), so its attention reads its keys and values
    as computed, and the trace's copy of them into the cache is never made."""
    at = at[at >= 0]
    if not len(at):
        return []
    return [v for v in range(int(at.min()) + 1, int(at.max()))
            if v not in placed and graph.is_forward[v] and not graph.is_view[v] and graph.output_of[v] < 0
            and graph.ops[v] != "getitem"]


def with_unplaced_views(graph: Graph, nodes: np.ndarray, placed: set[int]) -> np.ndarray:
    """``nodes`` (a unit's graph nodes, in order) and the forward views of them that no run-time op is
    placed on (``placed``: the nodes that are): such a view is made with its base (``_align_forward``)."""
    inside = set(nodes.tolist())
    for v in np.flatnonzero(graph.is_forward & graph.is_view).tolist():
        if v not in placed and int(graph.alias_of[v]) in inside:
            inside.add(v)
    return np.array(sorted(inside), dtype=np.int64)


def _unit(graph: Graph, step: RecordedStep, node_at: np.ndarray, saved: np.ndarray, call: tuple[str, int, int],
          nodes: np.ndarray, drops: np.ndarray, chains: list[list[int]] = ()) -> Unit:
    """The unit of module ``call`` (its graph ``nodes``, its dropped nodes ``drops``): per op as SAC
    counts it, the calls whose output is ``saved`` and saved by an op of the unit: read inside it, or
    saved by its own op's autograd formula (``sigmoid``'s result, a fused recurrent kernel's outputs and
    workspace: :func:`bonsai_core.derivatives.saves_own_output`), with every in-place chain (``chains``)
    saved as :func:`saved_in_place` says. Without the policy naming such an op, its output would be
    recomputed, not kept."""
    path, a, b = call
    inside = set(nodes[graph.output_of[nodes] < 0].tolist())  # the ops (a separated output is its op's)
    kept = {r for r in range(a, b) if node_at[r] >= 0 and saved[node_at[r]]
            and (read_inside(graph, node_at[r], inside) or saves_own_output(graph.ops[node_at[r]]))}
    kept = saved_in_place(kept, chains, a, b) - on_unplaced_bytes(step, node_at, range(a, b))
    saves: dict[str, list[int]] = {}
    calls = OpCalls()
    for r in range(a, b):
        op, k = calls(step.ops[r])
        if r in kept:
            saves.setdefault(op, []).append(k)
    return Unit(path, saves, b - a, int(graph.mem[drops].sum()) if len(drops) else 0)


def on_unplaced_bytes(step: RecordedStep, node_at: np.ndarray, ops: Iterable[int]) -> set[int]:
    """The run-time ``ops`` whose output is a view or alias of bytes another run-time op made that no
    graph node is placed on: saving such an output holds bytes the simulator never counts. A
    transformers attention run without its key/value cache (:func:`hidden_caches`) is one: its key, no
    longer ``cat``'s contiguous output, is copied (``clone``) for the ``bmm`` of SDPA's math path, and
    the ``_unsafe_view`` placed on the traced ``view`` of the key is a view of that copy. Left unsaved,
    the recomputation makes it again from what is saved."""
    made_by = step.bytes_made_by
    return {r for r in ops if r < len(made_by) and 0 <= made_by[r] != r and node_at[made_by[r]] < 0}


def inplace_chains(step: RecordedStep) -> list[list[int]]:
    """The run-time ops that share one activation's bytes: its producer, then each op that wrote it in
    place, whole (``step.inplace``) or through a view (``step.view_writes``: ATen's CPU LSTM and GRU
    cells write their gates into views of one tensor; SAC cannot save those either), in run order;
    only chains with a write."""
    root: dict[int, int] = {}
    chains: dict[int, list[int]] = {}
    for w, p in sorted([*step.inplace, *step.view_writes]):
        r = root.setdefault(w, root.get(p, p))
        chains.setdefault(r, [r]).append(w)
    return list(chains.values())


def saved_in_place(kept: set[int], chains: list[list[int]], a: int, b: int) -> set[int]:
    """``kept`` (run-time ops of the unit ``[a, b)`` whose outputs its SAC policy saves) without the ops
    of an in-place chain (docs/EXPORT.md, "In-place writes"): SAC cannot save them. It caches an alias
    of a saved output, which a later write changes (its check refuses that, even for the in-place op's
    own output, whose version the write bumps after SAC caches it), and in the recomputation an
    in-place op hands autograd its own first argument, not the cached tensor. So a chain is recomputed
    whole, from a fresh output of its producer: the values every reader saw in the forward."""
    return kept.difference(r for chain in chains for r in chain if a <= r < b)


def _chain_nodes(graph: Graph, node_at: np.ndarray, runtime_of: np.ndarray, read_later: np.ndarray,
                 chains: list[list[int]], a: int, b: int) -> list[int]:
    """The graph nodes of the in-place chains' ops in ``[a, b)`` that the checkpoints would keep
    (``read_later``: read by the backward pass, or saved by the plan for its recomputation, such as the
    hidden projection ATen's CPU recurrent cell adds the step's input into in place) and no forward op
    after ``[a, b)`` reads: a unit there frees them after its forward and rebuilds them
    (:func:`saved_in_place`) even where the plan keeps them. (A chain's output that a later op reads
    stays held by that reader, as the plan keeps it.)"""
    nodes = [int(node_at[r]) for chain in chains for r in chain if a <= r < b and node_at[r] >= 0]
    return [v for v in nodes if read_later[v]
            and all(a <= runtime_of[u] < b and not graph.is_view[u] for u in graph.users(v).tolist() if graph.is_forward[u])]


def read_inside(graph: Graph, v: int, inside: set[int]) -> bool:
    """Whether a forward op of the unit ``inside`` reads ``v`` (directly or through views of it). Only
    then can the unit's own backward save it; a unit output read only outside (say the input of the
    next layer's matmul) is saved by its reader as usual, and SAC caching it too would hold it until the
    unit's recomputation pops it, or to the end of the step when the recomputation stops early."""
    stack = [v]
    while stack:
        for u in graph.users(stack.pop()).tolist():
            if graph.is_forward[u] and u in inside:
                if graph.is_view[u]:
                    stack.append(u)
                else:
                    return True
    return False


def kept_for_backward(graph: Graph, read_by_backward: np.ndarray, realised: np.ndarray) -> np.ndarray:
    """bool[n]: forward nodes the checkpoints save: read by the backward pass and not dropped, and the
    base of every such view (saving a view holds its base's storage; recomputing the base would make a
    second copy)."""
    kept = graph.is_forward & read_by_backward & ~realised
    for v in range(graph.n - 1, -1, -1):  # views come after their bases
        if kept[v] and graph.alias_of[v] >= 0:
            kept[graph.alias_of[v]] = True
    return kept


def realised_sequence(graph: Graph, units: list[tuple[np.ndarray, np.ndarray]], read_by_backward: np.ndarray) -> list[int]:
    """The compute sequence the checkpoints really run, as the simulator's input: the forward pass
    once; before the first backward node that reads a dropped node of a unit or a saved one its own ops
    read, the unit's recomputation: its nodes in order up to the last saved-or-dropped one the backward
    pass reads, except the saved ones (SAC hands those back from its cache). Dropped nodes outside every
    unit stay saved."""
    return _realised(graph, units, read_by_backward)[0]


def _realised(graph: Graph, units: list[tuple[np.ndarray, np.ndarray]],
              read_by_backward: np.ndarray) -> tuple[list[int], list[tuple[int, int, set[int]]]]:
    """(:func:`realised_sequence`, per recomputation run: its first and last positions in the sequence and
    the nodes it computes that the frames running it still hold when it stops, :func:`held_at_stop`)."""
    seq = np.flatnonzero(graph.is_forward).tolist()
    realised = np.zeros(graph.n, dtype=bool)
    for _, drops in units:
        realised[drops] = True
    kept = kept_for_backward(graph, read_by_backward, realised)
    triggers = []
    for nodes, drops in units:
        saved = nodes[kept[nodes]]
        inside = set(nodes.tolist())
        # the checkpoint's hooks packed only what the unit's own ops saved: a kept output that only later
        # ops read (the block's residual sum) is theirs, and reading it does not start the recomputation
        packed = [v for v in saved.tolist() if read_inside(graph, v, inside) or saves_own_output(graph.ops[v])]
        # a dropped node the backward pass does not read (an op eager does not run as traced) is packed by
        # no hook: the recomputation stops before it
        watch = {d for d in drops.tolist() if read_by_backward[d]}.union(packed)
        order = sorted(set(nodes.tolist()))
        last = max((v for v in order if v in watch), default=-1)
        skip = set(saved.tolist())
        rebuild = [v for v in order if v <= last and v not in skip]
        triggers.append((watch, rebuild, held_at_stop(graph, rebuild, last)))
    done = [False] * len(units)
    runs = []
    for b in np.flatnonzero(~graph.is_forward).tolist():
        deps = set(graph.deps(b).tolist())
        for k, (watch, rebuild, held) in enumerate(triggers):
            if not done[k] and deps & watch:
                done[k] = True
                if rebuild:
                    runs.append((len(seq), len(seq) + len(rebuild) - 1, held))
                seq.extend(rebuild)
        seq.append(b)
    return seq, runs


def held_at_stop(graph: Graph, rebuild: list[int], last: int) -> set[int]:
    """The nodes of a unit's recomputation (``rebuild``, up to node ``last``) that a forward op after
    ``last`` reads, directly or through a view, and their bases. The recomputation stops early, right
    where the last saved tensor is packed (``torch.utils.checkpoint``'s early stop raises out of the
    unit's forward), so its Python and C++ frames hold every such tensor until then, as the forward
    held them: ATen's CPU recurrent layer its input projection, whose steps' views its ``unbind`` keeps
    until the outputs are stacked, and each layer's final hidden state until the layer loop ends."""
    held = set()
    for v in rebuild:
        stack = [v]
        while stack:
            users = [int(u) for u in graph.users(stack.pop()).tolist() if graph.is_forward[u]]
            if any(u > last for u in users):
                held.add(v)
                break
            stack.extend(u for u in users if graph.alias_of[u] >= 0)
    return graph.with_view_bases(held)


def _held_to_stop(ops: list[tuple[str, int]], runs: list[tuple[int, int, set[int]]]) -> list[tuple[str, int]]:
    """``ops`` (:func:`sequence_ops` of a sequence) with each free of a run's held nodes (``runs``: first and
    last sequence positions, the nodes held) that comes within the run put off until right after its
    last compute, in their order (views before bases)."""
    computes = [i for i, (kind, _) in enumerate(ops) if kind == COMPUTE]  # the p-th compute: sequence position p
    moved: dict[int, list[tuple[str, int]]] = {}  # op index -> the frees to put right after it
    skipped: set[int] = set()
    for first, last, held in runs:
        a, b = computes[first], computes[last]
        frees = [i for i in range(a + 1, b) if ops[i][0] == FREE and ops[i][1] in held]
        moved.setdefault(b, []).extend(ops[i] for i in frees)
        skipped.update(frees)
    out: list[tuple[str, int]] = []
    for i, op in enumerate(ops):
        if i not in skipped:
            out.append(op)
        if i in moved:
            out.extend(moved[i])
    return out


def realised_ops(graph: Graph, units: list[tuple[np.ndarray, np.ndarray]], read_by_backward: np.ndarray,
                 arguments: list[Collection[int]] = ()) -> list[tuple[str, int]]:
    """The simulator's ops of what the checkpoints really run: :func:`realised_sequence`, each copy freed
    after its last reader, except each unit's inputs (forward nodes outside it that its nodes read, not
    only hold; the unit call's tensor ``arguments`` its ops may not read; their bases): ``torch.utils.checkpoint``
    keeps the arguments of a checkpointed call for its recomputation until the last backward node that
    saved a tensor inside the call has run (its saved tensors' unpack hooks hold the call's frame), so
    they are freed right after the last backward node that reads a node of the unit or one of its
    inputs, if not later anyway."""
    seq, runs = _realised(graph, units, read_by_backward)
    ops = hold_separated_outputs(graph, _held_to_stop(sequence_ops(graph, seq), runs))
    hold: dict[int, int] = {}  # unit input -> the backward node it is held until
    backward = np.flatnonzero(~graph.is_forward)
    for k, (nodes, _) in enumerate(units):
        inside = set(nodes.tolist())
        # a dep the unit's op only holds (the frame of a module call holding its caller's argument, as the
        # attention call holds the norm's output that its input hook all-gathered) is no input of the unit
        inputs = graph.with_view_bases({int(d) for v in inside for d in graph.deps(v).tolist()
                                        if d not in inside and graph.is_forward[d] and d not in graph.held[v]})
        readers = [int(b) for b in backward if inside.union(inputs) & set(graph.deps(b).tolist())]
        inputs |= graph.with_view_bases({int(u) for u in (arguments[k] if k < len(arguments) else ()) if int(u) not in inside})
        if readers:
            for u in inputs:
                hold[u] = max(hold.get(u, -1), readers[-1])
    return _held(ops, hold)


def _held(ops: list[tuple[str, int]], hold: dict[int, int]) -> list[tuple[str, int]]:
    """``ops`` with the first free of each node of ``hold`` put off until right after its backward node
    is computed (or right before the node is computed again, whichever comes first), where that free
    comes before it; views before their bases, as the simulator wants."""
    out: list[tuple[str, int]] = []
    deferred: set[int] = set()
    done: set[int] = set()
    computed: set[int] = set()
    for kind, v in ops:
        if kind == FREE and v in hold and v not in done and hold[v] not in computed:
            deferred.add(v)
            done.add(v)
            continue
        if kind == COMPUTE and v in deferred:
            out.append((FREE, v))
            deferred.discard(v)
        out.append((kind, v))
        if kind == COMPUTE:
            computed.add(v)
            ending = sorted((u for u in deferred if hold[u] == v), reverse=True)  # views come after bases
            for u in ending:
                out.append((FREE, u))
                deferred.discard(u)
    return out + [(FREE, u) for u in sorted(deferred, reverse=True)]


@contextlib.contextmanager
def _on_fake_tensors(model: str) -> Any:
    """Run ``model``'s step on fake tensors as the trace does (``torch._assert`` on a tensor skipped); a
    failure there is an ExportError, not a traceback."""
    from bonsai_core.errors import BonsaiError
    from bonsai_core.trace.patches import skip_tensor_asserts

    try:
        with skip_tensor_asserts():
            yield
    except BonsaiError:
        raise
    except Exception as e:  # noqa: BLE001 (the user's model code, run on shapes only)
        raise ExportError(f"The checkpoint back-end runs {model!r}'s step again on fake tensors to find the ops of "
                          f"its submodules, and it failed there: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
                          "Export with --backend replay, which runs the traced step.") from None


# -- the recomputation runs what the forward ran ---------------------------------------------------

class _OpLog(TorchDispatchMode):
    """Appends ``[op, output shapes]`` for every op SAC counts (the op first: SAC may raise in it)."""

    def __init__(self, ops: list[list[Any]]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        from torch.utils.checkpoint import SAC_IGNORED_OPS

        if func in SAC_IGNORED_OPS:
            return func(*args, **(kwargs or {}))
        entry = [str(func), None]
        self.ops.append(entry)
        out = func(*args, **(kwargs or {}))
        entry[1] = tuple(tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def _logged(context: Any, ops: list[list[Any]]) -> Any:
    with context, _OpLog(ops):
        yield


def recomputation_mismatch(forward: list[list[Any]], recompute: list[list[Any]]) -> str | None:
    """Why SAC would hand a recomputation (``[op, output shapes]`` per op) other tensors than its forward
    made, in words; None when it would not.

    SAC pairs the k-th call of an op in the recomputation with the k-th call of that op in the forward
    (the saved output, or a licence to run it again). The pairing is sound when every pair has the same
    output shapes and the pairs keep the forward's order; the recomputation may stop early, and may skip
    ops (a constant the forward built and cached) as long as no later call of the same op shifts."""
    calls: dict[str, list[int]] = {}  # op name -> the positions of its calls in the forward
    forward_calls, recompute_calls = OpCalls(), OpCalls()
    for i, (op, _) in enumerate(forward):
        calls.setdefault(forward_calls(op)[0], []).append(i)
    last = -1
    for j, (op, shapes) in enumerate(recompute):
        name, k = recompute_calls(op)
        if k >= len(calls.get(name, ())):
            return (f"its recomputation runs {op} (its op {j + 1}) more often than its forward did "
                    f"({len(calls.get(name, ()))} time(s)): the forward changes state that the recomputation reads")
        i = calls[name][k]
        if shapes is not None and forward[i][1] is not None and shapes != forward[i][1]:
            return (f"call {k + 1} of {op} makes shapes {list(shapes)} in its recomputation, "
                    f"{list(forward[i][1])} in its forward: the forward changes state that the recomputation reads")
        if i < last:
            return (f"its recomputation runs call {k + 1} of {op} (its op {j + 1}) out of the forward's order: "
                    "it skips or adds ops, so SAC would hand it another op's tensor")
        last = i
    return None


def recomputation_mismatches(save: dict[str, dict[str, list[int]]], model: str, net: nn.Module,
                             inputs: tuple[torch.Tensor, ...], loss_fn: Any, autocast: str | None = None,
                             advice: str = "Export with --backend replay.") -> dict[str, str]:
    """One training step of ``net`` (with ``inputs`` and ``loss_fn``, on fake tensors, under the caller's
    ``FakeTensorMode``) with the plan ``save`` applied, logging each checkpointed call's ops in its
    forward and in its recomputation: per submodule whose recomputation SAC would hand other tensors
    (:func:`recomputation_mismatch`), why. ``model`` names it in messages; the forward runs under
    ``autocast`` ("bf16" / "fp16") when given, as the step was traced. ``net`` is left without checkpoints.

    When the step fails in another way, each submodule is tried alone and the ones whose step fails are
    returned with the error (the others stay in the plan); ExportError (ending with ``advice``) when
    every one alone runs (the step would fail in training too)."""
    if not save:
        return {}
    runs, error = _checked_step(save, model, net, inputs, loss_fn, autocast)
    found: dict[str, str] = {}
    for path, forward, recompute in runs:
        why = recomputation_mismatch(forward, recompute)
        if why is not None:
            found.setdefault(path, why)
    if error is None or found:
        return found
    if len(save) > 1:
        for path, saves in save.items():
            _, alone = _checked_step({path: saves}, model, net, inputs, loss_fn, autocast)
            if alone is not None:
                found[path] = f"its recomputation fails: {str(alone).splitlines()[0]}"
    if not found:
        raise ExportError(f"One training step of {model!r} with its checkpoints applied fails (on fake tensors, "
                          f"before training): {str(error).splitlines()[0]} {advice}") from None
    return found


def _checked_step(save: dict[str, dict[str, list[int]]], model: str, net: nn.Module, inputs: tuple[torch.Tensor, ...],
                  loss_fn: Any, autocast: str | None) -> tuple[list[tuple[str, list, list]], RuntimeError | None]:
    """(each checkpointed call's path, forward ops and recomputation ops; the step's RuntimeError or None)
    of one step of ``net`` with ``save`` applied (removed again afterwards)."""
    from bonsai_core.export_runtime.checkpointing import contexts, remove_checkpoints
    from bonsai_core.packed import PackedSequences

    runs: list[tuple[str, list[list[Any]], list[list[Any]]]] = []

    def logged_contexts(path: str, saves: dict[str, list[int]]) -> tuple[Any, Any]:
        forward, recompute = contexts(saves)
        run = (path, [], [])
        runs.append(run)
        return _logged(forward, run[1]), _logged(recompute, run[2])

    error = None
    try:
        for path, saves in save.items():  # each its own contexts, which know its path
            apply_saves(net, {path: saves}, model, functools.partial(logged_contexts, path))
        with torch.enable_grad(), PackedSequences():
            with autocast_context(autocast):
                loss = loss_fn(net(*inputs))
            loss.backward()
    except RuntimeError as e:  # SAC's "not found in storage", checkpoint's CheckpointError
        error = e
    finally:
        remove_checkpoints(net)
    return runs, error


def faithful_layout(graph: Graph, plan: CheckpointPlan, step: RecordedStep,
                    mismatches: Callable[[dict[str, dict[str, list[int]]]], dict[str, str]],
                    offload_misses: Callable[[CheckpointLayout], set] | None = None,
                    synchronous: bool = True) -> tuple[CheckpointLayout, dict[str, str]]:
    """The :func:`layout` of ``plan`` without the submodules whose recomputation would not run what their
    forward ran (``mismatches(save)``: path -> why, :func:`recomputation_mismatches`), and those left out;
    then without the offloads the run would not make (``offload_misses(layout)``: their names,
    :func:`offload_misses`), which stay on the device and are predicted so. Each pass leaves out at least
    one more submodule or offload, so this ends."""
    not_checkpointed: dict[str, str] = {}
    while True:
        lay = layout(graph, plan, step, exclude=not_checkpointed, synchronous=synchronous)
        found = mismatches(lay.save)
        if found:
            not_checkpointed.update(found)
            continue
        missed = offload_misses(lay) if offload_misses is not None and lay.offloaded else set()
        if not missed:
            return lay, not_checkpointed
        plan = dataclasses.replace(plan, offloaded=plan.offloaded - {lay.offloaded[name] for name in missed})


def offload_misses(save: dict[str, dict[str, list[int]]], offload: dict[str, dict[str, list[int]]], model: str,
                   net: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any, autocast: str | None = None) -> set:
    """The names (path, aten op, k) of ``offload`` that one forward + loss of ``net`` (on fake tensors,
    under the caller's ``FakeTensorMode``) with ``save`` and ``offload`` applied does not offload: never
    made (another op count than recorded), never packed by the saved-tensor hooks (saved only inside a
    checkpointed submodule or by the loss), or still held on the device once the loss is computed (by a
    checkpoint's inputs, SAC's cache, a view the forward keeps). ``net`` is left without them."""
    from bonsai_core.export_runtime.checkpointing import apply_offloads, remove_checkpoints
    from bonsai_core.packed import PackedSequences

    wanted = {(path, op, k) for path, ops in offload.items() for op, ks in ops.items() for k in ks}
    apply_saves(net, save, model)
    try:
        offloader = apply_offloads(net, offload, model)
        offloader.packed, offloader.found = set(), {}
        with torch.enable_grad(), PackedSequences():
            with autocast_context(autocast):
                loss = loss_fn(net(*inputs))
            held = {name for name, ref in offloader.found.items() if ref() is not None}
            del loss
    finally:
        remove_checkpoints(net)
    return wanted - (offloader.packed - held)


def hidden_caches(model: nn.Module) -> contextlib.AbstractContextManager:
    """Within: every submodule of ``model`` is handed no transformers key/value cache, as checkpointed
    submodules run (:func:`without_caches`); afterwards each runs its own forward again."""
    stack = contextlib.ExitStack()
    cache = kv_cache_type()
    for module in model.modules() if cache is not None else ():
        had = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        module.forward = without_caches(module.forward, cache)
        stack.callback(_restore_forward, module, had, previous)
    return stack


def _restore_forward(module: nn.Module, had: bool, previous: Any) -> None:
    if had:
        module.forward = previous
    else:
        del module.forward


def export_checkpoint(model: str, options: dict[str, Any], schedule: Schedule, out_dir: str | Path, *,
                      profile: str | None = None, seed: int = 0, autocast: str | None = None) -> Path:
    """Write the checkpoint back-end's export of ``schedule`` (a bonsai/chen checkpoint-region plan)
    for ``model`` (a zoo name or ``package.module:factory``) built with ``options``, its step traced
    under ``autocast`` ("bf16" / "fp16") when given. Returns ``out_dir``.

    Raises ExportError for a schedule that is not a checkpoint-region plan (use the replay back-end),
    ScheduleError when the schedule was made for another graph."""
    from bonsai_core.packed import spec_batch_sizes, with_batch_sizes_on_demand

    return with_batch_sizes_on_demand(lambda: _export_checkpoint(model, options, schedule, out_dir, profile=profile,
                                                                 seed=seed, autocast=autocast),
                                      spec_batch_sizes(model, seed, options))


def _export_checkpoint(model: str, options: dict[str, Any], schedule: Schedule, out_dir: str | Path, *,
                       profile: str | None, seed: int, autocast: str | None) -> Path:
    if "segments" not in schedule.extra:
        raise ExportError(
            f"The checkpoint back-end applies checkpoint-region plans (methods bonsai and chen); this "
            f"{schedule.method!r} schedule is a general recompute sequence (a tensor may be recomputed several "
            "times, or freed before its last use), which torch.utils.checkpoint cannot express. Export it with "
            "--backend replay, or solve with --method chen, or bonsai with --option space=regions (its default "
            "may answer with an op-level plan).")
    traced = trace_for_schedule(model, options, schedule, profile=profile, seed=seed, autocast=autocast)
    graph = traced.graph
    sim = simulate(graph, schedule)
    plan = CheckpointPlan.from_extra(schedule.extra)
    with built_for_tracing(model, seed, **options) as (net, inputs, loss_fn), _on_fake_tensors(model):
        with hidden_caches(net), autocast_context(autocast):  # as the checkpointed submodules will run
            step = record_step(net, inputs, loss_fn)

    def mismatches(save: dict[str, dict[str, list[int]]]) -> dict[str, str]:
        if not save:
            return {}
        with built_for_tracing(model, seed, **options) as (net, inputs, loss_fn), _on_fake_tensors(model):
            return recomputation_mismatches(save, model, net, inputs, loss_fn, autocast)

    def misses(lay: CheckpointLayout) -> set:
        with built_for_tracing(model, seed, **options) as (net, inputs, loss_fn), _on_fake_tensors(model):
            return offload_misses(lay.save, lay.offload, model, net, inputs, loss_fn, autocast)

    lay, not_checkpointed = faithful_layout(graph, plan, step, mismatches, misses)
    info = {**schedule_info(graph, schedule, sim, "checkpoint"), "model": model, "options": dict(options), "seed": seed,
            "batch": int(inputs[0].shape[0]) if inputs and inputs[0].dim() else None,
            "realised_peak": lay.realised_peak,
            "dropped_bytes": lay.dropped_bytes, "unrealised_dropped_bytes": lay.unrealised_bytes,
            "unrealised_dropped_nodes": len(lay.unrealised), "not_checkpointed": dict(not_checkpointed),
            "autocast": autocast, "attention_dropout": records_attention_dropout(graph),
            "offloaded_tensors": len(lay.offloaded), "offloaded_bytes": lay.offloaded_bytes,
            "offloads_kept_on_device": len(plan.offloaded) - len(lay.offloaded), "host_peak": lay.host_peak}
    source = generate_source(info, lay)
    if not_checkpointed and not lay.units and lay.dropped_bytes:
        path, why = next(iter(not_checkpointed.items()))
        raise ExportError(
            f"The checkpoint back-end cannot apply this plan to {model!r}: no submodule that would realise it "
            f"can be recomputed faithfully; `{path}`: {why}. torch.utils.checkpoint requires a recomputation to "
            "run the ops its forward ran: keep a submodule's forward free of state that it changes and reads back "
            "(a cache it appends to), or export with --backend replay, which runs the traced step.")
    return write_folder(out_dir, source, graph, schedule, sim, lambda folder: checkpoint_readme(
        info, [(u.path, u.ops, sum(map(len, u.saves.values())), u.dropped_bytes) for u in lay.units], folder))


_TEMPLATE = '''\
"""Checkpointed training for `{model}`: the {method} schedule of graph `{graph}`, applied to your own module.

Generated by `bonsai export --backend checkpoint` (see README.md). Plain PyTorch only:

    import checkpointed
    checkpointed.apply(model)          # in place; returns model
    loss = loss_fn(model(*inputs)); loss.backward()

`apply` wraps each submodule named in SAVE in torch.utils.checkpoint.checkpoint (non-reentrant) with
a selective-activation-checkpointing policy: inside one forward of that submodule, the k-th call of
an aten op keeps its output for the backward pass if k is listed under the op (MUST_SAVE); every
other op is recomputed in the backward pass (PREFER_RECOMPUTE). Any batch size; autocast works.
A checkpointed submodule is handed no transformers key/value cache (None instead), as transformers'
own gradient checkpointing does: its recomputation would append to the cache again.
The outputs OFFLOAD names (the k-th call of an aten op inside one forward of a submodule) are copied
to host memory when autograd saves them and back when the backward pass reads them (saved-tensor hooks).
"""

{runtime}

INFO = {info}

SAVE = {save}

OFFLOAD = {offload}


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Checkpoint ``model``'s submodules as the schedule says, and offload what OFFLOAD names (in
    place); return ``model``. ``remove_checkpoints(model)`` undoes both."""
    apply_saves(model, SAVE, INFO["model"])
    if OFFLOAD:
        apply_offloads(model, OFFLOAD, INFO["model"])
    return model
'''


def generate_source(info: dict[str, Any], lay: CheckpointLayout) -> str:
    """The text of ``checkpointed.py``."""
    save = lay.save
    return _TEMPLATE.format(model=info["model"], method=info["method"], graph=info["graph"],
                            runtime=CHECKPOINT_RUNTIME.read_text().rstrip(),
                            info=pprint.pformat(info, sort_dicts=False, width=110),
                            save=pprint.pformat(save, sort_dicts=False, width=110),
                            offload=pprint.pformat(lay.offload, sort_dicts=False, width=110))
