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
import sys
from collections import Counter

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# One name for the fused attention kernel whichever device runs it (op names in a plan use it too).
SAME_OP = {f"aten.{kernel}.default": "scaled_dot_product_attention"
           for kernel in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                          "_scaled_dot_product_fused_attention_overrideable")}


def kv_cache_type():
    """transformers' key/value cache class (``transformers.cache_utils.Cache``) once transformers is
    imported, else None."""
    return getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)


def without_caches(forward, cache_type):
    """``forward`` called with every ``cache_type`` argument replaced by None, as transformers' own
    gradient checkpointing does: a cache passed into a checkpointed submodule would be appended to
    again by its recomputation, which then runs other ops than its forward did."""

    def call(*args, **kwargs):
        return forward(*(None if isinstance(a, cache_type) else a for a in args),
                       **{k: None if isinstance(v, cache_type) else v for k, v in kwargs.items()})

    return call


def policy(saves):
    """A SAC policy for one forward of a checkpointed submodule (called once per op, in order)."""
    seen = {False: Counter(), True: Counter()}  # older torch also asks during the recomputation

    def decide(ctx, op, *args, **kwargs):
        name = SAME_OP.get(str(op), str(op))
        k = seen[ctx.is_recompute][name]
        seen[ctx.is_recompute][name] += 1
        return CheckpointPolicy.MUST_SAVE if k in saves.get(name, ()) else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def contexts(saves):
    """The (forward, recomputation) contexts of one checkpointed call, with a fresh policy."""
    return create_selective_checkpoint_contexts(policy(saves))


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


def stateful_contexts(make_contexts, saves, module, written):
    """``make_contexts(saves)``, with the buffers the forward writes put back after the recomputation."""
    forward, recompute = make_contexts(saves)
    return buffer_writes_noted(forward, module, written), buffer_writes_undone(recompute, module, written)


def checkpointed(forward, saves, make_contexts=contexts, module=None):
    """``forward`` run under non-reentrant checkpointing with the save policy ``saves`` (a
    ``functools.partial`` of torch's own ``checkpoint``, which torch.compile knows), never handed a
    key/value cache (see ``without_caches``). ``make_contexts(saves)`` makes each call's contexts.
    When ``module`` (the submodule ``forward`` belongs to) has buffers, the recomputation leaves them
    as the forward left them."""
    cache = kv_cache_type()
    context_fn = functools.partial(make_contexts, saves)
    if module is not None and next(module.buffers(), None) is not None:
        context_fn = functools.partial(stateful_contexts, make_contexts, saves, module, set())
    wrapped = functools.partial(checkpoint, forward if cache is None else without_caches(forward, cache),
                                use_reentrant=False, context_fn=context_fn)
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
    """Undo :func:`apply_saves` on ``model`` (in place): every checkpointed submodule runs its own
    forward again. Returns the paths it restored."""
    restored = []
    for path, module in model.named_modules():
        if is_checkpointed(module):
            original = module.forward.original_forward
            if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is type(module).forward:
                del module.forward  # the class's own forward again
            else:
                module.forward = original
            restored.append(path)
    return restored
