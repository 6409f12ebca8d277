"""Pipeline parallel: a rank's stages, one microbatch each, and how the rank holds its microbatches in flight.

**The stages.** torchtitan 0.2.2 splits the model as its ``pipeline_llm`` does: ``generate_llm_fqn_per_model_part``
(the embedding and the final norm and output weighing one layer each: ``pipeline_parallel_first_stage_less_layers``
and ``..._last_...`` 1) over ``pp`` stages for 1F1B, ``2 pp`` for interleaved 1F1B (its default without
``pipeline_parallel_layers_per_stage``), and ``pipeline_module_split`` gives rank ``r`` stages ``r, r + pp, ...``
(its "loop" style), each a copy of the model with the other layers deleted. Each stage is traced for one
microbatch (``local batch / microbatches`` sequences), the first from the tokens, the others from the
received activation (an input that needs its gradient), the last with the loss; a stage that is not last
returns its output, whose gradient comes from the next stage (:class:`bonsai_core.trace.descriptors.SentOutput`).
The rank's graph is its stages' graphs one after the other; the graph's ``parallel.pipeline`` field names
their node spans and the rank's compute actions in the order the schedule runs them:

* ``1f1b``: ``Schedule1F1B._step_microbatches`` of torch 2.13: ``min(m, pp - r)`` forwards, then a backward
  and a forward in turn, then the backwards left;
* ``interleaved-1f1b``: ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` of torch 2.13, called
  here (its warm-up ``_get_warmup_ops``: ``(v - 1) x microbatches per round + 2 (pp - 1 - r)`` forwards).

**What the rank holds** (torch 2.13's ``torch.distributed.pipelining``, simulator rule 11):

* per microbatch in flight (its forward done, its backward not): what its stage's forward left for the
  backward (``fwd_cache``: the saved activations, the stage's input and output, kept to the end of its
  backward by ``stage_backward``), the bytes the schedule leaves resident at the end of the stage's forward;
* the receive buffers, one per microbatch, allocated when the stages are set up and kept (``_RecvInfo``):
  the activation received (every stage but the first) and its gradient (every stage but the last): fixed;
* FSDP under pipeline parallel as torchtitan sets it (``apply_fsdp(pp_enabled=True)``: no resharding after
  forward) and the stage runs it (``backward_maybe_with_nosync``: no resharding after backward, no gradient
  sync until ``perform_reduce_grad``): every unit's parameters unsharded from the step's start to its stage's
  ``perform_reduce_grad``, which reshards them (fixed, given back there); its gradients accumulated unsharded in
  ``reduce_dtype`` from each unit's first backward in the step to the stage's last, then reduce-scattered:
  autograd's ``.grad`` where ``param_dtype`` is ``reduce_dtype``, else cast at each post-backward
  (``FSDPParam.to_accumulated_grad_if_needed``), the running unit's gradients held until then.

So at each op of a stage's forward (backward) the rank holds, beyond the op's own microbatch, the in-flight
bytes of every other microbatch of the action the op runs in, the largest over the stage's forward
(backward) actions: :func:`bonsai_core.in_flight.working` (the simulator's side) is that envelope, what the
simulator adds to the one microbatch's timeline. The peak is the rank's; every method is judged with it,
and :func:`bonsai_core.solvers.solve` solves again under a tighter budget where it pushes a plan over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn

from bonsai_core.errors import BonsaiError
from bonsai_core.graph import UNSHARDED_TO_REDUCE
from bonsai_core.in_flight import STAGES_PER_RANK, actions

# torchtitan 0.2.2's JobConfig: pipeline_parallel_first_stage_less_layers, ..._last_stage_less_layers
INPUT_WEIGHT = OUTPUT_WEIGHT = 1
TORCH_SCHEDULE = {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}  # get_schedule_class's names


# -- the stages and the schedule --------------------------------------------------------------------------

def stage_modules(layout: Any, n_layers: int) -> list[list[str]]:
    """Each stage's module names, as torchtitan's ``generate_llm_fqn_per_model_part`` gives them."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    stages = layout.pp * STAGES_PER_RANK[layout.pp_schedule]
    try:
        return generate_llm_fqn_per_model_part(stages, n_layers, INPUT_WEIGHT, OUTPUT_WEIGHT)
    except ValueError as e:
        raise BonsaiError(f"{layout.describe()}: torchtitan cannot split {n_layers} layers into {stages} stages ({e})."
                          ) from None


def rank_stages(layout: Any) -> list[int]:
    """The stage indices rank ``layout.rank`` runs, in order (torchtitan's "loop" style)."""
    return [layout.rank + k * layout.pp for k in range(STAGES_PER_RANK[layout.pp_schedule])]


# -- a rank's stages traced -------------------------------------------------------------------------------

class Parts(nn.ModuleList):
    """A rank's model parts as one module whose ``get_submodule`` finds a path in the part that has it (their
    paths are the whole model's: ``layers.12``), so FSDP's units are counted across them."""

    def get_submodule(self, target: str) -> nn.Module:
        for part in self:
            try:
                return part.get_submodule(target)
            except AttributeError:
                continue
        raise AttributeError(f"no stage of this rank has {target!r}")


@dataclass
class RankStages:
    """A pipeline rank's stages, split off as torchtitan splits the model and parallelized (fake tensors), each
    with one microbatch's input (the tokens, or the received activation, which needs its gradient) and loss
    (torchtitan's on the last stage, else :class:`SentOutput`)."""

    indices: list[int]
    parts: list[nn.Module]
    inputs: list[torch.Tensor]
    losses: list[nn.Module]
    first: list[bool]
    last: list[bool]
    micro: int
    sent: list[torch.Tensor]  # the activation each stage sends on (what the next stage receives), by shape and dtype


def split_rank(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any, layout: Any, dims: Any,
               precision: str | None) -> RankStages:
    """The stages of pipeline rank ``layout.rank`` of torchtitan's ``model`` (fake tensors, of the ambient fake
    mode): ``pipeline_module_split`` as ``pipeline_llm`` calls it, each part parallelized (tensor, context
    parallel), a microbatch of ``inputs`` and of the loss's labels each (the activation a stage receives in
    the dtype the stage before computes in: ``precision``, FSDP's param dtype)."""
    from torchtitan.distributed.pipeline_parallel import pipeline_module_split

    from bonsai_core.parallel import cp_positions, parallelize
    from bonsai_core.trace.descriptors import SentOutput
    from bonsai_core.tensors import fake_copy

    names = stage_modules(layout, model.model_args.n_layers)
    mode = torch._guards.detect_fake_mode(inputs)
    stages, parts = pipeline_module_split(model, dims.get_mesh("pp"), TORCH_SCHEDULE[layout.pp_schedule],
                                          inputs[0].device, names)
    parts = [fake_copy(part, mode) for part in parts]  # the split deep-copies into a fake mode of its own
    micro = inputs[0].shape[0] // layout.microbatches
    tokens, labels = inputs[0][:micro], loss_fn.labels[:micro]
    xs, losses, sent = [], [], []
    for stage, part in zip(stages, parts):
        parallelize(part, layout, dims)
        stage_tokens, stage_labels = tokens, labels
        if layout.cp > 1:
            stage_tokens, stage_labels = cp_positions(part, tokens, labels, dims)
        # the hidden state between stages: the sequence sharded by sequence parallel, in the computing dtype
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, next(part.parameters()).dtype)
        hidden = torch.empty(micro, stage_tokens.shape[1] // layout.tp, model.model_args.dim, dtype=dtype)
        xs.append(stage_tokens if stage.is_first else hidden.clone().requires_grad_(True))
        sent.append(hidden)
        losses.append(type(loss_fn)(stage_labels) if stage.is_last else SentOutput())
    return RankStages([s.stage_index for s in stages], parts, xs, losses, [s.is_first for s in stages],
                      [s.is_last for s in stages], micro, sent)


def trace_rank_stages(rank: RankStages, layout: Any, sharding: Any, label: str, step: dict[str, Any]) -> Any:
    """The rank's graph: each stage traced for one microbatch, one after the other, sharded by ``sharding``
    as FSDP under pipeline parallel, with the receive buffers and the ``parallel.pipeline`` field (module doc).
    Returns the :class:`Traced` of the last stage with the rank's graph."""
    from bonsai_core.fsdp import computing_in
    from bonsai_core.parallel import step_context
    from bonsai_core.trace import Traced, trace_step

    graphs, seconds = [], 0.0
    for index, part, x, loss in zip(rank.indices, rank.parts, rank.inputs, rank.losses):
        with step_context(part, layout), computing_in(part, sharding.mixed_precision):
            traced = trace_step(part, (x,), loss, name=f"{label} stage {index}", **step)
        graphs.append(output_held(traced.graph))
        seconds += traced.seconds
    graph = concatenate(graphs, rank.indices, label)
    graph = sharding.shard(graph, Parts(rank.parts)) if sharding.world > 1 else graph
    graph = with_pipeline(graph, layout, rank.indices, [not f for f in rank.first], [not last for last in rank.last],
                          rank.micro)
    # no one program replays a rank's stages (and a stage's export kept to exit corrupts the heap as the
    # fake process group's objects are torn down)
    return Traced(graph, None, [], seconds)


class _Received(torch.autograd.Function):
    """A stage's output handed to the next stage: no value here, and its gradient the one received back."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        ctx.gradient = gradient
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.gradient, None


class RankModel(nn.Module):
    """A pipeline rank's stages as one module, for the one call to lay a plan onto their submodules (it runs
    every stage's forward on its own input; :class:`RankLoss` adds up their losses): its submodules are the
    stages' under the whole model's paths (``tok_embeddings``, ``layers.12``, ``norm``, ``output``)."""

    bonsai_family = "torchtitan"

    def __init__(self, rank: RankStages) -> None:
        super().__init__()
        self.parts = list(rank.parts)  # called, not registered: their submodules are, under their own paths
        for part in rank.parts:
            for name, child in part.named_children():
                if child is None:
                    continue
                if isinstance(child, nn.ModuleDict):
                    merged = self._modules.get(name) or nn.ModuleDict()
                    merged.update(child)
                    self._modules[name] = merged
                else:
                    self._modules[name] = child

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(part(x) for part, x in zip(self.parts, inputs))


class RankLoss(nn.Module):
    """The losses of a rank's stages added up: the last stage's own, and for each stage that sends its output
    on, a zero whose gradient is the one received (:class:`_Received`, a buffer of the output's shape)."""

    def __init__(self, rank: RankStages) -> None:
        super().__init__()
        self.losses = nn.ModuleList([loss for loss, last in zip(rank.losses, rank.last) if last])
        self.last = list(rank.last)
        for k, (sent, last) in enumerate(zip(rank.sent, rank.last)):
            if not last:
                self.register_buffer(f"received_{k}", torch.empty_like(sent))

    def forward(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        total, losses = None, iter(self.losses)
        for k, (out, last) in enumerate(zip(outputs, self.last)):
            term = next(losses)(out) if last else _Received.apply(out, getattr(self, f"received_{k}"))
            total = term if total is None else total + term
        return total


def output_held(graph: Any) -> Any:
    """A stage's graph whose output (the last forward node of its model part: what it sends on, or the logits
    the last stage's loss reads) stays resident to the end of its backward: the stage's ``fwd_cache`` holds it
    from its forward, and ``backward_one_chunk`` until it returns."""
    from bonsai_core.graph import Graph

    data = graph.to_dict()
    out = max((last for _, _, last in graph.modules), default=max(v for v in range(graph.n) if graph.is_forward[v]))
    last = data["nodes"][-1]
    if out not in last["deps"]:
        last["deps"] = sorted({*last["deps"], out})
        last["held"] = sorted({*last.get("held", []), out})
    return Graph.rebuilt(data)


def concatenate(graphs: Sequence[Any], stages: Sequence[int], name: str) -> Any:
    """One graph of ``graphs`` (the rank's stages) one after the other: node ids shifted, names prefixed by
    the stage where there are several, fixed tensors and module calls of each."""
    from bonsai_core.graph import Graph

    if len(graphs) == 1:
        return graphs[0].with_fields(name=name)
    nodes, fixed, modules, offset = [], [], [], 0
    for stage, graph in zip(stages, graphs):
        data = graph.to_dict()
        for nd in data["nodes"]:
            nd = dict(nd)
            nd["id"] = nd["id"] + offset
            nd["name"] = f"s{stage}.{nd['name']}"
            nd["deps"] = [d + offset for d in nd["deps"]]
            for key in ("alias_of", "inplace_of"):
                if nd.get(key) is not None:
                    nd[key] = nd[key] + offset
            if nd.get("held"):
                nd["held"] = [d + offset for d in nd["held"]]
            nodes.append(nd)
        fixed += [[f"s{stage}.{t[0]}", t[1], t[2]] for t in data.get("fixed_tensors", [])]
        modules += [[path, first + offset, last + offset] for path, first, last in data.get("modules", [])]
        offset += graph.n
    return Graph.rebuilt({"format": "bonsai-graph", "version": 1, "name": name, "nodes": nodes,
                            "fixed_mem": sum(g.fixed_mem for g in graphs), "fixed_tensors": fixed,
                            "modules": modules})


def with_pipeline(graph: Any, layout: Any, stages: Sequence[int], receives: Sequence[bool], sends: Sequence[bool],
                  micro: int, name: str | None = None) -> Any:
    """``graph`` (the rank's stages, concatenated) with the ``parallel`` field naming the layout and the
    pipeline: the stages' node spans, the rank's actions; fixed memory gains the receive buffers of the other
    microbatches (one of each microbatch's is the graph's input, or its output's gradient) and, under FSDP,
    every unit's parameters unsharded (to their stage's gradient reduction, rule 11); ``name`` renames it."""
    spans = _spans(graph, len(stages))
    m = layout.microbatches
    extra: list[list[Any]] = []
    fsdp = graph.fsdp
    for k, (stage, (first, last)) in enumerate(zip(stages, spans)):
        inputs = [t for t in graph.fixed_tensors if t[2] == "input" and (len(stages) == 1 or t[0].startswith(f"s{stage}."))]
        if receives[k]:  # the received activation: the stage's floating input
            received = max((t[1] for t in inputs), default=0)
            extra.append([f"s{stage}.received activations (other microbatches)", received * (m - 1), "pipeline"])
        if sends[k]:  # the gradient of its output received back: the output's bytes, for each microbatch
            out_node = max(v for v in range(first, last + 1) if graph.is_forward[v])
            extra.append([f"s{stage}.received gradients", int(graph.mem[graph.storage_of(out_node)]) * m, "pipeline"])
    if graph.fsdp is not None:
        units = sum(u[3] for u in graph.fsdp["units"])
        extra.append([UNSHARDED_TO_REDUCE, units, "fsdp"])
        fsdp = {**graph.fsdp, "reshard_after_forward": False}
    pipeline = {"schedule": layout.pp_schedule, "degree": layout.pp, "rank": layout.rank, "microbatches": m,
                "microbatch_size": micro, "stages": [[s, first, last] for s, (first, last) in zip(stages, spans)],
                "actions": [list(a) for a in actions(layout)]}
    return graph.with_fields(fixed_tensors=[*map(list, graph.fixed_tensors), *extra],
                             fixed_mem=graph.fixed_mem + sum(t[1] for t in extra), fsdp=fsdp,
                             parallel={"layout": layout.to_dict(), "pipeline": pipeline},  # parallel.with_layout's
                             name=graph.name if name is None else name)


def _spans(graph: Any, count: int) -> list[tuple[int, int]]:
    """The node spans of the ``count`` stages concatenated in ``graph`` (by their names' ``s<stage>.`` prefix)."""
    if count == 1:
        return [(0, graph.n - 1)]
    prefixes = [name.split(".", 1)[0] for name in graph.names]
    starts = [0] + [v for v in range(1, graph.n) if prefixes[v] != prefixes[v - 1]]
    ends = starts[1:] + [graph.n]
    return [(a, b - 1) for a, b in zip(starts, ends)]
