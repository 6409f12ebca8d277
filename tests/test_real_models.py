"""Models as users bring them (tests/real_models.py: BatchNorm CNNs, a ViT with torch._assert, Hugging
Face GPT-2 and BERT from configs): forward ops labelled forward, unused parameters handled, and the
no-remat predicted peak against a real eager CPU step."""

import pytest
import torch

from bonsai_core import models
from bonsai_core.measure import measure_step
from bonsai_core.schedule import no_remat_peak
from bonsai_core.trace import trace_model

FAST = {"resnet18_bn": dict(batch=2, image=32, width=16), "mobilenet_v3_small": dict(batch=2, image=64)}
TRANSFORMERS = {"vit_assert": dict(batch=4, layers=2, width=64), "gpt2": dict(batch=2, seq=64, width=64),
                "bert_mlm": dict(batch=2, seq=64, width=64)}


def _spec(name):
    return "tests.real_models:" + name


def _predicted_and_measured(name, options):
    traced = trace_model(_spec(name), **options)
    model, inputs, loss_fn = models.build(_spec(name), **options)
    measured = measure_step(model, inputs, loss_fn, frozen=traced.frozen_params)
    return traced, no_remat_peak(traced.graph), measured


def _forward_is_a_prefix_ending_at_the_loss(g):
    forward = [v for v in range(g.n) if g.is_forward[v]]
    assert forward == list(range(len(forward))) and len(forward) > g.n // 3
    assert g.ops[forward[-1]] == "aten.nll_loss_forward.default"


@pytest.mark.slow  # half a minute each on the shared 2-core machine; test_trace has a small BN net
@pytest.mark.parametrize("name", list(FAST))
def test_batch_norm_cnn_traces_forward_and_predicts_the_real_peak(name):
    traced, predicted, measured = _predicted_and_measured(name, FAST[name])
    g = traced.graph
    _forward_is_a_prefix_ending_at_the_loss(g)
    norms = [v for v in range(g.n) if g.ops[v] == "aten._native_batch_norm_legit_functional.default"]
    assert norms and all(g.is_forward[v] for v in norms)
    assert len(traced.buffer_writes) == 3 * len(norms)  # running mean, var, num_batches_tracked
    assert g.fixed_mem == measured.fixed
    assert predicted == pytest.approx(measured.peak, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSFORMERS))
def test_transformer_without_dropout_predicts_the_real_peak(name):
    traced, predicted, measured = _predicted_and_measured(name, {**TRANSFORMERS[name], "dropout": 0.0})
    _forward_is_a_prefix_ending_at_the_loss(traced.graph)
    assert traced.graph.fixed_mem == measured.fixed
    assert predicted == pytest.approx(measured.peak, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSFORMERS))
def test_transformer_with_dropout_is_under_cpu_eager_by_its_float_noise_and_attention(name):
    """The trace records ``native_dropout`` (a bool mask: what CUDA eager and the exported replay
    run); CPU eager's ``dropout`` keeps a float noise tensor instead, 3 bytes more per element. And it
    records SDPA with dropout as the fused kernel a GPU runs (output and logsumexp kept), where CPU eager
    runs SDPA's math path, which keeps each layer's float32 probabilities, noise and dropped
    probabilities (batch x heads x tokens x tokens each) for the backward pass."""
    options = TRANSFORMERS[name]
    traced, predicted, measured = _predicted_and_measured(name, options)
    _forward_is_a_prefix_ending_at_the_loss(traced.graph)
    assert any("native_dropout" in op for op in traced.graph.ops)
    assert any("efficient_attention" in op for op in traced.graph.ops)
    model, (x,), _ = models.build(_spec(name), **options)
    tokens = x.shape[1] if x.dim() == 2 else (x.shape[-1] // 4) ** 2 + 1  # ViT: patches of 4 and a class token
    attention = 2 * 3 * 4 * x.shape[0] * 4 * tokens ** 2  # 2 layers, 4 heads (the factories' defaults)
    assert predicted <= measured.peak <= 1.15 * predicted + attention


@pytest.mark.slow
def test_bert_tied_alias_is_hidden_not_refused():
    traced = trace_model(_spec("bert_mlm"), **TRANSFORMERS["bert_mlm"])
    assert traced.hidden_aliases == ["inner.cls.predictions.bias"] and traced.frozen_params == []
    model, _, _ = models.build(_spec("bert_mlm"), **TRANSFORMERS["bert_mlm"])
    assert "inner.cls.predictions.bias" in dict(model.named_parameters(remove_duplicate=False))


def test_vit_with_torch_assert_traces():
    traced = trace_model(_spec("vit_assert"), batch=2, layers=1, width=32)
    _forward_is_a_prefix_ending_at_the_loss(traced.graph)
    assert torch._assert.__module__ == "torch"


def test_cli_refuses_a_value_branch_with_the_line_and_no_traceback(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "trace", _spec("item_branch"),
                          "-o", str(tmp_path / "g.json")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1
    assert "module 1 (ItemBranch)" in run.stderr and "real_models.py" in run.stderr and ".item()" in run.stderr
    assert "Traceback" not in run.stderr
