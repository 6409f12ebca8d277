"""Inductor's own program for a compiled graph, run on fake tensors: what a compiled step allocates.

``torch.compile`` hands each graph AOTAutograd's partitioner made (a forward, a backward) to inductor,
which lowers it, fuses it into kernels, plans its buffers (reuse, in-place, frees at last use) and writes
a Python *wrapper* that allocates those buffers, calls the kernels and frees what is dead. Within
:func:`inductor_without_kernels` every step of that pipeline runs as in a real compile (PyTorch's own
decompositions, partitioner, lowering, scheduler and wrapper), except the last one: the wrapper is not
loaded with compiled kernels. It is executed with every generated kernel replaced by a
:class:`KernelCall` that does no arithmetic but reports which buffers it reads and writes, and with the
wrapper's allocation helpers creating tensors through the dispatcher, so on fake tensors they are fake.
The wrapper's allocations, reuses and frees are then exactly those of the compiled step, on shapes only:
no C++ or Triton compiler runs, and no device memory is touched.

A kernel's reads and writes come from its generated signature, whose arguments inductor names by role
(``in_ptr`` read, ``out_ptr`` written, ``in_out_ptr`` both), in C++ (the CPU's kernels) and in Triton
(CUDA's) alike.
"""

from __future__ import annotations

import contextlib
import re
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from bonsai_core.thread_patches import in_this_thread

# the arguments of a generated kernel: C++ ``const float* in_ptr0``, Triton ``in_ptr0``
_CPP_SIGNATURE = re.compile(r'extern "C"\s+void\s+kernel\s*\(([^)]*)\)')
_TRITON_SIGNATURE = re.compile(r"def\s+\w+\s*\(([^)]*)\)")
_POINTER = re.compile(r"(const\s+)?[\w:<>]+\s*\*\s*(\w+)")

_compiling = threading.Lock()  # dynamo and inductor keep global state: one compiled trace at a time


@dataclass(frozen=True)
class KernelCall:
    """One call of a generated kernel: its name and the tensors it reads and writes."""

    name: str
    reads: tuple[torch.Tensor, ...]
    writes: tuple[torch.Tensor, ...]


class _Kernel:
    """A generated kernel that does no arithmetic: calling it reports a :class:`KernelCall` to the sink
    of the calling thread (:func:`kernel_calls`). ``roles[i]`` says what argument i is to the kernel:
    "r" read, "w" written, "rw" both, "" not a buffer (a size, a block constant)."""

    def __init__(self, roles: list[str]) -> None:
        self.roles = roles
        self.name = "kernel"

    def __call__(self, *args: Any, **_kwargs: Any) -> None:
        sink = getattr(_sinks, "sink", None)
        if sink is None:
            return
        reads = tuple(a for a, r in zip(args, self.roles) if isinstance(a, torch.Tensor) and "r" in r)
        writes = tuple(a for a, r in zip(args, self.roles) if isinstance(a, torch.Tensor) and "w" in r)
        sink(KernelCall(self.name, reads, writes))

    def run(self, *args: Any, **kwargs: Any) -> None:  # how the wrapper launches a Triton kernel
        self(*args, **kwargs)


_sinks = threading.local()


def _roles(names: list[str], const: list[bool]) -> list[str]:
    return ["r" if c or n.startswith("in_ptr") else "rw" if n.startswith("in_out_ptr") else
            "w" if n.startswith("out_ptr") else "" for n, c in zip(names, const)]


class _StubCompile:
    """Stands in for the wrapper's ``AsyncCompile``: each kernel it would compile is a :class:`_Kernel`."""

    def cpp_pybinding(self, argtypes: list[str], source: str) -> _Kernel:
        found = _CPP_SIGNATURE.search(source)
        params = [_POINTER.match(p.strip()) for p in found.group(1).split(",")] if found else []
        names = [m.group(2) if m else "" for m in params]
        const = [bool(m and m.group(1)) or "const" in t for m, t in zip(params, argtypes)]
        return _Kernel(_roles(names, const))

    def cpp(self, source: str) -> _Kernel:
        return self.cpp_pybinding([], source)

    def triton(self, kernel_name: str, source: str, *args: Any, **kwargs: Any) -> _Kernel:
        found = _TRITON_SIGNATURE.search(source)
        names = [p.split(":")[0].strip() for p in found.group(1).split(",")] if found else []
        return _Kernel(_roles(names, [False] * len(names)))

    def wait(self, scope: dict[str, Any]) -> None:
        for name, value in scope.items():
            if isinstance(value, _Kernel):
                value.name = name

    def __getattr__(self, attr: str) -> Callable[..., _Kernel]:  # other kernel kinds: roles unknown, all read
        return lambda *args, **kwargs: _Kernel([])


def _empty_strided(size: Any, stride: Any, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _reinterpret(base: torch.Tensor, size: Any, stride: Any, offset: int) -> torch.Tensor:
    return base.as_strided(size, stride, base.storage_offset() + offset)


def _loaded_without_kernels(graph: Any, wrapper_code: Any) -> Any:
    """``GraphLowering._compile_to_module_lines``'s stand-in: the wrapper's module, its kernels stubs
    and its C helpers (which allocate outside the dispatcher) replaced by dispatched equivalents."""
    source = wrapper_code.value.replace("async_compile = AsyncCompile()", "async_compile = _StubCompile()")
    scope: dict[str, Any] = {"_StubCompile": _StubCompile, "__name__": "bonsai_inductor_wrapper"}
    exec(compile(source, "<inductor wrapper>", "exec"), scope)  # noqa: S102 (torch's own generated code)
    scope.update(
        empty_strided_cpu=lambda size, stride, dtype: _empty_strided(size, stride, dtype, "cpu"),
        empty_strided_cuda=lambda size, stride, dtype: _empty_strided(size, stride, dtype, "cuda"),
        reinterpret_tensor=_reinterpret,
        assert_size_stride=lambda *args, **kwargs: None,
        assert_alignment=lambda *args, **kwargs: None,
        **constants_of(graph),  # what PyCodeCache sets as the module's attributes (its globals)
    )
    module = types.SimpleNamespace(**scope)
    module.__file__ = "<inductor wrapper>"
    return module


def constants_of(graph: Any) -> dict[str, Any]:
    """The constants a wrapper module reads as attributes (as ``PyCodeCache`` sets them)."""
    return {**graph.constants, **getattr(graph, "torchbind_constants", {}), **getattr(graph, "opaque_value_type_classes", {})}


# out= overloads a wrapper calls as extern kernels (``extern_kernels._scaled_mm(..., out=buf)``, Float8
# linears' matmul) that have no meta kernel: on fake tensors torch would run the real CPU kernel on zeros
_OUT_WITHOUT_META = ("_scaled_mm",)


def _meta_out(functional: Any) -> Callable[..., torch.Tensor]:
    """A meta kernel for ``functional``'s out= overload: the functional's own meta kernel gives the result's
    shape and dtype, which ``out`` must have (inductor allocates it so); ``out`` is returned as written."""
    def kernel(*args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        result = functional(*args, **kwargs)
        torch._check(out.shape == result.shape and out.dtype == result.dtype,
                     lambda: f"{functional}: out is {out.dtype} {tuple(out.shape)}, the result "
                             f"{result.dtype} {tuple(result.shape)}")
        return out
    return kernel


@contextlib.contextmanager
def _out_kernels_on_meta() -> Iterator[None]:
    """Within: the overloads of :data:`_OUT_WITHOUT_META` have a meta kernel (:func:`_meta_out`)."""
    library = torch.library.Library("aten", "IMPL")
    try:
        for name in _OUT_WITHOUT_META:
            packet = getattr(torch.ops.aten, name)
            library.impl(f"{name}.out", _meta_out(packet.default), "Meta")
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def inductor_without_kernels() -> Iterator[None]:
    """Within (this thread): ``torch.compile``'s inductor back-end compiles as it would, but its programs
    run their allocations and frees on whatever tensors they get (fake ones) with no kernel compiled or
    run (an extern kernel's out= overload without a meta kernel gets one, :func:`_out_kernels_on_meta`);
    compile caches are off, so every graph goes through this path."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    with _compiling, _out_kernels_on_meta(), \
            in_this_thread(GraphLowering, "_compile_to_module_lines", _loaded_without_kernels), \
            inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False, autotune_local_cache=False,
                                  compile_threads=1), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


@contextlib.contextmanager
def kernel_calls(sink: Callable[[KernelCall], None]) -> Iterator[None]:
    """Within (this thread): every stub kernel's call is passed to ``sink``."""
    previous = getattr(_sinks, "sink", None)
    _sinks.sink = sink
    try:
        yield
    finally:
        _sinks.sink = previous
