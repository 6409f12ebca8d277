"""Trace a model's training step (forward + loss + backward) into a :class:`Graph`.

The joint graph comes from AOTAutograd (``aot_export_module(..., trace_joint=True)``): functional
aten ops, exactly the kernels eager autograd runs, in execution order. Zoo models are built under
``FakeTensorMode``, so even GPT-2 small traces without allocating its weights or activations.

How FX nodes become graph nodes:

* placeholders (parameters, buffers, the batch) are not nodes: their bytes, and those of the
  parameter gradients, are ``fixed_mem``. Views of them are not nodes either.
* ``getitem`` of a multi-output op is that op's node (its ``mem`` is all outputs added up), except,
  for forward ops, the used outputs after the first that are at most a quarter of its size (batch
  norm's statistics, dropout's mask): each is a node of its own (op ``getitem``, ``deps`` = the op's
  node, ``mem`` its bytes, a nanosecond of ``cost``), so the big output dies when eager frees it.
* ``detach`` / ``alias`` are identities and fold into their input.
* other views (``view``, ``t``, ``transpose``, ``split``, ``_unsafe_view``, ...) are view nodes: ``alias_of`` their
  base, ``mem`` 0, ``cost`` 0.
* every other op is a compute node whose ``mem`` is its outputs' storage bytes and whose ``cost``
  comes from a roofline of FLOPs (``torch.utils.flop_counter``) and bytes moved on a device profile.
* nodes that no output needs are dropped.

Phases: a node is ``forward`` if eager runs it in the forward pass: it comes no later than the loss
in execution order, or a buffer update (below) needs it. The rest is ``backward``. The loss is the
step's user output (``signature.user_outputs``), not ``backward_signature.loss_output``, which
counts the mutated buffers among the outputs and so names a BatchNorm statistic when there is one.

BatchNorm and other buffer mutations: AOTAutograd returns each mutated buffer's new value (running
mean / var, ``num_batches_tracked``) as an extra graph output. Eager writes them into the buffers in
place, and the buffers are already ``fixed_mem``, so those outputs add no bytes to their node: a
batch norm node's ``mem`` is its output and saved statistics only, and the ``num_batches_tracked + 1``
node has ``mem`` 0. :attr:`Traced.buffer_writes` lists them for the exporter, which must copy them
back into the module's buffers.

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
takes its compile-time path (:func:`_libraries_compiling`).

A dropout that drops nothing (``p == 0``, as in Llama's and ViT's configs, or not training) returns
its input in eager PyTorch; AOTAutograd's decomposition would record a ``clone`` that eager never
makes, so while tracing such a dropout returns its input and the graph has no node for it.

``F.scaled_dot_product_attention`` with dropout has no fused kernel on the CPU (eager there runs its
math path, keeping ``seq x seq`` probabilities and a mask per head); a GPU runs a fused one. While
tracing, such a call is recorded as the memory-efficient attention kernel, which keeps the output,
the logsumexp and the generator's seed and offset (:mod:`bonsai_core.attention`), so the plan is made
for what a GPU step holds; the exported program runs that kernel on CUDA and its equivalent on the CPU.

A grouped matmul (``aten._grouped_mm``, how transformers' mixture-of-experts layers run their experts)
in float32 or float16 gets the shapes its kernels give it, where torch's own shape function refuses
all but bfloat16 (:func:`_grouped_mm_as_its_kernels`). When an op's shape function fails, fake
tensors log it with a traceback before the error reaches bonsai: while tracing those records are
dropped and the op is named in the :class:`ModelError` instead.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from bonsai_core.attention import FusedAttentionWithDropout
from bonsai_core.costmodel import DEFAULT_PROFILE, PROFILES, DeviceProfile, op_cost
from bonsai_core.errors import ModelError, ValueReadError
from bonsai_core.graph import Graph
from bonsai_core.tensors import storage_bytes, tensors_in



# What torch says when a closure holds a tensor that tracing cannot lift as an input.
_CAPTURED_CONSTANT_SIGNS = ("fake buffer", "_tensor_constant", "convert all Tensors to FakeTensors")
# What torch raises when Python code needs a tensor's value (which fake tensors do not have).
DATA_DEPENDENT_ERRORS = ("DataDependentOutputException", "GuardOnDataDependentSymNode",
                          "DynamicOutputShapeException", "UnsupportedOperatorException")
# torch.nn.functional's check that a training-mode batch norm has batch statistics to compute
_ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training"
_FIRST_RNN_TRACE = "len(gradients_to_parameters)="
_UNMARKED_VIEWS = {"aten._unsafe_view.default"}  # views whose schema does not say so
_IDENTITY_OPS = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default"}
_TORCH_DIR = os.path.dirname(torch.__file__)
_BONSAI_DIR = os.path.dirname(__file__)
_ZOO_FILE = os.path.join(_BONSAI_DIR, "zoo.py")


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
    module: fx.GraphModule
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


def trace_zoo(name: str, profile: str = DEFAULT_PROFILE, seed: int = 0, autocast: str | None = None,
              fsdp: int = 1, reshard_after_forward: bool = True, **options: Any) -> Traced:
    """Build a zoo model (or ``package.module:factory``) under FakeTensorMode and trace its step;
    with ``fsdp`` > 1, the step as one of that many FSDP ranks holds it (:mod:`bonsai_core.fsdp`)."""
    label = name if not options else name + "(" + ", ".join(f"{k}={v}" for k, v in sorted(options.items())) + ")"
    label += f" autocast {autocast}" if autocast else ""
    with built_for_tracing(name, seed, **options) as (model, inputs, loss_fn):
        traced = trace_step(model, inputs, loss_fn, name=label, profile=profile, autocast=autocast)
        if fsdp > 1:
            from bonsai_core.fsdp import shard_by_blocks

            traced.graph = shard_by_blocks(traced.graph, model, fsdp, reshard_after_forward)
    return traced


# -- building a model to trace -------------------------------------------------------------------

@contextlib.contextmanager
def built_for_tracing(name: str, seed: int = 0, **options: Any) -> Iterator[tuple[nn.Module, tuple[torch.Tensor, ...], Any]]:
    """Within a ``FakeTensorMode``: the zoo model or factory ``name`` built by the first way that works
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

    from bonsai_core import zoo

    try:
        return zoo.build(name, seed=seed, **options)
    except ValueReadError:
        pass
    try:
        with _initialisation_skipped():
            return zoo.build(name, seed=seed, **options)
    except ValueReadError:
        pass
    with unset_fake_temporarily():
        return zoo.build(name, seed=seed, **options)


# torch.nn.init's in-place initialisers: the public ones, and the helpers they call by name (which also
# catches libraries that keep their own references to the public ones, as transformers does).
_INIT_HELPERS = ("_no_grad_uniform_", "_no_grad_normal_", "_no_grad_trunc_normal_", "_no_grad_fill_", "_no_grad_zero_")


@contextlib.contextmanager
def _initialisation_skipped() -> Iterator[None]:
    """Within: every ``torch.nn.init`` initialiser returns its tensor untouched."""
    def untouched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    names = [n for n in (*_INIT_HELPERS, *getattr(nn.init, "__all__", ()))
             if n.endswith("_") and callable(getattr(nn.init, n, None))]
    with contextlib.ExitStack() as stack:
        for n in names:
            stack.enter_context(_in_this_thread(nn.init, n, untouched))
        yield


_thread_patches: dict[tuple[int, str], list[Any]] = {}  # (owner, attr) -> [original, active, users]
_thread_patches_lock = threading.Lock()


@contextlib.contextmanager
def _in_this_thread(owner: Any, attr: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Within: ``owner.attr(...)`` calls ``replacement`` in this thread only: traces run in threads of
    the explorer, and another thread's trace must keep the original. While any thread is within, a
    dispatcher stands in for the original; the last one out puts the original back."""
    key = (id(owner), attr)
    with _thread_patches_lock:
        if key not in _thread_patches:
            original, active = getattr(owner, attr), threading.local()

            @functools.wraps(original)
            def dispatch(*args: Any, **kwargs: Any) -> Any:
                return (getattr(active, "function", None) or original)(*args, **kwargs)

            _thread_patches[key] = [original, active, 0]
            setattr(owner, attr, dispatch)
        entry = _thread_patches[key]
        entry[2] += 1
    active = entry[1]
    previous = getattr(active, "function", None)
    active.function = replacement
    try:
        yield
    finally:
        active.function = previous
        with _thread_patches_lock:
            entry[2] -= 1
            if entry[2] == 0:
                setattr(owner, attr, entry[0])
                del _thread_patches[key]


def trace_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
               name: str = "model", profile: str = DEFAULT_PROFILE, autocast: str | None = None) -> Traced:
    """Trace one training step of ``model`` on ``inputs`` with ``loss_fn`` into a Graph.

    ``autocast`` ("bf16" | "fp16") traces the step under ``torch.autocast``: the graph holds the casts
    and the lower-precision tensors autocast makes. A step that reads a tensor's value is traced
    again with libraries on their compile-time path (:func:`_libraries_compiling`); what still reads
    one raises :class:`ValueReadError`."""
    try:
        return _trace_step_once(model, inputs, loss_fn, name, profile, autocast)
    except ValueReadError:
        with _libraries_compiling():
            return _trace_step_once(model, inputs, loss_fn, name, profile, autocast)


def _trace_step_once(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
                     name: str, profile: str, autocast: str | None) -> Traced:
    if profile not in PROFILES:
        raise ModelError(f"Unknown cost model {profile!r}; choose one of: {', '.join(PROFILES)}.")
    device_type = inputs[0].device.type if inputs else "cpu"
    cast = _autocast(autocast, device_type)
    start = time.perf_counter()
    step = _Step(model, loss_fn)
    frozen: list[str] = []
    hidden: list[str] = []
    try:
        with cast:
            gm, signature = _export_joint(step, tuple(inputs), name)
    except _NoGradient:  # rare, and finding the parameters costs a forward trace: only then
        unused = _unused_parameters(step, tuple(inputs), name)
        try:
            with _without_unused(step, unused) as (frozen, hidden), _autocast(autocast, device_type):
                gm, signature = _export_joint(step, tuple(inputs), name)
        except _NoGradient:
            raise ModelError(f"Tracing {name!r} failed: a trainable parameter gets no gradient from the loss "
                             "although the model reads it (through an op without a gradient, such as argmax). "
                             "Set requires_grad=False on it.") from None
    frozen = [n.removeprefix("model.") for n in frozen]
    hidden = [n.removeprefix("model.") for n in hidden]
    graph, fx_names = _to_graph(gm, signature, name, PROFILES[profile], _placeholder_tensors(step, inputs, signature))
    modules = _module_spans(model, tuple(inputs), loss_fn, graph, autocast)
    if modules:
        graph = Graph.from_dict({**graph.to_dict(), "modules": modules})
    writes = [(fx_name, buffer) for fx_name, buffer in signature.buffers_to_mutate.items()]
    return Traced(graph, gm, fx_names, time.perf_counter() - start, writes, frozen, hidden)


def _module_spans(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
                  graph: Graph, autocast: str | None) -> list[list[Any]]:
    """The graph's ``modules`` field: [path, first, last] forward node ids of each submodule called once
    (:mod:`bonsai_core.modules`), from one more forward + loss on fake tensors. Optional structure:
    a model whose forward cannot run again that way simply gets none."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from bonsai_core.modules import module_spans, record_step

    forward = np.flatnonzero(graph.is_forward)
    fake = all(isinstance(x, FakeTensor) for x in inputs)
    cast = _autocast(autocast, inputs[0].device.type if inputs else "cpu")
    try:
        with contextlib.nullcontext() if fake else FakeTensorMode(allow_non_fake_inputs=True), cast, \
                _grouped_mm_as_its_kernels(), FusedAttentionWithDropout(), _quiet_meta_failures():
            step = record_step(model, inputs, loss_fn)
    except Exception:  # noqa: BLE001 (any failure only means no module structure)
        return []
    return [[path, int(forward[a]), int(forward[b])] for path, a, b in module_spans(step, [graph.ops[v] for v in forward])]


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _autocast(autocast: str | None, device_type: str = "cpu") -> Any:
    """``torch.autocast`` for the device the step is traced on (fake tensors of the inputs' device)."""
    if autocast is None:
        return contextlib.nullcontext()
    if autocast not in AUTOCAST:
        raise ModelError(f"Unknown autocast {autocast!r}; choose one of: {', '.join(AUTOCAST)}.")
    return torch.autocast(device_type=device_type, dtype=AUTOCAST[autocast])


# -- tracing -------------------------------------------------------------------------------------

class _NoGradient(Exception):
    """AOTAutograd refused a trainable parameter that the loss gives no gradient."""


def _export_joint(step: _Step, inputs: tuple[torch.Tensor, ...], name: str) -> tuple[fx.GraphModule, Any]:
    """``aot_export_module`` of the joint step, with torch's failures turned into advice."""
    from torch._functorch.aot_autograd import aot_export_module

    with _quiet_meta_failures() as failures:
        try:
            with _as_in_eager():
                try:
                    return aot_export_module(step, inputs, trace_joint=True, output_loss_index=0)
                except AssertionError as e:
                    if _FIRST_RNN_TRACE not in str(e):
                        raise
                    # torch 2.13: the first joint trace of a recurrent layer (nn.LSTM) in a process
                    # miscounts its gradient outputs; the same trace again is right
                    return aot_export_module(step, inputs, trace_joint=True, output_loss_index=0)
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
                          "bonsai_core.zoo.CrossEntropyLoss.")
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


def user_code(e: BaseException, root: nn.Module | None = None) -> str:
    """'module NAME (Class) at FILE:LINE `code`' for the innermost frame of e in model code: outside
    torch and bonsai's own machinery (the zoo's models count as model code). NAME: the module's path
    in ``root`` (without a root, as while a factory builds the model: 'module Class at ...')."""
    frames = [(f, tb_line) for f, tb_line in traceback.walk_tb(e.__traceback__)
              if not f.f_code.co_filename.startswith(_TORCH_DIR)
              and (not f.f_code.co_filename.startswith(_BONSAI_DIR) or f.f_code.co_filename == _ZOO_FILE)]
    if not frames:
        return "model code"
    frame, line = frames[-1]
    summary = traceback.FrameSummary(frame.f_code.co_filename, line, frame.f_code.co_name)
    where = f"{summary.filename}:{line} `{(summary.line or '').strip()}`"
    owner = frame.f_locals.get("self")
    if isinstance(owner, nn.Module) and root is None:
        return f"module {type(owner).__name__} at {where}"
    if isinstance(owner, nn.Module):
        path = next((n for n, m in root.named_modules() if m is owner), "")
        label = ("" if path == "model" else path.removeprefix("model.")) or "(the model itself)"
        return f"module {label} ({type(owner).__name__}) at {where}"
    return f"{frame.f_code.co_name} at {where}"


class _EagerDropoutOff(TorchFunctionMode):
    """A dropout that drops nothing (``p == 0``, or not training) returns its input itself in eager
    PyTorch: no kernel, no new tensor. AOTAutograd's decomposition of ``aten.dropout`` records a
    ``clone`` there instead (a copy, to keep outputs from aliasing inputs), which would count a copy
    of every such activation that eager never makes: Hugging Face Llama's attention dropout
    (``attention_dropout`` 0.0) doubled each layer's attention probabilities. While tracing, such a
    dropout returns its input, as in eager, so the graph (and the program exported from it) has no
    node for it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            call = _DROPOUTS[func].bind(*args, **kwargs)
            call.apply_defaults()
            tensor, p, training = call.args[:3]
            if p == 0 or not training:
                return tensor
        return func(*args, **kwargs)


# The dropouts whose eager kernel returns its input when p == 0 or not training (ATen's
# ``_dropout_impl``), with their signatures (input, p, training, ...): torch.nn.functional's, which
# call the torch.* ones, and the torch.* ones for code that calls them directly.
_DROPOUTS = {f: inspect.signature(f) for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
                                                 F.alpha_dropout, F.feature_alpha_dropout)}
_DROPOUTS.update({f: inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                        for n in ("input", "p", "train")])
                  for f in (torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout)})


@contextlib.contextmanager
def _as_in_eager() -> Iterator[None]:
    """What tracing changes so that the graph is the step eager runs: no copy for a dropout that
    drops nothing, ``torch._assert`` on tensors skipped, float32/float16 grouped matmuls shaped
    as their kernels shape them, and SDPA with dropout recorded as the fused kernel a GPU runs, not
    the CPU's math path (:mod:`bonsai_core.attention`)."""
    with _skip_tensor_asserts(), _EagerDropoutOff(), _grouped_mm_as_its_kernels(), FusedAttentionWithDropout():
        yield


@contextlib.contextmanager
def _libraries_compiling() -> Iterator[None]:
    """Within: ``torch.compiler.is_compiling()`` is True, as under ``torch.compile``/``torch.export``.
    Libraries ask it to skip code that reads tensor values when traced: transformers' causal mask
    checks whether the positions of a call without an attention mask are packed sequences
    (``(mask == 0).all()``) unless compiling, and then builds the mask from those positions instead.
    Only for a step that reads a value otherwise: the compile-time path may run other kernels than
    eager (transformers' mixture-of-experts layers do), and the graph is to be eager's."""
    with _in_this_thread(torch.compiler, "is_compiling", lambda: True):
        yield


# Mixture-of-experts layers of transformers 5 (Mixtral, Qwen-MoE, ...) run their experts, by default
# (``experts_implementation="grouped_mm"``), as ``torch.nn.functional.grouped_mm``: ``aten._grouped_mm``
# over the tokens sorted by expert, one matmul per expert's rows, every shape static. Its kernels
# (CPU, and CUDA's fallback path) take float16, bfloat16 and float32, but the shape function fake
# tensors run, ``torch._meta_registrations._meta_grouped_mm_common`` (torch 2.13), still refuses all
# but bfloat16 ("Expected inputs of BF16 type"), so a float32 Mixtral that trains in eager did not
# trace. While tracing, float16/float32 calls get the kernels' checks (one dtype, 2D/3D operands,
# 16-byte strides, int32 offsets, no bias) and torch's own output tensor: the shape, dtype and strides
# eager makes. bfloat16 and the scaled (FP8) variant keep torch's shape function.
_GROUPED_MM_DTYPES = (torch.float16, torch.float32)
_grouped_mm_lock = threading.Lock()
_grouped_mm_state: dict[str, Any] = {"users": 0, "original": None}  # traces in threads share one patch


@contextlib.contextmanager
def _grouped_mm_as_its_kernels() -> Iterator[None]:
    """Within: ``aten._grouped_mm`` on float16/float32 fake tensors gets its kernels' shapes."""
    from torch import _meta_registrations as meta

    if not (callable(getattr(meta, "_meta_grouped_mm_common", None))
            and callable(getattr(meta, "_create_grouped_mm_output_tensor", None))):
        yield  # another torch: its own shape function
        return
    with _grouped_mm_lock:
        if _grouped_mm_state["users"] == 0:
            original = _grouped_mm_state["original"] = meta._meta_grouped_mm_common
            meta._meta_grouped_mm_common = lambda *args, **kwargs: _grouped_mm_meta(original, *args, **kwargs)
        _grouped_mm_state["users"] += 1
    try:
        yield
    finally:
        with _grouped_mm_lock:
            _grouped_mm_state["users"] -= 1
            if _grouped_mm_state["users"] == 0:
                meta._meta_grouped_mm_common = _grouped_mm_state["original"]


def _grouped_mm_meta(original: Callable[..., torch.Tensor], mat_a: torch.Tensor, mat_b: torch.Tensor,
                     scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
                     offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     scale_result: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     use_fast_accum: bool = False) -> torch.Tensor:
    """``_meta_grouped_mm_common`` (same arguments) that takes float16/float32 as the kernels do."""
    if scale_a is not None or scale_b is not None or mat_a.dtype not in _GROUPED_MM_DTYPES:
        return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    torch._check(mat_b.dtype == mat_a.dtype and out_dtype in (None, mat_a.dtype),
                 lambda: f"grouped_mm needs one dtype: mat_a {mat_a.dtype}, mat_b {mat_b.dtype}, out_dtype {out_dtype}")
    for label, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        torch._check(mat.dim() in (2, 3), lambda: f"grouped_mm: {label} must be 2D or 3D, got {mat.dim()}D")
        stride, size = mat.stride(), mat.shape
        lead = stride[-1] if stride[-2] == 1 and stride[-1] >= max(1, size[-2]) else \
            stride[-2] if stride[-1] == 1 and stride[-2] >= max(1, size[-1]) else None
        torch._check(lead is not None,
                     lambda: f"grouped_mm: invalid strides {stride} for sizes {tuple(size)} of {label}")
        torch._check(lead * mat.element_size() % 16 == 0,
                     lambda: f"grouped_mm: {label}'s strides {stride} are not multiples of 16 bytes")
    if mat_a.dim() == 3 or mat_b.dim() == 3:  # (2D x 2D groups along the contraction dimension)
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "grouped_mm: contraction dimensions differ")
    if mat_a.dim() == 2 or mat_b.dim() == 2:
        torch._check(offs is not None and offs.dim() == 1 and offs.dtype == torch.int32,
                     lambda: "grouped_mm: a 2D operand needs 1D int32 offsets")
    else:
        torch._check(offs is None, lambda: "grouped_mm: 3D operands take no offsets")
    torch._check(bias is None, lambda: "grouped_mm: bias is not supported")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


# Fake tensors log every op whose shape function raises, with its traceback, before re-raising: a
# screenful per failure (the CLI showed it above its one-line error). The error itself reaches bonsai.
_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")
_META_FAILED = "failed while attempting to run meta for %s"


class _MetaFailures(logging.Filter):
    """Drops the current thread's "failed while attempting to run meta for OP" records and keeps OP."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.ops: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _META_FAILED and record.thread == self.thread:
            self.ops.append(str(record.args[0]) if isinstance(record.args, tuple) and record.args else "an op")
            return False
        return True


@contextlib.contextmanager
def _quiet_meta_failures() -> Iterator[_MetaFailures]:
    """Within: failed shape functions are not logged; the filter yielded lists their ops."""
    failures = _MetaFailures()
    _FAKE_TENSOR_LOG.addFilter(failures)
    try:
        yield failures
    finally:
        _FAKE_TENSOR_LOG.removeFilter(failures)


@contextlib.contextmanager
def _skip_tensor_asserts() -> Iterator[None]:
    """``torch._assert`` on a tensor condition is a check, not a branch: skip it while tracing
    (fake tensors have no value to check), keep every other assert."""
    real_assert = torch._assert

    def traced_assert(condition: Any, message: str) -> None:
        if not isinstance(condition, torch.Tensor):
            real_assert(condition, message)

    with mock.patch.object(torch, "_assert", traced_assert):
        yield


def _unused_parameters(step: _Step, inputs: tuple[torch.Tensor, ...], name: str) -> list[str]:
    """Names (in ``step``) of the parameters the forward pass never reads: the placeholders without
    users in the forward-only graph. Each gets no gradient."""
    from torch._functorch.aot_autograd import aot_export_module

    with _quiet_meta_failures() as failures:
        try:
            with _as_in_eager():
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


# -- FX -> Graph ---------------------------------------------------------------------------------

_LEAF = -1  # a placeholder, or a view of one: part of fixed_mem, not a node
_ALL = -1  # every output of an op (a single-output op whose value is a buffer's new value)
# Cost of a node that takes one output of a multi-output op: no kernel runs, but the format wants
# every non-view node to cost something, so a nanosecond of bookkeeping.
_GETITEM_COST = 1e-9


def _placeholder_tensors(step: _Step, inputs: tuple[torch.Tensor, ...], signature: Any) -> dict[str, torch.Tensor]:
    """The tensor each placeholder was traced from (parameter, buffer or batch tensor): their storages
    say which placeholders share memory (AOTAutograd's fake copies of real tensors do not keep that)."""
    named = {**dict(step.named_parameters(remove_duplicate=False)), **dict(step.named_buffers(remove_duplicate=False))}
    tensors = {ph: named[n] for ph, n in {**signature.inputs_to_parameters, **signature.inputs_to_buffers}.items() if n in named}
    tensors.update((ph, t) for ph, t in zip(signature.user_inputs, inputs) if isinstance(t, torch.Tensor))
    return tensors


def _to_graph(gm: fx.GraphModule, signature: Any, name: str, profile: DeviceProfile,
              originals: dict[str, torch.Tensor]) -> tuple[Graph, list[str]]:
    fx_nodes = list(gm.graph.nodes)
    forward = _forward_nodes(fx_nodes, signature)
    written = _buffer_outputs(fx_nodes, signature)
    fixed_tensors = _fixed_tensors(gm, signature, originals)
    ids: dict[fx.Node, int] = {}  # FX node -> our node id, or _LEAF
    nodes: list[dict[str, Any]] = []
    fx_names: list[str] = []
    outputs: list[int] = []
    split: dict[fx.Node, set[int]] = {}  # multi-output op -> outputs that are nodes of their own

    def add(node: fx.Node, op: str, deps: list[int], alias_of: int | None, mem: int, cost: float) -> None:
        computed_by = node.args[0] if node.target is operator.getitem else node  # an output's phase is its op's
        phase = "forward" if computed_by in forward else "backward"
        nodes.append({"name": node.name, "op": op, "phase": phase, "deps": deps, "alias_of": alias_of,
                      "mem": mem, "cost": cost, "shape": _shape_str(node.meta.get("val"))})
        fx_names.append(node.name)
        ids[node] = len(nodes) - 1

    for node in fx_nodes:
        if node.op in ("placeholder", "get_attr"):
            ids[node] = _LEAF
            continue
        if node.op == "output":
            outputs = [ids[a] for a in tree_flatten(node.args)[0] if isinstance(a, fx.Node) and ids[a] != _LEAF]
            continue
        if node.target is operator.getitem:
            op_node, index = node.args
            if index in split.get(op_node, ()):
                mem = 0 if index in written.get(op_node, ()) else storage_bytes(op_node.meta["val"][index])
                add(node, "getitem", [ids[op_node]], None, mem, _GETITEM_COST)
            else:
                ids[node] = ids[op_node]
            continue
        op = str(node.target)
        inputs = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
        base = _view_base(node, inputs)
        deps = sorted({ids[a] for a in inputs if ids[a] != _LEAF})
        if op in _IDENTITY_OPS and inputs:
            ids[node] = ids[inputs[0]]
        elif base is not None and ids[base] == _LEAF:
            ids[node] = _LEAF
        elif base is not None:
            add(node, op, deps, ids[base], 0, 0.0)
        else:
            split[node] = _separate_outputs(node) if node in forward else set()
            add(node, op, deps, None, _output_bytes(node, written.get(node, set()) | split[node]), _cost(node, profile))
    return _prune(name, fixed_tensors, nodes, fx_names, outputs)


def _loss_node(fx_nodes: list[fx.Node], signature: Any) -> fx.Node:
    """The loss: the step's one user output. (``backward_signature.loss_output`` indexes all outputs,
    mutated buffers first, so with a batch norm it names a running statistic.)"""
    (loss_name,) = signature.user_outputs
    return next(n for n in fx_nodes if n.name == loss_name)


def _forward_nodes(fx_nodes: list[fx.Node], signature: Any) -> set[fx.Node]:
    """The FX nodes eager runs in the forward pass: those up to the loss in execution order, and
    whatever computes a buffer's new value (in case a loss module updates a buffer after the loss)."""
    loss = _loss_node(fx_nodes, signature)
    forward = set(fx_nodes[:fx_nodes.index(loss) + 1])
    by_name = {n.name: n for n in fx_nodes}
    stack = [by_name[fx_name] for fx_name in signature.buffers_to_mutate]
    while stack:
        n = stack.pop()
        if n not in forward:
            forward.add(n)
            stack.extend(n.all_input_nodes)
    return forward


def _buffer_outputs(fx_nodes: list[fx.Node], signature: Any) -> dict[fx.Node, set[int]]:
    """For each op, which of its outputs are a buffer's new value (``_ALL`` for a single output).

    Eager writes these into the buffer in place (``running_mean.mul_(...).add_(...)``), and the buffer
    is fixed_mem already, so they add no bytes to their op's node."""
    by_name = {n.name: n for n in fx_nodes}
    written: dict[fx.Node, set[int]] = {}
    for fx_name in signature.buffers_to_mutate:
        n = by_name[fx_name]
        if n.target is operator.getitem:
            written.setdefault(n.args[0], set()).add(n.args[1])
        else:
            written.setdefault(n, set()).add(_ALL)
    return written


def _separate_outputs(node: fx.Node) -> set[int]:
    """Outputs of a forward multi-output op that become nodes of their own: the used outputs after
    the first that are at most a quarter of its size (batch norm's statistics, dropout's mask).

    Eager frees each output when its last reader is done; one node holding them all would keep a
    batch norm's normalised output (or dropout's output) alive as long as the statistics (the mask)
    that the backward pass reads much later. The output's node follows its op's node, and in the
    forward pass nothing is freed between the two (an op's inputs are saved for the backward pass or
    read by the next op), so the kernel's moment of allocating all outputs at once is counted right.
    Such an output's bytes come only from its op's kernel, so the simulator lets a schedule compute
    its node again only after the op's node (``Graph.output_of``, DESIGN rule 5). What it misses is a
    recomputation of the op while such an output's node is resident: the kernel allocates that
    output again for a moment. The size limit bounds that to a quarter of the op's output
    (max-pooling's int64 indices, twice its output, stay with their op).
    Backward ops keep one node: their outputs (an input gradient with the weight gradients) die
    together within an op or two, and splitting them would let frees slip between the kernel and
    its output nodes."""
    outs = node.meta.get("val")
    used = sorted({u.args[1] for u in node.users if u.target is operator.getitem and u.users})
    if len(used) < 2 or not isinstance(outs, (tuple, list)):
        return set()
    first = storage_bytes(outs[used[0]])
    return {i for i in used[1:] if 4 * storage_bytes(outs[i]) <= first}


def _output_bytes(node: fx.Node, excluded: set[int]) -> int:
    """Storage bytes of the op's outputs, less the excluded ones (written into buffers, or nodes of
    their own)."""
    val = node.meta.get("val")
    if _ALL in excluded:
        return 0
    if excluded and isinstance(val, (tuple, list)):
        val = [v for i, v in enumerate(val) if i not in excluded]
    return storage_bytes(val)


def _fixed_tensors(gm: fx.GraphModule, signature: Any, originals: dict[str, torch.Tensor]) -> list[tuple[str, int, str]]:
    """The tensors ``fixed_mem`` is made of, as ``(name, bytes, kind)`` in a training loop's allocation
    order (the graph's optional ``fixed_tensors``): parameters, buffers and captured constants when the
    model is built, the gradients of the trainable parameters (frozen ones have none), then the batch.
    They live for the whole step (DESIGN.md). A storage (of the tensor a placeholder was traced from,
    ``originals``) counts once: a tied parameter (GPT-2's wte = lm_head) is two placeholders of one
    storage, with one ``.grad``, and a loss buffer that is the batch itself (language-model targets =
    the input ids) is one storage, whatever its kinds."""
    kind_of = {**{k: "param" for k in signature.inputs_to_parameters},
               **{k: "buffer" for k in signature.inputs_to_buffers}}
    grad_params = set(signature.backward_signature.gradients_to_parameters.values())
    seen: set[tuple[int, bool]] = set()
    model, grads, batch = [], [], []

    def add(to: list, name: str, value: Any, kind: str) -> None:
        traced_from = originals.get(name.removesuffix(".grad"), value)
        storage = traced_from.untyped_storage()._cdata if isinstance(traced_from, torch.Tensor) else id(value)
        key = (storage, kind == "grad")  # a gradient is counted by its parameter's storage, but is another
        if key not in seen:
            seen.add(key)
            to.append((name, storage_bytes(value), kind))

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value, kind = node.meta.get("val"), kind_of.get(node.name, "input")
            add(batch if kind == "input" else model, node.name, value, kind)
            if signature.inputs_to_parameters.get(node.name) in grad_params:
                add(grads, f"{node.name}.grad", value, "grad")
        elif node.op == "get_attr":
            add(model, node.name, getattr(gm, node.target, None), "constant")
    return model + grads + batch


def _prune(name: str, fixed_tensors: list[tuple[str, int, str]], nodes: list[dict[str, Any]],
           fx_names: list[str], outputs: list[int]) -> tuple[Graph, list[str]]:
    """Keep the nodes some output needs, renumbered in order."""
    needed = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v not in needed:
            needed.add(v)
            stack.extend(nodes[v]["deps"])
    keep = sorted(needed)
    new_id = {old: new for new, old in enumerate(keep)}
    kept = []
    for old in keep:
        nd = dict(nodes[old])
        nd["deps"] = [new_id[d] for d in nd["deps"]]
        nd["alias_of"] = None if nd["alias_of"] is None else new_id[nd["alias_of"]]
        kept.append(nd)
    fixed = sum(t[1] for t in fixed_tensors)
    return Graph.from_nodes(name, fixed, kept, fixed_tensors), [fx_names[i] for i in keep]


def _view_base(node: fx.Node, inputs: list[fx.Node]) -> fx.Node | None:
    """The input whose storage all of this op's outputs share, or None for an op that allocates.

    Storage identity of the traced (fake) values decides: it also catches ``_unsafe_view`` and ops
    returning lists of views (``split``), which schemas do not mark. When the values do not share
    storages although the op is a view (fake copies of a real model's parameters can lose their
    storage identity), the op's schema decides: outputs that alias ``self`` without writing it."""
    outs = tensors_in(node.meta.get("val"))
    owners: dict[int, fx.Node] = {}
    for a in inputs:
        for t in tensors_in(a.meta.get("val")):
            owners.setdefault(t.untyped_storage()._cdata, a)
    bases = [owners.get(t.untyped_storage()._cdata) for t in outs]
    if bases and all(b is not None for b in bases):
        return bases[0]
    return _schema_view_base(node)


def _schema_view_base(node: fx.Node) -> fx.Node | None:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    aliases = [r.alias_info for r in schema.returns]
    is_view = str(node.target) in _UNMARKED_VIEWS or all(a is not None and not a.is_write for a in aliases)
    return node.args[0] if is_view else None


def _shape_str(val: Any) -> str:
    ts = tensors_in(val)
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in ts[:3]) + (" ..." if len(ts) > 3 else "")


def _cost(node: fx.Node, profile: DeviceProfile) -> float:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    return op_cost(profile, node.target, args, kwargs, node.meta.get("val"))
