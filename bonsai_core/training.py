"""The one call in a training script: plan activation checkpointing under a byte budget, and apply it.

    import bonsai_core as bonsai

    report = bonsai.checkpoint(model, (input_ids,), lambda out: out.loss, budget="20GiB")
    print(report)                      # what was checkpointed, the predicted peak and compute overhead
    for batch in loader:               # train as before
        loss = model(**batch).loss; loss.backward(); ...

Data flows as in the CLI (model -> trace -> graph -> solve -> schedule -> simulate -> apply), with the
checkpoint export back-end's rules (:mod:`bonsai_core.export.checkpoint`) applied to the user's own
module instead of written to a folder:

1. **Trace** one training step of ``model`` on fake tensors (shapes only: no device memory is used and
   the weights are not read), with ``torch.autocast`` when asked, and the optimizer's state when named.
2. **Solve** a checkpoint-region plan under the budget (methods ``bonsai`` and ``chen``); the simulator
   validates it.
3. **Lay it onto submodules**: each region the plan recomputes becomes a submodule run under
   ``torch.utils.checkpoint`` (non-reentrant) with a selective-activation-checkpointing policy, and one
   more step on fake tensors checks that every such submodule's recomputation runs what its forward ran
   (one that does not is left out, and the layout chosen again).
4. **Apply** it in place (``checkpoint``), or return it (``plan``; ``Plan.apply`` later).

Apply it before ``torch.compile``, ``DistributedDataParallel`` or ``fully_shard`` (FSDP2) wrap the model,
as torchtitan applies activation checkpointing before sharding. The budget bounds one device's live
bytes in the traced step: parameters, gradients, buffers, the batch, the optimizer's state when
``optimizer`` is named, and the activations; with ``fsdp=N``, one rank's (its shards, and the blocks
``fully_shard`` gathers over the step).

Plans are cached on disk (``$BONSAI_CACHE_DIR``, else ``$XDG_CACHE_HOME/bonsai``, else
``~/.cache/bonsai``), keyed by what the plan depends on: the model's module classes and their source
files, parameter and buffer names, shapes and dtypes, training flags, the example inputs' shapes and
dtypes, each module's plain settings (a dropout's ``p``, a ``transformers`` config), the loss function's
code, the budget, method and options, and the torch, transformers and
bonsai versions. The second run of a script applies its plan without tracing.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from bonsai_core.budget import Budget, parse_budget
from bonsai_core.errors import BonsaiError, BudgetError, ModelError, ScheduleError, SolverError
from bonsai_core.export_runtime.checkpointing import (apply_offloads, apply_saves, is_checkpointed, is_offloading,
                                                      remove_checkpoints)
from bonsai_core.fsdp import Sharding
from bonsai_core.graph import Graph
from bonsai_core.packed import batch_sizes_left_alone, with_batch_sizes_on_demand
from bonsai_core.schedule import Schedule, no_remat_peak, simulate
from bonsai_core.tensors import fake_copy, fake_of
from bonsai_core.units import format_bytes

REGION_METHODS = ("bonsai", "chen")  # the methods whose plans are checkpoint regions
AUTO_MARGIN = 0.10  # share of a device's memory "auto" leaves to the caching allocator's rounding and waste
# bumped whenever what a cached plan means changes (its key does not hash the library's code)
CACHE_VERSION = 6
FIT_TRIES = 5  # solves to bring what the checkpoints run within the budget
COMPILED_TRIES = 7  # plans traced compiled in the search for the plan budget that fits under compile
# what to do when a checkpointed step cannot run, in the library's own terms (the CLI names its flags)
LIBRARY_ADVICE = ("Plan it with another budget= or method='chen', or train it with the replay back-end "
                  "(bonsai.plan's schedule, exported by bonsai_core.export).")

# how the run compiles the model, as the report says it (bonsai_core/trace/compiled.py)
COMPILED = {"model": "torch.compile(model)", "blocks": "each block compiled, fullgraph=True"}
# what each device's kernels keep, as the report says it (bonsai_core/trace/patches.py)
DEVICE_KERNELS = {"cpu": "dropout's float noise, SDPA with dropout on its math path",
                  "cuda": "dropout's bool mask, fused attention"}

Save = dict[str, dict[str, list[int]]]  # submodule path -> {aten op: calls that save their output}


@dataclass
class Report:
    """What a plan does to one training step (bytes include parameters, gradients and the batch)."""

    method: str
    budget: int  # bytes the plan was asked to fit
    budget_source: str  # how the budget was given ("20GiB", "60% of the no-remat peak", "auto: ...")
    regions: list[str]  # the checkpointed submodules, by path in model.named_modules()
    predicted_peak: int  # the simulator's peak of what the checkpoints run
    plan_peak: int  # the plan's own simulated peak (the checkpoints may run it less tightly)
    no_remat_peak: int
    fixed_memory: int  # parameters, gradients, buffers, batch and optimizer state
    overhead: float  # the plan's recomputed compute over one step's, predicted by the cost model (under compile: the
    # compiled step's with the checkpoints over the compiled step's without)
    not_checkpointed: dict[str, str] = field(default_factory=dict)  # submodule -> why it was left out
    unrealised_bytes: int = 0  # bytes the plan frees that no submodule can free with torch.utils.checkpoint
    graph_hash: str = ""
    seconds: dict[str, float] = field(default_factory=dict)  # trace, solve, layout
    cached: bool = False  # loaded from the plan cache (nothing traced)
    device: str = "cuda"  # the device whose kernels the step was traced with (dropout, attention): "cpu" or "cuda"
    offloaded: int = 0  # saved tensors copied to host memory in each step (offload=True)
    offloaded_bytes: int = 0  # their bytes
    host_peak: int = 0  # the most host bytes their copies hold at once (predicted)
    not_offloaded: int = 0  # tensors the plan offloads that the run cannot (kept on the device, and predicted so)
    compiled: str | None = None  # the torch.compile mode the peaks are of ("model", "blocks"); None: eager
    pipeline_stages: list[int] = field(default_factory=list)  # a pipeline rank's stages (Plan.apply: each part's paths)

    @property
    def status(self) -> str:
        """One line: what was done."""
        if not self.regions:
            return "fits without recomputation: nothing checkpointed"
        return f"checkpointed {len(self.regions)} submodule(s)"

    def __str__(self) -> str:
        saved = 1 - self.predicted_peak / self.no_remat_peak if self.no_remat_peak else 0.0
        lines = [
            f"{self.method} plan within {format_bytes(self.budget)} ({self.budget_source}): {self.status}"
            + (" [from the plan cache]" if self.cached else ""),
            f"  predicted peak {format_bytes(self.predicted_peak)} (no recomputation: {format_bytes(self.no_remat_peak)}, "
            f"{saved:.1%} less); fixed memory {format_bytes(self.fixed_memory)}; "
            f"recompute overhead {self.overhead:+.1%}; planned with {self.device.upper()} kernels "
            f"({DEVICE_KERNELS[self.device]})",
        ]
        if self.compiled:
            lines.append(f"  peaks of the step under torch.compile ({COMPILED[self.compiled]}), traced through inductor")
        if self.regions:
            shown = ", ".join(self.regions[:8]) + (f", ... ({len(self.regions)} in all)" if len(self.regions) > 8 else "")
            lines.append(f"  checkpointed: {shown}")
        for path, why in self.not_checkpointed.items():
            lines.append(f"  left out {path}: {why}")
        if self.predicted_peak > self.budget:
            lines.append(f"  over the budget by {format_bytes(self.predicted_peak - self.budget)}: the checkpoints cannot "
                         "free all the plan frees (below); lower the budget or use a finer method")
        if self.unrealised_bytes:
            lines.append(f"  {format_bytes(self.unrealised_bytes)} the plan frees stay saved: no submodule holds "
                         "them with their readers")
        if self.offloaded or self.not_offloaded:
            lines.append(f"  offloaded to host memory: {self.offloaded} saved tensor(s), "
                         f"{format_bytes(self.offloaded_bytes)} (host peak {format_bytes(self.host_peak)})"
                         + (f"; {self.not_offloaded} more the plan offloads stay on the device (held by a checkpointed "
                            "submodule, or not found at run time)"
                            if self.not_offloaded else ""))
        if self.seconds:
            lines.append("  " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        return "\n".join(lines)


@dataclass
class Plan:
    """A checkpoint-region plan for one model: what to apply, and what it does."""

    save: Save  # submodule path -> its save policy (bonsai_core/export_runtime/checkpointing.py)
    report: Report
    schedule: Schedule
    graph: Graph | None = None  # None when loaded from the plan cache
    offload: Save = field(default_factory=dict)  # submodule path -> {aten op: calls whose output goes to host}

    def apply(self, model: nn.Module) -> nn.Module:
        """Checkpoint ``model``'s submodules as planned and install the offloads' saved-tensor hooks (in
        place); return ``model``. ``bonsai.remove_checkpoints(model)`` undoes both."""
        made_for = f"a model traced as graph {self.report.graph_hash}"
        save, offload = self.save, self.offload
        if self.report.pipeline_stages:  # a pipeline rank's plan: each of its model parts takes its own paths
            names = dict(model.named_modules())
            save = {p: ops for p, ops in save.items() if p in names}
            offload = {p: ops for p, ops in offload.items() if p in names}
        try:
            apply_saves(model, save, made_for)
        except ValueError as e:
            raise ModelError(str(e)) from None
        try:
            if offload:
                apply_offloads(model, offload, made_for)
        except ValueError as e:
            remove_checkpoints(model)
            raise ModelError(str(e)) from None
        return model


def checkpoint(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor],
               budget: str | int = "auto", method: str = "bonsai", **kwargs: Any) -> Report:
    """Plan activation checkpointing for ``model`` within ``budget`` and apply it in place: the one call
    in a training script. Takes :func:`plan`'s arguments and returns its :class:`Report`.

    A model checkpointed by an earlier call gets the new plan instead (the old one is removed first).
    Raises :class:`~bonsai_core.errors.BudgetError` when no plan fits (naming the smallest budget the
    method meets) and :class:`~bonsai_core.errors.ModelError` when the model cannot be traced."""
    remove_checkpoints(model)
    made = plan(model, example_inputs, loss_fn, budget, method, **kwargs)
    made.apply(model)
    return made.report


def plan(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor], budget: str | int = "auto",
         method: str = "bonsai", *, autocast: str | None = None, optimizer: str = "none", grads: str = "zeroed", fsdp: int = 1,
         reshard_after_forward: bool | str = True, mixed_precision: str | None = None, tp: int = 1, cp: int = 1,
         pp: int = 1, dp_replicate: int = 1, pp_schedule: str = "1f1b", microbatches: int | None = None, rank: int = 0,
         async_tp: bool = False, cache: bool = True, cache_dir: str | os.PathLike | None = None, best_effort: bool = False,
         device: str | torch.device | None = None, compile: bool | str = False, **options: Any) -> Plan:
    """A checkpoint-region plan for one training step of ``model`` within ``budget``; nothing applied.

    Args:
        model: the module to train, on any device, in the mode it trains in (``model.train()``).
        example_inputs: one batch as the model takes it: a tensor, a tuple of positional tensors, or a
            dict of keyword tensors (``model(**batch)``), at the size training uses.
        loss_fn: the model's output -> a scalar loss (``lambda out: out.loss``,
            ``lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())``).
        budget: bytes (``20 * 2**30``), a size (``"20GiB"``, ``"800MB"``), a share of the step's peak
            without recomputation (``"60%"``), or ``"auto"``: the CUDA device's free memory plus what
            this process reserves there, less :data:`AUTO_MARGIN` for the allocator.
        method: ``"bonsai"`` (the segment ILP, default) or ``"chen"`` (sqrt(n) checkpoints).
        autocast: ``"bf16"`` / ``"fp16"`` when training runs under ``torch.autocast``; by default the
            autocast state of the call's own context.
        optimizer: ``"sgd"``, ``"adam"``, ``"adamw"`` to count the optimizer's state and step in the budget.
        grads: how the training loop leaves the gradients between steps: ``"zeroed"`` (``zero_grad(
            set_to_none=False)``: allocated through the step) or ``"none"`` (``optimizer.zero_grad()``'s
            default: each step makes them in its backward pass; an FSDP rank's sharded ones too).
        fsdp: the number of ranks when ``fully_shard`` (FSDP2) will shard each block of the model and the
            model itself (after this call): the budget is then one rank's, with its share of parameters,
            gradients and optimizer state and the unsharded blocks over the step (:mod:`bonsai_core.fsdp`);
            ``reshard_after_forward`` as given to ``fully_shard`` (or ``"all-but-last"`` / ``"torchtitan"``, how
            torchtitan applies it: :func:`bonsai_core.fsdp.fsdp_units`);
            ``mixed_precision="bf16"``: ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32))`` on an fp32 model.
        tp, cp, pp, dp_replicate, pp_schedule, microbatches, rank, async_tp: the rest of the layout, as torchtitan's
            ``ParallelDims`` takes it (``fsdp`` its ``dp_shard``): the plan is one rank's (:mod:`bonsai_core.parallel`,
            :mod:`bonsai_core.pipeline`); apply it before the model is parallelized.
        cache: read and write the plan cache (see the module doc); ``cache_dir`` overrides its folder.
        best_effort: when no layout of checkpointed submodules realises a plan within the budget, return
            the one with the smallest predicted peak (over the budget; the report says by how much)
            instead of raising BudgetError.
        device: ``"cpu"`` or ``"cuda"``: the device whose kernels the plan is made for (the CPU keeps a
            float dropout noise and runs SDPA with dropout on its math path, keeping the attention
            probabilities; CUDA keeps a bool mask and runs fused attention). By default the device of the
            model's parameters (a model on ``meta`` is planned for CUDA); the report says which.
        compile: ``True`` (or ``"model"``) when the script runs ``torch.compile(model)`` after this call,
            ``"blocks"`` when it compiles each block of the block stack (torchtitan's way): the peaks, the
            budget's share and the plan's check are then of the compiled step, traced through inductor's
            own programs (:mod:`bonsai_core.trace.compiled`): the partitioner's saved tensors and inductor's
            buffers under the plan's checkpoints. The plan is still applied before compiling.
        options: the method's options (as ``bonsai solve --option``), e.g. ``time_limit=30``.

    Long: the one call's steps in order (check, cache, trace, solve and lay out, report), each a call.
    """
    from bonsai_core.parallel import in_this_run, layout_of

    _check_arguments(method, options)
    parallel = in_this_run(layout_of(fsdp, tp, cp, pp, dp_replicate, pp_schedule, microbatches, rank, async_tp))
    sharding = Sharding.of(parallel.shard_world, reshard_after_forward, mixed_precision)
    compiled = _compile_mode(compile, sharding.world, parallel)
    if compiled and options.get("offload"):
        raise BonsaiError("offload=True with compile: saved-tensor hooks that copy to host memory are not traced through "
                          "torch.compile here, so such a plan's compiled peak is unknown; plan it without offload.")
    root, inputs, prefix = _step_inputs(model, example_inputs, loss_fn)
    if any(is_checkpointed(m) or is_offloading(m) for m in model.modules()):
        raise ModelError("The model is already checkpointed by bonsai: plan it as it is without checkpoints "
                         "(bonsai.remove_checkpoints(model) first), or call bonsai.checkpoint, which replaces the plan.")
    on = _device(model, inputs)
    kernels = _kernels(device, on)
    autocast = autocast if autocast is not None else _ambient_autocast(on)
    wanted, budget_source = _budget(budget, on)
    settings = {"method": method, "budget": str(budget), "budget_bytes": wanted.bytes, "autocast": autocast,
                "optimizer": optimizer, "grads": grads, "fsdp": [fsdp, reshard_after_forward, mixed_precision], "options": {k: repr(v) for k, v in sorted(options.items())}, "best_effort": best_effort,
                "device": on.type, "kernels": kernels, "keywords": list(example_inputs) if isinstance(example_inputs, dict) else None,
                "compile": compiled, "layout": parallel.to_dict()}
    folder = _cache_folder(cache_dir) if cache else None
    key = _fingerprint(model, inputs, loss_fn, settings)
    hit = _read_cached(folder, key) if folder else None
    if hit is not None:
        return hit

    with _world(parallel) as parallel:  # a parallel rank's meshes, for its trace and the layout's runs of its step
        # a model that packs sequences is planned for the batch sizes of example_inputs' lengths
        made = with_batch_sizes_on_demand(
            lambda: _made(_FakeStep.of(root, inputs, loss_fn, type(model).__name__, parallel, sharding.mixed_precision,
                                       compiled),
                          (autocast, optimizer, sharding, kernels, grads),
                          wanted, budget_source, method, options, best_effort, prefix),
            lambda: batch_sizes_left_alone(root, inputs, loss_fn))
    if folder:
        _write_cached(folder, key, made)
    return made


def _compile_mode(compile: bool | str, fsdp: int, parallel: Any) -> str | None:
    """``plan``'s ``compile`` as a compile mode of the trace, or None (eager); refused for a tensor, context
    or pipeline parallel rank (``parallel``), whose compiled step is not traced."""
    from bonsai_core.arguments import COMPILE_MODES
    from bonsai_core.trace.compiled import check_compile

    if compile is False or compile is None:
        return None
    mode = "model" if compile is True else compile
    if mode not in COMPILE_MODES:
        raise BonsaiError(f"compile={compile!r}: give True (torch.compile(model) after this call) or one of "
                          f"{', '.join(map(repr, COMPILE_MODES))}.")
    if parallel.is_parallel:
        raise BonsaiError(f"compile={compile!r} with {parallel.describe()}: a compiled tensor, context or pipeline "
                          "parallel rank is not traced by the one call (only an FSDP one is; `bonsai trace --tp N --compile "
                          "blocks` traces a torchtitan: model's tensor parallel rank compiled); plan that rank eager "
                          "(compile=False), or the compiled step with fsdp=N alone.")
    try:
        check_compile(mode, fsdp)
    except ModelError as e:
        raise BonsaiError(str(e).replace("--compile ", "compile=").replace("--fsdp ", "fsdp=")) from None
    return mode


def _made(step: "_FakeStep", traced: tuple[str | None, str, Sharding, str, str], wanted: Budget, budget_source: str,
          method: str, options: dict[str, Any], best_effort: bool, prefix: str) -> Plan:
    """:func:`plan`'s plan for ``step``: traced (``traced``: autocast, optimizer, sharding, kernels, grads), solved
    within ``wanted`` and laid out (:func:`_fitted`); the paths named as in the user's model (``prefix``)."""
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    graph = step.graph(*traced)
    reference = no_remat_peak(graph)
    if step.compiled:  # the budget's reference is the compiled step without a plan
        uncompiled_plan = step.compiled_graph({})
        reference = no_remat_peak(uncompiled_plan)
    seconds["trace"] = time.perf_counter() - start
    limit = wanted.resolve(reference)
    source = f"{wanted} of the no-remat peak {format_bytes(reference)}" if wanted.fraction is not None else budget_source
    schedule, save, layout = _fitted(step, graph, limit, method, options, seconds, best_effort)
    sim = simulate(graph, schedule)
    overhead = layout.compiled_cost / uncompiled_plan.total_cost - 1 if step.compiled else sim.overhead
    report = Report(method=method, budget=limit, budget_source=source,
                    regions=[_relative(p, prefix) for p in save], predicted_peak=layout.realised_peak,
                    plan_peak=sim.peak, no_remat_peak=reference, fixed_memory=graph.fixed_mem,
                    overhead=overhead, not_checkpointed={_relative(p, prefix): w for p, w in layout.not_checkpointed.items()},
                    unrealised_bytes=layout.unrealised_bytes, graph_hash=graph.hash, seconds=seconds, device=traced[3],
                    offloaded=layout.offloaded, offloaded_bytes=layout.offloaded_bytes, host_peak=layout.host_peak,
                    not_offloaded=len(schedule.extra.get("offloaded", ())) - layout.offloaded, compiled=step.compiled,
                    pipeline_stages=[s for s, _, _ in graph.parallel["pipeline"]["stages"]] if step.rank is not None else [])
    return Plan({_relative(p, prefix): s for p, s in save.items()}, report, schedule, graph,
                {_root_relative(p, prefix): ops for p, ops in layout.offload.items()})


def _world(layout: Any) -> contextlib.AbstractContextManager:
    """The process group a parallel rank is traced in (:func:`bonsai_core.parallel.world`); none for FSDP alone."""
    from bonsai_core.parallel import world

    return world(layout) if layout.is_parallel else contextlib.nullcontext(layout)


def _check_arguments(method: str, options: dict[str, Any]) -> None:
    """Refuse what :func:`plan` cannot do, naming its own arguments (not the CLI's flags)."""
    from bonsai_core.solvers import check_options, method_options

    if method not in REGION_METHODS:
        raise BonsaiError(f"method={method!r}: bonsai.plan applies checkpoint-region plans, made by method="
                          f"{' or '.join(map(repr, REGION_METHODS))}; {method!r} makes a general recompute sequence, "
                          "which torch.utils.checkpoint cannot run. Give method='bonsai' or method='chen'.")
    try:
        check_options(method, options)
    except SolverError:  # its message ends with the CLI's `bonsai methods`
        unknown = sorted(set(options) - {o.name for o in method_options(method) or ()})
        raise SolverError(f"{', '.join(f'{k}=' for k in unknown)}: not an argument of bonsai.plan nor an option of "
                          f"method={method!r}; its options are {', '.join(o.name for o in method_options(method) or ())}.") from None


def _fitted(step: "_FakeStep", graph: Graph, limit: int, method: str, options: dict[str, Any],
            seconds: dict[str, float], best_effort: bool = False) -> tuple[Schedule, Save, "_Layout"]:
    """Solve within ``limit`` and lay the plan onto submodules (finer submodules where they free more,
    :func:`bonsai_core.export.checkpoint.layout`); while what the checkpoints run peaks over ``limit``
    (a freed tensor no submodule can free with its readers), solve again with the plan's budget lowered
    by the excess, doubled at each try (at most :data:`FIT_TRIES` solves, never below what any step
    needs), and last lay out the plan at the smallest budget the method meets (:func:`_fitted_with`);
    then, for ``bonsai`` without a ``regions`` option on a graph that records module calls, the same with
    ``regions="modules"`` (only module calls recomputed: what the checkpoints can realise). The first
    layout within ``limit`` is returned; when none is, BudgetError names the smallest budget this search
    meets (:func:`_smallest_met`), unless ``best_effort`` (then the layout with the smallest realised
    peak is returned, over the budget). With ``offload``, the same without it last, and of the layouts
    within ``limit`` the one of least compute (:func:`_least_compute`): a plan whose offloads the
    checkpoints cannot make may be beaten by one that recomputes instead."""
    if method == "bonsai" and "space" not in options:  # the checkpoints apply checkpoint regions only
        options = {**options, "space": "regions"}
    if method == "bonsai" and step.compiled and "save_ops" not in options:
        return _fitted_both(step, graph, limit, method, options, seconds, best_effort)
    variants = [options]
    if method == "bonsai" and "regions" not in options and graph.modules:  # module regions need recorded module calls
        variants.append({**options, "regions": "modules"})
    if options.get("offload"):  # offloads the checkpoints hold on the device: the plan without them may fit
        variants += [{k: v for k, v in variant.items() if k != "offload"} for variant in list(variants)]
    best, refused, tried, fitting = None, None, [], []
    for variant in variants:
        try:
            fit = _fitted_compiled if step.compiled else _fitted_with
            found, guaranteed = fit(step, graph, limit, method, variant, seconds)
        except BudgetError as e:
            refused = refused or e  # the options the caller gave say it best
            if variant is variants[-1] and best is None:
                raise refused from None
            continue
        tried.append((variant, found[2].realised_peak, guaranteed))
        if best is None or found[2].realised_peak < best[2].realised_peak:
            best = found
        if found[2].realised_peak <= limit:
            if not options.get("offload"):
                return found
            fitting.append(found)
    if fitting:
        return _least_compute(graph, fitting)
    if best_effort:
        return best
    smallest = _smallest_met(step, graph, method, tried, seconds)
    if smallest is None and step.compiled and best[2].realised_peak < 2**62:
        raise BudgetError(
            f"budget={format_bytes(limit)} ({limit} bytes) cannot be met by checkpointing {step.name}'s submodules "
            f"under torch.compile: the smallest compiled peak its plans realise is {format_bytes(best[2].realised_peak)} "
            f"({best[2].realised_peak} bytes). Give a larger budget, or pass best_effort=True to take that plan over "
            "the budget.")
    if smallest is None:  # the layout's sequence model could not express any choice of submodules
        raise BudgetError(f"budget={format_bytes(limit)} ({limit} bytes): no layout of {step.name}'s submodules "
                          "under torch.utils.checkpoint can be predicted for this plan; give a larger budget.")
    raise BudgetError(
        f"budget={format_bytes(limit)} ({limit} bytes) cannot be met by checkpointing {step.name}'s submodules"
        f"{_largest_operator(graph, limit)}: "
        f"the smallest budget it can guarantee is {format_bytes(smallest)} ({smallest} bytes). Give budget="
        f"{smallest} or more, or pass best_effort=True to take the plan of the smallest peak over the budget.",
        smallest=smallest)


def _fitted_both(step: "_FakeStep", graph: Graph, limit: int, method: str, options: dict[str, Any],
                 seconds: dict[str, float], best_effort: bool) -> tuple[Schedule, Save, "_Layout"]:
    """:func:`_fitted` under compile with ``save_ops`` and without, the fitting layout of least compiled
    compute kept (else the one of the smaller compiled peak). A compiled block recomputes the pointwise ops
    between its saved matmul outputs inside fused kernels, nearly free, which only plans saving ops inside a
    segment exploit (torch's knapsack's plan is one); whole segments still win on some budgets."""
    found, refused = [], None
    for save_ops in (True, False):
        try:
            found.append(_fitted(step, graph, limit, method, {**options, "save_ops": save_ops}, seconds, best_effort))
        except BudgetError as e:
            refused = refused or e
    if not found:
        raise refused
    within = [f for f in found if f[2].realised_peak <= limit]
    if within:
        return min(within, key=lambda f: (f[2].compiled_cost, f[2].realised_peak))
    return min(found, key=lambda f: f[2].realised_peak)


def _least_compute(graph: Graph, layouts: list[tuple[Schedule, Save, "_Layout"]]) -> tuple[Schedule, Save, "_Layout"]:
    """Of laid-out plans, the one whose schedule computes least on ``graph`` (the overhead the report
    states; offload plans are eager, so no compiled cost), the smaller realised peak among equals, and
    the earlier one among equal both."""
    return min(layouts, key=lambda f: (simulate(graph, f[0]).compute_cost, f[2].realised_peak))


def _largest_operator(graph: Graph, limit: int) -> str:
    """Why no step fits in ``limit`` where it is below the largest single operator with its inputs and the
    fixed memory (a fused kernel no checkpoint splits); else nothing."""
    if limit >= graph.peak_lower_bound:
        return ""
    return (f" (the largest single operator needs {format_bytes(graph.peak_lower_bound)}, {graph.peak_lower_bound} "
            "bytes, with its inputs and the fixed memory)")


def _smallest_met(step: "_FakeStep", graph: Graph, method: str, tried: list[tuple[dict[str, Any], int, int | None]],
                  seconds: dict[str, float]) -> int | None:
    """The smallest budget :func:`_fitted` meets, of the searches ``tried`` (options, the smallest realised
    peak found, the realised peak of the plan at the method's smallest budget): that smallest peak where a
    search within it meets it (a layout found while lowering need not be found again from there), else
    the smallest plan's, which every search ends with (None: nothing the layout can express)."""
    variant, found, _ = min(tried, key=lambda t: t[1])
    if found >= 2**62:
        return None
    if step.compiled:  # its search bisects from the budget asked: no plan budget is sure to be found again
        return None
    again, _ = _fitted_with(step, graph, found, method, variant, seconds)
    if again[2].realised_peak <= found:
        return found
    return min((g for _, _, g in tried if g is not None and g < 2**62), default=None)


def _fitted_with(step: "_FakeStep", graph: Graph, limit: int, method: str, options: dict[str, Any],
                 seconds: dict[str, float]) -> tuple[tuple[Schedule, Save, "_Layout"], int | None]:
    """The lowering loop of :func:`_fitted` for one set of options, and last, where nothing is within
    ``limit``, the plan at the method's smallest budget (``BudgetError.smallest``): (the first layout within
    ``limit``, else the one with the smallest realised peak; that last plan's realised peak, or None where
    it was not needed or not found). Solving is deterministic, so a search within that peak meets it.
    BudgetError when the method finds no plan at all."""
    from bonsai_core.solvers import solve

    def laid_out(budget: int) -> tuple[Schedule, Save, _Layout]:
        start = time.perf_counter()
        try:
            schedule = solve(graph, budget, method, **options)
        finally:
            seconds["solve"] = seconds.get("solve", 0.0) + time.perf_counter() - start
        start = time.perf_counter()
        save, layout = step.layout(graph, schedule)
        seconds["layout"] = seconds.get("layout", 0.0) + time.perf_counter() - start
        return schedule, save, layout

    floor = max(graph.peak_lower_bound, graph.optimizer_peak, graph.fixed_mem)
    plan_budget, best, refused = limit, None, None
    for attempt in range(FIT_TRIES):
        try:
            found = laid_out(plan_budget)
        except BudgetError as e:
            refused = e
            break
        if best is None or found[2].realised_peak < best[2].realised_peak:
            best = found
        if found[2].realised_peak <= limit or plan_budget <= floor:
            break
        # an ILP within its gap may not move for less than the excess
        plan_budget = max(floor, plan_budget - (found[2].realised_peak - limit) * 2**attempt)
    if best is not None and best[2].realised_peak <= limit:
        return best, None
    # a refusal below what any step needs (the largest operator) names no budget: the method's smallest then
    smallest = refused.smallest if refused is not None and refused.smallest is not None \
        else _method_smallest(graph, method, options, floor)
    try:
        last = laid_out(smallest) if smallest is not None else None
    except BudgetError:
        last = None
    if last is not None and (best is None or last[2].realised_peak < best[2].realised_peak):
        best = last
    if best is None:
        raise refused if refused is not None else BudgetError(f"{method} found no plan of {step.name}.")
    return best, None if last is None else last[2].realised_peak


def _method_smallest(graph: Graph, method: str, options: dict[str, Any], floor: int) -> int | None:
    """The smallest budget ``method`` meets (``BudgetError.smallest`` of a solve at ``floor``), or None."""
    from bonsai_core.solvers import solve

    try:
        solve(graph, floor, method, **options)
    except BudgetError as e:
        return e.smallest
    return floor


def _fitted_compiled(step: "_FakeStep", graph: Graph, limit: int, method: str, options: dict[str, Any],
                     seconds: dict[str, float]) -> tuple[tuple[Schedule, Save, "_Layout"], None]:
    """:func:`_fitted_with` for a compiled step. The plan is solved on the eager graph, and compiling moves
    its peak either way (the partitioner saves other tensors, inductor fuses some away), so the plan budget
    whose compiled peak comes closest under ``limit`` is searched (:func:`_next_plan_budget`: the compiled
    peak grows with the plan budget, about one for one) between what any step needs and the eager step's
    no-remat peak, in at most :data:`COMPILED_TRIES` compiled traces. The fitting layout with the least
    compiled compute is returned, else the one with the smallest compiled peak (and None: no plan budget is
    sure to be met, as :func:`_fitted_with` gives). BudgetError when no solve finds a plan."""
    from bonsai_core.solvers import solve

    low, high = max(graph.peak_lower_bound, graph.optimizer_peak, graph.fixed_mem), no_remat_peak(graph)
    plan_budget = min(max(limit, low), high)
    close = max(1, limit // 1000)  # a compiled peak this close under the limit ends the search
    found: list[tuple[Schedule, Save, _Layout]] = []
    tried: list[tuple[int, int]] = []  # (plan budget, compiled peak)
    for _ in range(COMPILED_TRIES):
        start = time.perf_counter()
        try:
            schedule = solve(graph, plan_budget, method, **options)
        except BudgetError:
            schedule = None
        finally:
            seconds["solve"] = seconds.get("solve", 0.0) + time.perf_counter() - start
        if schedule is None:
            low = plan_budget  # no plan this low: only higher budgets are left
        else:
            start = time.perf_counter()
            save, layout = step.layout(graph, schedule)
            seconds["layout"] = seconds.get("layout", 0.0) + time.perf_counter() - start
            found.append((schedule, save, layout))
            tried.append((plan_budget, layout.realised_peak))
            if layout.realised_peak <= limit:
                low = plan_budget
                if limit - layout.realised_peak <= close:
                    break
            else:
                high = plan_budget
        if high - low <= close:
            break
        plan_budget = _next_plan_budget(tried, limit, low, high)
    if not found:
        raise BudgetError(f"budget={format_bytes(limit)} ({limit} bytes): {method} finds no plan for {step.name} within "
                          f"any budget down to {format_bytes(low)}; give a larger budget.")
    fitting = [f for f in found if f[2].realised_peak <= limit]
    if fitting:
        return min(fitting, key=lambda f: (f[2].compiled_cost, f[2].realised_peak)), None
    return min(found, key=lambda f: f[2].realised_peak), None


def _next_plan_budget(tried: list[tuple[int, int]], limit: int, low: int, high: int) -> int:
    """The next plan budget to try in the open bracket (``low``, ``high``) for a compiled peak at ``limit``,
    from the (plan budget, compiled peak) pairs ``tried``: the secant through the closest fitting and the
    closest exceeding pair, kept an eighth of the bracket away from its ends so that a side that stalls
    still shrinks it; with pairs on one side only, the closest one shifted by its distance from ``limit``
    (compiling moves a plan's peak by about what it moves the step's); with none, the bisection."""
    under = [t for t in tried if t[1] <= limit and low <= t[0] <= high]
    over = [t for t in tried if t[1] > limit and low <= t[0] <= high]
    if under and over:
        (b0, p0), (b1, p1) = max(under, key=lambda t: t[1]), min(over, key=lambda t: t[1])
        guess = b0 + (b1 - b0) * (limit - p0) / (p1 - p0) if p1 != p0 else (b0 + b1) / 2
    elif under or over:
        budget, peak = min(under or over, key=lambda t: abs(t[1] - limit))
        guess = budget + (limit - peak)
    else:
        guess = (low + high) / 2
    margin = (high - low) / 8 if under and over else 1
    return int(min(max(guess, low + margin), high - margin))


# -- the step: inputs, device, autocast, budget --------------------------------------------------

class _KeywordCall(nn.Module):
    """``model(**dict(zip(names, inputs)))``: a model called with keyword tensors, traced positionally."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, inputs)))


def _step_inputs(model: Any, example_inputs: Any, loss_fn: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...], str]:
    """The module to trace, its positional inputs, and the path prefix its submodules get there."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"bonsai.checkpoint takes a torch.nn.Module, not {type(model).__name__}.")
    if not callable(loss_fn):
        raise ModelError("loss_fn must be a function of the model's output returning a scalar loss, "
                         "e.g. lambda out: out.loss.")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, dict):
        bad = [k for k, v in example_inputs.items() if not isinstance(v, torch.Tensor)]
        if bad or not example_inputs:
            raise ModelError(f"example_inputs: every value of the batch dict must be a tensor ({bad[0]!r} is not)."
                             if bad else "example_inputs is an empty dict: pass one batch as the model takes it.")
        return _KeywordCall(model, list(example_inputs)), tuple(example_inputs.values()), "model."
    if isinstance(example_inputs, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in example_inputs):
        return model, tuple(example_inputs), ""
    raise ModelError("example_inputs must be one batch as the model takes it: a tensor, a tuple of tensors "
                     f"(model(*inputs)) or a dict of tensors (model(**batch)); got {type(example_inputs).__name__}.")


def _relative(path: str, prefix: str) -> str:
    return path[len(prefix):] if prefix and path.startswith(prefix) else path


def _root_relative(path: str, prefix: str) -> str:
    """``path`` in the user's model (``_relative``; the model itself, ``prefix`` without its dot, is "")."""
    return "" if prefix and path == prefix[:-1] else _relative(path, prefix)


def _device(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.device:
    for t in (*model.parameters(), *inputs):
        return t.device
    return torch.device("cpu")


def _kernels(device: str | torch.device | None, on: torch.device) -> str:
    """``"cpu"`` or ``"cuda"``: the device whose kernels to plan with, as given (``device=``), else that of
    the model (``on``): the CPU's for a CPU model, a GPU's otherwise (a model on ``meta`` is not yet
    materialised; it is planned for the GPU it will train on)."""
    if device is None:
        return "cpu" if on.type == "cpu" else "cuda"
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind not in DEVICE_KERNELS:
        raise BonsaiError(f"device={device!r}: give the device whose kernels to plan with, 'cpu' or 'cuda' "
                          "(or leave it out: the device of the model's parameters).")
    if kind == "cpu" and on.type not in ("cpu", "meta"):  # ATen picks dropout's kernel by the tensors' device
        raise BonsaiError(f"device='cpu': the model is on {on}, where the step cannot be traced with the CPU's "
                          "kernels; plan a CPU copy of the model, or leave device out.")
    return kind


def _ambient_autocast(device: torch.device) -> str | None:
    """``"bf16"`` / ``"fp16"`` when this call runs inside ``torch.autocast`` for ``device``, else None."""
    if device.type == "meta" or not torch.is_autocast_enabled(device.type):  # meta: a model not yet materialised
        return None
    dtype = torch.get_autocast_dtype(device.type)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)


def _budget(budget: str | int, device: torch.device) -> tuple[Budget, str]:
    """The budget and, in words, where it came from."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise BudgetError(f"budget={budget!r}: give bytes (an int), a size ('20GiB'), a share ('60%') or 'auto'.")
    if budget != "auto":
        return parse_budget(str(budget)), str(budget)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise BudgetError(f"budget='auto' reads the free memory of the CUDA device the model is on, and it is on "
                          f"{device.type}: give a size ('20GiB') or a share of the no-remat peak ('60%').")
    free, total = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_reserved(device)
    limit = int(usable * (1 - AUTO_MARGIN))
    return Budget(bytes=limit), (f"auto: {format_bytes(usable)} free or reserved by this process on {device} "
                                 f"(of {format_bytes(total)}), less {AUTO_MARGIN:.0%}")


# -- trace and lay out, on fake tensors ------------------------------------------------------------

@dataclass
class _Layout:
    realised_peak: int
    not_checkpointed: dict[str, str]
    unrealised_bytes: int
    offload: Save = field(default_factory=dict)  # the offloads the run makes (apply_offloads), by path in the step
    offloaded: int = 0  # tensors
    offloaded_bytes: int = 0
    host_peak: int = 0
    compiled_cost: float | None = None  # under compile: the compiled step's compute with the layout's checkpoints


@dataclass
class _FakeStep:
    """The user's training step on fake tensors: a copy of the model (and of the loss, when it is a
    module) whose parameters and buffers are fake tensors of the same shapes, dtypes and devices, so
    that planning neither allocates device memory nor changes the user's model (a BatchNorm's
    statistics, a batch counter)."""

    mode: Any  # the FakeTensorMode every fake tensor here belongs to
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Any
    name: str
    parallel: Any = None  # the layout (bonsai_core.parallel.Layout) of the parallel run whose rank is traced
    autocast: str | None = None  # as traced (graph), for the layout's runs of the step
    mixed_precision: str | None = None  # FSDP2's param_dtype, as traced (graph): every run computes in it
    kernels: str = "cuda"  # as traced (graph): on the CPU an offload's copy ends when made
    compiled: str | None = None  # the compile mode whose step a layout's peak is of (None: eager)
    finish: Any = None  # the traced graph's sharding and optimizer, applied to a compiled trace too
    rank: Any = None  # a pipeline rank's stages (bonsai_core.pipeline.RankStages), traced one by one

    @classmethod
    def of(cls, model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any, name: str,
           parallel: Any = None, precision: str | None = None, compiled: str | None = None) -> "_FakeStep":
        """The fake copy of the step (``compiled``: the compile mode its peaks are of); of one rank of a
        ``parallel`` layout, parallelized as its library does it (:func:`bonsai_core.parallel.parallelize`,
        the batch a context-parallel rank's share); of a pipeline rank, its stages
        (:func:`bonsai_core.pipeline.split_rank`: their received activations in FSDP's param dtype
        ``precision``) as one model and loss (:class:`bonsai_core.pipeline.RankModel`)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from bonsai_core.parallel import check_supported, cp_inputs, meshes, parallelize, with_batch

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            step = cls(mode, fake_copy(model, mode), tuple(fake_of(x, mode) for x in inputs),
                       fake_copy(loss_fn, mode) if isinstance(loss_fn, nn.Module) else loss_fn, name, parallel,
                       compiled=compiled)
            if parallel is not None and parallel.is_parallel:
                check_supported(step.model, parallel)
                step.parallel = layout = with_batch(parallel, *step.inputs[0].shape[:2])
                dims = meshes(step.model, layout)
                if layout.pp > 1:
                    from bonsai_core.pipeline import RankLoss, RankModel, split_rank

                    step.rank = split_rank(step.model, step.inputs, step.loss_fn, layout, dims, precision)
                    step.model, step.inputs = RankModel(step.rank), tuple(step.rank.inputs)
                    step.loss_fn = RankLoss(step.rank)
                    return step
                parallelize(step.model, layout, dims)
                if layout.cp > 1:
                    step.inputs = cp_inputs(step.model, step.inputs, step.loss_fn, dims)
            return step

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        from bonsai_core.fsdp import computing_in
        from bonsai_core.parallel import step_context
        from bonsai_core.trace.patches import skip_tensor_asserts

        parallel = step_context(self.model, self.parallel) if self.parallel is not None and self.parallel.is_parallel \
            else contextlib.nullcontext()
        with self.mode, skip_tensor_asserts(), computing_in(self.model, self.mixed_precision), parallel:
            yield

    def graph(self, autocast: str | None, optimizer: str, sharding: Sharding, kernels: str = "cuda",
              grads: str = "zeroed") -> Graph:
        """The traced step (as one of ``sharding``'s ranks holds it, under its mixed precision), with the
        optimizer's state and step and the gradients left ``grads`` between steps, recording ``kernels``'
        device's dropout and attention."""
        from bonsai_core.optimizer import check_name, with_grads, with_optimizer
        from bonsai_core.trace import trace_step

        check_name(optimizer)
        self.autocast, self.mixed_precision, self.kernels = autocast, sharding.mixed_precision, kernels
        if self.rank is not None:
            from bonsai_core.pipeline import trace_rank_stages

            with self.mode, _skip_asserts():
                graph = trace_rank_stages(self.rank, self.parallel, sharding, self.name,
                                          {"autocast": autocast, "kernels": kernels}).graph
            return with_grads(with_optimizer(graph, optimizer), grads)
        with self.running():
            traced = trace_step(self.model, self.inputs, self.loss_fn, name=self.name, autocast=autocast,
                                kernels=kernels)

        def finish(graph: Graph) -> Graph:
            graph = sharding.shard(graph, self.model)
            if self.parallel is not None and self.parallel.is_parallel:
                from bonsai_core.parallel import with_layout

                graph = with_layout(graph, self.parallel)
            return with_grads(with_optimizer(graph, optimizer), grads)

        self.finish = finish
        return finish(traced.graph)

    def compiled_graph(self, save: Save) -> Graph:
        """The step compiled as ``self.compiled`` says with ``save``'s checkpoints applied
        (:func:`bonsai_core.trace.compiled.trace_compiled_step`), sharded and with the optimizer as traced:
        its plain schedule is what the plan holds and computes under torch.compile."""
        from bonsai_core.trace.compiled import trace_compiled_step

        with self.running():
            try:
                apply_saves(self.model, save, self.name)
                graph = trace_compiled_step(self.model, self.inputs, self.loss_fn, self.compiled, name=self.name,
                                            autocast=self.autocast, kernels=self.kernels)
            finally:
                remove_checkpoints(self.model)
        return self.finish(graph)

    def layout(self, graph: Graph, schedule: Schedule) -> tuple[Save, _Layout]:
        """The plan laid onto the model's submodules (:meth:`laid_out`), with its peak: the simulator's of
        what the checkpoints run, or under compile the compiled step's with them."""
        lay, left_out = self.laid_out(graph, schedule)
        if not self.compiled:
            return lay.save, _Layout(lay.realised_peak, left_out, lay.unrealised_bytes, lay.offload,
                                     len(lay.offloaded), lay.offloaded_bytes, lay.host_peak)
        under_compile = self.compiled_graph(lay.save)
        return lay.save, _Layout(no_remat_peak(under_compile), left_out, lay.unrealised_bytes, lay.offload,
                                 len(lay.offloaded), lay.offloaded_bytes, lay.host_peak, under_compile.total_cost)

    def laid_out(self, graph: Graph, schedule: Schedule) -> tuple[Any, dict[str, str]]:
        """The plan's :func:`bonsai_core.export.checkpoint.faithful_layout` on the model's submodules (its
        ``CheckpointLayout``) and the submodules left out, with why."""
        from bonsai_core.export.checkpoint import faithful_layout, hidden_caches, recomputation_mismatches
        from bonsai_core.export.checkpoint import offload_misses as offload_misses_of
        from bonsai_core.modules import record_step
        from bonsai_core.regions import CheckpointPlan
        from bonsai_core.trace import autocast_context

        device_type = self.inputs[0].device.type if self.inputs else "cpu"
        with self.running(), hidden_caches(self.model), autocast_context(self.autocast, device_type):
            recorded = record_step(self.model, self.inputs, self.loss_fn)

        def mismatches(save: Save) -> dict[str, str]:
            with self.running():
                try:
                    return recomputation_mismatches(save, self.name, self.model, self.inputs, self.loss_fn,
                                                    self.autocast, advice=LIBRARY_ADVICE)
                finally:
                    remove_checkpoints(self.model)

        def offload_misses(lay: Any) -> set:
            with self.running():
                try:
                    missed = offload_misses_of(lay.save, lay.offload, self.name, self.model, self.inputs,
                                               self.loss_fn, self.autocast)
                finally:
                    remove_checkpoints(self.model)
            # under a keyword call the step's root is bonsai's wrapper, which the user's model is not
            return missed | {name for name in lay.offloaded if name[0] == "" and isinstance(self.model, _KeywordCall)}

        plan = CheckpointPlan.from_extra(schedule.extra)
        if self.compiled:
            plan = _pointwise_unsaved(graph, plan)
        lay, left_out = faithful_layout(graph, plan, recorded, mismatches, offload_misses,
                                        synchronous=self.kernels == "cpu")
        if left_out and not lay.units and lay.dropped_bytes:
            path, why = next(iter(left_out.items()))
            raise ModelError(f"bonsai cannot checkpoint {self.name}: no submodule that would realise the plan can be "
                             f"recomputed faithfully; `{path}`: {why}. torch.utils.checkpoint requires a recomputation "
                             "to run the ops its forward ran: keep a submodule's forward free of state that it changes "
                             "and reads back (a cache it appends to).")
        if self.compiled == "blocks":
            lay = self.shared_across_blocks(lay, mismatches)
        return lay, left_out

    def shared_across_blocks(self, lay: Any, mismatches: Callable[[Save], dict[str, str]]) -> Any:
        """``lay`` with at most dynamo's ``recompile_limit`` distinct block plans
        (:func:`bonsai_core.trace.compiled.shared_block_plans`): more, and the blocks' ``fullgraph=True``
        compile fails. ModelError when a block does not recompute another's plan as it ran."""
        import dataclasses

        from bonsai_core.trace.compiled import block_paths, shared_block_plans

        modules = {path for path, _ in self.model.named_modules()}
        units = shared_block_plans(lay.units, block_paths(self.model), torch._dynamo.config.recompile_limit, modules)
        if units == lay.units:
            return lay
        shared = dataclasses.replace(lay, units=units)
        found = mismatches(shared.save)
        if found:
            path, why = next(iter(found.items()))
            raise ModelError(f"{self.name}'s blocks cannot share checkpoint plans, which torch.compile's recompile "
                             f"limit ({torch._dynamo.config.recompile_limit}) needs: `{path}`: {why}. Raise "
                             "torch._dynamo.config.recompile_limit to the number of blocks, or compile the whole model.")
        return shared


def _pointwise_unsaved(graph: Graph, plan: Any) -> Any:
    """``plan`` (a CheckpointPlan) for a compiled step: the pointwise ops it saves inside recomputed segments
    (``save_ops``' density levels; not the self-contained nodes) recomputed instead. Inductor recomputes a
    pointwise op inside the kernel that reads it, at no cost of its own, while saving it holds its output until
    the backward and splits the backward's kernel that would have recomputed it (the 8B step's RMSNorm
    ``rsqrt``, cheapest per byte of all, 64 KiB a norm: 3.3 MiB at the peak and unfused norm backwards, from
    the compiled traces)."""
    import dataclasses

    from bonsai_core.regions import forward_positions
    from bonsai_core.solvers.bonsai_coef import self_contained

    constant, pos = self_contained(graph), forward_positions(graph)
    saved = frozenset(v for v in plan.saved if constant[pos[v]] or not _is_pointwise(graph.ops[v]))
    return plan if saved == plan.saved else dataclasses.replace(plan, saved=saved)


def _is_pointwise(op: str) -> bool:
    """Whether the save policy's op name (``aten.rsqrt.default``) is an aten op torch tags pointwise."""
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    packet = getattr(torch.ops.aten, name, None) if namespace == "aten" else None
    overload_op = getattr(packet, overload or "default", None) if packet is not None else None
    return overload_op is not None and torch.Tag.pointwise in overload_op.tags


def compiled_plan(spec: str, graph: Graph, schedule: Schedule | None, compile: str = "model", *, seed: int = 0,
                  fsdp: int = 1, kernels: str = "cuda", **options: Any) -> tuple[Graph, Save]:
    """The same plan, compiled: the step of model spec ``spec`` (built with ``options`` as
    :func:`bonsai_core.trace.trace_model` builds it, on one of ``fsdp`` ranks) compiled as ``compile`` says,
    with ``schedule``'s checkpoint regions laid onto its submodules as :func:`plan` lays them, and those
    save policies. ``graph`` is the eager step the schedule was solved on; a schedule without checkpoint
    regions (None, no remat) gives the compiled step without checkpoints. The graph's plain schedule is
    what the plan holds under torch.compile (its ``no_remat_peak``: :func:`plan`'s predicted peak under
    ``compile``), to set beside the eager schedule's; ``kernels``: the device the plan is for, as ``plan``'s
    ``device`` (the partitioner's choices: :func:`bonsai_core.trace.compiled.partitioner_for`)."""
    from torch._guards import detect_fake_mode

    from bonsai_core.trace import built_for_tracing
    from bonsai_core.trace.compiled import check_compile

    check_compile(compile, fsdp)
    if schedule is not None and schedule.graph_hash not in (None, graph.hash):
        raise ScheduleError(f"The schedule was solved on graph {schedule.graph_hash}, not on {graph.hash} ({graph.name}): "
                            "give the eager graph it was solved on.")
    regions = schedule is not None and "segments" in schedule.extra
    sharding = Sharding.of(fsdp, model=spec)
    with built_for_tracing(spec, seed, **options) as (model, inputs, loss_fn):
        step = _FakeStep(detect_fake_mode(inputs), model, tuple(inputs), loss_fn, spec, compiled=compile)
        step.mixed_precision, step.finish = sharding.mixed_precision, lambda g: sharding.shard(g, model)
        step.kernels = kernels
        save = step.laid_out(graph, schedule)[0].save if regions else {}
        return step.compiled_graph(save), save


def _skip_asserts() -> contextlib.AbstractContextManager:
    from bonsai_core.trace.patches import skip_tensor_asserts

    return skip_tensor_asserts()


# -- the plan cache --------------------------------------------------------------------------------

def _cache_folder(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("BONSAI_CACHE_DIR"):
        return Path(os.environ["BONSAI_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bonsai" / "plans"


def _fingerprint(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any, settings: dict[str, Any]) -> str:
    """A hash of everything a plan depends on (see the module doc)."""
    from bonsai_core.version import __version__

    digest = hashlib.sha256()

    def feed(*parts: Any) -> None:
        digest.update(repr(parts).encode())

    feed(CACHE_VERSION, __version__, torch.__version__, getattr(sys.modules.get("transformers"), "__version__", None),
         json.dumps(settings, sort_keys=True))
    files: set[str] = set()
    for name, m in model.named_modules():
        feed(name, type(m).__module__, type(m).__qualname__, m.training, _settings(m))
        files.add(_source_file(type(m)))
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        feed(name, tuple(t.shape), str(t.dtype), t.requires_grad)
    for t in inputs:
        feed(tuple(t.shape), str(t.dtype), t.requires_grad)
    if isinstance(loss_fn, nn.Module):
        files.add(_source_file(type(loss_fn)))
        for name, t in (*loss_fn.named_parameters(), *loss_fn.named_buffers()):
            feed(name, tuple(t.shape), str(t.dtype))
    code = getattr(loss_fn, "__code__", None)
    if code is not None:
        feed(code.co_code, repr(code.co_consts), code.co_names)
    for path in sorted(f for f in files if f):
        try:
            digest.update(Path(path).read_bytes())
        except OSError:
            feed(path)
    return digest.hexdigest()


_PLAIN = (int, float, str, bool, type(None))


def _settings(module: nn.Module) -> list[Any]:
    """A module's own settings: plain attributes (a dropout's ``p``, a norm's ``eps``) and a
    ``transformers`` config (its ``to_dict()``), which forward code reads (``config.attn_pdrop``)."""
    out: list[Any] = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_"):
            continue
        if isinstance(value, _PLAIN) or (isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value)):
            out.append((key, value))
        elif callable(getattr(value, "to_dict", None)):
            try:
                out.append((key, json.dumps(value.to_dict(), sort_keys=True, default=str)))
            except (TypeError, ValueError):
                out.append((key, type(value).__name__))
    return out


def _source_file(cls: type) -> str:
    try:
        return inspect.getsourcefile(cls) or ""
    except TypeError:  # a built-in class
        return ""


def _read_cached(folder: Path, key: str) -> Plan | None:
    """The cached plan for ``key``, or None (a missing, unreadable or stale entry is planned again)."""
    path = folder / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        report = Report(**{**data["report"], "cached": True})
        return Plan(data["save"], report, Schedule.from_dict(data["schedule"]), offload=data.get("offload", {}))
    except (OSError, ValueError, KeyError, TypeError, BonsaiError):
        return None


def _write_cached(folder: Path, key: str, made: Plan) -> None:
    """Store ``made`` under ``key`` (atomically; a cache that cannot be written is skipped, with a warning)."""
    import warnings

    data = {"save": made.save, "offload": made.offload, "report": asdict(made.report), "schedule": made.schedule.to_dict()}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, folder / f"{key}.json")
    except OSError as e:
        warnings.warn(f"bonsai: the plan cache {str(folder)!r} cannot be written ({e.strerror}); plans are not "
                      "cached. Set BONSAI_CACHE_DIR to a writable folder, or pass cache=False.", stacklevel=3)
