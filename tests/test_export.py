"""The exported model computes what the original does, and allocates what the simulator predicted.

Every zoo model at a small size, under schedule factories ``(graph, level) -> Schedule`` at three
levels: two hand-built ones (checkpoint regions; a general schedule with real recomputation) and the
registered real methods through ``solver_factory`` (level i is a budget ``BUDGET_SHARES[i]`` of the way
from the peak lower bound to the no-remat peak).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Callable

import numpy as np
import pytest
import torch

from bonsai_core import zoo
from bonsai_core.cli import main
from bonsai_core.errors import ScheduleError
from bonsai_core.export import export_model, export_traced, load_export, step_signature, verify_export
from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import Schedule, no_remat_peak, none_schedule, schedule_ops, simulate
from bonsai_core.solvers import METHODS
from bonsai_core.trace import trace_zoo

SMALL = {
    "mlp": dict(batch=64, width=32, layers=4),
    "vgg": dict(batch=2, width=4, layers=1, image=16),
    "resnet": dict(batch=2, width=4, layers=1, image=16),
    "unet": dict(batch=1, width=4, layers=2, image=16),
    "gpt": dict(batch=2, seq=16, width=32, layers=2, heads=2, vocab=64),
}
LEVELS = (0, 1, 2)
BUDGET_SHARES = (0.9, 0.7, 0.5)
ATOL = 1e-5

ScheduleFactory = Callable[[Graph, int], Schedule]


def checkpoint_every_other(graph: Graph, level: int) -> Schedule:
    """A contiguous split of the forward nodes into 2, 3 or 4 segments; every other one recomputed."""
    forward = np.flatnonzero(graph.is_forward)
    count = min((2, 3, 4)[level], len(forward))
    segments = [s for s in np.array_split(forward, count) if len(s)]
    return plan_schedule(graph, CheckpointPlan.of(segments, range(0, len(segments), 2)), "test-checkpoint")


def recompute_before_use(graph: Graph, level: int) -> Schedule:
    """A general schedule: every 4th, 2nd or every droppable forward node is freed after the forward
    pass and recomputed (with its dropped inputs) right before *each* backward node that reads it."""
    loss = int(np.flatnonzero(graph.is_forward).max())
    has_view = np.zeros(graph.n, dtype=bool)
    has_view[graph.alias_of[graph.is_view]] = True
    droppable = [v for v in np.flatnonzero(graph.is_forward & ~graph.is_view & ~has_view) if v != loss]
    dropped = set(droppable[::(4, 2, 1)[level]])
    seq = [int(v) for v in np.flatnonzero(graph.is_forward)]
    for b in np.flatnonzero(~graph.is_forward):
        fresh: set[int] = set()

        def rebuild(v: int) -> None:
            if v in fresh:
                return
            for d in graph.deps(v).tolist():
                if d in dropped:
                    rebuild(d)
            seq.append(v)
            fresh.add(v)

        for d in graph.deps(b).tolist():
            if d in dropped:
                rebuild(d)
        seq.append(int(b))
    return Schedule(graph.name, "test-recompute", schedule_ops(graph, seq), graph_hash=graph.hash)


def solver_factory(method: str, time_limit: float = 20.0) -> ScheduleFactory:
    """A real method at level i's budget: the peak lower bound plus ``BUDGET_SHARES[i]`` of the headroom
    up to the no-remat peak (small models are parameter-heavy, so shares of the peak itself are often
    below the bound). A method that cannot meet a budget is skipped there: that is the solver's
    business, not the exporter's."""
    from bonsai_core.errors import BudgetError, SolverError
    from bonsai_core.solvers import solve

    def factory(graph: Graph, level: int) -> Schedule:
        lb = graph.peak_lower_bound
        budget = int(lb + BUDGET_SHARES[level] * (no_remat_peak(graph) - lb))
        try:
            return solve(graph, budget, method=method, time_limit=time_limit)
        except (BudgetError, SolverError) as e:
            pytest.skip(f"{method} cannot meet this budget: {e}")

    return factory


FACTORIES: dict[str, ScheduleFactory] = {
    "checkpoint-every-other": checkpoint_every_other,
    "recompute-before-use": recompute_before_use,
}
# every real method that does recomputation; the op-level MILP takes minutes over all cases, so slow
FACTORIES.update({m: solver_factory(m) for m in METHODS if m != "none"})
SLOW_FACTORIES = {"checkmate"}


@pytest.fixture(scope="module")
def small_steps():
    """name -> (Traced, StepSignature) of every zoo model at its small size."""
    return {name: (trace_zoo(name, **opts), step_signature(name, opts)) for name, opts in SMALL.items()}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("factory", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FACTORIES else f
                                     for f in FACTORIES])
@pytest.mark.parametrize("name", list(SMALL))
def test_export_matches_original_and_predicted_peak(small_steps, tmp_path, name, factory, level):
    traced, signature = small_steps[name]
    g = traced.graph
    schedule = FACTORIES[factory](g, level)
    sim = simulate(g, schedule)
    out = export_traced(traced, signature, schedule, tmp_path, spec={"model": name, "options": SMALL[name]})
    v = verify_export(name, SMALL[name], out)
    assert v.predicted_peak == sim.peak
    assert v.loss_diff <= ATOL and v.max_grad_diff <= ATOL
    assert v.measured_peak == pytest.approx(sim.peak, rel=0.10)
    if sim.peak < 0.99 * v.original_peak:  # the schedule promises clearly less than the plain model uses
        assert v.measured_peak < v.original_peak


@pytest.mark.parametrize("factory", ["checkpoint-every-other", "recompute-before-use"])
def test_the_test_schedules_really_recompute(small_steps, factory):
    for traced, _ in small_steps.values():
        assert all(simulate(traced.graph, FACTORIES[factory](traced.graph, level)).recomputes > 0 for level in LEVELS)


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_late_frees_and_nodes_left_resident_are_followed(small_steps, tmp_path, name):
    """General schedules need not free at last use: delay random frees (or drop them, leaving the
    node resident at the end); the real step must still match the simulator."""
    traced, signature = small_steps[name]
    g = traced.graph
    rng = np.random.default_rng(0)
    ops = list(recompute_before_use(g, 1).ops)
    for _ in range(40):
        i = int(rng.choice([k for k, (kind, _) in enumerate(ops) if kind == "free"]))
        moved = ops[:i] + ops[i + 1:]
        if rng.random() < 0.2:
            candidate = moved  # never freed: resident at the end
        else:
            j = int(rng.integers(i, len(moved) + 1))
            candidate = moved[:j] + [ops[i]] + moved[j:]
        try:
            simulate(g, candidate)
        except ScheduleError:
            continue  # the move broke a rule (a recompute of a still-resident node, a base freed before a view)
        ops = candidate
    schedule = Schedule(g.name, "test-late-frees", ops, graph_hash=g.hash)
    sim = simulate(g, schedule)
    assert sim.peak > simulate(g, recompute_before_use(g, 1)).peak  # the moves cost memory
    out = export_traced(traced, signature, schedule, tmp_path)
    v = verify_export(name, SMALL[name], out)
    assert v.loss_diff <= ATOL and v.max_grad_diff <= ATOL
    assert abs(v.measured_peak - sim.peak) <= 64


def test_plain_schedule_export_allocates_what_eager_pytorch_does(small_steps, tmp_path):
    traced, signature = small_steps["gpt"]
    out = export_traced(traced, signature, none_schedule(traced.graph), tmp_path)
    v = verify_export("gpt", SMALL["gpt"], out, grads="direct")
    assert v.loss_diff == 0 and v.max_grad_diff == 0
    assert abs(v.measured_peak - v.predicted_peak) <= 64  # the autograd engine's 4-byte loss seed, rounded
    assert v.original_peak == pytest.approx(v.measured_peak, rel=0.01)


def test_scaled_loss_and_autograd_mode_give_the_same_gradients(small_steps, tmp_path):
    traced, signature = small_steps["resnet"]
    out = export_traced(traced, signature, checkpoint_every_other(traced.graph, 1), tmp_path)
    exported = load_export(out)
    model, inputs, loss_fn = zoo.build("resnet", **SMALL["resnet"])
    (3.0 * loss_fn(model(*inputs))).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    for grads in ("direct", "autograd"):
        model.zero_grad(set_to_none=True)
        ck = exported.load(model, grads=grads)
        (3.0 * ck(*inputs, loss_fn=loss_fn)).backward()
        for p, r in zip(model.parameters(), reference):
            torch.testing.assert_close(p.grad, r, atol=ATOL, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(ck(*inputs), model(*inputs))
    loss = ck(*inputs, loss_fn=loss_fn)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once per forward"):
        loss.backward()


def test_wrong_shapes_and_missing_loss_are_explained(small_steps, tmp_path):
    traced, signature = small_steps["mlp"]
    exported = load_export(export_traced(traced, signature, none_schedule(traced.graph), tmp_path))
    model, inputs, loss_fn = zoo.build("mlp", **SMALL["mlp"])
    ck = exported.load(model)
    with pytest.raises(TypeError, match="loss included"):
        ck(*inputs)
    with pytest.raises(ValueError, match="export again"):
        ck(inputs[0][:3], loss_fn=loss_fn)
    with pytest.raises(ValueError, match="parameters"):
        exported.load(zoo.build("mlp", **{**SMALL["mlp"], "layers": 2})[0])


def test_export_refuses_a_schedule_of_another_graph(tmp_path):
    other = trace_zoo("mlp", batch=8, width=16, layers=2).graph
    with pytest.raises(ScheduleError, match="traces to"):
        export_model("mlp", dict(batch=8, width=16, layers=3), none_schedule(other), tmp_path)


def test_exported_folder_runs_without_bonsai_core(tmp_path, monkeypatch):
    (tmp_path / "mymodel.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F

        class Loss(nn.Module):
            def __init__(self, target):
                super().__init__()
                self.register_buffer("target", target)
            def forward(self, out):
                return F.cross_entropy(out, self.target)

        def make(hidden=16):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                  nn.Linear(hidden, 3))
            return model, (torch.randn(32, 8),), Loss(torch.randint(0, 3, (32,)))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    traced = trace_zoo("mymodel:make")
    out = export_model("mymodel:make", {}, recompute_before_use(traced.graph, 2), tmp_path / "export")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["bonsai_core"] = None  # any import of it fails
        sys.path[:0] = [{str(tmp_path)!r}, {str(out)!r}]
        import checkpointed, mymodel
        model, inputs, loss_fn = mymodel.make()
        loss_fn(model(*inputs)).backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        loss = checkpointed.load(model)(*inputs, loss_fn=loss_fn)
        loss.backward()
        assert all((p.grad - r).abs().max() <= 1e-6 for p, r in zip(model.parameters(), ref))
        print("ok", float(loss))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")
    assert "bonsai verify" in (out / "README.md").read_text()


def test_cli_export_and_verify(tmp_path, capsys):
    opts = ["--batch", "2", "--seq", "16", "--width", "32", "--layers", "1", "--heads", "2", "--vocab", "64"]
    graph, sched = tmp_path / "g.json", tmp_path / "s.json"
    assert main(["trace", "gpt", *opts, "-o", str(graph)]) == 0
    g = Graph.from_dict(json.loads(graph.read_text()))
    sched.write_text(json.dumps(checkpoint_every_other(g, 0).to_dict()))
    capsys.readouterr()
    assert main(["export", "gpt", *opts, str(sched), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "schedule.json").is_file()
    capsys.readouterr()
    assert main(["verify", "gpt", *opts, str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_grad_diff"] <= ATOL and abs(report["peak_error"]) < 0.10 and report["ok"]
    assert main(["export", "gpt", *opts[:-2], "--vocab", "32", str(sched), "-o", str(tmp_path / "x")]) == 1
    assert "traces to" in capsys.readouterr().err
