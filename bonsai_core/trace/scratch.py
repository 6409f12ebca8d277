"""The memory a CPU kernel allocates for itself while it runs: a measured property of the kernel.

A convolution on the CPU allocates more than its outputs, and frees it before it returns: with oneDNN
(``torch.backends.mkldnn``, the default) its scratchpad and its reorders of the weights and activations
into the blocked layouts its kernel wants; without oneDNN the im2col *columns* of the whole batch
(``slow_conv2d``: batch x C_in x kh x kw x H_out x W_out elements). That memory comes from c10's CPU
allocator like a tensor's, so it is part of the step's peak, but no tensor, dispatcher event or inductor
buffer shows it. oneDNN chooses its layouts and scratchpad per CPU (its instruction set), thread count and
shapes, and exposes neither through torch, so the bytes are *measured*: the step's calls of these ops
(each by its op, its arguments' shapes, strides and dtypes, its other arguments) are run on real tensors
of those shapes, on this CPU, in a process like the measured one (:func:`bonsai_core.allocations.run_hooked`,
the allocation hook preloaded), and the most bytes each held beyond what it returns is its scratch. A
call's bytes depend on the calls before it (oneDNN keeps state from call to call: the zoo ResNet's
64-channel 3x3 backward at 8x8 holds 339,344 B on its first call, 300,832 B after the step's calls before
it, 322,352 B after another order), so the calls are run in the step's order, all of them twice, as the
compiling step and the measured one run them, and the second pass is read. The answer is cached on disk
by the sequence and by what the kernels' choice depends on (:func:`device_key`).

The trace gives each such call a node of those bytes that only the call reads (an allocation before it,
freed after it: the call's transient), so the simulator holds it while the call runs and at no other time.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

# the ops whose CPU kernels allocate memory of their own (found by instrumenting compiled CNN steps at
# the allocator: docs/DESIGN.md, "The compiled step"); top-level calls, as inductor's wrapper and eager
# code make them
SCRATCH_OPS = frozenset({"aten.convolution.default", "aten.convolution_backward.default"})

Signature = str  # JSON of [op, arguments], tensors as ["tensor", shape, stride, dtype, storage offset]


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype).removeprefix("torch."),
                value.storage_offset()]
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format)):
        return str(value)
    raise TypeError(f"cannot describe {type(value).__name__} in a kernel's signature")


def signature(op: str, args: tuple, kwargs: dict) -> Signature:
    """What a kernel's scratch can depend on, for one call: the op and every argument (tensors by shape,
    strides, dtype and offset, not by value)."""
    return json.dumps([op, _encode(list(args)), {k: _encode(v) for k, v in sorted(kwargs.items())}])


def device_key() -> str:
    """What oneDNN's and torch's choice of kernel (hence its scratch) depends on besides the call: torch's
    build, the CPU's instruction set as torch dispatches on it, the thread count, and whether oneDNN is on."""
    return "|".join([torch.__version__, platform.machine(), torch.backends.cpu.get_cpu_capability(),
                     f"threads={torch.get_num_threads()}", f"mkldnn={torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled}"])


def _decode(value: Any) -> Any:
    if isinstance(value, list) and value[:1] == ["tensor"]:
        _, shape, stride, dtype, offset = value
        span = offset + (sum((n - 1) * st for n, st in zip(shape, stride)) + 1 if all(shape) else 0)
        base = torch.empty(max(span, 1), dtype=getattr(torch, dtype))
        base.normal_() if base.is_floating_point() else base.zero_()
        return base.as_strided(shape, stride, offset)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _op(name: str) -> Any:
    _, op, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, op), overload)


def scratch_of_calls(signatures: list[Signature], threads: int, mkldnn: bool) -> list[int]:
    """In a hooked process: the calls run in their order on real tensors of their shapes, all of them
    twice (as the compiling step and then the measured one run them); for each call of the second pass,
    the most bytes it held above its inputs and its new outputs."""
    from bonsai_core import allocations

    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = mkldnn
    calls = []
    for sig in signatures:
        name, args, kwargs = json.loads(sig)
        calls.append((_op(name), _decode(args), {k: _decode(v) for k, v in kwargs.items()}))
    with torch.no_grad():
        for func, args, kwargs in calls:
            func(*args, **kwargs)
        out = []
        for func, args, kwargs in calls:
            inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            before = allocations.live_bytes()
            allocations.reset_peak()
            result = func(*args, **kwargs)
            peak = allocations.peak_bytes()
            made = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tree_flatten(result)[0]
                    if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs}
            out.append(peak - before - sum(made.values()))
            del result
    return out


def _cache_file() -> Path:
    from bonsai_core.allocations import cache_folder

    return cache_folder() / "kernel-scratch.json"


def _read_cache(path: Path) -> dict[str, list[int]]:
    try:
        return {str(k): [int(b) for b in v] for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def scratch_bytes(signatures: list[Signature]) -> list[int]:
    """The scratch bytes of each of a step's calls (in the step's order), measured on this CPU (module
    doc) unless the cache holds that sequence."""
    from bonsai_core.allocations import run_hooked

    if not signatures:
        return []
    mkldnn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    key = f"{device_key()}|{hashlib.sha256(json.dumps(signatures).encode()).hexdigest()}"
    path = _cache_file()
    cached = _read_cache(path).get(key)
    if cached is not None and len(cached) == len(signatures):
        return cached
    measured = run_hooked(scratch_of_calls, signatures, torch.get_num_threads(), mkldnn)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({**_read_cache(path), key: measured}))
        partial.replace(path)
    except OSError:
        pass  # an unwritable cache folder only costs measuring again
    return measured


def fill_scratch(nodes: list[dict[str, Any]], calls: list[tuple[int, Signature]]) -> None:
    """Give each scratch node (``calls``: its index and its call's signature, in the step's order) the bytes
    measured for that call."""
    for (v, _), nbytes in zip(calls, scratch_bytes([s for _, s in calls])):
        nodes[v]["mem"] = nbytes
