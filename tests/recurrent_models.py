"""Recurrent language models as users bring them (``bonsai trace tests.recurrent_models:FACTORY``):
an embedding, a stacked ``nn.LSTM`` / ``nn.GRU`` (dropout between its layers, drawn inside the fused
kernel), a linear head and cross-entropy over the next tokens. torch.nn only."""

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from bonsai_core.models.zoo import CrossEntropyLoss


class RecurrentLM(nn.Module):
    def __init__(self, cell: str, vocab: int, width: int, layers: int, dropout: float, bidirectional: bool,
                 lengths: list[int] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](width, width, num_layers=layers, dropout=dropout,
                                                          batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(width * (2 if bidirectional else 1), vocab)
        self.lengths = lengths  # packed sequences of these lengths (longest first), or None

    def forward(self, ids):
        x = self.embed(ids)
        if self.lengths is None:
            return self.head(self.rnn(x)[0])
        packed = pack_padded_sequence(x, torch.tensor(self.lengths), batch_first=True)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=ids.shape[1])
        return self.head(out)


def _lm(cell: str, batch: int, seq: int, vocab: int, width: int, layers: int, dropout: float,
        bidirectional: bool = False, packed: bool = False):
    lengths = [seq - (seq // 2) * i // max(batch - 1, 1) for i in range(batch)] if packed else None
    ids = torch.randint(0, vocab, (batch, seq))
    return (RecurrentLM(cell, vocab, width, layers, dropout, bidirectional, lengths), (ids,),
            CrossEntropyLoss(torch.randint(0, vocab, (batch, seq)), flatten=True))


def make_lstm_lm(batch: int = 8, seq: int = 32, vocab: int = 256, width: int = 64, layers: int = 2,
                 dropout: float = 0.1):
    """A 2-layer LSTM language model, dropout 0.1 between its layers."""
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
