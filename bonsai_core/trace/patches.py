"""What tracing changes in eager PyTorch so that the traced graph is the step eager runs.

Each is a context manager, entered by :mod:`bonsai_core.trace` around ``aot_export_module``
(:func:`_as_in_eager`) or around building a model to trace (:func:`_initialisation_skipped`).

A dropout that drops nothing (``p == 0``, as in Llama's and ViT's configs, or not training) returns
its input in eager PyTorch; AOTAutograd's decomposition would record a ``clone`` that eager never
makes, so while tracing such a dropout returns its input and the graph has no node for it.

Dropout and ``F.scaled_dot_product_attention`` with dropout run other kernels on a GPU than on the CPU,
and a trace records one device's (``kernels``, :data:`KERNELS`; :func:`device_kernels`):

* ``"cuda"`` (``bonsai trace``'s default, whatever device traced): dropout as ``native_dropout`` (a bool
  mask, what torch's decomposition writes and CUDA runs) and SDPA with dropout as the memory-efficient
  attention kernel, which keeps the output, the logsumexp and the generator's seed and offset
  (:mod:`bonsai_core.attention`); the exported program runs that kernel on CUDA and its equivalent on
  the CPU.
* ``"cpu"`` (``bonsai.checkpoint`` on a CPU model, ``bonsai trace --kernels cpu``): dropout as ATen's
  CPU kernel runs it (``empty_like``, ``bernoulli_``, ``div_``, ``mul``: a float noise tensor the
  backward pass reads, :func:`_cpu_dropout`), and SDPA with dropout as its math path (no fused CPU
  kernel has dropout), which keeps the ``batch x heads x seq x seq`` probabilities and the dropout noise.

A grouped matmul (``aten._grouped_mm``, how transformers' mixture-of-experts layers run their experts)
in float32 or float16 gets the shapes its kernels give it, where torch's own shape function refuses
all but bfloat16 (:func:`_grouped_mm_as_its_kernels`). When an op's shape function fails, fake
tensors log it with a traceback before the error reaches bonsai: while tracing those records are
dropped and the op is named in the :class:`ModelError` instead.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from bonsai_core.arguments import KERNELS
from bonsai_core.attention import FusedAttentionWithDropout
from bonsai_core.errors import ModelError
from bonsai_core.recurrent import FusedRecurrent
from bonsai_core.thread_patches import in_this_thread


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
            stack.enter_context(in_this_thread(nn.init, n, untouched))
        yield



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
def _as_in_eager(kernels: str = "cuda") -> Iterator[None]:
    """What tracing changes so that the graph is the step eager runs: no copy for a dropout that
    drops nothing, ``torch._assert`` on tensors skipped, float32/float16 grouped matmuls shaped
    as their kernels shape them, dropout and SDPA with dropout as ``kernels``' device runs them
    (:func:`device_kernels`), and ``nn.LSTM`` as the fused kernel eager runs, not torch's per-step
    decomposition (:mod:`bonsai_core.recurrent`), and ``silu_backward``/``mish_backward`` as their
    kernels, not their composite implementations (:func:`_backward_kernels_kept`); and CTC loss traced by its
    shapes (:mod:`bonsai_core.ctc`)."""
    from bonsai_core.ctc import register_ctc_shapes

    register_ctc_shapes()
    with skip_tensor_asserts(), _EagerDropoutOff(), _grouped_mm_as_its_kernels(), device_kernels(kernels), \
            FusedRecurrent(), _backward_kernels_kept():
        yield


# AOTAutograd traces the backward pass as if it were to be differentiated again: an op whose Autograd
# kernel is a composite implementation is decomposed when its inputs require grad. Two aten ops have a
# composite implementation and kernels of their own, ``silu_backward`` and ``mish_backward``: eager's
# backward pass runs the kernel (one output), where the trace recorded the composite's sigmoid, its
# products and their temporaries (traced so, hf:mixtral's no-remat peak is predicted 6% above its measurement).
# While tracing (this thread), they stay one op each.
_BACKWARD_KERNELS = (torch.ops.aten.silu_backward.default, torch.ops.aten.mish_backward.default)


@contextlib.contextmanager
def _backward_kernels_kept() -> Iterator[None]:
    """Within (this thread): ``silu_backward`` and ``mish_backward`` traced as the kernels eager runs."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    original = inspect.unwrap(FunctionalTensorMode._can_decompose)  # past another thread's patch

    def can_decompose(mode: Any, func: Any, args: Any, kwargs: Any) -> bool:
        return func not in _BACKWARD_KERNELS and original(mode, func, args, kwargs)

    with in_this_thread(FunctionalTensorMode, "_can_decompose", can_decompose):
        yield


def device_kernels(kernels: str) -> contextlib.AbstractContextManager:
    """Within: dropout and SDPA with dropout recorded as ``kernels``' device runs them (module doc)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: choose one of {', '.join(map(repr, KERNELS))}.")
    return FusedAttentionWithDropout() if kernels == "cuda" else _cpu_dropout()


# While tracing (under the Python dispatcher) ``aten.dropout`` runs torch's Python decomposition into
# ``native_dropout``, on every device. ATen's own composite kernel picks by device: the fused kernel on
# CUDA, and on the CPU ``_dropout_impl``, which draws a float noise tensor (``empty_like(x).bernoulli_(1 - p)
# .div_(1 - p)``) and returns ``x * noise``: 4 bytes per element kept for the backward pass where the
# bool mask keeps 1, and SDPA's math path calls it on every attention matrix. While a thread asks for
# the CPU's kernels, the decomposition is replaced (for that thread) by ATen's composite kernel.
_DROPOUT_KEYS = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)
_cpu_dropout_lock = threading.Lock()
_cpu_dropout_state: dict[str, Any] = {"users": 0, "original": {}}
_cpu_dropout_thread = threading.local()


def _dropout_kernel(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def kernel(input: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
        if getattr(_cpu_dropout_thread, "depth", 0):
            return torch.ops.aten.dropout.default._op_dk(_DROPOUT_KEYS[0], input, p, train)
        return original(input, p, train)
    return kernel


@contextlib.contextmanager
def _cpu_dropout() -> Iterator[None]:
    """Within (this thread): ``aten.dropout`` is traced as ATen's composite kernel runs it on the
    tensors' device (the CPU's: ``empty_like``, ``bernoulli_``, ``div_``, ``mul``), not as torch's
    decomposition into ``native_dropout``. Other threads keep the decomposition."""
    op = torch.ops.aten.dropout.default
    with _cpu_dropout_lock:
        if _cpu_dropout_state["users"] == 0:
            originals = _cpu_dropout_state["original"] = {k: op.py_kernels[k] for k in _DROPOUT_KEYS if k in op.py_kernels}
            for key, original in originals.items():
                op.py_kernels[key] = _dropout_kernel(original)
            op._dispatch_cache.clear()
        _cpu_dropout_state["users"] += 1
    _cpu_dropout_thread.depth = getattr(_cpu_dropout_thread, "depth", 0) + 1
    try:
        yield
    finally:
        _cpu_dropout_thread.depth -= 1
        with _cpu_dropout_lock:
            _cpu_dropout_state["users"] -= 1
            if _cpu_dropout_state["users"] == 0:
                op.py_kernels.update(_cpu_dropout_state["original"])
                op._dispatch_cache.clear()


@contextlib.contextmanager
def libraries_compiling() -> Iterator[None]:
    """Within: ``torch.compiler.is_compiling()`` is True, as under ``torch.compile``/``torch.export``.
    Libraries ask it to skip code that reads tensor values when traced: transformers' causal mask
    checks whether the positions of a call without an attention mask are packed sequences
    (``(mask == 0).all()``) unless compiling, and then builds the mask from those positions instead.
    Only for a step that reads a value otherwise: the compile-time path may run other kernels than
    eager (transformers' mixture-of-experts layers do), and the graph is to be eager's."""
    with in_this_thread(torch.compiler, "is_compiling", lambda: True):
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
def skip_tensor_asserts() -> Iterator[None]:
    """``torch._assert`` on a tensor condition is a check, not a branch: skip it while tracing
    (fake tensors have no value to check), keep every other assert."""
    real_assert = torch._assert

    def traced_assert(condition: Any, message: str) -> None:
        if not isinstance(condition, torch.Tensor):
            real_assert(condition, message)

    with mock.patch.object(torch, "_assert", traced_assert):
        yield


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(autocast: str | None, device_type: str = "cpu") -> Any:
    """``torch.autocast`` for the device the step is traced on (fake tensors of the inputs' device)."""
    if autocast is None:
        return contextlib.nullcontext()
    if autocast not in AUTOCAST:
        raise ModelError(f"Unknown autocast {autocast!r}; choose one of: {', '.join(AUTOCAST)}.")
    return torch.autocast(device_type=device_type, dtype=AUTOCAST[autocast])
