from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bonsai_core import models
from bonsai_core.errors import ModelError
from bonsai_core.measure import LiveBytes, measure_step
from bonsai_core.models import zoo
from bonsai_core.schedule import none_schedule, simulate
from bonsai_core.trace import trace_model, trace_step
from tests.marks import sweep


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_model_runs_a_deterministic_step(name):
    losses = []
    for _ in range(2):
        model, inputs, loss_fn = models.build(name)
        losses.append(float(loss_fn(model(*inputs)).detach()))
    assert losses[0] == losses[1] and losses[0] > 0


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_traced_graph_is_a_whole_training_step(traced_zoo, name):
    g = traced_zoo[name].graph
    phases = [g.phases[v] for v in range(g.n)]
    # forward first, then backward; outputs are the loss and the gradients
    assert phases == sorted(phases, key=lambda p: p != "forward")
    assert g.is_forward.any() and (~g.is_forward).any()
    # nothing dead: every node feeds an output (the loss, the parameter gradients)
    reaches = g.is_output.copy()
    for v in reversed(range(g.n)):
        reaches[v] |= reaches[g.users(v)].any()
    assert reaches.all()
    model, _, _ = models.build(name)
    assert ((g.cost > 0) | g.is_view).all() and (g.mem[g.is_view] == 0).all()
    assert g.fixed_mem >= 2 * sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_defaults_are_activation_dominated(traced_zoo, name):
    g = traced_zoo[name].graph
    peak = simulate(g, none_schedule(g)).peak
    assert peak - g.fixed_mem > g.fixed_mem


# BatchNorm's statistics, attention and a plain MLP by default; the other zoo models in the slow stage
@pytest.mark.parametrize("name", sweep(["resnet", "gpt", "mlp", *(n for n in zoo.ZOO if n not in ("resnet", "gpt", "mlp"))], 3))
def test_predicted_no_remat_peak_matches_a_real_step(traced_zoo, name):
    g = traced_zoo[name].graph
    predicted = simulate(g, none_schedule(g)).peak
    measured = measure_step(*models.build(name)).peak
    assert measured == pytest.approx(predicted, rel=0.10)
    assert g.fixed_mem == measure_step(*models.build(name)).fixed


def test_live_bytes_follows_allocation_and_release():
    with LiveBytes() as tracker:
        a = torch.empty(1000, dtype=torch.float32)
        b = a.view(10, 100)  # a view allocates nothing
        c = torch.empty(500, dtype=torch.float64)
        assert tracker.live == 8000
        del a, b
        assert tracker.live == 4000
        del c
    assert tracker.live == 0 and tracker.peak == 8000


def test_tracing_does_not_allocate_real_memory():
    traced = trace_model("gpt", layers=1, width=256, seq=256, vocab=1000)
    assert traced.graph.n > 50  # a real graph, traced on fake tensors


def test_a_loss_that_captures_a_constant_gets_advice():
    model = torch.nn.Linear(4, 2)
    target = torch.zeros(3, 2)
    with pytest.raises(ModelError, match="nn.Module"):
        trace_step(model, (torch.randn(3, 4),), lambda out: ((out - target) ** 2).mean())


@pytest.mark.parametrize("options, words", [({"depth": 3}, "no option 'depth'"), ({"width": 0}, "positive"),
                                            ({"width": 10, "heads": 3}, "multiple of 3")])
def test_bad_model_options(options, words):
    with pytest.raises(ModelError, match=words):
        models.build("gpt", **options)


def test_factory_spec_loads_a_user_model():
    model, inputs, loss_fn = models.build("tests.user_model:make", hidden=8)
    assert model(*inputs).shape == (4, 2)
    with pytest.raises(ModelError, match="Cannot load"):
        models.build("tests.no_such_module:make")


@pytest.mark.slow
def test_gpt2_small_traces_without_allocating():
    traced = trace_model("gpt", **zoo.GPT2_SMALL)
    assert traced.graph.n > 1000


# -- BatchNorm, unused parameters, data-dependent code ----------------------------------------------

def _bn_net():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4)).train()
    return model, (torch.randn(2, 3, 8, 8),), zoo.CrossEntropyLoss(torch.tensor([0, 3]))


def test_batch_norm_ops_are_forward_and_the_loss_ends_the_forward_pass():
    traced = trace_step(*_bn_net())
    g = traced.graph
    forward = [v for v in range(g.n) if g.is_forward[v]]
    assert forward == list(range(len(forward)))  # a prefix: forward, then backward
    assert g.ops[forward[-1]] == "aten.nll_loss_forward.default"  # the loss is the last forward op
    ops = {g.ops[v]: g.phases[v] for v in range(g.n)}
    assert ops["aten._native_batch_norm_legit_functional.default"] == "forward"
    assert ops["aten.relu.default"] == "forward" and ops["aten.addmm.default"] == "forward"
    assert ops["aten.native_batch_norm_backward.default"] == "backward"
    assert [b for _, b in traced.buffer_writes] == ["model.1.running_mean", "model.1.running_var",
                                                    "model.1.num_batches_tracked"]


def test_batch_norm_statistics_add_no_bytes_and_do_not_keep_the_output_alive():
    g = trace_step(*_bn_net()).graph
    bn = g.ops.index("aten._native_batch_norm_legit_functional.default")
    assert g.mem[bn] == 2 * 8 * 8 * 8 * 4  # the normalised output only: running stats go into buffers
    stats = [v for v in g.users(bn).tolist() if g.ops[v] == "getitem"]
    assert sorted(int(g.mem[v]) for v in stats) == [0, 0, 32, 32]  # new running mean/var, save_mean/rstd
    assert all(g.is_forward[u] for u in g.users(bn))  # read by relu and its own outputs, not by backward
    counter = g.names.index("add")  # num_batches_tracked + 1, written in place by eager
    assert g.mem[counter] == 0


def test_batch_norm_model_predicted_peak_matches_a_real_step():
    model, inputs, loss_fn = _bn_net()
    g = trace_step(model, inputs, loss_fn).graph
    measured = measure_step(model, inputs, loss_fn)
    assert measured.fixed == g.fixed_mem
    assert simulate(g, none_schedule(g)).peak == pytest.approx(measured.peak, rel=0.05)


class _PartlyUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_parameters_without_gradient_are_traced_frozen():
    torch.manual_seed(0)
    model, inputs, loss_fn = _PartlyUsed(), (torch.randn(2, 4),), zoo.MSELoss(torch.zeros(2, 4))
    traced = trace_step(model, inputs, loss_fn)
    assert traced.frozen_params == ["unused.weight", "unused.bias"]
    assert all(p.requires_grad for p in model.parameters())  # put back after tracing
    measured = measure_step(model, inputs, loss_fn, frozen=traced.frozen_params)
    assert model.unused.weight.grad is None and model.used.weight.grad is not None
    assert traced.graph.fixed_mem == measured.fixed  # no gradient bytes for the frozen ones


class _ItemBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum().item() > 0:  # a branch on a tensor's value
            x = x * 2
        return self.lin(x)


class _TensorAssert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        torch._assert(x.shape[1] == 4, "four features")
        torch._assert(torch.isfinite(x).all(), "finite input")  # a check on a tensor condition
        return self.lin(x)


def test_a_branch_on_a_tensor_value_names_the_module_and_line():
    model = torch.nn.Sequential(_ItemBranch())
    with pytest.raises(ModelError) as e:
        trace_step(model, (torch.randn(2, 4),), zoo.MSELoss(torch.zeros(2, 4)))
    message = str(e.value)
    assert "module 0 (_ItemBranch)" in message and "test_trace.py" in message
    assert "x.sum().item() > 0" in message and "torch.where" in message


class _Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(x)


def test_a_batch_norm_with_one_value_per_channel_asks_for_a_larger_batch():
    """Training-mode batch norm on a batch of one (hf:resnet --batch 1 reaches a 1 x 1 stage): the
    message says why and what to change, not only torch's words."""
    model = torch.nn.Sequential(_Normed())
    with pytest.raises(ModelError) as e:
        trace_step(model, (torch.randn(1, 4),), zoo.MSELoss(torch.zeros(1, 4)), name="bn")
    message = str(e.value)
    assert "module 0 (_Normed)" in message and "self.norm(x)" in message
    assert "more than one value per channel" in message and "--batch 2" in message


def test_a_torch_assert_on_a_tensor_is_skipped_while_tracing():
    real_assert = torch._assert
    traced = trace_step(_TensorAssert(), (torch.randn(2, 4),), zoo.MSELoss(torch.zeros(2, 4)))
    assert traced.graph.is_forward.any() and torch._assert is real_assert
    with pytest.raises(AssertionError, match="finite"):  # eager still checks
        _TensorAssert()(torch.full((2, 4), float("nan")))


def test_loss_targets_that_are_the_input_ids_count_once_in_fixed_memory():
    """A language model's targets are its input ids: one storage, a loss buffer and the batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    ids = torch.randint(0, 16, (2, 32))
    loss_fn = zoo.CrossEntropyLoss(ids, flatten=True)
    g = trace_step(model, (ids,), loss_fn).graph
    assert g.fixed_mem == measure_step(model, (ids,), loss_fn).fixed
    assert sum(t[1] for t in g.fixed_tensors if t[2] in ("buffer", "input")) == ids.numel() * 8


def _mlp(*dropouts: float) -> torch.nn.Sequential:
    torch.manual_seed(0)
    gaps = [[torch.nn.Dropout(p)] for p in dropouts] or [[], []]
    return torch.nn.Sequential(torch.nn.Linear(16, 64), *gaps[0], torch.nn.GELU(), *gaps[1], torch.nn.Linear(64, 4))


@pytest.mark.parametrize("dropouts, train", [((0.0, 0.0), True), ((0.5, 0.1), False)])
def test_a_dropout_that_drops_nothing_is_no_copy(dropouts, train):
    """Eager's dropout with p=0 (or in eval mode) returns its input: the step's graph and peak are
    those of the model without the dropouts (AOTAutograd's decomposition would add a clone)."""
    inputs, loss_fn = (torch.randn(32, 16),), zoo.MSELoss(torch.zeros(32, 4))
    plain = trace_step(_mlp(), inputs, loss_fn).graph
    g = trace_step(_mlp(*dropouts).train(train), inputs, loss_fn).graph
    assert g.ops == plain.ops and not any(op.startswith("aten.clone") for op in g.ops)
    assert simulate(g, none_schedule(g)).peak == simulate(plain, none_schedule(plain)).peak


def test_what_the_code_holds_never_makes_a_separated_output_an_op_of_its_own():
    """HF GPT-2 holds its embeddings until the final layer norm: the holder is that op, not its rstd
    output (a getitem with a dep more would be rebuilt alone, without its op: rstd None in the export)."""
    graph = trace_model("tests.export_models:hf_gpt2").graph
    holders = [v for v, held in enumerate(graph.held) if held]
    assert holders and all(graph.ops[v] != "getitem" for v in holders)
    separated = [v for v in range(graph.n) if graph.ops[v] == "getitem" and graph.mem[v] > 0 and not graph.is_view[v]]
    assert separated and all(graph.output_of[v] >= 0 for v in separated)


class _GatheredScores(torch.nn.Module):
    """Scores gathered at positions from a buffer (DeBERTa-v2's relative attention, an RL policy's taken
    actions): autograd's ``GatherBackward0`` saves the whole scores tensor, which its traced formula
    (``new_zeros`` of its shape, ``scatter_add``) reads only for its shape."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 512)
        self.register_buffer("positions", torch.arange(32).remainder(7).unsqueeze(1))

    def forward(self, x):
        scores = self.lin(x).relu() * 2
        return torch.gather(scores, 1, self.positions.expand(32, 8))


def test_a_tensor_saved_only_for_its_shape_is_held_until_its_backward_runs():
    torch.manual_seed(0)
    model, inputs, loss_fn = _GatheredScores(), (torch.randn(32, 16),), lambda out: out.square().mean()
    g = trace_step(model, inputs, loss_fn, kernels="cpu").graph
    scores = g.ops.index("aten.mul.Tensor")
    assert int(g.mem[scores]) == 32 * 512 * 4 and scores in g.held[g.ops.index("aten.scatter_add.default")]
    assert simulate(g, none_schedule(g)).peak == measure_step(model, inputs, loss_fn).peak


class _TargetLoss(nn.Module):
    """``loss(out, target)`` against a target held as a buffer."""

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], target: torch.Tensor) -> None:
        super().__init__()
        self.loss = loss
        self.register_buffer("target", target)

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        return self.loss(out, self.target)


@pytest.mark.parametrize("loss", [
    lambda target: zoo.MSELoss(target),
    lambda target: _TargetLoss(lambda o, t: F.mse_loss(o, t, reduction="sum"), target),
    lambda target: _TargetLoss(F.smooth_l1_loss, target),
    lambda target: _TargetLoss(lambda o, t: F.binary_cross_entropy(o.sigmoid(), t.sigmoid()), target),
    lambda target: _TargetLoss(lambda o, t: F.soft_margin_loss(o, t.sign()), target),
], ids=["mse", "mse-sum", "smooth-l1", "bce", "soft-margin"])
def test_a_reduced_loss_that_keeps_its_unreduced_buffer_is_predicted_to_the_byte(loss):
    """These kernels compute the unreduced loss into their output and resize it to 0-d, which keeps the
    storage: the loss holds input-sized bytes through the backward pass (32 KiB here, not 4 B)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 256))
    inputs, loss_fn = (torch.randn(32, 16),), loss(torch.randn(32, 256))
    g = trace_step(model, inputs, loss_fn, kernels="cpu").graph
    assert int(g.mem[next(v for v, op in enumerate(g.ops) if "loss" in op or "binary" in op)]) == 32 * 256 * 4
    assert simulate(g, none_schedule(g)).peak == measure_step(model, inputs, loss_fn).peak
