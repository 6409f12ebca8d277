"""Module calls of a training step, located in its traced graph.

The AOTAutograd joint graph carries no module metadata, so the structure of the user's model (a
transformer block, a ResNet stage, an MLP) is recovered by running the step's forward + loss once more
on fake tensors: a dispatch mode records the aten ops (as selective activation checkpointing sees
them) and global module hooks record the op range of every module call. ``difflib`` aligns that op
sequence with the traced graph's forward nodes (same ops in the same order, up to views of parameters
and ``_unsafe_view``/``view``).

Two users: the trace stores each module call's span of forward nodes in the graph
(``Graph.modules``), which Bonsai turns into candidate segments and per-block seed plans; the
``checkpoint`` export back-end maps a plan's regions onto submodules.
"""

from __future__ import annotations

import difflib
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from bonsai_core.tensors import tensors_in

# Run-time ops and the names the traced (functionalized) graph gives them, one name for both on both
# sides: ``view`` where eager runs ``_unsafe_view``, batch norm's functional forms.
_SAME_OP = {"aten._unsafe_view.default": "aten.view.default",
            "aten._native_batch_norm_legit_functional.default": "aten.native_batch_norm.default",
            "aten._native_batch_norm_legit.default": "aten.native_batch_norm.default",
            "aten._native_batch_norm_legit_no_training.default": "aten.native_batch_norm.default",
            "aten.bernoulli_.float": "aten.bernoulli.p"}
# Functional ops whose in-place form has another overload name: the CPU dropout's ``bernoulli_(p)`` is
# traced as ``bernoulli.p``.
_IN_PLACE_OVERLOAD = {"aten.bernoulli.p": ("bernoulli_", "float")}


def _same_op(op: str) -> str:
    """The name both sides of :func:`align` compare: an in-place op (``aten.add_.Tensor``, BatchNorm's
    ``num_batches_tracked += 1``) is traced as its functional form (``aten.add.Tensor``)."""
    op = _SAME_OP.get(op, op)
    parts = op.split(".")
    if len(parts) == 3 and parts[1].endswith("_") and not parts[1].startswith("_"):
        parts[1] = parts[1][:-1]
    return ".".join(parts)


def in_place_overload(op: Any) -> Any:
    """The in-place overload eager runs for the functional aten ``op`` of a traced graph, or None:
    same overload name (``aten.relu.default`` -> ``aten.relu_.default``, ``aten.add.Tensor`` ->
    ``aten.add_.Tensor``), except where the two names differ (``aten.bernoulli.p`` -> ``aten.bernoulli_.float``)."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    packet_name, overload = _IN_PLACE_OVERLOAD.get(str(op), (op._schema.name.split("::")[-1] + "_", op._overloadname))
    packet = getattr(torch.ops.aten, packet_name, None)
    return getattr(packet, overload, None) if packet is not None else None


@dataclass(frozen=True)
class RecordedStep:
    """The aten ops of one forward + loss as SAC's policy sees them, each module call's op range, and
    the ops that wrote an activation in place."""

    ops: list[str]
    calls: list[tuple[str, int, int]]  # (module path, first op, one past the last op), model modules only
    call_counts: Counter
    inplace: list[tuple[int, int]] = ()  # (in-place op, the op whose whole output it overwrote)
    # (in-place op, the op whose output it wrote through a view), and (an op whose output aliases that
    # output without being a view of it, such as unsafe_chunk's, the same op) for each such alias made
    # before a write through a view: ATen's CPU GRU cell writes its gates into unsafe_chunk's parts of
    # linear_hh's output, which is then no longer what the linear made
    view_writes: list[tuple[int, int]] = ()
    # (the ops that made and then wrote the storage in place, in order; ops run before Python dropped it;
    # which output of the first op it was; the forward op whose autograd node, running then, had saved
    # it, or -1): the forward's own lifetimes, as the model's code holds them (len(ops): held until the
    # loss function returned); with the backward pass recorded, op indices run on into ``backward_ops``
    # and count autograd's releases too
    released: list[tuple[tuple[int, ...], int, int, int]] = ()
    backward_ops: list[str] = ()  # the aten ops of ``loss.backward()``, as eager's autograd engine runs them
    # per entry of ``calls``, per storage the call took as a tensor argument (positional or keyword: what
    # ``torch.utils.checkpoint`` keeps for a recomputation of the call), the ops that made and wrote it
    # (the first output of the first)
    arguments: list[tuple[tuple[int, ...], ...]] = ()
    # the first op (index into ops + backward_ops) of each autograd node the backward pass ran, in order
    node_starts: list[int] = ()
    # per forward op, the recorded op that made the bytes of its first tensor output (itself for fresh
    # bytes, the base's maker for a view or alias; -1: bytes no recorded op made, a parameter's, the batch's)
    bytes_made_by: list[int] = ()


class _OpRecorder(TorchDispatchMode):
    """Records each op's name and, for an in-place op (``relu_``, ``add_``) whose first argument is the
    whole output of an earlier recorded op, that pair: an activation written in place. Writes into
    parameters, buffers, the batch or views are not activations' and are left out. While ``tracking``,
    also when each storage an op made is dropped (``released``: a weakref finalizer on the storage), and
    whether the autograd node then running had saved it (``saved``, ``saver``: set as the node starts)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.checkpoint import SAC_IGNORED_OPS

        self.ignored = SAC_IGNORED_OPS
        self.ops: list[str] = []
        self.inplace: list[tuple[int, int]] = []
        self.view_writes: list[tuple[int, int]] = []
        self.made_by: dict[int, int] = {}  # storage address -> the recorded op whose output it last was (-1: other)
        self.aliases: dict[int, list[int]] = {}  # storage address -> recorded ops whose outputs alias it, not views
        self.output: dict[int, int] = {}  # storage address -> which output of its op it is
        self.live: set[int] = set()  # storage addresses whose release is watched
        self.writers: dict[int, list[int]] = {}  # storage address -> the recorded ops that made, then wrote it
        self.released: list[tuple[tuple[int, ...], int, int, int]] = []
        # per forward op, autograd's sequence number as it ran: that of the node it made, if it made one
        self.sequence: list[int] = []
        self.saved: frozenset[int] = frozenset()  # storage addresses the running autograd node saved
        self.saver = -1  # the forward op that made the running autograd node (-1: none recorded)
        self.tracking = True
        self.forward = True  # in-place writes are the forward's (the backward's accumulate gradients)
        self.finalizers: list[weakref.finalize] = []
        self.bytes_made_by: list[int] = []  # per recorded op: RecordedStep.bytes_made_by

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        at = -1
        if func not in self.ignored:
            at = len(self.ops)
            self.ops.append(str(func))
            if self.forward:
                self.sequence.append(torch.autograd._get_sequence_nr() - 1)  # made before the op runs below it
                self._note_write(func, args, at)
        read = None
        for k, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and not t._is_view():
                key = _storage(t)
                if key not in self.live:  # every storage, so that a new one at a dead one's address is seen
                    self.live.add(key)
                    self.finalizers.append(weakref.finalize(t.untyped_storage(), self._release, key))
                # an ignored op's alias (autograd's detach), an in-place view (transpose_) or an alias of an
                # input a kernel makes without a view's autograd record (a C++ kernel's select) writes no data
                writes = at >= 0 and torch.Tag.inplace_view not in func.tags
                if writes:
                    read = read if read is not None else {_storage(x) for x in tensors_in((args, kwargs))}
                    writes = key not in read or _writes_first_argument(func, args)
                if writes or key not in self.made_by:
                    self.made_by[key] = at if writes else -1
                if writes:
                    self.output.setdefault(key, k)
                    self.writers.setdefault(key, []).append(at)
                elif at >= 0 and self.made_by[key] >= 0 and self.aliases.get(key, [None])[-1] != at:
                    self.aliases.setdefault(key, []).append(at)  # unsafe_chunk's parts: not views, same bytes
        if at >= 0:
            first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)), None)
            self.bytes_made_by.append(self.writers.get(_storage(first), [-1])[0] if first is not None else -1)
        return out

    def _note_write(self, func: Any, args: tuple, at: int) -> None:
        if not _writes_first_argument(func, args) or self.made_by.get(_storage(args[0]), -1) < 0:
            return
        key = _storage(args[0])
        made = self.made_by[key]  # the op that made (or last wrote whole) the bytes, not an alias of them
        self.view_writes.extend((a, made) for a in self.aliases.pop(key, ()))
        # whole, or through a view or an alias (ATen's CPU RNN cells' gates)
        (self.inplace if _written_in_place(func, args) is not None else self.view_writes).append((at, made))

    def made_first(self, tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
        """Per storage of ``tensors`` that a recorded op's first output made, the recorded ops that made
        and then wrote it, in order."""
        keys = {_storage(t) for t in tensors}
        return tuple(sorted(tuple(self.writers[k]) for k in keys if k in self.writers and self.output.get(k) == 0))

    def _release(self, key: int) -> None:
        self.live.discard(key)
        self.aliases.pop(key, None)
        self.made_by.pop(key, None)
        writers, k = self.writers.pop(key, ()), self.output.pop(key, 0)
        if self.tracking and writers:
            self.released.append((tuple(writers), len(self.ops), k, self.saver if key in self.saved else -1))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _writes_first_argument(func: Any, args: tuple) -> bool:
    """Whether an aten op writes its first argument in place (whole or a view of it)."""
    schema = func._schema
    if not (schema.name.endswith("_") and schema.arguments and args and isinstance(args[0], torch.Tensor)):
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _written_in_place(func: Any, args: tuple) -> torch.Tensor | None:
    """The tensor an in-place aten op (``aten.relu_``, ``aten.add_.Tensor``: a name ending in ``_``, its
    first argument written) overwrites whole, or None."""
    schema = func._schema
    if not (schema.name.endswith("_") and schema.arguments and args and isinstance(args[0], torch.Tensor)):
        return None
    alias = schema.arguments[0].alias_info
    t = args[0]
    if alias is None or not alias.is_write or t._is_view() or t.untyped_storage().nbytes() != t.nbytes:
        return None
    return t


def record_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
                backward: bool = False) -> RecordedStep:
    """Run ``loss_fn(model(*inputs))`` once (with grad, as in training) and record it. Cheap on fake tensors.
    Packed sequences there take the batch sizes :func:`bonsai_core.packed.known_batch_sizes` holds.
    With ``backward`` (``model`` on fake tensors: its gradients are put back as they were), also
    ``loss.backward()``: its ops and when autograd's engine drops each storage (``RecordedStep.backward_ops``)."""
    from bonsai_core.ctc import register_ctc_shapes
    from bonsai_core.packed import PackedSequences

    register_ctc_shapes()

    names = {id(m): name for name, m in model.named_modules()}
    recorder = _OpRecorder()
    open_calls: list[tuple[str, int]] = []
    calls: list[tuple[str, int, int]] = []
    counts: Counter = Counter()

    def pre(module: nn.Module, _args: Any) -> None:
        if id(module) in names:
            open_calls.append((names[id(module)], len(recorder.ops)))

    def post(module: nn.Module, args: Any, kwargs: Any, _out: Any) -> None:
        if id(module) in names and open_calls:
            path, start = open_calls.pop()
            calls.append((path, start, len(recorder.ops)))
            counts[path] += 1
            arguments.append(recorder.made_first(tensors_in((args, kwargs))))

    arguments: list[tuple[tuple[int, ...], ...]] = []
    # a call's range is its forward alone, as torch.utils.checkpoint wraps it: the module's own pre-hooks
    # (tensor parallel's input all-gather, FSDP's) run before it and its own post-hooks after, outside the
    # checkpoint, so SAC's count of the ops inside does not see theirs
    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre),
                                                   m.register_forward_hook(post, with_kwargs=True, prepend=True))]
    grads = {p: p.grad for p in model.parameters()}
    n_forward = None
    try:
        with torch.enable_grad(), PackedSequences(), recorder:
            out = model(*inputs)
            loss = loss_fn(out)
            del out  # the model's output (logits, a key/value cache) lives until the loss function returns
            n_forward = len(recorder.ops)
            recorder.tracking = backward  # what dies with the loss is the backward pass's
            recorder.forward = False
            for h in hooks:
                h.remove()
            if backward:
                starts = _node_starts(loss, recorder)
                loss.backward()
            del loss
    finally:
        for h in hooks:
            h.remove()
        for f in recorder.finalizers:  # storages a module keeps (a cache) would keep the recorder alive
            f.detach()
        for p, grad in grads.items():
            p.grad = grad
    ops = recorder.ops
    return RecordedStep(ops[:n_forward], calls, counts, recorder.inplace, recorder.view_writes, recorder.released,
                        ops[n_forward:], arguments, starts if backward else [], recorder.bytes_made_by[:n_forward])


def _node_starts(loss: torch.Tensor, recorder: _OpRecorder) -> list[int]:
    """A list that ``loss.backward()`` fills with the first op of each autograd node it runs (a pre-hook on
    every node of the graph; a pre-hook changes nothing the node holds, where a post-hook would keep its
    inputs for the hook). The pre-hook also tells ``recorder`` the storages the node saved
    (:func:`_saved_storages`) and the forward op that made it (the first whose autograd sequence number
    is the node's), both found before the backward pass: the hook holds no reference to the node."""
    starts: list[int] = []
    made_by: dict[int, int] = {}
    for op, number in enumerate(recorder.sequence):  # an op that makes no node repeats the last number
        made_by.setdefault(number, op)

    def starting(saved: frozenset[int], saver: int) -> None:
        starts.append(len(recorder.ops))
        recorder.saved, recorder.saver = saved, saver

    seen, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        fn.register_prehook(lambda _grads, saved=_saved_storages(fn), saver=made_by.get(fn._sequence_nr(), -1):
                            starting(saved, saver))
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return starts


def _saved_storages(fn: Any) -> frozenset[int]:
    """The storages autograd node ``fn`` saved for its backward: a built-in node's ``_saved_<name>``
    tensors, a custom Function's ``saved_tensors``. It holds them until it has run, whatever its formula
    reads of them (``gather``'s input only for its shape)."""
    values = []
    for name in dir(fn):
        if name.startswith("_saved_") or name == "saved_tensors":
            try:
                values.append(getattr(fn, name))
            except RuntimeError:  # freed already, or not saved in this configuration
                continue
    return frozenset(_storage(t) for t in tensors_in(values))


def held_until(step: RecordedStep, forward_ops: list[str],
               backward_ops: list[str] = ()) -> list[tuple[int, int, int, frozenset[int] | None]]:
    """(v, w, k, node) positions in the traced ops (``forward_ops``, then ``backward_ops`` when the step's
    backward pass was recorded): eager dropped the k-th output of the traced op at v only after the one at
    w (the last placed op before the release), for the recorded releases the alignment places. The two
    passes are aligned apart: a backward matmul is never placed on a forward one. ``node``: for a release
    while the backward pass ran, the traced positions of the autograd node that ran then (the graph's
    readers of v among them tell a saved tensor, an incoming gradient or a formula's temporary, which the
    node holds, from an op the alignment misplaced), and, where the node had saved the tensor, the forward
    op that made the node (it held what that op read, whatever its traced formula reads of it: ``gather``'s
    input, only for its shape); None for the forward's and for what outlives ``loss.backward()``. (The
    release's node is that of the last placed op before it: eager's engine may copy a gradient into the
    strides it expects after a node's ops, the first time a kernel runs.)"""
    later = align(list(step.backward_ops), list(backward_ops))
    at = np.concatenate([align(step.ops, forward_ops), np.where(later >= 0, later + len(forward_ops), -1)])
    placed = np.maximum.accumulate(np.where(at >= 0, np.arange(len(at)), -1)) if len(at) else at
    starts = list(step.node_starts) + [len(at)]
    out = []
    for writers, p, k, saver in step.released:
        i = writers[-1]  # the op whose output holds the bytes last (the traced graph's in-place chains end there)
        j = int(placed[p - 1]) if p > 0 else -1
        if at[i] >= 0 and j >= 0 and at[j] > at[i]:
            node = None
            if len(step.ops) < p < len(at):  # the node of the last placed op: a node's copy of a gradient into
                n = int(np.searchsorted(starts, j, side="right")) - 1  # its expected strides may come after
                node = frozenset(int(x) for x in at[starts[max(n, 0)]:starts[n + 1]] if x >= 0) if n >= 0 else frozenset()
                if saver >= 0 and at[saver] >= 0:  # the node saved it: the forward op that made the node read it
                    node |= {int(at[saver])}
            out.append((int(at[i]), int(at[j]), k, node))
    return out


def align(runtime_ops: list[str], traced_ops: list[str]) -> np.ndarray:
    """int64[len(runtime_ops)]: the traced forward position each run-time op is, or -1.

    Matches ops in order (``difflib``): run-time-only ops (views of parameters, casts, a CPU batch
    norm's ``empty``, a CPU dropout's ``bernoulli_``) stay -1 and split the matching runs where the
    two programs differ. The traced side's ``getitem`` nodes (FX's picks from a tuple, never a kernel)
    are left out before matching: a batch norm's five of them drew a longest common run away from the
    true one."""
    runtime = [_same_op(op) for op in runtime_ops]
    b_at = [j for j, op in enumerate(traced_ops) if op != "getitem"]
    matcher = difflib.SequenceMatcher(None, runtime, [_same_op(traced_ops[j]) for j in b_at], autojunk=False)
    at = np.full(len(runtime_ops), -1, dtype=np.int64)
    for block in matcher.get_matching_blocks():
        at[block.a:block.a + block.size] = [b_at[block.b + k] for k in range(block.size)]
    return at


def inplace_pairs(step: RecordedStep, forward_ops: list[str]) -> list[tuple[int, int]]:
    """(v, u) forward positions: the traced op at v is one eager ran in place on the output of u, for the
    recorded in-place writes whose two ops the alignment with ``forward_ops`` places."""
    at = align(step.ops, forward_ops)
    return [(int(at[i]), int(at[p])) for i, p in step.inplace if at[i] >= 0 and at[p] >= 0]


def module_spans(step: RecordedStep, forward_ops: list[str]) -> list[tuple[str, int, int]]:
    """(module path, first, last) forward positions (inclusive) of every submodule called once in
    ``step`` (not the whole model), in call order, for the ops the alignment with ``forward_ops`` (the
    graph's forward ops in listed order) places. A call none of whose ops is placed is left out."""
    at = align(step.ops, forward_ops)
    spans = []
    for path, a, b in step.calls:
        if not path or step.call_counts[path] != 1:
            continue
        placed = at[a:b][at[a:b] >= 0]
        if len(placed):
            spans.append((path, int(placed.min()), int(placed.max())))
    return sorted(spans, key=lambda s: (s[1], -s[2]))
