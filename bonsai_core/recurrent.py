"""How a recurrent layer (``nn.LSTM``) is recorded in a traced step: as the fused kernel eager runs.

Eager PyTorch runs a float32 ``nn.LSTM`` on the CPU as one oneDNN kernel per layer and direction,
``aten.mkldnn_rnn_layer`` (``aten/src/ATen/native/mkldnn/RNN.cpp``: ``mkldnn_rnn``), with the dropout
between layers drawn by ``at::dropout`` between the kernels. Its autograd formula
(``tools/autograd/derivatives.yaml``: ``mkldnn_rnn_layer`` -> ``mkldnn_rnn_layer_backward``) saves the
layer's input, weights, initial states, its three outputs and its fourth output, the oneDNN
*workspace*: every gate of every step, the states, and room for the backward pass's state gradients.

AOTAutograd traces something else: torch's Python decomposition of ``aten.lstm``
(``torch/_decomp/decompositions.py``: ``lstm_impl``) unrolls the layer into per-step matmuls,
sigmoids and tanhs whenever the input requires a gradient (an embedding's output does), and applies
no dropout between layers (its ``num_layers < i - 1`` is never true). The graph then holds tensors
eager never makes and misses the workspace eager keeps: traced that way, a 2-layer LSTM language
model's step is predicted 33% under its measured peak (docs/results/fused_kernels.md).

So, while tracing, :class:`FusedRecurrent` runs ``torch._VF.lstm`` as the C++ ``mkldnn_rnn`` does it
(:func:`cpu_lstm`): the graph holds one ``mkldnn_rnn_layer`` per layer and direction, the backward
pass its ``mkldnn_rnn_layer_backward``, each reading what the autograd formula saves, and CPU
dropout's float noise between the layers (``_dropout_impl``: ``empty_like(x).bernoulli_(1 - p)
.div_(1 - p)``, ``x * noise``). torch's shape function for the kernel gives the workspace 0 bytes;
:func:`onednn_lstm_workspace_bytes` gives it the bytes oneDNN allocates (``rnn_utils.hpp``:
``init_conf`` and ``set_workspace_sizes``, ``rnn_utils.cpp``: ``set_offsets``), registered as the
kernel's shape function on the ``Meta`` key (:func:`register_workspace_shape`; only fake and meta
tensors see it). Only where eager runs that kernel: float32 CPU tensors, oneDNN enabled, no
projections (``proj_size``).

``nn.GRU`` on the CPU, and ``nn.LSTM``/``nn.GRU`` over packed sequences, run no fused kernel: ATen runs
them as per-step cells, recorded as ATen writes them (:mod:`bonsai_core.recurrent_steps`; packed
sequences' batch sizes: :mod:`bonsai_core.packed`). Everything else keeps torch's decomposition:
``nn.RNN``, an unpacked LSTM in other dtypes, projections, and CUDA (``_cudnn_rnn``, whose reserve
space cuDNN sizes per algorithm: not measured here).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Sequence

import torch

from bonsai_core import recurrent_steps
from bonsai_core.packed import PackedSequences

MKLDNN_RNN_LAYER = "aten.mkldnn_rnn_layer.default"
LSTM_MODE = 2  # ideep::rnn_kind::LSTM, the mode argument of mkldnn_rnn_layer
_LSTM_GATES = 4
_PAGE = 4096  # oneDNN page-aligns each part of the workspace (rnn_utils.cpp: set_offsets)
_CACHE_LINE = 64  # bytes: oneDNN's leading dimensions are multiples of this (get_good_ld)


def _good_ld(dim: int, itemsize: int) -> int:
    """oneDNN's ``get_good_ld``: ``dim`` rounded up to a 64-byte multiple, one more 64 bytes when that
    is a multiple of 256 elements (to avoid 4K aliasing)."""
    step = _CACHE_LINE // itemsize
    ld = math.ceil(dim / step) * step
    return ld + step if ld % 256 == 0 else ld


def onednn_lstm_workspace_bytes(steps: int, batch: int, input_size: int, hidden: int) -> int:
    """Bytes of the workspace a float32 ``mkldnn_rnn_layer`` (one LSTM layer, one direction) keeps
    for its backward pass: oneDNN's training workspace for ``steps`` x ``batch`` with 4-byte states
    and accumulators, each part page-aligned. Measured equal to the kernel's on every shape tried
    (tests/test_fused_kernels.py)."""
    layers = directions = 1
    f32 = 4
    states_ld = _good_ld(max(input_size, hidden), f32)  # max(sic, slc, dlc)
    state_block = (layers + 1) * directions * (steps + 1) * batch
    parts = [
        layers * directions * steps * batch * _good_ld(_LSTM_GATES * hidden, f32) * f32,  # ws_gates
        layers * directions * steps * batch * _good_ld(hidden, f32) * f32,  # ws_ht
        state_block * states_ld * f32,  # ws_states_layer (= ws_states_iter)
        state_block * hidden * f32,  # ws_states_iter_c
        state_block * states_ld * f32,  # ws_diff_states_layer
        state_block * states_ld * f32,  # ws_diff_states_iter
        state_block * hidden * f32,  # ws_diff_states_iter_c
    ]
    return sum(math.ceil(p / _PAGE) * _PAGE for p in parts)


def kernel_workspace_bytes(input: torch.Tensor, hidden: int, mode: int, train: bool) -> int | None:
    """The workspace bytes the CPU kernel ``mkldnn_rnn_layer`` allocates for ``input`` (steps x batch x
    features), or None where it is not modelled (not an LSTM, not float32). Inference keeps none."""
    if not train:
        return 0
    if mode != LSTM_MODE or input.dtype != torch.float32 or input.dim() != 3:
        return None
    steps, batch, features = (int(s) for s in input.shape)
    return onednn_lstm_workspace_bytes(steps, batch, features, hidden)


_registered = threading.Lock()
_state = {"done": False}


def register_workspace_shape() -> None:
    """Make ``aten.mkldnn_rnn_layer``'s shape function (what fake and meta tensors run) give the
    workspace the bytes the CPU kernel allocates (:func:`kernel_workspace_bytes`), once per process.
    torch's own gives it 0 bytes. A Meta-key registration cannot be withdrawn, so this stays; it
    changes only the workspace's size, where the kernel's is known, and nothing on real tensors."""
    with _registered:
        if _state["done"]:
            return
        from torch._meta_registrations import mkldnn_rnn_layer as torch_shape

        def shape(input, w0, w1, w2, w3, hx_, cx_, reverse, batch_sizes, mode, hidden_size, num_layers,  # noqa: ANN001
                  has_biases, bidirectional, batch_first, train):
            output, hy, cy, workspace = torch_shape(input, w0, w1, w2, w3, hx_, cx_, reverse, batch_sizes, mode,
                                                    hidden_size, num_layers, has_biases, bidirectional, batch_first,
                                                    train)
            size = kernel_workspace_bytes(input, hidden_size, mode, train) if not batch_sizes else None
            if size:
                workspace = torch.empty(size, device=input.device, dtype=torch.uint8)
            return output, hy, cy, workspace

        _state["library"] = library = torch.library.Library("aten", "IMPL", "Meta")  # kept: its kernels live with it
        library.impl("mkldnn_rnn_layer", shape)
        _state["done"] = True


def runs_fused_kernel(input: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """Whether eager runs ``torch._VF.lstm`` on these tensors as ``mkldnn_rnn_layer`` (RNN.cpp's
    ``use_mkldnn`` for float32, and no projections)."""
    tensors = [input, *hx, *params]
    return (torch._C._get_mkldnn_enabled() and all(t.device.type == "cpu" for t in tensors)
            and all(t.dtype == torch.float32 for t in tensors) and input.numel() > 0
            and len(hx) == 2 and hx[0].size(2) == hx[1].size(2))


def cpu_lstm(input: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor], has_biases: bool,
             num_layers: int, dropout: float, train: bool, bidirectional: bool,
             batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch._VF.lstm`` (the input form) as ATen's ``mkldnn_rnn`` runs it on the CPU: per layer and
    direction one ``mkldnn_rnn_layer``, the directions concatenated, CPU dropout between layers."""
    x = (input.transpose(0, 1) if batch_first else input).contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    stride = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    hidden = h0.size(2)
    hy, cy = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w = params[index * stride:(index + 1) * stride]
            b_ih, b_hh = (w[2], w[3]) if has_biases else (torch.zeros(w[0].shape), torch.zeros(w[1].shape))
            out, h, c, _ = torch.ops.aten.mkldnn_rnn_layer(x, w[0], w[1], b_ih, b_hh, h0[index], c0[index],
                                                           direction > 0, [], LSTM_MODE, hidden, num_layers,
                                                           has_biases, bidirectional, batch_first, train)
            outputs.append(out)
            hy.append(h)
            cy.append(c)
        x = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            x = recurrent_steps.cpu_dropout(x, dropout)
    output = x.transpose(0, 1) if batch_first else x
    return output, torch.stack(hy, 0), torch.stack(cy, 0)


def runs_step_by_step(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether eager runs a recurrent layer over these tensors as ATen's per-step CPU cells
    (:mod:`bonsai_core.recurrent_steps`): all on the CPU, no autocast (which casts the layer whole)."""
    return all(t.device.type == "cpu" for t in tensors) and not torch.is_autocast_enabled("cpu")


def _run_packed(func: Any, args: tuple, sizes: list[int]) -> Any:
    """``_VF.lstm``/``_VF.gru`` over packed data as :mod:`bonsai_core.recurrent_steps` writes ATen's CPU
    layers, or None where eager runs something else (another device, LSTM projections)."""
    data, _, hx, params, *rest = args
    hx_list = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    if not runs_step_by_step([data, *hx_list, *params]):
        return None
    if func is torch._VF.lstm:
        if hx_list[0].size(2) != hx_list[1].size(2):  # proj_size
            return None
        return recurrent_steps.cpu_packed_lstm(data, sizes, hx, params, *rest)
    return recurrent_steps.cpu_packed_gru(data, sizes, hx, params, *rest)


class FusedRecurrent(PackedSequences):
    """Within: ``torch._VF.lstm`` (``nn.LSTM``'s call, input form) runs as :func:`cpu_lstm` where eager
    runs the fused CPU kernel (:func:`runs_fused_kernel`); ``torch._VF.gru`` on the CPU, and both over
    packed sequences (:class:`bonsai_core.packed.PackedSequences`, their batch sizes known), as ATen's
    per-step CPU cells (:mod:`bonsai_core.recurrent_steps`); everything else as usual. For tracing."""

    def __init__(self) -> None:
        super().__init__(run_packed=_run_packed)
        register_workspace_shape()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        if func is torch._VF.lstm and not kwargs and len(args) == 9 and isinstance(args[1], (list, tuple)):
            input, hx, params = args[:3]
            if runs_fused_kernel(input, hx, params):
                return cpu_lstm(*args)
        if func is torch._VF.gru and not kwargs and len(args) == 9 and isinstance(args[2], (list, tuple)):
            input, hx, params = args[:3]
            if runs_step_by_step([input, hx, *params]):
                return recurrent_steps.cpu_gru(*args)
        return super().__torch_function__(func, types, args, kwargs)

