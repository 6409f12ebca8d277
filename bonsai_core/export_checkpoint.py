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
   kept and read by the backward pass (and the bases of such views), ``PREFER_RECOMPUTE`` for every
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
"""

from __future__ import annotations

import contextlib
import json
import pprint
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Collection

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from bonsai_core.attention import records_attention_dropout
from bonsai_core.errors import ModelError, ScheduleError
from bonsai_core.export import ExportError, load_export, trace_for_schedule
from bonsai_core.export.verify import (PEAK_TOLERANCE, gradient_problem, largest_differences, loss_problem,
                                       measuring_device, precision_of)
from bonsai_core.export_runtime import checkpointing
from bonsai_core.export_runtime.checkpointing import SAME_OP, apply_saves, kv_cache_type, without_caches
from bonsai_core.graph import Graph
from bonsai_core.modules import RecordedStep, align, record_step
from bonsai_core.regions import CheckpointPlan, dropped_nodes
from bonsai_core.schedule import Schedule, schedule_ops, simulate
from bonsai_core.trace import _autocast, built_for_tracing

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

    @property
    def save(self) -> dict[str, dict[str, list[int]]]:
        """The plan as the runtime applies it: submodule path -> its save policy."""
        return {u.path: u.saves for u in self.units}


# -- plan -> units ---------------------------------------------------------------------------------

def layout(graph: Graph, plan: CheckpointPlan, step: RecordedStep, exclude: Collection[str] = ()) -> CheckpointLayout:
    """Choose the checkpointed submodules and their save policies for ``plan`` (see the module doc),
    never a submodule named in ``exclude``.

    The candidates are the outermost module calls chosen for the dropped nodes; then, while it lowers
    the simulated peak of what the checkpoints will really do (:func:`realised_sequence`), a unit is
    replaced by the chosen calls nested in it, or removed. O(units * (n + edges)) per pass."""
    forward = np.flatnonzero(graph.is_forward)
    at = align(step.ops, [graph.ops[v] for v in forward])
    node_at = np.where(at >= 0, forward[np.maximum(at, 0)], -1)  # run-time op -> graph node, or -1
    runtime_of = np.full(graph.n, -1, dtype=np.int64)
    runtime_of[node_at[node_at >= 0]] = np.flatnonzero(node_at >= 0)
    for v in forward.tolist():  # a multi-output op's outputs (getitem nodes) are made by their op's run
        if runtime_of[v] < 0 and graph.ops[v] == "getitem" and len(graph.deps(v)):
            runtime_of[v] = runtime_of[graph.deps(v)[0]]
    dropped = dropped_nodes(graph, plan)
    read_by_backward = np.zeros(graph.n, dtype=bool)
    for b in np.flatnonzero(~graph.is_forward):
        read_by_backward[graph.deps(b)] = True

    # Module calls that may be units: inside the model (not the whole model), called once per step.
    calls = [(p, a, b) for p, a, b in step.calls if p and step.call_counts[p] == 1 and p not in exclude]
    chosen: dict[int, list[int]] = {}  # call index -> dropped nodes whose innermost holding call it is
    for d in np.flatnonzero(dropped).tolist():
        span = [runtime_of[d]] + [runtime_of[u] for u in graph.users(d).tolist() if graph.is_forward[u]]
        if min(span) < 0:
            continue
        holding = [i for i, (_, a, b) in enumerate(calls) if a <= min(span) and max(span) < b]
        if holding:
            chosen.setdefault(min(holding, key=lambda i: calls[i][2] - calls[i][1]), []).append(d)

    def inside(j: int, i: int) -> bool:
        return calls[i][1] <= calls[j][1] and calls[j][2] <= calls[i][2]

    def outermost(ids: list[int]) -> list[int]:
        return sorted((i for i in ids if not any(j != i and inside(i, j) and calls[j][1:] != calls[i][1:]
                                                  for j in ids)), key=lambda i: calls[i][1])

    def realise(units: list[int]) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Per unit (its graph nodes, its dropped nodes), and every dropped node realised."""
        groups = [np.array(sorted(d for j in chosen if inside(j, i) for d in chosen[j]), dtype=np.int64)
                  for i in units]
        realised = np.zeros(graph.n, dtype=bool)
        for drops in groups:
            realised[drops] = True
        realised &= ~kept_for_backward(graph, read_by_backward, realised)  # the base of a kept view stays
        out = []
        for i, drops in zip(units, groups):
            nodes = node_at[calls[i][1]:calls[i][2]]
            out.append((nodes[nodes >= 0], drops[realised[drops]]))
        return out, realised

    def peak(units: list[int]) -> int:
        parts, _ = realise(units)
        try:
            return simulate(graph, schedule_ops(graph, realised_sequence(graph, parts, read_by_backward))).peak
        except ScheduleError:  # a layout the sequence model cannot express: never prefer it
            return 2**62

    units = outermost(list(chosen))
    best = peak(units)
    improved = True
    while improved:
        improved = False
        for i in units:
            rest = [j for j in units if j != i]
            nested = outermost([j for j in chosen if j != i and inside(j, i) and calls[j][1:] != calls[i][1:]])
            for alternative in ([*rest, *nested], rest) if nested else (rest,):
                p = peak(sorted(alternative, key=lambda j: calls[j][1]))
                if p < best:
                    units, best, improved = sorted(alternative, key=lambda j: calls[j][1]), p, True
                    break
            if improved:
                break

    parts, realised = realise(units)
    saved = kept_for_backward(graph, read_by_backward, realised)
    out = []
    for i, (nodes, drops) in zip(units, parts):
        path, a, b = calls[i]
        inside = set(nodes.tolist())
        saves: dict[str, list[int]] = {}
        seen: Counter = Counter()
        for r in range(a, b):
            op = SAME_OP.get(step.ops[r], step.ops[r])
            k = seen[op]
            seen[op] += 1
            if node_at[r] >= 0 and saved[node_at[r]] and read_inside(graph, node_at[r], inside):
                saves.setdefault(op, []).append(k)
        out.append(Unit(path, saves, b - a, int(graph.mem[drops].sum()) if len(drops) else 0))
    unrealised = np.flatnonzero(dropped & ~realised)
    return CheckpointLayout(out, int(graph.mem[dropped].sum()), unrealised.tolist(), int(graph.mem[unrealised].sum()),
                            best if units else peak([]))


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
    once; before the first backward node that reads a saved or dropped node of a unit, the unit's
    recomputation: its nodes in order up to the last saved-or-dropped one, except the saved ones (SAC
    hands those back from its cache). Dropped nodes outside every unit stay saved."""
    seq = np.flatnonzero(graph.is_forward).tolist()
    realised = np.zeros(graph.n, dtype=bool)
    for _, drops in units:
        realised[drops] = True
    kept = kept_for_backward(graph, read_by_backward, realised)
    triggers = []
    for nodes, drops in units:
        saved = nodes[kept[nodes]]
        watch = set(np.concatenate([drops, saved]).tolist())
        order = sorted(set(nodes.tolist()))
        last = max((v for v in order if v in watch), default=-1)
        skip = set(saved.tolist())
        triggers.append((watch, [v for v in order if v <= last and v not in skip]))
    done = [False] * len(units)
    for b in np.flatnonzero(~graph.is_forward).tolist():
        deps = set(graph.deps(b).tolist())
        for k, (watch, rebuild) in enumerate(triggers):
            if not done[k] and deps & watch:
                done[k] = True
                seq.extend(rebuild)
        seq.append(b)
    return seq


@contextlib.contextmanager
def _on_fake_tensors(model: str) -> Any:
    """Run ``model``'s step on fake tensors as the trace does (``torch._assert`` on a tensor skipped); a
    failure there is an ExportError, not a traceback."""
    from bonsai_core.errors import BonsaiError
    from bonsai_core.trace.patches import _skip_tensor_asserts

    try:
        with _skip_tensor_asserts():
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
    calls: dict[str, list[int]] = {}
    for i, (op, _) in enumerate(forward):
        calls.setdefault(op, []).append(i)
    seen: Counter = Counter()
    last = -1
    for j, (op, shapes) in enumerate(recompute):
        k = seen[op]
        seen[op] += 1
        if k >= len(calls.get(op, ())):
            return (f"its recomputation runs {op} (its op {j + 1}) more often than its forward did "
                    f"({len(calls.get(op, ()))} time(s)): the forward changes state that the recomputation reads")
        i = calls[op][k]
        if shapes is not None and forward[i][1] is not None and shapes != forward[i][1]:
            return (f"call {k + 1} of {op} makes shapes {list(shapes)} in its recomputation, "
                    f"{list(forward[i][1])} in its forward: the forward changes state that the recomputation reads")
        if i < last:
            return (f"its recomputation runs call {k + 1} of {op} (its op {j + 1}) out of the forward's order: "
                    "it skips or adds ops, so SAC would hand it another op's tensor")
        last = i
    return None


def recomputation_mismatches(save: dict[str, dict[str, list[int]]], model: str, net: nn.Module,
                             inputs: tuple[torch.Tensor, ...], loss_fn: Any, autocast: str | None = None) -> dict[str, str]:
    """One training step of ``net`` (with ``inputs`` and ``loss_fn``, on fake tensors, under the caller's
    ``FakeTensorMode``) with the plan ``save`` applied (it stays applied), logging each checkpointed
    call's ops in its forward and in its recomputation: per submodule whose recomputation SAC would hand
    other tensors (:func:`recomputation_mismatch`), why. ``model`` names it in messages; the forward runs
    under ``autocast`` ("bf16" / "fp16") when given, as the step was traced.

    Raises ExportError when the step fails in another way (it would fail in training too)."""
    from bonsai_core.export_runtime.checkpointing import contexts

    if not save:
        return {}
    paths = {id(saves): path for path, saves in save.items()}
    runs: list[tuple[str, list[list[Any]], list[list[Any]]]] = []

    def logged_contexts(saves: dict[str, list[int]]) -> tuple[Any, Any]:
        forward, recompute = contexts(saves)
        run = (paths[id(saves)], [], [])
        runs.append(run)
        return _logged(forward, run[1]), _logged(recompute, run[2])

    error = None
    apply_saves(net, save, model, logged_contexts)
    try:
        with torch.enable_grad():
            with _autocast(autocast):
                loss = loss_fn(net(*inputs))
            loss.backward()
    except RuntimeError as e:  # SAC's "not found in storage", checkpoint's CheckpointError
        error = e
    found: dict[str, str] = {}
    for path, forward, recompute in runs:
        why = recomputation_mismatch(forward, recompute)
        if why is not None:
            found.setdefault(path, why)
    if error is not None and not found:
        raise ExportError(f"One training step of {model!r} with its checkpoints applied fails (on fake tensors, "
                          f"before training): {str(error).splitlines()[0]} Export with --backend replay.") from None
    return found


def faithful_layout(graph: Graph, plan: CheckpointPlan, step: RecordedStep,
                    mismatches: Callable[[dict[str, dict[str, list[int]]]], dict[str, str]]) -> tuple[CheckpointLayout, dict[str, str]]:
    """The :func:`layout` of ``plan`` without the submodules whose recomputation would not run what their
    forward ran (``mismatches(save)``: path -> why, :func:`recomputation_mismatches`), and those left out.
    Each pass leaves out at least one more submodule, so this ends."""
    not_checkpointed: dict[str, str] = {}
    while True:
        lay = layout(graph, plan, step, exclude=not_checkpointed)
        found = mismatches(lay.save)
        if not found:
            return lay, not_checkpointed
        not_checkpointed.update(found)


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
    if "segments" not in schedule.extra:
        raise ExportError(
            f"The checkpoint back-end applies checkpoint-region plans (methods bonsai and chen); this "
            f"{schedule.method!r} schedule is a general recompute sequence (a tensor may be recomputed several "
            "times, or freed before its last use), which torch.utils.checkpoint cannot express. Export it with "
            "--backend replay, or solve with --method bonsai or chen.")
    traced = trace_for_schedule(model, options, schedule, profile=profile, seed=seed, autocast=autocast)
    graph = traced.graph
    sim = simulate(graph, schedule)
    plan = CheckpointPlan.from_extra(schedule.extra)
    with built_for_tracing(model, seed, **options) as (net, inputs, loss_fn), _on_fake_tensors(model):
        with hidden_caches(net), _autocast(autocast):  # as the checkpointed submodules will run
            step = record_step(net, inputs, loss_fn)

    def mismatches(save: dict[str, dict[str, list[int]]]) -> dict[str, str]:
        if not save:
            return {}
        with built_for_tracing(model, seed, **options) as (net, inputs, loss_fn), _on_fake_tensors(model):
            return recomputation_mismatches(save, model, net, inputs, loss_fn, autocast)

    lay, not_checkpointed = faithful_layout(graph, plan, step, mismatches)
    info = {"graph": graph.name, "graph_hash": graph.hash, "method": schedule.method, "budget": schedule.budget,
            "predicted_peak": sim.peak, "fixed_mem": graph.fixed_mem, "recomputes": sim.recomputes,
            "overhead": sim.overhead, "model": model, "options": dict(options), "seed": seed,
            "batch": int(inputs[0].shape[0]) if inputs and inputs[0].dim() else None,
            "realised_peak": lay.realised_peak,
            "dropped_bytes": lay.dropped_bytes, "unrealised_dropped_bytes": lay.unrealised_bytes,
            "unrealised_dropped_nodes": len(lay.unrealised), "not_checkpointed": dict(not_checkpointed),
            "autocast": autocast, "attention_dropout": records_attention_dropout(graph)}
    source = generate_source(info, lay)
    if not_checkpointed and not lay.units and lay.dropped_bytes:
        path, why = next(iter(not_checkpointed.items()))
        raise ExportError(
            f"The checkpoint back-end cannot apply this plan to {model!r}: no submodule that would realise it "
            f"can be recomputed faithfully; `{path}`: {why}. torch.utils.checkpoint requires a recomputation to "
            "run the ops its forward ran: keep a submodule's forward free of state that it changes and reads back "
            "(a cache it appends to), or export with --backend replay, which runs the traced step.")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpointed.py").write_text(source)
        saved = Schedule(graph=graph.name, method=schedule.method, ops=list(schedule.ops), budget=schedule.budget,
                         graph_hash=graph.hash, stats={**schedule.stats, **sim.stats()}, extra=schedule.extra)
        (out / "schedule.json").write_text(json.dumps(saved.to_dict(), separators=(",", ":")) + "\n")
        (out / "README.md").write_text(_readme(info, lay, out.resolve()))
    except OSError as e:
        raise ExportError(f"Cannot write the export to {str(out)!r}: {e.strerror}. Choose a writable folder.") from None
    return out


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
"""

{runtime}

INFO = {info}

SAVE = {save}


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Checkpoint ``model``'s submodules as the schedule says (in place) and return ``model``."""
    return apply_saves(model, SAVE, INFO["model"])
'''


def generate_source(info: dict[str, Any], lay: CheckpointLayout) -> str:
    """The text of ``checkpointed.py``."""
    save = lay.save
    return _TEMPLATE.format(model=info["model"], method=info["method"], graph=info["graph"],
                            runtime=CHECKPOINT_RUNTIME.read_text().rstrip(),
                            info=pprint.pformat(info, sort_dicts=False, width=110),
                            save=pprint.pformat(save, sort_dicts=False, width=110))


def _readme(info: dict[str, Any], lay: CheckpointLayout, folder: Path) -> str:
    from bonsai_core.units import format_bytes

    model = info["model"]
    opts = " ".join(f"--{k} {v}" for k, v in (info.get("options") or {}).items())
    opts += f" --autocast {info['autocast']}" if info.get("autocast") else ""
    units = "\n".join(f"| `{u.path}` | {u.ops} | {sum(map(len, u.saves.values()))} | {format_bytes(u.dropped_bytes)} |"
                      for u in lay.units) or "| (none: the plan recomputes nothing) | | | |"
    unrealised = ""
    if lay.unrealised:
        unrealised = (f"\n{len(lay.unrealised)} dropped tensor(s) of the plan ({format_bytes(lay.unrealised_bytes)}) "
                      "are not held by any submodule short of the whole model together with their readers (or are "
                      "computed by the loss), so they stay saved: the real peak can exceed the prediction by up to "
                      "that much.\n")
    for path, why in (info.get("not_checkpointed") or {}).items():
        unrealised += f"\n`{path}` is not checkpointed: {why}.\n"
    return f"""# Checkpointed `{model}` ({info['method']} schedule, checkpoint back-end)

Made by `bonsai export --backend checkpoint` for graph `{info['graph']}` (hash `{info['graph_hash']}`).
Predicted peak at the traced size: **{format_bytes(info['predicted_peak'])}** ({info['predicted_peak']} bytes, of
which {format_bytes(info['fixed_mem'])} fixed); compute overhead {info['overhead']:+.2%}.

## Train with it

```python
import importlib.util
spec = importlib.util.spec_from_file_location("checkpointed", "{folder}/checkpointed.py")
checkpointed = importlib.util.module_from_spec(spec); spec.loader.exec_module(checkpointed)

checkpointed.apply(model)               # your own module, checkpointed in place
loss = loss_fn(model(*inputs))          # any batch size; torch.autocast works
loss.backward(); optimizer.step(); optimizer.zero_grad()
```

## What it checkpoints

| submodule | aten ops per forward | ops saved | dropped bytes recomputed |
| --- | --- | --- | --- |
{units}
{unrealised}
Each submodule runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)` with a selective
policy (`SAVE` in `checkpointed.py`): the tensors the schedule keeps are saved, the rest is recomputed
when the backward pass reaches the submodule.

## Check it

```
bonsai verify {model} {opts} {folder}
```
"""


# -- verification ----------------------------------------------------------------------------------

# Why the checkpoint back-end's peak is not judged under autocast.
CHECKPOINT_AUTOCAST = (
    "under autocast the checkpointed submodules run casts whose lifetimes the back-end's simulation of "
    "them does not follow (hf:llama at a small size measured +15.9% over it); the replay back-end meets "
    "its prediction under autocast")
# Why the checkpoint back-end's peak is not judged on the CPU for a step with SDPA dropout.
CPU_ATTENTION_DROPOUT = (
    "on the CPU, SDPA with dropout runs its math path, which keeps every layer's batch x heads x seq x seq "
    "attention probabilities and dropout mask for the backward pass, where the plan counts what the fused "
    "kernel of a GPU keeps (output, logsumexp, generator seed); measure the peak with --device cuda, or "
    "check the plan on the CPU with --backend replay, which runs the fused kernel's equivalent")

def load_checkpointed(out_dir: str | Path) -> ModuleType:
    """Import ``out_dir/checkpointed.py`` with the standard importlib recipe (not put in sys.modules)."""
    module = load_export(out_dir)
    path = Path(out_dir) / "checkpointed.py"
    if not hasattr(module, "apply") or not hasattr(module, "SAVE"):
        raise ExportError(f"{str(path)!r} is not a checkpoint back-end export (no apply/SAVE): verify it with "
                          "--backend replay.")
    return module


@dataclass(frozen=True)
class CheckpointVerification:
    """The original model and the checkpointed one, one step each on one device at one batch size."""

    device: str
    batch: int | None
    traced_size: bool  # the export's own options: the prediction applies
    loss_original: float
    loss_exported: float
    max_grad_diff: float
    predicted_peak: int | None  # the schedule's peak; None away from the traced size or under autocast
    realised_peak: int | None  # the simulator's peak of what the checkpoints really run (same conditions)
    measured_peak: int
    original_peak: int
    seconds_original: float
    seconds_exported: float
    predicted_overhead: float
    max_grad_scaled_diff: float = 0.0  # largest gradient difference / that tensor's largest magnitude
    autocast: str | None = None
    precision: str | None = None  # "bf16" / "fp16" when the parameters (their gradients) are in that type
    unpredicted: str | None = None  # why no peak is predicted for this run, when the traced size has one

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_exported - self.loss_original)

    @property
    def peak_error(self) -> float | None:
        """(measured - predicted) / predicted, at the traced size."""
        return None if not self.predicted_peak else self.measured_peak / self.predicted_peak - 1.0

    @property
    def judged_on_realised(self) -> bool:
        """Whether the checkpoints run another plan than the schedule (their simulated peak more than 1%
        off the schedule's, as the export's README said): the measured peak is judged against theirs.
        A boundary view's bytes apart, as in module-region plans, is not worth it."""
        return bool(self.predicted_peak and self.realised_peak
                    and abs(self.realised_peak / self.predicted_peak - 1.0) > 0.01)

    @property
    def realised_peak_error(self) -> float | None:
        """(measured - realised) / realised, at the traced size."""
        return None if not self.predicted_peak or not self.realised_peak else self.measured_peak / self.realised_peak - 1.0

    @property
    def time_overhead(self) -> float:
        """Measured wall time of the checkpointed step over the original's, minus one."""
        return self.seconds_exported / self.seconds_original - 1.0

    def problems(self, atol: float = 1e-5, peak_tolerance: float = PEAK_TOLERANCE) -> list[str]:
        """What is wrong, in words; empty when the export is verified."""
        loss = loss_problem(self.loss_original, self.loss_exported, atol, self.precision)
        out = [loss] if loss else []
        grads = gradient_problem(self.max_grad_diff, self.max_grad_scaled_diff, atol, self.autocast, self.precision)
        out += [grads] if grads else []
        if self.judged_on_realised:
            if abs(self.realised_peak_error) > peak_tolerance:
                out.append(f"the measured peak is {self.realised_peak_error:+.1%} off what the checkpoints run, "
                           f"simulated (tolerance {peak_tolerance:.0%}, above or below)")
        elif self.peak_error is not None and abs(self.peak_error) > peak_tolerance:
            out.append(f"the measured peak is {self.peak_error:+.1%} off the prediction "
                       f"(tolerance {peak_tolerance:.0%}, above or below)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "loss_diff": self.loss_diff, "peak_error": self.peak_error,
                "judged_on_realised": self.judged_on_realised, "realised_peak_error": self.realised_peak_error,
                "time_overhead": self.time_overhead}


def verify_checkpoint(model: str, options: dict[str, Any], out_dir: str | Path, *, device: str = "cpu",
                      seed: int = 0, batch: int | None = None, autocast: str | None = None,
                      repeats: int = 3) -> CheckpointVerification:
    """One training step of the original model and of the model with ``apply`` from ``out_dir``:
    loss, gradients (``.grad`` compared), peak memory (``measure.measure_step``) and wall time
    (median of ``repeats`` further steps). ``batch`` runs another batch size than the traced one
    (no predicted peak there); ``autocast`` ("bf16" / "fp16") runs both under ``torch.autocast``
    (default: the autocast the export's step was traced with). A run under autocast has no predicted
    peak (:data:`CHECKPOINT_AUTOCAST`), nor has a step with SDPA dropout on the CPU
    (:data:`CPU_ATTENTION_DROPOUT`): ``unpredicted`` says why."""
    from bonsai_core import models
    from bonsai_core.measure import measure_step

    exported = load_checkpointed(out_dir)
    dev = measuring_device(device)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if autocast is not None and autocast not in dtypes:
        raise ModelError(f"--autocast {autocast!r}: use bf16 or fp16.")
    traced_autocast = exported.INFO.get("autocast")
    autocast = traced_autocast if autocast is None else autocast
    opts = dict(options)
    traced_size = batch is None or batch == exported.INFO.get("batch")
    unpredicted = None
    if traced_size and autocast != traced_autocast:
        unpredicted = f"the schedule was traced with autocast {traced_autocast or 'off'}, this run has {autocast}"
    elif traced_size and autocast:
        unpredicted = CHECKPOINT_AUTOCAST
    elif traced_size and dev.type == "cpu" and exported.INFO.get("attention_dropout"):
        unpredicted = CPU_ATTENTION_DROPOUT
    predicted = traced_size and unpredicted is None
    if batch is not None:
        opts["batch"] = batch

    def build(checkpointed: bool) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
        net, inputs, loss_fn = models.build(model, seed=seed, **opts)
        if isinstance(loss_fn, nn.Module):
            loss_fn = loss_fn.to(dev)
        net = net.to(dev)
        if checkpointed:
            try:
                exported.apply(net)
            except ValueError as e:
                raise ModelError(f"The export in {str(out_dir)!r} does not fit {model!r}: {e}") from None
        return net, tuple(x.to(dev) for x in inputs), loss_fn

    def run(checkpointed: bool) -> tuple[Any, nn.Module, float]:
        net, inputs, loss_fn = build(checkpointed)

        def step() -> torch.Tensor:
            with torch.autocast(dev.type, dtype=dtypes[autocast]) if autocast else contextlib.nullcontext():
                loss = loss_fn(net(*inputs))
            loss.backward()
            return loss

        measured = measure_step(net, inputs, loss_fn, step=step)
        grads = {n: p.grad.detach().cpu().clone() for n, p in net.named_parameters() if p.grad is not None}
        times = []
        for _ in range(max(1, repeats)):
            _sync(dev)
            start = time.perf_counter()
            step()
            _sync(dev)
            times.append(time.perf_counter() - start)
        return measured, grads, statistics.median(times)

    original, reference, t_original = run(False)
    measured, grads, t_exported = run(True)
    diff, scaled = largest_differences({n: g for n, g in grads.items() if n in reference}, reference)
    return CheckpointVerification(
        device=measured.device, batch=opts.get("batch"), traced_size=traced_size,
        loss_original=original.loss, loss_exported=measured.loss, max_grad_diff=diff,
        predicted_peak=int(exported.INFO["predicted_peak"]) if predicted else None,
        realised_peak=int(exported.INFO["realised_peak"]) if predicted else None,
        measured_peak=measured.peak, original_peak=original.peak, seconds_original=t_original,
        seconds_exported=t_exported, predicted_overhead=float(exported.INFO["overhead"]),
        max_grad_scaled_diff=scaled, autocast=autocast, precision=precision_of(reference.values()),
        unpredicted=unpredicted)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
