"""Packed sequences (``nn.utils.rnn.pack_padded_sequence``) on fake tensors: their batch sizes.

``pack_padded_sequence`` computes a packed sequence's batch sizes (how many sequences are still running
at each step) from the lengths' *values*, and every shape after it depends on them: the packed data
(one row per real token), each step of the recurrent layer, ``pad_packed_sequence``'s output. Fake
tensors carry no values, so a traced step that packs failed there (``aten._pack_padded_sequence``).

The values are read once from the model itself: :func:`recorded_batch_sizes` runs the model spec's
forward and loss on real CPU tensors (built as the trace builds them, same seed) and records the batch
sizes each ``pack_padded_sequence`` call made, in call order. Within :func:`known_batch_sizes`, the
:class:`PackedSequences` mode hands them to the fake run, call by call:

* ``_pack_padded_sequence(input, lengths, batch_first)`` becomes the same rows of ``input`` picked with
  ``aten.index`` (index tensors from ``arange``: no constant in the graph), and a real batch sizes
  tensor whose fake twin holds its values (``FakeTensor.constant``), so ``nn.LSTM``'s
  ``int(batch_sizes[0])`` works on fake tensors, and ATen's packed kernels read its data;
* ``_pad_packed_sequence`` becomes the padded output filled with ``index_put`` (the kernel itself
  writes lengths through a data pointer, which a fake tensor has not);
* ``_VF.lstm``/``_VF.gru``/``_VF.rnn_tanh``/``_VF.rnn_relu`` over packed data get the real batch sizes back where ATen's own kernels
  run (recording the step's ops: the per-step cells eager runs), or run as
  :mod:`bonsai_core.recurrent_steps` where the step is traced.

A plan made this way is made for the traced batch's lengths: the sizes of a packed step follow them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode

from bonsai_core.errors import ModelError

_state = threading.local()


class PackedLengthsUnknown(ModelError):
    """A fake run met ``pack_padded_sequence`` without the batch sizes of its lengths."""

    def __init__(self) -> None:
        super().__init__(
            "The model packs sequences (pack_padded_sequence), whose batch sizes come from the lengths' values, "
            "and tracing runs on shapes only. Trace it with bonsai_core.trace.trace_model or `bonsai trace` "
            "(which read the lengths from one real forward pass of the model), or pass real model and inputs "
            "to trace_step or bonsai.checkpoint.")


@contextlib.contextmanager
def known_batch_sizes(sizes: Sequence[Sequence[int]] | None) -> Iterator[None]:
    """Within: the k-th ``pack_padded_sequence`` call of a fake run packs to ``sizes[k]`` (cycling: each
    run of the forward starts over). ``None`` or empty: nothing known (a model that does not pack)."""
    previous = getattr(_state, "sizes", None), getattr(_state, "next", 0)
    _state.sizes, _state.next = (tuple(tuple(s) for s in sizes), 0) if sizes else (None, 0)
    try:
        yield
    finally:
        _state.sizes, _state.next = previous


def _next_sizes() -> tuple[int, ...]:
    sizes = getattr(_state, "sizes", None)
    if not sizes:
        raise PackedLengthsUnknown()
    k = _state.next
    _state.next = k + 1
    return sizes[k % len(sizes)]


class _PackRecorder(TorchFunctionMode):
    """Records the batch sizes of every ``_pack_padded_sequence`` call (real tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        if func is torch._VF._pack_padded_sequence:
            self.sizes.append(tuple(int(s) for s in out[1].tolist()))
        return out


def batch_sizes_of(model: torch.nn.Module, inputs: Sequence[torch.Tensor], loss_fn: Callable[[Any], torch.Tensor]) -> list[tuple[int, ...]]:
    """The batch sizes of each ``pack_padded_sequence`` call in one forward and loss of ``model`` on
    real ``inputs`` (no gradient), in call order."""
    recorder = _PackRecorder()
    with torch.no_grad(), recorder:
        loss_fn(model(*inputs))
    return recorder.sizes


@functools.lru_cache(maxsize=32)
def _recorded(name: str, seed: int, options: tuple[tuple[str, Any], ...]) -> tuple[tuple[int, ...], ...]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from bonsai_core import models

    with unset_fake_temporarily():
        model, inputs, loss_fn = models.build(name, seed=seed, **dict(options))
        return tuple(batch_sizes_of(model, inputs, loss_fn))


def recorded_batch_sizes(name: str, seed: int = 0, **options: Any) -> tuple[tuple[int, ...], ...]:
    """:func:`batch_sizes_of` the model spec ``name`` built on real CPU tensors with ``seed`` and
    ``options`` (as :func:`bonsai_core.trace.trace_model` builds it), once per process and spec."""
    return _recorded(name, seed, tuple(sorted(options.items())))


# -- packing on fake tensors -----------------------------------------------------------------------

def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(t, torch.Tensor) and is_fake(t)


def real_batch_sizes(batch_sizes: torch.Tensor) -> torch.Tensor | None:
    """The real tensor behind a batch sizes tensor :class:`PackedSequences` made (or ``batch_sizes``
    itself when it is real); None for another fake one."""
    if not _is_fake(batch_sizes):
        return batch_sizes
    return getattr(batch_sizes, "constant", None)


def batch_size_list(batch_sizes: torch.Tensor) -> list[int] | None:
    """The values of a batch sizes tensor as ints (see :func:`real_batch_sizes`), or None."""
    from torch.utils._mode_utils import no_dispatch

    real = real_batch_sizes(batch_sizes)
    if real is None:
        return None
    with no_dispatch():
        return [int(s) for s in real.tolist()]


def _batch_sizes_tensor(like: torch.Tensor, values: Sequence[int]) -> torch.Tensor:
    """A real int64 CPU tensor of ``values`` whose fake twin in ``like``'s fake mode keeps its values
    (``FakeTensor.constant``, registered with the mode's converter): where the fake mode meets it
    (``int(batch_sizes[0])``, with or without :class:`PackedSequences`, as in a checkpoint's
    recomputation) its values are known, and ATen's packed kernels read its data."""
    from torch._guards import detect_fake_mode
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        real = torch.tensor(list(values), dtype=torch.int64)
    mode = detect_fake_mode((like,))
    if mode is not None:
        real._fake_twin = mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True)  # memo is weak
    real._batch_sizes = tuple(values)  # read as ints while tracing (never as a graph constant)
    return real


def _positions(sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, sequence) of every packed row, step by step: at step t the first ``sizes[t]`` sequences.
    Built from ``arange`` per run of equal batch sizes (at most one run per sequence)."""
    steps, rows = [], []
    t = 0
    while t < len(sizes):
        end = t
        while end < len(sizes) and sizes[end] == sizes[t]:
            end += 1
        steps.append(torch.arange(t, end).repeat_interleave(sizes[t]))
        rows.append(torch.arange(sizes[t]).repeat(end - t))
        t = end
    return torch.cat(steps), torch.cat(rows)


def _index(sizes: Sequence[int], batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The index of the packed rows into a padded tensor (sequences x steps with ``batch_first``)."""
    steps, rows = _positions(sizes)
    return (rows, steps) if batch_first else (steps, rows)


def _runs(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(value, count) of each run of equal values in ``sizes``, in order."""
    runs: list[tuple[int, int]] = []
    for s in sizes:
        if runs and runs[-1][0] == s:
            runs[-1] = (s, runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


def _sizes_tensor(sizes: Sequence[int]) -> torch.Tensor:
    """The batch sizes as an int64 CPU tensor made by ``full`` ops (a graph constant would not trace)."""
    return torch.cat([torch.full((count,), s, dtype=torch.int64, device="cpu") for s, count in _runs(sizes)])


def _index_of(batch_sizes: torch.Tensor, rows: int, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_index` read from a batch sizes tensor (``rows`` packed rows in all), as
    ``_pack_padded_sequence_backward`` reads the batch sizes it saved."""
    steps = torch.arange(len(batch_sizes)).repeat_interleave(batch_sizes, output_size=rows)
    within = torch.arange(rows) - (batch_sizes.cumsum(0) - batch_sizes).repeat_interleave(batch_sizes, output_size=rows)
    return (within, steps) if batch_first else (steps, within)


class _Pack(torch.autograd.Function):
    """``_pack_padded_sequence``'s data as ATen's kernel keeps it for the backward pass: its batch sizes
    tensor (one int64 per step), which ``_pack_padded_sequence_backward`` reads, and no index of the
    rows: the backward pass builds that again from the batch sizes (an ``aten.index`` would save its
    index tensors, 16 bytes per packed row, to the embedding's gradient)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, sizes: tuple[int, ...], batch_first: bool) -> torch.Tensor:  # noqa: ANN001
        ctx.batch_first, ctx.shape, ctx.rows = batch_first, input.shape, sum(sizes)
        ctx.save_for_backward(_sizes_tensor(sizes))
        return input[_index(sizes, batch_first)]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        batch_sizes, = ctx.saved_tensors
        index = _index_of(batch_sizes, ctx.rows, ctx.batch_first)
        return torch.index_put(grad.new_zeros(ctx.shape), index, grad), None, None


class _Pad(torch.autograd.Function):
    """``_pad_packed_sequence``'s padded output (steps x sequences) as ATen's keeps it: nothing saved for
    the backward pass (its copies into slices of the output save no index), the index built again there."""

    @staticmethod
    def forward(ctx, data: torch.Tensor, sizes: tuple[int, ...], padding_value: float,  # noqa: ANN001
                length: int) -> torch.Tensor:
        ctx.sizes = sizes
        out = data.new_full((length, sizes[0], *data.shape[1:]), padding_value)
        return torch.index_put(out, _index(sizes, False), data)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: ANN001
        return grad[_index(ctx.sizes, False)], None, None, None


def pack(input: torch.Tensor, sizes: Sequence[int], batch_first: bool) -> torch.Tensor:
    """``_pack_padded_sequence``'s data: the rows of ``input`` (steps x sequences, or sequences x steps
    with ``batch_first``) of the running sequences, step by step (:class:`_Pack`)."""
    return _Pack.apply(input, tuple(sizes), batch_first)


def pad(data: torch.Tensor, sizes: Sequence[int], batch_first: bool, padding_value: float,
        total_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_pad_packed_sequence``: (the padded output, steps x sequences and then transposed with
    ``batch_first`` as the kernel does, its lengths) (:class:`_Pad`)."""
    out = _Pad.apply(data, tuple(sizes), padding_value, max(total_length, len(sizes)))
    return (out.transpose(0, 1) if batch_first else out), _lengths(sizes)


def _lengths(sizes: Sequence[int]) -> torch.Tensor:
    """The sequences' lengths (longest first) as an int64 CPU tensor made by ``full`` ops (a graph
    constant would not trace): ``pad_packed_sequence`` indexes it with the fake unsorted indices."""
    lengths = [sum(1 for s in sizes if s > b) for b in range(sizes[0])]
    runs = [(n, lengths.count(n)) for n in sorted(set(lengths), reverse=True)]
    return torch.cat([torch.full((count,), n, dtype=torch.int64, device="cpu") for n, count in runs])


class PackedSequences(TorchFunctionMode):
    """Within: packing and padding on fake tensors use the batch sizes :func:`known_batch_sizes` holds
    (see the module doc). ``run_packed(func, args, sizes)``, given while tracing, runs a recurrent layer
    over packed data (``_VF.lstm``, ``_VF.gru``, ``_VF.rnn_tanh`` or ``_VF.rnn_relu``, data form) with its batch sizes as ints, or returns
    None to run ATen's own with the real batch sizes (as without it). Real tensors are left alone."""

    def __init__(self, run_packed: Callable[[Any, tuple, list[int]], Any] | None = None) -> None:
        super().__init__()
        self.run_packed = run_packed

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        if self.run_packed and func is torch.Tensor.__getitem__ and hasattr(args[0], "_batch_sizes") \
                and isinstance(args[1], int):
            # nn.LSTM's int(batch_sizes[0]) while tracing: no op on a constant in the graph. Elsewhere the
            # op runs (on the constant's values), as in eager and in a checkpoint's recomputation.
            return args[0]._batch_sizes[args[1]]
        if func is torch._VF._pack_padded_sequence and _is_fake(args[0]):
            input, lengths, batch_first = (list(args) + [kwargs.get("batch_first")])[:3]
            sizes = batch_size_list(lengths)
            sizes = sizes_from_lengths(sizes) if sizes is not None else _next_sizes()
            return pack(input, sizes, batch_first), _batch_sizes_tensor(input, sizes)
        if func is torch._VF._pad_packed_sequence and _is_fake(args[0]):
            sizes = batch_size_list(args[1])
            if sizes is not None:
                return pad(args[0], sizes, *args[2:5])
        if func in _RECURRENT and len(args) > 2 and isinstance(args[1], torch.Tensor) \
                and isinstance(args[2], (list, tuple, torch.Tensor)) and _is_fake(args[0]) and not kwargs:
            packed = _packed_form(func, args)
            sizes = batch_size_list(args[1]) if packed else None
            if sizes is not None:
                out = self.run_packed(func, args, sizes) if self.run_packed else None
                if out is not None:
                    return out
                return func(args[0], real_batch_sizes(args[1]), *args[2:])
        return func(*args, **kwargs)


_RECURRENT = (torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu)


def _packed_form(func: Any, args: tuple) -> bool:
    """Whether a recurrent ``_VF`` call is its data (packed) form: ``(data, batch_sizes, hx, ...)``."""
    if func is torch._VF.lstm:
        return isinstance(args[2], (list, tuple))
    return isinstance(args[2], torch.Tensor)


def sizes_from_lengths(lengths: Sequence[int]) -> list[int]:
    """Batch sizes of sorted (longest first) ``lengths``: at step t, how many are longer than t."""
    return [sum(1 for n in lengths if n > t) for t in range(max(lengths))]


def with_batch_sizes_on_demand(run: Callable[[], Any], read_sizes: Callable[[], Sequence[Sequence[int]]]) -> Any:
    """``run()``; where it meets a packed sequence with no batch sizes known, ``run()`` again within
    :func:`known_batch_sizes` of ``read_sizes()`` (which runs the model on real tensors: a model that
    does not pack is never run so)."""
    try:
        return run()
    except PackedLengthsUnknown:
        if getattr(_state, "sizes", None):
            raise
        sizes = read_sizes()
    with known_batch_sizes(sizes):
        return run()


def spec_batch_sizes(name: str, seed: int, options: dict[str, Any]) -> Callable[[], tuple[tuple[int, ...], ...]]:
    """The batch sizes reader of a model spec (:func:`recorded_batch_sizes`), for :func:`with_batch_sizes_on_demand`."""
    return lambda: recorded_batch_sizes(name, seed, **options)


def batch_sizes_left_alone(model: torch.nn.Module, inputs: Sequence[torch.Tensor],
                           loss_fn: Callable[[Any], torch.Tensor]) -> list[tuple[int, ...]]:
    """:func:`batch_sizes_of` the user's own model, which it leaves as it was: its buffers (a batch norm's
    statistics) and the random number generators (dropout's draws) are put back afterwards."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({t.device.index or 0 for t in (*model.parameters(), *inputs) if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            return batch_sizes_of(model, inputs, loss_fn)
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
