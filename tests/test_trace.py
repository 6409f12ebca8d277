import pytest
import torch

from bonsai_core import zoo
from bonsai_core.errors import ModelError
from bonsai_core.measure import LiveBytes, measure_step
from bonsai_core.schedule import none_schedule, simulate
from bonsai_core.trace import trace_step, trace_zoo


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_model_runs_a_deterministic_step(name):
    losses = []
    for _ in range(2):
        model, inputs, loss_fn = zoo.build(name)
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
    model, _, _ = zoo.build(name)
    assert ((g.cost > 0) | g.is_view).all() and (g.mem[g.is_view] == 0).all()
    assert g.fixed_mem >= 2 * sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_defaults_are_activation_dominated(traced_zoo, name):
    g = traced_zoo[name].graph
    peak = simulate(g, none_schedule(g)).peak
    assert peak - g.fixed_mem > g.fixed_mem


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_predicted_no_remat_peak_matches_a_real_step(traced_zoo, name):
    g = traced_zoo[name].graph
    predicted = simulate(g, none_schedule(g)).peak
    measured = measure_step(*zoo.build(name)).peak
    assert measured == pytest.approx(predicted, rel=0.10)
    assert g.fixed_mem == measure_step(*zoo.build(name)).fixed


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
    traced = trace_zoo("gpt", layers=1, width=256, seq=256, vocab=1000)
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
        zoo.build("gpt", **options)


def test_factory_spec_loads_a_user_model():
    model, inputs, loss_fn = zoo.build("tests.user_model:make", hidden=8)
    assert model(*inputs).shape == (4, 2)
    with pytest.raises(ModelError, match="Cannot load"):
        zoo.build("tests.no_such_module:make")


@pytest.mark.slow
def test_gpt2_small_traces_without_allocating():
    traced = trace_zoo("gpt", **zoo.GPT2_SMALL)
    assert traced.graph.n > 1000
