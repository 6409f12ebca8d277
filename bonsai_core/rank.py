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
            raise BonsaiError(f"--compile with {parallel.describe()}: a compiled tensor, context or pipeline parallel "
                              "rank is not traced yet (only an FSDP one is); trace that rank eager (leave out --compile, "
                              "--ac, --float8), or the compiled step with --fsdp N alone.")
        for key in ("fsdp", "compile", "ac", "float8"):
            kwargs.pop(key, None)
        return trace_rank(name, parallel, **kwargs)
    if parallel is not None:
        kwargs["fsdp"] = parallel.fsdp
    return trace_model(name, **kwargs)


def trace_rank(name: str, layout: Layout, seed: int = 0, reshard_after_forward: bool | str | None = None,
               mixed_precision: str | None = None, **trace_options: Any) -> Any:
    """One rank of ``layout`` training model spec ``name``: built on fake tensors, parallelized as its
    library does it, its step traced (:func:`bonsai_core.trace.trace_step`; ``trace_options``: ``profile``,
    ``autocast``, ``kernels`` and the model's size options), then sharded by FSDP over ``dp_shard x cp``
    ranks (:class:`bonsai_core.fsdp.Sharding`: its settings default as for ``--fsdp``, torchtitan's for a
    ``torchtitan:`` model), the graph's ``parallel`` field naming the layout."""
    from bonsai_core.fsdp import Sharding
    from bonsai_core.trace import built_for_tracing

    sharding = Sharding.of(layout.shard_world, reshard_after_forward, mixed_precision, model=name)
    step = {k: trace_options.pop(k) for k in ("profile", "autocast", "kernels") if k in trace_options}
    with world(layout) as layout:
        with built_for_tracing(name, seed, **trace_options) as (model, inputs, loss_fn):
            check_supported(model, layout)
            layout = with_batch(layout, *inputs[0].shape[:2])
            label = f"{name}({', '.join(f'{k}={v}' for k, v in sorted(trace_options.items()))}) {layout.describe()}"
            return _traced_rank(model, inputs, loss_fn, layout, label, sharding, step)


def _traced_rank(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any, layout: Layout, label: str,
                 sharding: Any, step: dict[str, Any]) -> Any:
    from bonsai_core.fsdp import computing_in
    from bonsai_core.trace import trace_step

    dims = meshes(model, layout)
    if layout.pp > 1:
        rank = split_rank(model, inputs, loss_fn, layout, dims, sharding.mixed_precision)
        return trace_rank_stages(rank, layout, sharding, label, step)
    parallelize(model, layout, dims)
    if layout.cp > 1:
        inputs = cp_inputs(model, inputs, loss_fn, dims)
    precision = sharding.mixed_precision
    with step_context(model, layout), computing_in(model, precision):
        traced = trace_step(model, inputs, loss_fn, name=label + (f" fsdp mixed precision {precision}" if precision else ""),
                            **step)
    traced.graph = with_layout(sharding.shard(traced.graph, model), layout)
    return traced


