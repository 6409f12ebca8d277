"""Models as users bring them (tests/robust_models.py), through the CLI: trace, solve, export, verify."""

import pytest

from bonsai_core.cli import main
from bonsai_core.export.verify import GRAD_RTOL, CheckpointVerification, Verification


def _trace_solve(model, tmp_path, budget, *options):
    graph, schedule = tmp_path / "g.json", tmp_path / "s.json"
    assert main(["trace", model, *options, "-o", str(graph)]) == 0
    assert main(["solve", str(graph), "--budget", budget, "--method", "bonsai", "-o", str(schedule)]) == 0
    return schedule


def _export_verify(model, tmp_path, budget, capsys, *options):
    schedule = _trace_solve(model, tmp_path, budget, *options)
    assert main(["export", model, *options, str(schedule), "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    code = main(["verify", model, *options, str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    return printed


def test_a_vision_transformer_initialised_with_trunc_normal_traces_exports_and_verifies(tmp_path, capsys):
    """transformers' ViT calls trunc_normal_ (which reads mask.any()) while building: it is built with
    torch.nn.init skipped on fake tensors, and verified on real ones."""
    printed = _export_verify("tests.robust_models:make_vit", tmp_path, "95%", capsys)
    assert "OK" in printed


def test_constructors_that_read_values_build(tmp_path):
    assert main(["trace", "tests.robust_models:make_trunc_normal", "-o", str(tmp_path / "a.json")]) == 0
    assert main(["trace", "tests.robust_models:make_linspace_rates", "-o", str(tmp_path / "b.json")]) == 0


def test_a_value_read_in_forward_is_still_refused_with_the_line():
    from bonsai_core.errors import ModelError
    from bonsai_core.trace import trace_model

    with pytest.raises(ModelError, match="reads a tensor's value"):
        trace_model("tests.robust_models:make_reads_in_forward")


def test_a_causal_lm_called_without_a_mask_traces_exports_and_verifies(tmp_path, capsys):
    """model(input_ids=ids, labels=ids), no attention mask, no cache: transformers' packed-sequence
    check reads a value unless torch.compiler.is_compiling(), which is True while tracing."""
    printed = _export_verify("tests.robust_models:make_maskless_llama", tmp_path, "95%", capsys)
    assert "OK" in printed


def test_a_maskless_gpt2_traces(tmp_path):
    assert main(["trace", "tests.robust_models:make_maskless_gpt2", "-o", str(tmp_path / "g.json")]) == 0


def test_an_lstm_with_dropout_between_layers_is_refused_by_the_replay(tmp_path, capsys):
    schedule = _trace_solve("tests.robust_models:make_lstm", tmp_path, "100%")
    capsys.readouterr()
    assert main(["export", "tests.robust_models:make_lstm", str(schedule), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "'lstm' (LSTM)" in err and "dropout 0.1" in err and "--backend checkpoint" in err


@pytest.mark.slow  # 15-70 s; the model trains alike under the one call in tests/test_training.py
def test_a_batchnorm_cnn_with_stochastic_depth_verifies_printing_both_differences(tmp_path, capsys):
    printed = _export_verify("tests.robust_models:make_stochastic_depth_cnn", tmp_path, "70%", capsys)
    assert "OK" in printed
    assert "gradients bitwise equal" in printed or "of its tensor's largest magnitude" in printed


def test_a_gradient_is_judged_relative_to_its_scale():
    """A BatchNorm CNN's gradient 1.98e-05 apart (> 1e-05 absolute) is a reduction-order difference
    when it is a small fraction of its tensor's scale; the same difference on a tiny gradient is not."""
    def problems(scaled):
        return Verification(device="cpu", loss_original=1.0, loss_exported=1.0, max_grad_diff=1.98e-5,
                            predicted_peak=1000, measured_peak=1000, original_peak=1000, measured_peak_grads_none=900,
                            max_grad_scaled_diff=scaled).problems()

    assert not problems(2e-6)
    assert any("gradient differs" in p for p in problems(10 * GRAD_RTOL))
    checkpointed = dict(device="cpu", batch=2, traced_size=True, loss_original=1.0, loss_exported=1.0,
                        max_grad_diff=1.98e-5, predicted_peak=1000, realised_peak=1000, measured_peak=1000,
                        original_peak=1000, seconds_original=1.0, seconds_exported=1.0, predicted_overhead=0.0)
    assert not CheckpointVerification(**checkpointed, max_grad_scaled_diff=2e-6).problems()
    assert CheckpointVerification(**checkpointed, max_grad_scaled_diff=1e-3).problems()


def test_library_patches_hold_in_the_tracing_thread_only_and_are_put_back():
    import threading

    import torch

    from bonsai_core.trace.patches import libraries_compiling

    original = torch.compiler.is_compiling
    seen = {}
    with libraries_compiling():
        other = threading.Thread(target=lambda: seen.update(other=torch.compiler.is_compiling()))
        other.start()
        other.join()
        seen["here"] = torch.compiler.is_compiling()
    assert seen == {"here": True, "other": False}
    assert torch.compiler.is_compiling is original
