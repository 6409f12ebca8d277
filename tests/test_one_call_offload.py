"""``bonsai.checkpoint(..., offload=True)``: the plan's offloads realised with saved-tensor hooks on the
user's own module (``export_runtime/checkpointing.py``, ``apply_offloads``): the same loss and gradients
as without the plan, the device bytes the report predicts (host copies counted apart, as
``LiveBytes.count_on_host`` counts them), the plan cache, and the checkpoint export back-end."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import bonsai_core as bonsai
from bonsai_core import models
from bonsai_core.export_runtime.checkpointing import apply_offloads, is_offloading
from bonsai_core.measure import measure_step
from tests.test_training import PEAK_TOLERANCE, _checked, _Keywords, _llama, _step

GPT = dict(batch=4, seq=32, width=64, layers=2, heads=2, vocab=128)


def _measured_within_the_prediction(report: bonsai.Report, model: nn.Module, inputs, loss_fn) -> None:
    measured = measure_step(model, inputs, loss_fn)
    assert abs(measured.peak / report.predicted_peak - 1) <= PEAK_TOLERANCE, (measured.peak, report.predicted_peak)
    assert measured.peak <= report.budget, (measured.peak, report.budget)
    assert measured.host_peak == report.host_peak  # the CPU's copies: made when saved, dropped with the graph


def test_zoo_gpt_offloads_and_trains_the_same_within_the_predicted_peak(tmp_path):
    """At 95% the zoo GPT fits by offloading alone (nothing recomputed): the offloads are the plan's
    cheapest way under the budget, and no checkpoint holds them on the device."""
    model, inputs, loss_fn = models.build("gpt", **GPT)
    reference = _step(model, lambda m: m(*inputs), loss_fn)

    report = bonsai.checkpoint(model, inputs, loss_fn, budget="95%", cache_dir=tmp_path, offload=True)

    assert report.offloaded > 0 and report.offloaded_bytes > 0 and report.host_peak > 0
    assert "offloaded to host memory" in str(report)
    assert is_offloading(model)
    _checked(model, lambda m: m(*inputs), loss_fn, report, reference)
    _measured_within_the_prediction(report, model, inputs, loss_fn)

    bonsai.remove_checkpoints(model)
    assert not any(is_offloading(m) for m in model.modules()) and "forward" not in model.__dict__
    cached = bonsai.plan(model, inputs, loss_fn, budget="95%", cache_dir=tmp_path, offload=True)
    assert cached.report.cached and cached.offload and cached.report.offloaded_bytes == report.offloaded_bytes


def test_hf_llama_offloads_without_recomputing_and_trains_the_same(tmp_path):
    """At 90% transformers' Llama fits by offloading alone: nothing recomputed, its saved residual sums
    and norms copied to host."""
    model, batch = _llama()
    loss_fn = lambda out: out.loss  # noqa: E731
    reference = _step(model, lambda m: m(**batch), loss_fn)

    report = bonsai.checkpoint(model, batch, loss_fn, budget="90%", cache_dir=tmp_path, offload=True)

    assert report.offloaded_bytes > 0 and report.predicted_peak <= report.budget
    _checked(model, lambda m: m(**batch), loss_fn, report, reference)
    _measured_within_the_prediction(report, _Keywords(model, batch), tuple(batch.values()), loss_fn)


class _Cached(nn.Module):
    """Two linears; the first's output is also kept on the module (a cache the forward writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.kept = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.kept = h
        return self.b(torch.tanh(h))


def test_offloads_the_run_cannot_make_are_found_before_training():
    """An offload held on the device (a module attribute), or one the forward never makes (another call
    count), is named by the check on the step; one the hooks make is not."""
    from bonsai_core.export.checkpoint import offload_misses

    net, x = _Cached(), torch.randn(4, 8)
    offload = {"": {"aten.tanh.default": [0, 1, 7]}}
    missed = offload_misses({}, offload, "net", net, (x,), lambda out: out.sum())
    assert missed == {("", "aten.tanh.default", 0), ("", "aten.tanh.default", 7)}
    assert not is_offloading(net)


def test_offloaded_views_come_back_as_the_same_views():
    """A saved view of an offloaded storage (a transpose read by a matmul) is unpacked as that view of
    the host copy brought back: gradients as without the hooks."""

    class Net(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            h = torch.sin(x)
            return (h.t() @ w).sum() + (h @ w.t()).sum()

    x, w = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    net = Net()
    net(x, w).backward()
    reference = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    offloader = apply_offloads(net, {"": {"aten.sin.default": [0]}})
    offloader.packed, offloader.found = set(), {}
    net(x, w).backward()
    assert offloader.packed == {("", "aten.sin.default", 0)}
    assert torch.equal(x.grad, reference[0]) and torch.equal(w.grad, reference[1])


def test_checkpoint_export_of_an_offload_plan_verifies(tmp_path):
    from bonsai_core.export.checkpoint import export_checkpoint
    from bonsai_core.export.verify import load_checkpointed, verify_checkpoint
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve
    from bonsai_core.trace import trace_model

    options = dict(batch=4, seq=32, width=64, layers=3, heads=2, vocab=128)
    graph = trace_model("gpt", **options).graph
    schedule = solve(graph, int(0.9 * no_remat_peak(graph)), method="bonsai", offload=True, space="regions")
    assert schedule.extra.get("offloaded")
    out = export_checkpoint("gpt", options, schedule, tmp_path / "ck")
    exported = load_checkpointed(out)
    assert exported.OFFLOAD and exported.INFO["offloaded_bytes"] > 0
    assert "Offloaded to host memory" in (out / "README.md").read_text()
    v = verify_checkpoint("gpt", options, out, repeats=1)
    assert v.loss_diff == 0 and v.max_grad_diff == 0, v.to_dict()
    assert abs(v.measured_peak / v.realised_peak - 1) <= PEAK_TOLERANCE, v.to_dict()


def test_offload_takes_the_cheapest_plan_within_the_budget():
    """At 90% the zoo GPT's offload plan fits but keeps its offloads on the device (the checkpoints hold
    them) and recomputes more than the plan without offload, which fits too: offload=True takes the
    cheaper one (+1.76% against +2.64%), never costing more than offload=False where that plan fits."""
    model, inputs, loss_fn = models.build("gpt", **GPT)
    without = bonsai.plan(model, inputs, loss_fn, budget="90%", cache=False).report
    offload = bonsai.plan(model, inputs, loss_fn, budget="90%", cache=False, offload=True).report

    assert without.predicted_peak <= without.budget and offload.predicted_peak <= offload.budget
    assert offload.overhead <= without.overhead
