"""A user's model factory, as `bonsai trace tests.user_model:make` loads it."""

import torch

from bonsai_core.zoo import MSELoss


def make(hidden: int = 16):
    model = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    return model, (torch.randn(4, 3),), MSELoss(torch.zeros(4, 2))
