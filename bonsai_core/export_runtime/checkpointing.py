# ---- bonsai checkpoint runtime (from bonsai_core/export_runtime/checkpointing.py; plain PyTorch only) ----
"""Checkpoint chosen submodules of a model with a selective-activation-checkpointing (SAC) save policy.

``bonsai export --backend checkpoint`` copies this text into every ``checkpointed.py`` it writes, and
``bonsai_core.checkpoint`` (the one call in a training script) imports it: one definition of what a
checkpoint-region plan does at run time.

A plan is a ``save`` dict: submodule path -> {aten op name: [k, ...]}. Each named submodule's forward
runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant); inside one forward of it the k-th call
of an op keeps its output for the backward pass if k is listed under the op (MUST_SAVE), and every other
op is recomputed in the backward pass (PREFER_RECOMPUTE). Ops are counted per name, not per shape, so a
plan holds at any batch size and under autocast.

A recomputation re-runs the submodule's forward, so it would update a buffer the forward updates
(BatchNorm's running statistics, its batch counter) a second time; the buffers the forward wrote are put
back after the recomputation, so they change once per step, as without checkpointing.
"""

import contextlib
import functools
import json
import sys
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# The fused attention kernels F.scaled_dot_product_attention may run, whichever device runs it (the CPU's
# flash kernel stands for a GPU's in a trace), and the one name a plan gives them all.
FUSED_ATTENTION = tuple(f"aten.{kernel}.default" for kernel in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable"))
SAME_OP = dict.fromkeys(FUSED_ATTENTION, "scaled_dot_product_attention")


class OpCalls:
    """SAC's count of the ops inside one forward of a submodule: called with each op in turn, says its
    name (SAME_OP's for a fused attention kernel) and k, its calls of that name before it."""

    def __init__(self):
        self.seen = Counter()

    def __call__(self, op):
        name = SAME_OP.get(str(op), str(op))
        k = self.seen[name]
        self.seen[name] += 1
        return name, k


def kv_cache_type():
    """transformers' key/value cache class (``transformers.cache_utils.Cache``) once transformers is
    imported, else None."""
    return getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)


def without_caches(forward, cache_type):
    """``forward`` called with every ``cache_type`` argument (None: no type) replaced by None, as
    transformers' own gradient checkpointing does: a cache passed into a checkpointed submodule would be
    appended to again by its recomputation, which then runs other ops than its forward did."""
    return functools.partial(_call_without_caches, forward, cache_type)


def _call_without_caches(forward, cache_type, *args, **kwargs):
    if cache_type is None:
        return forward(*args, **kwargs)
    return forward(*(None if isinstance(a, cache_type) else a for a in args),
                   **{k: None if isinstance(v, cache_type) else v for k, v in kwargs.items()})


def policy(saves):
    """A SAC policy for one forward of a checkpointed submodule (called once per op, in order)."""
    calls = {False: OpCalls(), True: OpCalls()}  # older torch also asks during the recomputation

    def decide(ctx, op, *args, **kwargs):
        name, k = calls[ctx.is_recompute](op)
        return CheckpointPolicy.MUST_SAVE if k in saves.get(name, ()) else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def contexts(saves):
    """The (forward, recomputation) contexts of one checkpointed call, with a fresh policy."""
    return create_selective_checkpoint_contexts(policy(saves))


def saves_as_text(saves):
    """``saves`` (op name -> [k, ...]) as the one string a checkpoint's ``context_fn`` carries. torch.compile
    reads that ``context_fn`` as a constant; a string stays one, whereas an int in a dict or list that
    differs between the blocks sharing one compiled function becomes a dynamic value on recompilation
    (automatic dynamic shapes), and the checkpoint then cannot be traced ("Not a Python constant")."""
    return json.dumps({op: [int(k) for k in calls] for op, calls in saves.items()}, sort_keys=True)


def contexts_of_text(make_contexts, text):
    """``make_contexts`` of the saves that :func:`saves_as_text` wrote as ``text``."""
    return make_contexts(json.loads(text))


@contextlib.contextmanager
def buffer_writes_noted(context, module, written):
    """``context``; the first time, ``written`` is filled with the names of the buffers of ``module``
    whose values change within it (by value: BatchNorm's kernel updates its statistics without telling
    the tensors' version counters)."""
    if written:
        with context:
            yield
        return
    before = {name: b.detach().clone() for name, b in module.named_buffers()}
    with context:
        yield
    try:
        changed = [name for name, b in module.named_buffers() if name in before and not torch.equal(b, before[name])]
    except Exception:  # noqa: BLE001 (tensors without values, as when bonsai checks a plan on fake tensors)
        return
    written.update(changed)
    written.add("")  # noted: the next forwards skip the comparison


@contextlib.contextmanager
def buffer_writes_undone(context, module, written):
    """``context``, putting back afterwards the buffers of ``module`` named in ``written``."""
    buffers = dict(module.named_buffers())
    kept = {name: buffers[name].detach().clone() for name in written if name in buffers}
    try:
        with context:
            yield
    finally:
        with torch.no_grad():
            for name, value in kept.items():
                buffers[name].copy_(value)


def stateful_contexts(make_contexts, text, module, written):
    """``make_contexts`` of the saves written as ``text``, with the buffers the forward writes put back
    after the recomputation. Under torch.compile the step is functional (a buffer's write is applied
    once, after the graph), so the contexts are the plain ones there."""
    forward, recompute = contexts_of_text(make_contexts, text)
    if torch.compiler.is_compiling():
        return forward, recompute
    return buffer_writes_noted(forward, module, written), buffer_writes_undone(recompute, module, written)


def checkpointed(forward, saves, make_contexts=contexts, module=None):
    """``forward`` run under non-reentrant checkpointing with the save policy ``saves`` (a
    ``functools.partial`` of torch's own ``checkpoint``, which torch.compile knows), never handed a
    key/value cache (see ``without_caches``): the cache is taken out of the call's arguments before
    ``checkpoint`` keeps them for the recomputation, else it would hold every key and value later layers
    append to it until this submodule's backward pass. ``make_contexts(saves)`` makes each call's
    contexts. When ``module`` (the submodule ``forward`` belongs to) has buffers, the recomputation leaves
    them as the forward left them. The call goes through a Python function (``_call_without_caches``)
    even without transformers, so that ``torch.compile(module)`` has a frame to trace: torch's
    ``checkpoint`` itself is a frame dynamo skips."""
    text = saves_as_text(saves)
    context_fn = functools.partial(contexts_of_text, make_contexts, text)
    if module is not None and next(module.buffers(), None) is not None:
        context_fn = functools.partial(stateful_contexts, make_contexts, text, module, set())
    wrapped = functools.partial(checkpoint, forward, use_reentrant=False, context_fn=context_fn)
    wrapped = without_caches(wrapped, kv_cache_type())
    wrapped.original_forward = forward  # what remove_checkpoints puts back
    return wrapped


def is_checkpointed(module):
    """Whether ``module``'s forward was wrapped by :func:`checkpointed`."""
    return isinstance(module.forward, functools.partial) and hasattr(module.forward, "original_forward")


def apply_saves(model, save, made_for="this model", make_contexts=contexts):
    """Checkpoint ``model``'s submodules named in ``save`` with their save policies (in place); return
    ``model``. ``made_for`` names the model the plan was made for, in errors."""
    modules = dict(model.named_modules())
    missing = [path for path in save if path not in modules]
    if missing:
        raise ValueError(f"The model has no submodule {missing[0]!r}: this plan was made for {made_for!r} "
                         f"({type(model).__name__} differs). Make the plan again for this model.")
    twice = [path for path in save if is_checkpointed(modules[path])]
    if twice:
        raise ValueError(f"Submodule {twice[0]!r} is already checkpointed: apply a plan once "
                         "(remove_checkpoints(model) undoes one).")
    for path, saves in save.items():
        modules[path].forward = checkpointed(modules[path].forward, saves, make_contexts, modules[path])
    return model


def remove_checkpoints(model):
    """Undo :func:`apply_saves` and :func:`apply_offloads` on ``model`` (in place): every checkpointed
    submodule runs its own forward again, and nothing is offloaded. Returns the paths it restored."""
    restored = []
    for path, module in model.named_modules():
        while is_checkpointed(module) or is_offloading(module):
            original = module.forward.original_forward
            if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is type(module).forward:
                del module.forward  # the class's own forward again
            else:
                module.forward = original
            if path not in restored:
                restored.append(path)
    return restored


# -- offload to host (simulator rule 9): saved tensors the plan copies to host memory ----------------
#
# A plan may offload forward tensors that are computed once, kept (outside every checkpointed
# submodule) and read by the backward pass: the ``offload`` dict names them as ``save`` names ops,
# submodule path -> {aten op: [k, ...]} (the output of the k-th call of that op inside one forward of
# that submodule). As ``torch.autograd.graph.save_on_cpu`` and torchtune's activation offloading do, a
# saved-tensor pack hook copies such a tensor to host memory when autograd saves it, so the device
# bytes go when the forward pass drops the tensor, and the unpack hook copies it back when the
# backward pass first reads it. Only the planned tensors move: a light dispatch mode inside the named
# submodules counts their ops and notes the storages of the planned outputs; the pack hook offloads a
# saved tensor whose storage is noted (a saved view of it comes back as the same view of the copy).

def _is_fake(tensor):
    """Whether ``tensor`` holds no data (a fake or meta tensor: bonsai checks a plan on those)."""
    from torch._subclasses.fake_tensor import is_fake

    return tensor.is_meta or is_fake(tensor)


_OFFLOAD_STREAMS = {}


def _offload_stream(direction, device):
    """The one CUDA copy stream of ``direction`` ("d2h" or "h2d") on ``device``."""
    key = (direction, device.index)
    if key not in _OFFLOAD_STREAMS:
        _OFFLOAD_STREAMS[key] = torch.cuda.Stream(device)
    return _OFFLOAD_STREAMS[key]


class HostCopy:
    """One offloaded storage: its host copy, made now, and the device copy the backward pass reads,
    made at the first unpack and dropped once every saved tensor of the storage was unpacked."""

    def __init__(self, base):
        self.device = base.device
        self.pending = 0  # saved tensors of this storage not unpacked yet
        self.reloaded = None
        self.event = None
        if self.device.type != "cuda" or _is_fake(base):
            # the CPU's device and host memory are one: a copy that a measuring dispatch mode counts apart
            self.host = base.clone()
            from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

            for mode in _get_current_dispatch_mode_stack():
                if hasattr(mode, "count_on_host"):
                    mode.count_on_host(self.host)
            return
        stream = _offload_stream("d2h", self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.host = torch.empty_like(base, device="cpu", pin_memory=True)
            self.host.copy_(base, non_blocking=True)
        base.record_stream(stream)  # the device block is given back when the copy has ended
        self.event = stream.record_event()

    def unpacked(self):
        """The device copy (copied back at the first call), for one saved tensor."""
        value = self.reloaded
        if value is None:
            if self.device.type != "cuda" or _is_fake(self.host):
                value = self.host.clone()
            else:
                stream = _offload_stream("h2d", self.device)
                value = torch.empty_like(self.host, device=self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                stream.wait_event(self.event)
                with torch.cuda.stream(stream):
                    value.copy_(self.host, non_blocking=True)
                value.record_stream(stream)
                torch.cuda.current_stream(self.device).wait_stream(stream)
        self.pending -= 1
        self.reloaded = value if self.pending > 0 else None
        return value


class Offloader:
    """The saved-tensor hooks of one model: storages noted by :class:`OffloadCounter`, offloaded when
    autograd saves them. ``packed`` / ``noted`` (when not None) collect the names of what was found."""

    def __init__(self):
        self.noted = {}  # storage key -> (weakref to the storage, the planned output's name)
        self.copies = {}  # storage key -> its HostCopy, for this forward
        self.busy = False  # inside a hook: the counters do not count the hooks' own ops
        self.packed = None  # names of planned outputs offloaded, when collecting (bonsai's check)
        self.found = None  # name -> weakref to its storage, when collecting

    def note(self, tensor, name):
        storage = tensor.untyped_storage()
        self.noted[storage._cdata] = (weakref.ref(storage), name)
        self.copies.pop(storage._cdata, None)  # a new storage at a reused address
        if self.found is not None:
            self.found[name] = weakref.ref(storage)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self.noted.get(key)
        if entry is None or entry[0]() is not storage:
            return tensor
        copy = self.copies.get(key)
        if copy is None:
            self.busy = True
            try:
                with torch.no_grad():
                    whole = tensor.detach().as_strided((storage.nbytes() // tensor.element_size(),), (1,), 0)
                    copy = self.copies[key] = HostCopy(whole)
            finally:
                self.busy = False
            if self.packed is not None:
                self.packed.add(entry[1])
        copy.pending += 1
        return copy, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        copy, shape, stride, offset = packed
        self.busy = True
        try:
            with torch.no_grad():
                return copy.unpacked().as_strided(shape, stride, offset)
        finally:
            self.busy = False

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def forget(self):
        """After a forward: the next one notes its own storages (the copies live with autograd's graph)."""
        self.noted.clear()
        self.copies.clear()


class OffloadCounter(TorchDispatchMode):
    """Inside one forward of a submodule: counts its ops as SAC does (by name, SAME_OP's names) and
    notes the output storage of each call ``offload`` names (op -> [k, ...]) with ``offloader``."""

    def __init__(self, offload, offloader, path):
        super().__init__()
        self.offload = offload
        self.offloader = offloader
        self.path = path
        self.calls = OpCalls()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.checkpoint import SAC_IGNORED_OPS

        out = func(*args, **(kwargs or {}))
        if self.offloader.busy or func in SAC_IGNORED_OPS:
            return out
        name, k = self.calls(func)
        if k in self.offload.get(name, ()) and isinstance(out, torch.Tensor):
            self.offloader.note(out, (self.path, name, k))
        return out


def offloading(forward, offload, offloader, path, hooks=False):
    """``forward`` run with ``offload``'s outputs noted (an :class:`OffloadCounter`) and, with
    ``hooks`` (the model's own forward), under ``offloader``'s saved-tensor hooks."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            if hooks:
                stack.enter_context(offloader.hooks())
            if offload:
                stack.enter_context(OffloadCounter(offload, offloader, path))
            try:
                return forward(*args, **kwargs)
            finally:
                if hooks:
                    offloader.forget()

    run.original_forward = forward  # what remove_checkpoints puts back
    run.offloader = offloader
    return run


def is_offloading(module):
    """Whether ``module``'s forward was wrapped by :func:`offloading`."""
    return hasattr(module.forward, "offloader") and hasattr(module.forward, "original_forward")


def apply_offloads(model, offload, made_for="this model"):
    """Offload the saved tensors ``offload`` names (submodule path -> {aten op: [k, ...]}) to host
    memory in every training step of ``model`` (in place; after :func:`apply_saves`); return the
    :class:`Offloader`. ``remove_checkpoints`` undoes it."""
    modules = dict(model.named_modules())
    missing = [path for path in offload if path not in modules]
    if missing:
        raise ValueError(f"The model has no submodule {missing[0]!r}: this plan was made for {made_for!r} "
                         f"({type(model).__name__} differs). Make the plan again for this model.")
    offloader = Offloader()
    for path in sorted(set(offload) | {""}, key=len, reverse=True):  # the model's own forward last (outermost)
        module = modules[path]
        module.forward = offloading(module.forward, offload.get(path, {}), offloader, path, hooks=path == "")
    return offloader
