"""A user's model factory, as `bonsai trace tests.user_model:make` loads it."""

import torch

from bonsai_core.models.zoo import MSELoss


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


class _ResidualBlocks(torch.nn.Module):
    """A small CNN as users write it: residual blocks of conv, BatchNorm and GELU in a ModuleList."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, width, 3, padding=1)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.BatchNorm2d(width),
                                torch.nn.GELU()) for _ in range(layers))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


def make_batchnorm_cnn(width: int = 16, layers: int = 6, batch: int = 2, image: int = 8):
    from bonsai_core.models.zoo import CrossEntropyLoss

    return (_ResidualBlocks(width, layers), (torch.randn(batch, 3, image, image),),
            CrossEntropyLoss(torch.randint(0, 10, (batch,))))


def make_raising(hidden: int = 16):
    """A factory with a bug of its own."""
    raise ValueError(f"no layer of width {hidden}")
