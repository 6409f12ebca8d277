"""PyTorch's own value-reading ops traced by their shapes (issue 55): CTC loss with its lengths as tensors
plans and trains through the one call; an op whose output's shape does depend on values gets advice
about that op, and a value the user's code reads keeps its own."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import bonsai_core as bonsai
from bonsai_core.errors import ValueReadError
from bonsai_core.measure import measure_step
from bonsai_core.trace import trace_step


class Acoustic(nn.Module):
    """A small CTC acoustic model: a convolutional front end, residual MLP blocks, log-probabilities
    time-major as ``F.ctc_loss`` takes them."""

    def __init__(self, features: int = 40, width: int = 64, vocab: int = 30, blocks: int = 3) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(features, width, 5, padding=2), nn.GELU(),
                                  nn.Conv1d(width, width, 5, padding=2), nn.GELU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: batch x features x time
        h = self.conv(x).transpose(1, 2)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).log_softmax(-1).transpose(0, 1)


class CTCLoss(nn.Module):
    """``F.ctc_loss`` with the batch's targets and lengths as tensors (buffers), as CTC recipes pass them."""

    def __init__(self, targets: torch.Tensor, input_lengths: torch.Tensor, target_lengths: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("targets", targets)
        self.register_buffer("input_lengths", input_lengths)
        self.register_buffer("target_lengths", target_lengths)

    def forward(self, log_probs: torch.Tensor) -> torch.Tensor:
        return F.ctc_loss(log_probs, self.targets, self.input_lengths, self.target_lengths, zero_infinity=True)


def make_ctc(batch: int = 4, steps: int = 200, concatenated: bool = False):
    """Targets padded to the batch's longest (``batch x 30``), or concatenated (1-D)."""
    torch.manual_seed(0)
    target_lengths = torch.tensor([30, 25, 18, 12, 27, 9, 30, 21][:batch])
    targets = torch.randint(1, 30, (int(target_lengths.sum()),) if concatenated else (batch, int(target_lengths.max())))
    input_lengths = torch.tensor([steps - 20 * i for i in range(batch)])
    return Acoustic(), (torch.randn(batch, 40, steps),), CTCLoss(targets, input_lengths, target_lengths)


@pytest.mark.parametrize("concatenated", [False, True], ids=["padded", "concatenated"])
def test_ctc_loss_with_tensor_lengths_is_traced_by_its_shapes(concatenated):
    """On fake tensors (the one call's trace) the graph holds _ctc_loss and its backward, log_alpha sized
    for the longest target's bound from the targets' shape: exact for targets padded to the batch's
    longest, above it for concatenated ones. The step without a plan is predicted to the byte (log_alpha
    does not set this step's peak)."""
    model, inputs, loss_fn = make_ctc(concatenated=concatenated)
    made = bonsai.plan(model, inputs, loss_fn, budget="100%", cache=False)
    graph = made.graph
    ctc = [v for v in range(graph.n) if graph.ops[v] == "aten._ctc_loss.Tensor"]
    assert len(ctc) == 1 and "aten._ctc_loss_backward.Tensor" in graph.ops
    batch, steps = inputs[0].shape[0], inputs[0].shape[2]
    longest = int(loss_fn.targets.shape[0] if concatenated else loss_fn.target_lengths.max())
    assert graph.mem[ctc[0]] == 4 * batch + 4 * batch * steps * (2 * longest + 1)
    assert measure_step(copy.deepcopy(model), inputs, loss_fn).peak == made.report.no_remat_peak


def test_the_longest_target_is_read_where_it_is_known():
    from bonsai_core.ctc import longest_target

    targets = torch.zeros(3, 9)
    assert longest_target(targets, [4, 7, 2]) == 7  # the int-list overload: the lengths are there
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.tensor([4, 7, 2]))
        assert longest_target(mode.from_tensor(targets), fake) == 9  # no value: the padded width bounds it


@pytest.mark.parametrize("budget", ["60%", "80%"])
def test_a_ctc_model_plans_and_trains_through_the_one_call(budget):
    model, inputs, loss_fn = make_ctc()
    reference = copy.deepcopy(model)
    expected = loss_fn(reference(*inputs))
    expected.backward()
    report = bonsai.checkpoint(model, inputs, loss_fn, budget=budget, cache=False)
    loss = loss_fn(model(*inputs))
    loss.backward()
    assert report.regions and loss.item() == expected.item()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    for _ in range(2):
        measured = measure_step(model, inputs, loss_fn).peak
        assert measured <= report.budget and abs(measured / report.predicted_peak - 1) < 1e-6, (measured, str(report))


class MaskedTokens(nn.Module):
    """Keeps the non-padding positions with boolean indexing: an output whose shape is a count of values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[x.abs().sum(-1) > 0])


def test_an_op_whose_shape_comes_from_values_gets_advice_about_shapes():
    with pytest.raises(ValueReadError, match=r"output's shape depends on its input's values.*nonzero_static") as info:
        trace_step(MaskedTokens(), (torch.randn(4, 8),), lambda out: out.sum())
    assert "`.item()`" not in str(info.value)
