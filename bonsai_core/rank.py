"""One rank of a parallel run traced: the entry that takes any layout (:class:`bonsai_core.parallel.Layout`),
its tensor and context parallel applied as :mod:`bonsai_core.parallel` applies them, its pipeline stages as
:mod:`bonsai_core.pipeline` splits them, FSDP over ``dp_shard x cp`` ranks (:class:`bonsai_core.fsdp.Sharding`).
A layout that is FSDP alone is :func:`bonsai_core.trace.trace_model`'s ``fsdp``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from bonsai_core.errors import BonsaiError
from bonsai_core.parallel import (Layout, check_supported, cp_inputs, meshes, parallelize, step_context, with_batch,
                                  with_layout, world)
from bonsai_core.pipeline import split_rank, trace_rank_stages


def trace(name: str, parallel: Layout | None = None, **kwargs: Any) -> Any:
    """:func:`bonsai_core.trace.trace_model` of model spec ``name``, as one rank of ``parallel`` where it is more
    than FSDP (:func:`trace_rank`; its ``fsdp`` then the FSDP degree), else with ``kwargs``' ``fsdp``."""
    from bonsai_core.trace import trace_model

    if parallel is not None and parallel.is_parallel:
        if kwargs.get("compile") or kwargs.get("ac") or kwargs.get("float8"):
            check_compiled_rank(name, parallel, kwargs.get("compile"), kwargs.get("ac"), kwargs.get("float8", False))
        kwargs.pop("fsdp", None)
        return trace_rank(name, parallel, **kwargs)
    if parallel is not None:
        kwargs["fsdp"] = parallel.fsdp
    return trace_model(name, **kwargs)


def check_compiled_rank(name: str, layout: Layout, compile: str | None, ac: str | None, float8: bool) -> None:
    """Refuse a compiled rank this trace cannot run: it traces a tensor parallel rank (with FSDP, HSDP) of a
    ``torchtitan:`` model compiled block by block, as torchtitan compiles it, with ``ac`` and ``float8``."""
    from bonsai_core.trace.compiled import check_checkpointing

    if compile is None:
        raise BonsaiError(f"--ac/--float8 with {layout.describe()} are applied before torch.compile: give --compile "
                          "blocks with them.")
    if layout.cp > 1 or layout.pp > 1:
        raise BonsaiError(f"--compile with {layout.describe()}: a compiled context or pipeline parallel rank is not "
                          "traced yet (a tensor parallel one is, with FSDP/HSDP); trace that rank eager (leave out "
                          "--compile, --ac, --float8).")
    if compile != "blocks":
        raise BonsaiError(f"--compile {compile} with {layout.describe()}: a parallel rank is traced compiled block by "
                          "block, as torchtitan compiles it; give --compile blocks.")
    if not name.startswith("torchtitan:"):
        raise BonsaiError(f"--compile with {layout.describe()} is traced for torchtitan: models (its parallelize_llama "
                          f"compiles each block after tensor parallel and checkpointing); trace {name!r} eager.")
    check_checkpointing(ac, name)


def trace_rank(name: str, layout: Layout, seed: int = 0, reshard_after_forward: bool | str | None = None,
               mixed_precision: str | None = None, compile: str | None = None, ac: str | None = None,
               float8: bool = False, **trace_options: Any) -> Any:
    """One rank of ``layout`` training model spec ``name``: built on fake tensors, parallelized as its
    library does it, its step traced (:func:`bonsai_core.trace.trace_step`; ``trace_options``: ``profile``,
    ``autocast``, ``kernels`` and the model's size options), then sharded by FSDP over ``dp_shard x cp``
    ranks (:class:`bonsai_core.fsdp.Sharding`: its settings default as for ``--fsdp``, torchtitan's for a
    ``torchtitan:`` model), the graph's ``parallel`` field naming the layout. ``compile`` ("blocks"), ``ac`` and
    ``float8``: the step compiled as torchtitan's ``parallelize_llama`` runs it (:func:`check_compiled_rank`):
    Float8 linears converted first, tensor parallel with torchao's Float8 styles (the sequence-parallel inputs
    all-gathered in float8), then ``ac``, then each block compiled (:func:`bonsai_core.trace.compiled.trace_compiled_step`)."""
    from bonsai_core.fsdp import Sharding
    from bonsai_core.trace import built_for_tracing

    sharding = Sharding.of(layout.shard_world, reshard_after_forward, mixed_precision, model=name)
    step = {k: trace_options.pop(k) for k in ("profile", "autocast", "kernels") if k in trace_options}
    with world(layout) as layout:
        with built_for_tracing(name, seed, **trace_options) as (model, inputs, loss_fn):
            check_supported(model, layout)
            layout = with_batch(layout, *inputs[0].shape[:2])
            label = f"{name}({', '.join(f'{k}={v}' for k, v in sorted(trace_options.items()))}) {layout.describe()}"
            compiled = dict(compile=compile, ac=ac, float8=float8) if compile else None
            return _traced_rank(model, inputs, loss_fn, layout, label, sharding, step, compiled)


def _traced_rank(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any, layout: Layout, label: str,
                 sharding: Any, step: dict[str, Any], compiled: dict[str, Any] | None = None) -> Any:
    import time

    from bonsai_core.fsdp import computing_in
    from bonsai_core.trace import Traced, trace_step

    dims = meshes(model, layout)
    if layout.pp > 1:
        rank = split_rank(model, inputs, loss_fn, layout, dims, sharding.mixed_precision)
        return trace_rank_stages(rank, layout, sharding, label, step)
    float8 = bool(compiled and compiled["float8"])
    if float8:
        from bonsai_core.trace.compiled import float8_linears

        float8_linears(model)
    parallelize(model, layout, dims, float8=float8)
    if layout.cp > 1:
        inputs = cp_inputs(model, inputs, loss_fn, dims)
    precision = sharding.mixed_precision
    name = label + (f" fsdp mixed precision {precision}" if precision else "")
    with step_context(model, layout), computing_in(model, precision):
        if compiled is None:
            traced = trace_step(model, inputs, loss_fn, name=name, **step)
        else:
            from bonsai_core.trace.compiled import trace_compiled_step

            start = time.perf_counter()
            graph = trace_compiled_step(model, inputs, loss_fn, compiled["compile"], name=name,
                                        checkpointing=compiled["ac"], float8=float8, **step)
            traced = Traced(graph, None, [], time.perf_counter() - start)
    traced.graph = with_layout(sharding.shard(traced.graph, model), layout)
    return traced
