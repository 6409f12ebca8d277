"""The optimizer step after the backward pass: its state as fixed memory, its temporaries as a peak."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn as nn

from bonsai_core import models
from bonsai_core.errors import BonsaiError, BudgetError
from bonsai_core.graph import Graph
from bonsai_core.measure import LiveBytes, measure_step
from bonsai_core.optimizer import OPTIMIZERS, init_state, make, with_grads, with_optimizer
from bonsai_core.schedule import none_schedule, simulate
from bonsai_core.trace import trace_model
from tests.marks import sweep


@functools.cache
def traced(name: str, **options) -> Graph:
    """``name``'s step traced once for the module's tests (which read it and never change it)."""
    return trace_model(name, **options).graph


def _trainable_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rules_match_a_measured_foreach_step(name, dtype):
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 40)).to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = make(model.parameters(), name)
    state = init_state(opt)
    params = _trainable_bytes(model)
    expected_state = {"adamw": 2, "adam": 2, "sgd": 1}[name] * params
    assert state == expected_state
    for _ in range(2):  # the first step from the initialised state, then a steady one
        with LiveBytes() as tracker:
            opt.step()
        assert tracker.peak == {"adamw": params, "adam": params, "sgd": 0}[name]
        assert tracker.live == 0


def test_initialised_state_leaves_the_first_step_unchanged():
    torch.manual_seed(0)
    a = nn.Linear(8, 4)
    b = nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    for name in ("adamw", "sgd"):
        for m in (a, b):
            for p in m.parameters():
                p.grad = torch.ones_like(p)
        oa, ob = make(a.parameters(), name), make(b.parameters(), name)
        init_state(ob)
        oa.step()
        ob.step()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


@pytest.fixture(scope="module")
def gpt_with_adamw():
    g = traced("gpt", layers=1, batch=1, seq=16)
    return g, with_optimizer(g, "adamw")


def test_with_optimizer_adds_state_to_fixed_memory_and_the_step_as_a_peak(gpt_with_adamw):
    g, ga = gpt_with_adamw
    grads = sum(t[1] for t in g.fixed_tensors if t[2] == "grad")
    assert ga.fixed_mem == g.fixed_mem + 2 * grads
    assert [t[2] for t in ga.fixed_tensors[-2:]] == ["optimizer", "optimizer"]
    assert ga.optimizer == {"name": "adamw", "step_bytes": grads}
    assert ga.optimizer_peak == ga.fixed_mem + grads
    assert Graph.from_dict(json.loads(json.dumps(ga.to_dict()))).hash == ga.hash  # the field round-trips
    sim = simulate(ga, none_schedule(ga))
    assert sim.peak == max(simulate(g, none_schedule(g)).peak + 2 * grads, ga.optimizer_peak)
    assert ga.peak_lower_bound >= ga.optimizer_peak
    assert with_optimizer(g, "none") is g
    with pytest.raises(BonsaiError, match="already has an optimizer"):
        with_optimizer(ga, "sgd")
    with pytest.raises(BonsaiError, match="Unknown optimizer"):
        with_optimizer(g, "lamb")
    assert set(OPTIMIZERS) == {"none", "sgd", "adam", "adamw"}


def test_a_budget_below_the_optimizer_step_is_refused_by_name(gpt_with_adamw):
    from bonsai_core.solvers import solve

    _, ga = gpt_with_adamw
    assert ga.peak_lower_bound == ga.optimizer_peak  # 1 layer, batch 1: the step sets the bound
    with pytest.raises(BudgetError, match="optimizer step"):
        solve(ga, ga.optimizer_peak - 1, "chen")


@pytest.mark.parametrize("name, options", [
    ("gpt", {}), ("gpt", dict(layers=1, batch=1, seq=16)), pytest.param("hf:gpt2", {}, marks=pytest.mark.slow)])
def test_the_optimizer_steps_bytes_match_a_real_step(name, options):
    # what the optimizer adds to the peak, predicted and measured: its state under the activations'
    # peak (gpt), or its step setting the peak (1 layer, batch 1)
    g = traced(name, **options)
    ga = with_optimizer(g, "adamw")
    predicted = simulate(ga, none_schedule(ga)).peak - simulate(g, none_schedule(g)).peak
    without = measure_step(*models.build(name, **options)) if name != "gpt" else None
    model, inputs, loss_fn = models.build(name, **options)
    measured = measure_step(model, inputs, loss_fn, optimizer=make(model.parameters(), "adamw"))
    assert measured.fixed == ga.fixed_mem
    if name == "gpt":  # the zoo's eager step is the traced one: the peak itself is predicted
        assert abs(measured.peak - simulate(ga, none_schedule(ga)).peak) <= 16  # the loss scalar, during the step
    else:  # HF GPT-2's eager step peaks above its trace, whatever the optimizer: compare what the optimizer adds
        assert abs((measured.peak - without.peak) - predicted) <= 16


def test_the_allocator_does_not_add_the_state_twice(gpt_with_adamw):
    from bonsai_core.allocator import replay

    g, ga = gpt_with_adamw
    derived = replay(g, none_schedule(g), optimizer="adam")  # full arena: Adam's state added to the pool
    traced = replay(ga, none_schedule(ga))  # the state is in fixed_mem already
    assert traced.live.max() - simulate(ga, none_schedule(ga)).timeline.max() == 0
    assert derived.live.max() == traced.live.max()


def test_the_allocator_steps_the_optimizer_over_gradients_set_to_none(gpt_with_adamw):
    """Set to None, the gradients are no fixed buffers, but AdamW's step still allocates one temporary per
    gradient: the replayed pool reaches the simulator's optimizer-step peak (the step sets this tiny
    graph's peak), as it does with the gradients kept."""
    from bonsai_core.allocator import replay

    _, ga = gpt_with_adamw
    for graph in (ga, with_grads(ga, "none")):
        result = replay(graph, none_schedule(graph), full=False)
        assert simulate(graph, none_schedule(graph)).peak == graph.optimizer_peak
        assert result.reserved_peak >= graph.optimizer_peak


def test_cli_trace_with_an_optimizer(tmp_path, capsys):
    from bonsai_core.cli import main

    out = tmp_path / "g.json"
    assert main(["trace", "gpt", "--layers", "1", "--optimizer", "sgd", "-o", str(out), "--json"]) == 0
    data = json.loads(out.read_text())
    assert data["optimizer"] == {"name": "sgd", "step_bytes": 0}
    assert sum(t[1] for t in data["fixed_tensors"] if t[2] == "optimizer") > 0


def test_an_export_of_a_graph_with_its_optimizer_verifies_with_the_optimizer_step(tmp_path, capsys):
    from bonsai_core.cli import main
    from bonsai_core.export import load_export

    size = ["--layers", "1", "--batch", "8", "--seq", "64"]  # the activations set the peak, not the step
    g, s, out = tmp_path / "g.json", tmp_path / "s.json", tmp_path / "out"
    assert main(["trace", "gpt", *size, "--optimizer", "adamw", "-o", str(g)]) == 0
    assert main(["solve", str(g), "--budget", "85%", "--method", "chen", "-o", str(s)]) == 0
    assert main(["export", "gpt", *size, str(s), "-o", str(out)]) == 0
    assert load_export(out).INFO["optimizer"] == "adamw"
    capsys.readouterr()
    assert main(["verify", "gpt", *size, str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    graph = Graph.from_dict(json.loads(g.read_text()))
    assert report["predicted_peak"] >= graph.optimizer_peak
    assert abs(report["measured_peak"] - report["predicted_peak"]) <= 64


def test_a_budget_below_the_fixed_memory_is_refused_clearly_with_or_without_an_optimizer():
    """The reserved-bytes loop can ask for a live budget below the fixed memory (even below 0): the
    error names what needs more, not an optimizer the graph does not have (it raised a TypeError)."""
    import pytest

    from bonsai_core.errors import BudgetError
    from bonsai_core.graph import Graph
    from bonsai_core.solvers import solve

    g = Graph.from_nodes("tiny", 100, [dict(name="a", cost=1, mem=8, deps=[]),
                                        dict(name="b", phase="backward", cost=1, mem=8, deps=[0])])
    for budget in (50, -3):
        with pytest.raises(BudgetError, match="largest single operator of 'tiny'"):
            solve(g, budget, "bonsai")


# -- gradients set to None between steps (optimizer.zero_grad()'s default) ------------------------------

# the zoo's GPT in the default run, a Hugging Face Llama in the slow stage
@pytest.mark.parametrize("name, options", sweep([("gpt", dict(layers=2)), ("hf:llama", dict(layers=2, batch=2, seq=64))]))
@pytest.mark.parametrize("optimizer", ["none", "adamw"])
def test_gradients_set_to_none_are_predicted_as_the_steady_step_measures(name, options, optimizer):
    """A steady step whose gradients were set to None: its backward pass makes them (eager keeps each as
    ``.grad`` from its AccumulateGrad) and holds them through the optimizer step; predicted to the byte,
    lower than with zeroed buffers by up to the gradients' bytes."""
    zeroed = with_optimizer(traced(name, **options), optimizer)
    g = with_grads(zeroed, "none")
    grads = sum(t[1] for t in zeroed.fixed_tensors if t[2] == "grad")
    assert g.grads_set_to_none == grads and g.fixed_mem == zeroed.fixed_mem - grads
    assert not any(t[2] == "grad" for t in g.fixed_tensors)
    assert Graph.from_dict(json.loads(json.dumps(g.to_dict()))).hash == g.hash  # the field round-trips
    model, inputs, loss_fn = models.build(name, **options)
    opt = make(model.parameters(), optimizer)
    for _ in range(2):  # the first step, then a steady one
        measured = measure_step(model, inputs, loss_fn, optimizer=opt, allocate_grads=False)
        (opt.zero_grad() if opt else model.zero_grad(set_to_none=True))
        assert all(p.grad is None for p in model.parameters())
    predicted = simulate(g, none_schedule(g)).peak
    assert measured.fixed == g.fixed_mem and abs(measured.peak - predicted) <= 8, (measured.peak, predicted)
    assert predicted < simulate(zeroed, none_schedule(zeroed)).peak  # no gradient lives through the forward
    with pytest.raises(BonsaiError, match="Unknown grads"):
        with_grads(zeroed, "zero")


def test_cli_trace_with_gradients_set_to_none(tmp_path):
    from bonsai_core.cli import main

    out = tmp_path / "g.json"
    assert main(["trace", "gpt", "--layers", "1", "--optimizer", "adamw", "--grads", "none", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["grads"]["set_to_none"] and data["grads"]["bytes"] > 0
    assert not any(t[2] == "grad" for t in data["fixed_tensors"])
