"""FSDP2 per rank: the memory one of N processes holds when ``fully_shard`` shards the model by block.

``torch.distributed.fsdp.fully_shard`` applied to each *unit* (each block of the model, a transformer's
layers; torchtitan 0.2.2 also makes the embedding and ``[norm, output]`` units: :func:`fsdp_units`) and
then to the whole model (the *root* unit: every parameter left, e.g. embeddings, final norm, head)
keeps on every rank 1/N of each parameter, of its gradient and of the optimizer's state. Around that
sharded state a rank holds whole (*unsharded*) tensors for a while. The simulator's rules (docs/DESIGN.md;
a "block" below is any unit):

* **Fixed per rank**: the sharded parameters, gradients and optimizer state (1/N each, rounded up),
  and the root unit's unsharded parameters, gathered at the first forward op and kept through the
  backward pass (FSDP does not reshard the root after its forward: its head runs first backwards).
* **Mixed precision** (``mixed_precision="bf16"``: ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, as torchtitan sets it): the sharded parameters, gradients and optimizer state
  stay fp32; the unsharded parameters are bf16 (each unit's all-gather casts its shards into one flat
  bf16 copy first, then gathers bf16), so the forward and backward compute in bf16 and the gradients
  come out bf16; ``foreach_reduce`` copies them into an fp32 reduce-scatter input. The trace runs the
  model with bf16 parameters and float inputs cast to bf16 (:func:`computing_in`), as FSDP2 does.
* **Forward**: while an op of block *u* runs, *u*'s parameters are unsharded, and the flat output of
  the last all-gather is kept until the next all-gather has been issued (the root's first); with
  ``reshard_after_forward`` (the default; one flag per unit possible: torchtitan keeps the last block)
  *u* is resharded when an op outside it runs, else it stays unsharded until its backward ends.
* **Backward**: once the gradient reaches the model's output (the first backward op reading a forward
  tensor of the model rather than of the loss function), the last block's all-gather is prefetched.
  Block *u*'s backward runs from the first backward op that reads a tensor of *u*'s forward (the latest
  block such an op reads) until an op of an earlier block runs; meanwhile *u*'s parameters are
  unsharded, the block before it is prefetched (its flat all-gather output held), *u*'s gradients are
  held as they are computed (the graph frees a gradient at once) until its post-backward: *u* is
  resharded, the previous reduce-scatter input freed, *u*'s gradients copied into a new one (in
  reduce_dtype) and freed, the sharded output allocated on the reduce-scatter stream and accumulated.
  That input is kept until the next reduce-scatter. A recomputed forward op of block *u* runs inside
  *u*'s backward. The root's gradients (and the first block's) are held to the end of the backward,
  where the root's final callback reduce-scatters them.

These are FSDP2's own allocations (``torch/distributed/fsdp/_fully_shard``: ``foreach_all_gather``,
``all_gather_state``, ``foreach_reduce``, ``reduce_scatter_states``, implicit backward prefetching).
:func:`buffer_events` gives them per schedule op as allocations and frees on FSDP2's streams (which the
allocator model replays: a block freed on one stream is not reused by another's allocation);
:func:`working_profile` their bytes per op, which ``simulate`` adds to the timeline, so every
schedule's peak is the rank's, and :func:`bonsai_core.solvers.solve` tightens a method's budget by
what they add where they set the peak. Measured against gloo processes: docs/REAL_RUNS.md.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn as nn

from bonsai_core.arguments import ALL_BUT_LAST, TORCHTITAN
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph, block_stack

SHARDED_KINDS = ("param", "grad", "optimizer")  # fixed tensors each rank holds 1/N of
CAST_KINDS = ("param", "grad")  # fixed tensors traced in param_dtype that a rank holds in fp32
MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}  # MixedPrecisionPolicy(param_dtype=...)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
REDUCE_DTYPE = "fp32"  # torchtitan's mixed_precision_reduce default (MixedPrecisionPolicy(reduce_dtype=fp32))
# FSDP2's streams (FSDPCommContext: all_gather_copy_in_stream, reduce_scatter_stream) and the compute stream
COMPUTE_STREAM, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = "compute", "all_gather_copy_in", "reduce_scatter"


# How ``fully_shard`` is applied, besides one flag for every block (``reshard_after_forward`` true or false):
# ALL_BUT_LAST, torchtitan's apply_fsdp of December 2024 (commit 9dec370, the published memory table's):
# each block, the last one not resharded after forward, then the model (the root keeps embeddings, final
# norm and head). TORCHTITAN, release 0.2.2's apply_fsdp (models/llama3/infra/parallelize.py, its
# "default" policy without pipeline parallelism): tok_embeddings, each block (all resharded after
# forward) and [norm, output] (not resharded: its backward comes first) as units of their own, then the
# model, which owns nothing left. Its units around the blocks: (module paths, reshard_after_forward)
TORCHTITAN_FIRST, TORCHTITAN_LAST = (("tok_embeddings",), True), (("norm", "output"), False)

# torchtitan 0.2.2's FSDP2 setting: config_manager's training.mixed_precision_param = "bfloat16" /
# mixed_precision_reduce = "float32" (as in December 2024), and its apply_fsdp's units
TORCHTITAN_FSDP = {"reshard_after_forward": TORCHTITAN, "mixed_precision": "bf16"}


def fsdp_defaults(model: str, reshard_after_forward: bool | str | None,
                  mixed_precision: str | None) -> tuple[bool | str, str | None]:
    """The FSDP2 setting a model spec is sharded with where the caller leaves it out (None): a
    ``torchtitan:`` model's is torchtitan's (:data:`TORCHTITAN_FSDP`), any other's ``fully_shard``'s
    (reshard after forward, no mixed precision). ``mixed_precision="none"`` turns it off."""
    own = TORCHTITAN_FSDP if model.startswith("torchtitan:") else {"reshard_after_forward": True, "mixed_precision": None}
    reshard = own["reshard_after_forward"] if reshard_after_forward is None else reshard_after_forward
    precision = own["mixed_precision"] if mixed_precision is None else mixed_precision
    return reshard, None if precision == "none" else precision


@dataclass(frozen=True)
class Sharding:
    """How FSDP2 shards a training step: over ``world`` ranks (1: not sharded), ``fully_shard``'s
    ``reshard_after_forward`` (one flag for every unit, or ``"all-but-last"`` / ``"torchtitan"``:
    :func:`fsdp_units`) and ``MixedPrecisionPolicy``'s param dtype (None: the parameters' own). The one
    place its defaults and rules are (:meth:`of`); :meth:`shard` applies it to a traced graph."""

    world: int = 1
    reshard_after_forward: bool | str = True
    mixed_precision: str | None = None

    @classmethod
    def of(cls, world: int = 1, reshard_after_forward: bool | str | None = None, mixed_precision: str | None = None,
           model: str = "", ranks: str = "fsdp=") -> "Sharding":
        """The setting asked for, the model spec's own where left out (None; :func:`fsdp_defaults`:
        torchtitan's for a ``torchtitan:`` model). Mixed precision is FSDP2's policy: asked for on an
        unsharded step (``world`` 1) it is refused, and a model's default one applies to a sharded step only.
        ``ranks``: how the caller's user gives the ranks, in a refusal (``fsdp=``; the command: ``--fsdp ``)."""
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise BonsaiError(f"{ranks}{world!r}: FSDP shards a step over at least 1 rank; give the number of ranks.")
        if mixed_precision not in (None, "none") and world < 2:
            raise BonsaiError(f"Mixed precision {mixed_precision!r} is FSDP2's policy: give {ranks}N (N >= 2) with it, "
                              "or leave it out.")
        reshard, precision = fsdp_defaults(model, reshard_after_forward, mixed_precision)
        return cls(world, reshard, check_mixed_precision(precision) if world > 1 else None)

    def shard(self, graph: Graph, model: nn.Module) -> Graph:
        """``graph`` (traced from ``model`` computing in the mixed precision: :func:`computing_in`) as one
        of the ranks holds it (:func:`shard_by_units`); unchanged on one rank."""
        if self.world == 1:
            return graph
        return shard_by_units(graph, model, self.world, self.reshard_after_forward, self.mixed_precision)


def unit_bytes(model: nn.Module, units: Sequence[Sequence[str]], mixed_precision: str | None = None) -> tuple[list[int], int]:
    """The unsharded parameter bytes of each unit (its modules' paths in ``model.named_modules()``) and of
    the rest of the model (the root unit), each parameter counted once (tied ones in the first unit that
    has them), in ``mixed_precision``'s dtype when given (the all-gathered bytes), else the parameters' own.
    A tensor-parallel DTensor parameter counts its rank's local shard (what FSDP shards and gathers)."""
    from bonsai_core.tensors import local_tensor

    seen: set[int] = set()
    itemsize = DTYPE_BYTES[mixed_precision] if mixed_precision else None

    def own(module: nn.Module) -> int:
        total = 0
        for p in module.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                total += local_tensor(p).numel() * (itemsize or p.element_size())
        return total

    per_unit = [sum(own(model.get_submodule(path)) for path in paths) for paths in units]
    return per_unit, own(model)


def check_mixed_precision(mixed_precision: str | None) -> str | None:
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
        raise BonsaiError(f"--mixed-precision {mixed_precision!r}: FSDP2's param_dtype is one of "
                          f"{', '.join(MIXED_PRECISION)} (reduce_dtype fp32).")
    return mixed_precision


@contextlib.contextmanager
def computing_in(model: nn.Module, mixed_precision: str | None) -> Iterator[None]:
    """Within: ``model`` computes as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` makes it (its
    parameters in that dtype, buffers untouched, float positional and keyword inputs cast by a forward
    pre-hook as the root's ``_cast_forward_inputs`` does); restored after. Nothing without a dtype.
    The parameters must be fp32, what FSDP2's mixed precision starts from."""
    if check_mixed_precision(mixed_precision) is None:
        yield
        return
    dtype = MIXED_PRECISION[mixed_precision]
    params = [p for p in model.parameters()]
    wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if wrong:
        raise BonsaiError(f"--mixed-precision {mixed_precision} keeps fp32 parameters sharded and computes in "
                          f"{mixed_precision}, but the model's parameters are {', '.join(wrong)}: build it in fp32 "
                          "(leave --dtype out).")
    from torch.distributed.tensor import DTensor

    distributed = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    originals = [p.data for p in plain]

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def cast_inputs(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def swap_all() -> None:  # a DTensor's .data assignment keeps its local tensor: swap whole parameters
        for p, q in zip(distributed, swapped):
            torch.utils.swap_tensors(p, q)

    swapped = [nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad) for p in distributed]
    hook = model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    try:
        for p in plain:
            p.data = p.data.to(dtype)
        swap_all()
        yield
    finally:
        hook.remove()
        swap_all()  # back
        for p, data in zip(plain, originals):
            p.data = data


def shard_by_units(graph: Graph, model: nn.Module, world: int, reshard_after_forward: bool | str = True,
                   mixed_precision: str | None = None) -> Graph:
    """:func:`with_fsdp` with ``fully_shard`` on the units :func:`fsdp_units` names (the blocks of the
    graph's block stack, :func:`bonsai_core.graph.block_stack`, and with ``"torchtitan"`` torchtitan's
    units around them) of ``model`` (the traced module) and on the whole model."""
    units = fsdp_units(graph, reshard_after_forward)
    sizes, root = unit_bytes(model, [paths for paths, _ in units], mixed_precision)
    return shard_by_sizes(graph, units, sizes, root, world, reshard_after_forward, mixed_precision)


def shard_by_sizes(graph: Graph, units: list[tuple[tuple[str, ...], bool]], sizes: Sequence[int], root: int, world: int,
                   reshard_after_forward: bool | str = True, mixed_precision: str | None = None) -> Graph:
    """:func:`with_fsdp` of ``graph`` with the ``units`` of :func:`fsdp_units` of unsharded ``sizes`` and the
    root's ``root`` bytes (:func:`unit_bytes` of the traced module), each spanning its modules' calls."""
    spans = {path: (first, last) for path, first, last in reversed(graph.modules)}  # a module's first call
    model_last = max((last for _, _, last in graph.modules), default=graph.n - 1)
    return with_fsdp(graph, world, [(",".join(paths), min(spans[p][0] for p in paths), max(spans[p][1] for p in paths), b)
                                    for (paths, _), b in zip(units, sizes)], root,
                     reshard_after_forward if isinstance(reshard_after_forward, bool) else [flag for _, flag in units],
                     model_last, mixed_precision)


def fsdp_units(graph: Graph, reshard_after_forward: bool | str) -> list[tuple[tuple[str, ...], bool]]:
    """The units ``fully_shard`` is applied to before the whole model, in forward order, each as (module
    paths, its reshard_after_forward): every block of the block stack with one flag for all, or
    ``"all-but-last"`` (torchtitan's of December 2024), or ``"torchtitan"`` (0.2.2's apply_fsdp: also
    ``tok_embeddings`` and ``[norm, output]`` where the model has them, as apply_fsdp checks)."""
    blocks = [(path,) for path, _, _ in block_stack(graph)]
    if reshard_after_forward == TORCHTITAN:
        called = {path for path, _, _ in graph.modules}
        first = [TORCHTITAN_FIRST] if set(TORCHTITAN_FIRST[0]) <= called else []
        last = [TORCHTITAN_LAST] if set(TORCHTITAN_LAST[0]) <= called else []
        return [*first, *((b, True) for b in blocks), *last] if blocks else []
    if reshard_after_forward == ALL_BUT_LAST:
        return [(b, k < len(blocks) - 1) for k, b in enumerate(blocks)]
    if isinstance(reshard_after_forward, bool):
        return [(b, reshard_after_forward) for b in blocks]
    raise BonsaiError(f"reshard_after_forward {reshard_after_forward!r}: give true, false, {ALL_BUT_LAST!r} "
                      f"or {TORCHTITAN!r}.")


def with_fsdp(graph: Graph, world: int, blocks: Sequence[tuple[str, int, int, int]], root: int,
              reshard_after_forward: bool | Sequence[bool] = True, model_last: int | None = None,
              mixed_precision: str | None = None) -> Graph:
    """``graph`` as one of ``world`` FSDP ranks holds it (see the module doc). ``blocks``: each block's
    (path, first, last forward node, unsharded parameter bytes), in order; ``root``: the other
    parameters' unsharded bytes; ``reshard_after_forward``: one flag, or one per block; ``model_last``:
    the model's last forward node (the loss function's ops follow; default: all are the model's), where
    the root's backward begins; ``mixed_precision``: FSDP2's param_dtype (reduce_dtype fp32), the graph
    then traced computing in it (:func:`computing_in`): its parameters and gradients are held sharded in fp32.
    Apply it before :func:`bonsai_core.optimizer.with_optimizer`, whose state is then sharded too."""
    Sharding.of(world, True, mixed_precision)  # its rules: ranks, and mixed precision only on a sharded step
    if graph.fsdp is not None:
        raise BonsaiError(f"{graph.name!r} is already sharded over {graph.fsdp['world']} ranks; trace it again.")
    if graph.optimizer is not None:
        raise BonsaiError(f"{graph.name!r} already has its optimizer's state: shard the graph first, then add the "
                          "optimizer (bonsai trace --fsdp N --optimizer NAME does).")
    if world == 1:
        return graph
    if not blocks:
        raise BonsaiError(f"{graph.name!r} records no repeated blocks (its 'modules' field has no "
                          "<parent>.<index> calls), so its FSDP units are unknown: FSDP per rank needs a model "
                          "with a block stack (a transformer's layers, a ResNet's blocks).")
    if not isinstance(reshard_after_forward, bool) and len(reshard_after_forward) != len(blocks):
        raise BonsaiError(f"reshard_after_forward has {len(reshard_after_forward)} flags for {len(blocks)} blocks.")
    # a rank holds its parameters and gradients in fp32: the trace computed them in param_dtype
    widen = DTYPE_BYTES[REDUCE_DTYPE] / DTYPE_BYTES[mixed_precision] if mixed_precision else 1
    # FSDP shards a gradient as its parameter (a tensor-parallel gradient replicated where its parameter is
    # sharded is reduce-scattered into the parameter's shard)
    params = {name: nbytes for name, nbytes, kind in graph.fixed_tensors if kind == "param"}
    own = [(name, min(nbytes, params.get(name.removesuffix(".grad"), nbytes)) if kind == "grad" else nbytes, kind)
           for name, nbytes, kind in graph.fixed_tensors]
    sharded = [(name, math.ceil(nbytes * (widen if kind in CAST_KINDS else 1) / world)
                if kind in SHARDED_KINDS else nbytes, kind)
               for name, nbytes, kind in own]
    fixed = [*sharded, ("fsdp.root_unsharded", root, "fsdp")]
    reshard = bool(reshard_after_forward) if isinstance(reshard_after_forward, bool) else [bool(f) for f in reshard_after_forward]
    fsdp = {"world": world, "reshard_after_forward": reshard, "root_bytes": root,
            "model_last": graph.n - 1 if model_last is None else int(model_last),
            "units": [[path, int(first), int(last), int(nbytes)] for path, first, last, nbytes in blocks]}
    if mixed_precision:
        fsdp.update(param_dtype=mixed_precision, reduce_dtype=REDUCE_DTYPE)
    return graph.with_fields(fixed_tensors=[list(t) for t in fixed], fsdp=fsdp,
                             fixed_mem=graph.fixed_mem - sum(t[1] for t in graph.fixed_tensors) + sum(t[1] for t in fixed))


class Buffer(NamedTuple):
    """One of FSDP2's own allocations or frees: ``nbytes`` > 0 allocates buffer ``key`` on ``stream``,
    < 0 frees it. A key ``grad:V`` is node V's gradient, which FSDP holds after the graph frees it (the
    allocator keeps that node's block until the free)."""

    key: str
    nbytes: int
    stream: str = COMPUTE_STREAM


def buffer_events(graph: Graph, ops: Sequence[tuple[str, int]]) -> list[list[Buffer]]:
    """Rule 7 as events: for each op of a schedule, FSDP2's allocations and frees in the order they
    happen before the op runs, and one more list for what follows the last op (the post-backward of
    the units still holding gradients). Empty lists for a graph without ``fsdp``. The order is
    FSDP2's (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``): a unit's post-backward
    (reshard, then ``foreach_reduce``) runs before the next unit's pre-backward (copy-out of its
    prefetched all-gather, then the prefetch of the unit before it)."""
    none: list[Buffer] = []  # shared by every op without events (most): never appended to by the caller
    events: list[list[Buffer]] = [none] * (len(ops) + 1)
    if graph.fsdp is None:
        return [[] for _ in events]
    walk = _Walk(graph)
    for i, (kind, v) in enumerate(ops):
        walk.out = []
        walk.op(kind, v)
        if walk.out:
            events[i] = walk.out
    walk.out = events[-1] = []
    walk.finish()
    return events


def working_profile(graph: Graph, ops: Sequence[tuple[str, int]]) -> np.ndarray:
    """int64[len(ops)]: the bytes FSDP holds at each op of a schedule beyond ``fixed_mem`` and the graph's
    own tensors (the module doc's rules): the most it holds while the op's events run (what follows the
    last op counts at the last op); zeros for a graph without ``fsdp``."""
    return sum(working_parts(graph, ops).values(), np.zeros(len(ops), dtype=np.int64))


# What holds FSDP's bytes, by the prefix of a buffer's key (``_Walk``'s names).
WORKING_PARTS = {"all-gathered blocks": ("unsharded", "all_gather_output", "all_gather_input"),
                 "gradients held": ("grad",),
                 "collective buffers": ("reduce_scatter_input", "reduce_scatter_output"),
                 "sharded gradients": ("sharded_grad",)}


def working_parts(graph: Graph, ops: Sequence[tuple[str, int]]) -> dict[str, np.ndarray]:
    """:func:`working_profile` by what holds the bytes (``WORKING_PARTS``): at each op, each part's bytes
    at the moment FSDP holds the most while the op's events run. int64[len(ops)] each; zeros without
    ``fsdp``."""
    names = list(WORKING_PARTS)
    part_of = {prefix: k for k, name in enumerate(names) for prefix in WORKING_PARTS[name]}
    out = np.zeros((len(names), len(ops)), dtype=np.int64)
    if graph.fsdp is not None and ops:
        held, total = [0] * len(names), 0  # Python ints: each op's few events cost less than numpy's calls
        rows: list[list[int]] = []
        for i, step in enumerate(buffer_events(graph, ops)):
            top, most = held[:], total
            for b in step:
                held[part_of[b.key.split(":", 1)[0]]] += b.nbytes
                total += b.nbytes
                if total > most:
                    top, most = held[:], total
            if i < len(ops):
                rows.append(top)
            elif most > sum(rows[-1]):  # what follows the last op counts at the last op
                rows[-1] = top
        out = np.ascontiguousarray(np.array(rows, dtype=np.int64).T)
    return dict(zip(names, out))


class _Walk:
    """The state rule 7 follows along a schedule (see :func:`buffer_events`); ``out`` is the list the
    events of the current op go to."""

    def __init__(self, graph: Graph) -> None:
        fsdp = graph.fsdp
        self.graph, self.world = graph, int(fsdp["world"])
        self.size = [int(u[3]) for u in fsdp["units"]]
        self.resharded = reshard_flags(fsdp)
        self.forward, self.gradient, self.owner, self.reads = _walk_tables(graph)
        self.model_last = int(fsdp["model_last"])
        # the reduce-scatter input is in reduce_dtype, the gradients it copies in are in param_dtype
        self.reduce_ratio = DTYPE_BYTES[fsdp.get("reduce_dtype") or "fp32"] / DTYPE_BYTES[fsdp.get("param_dtype") or "fp32"] \
            if fsdp.get("param_dtype") else 1.0
        self.cast = bool(fsdp.get("param_dtype"))  # all-gather inputs are cast copies of the shards
        self.tensor_parallel = (graph.parallel or {}).get("layout", {}).get("tp", 1) > 1
        self.out: list[Buffer] = []
        self.gathered: set[int] = set()  # units whose parameters are unsharded
        self.gather_output: str | None = None  # the flat all-gather output FSDP holds
        self.scatter_input: str | None = None  # the last reduce-scatter's input, held until the next one
        self.in_backward = self.root_backward = False
        self.current = -1  # the unit whose backward runs
        self.grads: dict[int, list[int]] = {}  # unit (-1: root) -> gradient nodes held until its reduce-scatter
        self.pending: list[int] = []  # gradients computed by the last op: held from the next one
        self.bytes: dict[str, int] = {}
        self.first = True

    def emit(self, key: str, nbytes: int, stream: str = COMPUTE_STREAM) -> None:
        if nbytes > 0:
            self.bytes[key] = nbytes
            self.out.append(Buffer(key, nbytes, stream))
        elif key in self.bytes:
            self.out.append(Buffer(key, -self.bytes.pop(key), stream))

    def all_gather(self, unit: int, nbytes: int) -> str:
        """``foreach_all_gather``: the cast shards (with a param_dtype: ``_get_param_all_gather_inputs``'
        flat copy) and the flat output, both on the copy-in stream; the cast copy is freed once copied in."""
        key = f"all_gather_output:{unit}"
        if self.cast:
            self.emit(f"all_gather_input:{unit}", math.ceil(nbytes / self.world), ALL_GATHER_STREAM)
        self.emit(key, nbytes, ALL_GATHER_STREAM)
        if self.cast:
            self.emit(f"all_gather_input:{unit}", 0)
        return key

    def hold(self, g: int) -> None:
        """Gradient node ``g``, which the graph frees at once, held by FSDP until its unit's reduce-scatter."""
        nbytes = int(self.graph.mem[self.graph.storage_of(g)])
        if nbytes > 0:
            self.emit(f"grad:{g}", nbytes)
            self.grads.setdefault(self.current, []).append(g)

    def unshard(self, unit: int) -> None:
        """A unit's parameters resized to their unsharded bytes (the copy-out)."""
        self.emit(f"unsharded:{unit}", self.size[unit])
        self.gathered.add(unit)

    def reshard(self, unit: int) -> None:
        self.emit(f"unsharded:{unit}", 0)
        self.gathered.discard(unit)

    def free_gather_output(self) -> None:
        if self.gather_output is not None:
            self.emit(self.gather_output, 0)
            self.gather_output = None

    def reduce_scatter(self, unit: int) -> None:
        """``foreach_reduce``: the previous reduce-scatter input freed, this one's (the gradients in
        reduce_dtype) allocated on the compute stream and the gradients copied in and freed, the sharded
        output allocated on the reduce-scatter stream (accumulated into the sharded gradients, then
        freed; where the gradients are set to None between steps, kept: its views are the sharded
        gradients); the input is held until the next reduce-scatter."""
        grads = self.grads.pop(unit, [])
        if not grads:
            return
        if self.scatter_input is not None:
            self.emit(self.scatter_input, 0)
        held = sum(self.bytes[f"grad:{v}"] for v in grads)
        if self.tensor_parallel:  # a gradient replicated where its parameter is sharded is redistributed to the
            # parameter's shard first (FSDPParam._get_grad_inner_tensor): at most the unit's parameters
            held = min(held, (self.size[unit] if unit >= 0 else int(self.graph.fsdp["root_bytes"])) or held)
        nbytes = int(held * self.reduce_ratio)
        self.scatter_input = f"reduce_scatter_input:{unit}"
        self.emit(self.scatter_input, nbytes)
        for v in grads:
            self.emit(f"grad:{v}", 0)
        output = "sharded_grad" if self.graph.grads_set_to_none else "reduce_scatter_output"
        self.emit(f"{output}:{unit}", math.ceil(nbytes / self.world), REDUCE_SCATTER_STREAM)
        if not self.graph.grads_set_to_none:
            self.emit(f"{output}:{unit}", 0, REDUCE_SCATTER_STREAM)

    def op(self, kind: str, v: int) -> None:
        graph = self.graph
        for g in self.pending:  # the graph frees a gradient at once: FSDP holds it from here
            self.hold(g)
        self.pending = []
        if self.first:  # the root's parameters, gathered at the first op, stay unsharded (fixed memory)
            self.first, self.gather_output = False, self.all_gather(-1, int(graph.fsdp["root_bytes"]))
        if kind != "compute":
            return
        forward = self.forward[v]
        if not forward and not self.in_backward:  # the forward's last all-gather output is freed at its end
            self.in_backward = True
            self.free_gather_output()
            for g in [g for g in self.gathered if self.resharded[g]]:
                self.reshard(g)
        u = self.owner[v] if forward else self.reads[v]
        if not self.in_backward:
            self._forward(u)
        else:
            self._backward(u, v)
        if self.gradient[v] and not forward:
            self.pending.append(v)

    def _forward(self, u: int) -> None:
        for g in [g for g in self.gathered if self.resharded[g] and g != u]:  # its forward ended
            self.reshard(g)
        if u >= 0 and u not in self.gathered:
            # pre-forward: all-gather, then wait_for_unshard frees the previous all-gather's output
            # (all_gather_state) and copies the new one out
            key = self.all_gather(u, self.size[u])
            self.free_gather_output()
            self.gather_output = key
            self.unshard(u)

    def _backward(self, u: int, v: int) -> None:
        graph = self.graph
        if not self.root_backward and self.current < 0 and self.size \
                and any(graph.is_forward[d] and d <= self.model_last for d in graph.deps(v).tolist()):
            self.root_backward = True  # the gradient reached the model's output: the last unit is prefetched
            self._prefetch(len(self.size) - 1)
        if u < 0 or u == self.current:
            return
        if self.current >= 0:  # its post-backward: resharded, its gradients reduce-scattered
            self.reshard(self.current)
            self.reduce_scatter(self.current)
        self.current = u
        if u not in self.gathered:  # pre-backward: copy-out of its (prefetched) all-gather, whose output is freed
            if self.gather_output != f"all_gather_output:{u}":
                self._prefetch(u)
            self.unshard(u)
            self.free_gather_output()
        if u > 0:
            self._prefetch(u - 1)

    def _prefetch(self, unit: int) -> None:
        if unit not in self.gathered and self.gather_output != f"all_gather_output:{unit}":
            self.free_gather_output()
            self.gather_output = self.all_gather(unit, self.size[unit])

    def finish(self) -> None:
        """After the last op: the root's final callback runs the post-backward of the units still holding
        gradients (the last one whose backward ran, then the root); the last reduce-scatter input is freed."""
        for g in self.pending:
            self.hold(g)
        for unit in [u for u in self.grads if u >= 0]:
            self.reshard(unit)
            self.reduce_scatter(unit)
        self.reduce_scatter(-1)
        for g in list(self.gathered):
            self.reshard(g)
        self.free_gather_output()
        if self.scatter_input is not None:
            self.emit(self.scatter_input, 0)


def reshard_flags(fsdp: dict[str, Any]) -> list[bool]:
    """Each unit's ``reshard_after_forward`` (the field is one bool for all, or one per unit)."""
    flag = fsdp["reshard_after_forward"]
    return [bool(f) for f in flag] if isinstance(flag, list) else [bool(flag)] * len(fsdp["units"])


_TABLES: dict[str, tuple[list[bool], list[bool], list[int], list[int]]] = {}  # graph hash -> _walk_tables
_TABLES_KEPT = 8
_TABLES_LOCK = threading.Lock()  # explorer sessions simulate in threads


def _walk_tables(graph: Graph) -> tuple[list[bool], list[bool], list[int], list[int]]:
    """(is_forward, is a gradient (:func:`bonsai_core.optimizer.gradient_nodes`), :func:`_forward_owner`,
    :func:`_backward_unit`) of ``graph`` as Python lists,
    which the walk reads once per op: built once per graph (a sweep simulates hundreds of schedules of one)."""
    found = _TABLES.get(graph.hash)
    if found is None:
        from bonsai_core.optimizer import gradient_nodes

        owner = _forward_owner(graph, graph.fsdp["units"])
        gradient = np.zeros(graph.n, dtype=bool)
        gradient[gradient_nodes(graph)] = True
        found = (graph.is_forward.tolist(), gradient.tolist(), owner.tolist(), _backward_unit(graph, owner).tolist())
        with _TABLES_LOCK:
            while len(_TABLES) >= _TABLES_KEPT:
                del _TABLES[next(iter(_TABLES))]
            _TABLES[graph.hash] = found
    return found


def _forward_owner(graph: Graph, units: Sequence[Sequence[Any]]) -> np.ndarray:
    """int64[n]: the block whose forward span holds each forward node, or -1."""
    owner = np.full(graph.n, -1, dtype=np.int64)
    for k, (_, first, last, _) in enumerate(units):
        span = np.arange(int(first), int(last) + 1)
        owner[span[graph.is_forward[span]]] = k
    return owner


def _backward_unit(graph: Graph, owner: np.ndarray) -> np.ndarray:
    """int64[n]: for each backward node, the latest block (in forward order) among the forward tensors it
    reads, or -1 (an op reading none keeps the block whose backward runs)."""
    reads = np.full(graph.n, -1, dtype=np.int64)
    for b in np.flatnonzero(~graph.is_forward).tolist():
        forward = [int(owner[d]) for d in graph.deps(b).tolist() if graph.is_forward[d]]
        reads[b] = max(forward, default=-1)
    return reads
