"""The one call in a training script (``bonsai_core.checkpoint`` / ``plan``): the plan applied to the
user's own module trains with the same loss and gradients as without it, within the predicted peak, on
models built from public libraries; the plan cache; clear errors; the examples run."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import bonsai_core as bonsai
from bonsai_core import models
from bonsai_core.errors import BonsaiError, BudgetError, ModelError
from bonsai_core.export_runtime.checkpointing import is_checkpointed
from bonsai_core.measure import measure_step

ROOT = Path(__file__).resolve().parent.parent
PEAK_TOLERANCE = 0.05


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model: nn.Module, call, loss_fn, seed: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(call(model))
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _checked(model: nn.Module, call, loss_fn, report: bonsai.Report, reference: tuple[float, dict]) -> None:
    """Same loss and gradients as the model without the plan (bitwise: the same kernels run)."""
    loss, grads = _step(model, call, loss_fn)
    assert loss == reference[0]
    assert grads.keys() == reference[1].keys()
    for name, g in grads.items():
        assert torch.equal(g, reference[1][name]), name


def test_zoo_gpt_trains_the_same_within_the_predicted_peak(tmp_path):
    model, inputs, loss_fn = models.build("gpt", batch=4, seq=32, width=64, layers=3, heads=2, vocab=128)
    reference = _step(model, lambda m: m(*inputs), loss_fn)
    state = copy.deepcopy(model.state_dict())

    report = bonsai.checkpoint(model, inputs, loss_fn, budget="75%", cache_dir=tmp_path)

    assert report.regions and report.method == "bonsai" and not report.cached
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()), "planning changed the model"
    modules = dict(model.named_modules())
    assert all(is_checkpointed(modules[path]) for path in report.regions)
    assert report.predicted_peak < report.no_remat_peak
    _checked(model, lambda m: m(*inputs), loss_fn, report, reference)
    measured = measure_step(model, inputs, loss_fn)
    assert abs(measured.peak / report.predicted_peak - 1) <= PEAK_TOLERANCE, (measured.peak, report.predicted_peak)
    assert "checkpointed" in str(report) and "predicted peak" in str(report)


def _llama(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    return model, {"input_ids": ids, "labels": ids}


class _Keywords(nn.Module):
    """``model(**batch)`` as a positional call, for measure_step."""

    def __init__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model, self.names = model, list(batch)

    def forward(self, *tensors: torch.Tensor):
        return self.model(**dict(zip(self.names, tensors)))


def test_hf_causal_lm_called_without_a_mask_trains_the_same_within_the_predicted_peak(tmp_path):
    """The usual training call, model(input_ids=..., labels=...) with transformers' default (SDPA)
    attention: traced through transformers' compile-time path, planned, applied to its submodules."""
    model, batch = _llama()
    reference = _step(model, lambda m: m(**batch), lambda out: out.loss)

    report = bonsai.checkpoint(model, batch, lambda out: out.loss, budget="70%", cache_dir=tmp_path)

    assert report.regions and all(not r.startswith("model.model") for r in report.regions)
    assert any(r.startswith("model.layers.") for r in report.regions)
    _checked(model, lambda m: m(**batch), lambda out: out.loss, report, reference)
    measured = measure_step(_Keywords(model, batch), tuple(batch.values()), lambda out: out.loss)
    assert abs(measured.peak / report.predicted_peak - 1) <= PEAK_TOLERANCE, (measured.peak, report.predicted_peak)


def _small_gpt():
    return models.build("gpt", batch=2, seq=16, width=32, layers=2, heads=2, vocab=64)


@pytest.fixture(scope="module")
def cached_plan(tmp_path_factory):
    """A small GPT's plan at 90%, made once and kept in a cache folder: (the plan, the folder)."""
    folder = tmp_path_factory.mktemp("plans")
    model, inputs, loss_fn = _small_gpt()
    return bonsai.plan(model, inputs, loss_fn, budget="90%", cache_dir=folder), folder


def test_the_second_run_applies_the_cached_plan_without_tracing(cached_plan, monkeypatch):
    first, tmp_path = cached_plan
    model, inputs, loss_fn = _small_gpt()
    assert list(tmp_path.glob("*.json"))

    import bonsai_core.trace

    def no_trace(*args, **kwargs):
        raise AssertionError("traced although the plan is cached")

    monkeypatch.setattr(bonsai_core.trace, "trace_step", no_trace)
    again, _, _ = _small_gpt()
    report = bonsai.checkpoint(again, inputs, loss_fn, budget="90%", cache_dir=tmp_path)
    assert report.cached and report.regions == first.report.regions
    assert report.predicted_peak == first.report.predicted_peak

    # Another budget, or another batch size, is another plan.
    with pytest.raises(AssertionError, match="traced although"):
        bonsai.plan(model, inputs, loss_fn, budget="95%", cache_dir=tmp_path)
    other_setting, _, _ = _small_gpt()
    norms = [m for m in other_setting.modules() if isinstance(m, nn.LayerNorm)]
    assert norms
    for m in norms:
        m.eps = 1e-3  # a module setting the forward reads: another plan
    with pytest.raises(AssertionError, match="traced although"):
        bonsai.plan(other_setting, inputs, loss_fn, budget="90%", cache_dir=tmp_path)
    bigger = (torch.cat([inputs[0], inputs[0]]),)
    with pytest.raises(AssertionError, match="traced although"):
        bonsai.plan(model, bigger, loss_fn, budget="90%", cache_dir=tmp_path)


def test_a_corrupt_cache_entry_is_planned_again(cached_plan, tmp_path):
    shutil.copytree(cached_plan[1], tmp_path, dirs_exist_ok=True)
    model, inputs, loss_fn = _small_gpt()
    for path in tmp_path.glob("*.json"):
        path.write_text("{not json")
    made = bonsai.plan(model, inputs, loss_fn, budget="90%", cache_dir=tmp_path)
    assert not made.report.cached and made.graph is not None


def test_checkpoint_again_replaces_the_plan_and_remove_checkpoints_undoes_it():
    model, inputs, loss_fn = _small_gpt()
    reference = _step(model, lambda m: m(*inputs), loss_fn)
    first = bonsai.checkpoint(model, inputs, loss_fn, budget="95%", cache=False)
    second = bonsai.checkpoint(model, inputs, loss_fn, budget="90%", cache=False)
    checkpointed = sorted(p for p, m in model.named_modules() if is_checkpointed(m))
    assert checkpointed == sorted(second.regions) and first.regions
    with pytest.raises(ModelError, match="already checkpointed"):
        bonsai.plan(model, inputs, loss_fn, budget="90%", cache=False)
    assert sorted(bonsai.remove_checkpoints(model)) == checkpointed
    assert not any(is_checkpointed(m) for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())  # each runs its class's forward again
    _checked(model, lambda m: m(*inputs), loss_fn, second, reference)


@pytest.mark.parametrize(("factory", "sizes"), [
    # transformers' ViT: trunc_normal_ in its initialisation (test_robust exports and verifies it in the default run)
    pytest.param("make_vit", dict(batch=16, image=32), marks=pytest.mark.slow),
    ("make_stochastic_depth_cnn", {}),  # BatchNorm + SiLU, stochastic depth: random, and stateful
    ("make_maskless_gpt2", dict(batch=4, seq=32)),  # transformers' GPT-2: SDPA with dropout 0.1, no mask
])
def test_models_from_public_libraries_train_the_same_and_keep_their_state(factory, sizes):
    """Same loss, gradients and buffers (a recomputed BatchNorm does not update its statistics twice)
    as the model without the plan, under one seed."""
    transformers_needed = factory != "make_stochastic_depth_cnn"
    if transformers_needed:
        pytest.importorskip("transformers")
    from tests import robust_models

    torch.manual_seed(0)
    model, inputs, loss_fn = getattr(robust_models, factory)(**sizes)
    reference = copy.deepcopy(model)
    torch.manual_seed(5)
    expected_loss = loss_fn(reference(*inputs))
    expected_loss.backward()

    report = bonsai.checkpoint(model, inputs, loss_fn, budget="75%", cache=False)
    assert report.regions
    torch.manual_seed(5)
    loss = loss_fn(model(*inputs))
    loss.backward()
    assert loss.item() == expected_loss.item()
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name


def test_planning_leaves_the_model_untouched():
    """Planning runs the step on fake copies: a BatchNorm's statistics and batch counter stay as they were."""
    from tests import robust_models

    model, inputs, loss_fn = robust_models.make_stochastic_depth_cnn()
    state = copy.deepcopy(model.state_dict())
    bonsai.plan(model, inputs, loss_fn, budget="70%", cache=False)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert all(p.grad is None for p in model.parameters())


def test_a_fused_recurrent_kernel_is_refused_with_its_size():
    """An LSTM layer is one fused op whose tensors no checkpoint can split: a budget below it names it.
    (80% fits since the trace counts the kernel's workspace: checkpointing the LSTM recomputes it.)"""
    from tests import robust_models

    model, inputs, loss_fn = robust_models.make_lstm(batch=8, seq=32, width=64, layers=3)
    with pytest.raises(BudgetError, match="largest single operator"):
        bonsai.checkpoint(model, inputs, loss_fn, budget="50%", cache=False)


def test_under_torch_compile():
    model, inputs, loss_fn = _small_gpt()
    reference = _step(model, lambda m: m(*inputs), loss_fn)
    report = bonsai.checkpoint(model, inputs, loss_fn, budget="90%", cache=False)
    assert report.regions
    compiled = torch.compile(model, backend="aot_eager")
    loss, grads = _step(model, lambda m: compiled(*inputs), loss_fn)
    assert loss == pytest.approx(reference[0], rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, reference[1][name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_plan_made_for_compile_keeps_the_loss_and_gradients_under_inductor():
    """``compile=True``: the plan laid out for the compiled step (its pointwise saves left to the kernels) and
    then ``torch.compile`` with inductor give the eager step's loss and gradients."""
    model, inputs, loss_fn = models.build("gpt", layers=1)
    reference = _step(model, lambda m: m(*inputs), loss_fn)
    report = bonsai.checkpoint(model, inputs, loss_fn, budget="70%", compile=True, cache=False)
    assert report.regions
    compiled = torch.compile(model)
    loss, grads = _step(model, lambda m: compiled(*inputs), loss_fn)
    assert loss == pytest.approx(reference[0], rel=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, reference[1][name], rtol=1e-4, atol=1e-5)


def test_a_budget_no_plan_meets_names_the_smallest_that_can():
    model, inputs, loss_fn = _small_gpt()
    with pytest.raises(BudgetError, match="smallest budget|at least"):
        bonsai.checkpoint(model, inputs, loss_fn, budget="20%", cache=False)
    assert not any(is_checkpointed(m) for m in model.modules())


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    (dict(budget="auto"), BudgetError, "CUDA"),
    (dict(budget="lots"), BudgetError, "Cannot read the budget"),
    (dict(budget=2.5), BudgetError, "give bytes"),
    (dict(budget="60%", method="dtr"), BonsaiError, "checkpoint-region plans"),
    (dict(budget="60%", optimizer="lion"), BonsaiError, "lion"),
    (dict(budget="60%", nonsense=1), BonsaiError, "nonsense"),
])
def test_bad_arguments_get_clear_errors(kwargs, error, words):
    model, inputs, loss_fn = models.build("gpt", batch=2, seq=16, width=32, layers=1, heads=2, vocab=64)
    with pytest.raises(error, match=words):
        bonsai.plan(model, inputs, loss_fn, cache=False, **kwargs)


@pytest.mark.parametrize(("inputs", "words"), [
    ([1, 2], "a tensor, a tuple of tensors"),
    ({"input_ids": [1, 2]}, "must be a tensor"),
    ({}, "empty dict"),
])
def test_inputs_that_are_not_a_batch_get_clear_errors(inputs, words):
    model, _, loss_fn = models.build("gpt", batch=2, seq=16, width=32, layers=1, heads=2, vocab=64)
    with pytest.raises(ModelError, match=words):
        bonsai.plan(model, inputs, loss_fn, budget="60%", cache=False)


def _run_example(args: list[str], tmp_path: Path, timeout: int = 300) -> str:
    env = {**os.environ, "BONSAI_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # a process of its own, 15-60 s; the one call in a training loop: test_zoo_gpt_trains_the_same_*
def test_example_plain_training_loop(tmp_path):
    out = _run_example(["examples/train_gpt.py", "--steps", "2"], tmp_path)
    assert "checkpointed" in out and "step 1: loss" in out


@pytest.mark.slow  # a process of its own, 20-70 s; the one call on Hugging Face LMs in-process: test_hf_causal_lm_*
def test_example_hugging_face_causal_lm(tmp_path):
    pytest.importorskip("transformers")
    out = _run_example(["examples/train_hf_causal_lm.py", "--steps", "2"], tmp_path)
    assert "checkpointed" in out and "step 1: loss" in out


@pytest.mark.slow
def test_example_fsdp2_on_two_processes(tmp_path):
    pytest.importorskip("transformers")
    out = _run_example(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "examples/train_fsdp.py", "--steps", "2"], tmp_path)
    assert "checkpointed" in out and "step 1: loss per rank" in out
