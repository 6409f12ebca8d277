# ---- bonsai export runtime (copied from bonsai_core/export_runtime/runtime.py; plain PyTorch only) ----
"""Run one training step (forward, loss, backward) of a model in the order a rematerialization
schedule prescribes.

The step is the AOTAutograd joint graph that ``bonsai trace`` traced: aten ops, one generated line per
scheduled ``compute`` and a ``del`` per scheduled ``free``, so Python frees each tensor exactly where
the schedule does and a recomputed tensor is simply computed again. A schedule that offloads saved
tensors to host memory gets an ``offload`` / ``reload`` / ``ready`` call per such op (copy streams below). ``forward_part`` runs the ops up to
the loss inside ``torch.autograd.Function.forward``; ``backward_part`` runs the rest (the recomputations
and the gradients) when autograd calls the Function's ``backward``.
"""

from __future__ import annotations

import contextlib
import math  # noqa: F401  (the generated program writes inf / nan as math.inf / math.nan)
import os
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.nn as nn

GRAD_MODES = ("autograd", "direct")


class Program(NamedTuple):
    """A generated training step: the placeholders it reads and its two scheduled halves.

    (A NamedTuple, not a dataclass: the file then loads with the plain ``importlib`` recipe, without
    being put into ``sys.modules`` first.)"""

    params: Sequence[tuple[str, tuple[int, ...], str, bool]]  # model parameter name, shape, dtype, requires_grad
    buffers: Sequence[tuple[str, str, tuple[int, ...], str]]  # owner ("model" | "loss_fn"), name, shape, dtype
    inputs: Sequence[tuple[tuple[int, ...], str]]  # shape, dtype of each model input
    constants: Sequence[str]  # tensors the traced model created itself (saved in constants.pt)
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    info: dict[str, Any]


def load_constants(program_file: str, names: Sequence[str]) -> list[torch.Tensor]:
    """The traced step's tensor constants, from ``constants.pt`` next to ``program_file``."""
    if not names:
        return []
    saved = torch.load(os.path.join(os.path.dirname(os.path.abspath(program_file)), "constants.pt"), weights_only=True)
    return [saved[name] for name in names]


# -- random ops: a recomputation draws what the first computation drew ----------------------------

def rng_state(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The generator state random ops on ``dev`` draw from (CPU's, and the device's on CUDA)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)


@contextlib.contextmanager
def replay_rng(state: tuple[torch.Tensor, torch.Tensor | None], dev: torch.device) -> Iterator[None]:
    """Run with the generator at ``state`` (saved before the first computation), then put the live
    generator back: the recomputation repeats the first one's numbers and consumes none."""
    live = rng_state(dev)
    _set_rng(state, dev)
    try:
        yield
    finally:
        _set_rng(live, dev)


def _set_rng(state: tuple[torch.Tensor, torch.Tensor | None], dev: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], dev)


# -- kernels traced on one device, run on the device of the batch ---------------------------------

def sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):  # noqa: ANN001, ANN201
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (output, logsumexp) on CPU, where it was
    traced; on other devices the memory-efficient attention kernel, which returns the same pair. (The
    trace records SDPA with dropout as :func:`efficient_attention_forward` instead.)"""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    if dropout_p:
        raise NotImplementedError("The CPU flash-attention kernel takes no dropout, so a step traced with it has "
                                  "none; trace and export again with this version of bonsai.")
    out, logsumexp, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention.default(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)
    return out, logsumexp


def sdpa_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):  # noqa: ANN001, ANN201
    """The backward of :func:`sdpa_forward` on the same device: (grad_query, grad_key, grad_value)."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    no_philox = torch.empty((), dtype=torch.int64, device=query.device)  # read only with dropout
    grad_q, grad_k, grad_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default(
        grad_out, query, key, value, attn_mask, out, logsumexp, no_philox, no_philox, dropout_p,
        [True, True, True, False], is_causal, scale=scale)
    return grad_q, grad_k, grad_v


# -- the memory-efficient attention kernel (SDPA with dropout), and the CPU's equivalent -----------

def efficient_attention_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,  # noqa: ANN001, ANN201
                                is_causal=False, *, scale=None):
    """``aten._scaled_dot_product_efficient_attention``: (output, logsumexp, philox seed, philox offset).

    Off the CPU, that kernel (it draws its dropout mask from the device's generator and returns the
    seed and offset it drew with). The CPU has no such kernel: there the same outputs are computed in
    blocks of query rows (never a whole ``seq x seq`` matrix), and the dropout mask is drawn from the
    CPU generator in the order eager's SDPA math path draws it (batch, head, query, key), so under one
    seed it is eager's mask. The "seed" returned on the CPU is the generator's state before the draws
    (``torch.get_rng_state()``), from which :func:`efficient_attention_backward` draws the mask again."""
    if query.device.type != "cpu":
        return torch.ops.aten._scaled_dot_product_efficient_attention.default(
            query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale=scale)
    batch, heads, queries, _ = query.shape
    out = torch.empty(batch, queries, heads, value.shape[-1], dtype=query.dtype).transpose(1, 2)  # the kernel's layout
    logsumexp = torch.zeros(batch, heads, -(-queries // 32) * 32 if compute_log_sumexp else 0, dtype=torch.float32)
    seed = torch.get_rng_state() if dropout_p else torch.empty((), dtype=torch.int64)
    offset = torch.zeros((), dtype=torch.int64)
    for b, h, rows, q, k, v, probs, scores in _attention_blocks(query, key, value, attn_bias, is_causal, scale):
        dropped = probs if not dropout_p else probs * _dropout_multiplier(probs, dropout_p)
        out[b, h, rows].copy_(dropped @ v)
        if compute_log_sumexp:
            logsumexp[b, h, rows] = torch.logsumexp(scores, dim=-1)
    return out, logsumexp, seed, offset


def efficient_attention_backward(grad_out, query, key, value, attn_bias, out, logsumexp,  # noqa: ANN001, ANN201
                                 philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    """The backward of :func:`efficient_attention_forward` on the same device: (grad_query, grad_key,
    grad_value, grad_bias or None). On the CPU the dropout mask is drawn again from the generator
    state the forward kept, and the live generator is put back afterwards."""
    if query.device.type != "cpu":
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward.default(
            grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
            grad_input_mask, is_causal, scale=scale)
    grad_q, grad_k, grad_v = (torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype) for t in (query, key, value))
    grad_bias = None
    if attn_bias is not None and grad_input_mask[3]:  # the kernel's layout: rows padded to a multiple of 16
        keys = attn_bias.shape[-1]
        grad_bias = torch.empty(*attn_bias.shape[:-1], -(-keys // 16) * 16, dtype=attn_bias.dtype)[..., :keys]
    root = math.sqrt(_attention_scale(query, scale))
    live = torch.get_rng_state()
    if dropout_p:
        torch.set_rng_state(philox_seed)
    try:
        grad_key = grad_value = None
        for b, h, rows, q, k, v, probs, _ in _attention_blocks(query, key, value, attn_bias, is_causal, scale):
            if rows.start == 0:  # a new (batch, head): the key and value gradients sum over its row blocks
                grad_key, grad_value = torch.zeros_like(k), torch.zeros_like(v)
            grad = grad_out[b, h, rows].float()
            keep = None if not dropout_p else _dropout_multiplier(probs, dropout_p)
            grad_value += (probs if keep is None else probs * keep).transpose(0, 1) @ grad
            grad_probs = grad @ v.transpose(0, 1)
            if keep is not None:
                grad_probs = grad_probs * keep
            grad_scores = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, torch.float32)
            if grad_bias is not None:
                grad_bias[b, h, rows].copy_(grad_scores)
            grad_q[b, h, rows].copy_((grad_scores @ k) * root)
            grad_key += (grad_scores.transpose(0, 1) @ q) * root
            if rows.stop == query.shape[2]:
                grad_k[b, h].copy_(grad_key)
                grad_v[b, h].copy_(grad_value)
    finally:
        torch.set_rng_state(live)
    return grad_q, grad_k, grad_v, grad_bias


def _attention_scale(query, scale):  # noqa: ANN001, ANN202
    return scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])


def _attention_blocks(query, key, value, attn_bias, is_causal, scale):  # noqa: ANN001, ANN202
    """Attention as SDPA's math path computes it (in float32, query and key each scaled by the square
    root of the scale), one block of query rows of one (batch, head) at a time, in row-major order.
    Yields (b, h, rows, scaled query block, scaled key, value, softmax probabilities, scores); a block
    holds at most as many scores as its (batch, head) has outputs."""
    batch, heads, queries, dim = query.shape
    keys = key.shape[2]
    root = math.sqrt(_attention_scale(query, scale))
    block = max(1, min(queries, queries * dim // max(keys, 1)))
    for b in range(batch):
        for h in range(heads):
            k, v = key[b, h].float() * root, value[b, h].float()
            for start in range(0, queries, block):
                rows = slice(start, min(start + block, queries))
                q = query[b, h, rows].float() * root
                scores = q @ k.transpose(0, 1)
                if attn_bias is not None:
                    scores += attn_bias[b, h, rows]
                if is_causal:  # upper-left aligned, as SDPA's is_causal
                    allowed = torch.ones(rows.stop - start, keys, dtype=torch.bool).tril(start)
                    scores += torch.where(allowed, 0.0, -math.inf)
                yield b, h, rows, q, k, v, torch._safe_softmax(scores, -1), scores


def _dropout_multiplier(probs, dropout_p):  # noqa: ANN001, ANN202
    """What eager's CPU dropout multiplies by: a Bernoulli(1 - p) draw over ``probs``'s shape, / (1 - p)."""
    return torch.empty_like(probs).bernoulli_(1 - dropout_p).div_(1 - dropout_p)


# -- offload to host (simulator rule 9): a copy stream per direction, overlapped with compute ----------

_COPY_STREAMS: dict[tuple[str, int | None], Any] = {}


def _copy_stream(direction: str, dev: torch.device) -> Any:
    """The one CUDA stream of ``direction`` ("d2h" or "h2d") on ``dev``: copies in issue order."""
    key = (direction, dev.index)
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(dev)
    return _COPY_STREAMS[key]


def offload(value):  # noqa: ANN001, ANN201
    """A host copy of ``value`` (a tensor, or a multi-output op's list), started now: on CUDA a pinned
    buffer filled on the device-to-host stream once the compute issued so far has written ``value``;
    ``value``'s block is recorded on that stream, so deleting ``value`` gives the block back only when
    the copy has ended. On the CPU, where device and host are the same memory, a plain copy that a
    measuring dispatch mode counts apart (``count_on_host``, bonsai_core.measure.LiveBytes)."""
    if isinstance(value, (list, tuple)):
        return [offload(x) if isinstance(x, torch.Tensor) else x for x in value]
    if value.device.type != "cuda":
        host = value.clone()
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        for mode in _get_current_dispatch_mode_stack():
            if hasattr(mode, "count_on_host"):
                mode.count_on_host(host)
        return host
    stream = _copy_stream("d2h", value.device)
    stream.wait_stream(torch.cuda.current_stream(value.device))
    with torch.cuda.stream(stream):
        host = torch.empty_like(value, device="cpu", pin_memory=True)
        host.copy_(value, non_blocking=True)
    value.record_stream(stream)
    host.bonsai_copied = stream.record_event()
    return host


def reload(host, dev: torch.device):  # noqa: ANN001, ANN201
    """``host`` (what :func:`offload` returned) back on ``dev``, started now: on CUDA a block taken on
    the compute stream (so the bytes count from here, as the simulator counts them), filled on the
    host-to-device stream after the offload's copy; call :func:`ready` on the result before reading it."""
    if isinstance(host, (list, tuple)):
        return [reload(x, dev) if isinstance(x, torch.Tensor) else x for x in host]
    if dev.type != "cuda":
        return host.clone()
    stream = _copy_stream("h2d", dev)
    value = torch.empty_like(host, device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    offloaded = getattr(host, "bonsai_copied", None)
    if offloaded is not None:
        stream.wait_event(offloaded)
    with torch.cuda.stream(stream):
        value.copy_(host, non_blocking=True)
    value.record_stream(stream)
    value.bonsai_copied = stream.record_event()
    return value


def ready(value) -> None:  # noqa: ANN001
    """Make the compute stream wait for the copy that wrote ``value`` (a reload), or read it (an offload's
    host copy, for a scheduled ``wait``); nothing on the CPU, where copies are done when issued."""
    for t in value if isinstance(value, (list, tuple)) else [value]:
        event = getattr(t, "bonsai_copied", None) if isinstance(t, torch.Tensor) else None
        if event is not None:
            event.wait()


class _ScheduledStep(torch.autograd.Function):
    """Forward: the scheduled ops up to the loss. Backward: the rest of the schedule.

    The tensors alive at the split are kept in a plain list on ``ctx`` (not ``save_for_backward``) so
    that ``backward_part`` can drop each one where the schedule frees it; the placeholders (parameters,
    buffers, the batch) live for the whole step anyway and are saved the usual way.
    """

    @staticmethod
    def forward(ctx, program: Program, mode: str, params: list[nn.Parameter], *tensors: torch.Tensor):  # noqa: ANN001
        dev = tensors[len(tensors) - len(program.constants) - 1].device if program.inputs else tensors[0].device
        with torch.autocast(dev.type, enabled=False):  # the program holds the traced casts already
            loss, alive, rng = program.forward(tensors, dev)
        ctx.program, ctx.mode, ctx.dev, ctx.params, ctx.alive, ctx.rng = program, mode, dev, params, alive, rng
        ctx.save_for_backward(*tensors)
        # a new tensor object: ctx holds the schedule's own loss tensor, and an output held by ctx
        # would be a reference cycle that keeps the whole step alive
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # noqa: ANN001
        tensors = ctx.saved_tensors
        alive, ctx.alive = ctx.alive, None
        if alive is None:
            raise RuntimeError("The scheduled backward frees the step's tensors as it goes, so it runs once per "
                               "forward (retain_graph is not supported): call ck(...) again for another backward.")
        params, mode = ctx.params, ctx.mode
        # loss.backward() seeds 1; anything else (a scaled loss, AMP's GradScaler) scales every gradient
        scale = None if bool((grad_loss == 1).all()) else grad_loss

        def emit(j: int, g: torch.Tensor) -> None:
            if scale is not None:
                g = g * scale
            if mode == "direct":
                _accumulate(params[j], g)
            else:
                # a reentrant backward from the parameter itself: autograd accumulates g and runs the
                # parameter's hooks (DDP's all-reduce among them) now, not when this backward ends
                torch.autograd.backward(params[j], g)

        with torch.autocast(ctx.dev.type, enabled=False):
            ctx.program.backward(tensors, alive, ctx.rng, ctx.dev, emit)
        del alive
        return (None, None, None, *([None] * len(tensors)))


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    """Add a gradient into ``p.grad`` as autograd's AccumulateGrad does: in place when ``p.grad``
    exists, else by taking over ``g``'s storage (a copy only if ``g`` is a view or strided unlike p)."""
    if p.grad is None:
        p.grad = g if (g._base is None and g.stride() == p.stride()) else g.clone(memory_format=torch.preserve_format)
    else:
        p.grad.add_(g)


class Checkpointed(nn.Module):
    """``model``'s training step, run in the order of a rematerialization schedule.

    Shares ``model``'s parameters (it holds ``model`` as ``self.model``). ``ck(*inputs, loss_fn=loss_fn)``
    returns the same loss as ``loss_fn(model(*inputs))``; ``loss.backward()`` runs the schedule's
    backward part and the gradients land in ``model``'s ``.grad``. Under ``torch.no_grad()``,
    ``ck(*inputs)`` returns ``model(*inputs)`` (nothing to recompute without a backward pass).

    ``grads="autograd"`` (default) hands each parameter gradient to autograd the moment the schedule
    computes it (a reentrant ``torch.autograd.backward`` from the parameter), so parameter hooks and
    ``DistributedDataParallel``'s all-reduce run as in eager training. ``grads="direct"`` adds it into
    ``.grad`` itself, bypassing autograd (and its hooks). Both free each gradient where the schedule
    does; with ``.grad`` already allocated both reach the predicted peak. When ``.grad`` is None,
    ``direct`` takes the gradient's storage over where autograd may copy it (one gradient at a time).
    """

    def __init__(self, model: nn.Module, program: Program, grads: str = "autograd",
                 constants: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        if grads not in GRAD_MODES:
            raise ValueError(f"grads={grads!r}; choose one of {GRAD_MODES}.")
        self.model = model
        self.program = program
        self.grads = grads
        named = dict(model.named_parameters(remove_duplicate=False))
        missing = [name for name, *_ in program.params if name not in named]
        # every distinct parameter is in the program (a tied one may be there under one name only)
        covered = {id(named[name]) for name, *_ in program.params if name in named}
        if missing or covered != {id(p) for p in named.values()}:
            raise ValueError(f"This export was made for a model with parameters {[n for n, *_ in program.params][:5]}... "
                             f"({len(program.params)} in all); the given model has {len(named)} "
                             f"({', '.join(missing[:3]) or 'others'} missing). Load it with the model you exported.")
        for name, shape, dtype, _ in program.params:
            _check(f"parameter {name!r}", named[name], shape, dtype)
        self._param_names = [name for name, *_ in program.params]
        # buffers of this module (not of ``model``), so ``ck.to(device)`` moves them with the model
        device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
        self._constant_names = [f"constant{i}" for i in range(len(constants))]
        for name, t in zip(self._constant_names, constants):
            self.register_buffer(name, t.to(device), persistent=False)

    def forward(self, *inputs: torch.Tensor, loss_fn: nn.Module | None = None) -> torch.Tensor:
        if loss_fn is None:
            if torch.is_grad_enabled():
                raise TypeError("The schedule covers the whole training step, loss included: call "
                                "ck(*inputs, loss_fn=loss_fn) and .backward() the loss it returns. For evaluation "
                                "run ck(*inputs) under torch.no_grad(), or call ck.model directly.")
            return self.model(*inputs)
        if len(inputs) != len(self.program.inputs):
            raise TypeError(f"This export takes {len(self.program.inputs)} model input(s); got {len(inputs)}.")
        named = dict(self.model.named_parameters(remove_duplicate=False))
        params = [named[name] for name in self._param_names]
        owners = {"model": dict(self.model.named_buffers(remove_duplicate=False)),
                  "loss_fn": dict(loss_fn.named_buffers(remove_duplicate=False)) if isinstance(loss_fn, nn.Module) else {}}
        buffers = []
        for owner, name, shape, dtype in self.program.buffers:
            if name not in owners[owner]:
                raise TypeError(f"The traced {owner} has a buffer {name!r} that the given one lacks: pass the loss "
                                "module the step was exported with (an nn.Module holding its targets as buffers).")
            buffers.append(_check(f"{owner} buffer {name!r}", owners[owner][name], shape, dtype))
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self.program.inputs)):
            _check(f"input {i}", x, shape, dtype)
        constants = [getattr(self, name) for name in self._constant_names]
        return _ScheduledStep.apply(self.program, self.grads, params, *params, *buffers, *inputs, *constants)

    def extra_repr(self) -> str:
        info = self.program.info
        return (f"method={info.get('method')!r}, graph={info.get('graph')!r}, "
                f"predicted_peak={info.get('predicted_peak')}, grads={self.grads!r}")


def _check(what: str, t: torch.Tensor, shape: Sequence[int], dtype: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or str(t.dtype) != dtype:
        raise ValueError(f"{what} is {str(t.dtype)}{list(t.shape)}, but the export was traced with {dtype}{list(shape)}. "
                         "A schedule (and the memory it predicts) is made for one set of shapes: export again "
                         "with the model options (--batch, --seq, ...) you train with.")
    return t
# ---- end of runtime ----
