"""A training step recorded as it runs, storage by storage, into a :class:`~bonsai_core.graph.Graph`.

The eager trace (:mod:`bonsai_core.trace`) reads AOTAutograd's functional joint graph. A compiled step
is not one graph: eager code between compiled regions, each region's forward and backward program as
inductor wrote it (:mod:`bonsai_core.trace.inductor`), and the autograd engine between them. So it is
recorded while it runs on fake tensors: :class:`StepRecorder` sees every aten op the dispatcher runs
(eager ops, and the extern kernels and allocations of inductor's wrappers) and every generated kernel's
call, with the storages each reads and writes, and when each storage dies.

How the run becomes nodes (storages, not tensors: a view is no node, and reads through it read its
storage):

* an op or kernel that makes new storages, or writes into storages the step made, is a node; its
  ``mem`` is the bytes of the first storage it makes or writes. A further new storage is allocated before
  the op (a node the op reads) and written by it (a node after it, ``inplace_of`` the allocation), so
  all of an op's outputs are live together while it runs and its inputs die after it, as they do;
* an allocation (``empty_strided``: how inductor's wrapper makes every buffer) is no node: its storage
  belongs to the first op or kernel that writes it, as the allocation comes right before it;
* a write into a storage that holds an earlier node's value (inductor's in-place kernels and buffer
  reuse, eager's ``add_``) makes a node with ``inplace_of`` that node (simulator rule 8): the storage's
  bytes are counted once;
* a node reads the node whose value each storage it reads holds (its current version); storages that
  live through the step (parameters, gradients, buffers, the batch: ``fixed``) are no nodes, and storages
  that existed before the step without being fixed ones are counted as constants;
* a kernel that allocates memory of its own while it runs (a CPU convolution's scratch:
  :mod:`bonsai_core.trace.scratch`) gets a node of those bytes before it that only it reads, so they
  are live while it runs and freed after; ``scratch`` lists those nodes with the call's signature, and
  :func:`~bonsai_core.trace.scratch.fill_scratch` gives them the bytes measured for that call;
* a storage that dies after its value's last reader is held by the op before its death (a ``held`` dep,
  as the eager trace writes what Python holds), so the plain schedule frees it when the run did; one
  alive at the end is held by the last op.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from bonsai_core.costmodel import DeviceProfile, op_cost
from bonsai_core.optimizer import ACCUMULATE_GRAD
from bonsai_core.trace.inductor import KernelCall
from bonsai_core.trace.scratch import SCRATCH_OPS, Signature, signature

_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.new_empty_strided.default}
_SEPARATE_COST = 1e-9  # a further output of one kernel: no kernel of its own, but every node costs something


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` that can hold bytes: not those on the meta device (DTensor's sharding
    propagation runs ops on meta tensors of the global shape to learn their outputs' metadata)."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"]


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tensors an aten op writes, those of them it does not read: ``out=`` arguments)."""
    written, write_only = [], []
    if not hasattr(func, "_schema"):  # a higher-order operator: functional
        return written, write_only
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if alias is None or not alias.is_write:
            continue
        value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only else None)
        tensors = _tensors(value)
        written += tensors
        if arg.kwarg_only:
            write_only += tensors
    return written, write_only


class StepRecorder(TorchDispatchMode):
    """Records the ops and kernels run inside it as graph nodes (module doc). ``fixed``: the storages
    that live through the step (parameters, gradients, buffers, the batch), by ``untyped_storage()._cdata``.
    Set ``phase`` to ``"backward"`` before the backward pass runs.

    It declares itself an infrastructure mode, as fake tensors do, so that ``torch.compile`` runs its
    compiled frames under it instead of falling back to eager (which would record another step)."""

    def __init__(self, profile: DeviceProfile, fixed: Iterable[int]) -> None:
        super().__init__()
        self.profile = profile
        self.fixed = set(fixed)
        self.phase = "forward"
        self.nodes: list[dict[str, Any]] = []
        self.op_nodes: list[int] = []  # the nodes that are an op or kernel (not a further output of one)
        self.version: dict[int, int] = {}  # storage -> the node whose value it holds
        self.sizes: dict[int, int] = {}  # storages the step made -> bytes
        self.pending: set[int] = set()  # storages allocated and not yet written
        self.constants: dict[int, int] = {}  # storages from before the step, not fixed, that it reads
        self.released: list[tuple[int, int]] = []  # (node whose value a dying storage held, nodes made before)
        self._finalizers: list[weakref.finalize] = []
        self._counts: dict[str, int] = {}
        self.scratch: list[tuple[int, Signature]] = []  # (scratch node, its call's signature)
        self.paused = 0  # within unrecorded(): ops that are no part of the step

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Within: the ops run are not recorded (work on tensors that are no part of the step)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    supports_higher_order_operators = True  # a compiled program may call one (checkpointing's RNG state)

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    # -- what runs ---------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if any(is_traceable_wrapper_subclass(t) for t in _tensors((args, kwargs))):
            # a DTensor (tensor parallel) or a Float8 tensor: its own dispatch runs the ops on its plain
            # tensors, which come back here and are recorded; the wrapper holds no bytes of its own
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):  # one op here, whatever it runs inside
            with _pop_mode_temporarily():
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            for t in _tensors(out):
                self._made(t)
                self.pending.add(_key(t))
            return out
        written, write_only = _written_arguments(func, args, kwargs)
        write_only_keys = {_key(t) for t in write_only}
        inputs = _tensors((args, kwargs))
        reads = [t for t in inputs if _key(t) not in write_only_keys]
        input_keys = {_key(t) for t in inputs}
        made = [t for t in _tensors(out) if _key(t) not in input_keys and _key(t) not in self.sizes
                and _key(t) not in self.fixed]
        if not made and not written:
            return out  # a view, or an op on metadata: no data made or written
        for t in made:
            self._made(t)
        op = str(func)
        self._add(op, reads, [*made, *written], lambda: op_cost(self.profile, func, args, kwargs, out),
                  scratch=signature(op, args, kwargs) if op in SCRATCH_OPS else None)
        return out

    def kernel(self, call: KernelCall) -> None:
        """A generated kernel ran (:func:`bonsai_core.trace.inductor.kernel_calls` passes it here)."""
        if not call.writes:
            return

        def cost() -> float:
            moved = sum(t.numel() * t.element_size() for t in (*call.reads, *call.writes))
            return self.profile.cost(float(sum(t.numel() for t in call.writes)), moved)
        self._add("inductor." + call.name.rstrip("0123456789").rstrip("_"), list(call.reads), list(call.writes), cost,
                  name=call.name)

    def taken(self, t: torch.Tensor) -> None:
        """Autograd's ``AccumulateGrad`` took gradient ``t`` (made in the step) for its parameter: a node that
        stands for the taking, in place on the storage (no bytes of its own, no kernel: a kept buffer's
        ``add_`` is not counted), so the gradient lives until here and is the step's output from here."""
        key = _key(t)
        v = self.version.get(key)
        if v is None or self.paused:
            return
        self._counts["accumulate_grad"] = self._counts.get("accumulate_grad", 0) + 1
        node = self._node(ACCUMULATE_GRAD, f"accumulate_grad_{self._counts['accumulate_grad']}", [v],
                          self.sizes[key], _SEPARATE_COST, inplace_of=v)
        self.op_nodes.append(node)
        self.version[key] = node

    # -- nodes -------------------------------------------------------------------------------------

    def _made(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        self.sizes[key] = st.nbytes()
        self._finalizers.append(weakref.finalize(st, self._release, key))

    def _release(self, key: int) -> None:
        self.pending.discard(key)
        v = self.version.pop(key, None)
        self.sizes.pop(key, None)
        if v is not None:
            self.released.append((v, len(self.nodes)))

    def _value_of(self, t: torch.Tensor) -> int | None:
        """The node whose value ``t``'s storage holds; None for a fixed or earlier storage."""
        key = _key(t)
        if key in self.pending:  # read before any write: its value is the allocation's own
            self.pending.discard(key)
            self.version[key] = self._node("aten.empty_strided.default", "empty_strided", [], self.sizes[key],
                                           self.profile.launch)
            self.op_nodes.append(self.version[key])
        if key not in self.version and key not in self.sizes and key not in self.fixed:
            self.constants[key] = t.untyped_storage().nbytes()
        return self.version.get(key)

    def _node(self, op: str, name: str, deps: list[int], mem: int, cost: float, inplace_of: int | None = None) -> int:
        self.nodes.append({"name": name, "op": op, "phase": self.phase, "cost": cost, "mem": mem,
                           "deps": sorted(set(deps)), "inplace_of": inplace_of})
        return len(self.nodes) - 1

    def _add(self, op: str, reads: list[torch.Tensor], outputs: list[torch.Tensor], cost: Any,
             name: str | None = None, scratch: Signature | None = None) -> None:
        deps = [v for v in map(self._value_of, reads) if v is not None]
        targets: list[tuple[int, int | None]] = []  # (storage, node whose value it overwrites)
        for t in outputs:
            key = _key(t)
            if key in self.fixed or key not in self.sizes or any(key == k for k, _ in targets):
                continue  # a write into fixed memory (a gradient, a statistic) makes no bytes
            self.pending.discard(key)
            targets.append((key, self.version.get(key)))
        if name is None:
            short = op.split(".")[1] if op.startswith("aten.") else op
            self._counts[short] = self._counts.get(short, 0) + 1
            name = f"{short}_{self._counts[short]}"
        # a kernel's outputs are all allocated before it runs and its inputs freed after: each output
        # beyond the first is an allocation node read by the op, then a write of the op's into it
        allocated = {key: self._node("aten.empty_strided.default", f"{name}_buffer{i}", [], self.sizes[key],
                                     self.profile.launch) for i, (key, old) in enumerate(targets[1:], 1) if old is None}
        self.op_nodes += allocated.values()
        if scratch is not None:  # bytes filled in once measured (fill_scratch)
            deps.append(self._node("scratch", f"{name}_scratch", [], 0, _SEPARATE_COST))
            self.op_nodes.append(deps[-1])
            self.scratch.append((deps[-1], scratch))
        first_key, first_old = targets[0] if targets else (None, None)
        node = self._node(op, name, deps + [v for v in (first_old,) if v is not None] + list(allocated.values()),
                          self.sizes[first_key] if targets else 0, max(float(cost()), self.profile.launch),
                          inplace_of=first_old)
        self.op_nodes.append(node)
        if first_key is not None:
            self.version[first_key] = node
        for i, (key, old) in enumerate(targets[1:], 1):
            old = allocated.get(key, old)
            self.version[key] = self._node(op + ":write", f"{name}_write{i}", [node, old], self.sizes[key],
                                           _SEPARATE_COST, inplace_of=old)

    # -- the graph ---------------------------------------------------------------------------------

    def finish(self, outputs: Iterable[int] = ()) -> list[dict[str, Any]]:
        """The recorded nodes, with ``held`` deps for storages that died after their last reader (or
        live on after the step), but ``outputs``: storages the step made that live on as its results (the
        parameters' gradients), left as outputs nobody holds, as the eager trace leaves a gradient (the
        training loop decides how long it lives: :func:`bonsai_core.optimizer.with_grads`, FSDP's
        reduce-scatter). Call after the step's other tensors are gone."""
        for f in self._finalizers:
            f.detach()
        results = set(outputs)
        alive = [(v, len(self.nodes)) for key, v in self.version.items() if key not in results]
        self.version.clear()
        last_read = [-1] * len(self.nodes)
        for v, nd in enumerate(self.nodes):
            for d in nd["deps"]:
                last_read[d] = max(last_read[d], v)
        ops = self.op_nodes
        import bisect

        for v, made_before in [*self.released, *alive]:
            at = bisect.bisect_left(ops, made_before) - 1  # the last op before the storage died
            holder = ops[at] if at >= 0 else -1
            if holder > v and last_read[v] < holder:
                nd = self.nodes[holder]
                nd["deps"] = sorted({*nd["deps"], v})
                nd.setdefault("held", []).append(v)
                last_read[v] = holder
        return self.nodes
