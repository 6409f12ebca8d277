"""Every rank of a parallel run: the layout (FSDP, HSDP, tensor, context and pipeline parallel degrees), and
one rank's training step traced in one process.

A :class:`Layout` names the degrees as torchtitan 0.2.2's ``ParallelDims`` takes them: ``dp_replicate``
(HSDP's replicas), ``fsdp`` (``dp_shard``), ``cp``, ``tp``, ``pp``; their product is the number of GPUs.
One rank of such a run is traced on fake tensors with PyTorch's fake process group
(``torch.testing._internal.distributed.fake_pg``), so a 512-GPU mesh is built on one CPU:

* **tensor parallel** as the model's library applies it: torchtitan's ``apply_tp`` (its
  ``parallelize_llama``: colwise / rowwise linears, sequence-parallel norms, the embedding sharded by
  vocabulary, the output colwise with loss parallel) or, for ``hf:`` models, transformers' own
  ``tp_plan`` (``apply_tensor_parallelism``). The parameters become DTensors; the joint graph is one
  rank's program (:mod:`bonsai_core.trace.descriptors`): its local shards, and the collectives DTensor
  issues (all-gather, reduce-scatter, all-reduce) as nodes whose outputs hold their bytes;
* **context parallel** as torchtitan applies it (``apply_cp_to_attention_module``, the batch sharded by
  ``prepare_context_parallel_input`` with its head-tail load balancer): the sequence is split over the
  CP ranks and attention runs torch's ring attention (its K/V exchange, all-gather by default, as nodes
  of the graph). The trace records SDPA as the GPU's flash kernel there (:func:`_sdpa_as_cuda_flash`):
  the CP dispatcher implements the GPU kernels only;
* **FSDP** over torchtitan's ``fsdp`` mesh dimension (``dp_shard x cp``) as :mod:`bonsai_core.fsdp`
  models it (rule 7), on the rank's local (tensor-parallel) shards; **HSDP** (``dp_replicate``)
  shards over that dimension only, its all-reduce across replicas runs in place on the reduce-scatter's
  output (``foreach_reduce``), which FSDP holds anyway;
* **pipeline parallel**: :mod:`bonsai_core.pipeline`.

``async_tp`` (torchtitan's ``enable_async_tensor_parallel``) is refused: it is an Inductor pass
(``_micro_pipeline_tp``) that needs ``torch.compile`` of the model, which the trace does not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import unittest.mock
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn

from bonsai_core.arguments import SCHEDULES
from bonsai_core.errors import BonsaiError, ModelError

ASYNC_TP_REFUSED = ("--async-tp (torchtitan's enable_async_tensor_parallel) is an Inductor pass (torch._inductor's "
                    "_micro_pipeline_tp: all-gathers fused with the matmuls that read them, on symmetric memory) that "
                    "runs only under torch.compile; bonsai traces the eager step, so it cannot model it. Leave "
                    "--async-tp out: the rank is then predicted with TP's collectives as eager runs them.")


@dataclass(frozen=True)
class Layout:
    """How a run is laid out over its GPUs (torchtitan's ``ParallelDims`` degrees) and which rank is traced.
    ``fsdp`` is ``dp_shard``; ``microbatches`` (pipeline parallel) defaults to one sequence each (torchtitan's
    ``pipeline_parallel_microbatch_size`` 1); ``rank`` is the pipeline rank (ranks differ by their stages only)."""

    fsdp: int = 1
    dp_replicate: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    rank: int = 0
    async_tp: bool = False

    @property
    def world(self) -> int:
        return self.dp_replicate * self.fsdp * self.cp * self.tp * self.pp

    @property
    def shard_world(self) -> int:
        """The ranks FSDP shards over: torchtitan's ``fsdp`` mesh dimension, ``dp_shard x cp``."""
        return self.fsdp * self.cp

    @property
    def is_parallel(self) -> bool:
        """More than FSDP alone (which :mod:`bonsai_core.fsdp` traces without a mesh)."""
        return max(self.tp, self.cp, self.pp, self.dp_replicate) > 1

    def to_dict(self) -> dict[str, Any]:
        """The degrees, and with pipeline parallel its schedule, microbatches and the rank (the graph's field)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in ("fsdp", "dp_replicate", "tp", "cp", "pp")}
        if self.pp > 1:
            out.update(pp_schedule=self.pp_schedule, microbatches=self.microbatches, rank=self.rank)
        return out

    def describe(self, rank: bool = True) -> str:
        """``FSDP 8 x TP 8 x PP 8 (1F1B, 32 microbatches), pipeline rank 3`` (the degrees above 1; the
        microbatches where known, the rank unless ``rank`` is False)."""
        parts = [f"{name} {n}" for name, n in (("HSDP replicas", self.dp_replicate), ("FSDP", self.fsdp),
                                                ("CP", self.cp), ("TP", self.tp), ("PP", self.pp)) if n > 1]
        text = " x ".join(parts) or "one GPU"
        if self.pp > 1:
            micro = f", {self.microbatches} microbatches" if self.microbatches else ""
            text += f" ({SCHEDULES[self.pp_schedule]}{micro})" + (f", pipeline rank {self.rank}" if rank else "")
        return text


def layout_of(fsdp: int = 1, tp: int = 1, cp: int = 1, pp: int = 1, dp_replicate: int = 1,
              pp_schedule: str = "1f1b", microbatches: int | None = None, rank: int = 0,
              async_tp: bool = False) -> Layout:
    """A :class:`Layout` from the keywords the command line, the one call and ``plan_for`` take, checked."""
    for name, n in (("fsdp", fsdp), ("tp", tp), ("cp", cp), ("pp", pp), ("dp_replicate", dp_replicate)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BonsaiError(f"{name}={n!r}: a parallel degree is a whole number, 1 or more.")
    if async_tp:
        raise BonsaiError(ASYNC_TP_REFUSED)
    if pp_schedule not in SCHEDULES:
        raise BonsaiError(f"pp_schedule={pp_schedule!r}: choose one of {', '.join(SCHEDULES)} "
                          "(torch.distributed.pipelining's Schedule1F1B and ScheduleInterleaved1F1B).")
    if not 0 <= rank < pp:
        raise BonsaiError(f"rank={rank}: the pipeline rank is 0 to {pp - 1} (pp={pp}).")
    if dp_replicate > 1 and fsdp * cp == 1:
        raise BonsaiError(f"dp_replicate={dp_replicate} without FSDP is DDP (torchtitan's apply_ddp), which bonsai does "
                          "not model: give fsdp=N (HSDP: dp_replicate replicas of an FSDP group of N ranks).")
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                     or microbatches < 1):
        raise BonsaiError(f"microbatches={microbatches!r}: give a whole number, 1 or more.")
    return Layout(fsdp, dp_replicate, tp, cp, pp, pp_schedule, microbatches if pp > 1 else None, rank, False)


def with_batch(layout: Layout, batch: int, seq: int) -> Layout:
    """``layout`` checked against a local batch of ``batch x seq`` as torchtitan checks it (the sequence
    divisible by ``tp x 2 cp``, ``ParallelDims.seq_len_divisor``; the batch by the microbatches), its
    microbatches defaulting to one sequence each."""
    divisor = layout.tp * (2 * layout.cp if layout.cp > 1 else 1)
    if seq % divisor:
        raise BonsaiError(f"seq={seq}: sequence parallel needs the sequence divisible by the TP degree"
                          + (" and context parallel by 2 x CP (its load balancer)" if layout.cp > 1 else "")
                          + f", here {divisor}.")
    if layout.pp == 1:
        return layout
    micro = layout.microbatches or batch
    if batch % micro:
        raise BonsaiError(f"batch={batch} is not divisible into {micro} microbatches (torchtitan's "
                          "pipeline_parallel_microbatch_size must divide the local batch).")
    if layout.pp_schedule == "1f1b" and micro < layout.pp:
        raise BonsaiError(f"1F1B needs at least as many microbatches as stages: {micro} < pp={layout.pp} "
                          "(torch's Schedule1F1B refuses it); give a larger batch or microbatches.")
    if layout.pp_schedule == "interleaved-1f1b":
        rounds = max(1, micro // layout.pp)
        if micro % rounds:
            raise BonsaiError(f"Interleaved 1F1B needs the microbatches ({micro}) a multiple of its rounds "
                              f"({rounds} = microbatches // pp), as torch's ScheduleInterleaved1F1B checks.")
    return dataclasses.replace(layout, microbatches=micro)


# -- the process group and meshes a rank is traced in -------------------------------------------------

_WORLD = threading.Lock()  # one fake default process group at a time in this process


@contextlib.contextmanager
def world(layout: Layout) -> Iterator[Layout]:
    """The process group the rank's meshes live in, yielding ``layout`` with this process's pipeline rank:
    where none is set up (the command line, the explorer), a fake one of ``layout.world`` ranks in which this
    process is the first rank of pipeline rank ``layout.rank`` (torchtitan's mesh puts ``pp`` outermost), torn
    down after; inside a run (a training script's one call, the gloo checks), the run's own group, which must
    be ``layout.world`` ranks, and this process's rank in it: no collective runs on fake tensors, its meshes
    only name the ranks."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != layout.world:
            raise BonsaiError(f"The layout {layout.describe()} has {layout.world} ranks, but this process runs in a "
                              f"process group of {dist.get_world_size()}: give the run's own degrees.")
        yield in_this_run(layout)
        return
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers the "fake" backend)

    with _WORLD:
        rank = layout.rank * (layout.world // layout.pp)
        # a C++ store: fake_pg's FakeStore, a Python subclass, left behind with the torn-down group corrupts
        # the heap at the interpreter's exit
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=layout.world)
        try:
            yield layout
        finally:
            # what holds the fake groups (meshes, pipeline stages in reference cycles) goes first: a group
            # freed after its process group is destroyed corrupts the heap at exit
            gc.collect()
            dist.destroy_process_group()
            _forget_meshes()


def in_this_run(layout: Layout) -> Layout:
    """``layout`` with the pipeline rank of this process, inside a run (a process group set up); as it is
    elsewhere."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != layout.world:
        return layout
    return dataclasses.replace(layout, rank=dist.get_rank() // (layout.world // layout.pp))


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution plans: they are keyed by meshes, whose equality
    ignores the process groups, and hold the meshes they were made on, so the next fake world's mesh of the
    same shape would find a plan naming the groups just destroyed."""
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def torchtitan_dims(layout: Layout) -> Any:
    """torchtitan's ``ParallelDims`` of ``layout`` with its meshes built (in the current process group), on
    the CPU: the trace runs on CPU fake tensors."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    dims = parallel_dims.ParallelDims(dp_replicate=layout.dp_replicate, dp_shard=layout.fsdp, cp=layout.cp,
                                      tp=layout.tp, pp=layout.pp, ep=1, etp=1, world_size=layout.world)
    with unittest.mock.patch.object(parallel_dims, "device_type", "cpu"):  # its meshes' device, else cuda
        dims.build_mesh()
    return dims


# -- which library parallelizes a model -----------------------------------------------------------------

def family(model: nn.Module) -> str:
    """``"torchtitan"`` (its Llama 3 ``Transformer``) or ``"hf"`` (a transformers model, or bonsai's wrapper
    of one): the library whose tensor-parallel plan the rank is traced with."""
    if getattr(model, "bonsai_family", None) == "torchtitan" \
            or any(cls.__module__.startswith("torchtitan.") for cls in type(model).__mro__):  # FSDP2 subclasses it
        return "torchtitan"
    if _transformers_model(model) is not None:
        return "hf"
    raise ModelError(f"{type(model).__name__} has no tensor, context or pipeline parallel plan bonsai knows: "
                     "torchtitan: models are parallelized as torchtitan's parallelize_llama does, hf: models with "
                     "transformers' tp_plan; any model can be planned under FSDP alone (--fsdp N).")


def _transformers_model(model: nn.Module) -> nn.Module | None:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def check_supported(model: nn.Module, layout: Layout) -> str:
    """The model's family, refusing what its library does not parallelize here."""
    kind = family(model)
    if kind == "hf" and (layout.cp > 1 or layout.pp > 1):
        raise ModelError("hf: models are traced under tensor parallel (transformers' tp_plan) and FSDP/HSDP; context "
                         "and pipeline parallel are modelled for torchtitan: models (torchtitan's own "
                         "parallelize_llama and pipeline split).")
    return kind


def parallelize(model: nn.Module, layout: Layout, dims: Any, float8: bool = False) -> None:
    """Tensor and context parallel applied to ``model`` (fake tensors) in place, as its library applies them:
    torchtitan's ``apply_tp`` / ``apply_cp_to_attention_module`` (loss parallel on, its default), or
    transformers' ``tp_plan``. ``dims``: :func:`meshes`'s. ``float8``: the linears are torchao's Float8 ones, and
    tensor parallel takes torchao's Float8 styles, as torchtitan's ``parallelize_llama`` does for them."""
    if family(model) == "hf":
        if layout.tp > 1:
            from transformers.distributed import DistributedConfig
            from transformers.distributed.tensor_parallel import apply_tensor_parallelism

            hf = _transformers_model(model)
            plan = hf._resolve_parallel_plans(DistributedConfig(tp_size=layout.tp))[0]
            apply_tensor_parallelism(hf, dims["tp"], plan)
        return
    from torchtitan.distributed.context_parallel import apply_cp_to_attention_module
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    if layout.tp > 1:
        apply_tp(model, dims.get_mesh("tp"), loss_parallel=True, enable_float8_tensorwise_tp=float8,
                 cp_enabled=layout.cp > 1)
    if layout.cp > 1:
        apply_cp_to_attention_module([block.attention.inner_attention for block in model.layers.values()],
                                     dims.get_mesh("cp"), getattr(model.model_args, "attn_type", "sdpa"))


def meshes(model: nn.Module, layout: Layout) -> Any:
    """The device meshes ``model``'s library parallelizes with: torchtitan's ``ParallelDims``, or for an
    ``hf:`` model ``{"tp": mesh, "dp": mesh}`` of torch's ``init_device_mesh`` (data parallel outermost). Built on
    real tensors (a mesh reads its ranks' values) while the model is fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    with unset_fake_temporarily():
        if family(model) == "torchtitan":
            return torchtitan_dims(layout)
        mesh = init_device_mesh("cpu", (layout.world // layout.tp, layout.tp), mesh_dim_names=("dp", "tp"))
        return {"tp": mesh["tp"], "dp": mesh["dp"]}


@contextlib.contextmanager
def step_context(model: nn.Module, layout: Layout) -> Iterator[None]:
    """What a rank's step runs under: torchtitan's train context with loss parallel (TP) and SDPA as the
    GPU's flash kernel under context parallel (:func:`_sdpa_as_cuda_flash`); nothing otherwise."""
    with contextlib.ExitStack() as stack:
        if family(model) == "torchtitan" and layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        if layout.cp > 1:
            stack.enter_context(_sdpa_as_cuda_flash())
        yield


@contextlib.contextmanager
def _sdpa_as_cuda_flash() -> Iterator[None]:
    """Within: ``F.scaled_dot_product_attention`` (no mask, no dropout) runs ``aten._scaled_dot_product_flash_attention``,
    the GPU's flash kernel, on the CPU fake tensors: torch's context-parallel dispatcher implements ring
    attention for the GPU's kernels only (flash, memory-efficient, cuDNN; torchtitan 0.2.2 prefers cuDNN,
    which keeps what flash keeps: the output and a logsumexp per row)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from bonsai_core.attention import sdpa_arguments

    class Flash(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                call = sdpa_arguments(args, kwargs)
                if call["attn_mask"] is None and not call["dropout_p"]:
                    return torch.ops.aten._scaled_dot_product_flash_attention(
                        call["query"], call["key"], call["value"], 0.0, call["is_causal"], False,
                        scale=call["scale"])[0]
            return func(*args, **kwargs)

    with Flash():
        yield


def cp_inputs(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any, dims: Any) -> tuple[torch.Tensor, ...]:
    """A context-parallel rank's share of the batch (:func:`cp_positions`), the loss's labels sharded in place."""
    tokens, loss_fn.labels = cp_positions(model, inputs[0], loss_fn.labels, dims)
    return (tokens,)


def cp_positions(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, dims: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A context-parallel rank's tokens and labels, as torchtitan's ``prepare_context_parallel_input`` shards
    them along the sequence (head-tail load balanced), and the positions the model then reads (its RoPE
    table by position; every pipeline stage gets them) held as a buffer ``model`` passes on."""
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    tokens, labels, extra = prepare_context_parallel_input(tokens, labels, {}, dims.get_mesh("cp"), tokens.device,
                                                           "headtail")
    model.register_buffer("cp_positions", extra["positions"], persistent=False)
    forward = type(model).forward
    # read through the attribute at each call, so that the export lifts the buffer as an input
    model.forward = lambda x: forward(model, x, positions=model.cp_positions)
    return tokens, labels


def with_layout(graph: Any, layout: Layout, **fields: Any) -> Any:
    """``graph`` with its ``parallel`` field: the layout, and any other ``fields`` (``pipeline``)."""
    return graph.with_fields(parallel={"layout": layout.to_dict(), **fields})
