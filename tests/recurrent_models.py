"""Recurrent language models as users bring them (``bonsai trace tests.recurrent_models:FACTORY``):
an embedding, a stacked ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` in any configuration torch.nn offers
(dropout between its layers, bidirectional, ``proj_size``, ``batch_first``, packed sequences, initial
states given as inputs), a linear head and cross-entropy over the next tokens. torch.nn only."""

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from bonsai_core.models.zoo import CrossEntropyLoss

CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class RecurrentLM(nn.Module):
    def __init__(self, cell: str, vocab: int, width: int, layers: int, dropout: float, bidirectional: bool,
                 lengths: list[int] | None = None, proj_size: int = 0, batch_first: bool = True,
                 nonlinearity: str = "tanh") -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        options = {"proj_size": proj_size} if proj_size else {"nonlinearity": nonlinearity} if cell == "rnn" else {}
        self.rnn = CELLS[cell](width, width, num_layers=layers, dropout=dropout, batch_first=batch_first,
                               bidirectional=bidirectional, **options)
        self.head = nn.Linear((proj_size or width) * (2 if bidirectional else 1), vocab)
        self.lengths = lengths  # packed sequences of these lengths (longest first), or None
        self.batch_first = batch_first

    def forward(self, ids, *states):
        x = self.embed(ids)
        x = x if self.batch_first else x.transpose(0, 1)
        hx = None if not states else tuple(states) if len(states) == 2 else states[0]
        if self.lengths is not None:
            x = pack_padded_sequence(x, torch.tensor(self.lengths), batch_first=self.batch_first)
        y = self.rnn(x, hx)[0]
        if self.lengths is not None:
            y, _ = pad_packed_sequence(y, batch_first=self.batch_first, total_length=ids.shape[1])
        return self.head(y if self.batch_first else y.transpose(0, 1))


def _lm(cell: str, batch: int, seq: int, vocab: int, width: int, layers: int, dropout: float,
        bidirectional: bool = False, packed: bool = False, proj_size: int = 0, batch_first: bool = True,
        states: bool = False, nonlinearity: str = "tanh"):
    lengths = [seq - (seq // 2) * i // max(batch - 1, 1) for i in range(batch)] if packed else None
    model = RecurrentLM(cell, vocab, width, layers, dropout, bidirectional, lengths, proj_size, batch_first, nonlinearity)
    ids = torch.randint(0, vocab, (batch, seq))
    inputs = (ids,)
    if states:  # learned initial states, as a user passes (h0, c0)
        rows = layers * (2 if bidirectional else 1)
        h0 = torch.zeros(rows, batch, proj_size or width, requires_grad=True)
        inputs = (ids, h0, torch.zeros(rows, batch, width, requires_grad=True)) if cell == "lstm" else (ids, h0)
    return model, inputs, CrossEntropyLoss(torch.randint(0, vocab, (batch, seq)), flatten=True)


def make_recurrent_lm(cell: str = "lstm", batch: int = 4, seq: int = 16, vocab: int = 64, width: int = 32,
                      layers: int = 2, dropout: float = 0.1, bidirectional: bool = False, packed: bool = False,
                      proj_size: int = 0, batch_first: bool = True, states: bool = False, nonlinearity: str = "tanh"):
    """Any configuration: ``cell`` lstm, gru or rnn, and nn's own options."""
    return _lm(cell, batch, seq, vocab, width, layers, dropout, bidirectional, packed, proj_size, batch_first,
               states, nonlinearity)


def make_lstm_lm(batch: int = 8, seq: int = 32, vocab: int = 256, width: int = 64, layers: int = 2,
                 dropout: float = 0.1):
    """A 2-layer LSTM language model, dropout 0.1 between its layers (issue 44's case)."""
    return _lm("lstm", batch, seq, vocab, width, layers, dropout)


def make_gru_lm(batch: int = 8, seq: int = 32, vocab: int = 256, width: int = 64, layers: int = 2,
                dropout: float = 0.1):
    return _lm("gru", batch, seq, vocab, width, layers, dropout)


def make_bilstm_lm(batch: int = 8, seq: int = 32, vocab: int = 256, width: int = 64, layers: int = 2,
                   dropout: float = 0.1):
    return _lm("lstm", batch, seq, vocab, width, layers, dropout, bidirectional=True)


def make_packed_lstm_lm(batch: int = 8, seq: int = 32, vocab: int = 256, width: int = 64, layers: int = 2,
                        dropout: float = 0.1):
    """Sequences of decreasing lengths (seq down to about seq/2), packed."""
    return _lm("lstm", batch, seq, vocab, width, layers, dropout, packed=True)
