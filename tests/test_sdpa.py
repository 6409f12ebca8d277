"""Attention and precision as they are trained: ``hf:`` models on SDPA (``--attention``), SDPA with
dropout recorded as the fused kernel a GPU runs and replayed on the CPU with eager's dropout mask, and
models whose parameters are bf16 (``--dtype``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from bonsai_core import models
from bonsai_core.attention import EFFICIENT_ATTENTION
from bonsai_core.cli import main
from bonsai_core.errors import ModelError
from bonsai_core.export import export_traced, step_signature, verify_export
from bonsai_core.export_runtime import runtime
from bonsai_core.measure import measure_step
from bonsai_core.models import zoo
from bonsai_core.schedule import COMPUTE, no_remat_peak, none_schedule
from bonsai_core.trace import trace_model
from tests.marks import sweep

pytest.importorskip("transformers")

TEXT = dict(batch=2, seq=16, width=32, layers=1, heads=2, vocab=64)
FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"
BYTES = 16  # the measured peak may exceed the prediction by the loss seed and verify's check of it


@pytest.fixture(scope="module")
def text_traces():
    """arch -> the Hugging Face model's step at TEXT's sizes, traced once for the tests that read it."""
    return {arch: trace_model(f"hf:{arch}", **TEXT) for arch in ("llama", "gpt2")}


def _fx_nodes(traced, op: str):
    return [n for n in traced.module.graph.nodes if str(n.target) == op]


# -- which attention the step runs ---------------------------------------------------------------

def test_hf_models_are_built_with_sdpa_unless_eager_is_asked_for():
    assert models.build("hf:llama", **TEXT)[0].model.config._attn_implementation == "sdpa"
    assert models.build("hf:llama", attention="eager", **TEXT)[0].model.config._attn_implementation == "eager"
    assert models.build("hf:resnet", batch=2, image=16, width=8, layers=1)[0].model.config._attn_implementation == "eager"
    with pytest.raises(ModelError, match="attention='flash'; choose one of: sdpa, eager"):
        models.build("hf:llama", attention="flash", **TEXT)
    with pytest.raises(ModelError, match="has no SDPA attention"):
        models.build("hf:resnet", attention="sdpa", batch=2, image=16, width=8, layers=1)
    with pytest.raises(ModelError, match="applies to hf: models only"):
        models.build("gpt", attention="sdpa")
    assert "attention" not in zoo.ZooEntry("x", lambda batch=1, *, attention=None: None, "").options


def test_the_trace_calls_sdpa_as_eager_does_causal_without_a_mask(text_traces):
    """Eager transformers sees a batch without padding and calls SDPA with is_causal=True and no mask
    (and, for grouped-query attention, the key/value heads as they are); on fake tensors it cannot read
    the batch and would build a batch x seq x seq mask, which the kernel then keeps for the backward."""
    llama = text_traces["llama"]
    (call,) = _fx_nodes(llama, FLASH_CPU)
    assert call.args[4] is True and call.kwargs.get("attn_mask") is None
    assert call.args[1].meta["val"].shape[1] == TEXT["heads"] // 2  # grouped-query attention, not repeated
    assert not _fx_nodes(llama, "aten.where.self")
    gpt2 = text_traces["gpt2"]
    (call,) = _fx_nodes(gpt2, EFFICIENT_ATTENTION)
    assert call.args[3] is None and call.args[6] is True  # no bias, causal
    eager = trace_model("hf:gpt2", attention="eager", **TEXT)
    assert not _fx_nodes(eager, EFFICIENT_ATTENTION) and _fx_nodes(eager, "aten._softmax.default")


def test_attention_dropout_keeps_what_the_fused_kernel_keeps():
    """GPT-2's attention dropout (0.1): the graph keeps the output, the logsumexp (padded to 32 rows)
    and the generator's seed and offset, not the seq x seq probabilities and mask of the math path."""
    options = dict(TEXT, seq=64)
    sdpa, eager = trace_model("hf:gpt2", **options).graph, trace_model("hf:gpt2", attention="eager", **options).graph
    (v,) = [v for v in range(sdpa.n) if sdpa.ops[v] == EFFICIENT_ATTENTION]
    batch, heads, seq, head_dim = options["batch"], options["heads"], options["seq"], options["width"] // options["heads"]
    outputs = sorted(int(sdpa.mem[u]) for u in range(sdpa.n) if sdpa.ops[u] == "getitem" and v in sdpa.deps(u).tolist())
    assert int(sdpa.mem[v]) == 4 * batch * heads * seq * head_dim
    assert outputs == [8, 8, 4 * batch * heads * seq]
    probabilities = f"[{batch}, {heads}, {seq}, {seq}]"
    assert not any(probabilities in shape for shape in sdpa.shapes) and any(probabilities in s for s in eager.shapes)
    assert no_remat_peak(sdpa) < no_remat_peak(eager) - 2 * 4 * batch * heads * seq * seq


def test_sdpa_and_dtype_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["trace", "hf:llama", *[f"--{k}={v}" for k, v in TEXT.items()], "--attention", "eager",
                 "--dtype", "bf16", "-o", str(out), "--json"]) == 0
    assert "hf:llama(attention=eager, batch=2, dtype=bf16" in capsys.readouterr().out
    assert main(["trace", "gpt", "--attention", "sdpa", "-o", str(out)]) == 1
    assert "applies to hf: models only" in capsys.readouterr().err


# -- the CPU's equivalent of the memory-efficient kernel -------------------------------------------

@pytest.mark.parametrize("dtype,bias,causal", [(torch.float32, False, True), (torch.float32, True, False),
                                               (torch.bfloat16, False, True)])
def test_cpu_efficient_attention_draws_eager_dropout_mask(dtype, bias, causal):
    """Under one seed the runtime's CPU attention draws the mask eager SDPA (its math path) draws, and
    leaves the generator where eager leaves it; its backward draws the same mask again and puts the
    live generator back."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 40, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 1, 40, 40, dtype=dtype, requires_grad=True) if bias else None
    grad = torch.randn(2, 3, 40, 8, dtype=dtype)
    p, scale = 0.3, 0.2

    torch.manual_seed(7)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale)
    after_eager = torch.get_rng_state()
    out.backward(grad)
    torch.manual_seed(7)
    bias4 = None if mask is None else mask.detach().expand(2, 3, 40, 40)
    got, lse, seed, offset = runtime.efficient_attention_forward(q.detach(), k.detach(), v.detach(), bias4, True, p,
                                                                 causal, scale=scale)
    assert torch.equal(torch.get_rng_state(), after_eager)
    assert got.stride() == (40 * 3 * 8, 8, 3 * 8, 1) and lse.shape == (2, 3, 64)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, out.detach(), **tol)
    live = torch.get_rng_state()
    grads = runtime.efficient_attention_backward(grad, q.detach(), k.detach(), v.detach(), bias4, got, lse, seed, offset,
                                                 p, [True, True, True, bias], causal, scale=scale)
    assert torch.equal(torch.get_rng_state(), live)
    for mine, eager in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, eager, **tol)
    if bias:
        torch.testing.assert_close(grads[3].sum(1, keepdim=True), mask.grad, **tol)


def test_efficient_attention_helpers_call_the_kernel_off_the_cpu():
    """Off the CPU the helpers call the memory-efficient kernel itself (dropout included): checked on the
    meta device, which has its shapes and signatures (no GPU here)."""
    q = torch.empty(2, 3, 40, 8, device="meta")
    out, lse, seed, offset = runtime.efficient_attention_forward(q, q, q, None, True, 0.1, True, scale=0.25)
    assert out.shape == q.shape and lse.shape == (2, 3, 64) and seed.shape == offset.shape == ()
    grads = runtime.efficient_attention_backward(out, q, q, q, None, out, lse, seed, offset, 0.1,
                                                 [True, True, True, False], True, scale=0.25)
    assert [g.shape for g in grads[:3]] == [q.shape] * 3 and grads[3] is None


# -- exported and verified -----------------------------------------------------------------------

def test_exported_gpt2_recomputes_its_attention_with_the_same_dropout(tmp_path, text_traces):
    """hf:gpt2 on SDPA (attention dropout 0.1): a schedule that recomputes the attention kernel replays
    the generator state, so loss and gradients are eager's, at the predicted peak."""
    from tests.test_export import checkpoint_every_other

    traced = text_traces["gpt2"]
    schedule = checkpoint_every_other(traced.graph, 0)
    counts = Counter(v for kind, v in schedule.ops if kind == COMPUTE)
    assert [counts[v] for v in range(traced.graph.n) if traced.graph.ops[v] == EFFICIENT_ATTENTION] == [2]
    out = export_traced(traced, step_signature("hf:gpt2", TEXT), schedule, tmp_path / "ck",
                        spec={"model": "hf:gpt2", "options": TEXT})
    assert "efficient_attention_forward(" in (out / "checkpointed.py").read_text().split("# ---- generated")[1]
    v = verify_export("hf:gpt2", TEXT, out, repeats=0)
    assert v.loss_diff == 0 and v.max_grad_diff <= 1e-6, v.to_dict()
    assert abs(v.measured_peak - v.predicted_peak) <= BYTES, v.to_dict()
    assert not v.problems()


@pytest.mark.parametrize("arch", sweep(["llama", "gpt2"]))
def test_bf16_parameters_are_what_a_bf16_step_holds(tmp_path, text_traces, arch):
    """``dtype=bf16``: parameters, gradients and activations in bf16 in the graph, as measured; the
    exported step's peak is the prediction to a few bytes, with the same loss and gradients to bf16's
    rounding."""
    options = dict(TEXT, dtype="bf16")
    traced = trace_model(f"hf:{arch}", **options)
    fp32 = text_traces[arch].graph
    params = [(n, b) for n, b, kind in traced.graph.fixed_tensors if kind in ("param", "grad")]
    assert sum(b for _, b in params) * 2 == sum(b for n, b, kind in fp32.fixed_tensors if kind in ("param", "grad"))
    model, inputs, loss_fn = models.build(f"hf:{arch}", **options)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    measured = measure_step(model, inputs, loss_fn, frozen=traced.frozen_params)
    assert measured.fixed == traced.graph.fixed_mem
    out = export_traced(traced, step_signature(f"hf:{arch}", options), none_schedule(traced.graph), tmp_path / "ck",
                        spec={"model": f"hf:{arch}", "options": options})
    v = verify_export(f"hf:{arch}", options, out, repeats=0)
    assert v.precision == "bf16" and v.loss_diff == 0 and not v.problems(), v.to_dict()
    assert abs(v.measured_peak - v.predicted_peak) <= BYTES, v.to_dict()


# -- the checkpoint back-end ----------------------------------------------------------------------

def _module_plan(model: str, options: dict, autocast: str | None = None):
    from bonsai_core.solvers import solve

    graph = trace_model(model, autocast=autocast, **options).graph
    lb = graph.peak_lower_bound
    return solve(graph, int(lb + 0.5 * (no_remat_peak(graph) - lb)), "bonsai", regions="modules")


def test_checkpoint_backend_does_not_judge_a_cpu_peak_of_attention_dropout(tmp_path):
    """The checkpoint back-end runs the user's own module, whose SDPA with dropout takes the math path
    on the CPU: its peak is not the plan's, and verify says why instead of judging it."""
    from bonsai_core.export.checkpoint import export_checkpoint
    from bonsai_core.export.verify import CPU_ATTENTION_DROPOUT, verify_checkpoint

    options = dict(TEXT, layers=2)
    out = export_checkpoint("hf:gpt2", options, _module_plan("hf:gpt2", options), tmp_path / "ck")
    v = verify_checkpoint("hf:gpt2", options, out, repeats=1)
    assert v.predicted_peak is None and v.unpredicted == CPU_ATTENTION_DROPOUT, v.to_dict()
    assert v.loss_diff == 0 and v.max_grad_diff == 0 and not v.problems(), v.to_dict()


def test_checkpoint_backend_exports_a_schedule_traced_under_autocast(tmp_path):
    """A schedule traced under autocast is exported with it (not refused as another graph's) and trains
    the same under autocast; its peak is not judged, and verify says why."""
    from bonsai_core.export.checkpoint import export_checkpoint
    from bonsai_core.export.verify import CHECKPOINT_AUTOCAST, load_checkpointed, verify_checkpoint

    options = dict(TEXT, layers=2)
    schedule = _module_plan("hf:llama", options, autocast="bf16")
    with pytest.raises(Exception, match="autocast bf16"):  # the schedule's graph is the autocast one
        export_checkpoint("hf:llama", options, schedule, tmp_path / "no")
    out = export_checkpoint("hf:llama", options, schedule, tmp_path / "ck", autocast="bf16")
    assert load_checkpointed(out).INFO["autocast"] == "bf16"
    v = verify_checkpoint("hf:llama", options, out, repeats=1)
    assert v.autocast == "bf16" and v.predicted_peak is None and v.unpredicted == CHECKPOINT_AUTOCAST, v.to_dict()
    assert v.loss_diff == 0 and not v.problems(), v.to_dict()


def test_low_precision_reference_runs_dropout_as_cuda_does():
    """verify's reference for bf16 parameters runs ``F.dropout`` as ``native_dropout``: the same mask and
    forward values as CPU eager's dropout, but a backward scaled by 1 / (1 - p) in float, where CPU eager
    multiplies by that factor rounded to bf16."""
    from bonsai_core.export.verify import NativeDropout

    x = torch.randn(4096, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(4096, dtype=torch.bfloat16)
    torch.manual_seed(0)
    eager = F.dropout(x, 0.1)
    eager.backward(grad)
    eager_grad, x.grad = x.grad, None
    torch.manual_seed(0)
    with NativeDropout():
        native = F.dropout(x, 0.1)
    native.backward(grad)
    assert torch.equal(native, eager)
    keep = eager != 0
    assert torch.equal(x.grad, torch.ops.aten.native_dropout_backward(grad, keep, 1 / 0.9))
    assert not torch.equal(x.grad, eager_grad)
