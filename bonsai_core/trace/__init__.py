"""Trace a model's training step (forward + loss + backward) into a :class:`Graph`.

The joint graph comes from AOTAutograd (``aot_export_module(..., trace_joint=True)``): functional
aten ops, exactly the kernels eager autograd runs, in execution order. :func:`trace_model` builds
its model under ``FakeTensorMode``, so even GPT-2 small traces without allocating its weights or
activations.

The package: this module holds the entry points (:func:`trace_model`, :func:`trace_step`) and the
AOT export; :mod:`bonsai_core.trace.patches` what tracing changes in eager PyTorch so that the graph
is the step eager runs (dropout, SDPA, grouped matmuls, asserts); :mod:`bonsai_core.trace.to_graph`
how the FX nodes become graph nodes, their phases and the buffer writes. The models themselves come
from :func:`bonsai_core.models.build`, which knows nothing of tracing.

Parameters that get no gradient from the loss (BERT's pooler under the MLM loss) are traced as
frozen: their ``.grad`` stays ``None`` as in eager, so their gradient bytes are not ``fixed_mem``.
:attr:`Traced.frozen_params` names them.

Model code that reads a tensor's value (``.item()``, ``if`` on a tensor) cannot be traced on fake
tensors: it raises a :class:`ModelError` naming the module and the source line. A ``torch._assert``
whose condition is a tensor is only a check, not a branch, so it is skipped while tracing (the
user's own eager run still checks it).

A constructor that reads a tensor's value (``trunc_normal_`` checks ``mask.any()``) is built again
with ``torch.nn.init`` skipped, then on real CPU tensors (:func:`built_for_tracing`). A step whose
forward reads a value is traced again with ``torch.compiler.is_compiling()`` True, so library code
takes its compile-time path (:func:`libraries_compiling`).
"""

from __future__ import annotations

import contextlib
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from bonsai_core.costmodel import DEFAULT_PROFILE, PROFILES
from bonsai_core.errors import ModelError, ValueReadError
from bonsai_core.graph import Graph
from bonsai_core.packed import (PackedLengthsUnknown, batch_sizes_of, known_batch_sizes, spec_batch_sizes,
                                with_batch_sizes_on_demand)
from bonsai_core.trace.patches import (KERNELS, _as_in_eager, _grouped_mm_as_its_kernels, _initialisation_skipped,
                                       autocast_context, device_kernels, libraries_compiling, _quiet_meta_failures)
from bonsai_core.trace.to_graph import IDENTITY_OPS, _placeholder_tensors, _to_graph
from bonsai_core.user_code import DATA_DEPENDENT_ERRORS, user_code

# What torch says when a closure holds a tensor that tracing cannot lift as an input.
_CAPTURED_CONSTANT_SIGNS = ("fake buffer", "_tensor_constant", "convert all Tensors to FakeTensors")
# torch.nn.functional's check that a training-mode batch norm has batch statistics to compute
_ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training"
# an op whose output's shape depends on its input's values (nonzero, masked_select, unique), which the
# user's code called; PyTorch's own value-reading ops whose shapes do not are traced (bonsai_core.ctc)
_SHAPE_FROM_VALUES = ("DynamicOutputShapeException",)
_FIRST_RNN_TRACE = "len(gradients_to_parameters)="


@dataclass
class Traced:
    """A traced step: the graph, plus what the exporter needs to run the FX module again.

    ``buffer_writes`` are the step's buffer mutations in the FX graph's output order: (FX node name
    of the new value, buffer name relative to the traced ``_Step``, e.g. ``model.bn1.running_mean``
    or ``loss_fn.count``); a faithful replay copies each value into its buffer after the step.
    ``frozen_params`` are the model's parameters (names relative to the model) that get no gradient
    from the loss: traced as ``requires_grad=False``, so the FX graph has no gradient output for
    them and their ``.grad`` must stay ``None``.
    ``hidden_aliases`` are unused names of tied parameters that the model reads under another name
    (BERT's ``cls.predictions.bias`` = ``cls.predictions.decoder.bias``): they were left out of the
    traced module's parameters, so the FX graph has no placeholder for them; the parameter itself
    is traced (and gets its gradient) under its other name.
    """

    graph: Graph
    module: fx.GraphModule | None  # None for a compiled step (no one joint FX graph)
    fx_names: list[str]  # FX node name of each graph node
    seconds: float
    buffer_writes: list[tuple[str, str]] = field(default_factory=list)
    frozen_params: list[str] = field(default_factory=list)
    hidden_aliases: list[str] = field(default_factory=list)


class _Step(nn.Module):
    """``model`` followed by ``loss_fn``, returning the loss: the module AOTAutograd traces."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn  # registered as a submodule when it is one, so its buffers are lifted

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.loss_fn(self.model(*inputs)),)


def trace_model(name: str, profile: str = DEFAULT_PROFILE, seed: int = 0, autocast: str | None = None,
                fsdp: int = 1, reshard_after_forward: bool | str | None = None, mixed_precision: str | None = None,
                kernels: str = "cuda", compile: str | None = None, ac: str | None = None, float8: bool = False,
                **options: Any) -> Traced:
    """Build a model spec (:func:`bonsai_core.models.build`: a zoo name, ``hf:...`` or
    ``package.module:factory``) under FakeTensorMode and trace its step;
    with ``fsdp`` > 1, the step as one of that many FSDP ranks holds it (:mod:`bonsai_core.fsdp`), with
    ``mixed_precision`` ("bf16") under FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
    either left None: the model's own setting (:meth:`bonsai_core.fsdp.Sharding.of`: torchtitan's for a
    ``torchtitan:`` model); one rank of a tensor, context or pipeline parallel layout:
    :func:`bonsai_core.rank.trace`. ``kernels``: see :func:`trace_step`. ``compile`` ("model" | "blocks"): the
    step as ``torch.compile`` runs it (:mod:`bonsai_core.trace.compiled`; the Traced then has no FX module),
    with ``ac`` applied before compiling (:data:`bonsai_core.arguments.CHECKPOINTING`) and, with ``float8``,
    torchtitan's Float8 linears (:func:`bonsai_core.trace.compiled.float8_linears`)."""
    from bonsai_core.fsdp import Sharding, computing_in

    sharding = Sharding.of(fsdp, reshard_after_forward, mixed_precision, model=name, ranks="--fsdp ")
    mixed_precision = sharding.mixed_precision
    label = name if not options else name + "(" + ", ".join(f"{k}={v}" for k, v in sorted(options.items())) + ")"
    label += f" autocast {autocast}" if autocast else ""
    label += f" fsdp mixed precision {mixed_precision}" if mixed_precision else ""

    if compile is not None:
        from bonsai_core.trace.compiled import check_checkpointing, check_compile

        check_compile(compile, fsdp)
        check_checkpointing(ac, name)
    elif ac is not None:
        raise ModelError(f"--ac {ac} is applied before torch.compile: give --compile with it (an eager step's "
                         "checkpointing is a method: bonsai solve --method torchtitan-selective).")
    if float8 and (compile is None or not name.startswith("torchtitan:")):
        raise ModelError("--float8 is torchtitan's Float8 linears, which torchtitan runs compiled: give it with a "
                         "torchtitan: model and --compile.")

    def trace() -> Traced:
        with built_for_tracing(name, seed, **options) as (model, inputs, loss_fn):
            with computing_in(model, mixed_precision):
                if compile is None:
                    traced = trace_step(model, inputs, loss_fn, name=label, profile=profile, autocast=autocast,
                                        kernels=kernels)
                else:
                    from bonsai_core.trace.compiled import trace_compiled_step

                    start = time.perf_counter()
                    graph = trace_compiled_step(model, inputs, loss_fn, compile, name=label, profile=profile,
                                                autocast=autocast, checkpointing=ac, float8=float8,
                                                kernels=kernels)
                    traced = Traced(graph, None, [], time.perf_counter() - start)
            traced.graph = sharding.shard(traced.graph, model)
        return traced

    return with_batch_sizes_on_demand(trace, spec_batch_sizes(name, seed, options))


# -- building a model to trace -------------------------------------------------------------------

@contextlib.contextmanager
def built_for_tracing(name: str, seed: int = 0, **options: Any) -> Iterator[tuple[nn.Module, tuple[torch.Tensor, ...], Any]]:
    """Within a ``FakeTensorMode``: the model spec ``name`` built by the first way that works
    (:func:`_build_for_tracing`), yielded as (model, inputs, loss_fn) to trace there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield _build_for_tracing(name, seed, options)


def _build_for_tracing(name: str, seed: int, options: dict[str, Any]) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    """Build under the ambient FakeTensorMode, trying in order: (1) the factory as written, on fake
    tensors; (2) the same with ``torch.nn.init`` skipped, for a constructor that reads a value only
    while initialising weights (``trunc_normal_`` checks ``mask.any()``): fake tensors have no values
    to initialise, and the plan does not depend on them; (3) on real CPU tensors (the weights are
    allocated), for a constructor that reads a value otherwise (``x.item() for x in torch.linspace(...)``).
    Tracing then runs on fake copies of whatever was built. The factory's inputs and loss are built
    as written in each."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from bonsai_core import models

    try:
        return models.build(name, seed=seed, **options)
    except ValueReadError:
        pass
    try:
        with _initialisation_skipped():
            return models.build(name, seed=seed, **options)
    except ValueReadError:
        pass
    with unset_fake_temporarily():
        return models.build(name, seed=seed, **options)


def trace_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
               name: str = "model", profile: str = DEFAULT_PROFILE, autocast: str | None = None,
               kernels: str = "cuda") -> Traced:
    """Trace one training step of ``model`` on ``inputs`` with ``loss_fn`` into a Graph.

    ``autocast`` ("bf16" | "fp16") traces the step under ``torch.autocast``: the graph holds the casts
    and the lower-precision tensors autocast makes. ``kernels`` ("cuda" | "cpu") is the device whose
    dropout and attention-with-dropout kernels the graph records (:mod:`bonsai_core.trace.patches`):
    what a GPU step holds (the CLI's, whatever device traces), or what a CPU step does. A step that
    reads a tensor's value is traced again with libraries on their compile-time path
    (:func:`libraries_compiling`); what still reads one raises :class:`ValueReadError`."""
    try:
        return _trace_step_once(model, inputs, loss_fn, name, profile, autocast, kernels)
    except PackedLengthsUnknown:
        from torch._subclasses.fake_tensor import is_fake

        if any(is_fake(x) for x in inputs) or any(is_fake(p) for p in model.parameters()):
            raise
        with known_batch_sizes(batch_sizes_of(model, inputs, loss_fn)):  # real tensors: read them here
            return _trace_step_once(model, inputs, loss_fn, name, profile, autocast, kernels)
    except ValueReadError:
        with libraries_compiling():
            return _trace_step_once(model, inputs, loss_fn, name, profile, autocast, kernels)


def _trace_step_once(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
                     name: str, profile: str, autocast: str | None, kernels: str = "cuda") -> Traced:
    if profile not in PROFILES:
        raise ModelError(f"Unknown cost model {profile!r}; choose one of: {', '.join(PROFILES)}.")
    if kernels not in KERNELS:
        raise ModelError(f"Unknown kernels {kernels!r}; choose the device whose kernels to record: {', '.join(KERNELS)}.")
    device_type = inputs[0].device.type if inputs else "cpu"
    cast = autocast_context(autocast, device_type)
    start = time.perf_counter()
    step = _Step(model, loss_fn)
    frozen: list[str] = []
    hidden: list[str] = []
    try:
        with cast:
            gm, signature = _export_joint(step, tuple(inputs), name, kernels)
    except _NoGradient:  # rare, and finding the parameters costs a forward trace: only then
        unused = _unused_parameters(step, tuple(inputs), name, kernels)
        try:
            with _without_unused(step, unused) as (frozen, hidden), autocast_context(autocast, device_type):
                gm, signature = _export_joint(step, tuple(inputs), name, kernels)
        except _NoGradient:
            raise ModelError(f"Tracing {name!r} failed: a trainable parameter gets no gradient from the loss "
                             "although the model reads it (through an op without a gradient, such as argmax). "
                             "Set requires_grad=False on it.") from None
    frozen = [n.removeprefix("model.") for n in frozen]
    hidden = [n.removeprefix("model.") for n in hidden]
    graph, fx_names = _to_graph(gm, signature, name, PROFILES[profile], _placeholder_tensors(step, inputs, signature))
    graph = _with_recorded_structure(graph, gm, fx_names, model, tuple(inputs), loss_fn, autocast, kernels)
    writes = [(fx_name, buffer) for fx_name, buffer in signature.buffers_to_mutate.items()]
    return Traced(graph, gm, fx_names, time.perf_counter() - start, writes, frozen, hidden)


def _with_recorded_structure(graph: Graph, gm: fx.GraphModule, fx_names: list[str], model: nn.Module,
                             inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
                             autocast: str | None, kernels: str = "cuda") -> Graph:
    """``graph`` with what one more step on fake tensors shows (:mod:`bonsai_core.modules`): the
    ``modules`` field ([path, first, last] forward node ids of each submodule called once) and each
    node's ``inplace_of`` (the activation eager overwrites with it), from its forward + loss; and deps
    for what eager holds longer than its last read (:func:`_held_by_eager`), from its forward, loss and
    backward pass. Optional structure: a model whose forward cannot run again that way simply gets none;
    one whose backward cannot, no backward holds."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from bonsai_core.modules import held_until, inplace_pairs, module_spans, record_step

    forward, backward = np.flatnonzero(graph.is_forward), np.flatnonzero(~graph.is_forward)
    fake = all(isinstance(x, FakeTensor) for x in inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if not fake else contextlib.nullcontext()
    cast = autocast_context(autocast, inputs[0].device.type if inputs else "cpu")
    step = None
    for with_backward in (True, False):  # the backward pass's lifetimes where eager's backward runs on fakes
        try:
            with mode, cast, _grouped_mm_as_its_kernels(), device_kernels(kernels), _quiet_meta_failures():
                step = record_step(_on_fakes(model, mode, inputs) if with_backward else model, inputs, loss_fn,
                                   with_backward)
            break
        except Exception:  # noqa: BLE001 (any failure only means no module structure)
            continue
    if step is None:
        return graph
    forward_ops = [graph.ops[v] for v in forward]
    data = graph.to_dict()
    modules = [[path, int(forward[a]), int(forward[b])] for path, a, b in module_spans(step, forward_ops)]
    if modules:
        data["modules"] = modules
    fx_nodes = {node.name: node for node in gm.graph.nodes}
    ids = {name: v for v, name in enumerate(fx_names)}
    pairs = [(int(forward[a]), int(forward[b])) for a, b in inplace_pairs(step, forward_ops)]
    order = np.concatenate([forward, backward])
    held = [(_output_node(graph, fx_nodes, fx_names, int(order[a]), k), int(order[b]),
             None if node is None else {int(order[x]) for x in node})
            for a, b, k, node in held_until(step, forward_ops, [graph.ops[v] for v in backward])]
    for v, extra in _held_by_eager(graph, held, {u for _, u in pairs}).items():
        data["nodes"][v]["deps"] = sorted(set(data["nodes"][v]["deps"]) | extra)
        data["nodes"][v]["held"] = sorted(extra)
    graph = Graph.rebuilt(data)
    for v, u in pairs:
        if _runs_in_place(graph, fx_nodes[fx_names[v]], ids, v, u):
            data["nodes"][v]["inplace_of"] = u
    return Graph.rebuilt(data)


def _output_node(graph: Graph, fx_nodes: dict[str, fx.Node], fx_names: list[str], v: int, k: int) -> int:
    """The node holding the ``k``-th output of the op at node ``v``: a separated output of it (a getitem
    node with bytes of its own, ``Graph.output_of``), else ``v``."""
    for x in graph.users(v).tolist():
        if graph.output_of[x] == v and fx_nodes[fx_names[x]].args[1] == k:
            return x
    return v


def _on_fakes(model: nn.Module, mode: Any, inputs: tuple[torch.Tensor, ...]) -> nn.Module:
    """``model`` when its parameters are fake tensors, else a fake copy of it in ``mode`` (or in the fake
    mode of its ``inputs``): a recorded backward pass writes gradients into the model it runs."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    from bonsai_core.tensors import fake_copy

    if all(isinstance(p, FakeTensor) for p in model.parameters()):
        return model
    return fake_copy(model, mode if not isinstance(mode, contextlib.nullcontext) else detect_fake_mode(inputs))


def _held_by_eager(graph: Graph, held: list[tuple[int, int, set[int] | None]], written: set[int]) -> dict[int, set[int]]:
    """Extra deps, by graph node, for the tensors eager keeps beyond the functional graph's last read
    (``held``: (u, w, node), u's storage dropped only after node w ran, as the run of
    :func:`bonsai_core.modules.record_step` saw it): the node at or before w that is no view (nor a
    separated output, ``Graph.output_of``) reads u. A release in the backward pass counts where one of
    u's readers, or a view's (a linear saves its flattened input), is an op of the autograd node that
    released it or, where that node saved u, the forward op that made the node (``node``, graph nodes):
    the node held it (``gather``'s input, which its traced formula reads only for its shape); the
    alignment of eager's ops with the graph's misplaces some where the traced ops are not eager's (a
    recurrent cell written functionally).
    In the forward pass Python holds them: a submodule call's arguments until the call returns, a
    caller's local (``inputs_embeds`` through a whole transformers model), the model's output (logits, a
    key/value cache) until the loss function returns. Invisible where autograd saves those tensors
    anyway, they set the peak of a forward that saves little, such as a frozen backbone's. In the
    backward pass autograd's engine holds them: a backward node's saved tensors and incoming gradient
    until it has computed all its input gradients (a matmul's saved input past the weight gradient that
    last reads it, into the input gradient's matmul), a derivative formula's temporaries until its C++
    expression ends (``div``'s ``-grad * ((self / other) / other)``), the loss and its seed gradient
    through ``loss.backward()``. A parameter gradient (an output) is left alone: its bytes are in
    ``fixed_mem``; so is a tensor another op writes in place (``written``): the writer's output holds its
    bytes."""
    extra: dict[int, set[int]] = {}
    for u, w, node in held:
        readers = _readers(graph, u)
        if u in written or graph.is_output[u] or (node is not None and not node.intersection(readers)):
            continue
        # no view, and no separated output of a multi-output op: a dep more would make it an op of its own
        v = next((x for x in range(w, u, -1) if graph.alias_of[x] < 0 and graph.output_of[x] < 0), -1)
        if v > u and max(readers, default=-1) < v:  # else the graph holds it that long already
            extra.setdefault(v, set()).add(u)
    return extra


def _readers(graph: Graph, u: int) -> set[int]:
    """The nodes reading ``u`` or a view of it: a resident view keeps its base resident, and an autograd
    node that saved the view (a linear's flattened input) holds the base's storage."""
    readers, stack = set(), [u]
    while stack:
        for x in graph.users(stack.pop()).tolist():
            readers.add(x)
            if graph.alias_of[x] >= 0:
                stack.append(x)
    return readers


def _runs_in_place(graph: Graph, node: fx.Node, ids: dict[str, int], v: int, u: int) -> bool:
    """Whether graph node v (FX ``node``) can be recorded as writing u in place, as the export will run
    it: its first argument is u's value (through getitem and identities: a batch norm's output), its op
    has an in-place overload, the two hold the same bytes, and v is u's last reader
    (:meth:`Graph._validate_inplace`)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    first = node.args[0]
    while first.name not in ids and (first.target is operator.getitem or str(first.target) in IDENTITY_OPS):
        first = first.args[0]
    if ids.get(first.name) != u:
        return False
    from bonsai_core.modules import in_place_overload

    return (in_place_overload(target) is not None and graph.alias_of[v] < 0
            and graph.alias_of[u] < 0 and graph.mem[u] == graph.mem[v] > 0 and int(graph.users(u)[-1]) == v)


# -- tracing -------------------------------------------------------------------------------------

class _NoGradient(Exception):
    """AOTAutograd refused a trainable parameter that the loss gives no gradient."""


def _export_joint(step: _Step, inputs: tuple[torch.Tensor, ...], name: str, kernels: str = "cuda") -> tuple[fx.GraphModule, Any]:
    """``aot_export_module`` of the joint step (with DTensor parameters, or as a pipeline stage, the export
    with descriptors: :mod:`bonsai_core.trace.descriptors`), with torch's failures turned into advice."""
    from torch._functorch.aot_autograd import aot_export_module

    from bonsai_core.trace.descriptors import export_joint, needs_descriptors

    with _quiet_meta_failures() as failures:
        try:
            with _as_in_eager(kernels):
                if needs_descriptors(step):
                    return export_joint(step, inputs)
                try:
                    return aot_export_module(step, inputs, trace_joint=True, output_loss_index=0)
                except AssertionError as e:
                    if _FIRST_RNN_TRACE not in str(e):
                        raise
                    # torch 2.13: the first joint trace of a recurrent layer (nn.LSTM) in a process
                    # miscounts its gradient outputs; the same trace again is right
                    return aot_export_module(step, inputs, trace_joint=True, output_loss_index=0)
        except PackedLengthsUnknown:
            raise
        except Exception as e:  # torch raises many types here; the user needs the message, not the stack
            if "did not receive a gradient" in str(e):
                raise _NoGradient() from None
            raise _model_error(e, step, name, failures.ops) from None


def _model_error(e: Exception, step: _Step, name: str, failed_ops: Sequence[str] = ()) -> ModelError:
    """The ModelError for a failed trace. ``failed_ops``: the ops whose shape function (meta kernel)
    raised, as fake tensors logged them (:class:`_MetaFailures`)."""
    if any(sign in str(e) for sign in _CAPTURED_CONSTANT_SIGNS):
        return ModelError("The loss function (or model) captures tensors, such as targets, as constants. "
                          "Make loss_fn an nn.Module that holds them as buffers, like "
                          "bonsai_core.models.zoo.CrossEntropyLoss.")
    if type(e).__name__ in _SHAPE_FROM_VALUES:
        return ValueReadError(f"Tracing {name!r} failed: {user_code(e, step)} runs {str(e).splitlines()[0]}, whose "
                              "output's shape depends on its input's values (how many elements are nonzero, "
                              "selected or unique), which tracing, on shapes only, does not know. Give that "
                              "output a fixed shape: a mask multiplied in or `torch.where` instead of boolean "
                              "indexing or `masked_select`, `torch.nonzero_static(x, size=N)`, "
                              "`F.one_hot(x, num_classes=N)`, `repeat_interleave(..., output_size=N)`.")
    if type(e).__name__ in DATA_DEPENDENT_ERRORS:
        return ValueReadError(f"Tracing {name!r} failed: {user_code(e, step)} reads a tensor's value "
                          f"({str(e).splitlines()[0]}): `.item()`, `int()`/`bool()` of a tensor, or an `if` on "
                          "one. Tracing runs on shapes only, so no value is known there. Make the code "
                          "independent of tensor values (`torch.where` instead of an `if`, checks on "
                          "`x.shape` instead of on tensor contents, `.item()` calls moved out of forward).")
    first_line = (str(e).strip().splitlines() or [""])[0]
    if _ONE_VALUE_PER_CHANNEL in first_line:  # a step that fails in eager too, with a known remedy
        return ModelError(f"Tracing {name!r} failed in {user_code(e, step)}: a batch norm in training mode needs "
                          f"more than one value per channel to compute its batch statistics ({first_line}). "
                          "Trace with a larger batch (`--batch 2` or more; the batch field on the explorer's "
                          "Model page) or larger inputs.")
    if failed_ops:
        return ModelError(f"Tracing {name!r} failed: {user_code(e, step)} runs {failed_ops[-1]}, whose shape "
                          f"function (what tracing runs instead of the kernel) refuses its inputs "
                          f"({type(e).__name__}: {first_line}). If the step runs in eager, that shape function "
                          "is stricter than the kernel: another dtype or implementation of that layer may trace.")
    return ModelError(f"Tracing {name!r} failed in {user_code(e, step)} ({type(e).__name__}): {e}")




def _unused_parameters(step: _Step, inputs: tuple[torch.Tensor, ...], name: str, kernels: str = "cuda") -> list[str]:
    """Names (in ``step``) of the parameters the forward pass never reads: the placeholders without
    users in the forward-only graph. Each gets no gradient."""
    from torch._functorch.aot_autograd import aot_export_module

    with _quiet_meta_failures() as failures:
        try:
            with _as_in_eager(kernels):
                gm, signature = aot_export_module(step, inputs, trace_joint=False)
        except Exception as e:  # the same failures as the joint trace, said the same way
            raise _model_error(e, step, name, failures.ops) from None
    unused = {n.name for n in gm.graph.nodes if n.op == "placeholder" and not n.users}
    return [p for ph, p in signature.inputs_to_parameters.items() if ph in unused]


@contextlib.contextmanager
def _without_unused(step: _Step, unused: list[str]) -> Iterator[tuple[list[str], list[str]]]:
    """Trace ``step`` with its unused parameters out of the way, yielding (frozen, hidden): a
    parameter no name of which is read is frozen (``requires_grad=False``), and an unused name of a
    tied parameter that is read under another name (BERT's ``cls.predictions.bias``, tied to
    ``decoder.bias``) is hidden from ``named_parameters`` (AOTAutograd lists every name of a tied
    parameter and refuses a name that gets no gradient). Everything is put back afterwards."""
    names_of: dict[int, list[str]] = {}
    for n, p in step.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(n)
    owners = dict(step.named_modules(remove_duplicate=False))
    params = dict(step.named_parameters(remove_duplicate=False))
    frozen = [n for n in unused if all(alias in unused for alias in names_of[id(params[n])]) and params[n].requires_grad]
    hidden = [n for n in unused if n not in frozen and params[n].requires_grad]
    frozen = list(dict.fromkeys(names_of[id(params[n])][0] for n in frozen))  # a tied parameter once
    saved = {}
    for n in hidden:
        module_name, _, attr = n.rpartition(".")
        module = owners[module_name]
        saved.setdefault(module_name, dict(module._parameters))
        del module._parameters[attr]
        module.__dict__[attr] = params[n]  # still readable as an attribute, no longer a named parameter
    for n in frozen:
        params[n].requires_grad_(False)
    try:
        yield frozen, hidden
    finally:
        for n in frozen:
            params[n].requires_grad_(True)
        for module_name, original in saved.items():
            module = owners[module_name]
            for attr in original:
                module.__dict__.pop(attr, None)
            module._parameters.clear()
            module._parameters.update(original)  # same order as before: the exporter's signature

