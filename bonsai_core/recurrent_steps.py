"""Recurrent layers that eager runs step by step on the CPU, written as eager runs them.

ATen runs ``nn.GRU`` and ``nn.RNN`` (any dtype), ``nn.LSTM`` with projections (``proj_size``), and
``nn.LSTM`` over packed sequences, without a fused kernel on the CPU
(``aten/src/ATen/native/RNN.cpp``: ``_rnn_impl`` over ``FullLayer`` / ``PackedLayer`` and their
bidirectional forms, ``GRUCell``, ``LSTMCell``, ``SimpleCell``): per layer and direction the input is
projected once for all steps (``linear_ih``, the CPU's ``pre_compute_input``), then each step is a
handful of ops on ``linear_hh`` of the hidden state; the steps' outputs are stacked (full) or
concatenated (packed), and ``at::dropout`` draws CPU dropout's float noise between the layers.

torch's Python decomposition, which AOTAutograd traces otherwise, differs in what it keeps: it draws
no dropout between layers, projects a packed layer's input step by step, and its GRU cell keeps the
reset and update gates apart where eager's cell writes them into its hidden projection in place. Here
each cell is written with functional ops that hold the bytes eager's in-place cell holds
(:func:`gru_cell`; with the gates apart, a 2-layer GRU language model's step is predicted 2.5% over its
measured peak), so a traced step keeps what eager keeps. Used while tracing (:class:`bonsai_core.recurrent.FusedRecurrent`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# one layer and direction's weights as ATen's CellParams hold them: w_ih, w_hh, b_ih, b_hh (None without
# biases) and w_hr (an LSTM's projection, None without)
Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Cell = Callable[[torch.Tensor, Hidden, Weights], Hidden]


def weights(params: Sequence[torch.Tensor], k: int, has_biases: bool, projections: bool) -> Weights:
    """The k-th layer and direction's weights in a recurrent module's flat parameter list (``_flat_weights``:
    w_ih, w_hh, then b_ih, b_hh with biases, then w_hr with projections)."""
    stride = (4 if has_biases else 2) + projections
    w = list(params[k * stride:(k + 1) * stride])
    biases = (w[2], w[3]) if has_biases else (None, None)
    return w[0], w[1], *biases, w[-1] if projections else None


def lstm_cell(x_w: torch.Tensor, hidden: Hidden, w: Weights) -> Hidden:
    """ATen's ``LSTMCell`` on a step's projected input ``x_w``. Eager adds ``x_w`` into the hidden
    projection and applies the gates' activations in place (one gates tensor, kept for the backward
    pass); the four activations here hold the same bytes. With projections the new hidden state is
    ``matmul_hr``'s ``h @ w_hr.t()``."""
    h, c = hidden
    gates = F.linear(h, w[1], w[3]) + x_w
    i, f, g, o = gates.unsafe_chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    c = f * c + i * g
    h = o * c.tanh()
    return (h if w[4] is None else torch.matmul(h, w[4].t())), c


def simple_cell(nonlinearity: Callable[[torch.Tensor], torch.Tensor]) -> Cell:
    """ATen's ``SimpleCell`` (``nn.RNN``): ``nonlinearity(linear_hh(h).add_(x_w))``, the sum written
    into the hidden projection (the ``+`` here frees it at once: no step keeps it)."""
    def cell(x_w: torch.Tensor, h: Hidden, w: Weights) -> torch.Tensor:
        return nonlinearity(F.linear(h, w[1], w[3]) + x_w)
    return cell


def gru_cell(x_w: torch.Tensor, h: torch.Tensor, w: Weights) -> torch.Tensor:
    """ATen's ``GRUCell`` on a step's projected input ``x_w``. Eager keeps, per step: its hidden projection
    (3 x hidden wide), into whose first two thirds it writes the reset and update gates in place (the
    third holds ``n * r`` after an in-place ``mul_``, kept but never read); autograd's copy of that third
    taken before the ``mul_``; the new gate; a copy of ``h - new`` (again before an in-place ``mul_``) and
    the new hidden state. Here the gates are one sigmoid over all three thirds (the third unused), so the
    step keeps the same bytes, and gives the same values."""
    input_new = x_w.unsafe_chunk(3, 1)[2]
    hidden_gates = F.linear(h, w[1], w[3])
    reset, update, _ = (hidden_gates + x_w).sigmoid().unsafe_chunk(3, 1)
    new_hidden = hidden_gates.unsafe_chunk(3, 1)[2].clone()
    new = (input_new + new_hidden * reset).tanh()
    return (h - new) * update + new


def _output(hidden: Hidden) -> torch.Tensor:
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _slice(hidden: Hidden, start: int, end: int) -> Hidden:
    if isinstance(hidden, tuple):
        return tuple(x.narrow(0, start, end - start) for x in hidden)
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: Sequence[Hidden]) -> Hidden:
    if isinstance(hiddens[0], tuple):
        return tuple(torch.cat(parts, 0) for parts in zip(*hiddens))
    return torch.cat(list(hiddens), 0)


def full_layer(cell: Cell, x: torch.Tensor, hidden: Hidden, w: Weights,
               reverse: bool = False) -> tuple[torch.Tensor, Hidden]:
    """``FullLayer`` on the CPU (``reverse``: the backward direction of ``FullBidirectionalLayer``):
    ``x`` steps x batch x features."""
    steps = F.linear(x, w[0], w[2]).unbind(0)
    outputs = []
    for step in (reversed(steps) if reverse else steps):
        hidden = cell(step, hidden, w)
        outputs.append(_output(hidden))
    if reverse:
        outputs.reverse()
    return torch.stack(outputs, 0), hidden


def packed_layer(cell: Cell, data: torch.Tensor, sizes: Sequence[int], hidden: Hidden,
                 w: Weights) -> tuple[torch.Tensor, Hidden]:
    """``PackedLayer`` on the CPU: the sequences that end leave their final hidden state behind. The
    step's input is narrowed before the hidden state is sliced, as ATen does: the backward pass runs
    the slices' gradients first (autograd runs the later-made node first)."""
    x_w = F.linear(data, w[0], w[2])
    outputs, finished = [], []
    offset, last = 0, sizes[0]
    for size in sizes:
        step = x_w.narrow(0, offset, size)
        if size < last:
            finished.append(_slice(hidden, size, last))
            hidden = _slice(hidden, 0, size)
        last = size
        hidden = cell(step, hidden, w)
        offset += size
        outputs.append(_output(hidden))
    finished.append(hidden)
    return torch.cat(outputs, 0), _concat(finished[::-1])


def reversed_packed_layer(cell: Cell, data: torch.Tensor, sizes: Sequence[int], hidden: Hidden,
                          w: Weights) -> tuple[torch.Tensor, Hidden]:
    """``ReversedPackedLayer`` on the CPU: from the last step back, sequences join as they start."""
    x_w = F.linear(data, w[0], w[2])
    initial = hidden
    outputs = []
    offset, last = data.size(0), sizes[-1]
    hidden = _slice(initial, 0, last)
    for size in reversed(sizes):
        if size > last:
            hidden = _concat([hidden, _slice(initial, last, size)])
        offset -= size
        last = size
        hidden = cell(x_w.narrow(0, offset, size), hidden, w)
        outputs.append(_output(hidden))
    outputs.reverse()
    return torch.cat(outputs, 0), hidden


def cpu_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``at::dropout`` on the CPU (``_dropout_impl``): a float noise tensor, kept for the backward."""
    if p == 1:
        return x * torch.zeros_like(x)
    noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    return x * noise


def run_layers(layer: Callable[[torch.Tensor, Hidden, Weights, bool], tuple[torch.Tensor, Hidden]],
               x: torch.Tensor, hiddens: Sequence[Hidden], params: Sequence[torch.Tensor], has_biases: bool,
               num_layers: int, dropout: float, train: bool, bidirectional: bool,
               projections: bool = False) -> tuple[torch.Tensor, list[Hidden]]:
    """``_rnn_impl``: ``layer(x, hidden, weights, reverse)`` per layer and direction, the directions'
    outputs concatenated on the last dimension, dropout between layers. (output, final hidden per layer
    and direction)."""
    directions = 2 if bidirectional else 1
    finals = []
    for index in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = index * directions + direction
            out, final = layer(x, hiddens[k], weights(params, k, has_biases, projections), direction > 0)
            outputs.append(out)
            finals.append(final)
        x = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout != 0 and train and index < num_layers - 1:
            x = cpu_dropout(x, dropout)
    return x, finals


CELLS: dict[str, Cell] = {"lstm": lstm_cell, "gru": gru_cell, "rnn_tanh": simple_cell(torch.tanh),
                          "rnn_relu": simple_cell(torch.relu)}  # by the name of its torch._VF function


def _hiddens(kind: str, hx: torch.Tensor | Sequence[torch.Tensor]) -> tuple[list[Hidden], bool]:
    """(per layer and direction the initial hidden state, whether an LSTM projects its hidden state:
    its ``h`` narrower than its ``c``)."""
    if kind == "lstm":
        return list(zip(hx[0].unbind(0), hx[1].unbind(0))), hx[0].size(2) != hx[1].size(2)
    return list(hx.unbind(0)), False


def _finals(kind: str, finals: list[Hidden]) -> tuple[torch.Tensor, ...]:
    if kind == "lstm":
        return torch.stack([h for h, _ in finals], 0), torch.stack([c for _, c in finals], 0)
    return (torch.stack(finals, 0),)


def cpu_layers(kind: str, input: torch.Tensor, hx: torch.Tensor | Sequence[torch.Tensor], params: Sequence[torch.Tensor],
               has_biases: bool, num_layers: int, dropout: float, train: bool, bidirectional: bool,
               batch_first: bool) -> tuple[torch.Tensor, ...]:
    """``torch._VF.<kind>`` (``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``; input form) as ATen runs it on
    the CPU step by step: (output, h_n) or, for an LSTM, (output, h_n, c_n)."""
    x = input.transpose(0, 1) if batch_first else input
    cell = CELLS[kind]

    def layer(x, hidden, w, reverse):  # noqa: ANN001, ANN202
        return full_layer(cell, x, hidden, w, reverse)

    hiddens, projections = _hiddens(kind, hx)
    out, finals = run_layers(layer, x, hiddens, params, has_biases, num_layers, dropout, train, bidirectional,
                             projections)
    return (out.transpose(0, 1) if batch_first else out), *_finals(kind, finals)


def _packed_layer(cell: Cell, sizes: Sequence[int]) -> Callable:
    def layer(x, hidden, w, reverse):  # noqa: ANN001, ANN202
        return (reversed_packed_layer if reverse else packed_layer)(cell, x, sizes, hidden, w)
    return layer


def cpu_packed_layers(kind: str, data: torch.Tensor, sizes: Sequence[int], hx: torch.Tensor | Sequence[torch.Tensor],
                      params: Sequence[torch.Tensor], has_biases: bool, num_layers: int, dropout: float, train: bool,
                      bidirectional: bool) -> tuple[torch.Tensor, ...]:
    """``torch._VF.<kind>`` over packed ``data`` (batch sizes ``sizes``) as ATen runs it on the CPU."""
    hiddens, projections = _hiddens(kind, hx)
    out, finals = run_layers(_packed_layer(CELLS[kind], sizes), data, hiddens, params, has_biases, num_layers,
                             dropout, train, bidirectional, projections)
    return out, *_finals(kind, finals)
