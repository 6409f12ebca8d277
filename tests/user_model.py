"""A user's model factory, as `bonsai trace tests.user_model:make` loads it."""

import torch

from bonsai_core.zoo import MSELoss


def make(hidden: int = 16):
    model = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    return model, (torch.randn(4, 3),), MSELoss(torch.zeros(4, 2))


class _PositionTable(torch.nn.Module):
    """Looks positions up in a table one row too short: fake tensors (shapes only) never notice."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(seq, 2)
        self.register_buffer("positions", torch.arange(1, seq + 1))

    def forward(self, x):
        return x + self.table(self.positions)


def make_out_of_range(seq: int = 4):
    return _PositionTable(seq), (torch.randn(seq, 2),), MSELoss(torch.zeros(seq, 2))
