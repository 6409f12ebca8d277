"""Hugging Face models as a model source: ``hf:ARCH`` and ``hf:PATH/config.json`` (bonsai_core.models.hf)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from bonsai_core import models
from bonsai_core.bench.methods import ModelSpec
from bonsai_core.cli import main
from bonsai_core.errors import ModelError
from bonsai_core.models import hf

pytest.importorskip("transformers")

TEXT = dict(batch=2, seq=16, width=32, layers=1, heads=2, vocab=64)
TINY = {"gpt2": TEXT, "bert": TEXT, "llama": TEXT, "mistral": TEXT, "mixtral": TEXT,
        "vit": dict(batch=2, image=16, width=32, layers=1, heads=2), "resnet": dict(batch=2, image=16, width=8, layers=1)}


def _traced_arch(arch: str, options: dict[str, int]):
    from bonsai_core.trace import trace_model

    return trace_model(f"hf:{arch}", **options)


def _check_forward_labelled(arch: str) -> None:
    """Every Linear/Conv2d of the model runs in the forward phase: at least that many matmul or
    convolution nodes are labelled forward, and the loss (one cross-entropy) is forward too."""
    traced = _traced_arch(arch, TINY[arch])
    g = traced.graph
    model, _, _ = models.build(f"hf:{arch}", **TINY[arch])
    layers = sum(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in model.modules())
    heavy = ("aten.mm", "aten.addmm", "aten.bmm", "aten.convolution.")
    forward_heavy = sum(p == "forward" and o.startswith(heavy) for p, o in zip(g.phases, g.ops))
    assert forward_heavy >= layers, (forward_heavy, layers)
    loss_phases = [p for p, o in zip(g.phases, g.ops) if o.startswith("aten.nll_loss_forward")]
    assert loss_phases == ["forward"], loss_phases


def test_hf_gpt2_traces_with_forward_ops_labelled_forward():
    _check_forward_labelled("gpt2")


@pytest.mark.slow
@pytest.mark.parametrize("arch", [
"llama", "mistral", "mixtral", "vit", "bert", "resnet"])
def test_each_hf_arch_traces_with_forward_ops_labelled_forward(arch):
    _check_forward_labelled(arch)


@pytest.mark.parametrize("arch, options", [
    ("llama", dict(batch=2, seq=64, width=32, layers=1, heads=2, vocab=64)),
    ("vit", dict(batch=2, image=16, width=32, layers=1, heads=2))])
def test_hf_arch_without_dropout_predicts_the_eager_peak(arch, options):
    """Llama's attention dropout and ViT's dropouts are nn.Dropout(0.0): eager returns the input
    itself, so the prediction must not count a copy (sizes where the attention probabilities, which
    such a copy would double, are a large part of the peak)."""
    from bonsai_core.measure import measure_step
    from bonsai_core.schedule import no_remat_peak

    traced = _traced_arch(arch, options)
    model, inputs, loss_fn = models.build(f"hf:{arch}", **options)
    measured = measure_step(model, inputs, loss_fn, frozen=traced.frozen_params)
    assert traced.graph.fixed_mem == measured.fixed
    assert no_remat_peak(traced.graph) == pytest.approx(measured.peak, rel=0.05)


def test_every_built_in_arch_has_a_tiny_size_here():
    assert set(TINY) == set(hf.ARCHS)


# -- the adapter is faithful: the loss is the model's own training loss, on the labels we mean --------

def _eval_loss_and_logits(arch: str, seed: int = 0):
    model, inputs, loss_fn = models.build(f"hf:{arch}", seed=seed, **TINY[arch])
    model.eval()  # dropout off, so the loss can be recomputed from the logits
    with torch.no_grad():
        loss = loss_fn(model(*inputs))
        logits = model.model(**dict(zip(model.input_names, inputs))).logits
    return model, inputs, loss, logits


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral", "mixtral"])
def test_causal_lm_loss_is_next_token_cross_entropy(arch):
    model, (ids,), loss, logits = _eval_loss_and_logits(arch)
    assert torch.equal(model.labels, ids)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_bert_masks_15_percent_of_each_row_from_the_seed_and_scores_only_those():
    model, (ids,), loss, logits = _eval_loss_and_logits("bert")
    labels = model.labels
    masked = labels != -100
    seq, vocab = TINY["bert"]["seq"], TINY["bert"]["vocab"]
    assert (masked.sum(dim=1) == max(1, round(0.15 * seq))).all()
    assert (ids[masked] == vocab - 1).all() and (ids[~masked] < vocab - 1).all()
    torch.testing.assert_close(loss, F.cross_entropy(logits[masked], labels[masked]), rtol=1e-5, atol=1e-6)
    again, (ids2,), _, _ = _eval_loss_and_logits("bert")
    other, _, _, _ = _eval_loss_and_logits("bert", seed=1)
    assert torch.equal(again.labels, labels) and torch.equal(ids2, ids)
    assert not torch.equal(other.labels, labels)


@pytest.mark.parametrize("arch", ["vit", "resnet"])
def test_image_classification_loss_is_cross_entropy_on_the_labels(arch):
    model, (pixels,), loss, logits = _eval_loss_and_logits(arch)
    assert pixels.shape == (2, 3, 16, 16) and logits.shape == (2, hf.CLASSES)
    torch.testing.assert_close(loss, F.cross_entropy(logits, model.labels), rtol=1e-5, atol=1e-6)


def test_train_mode_with_config_dropout_and_the_hf_model_under_model():
    model, inputs, loss_fn = models.build("hf:gpt2", **TINY["gpt2"])
    assert model.training and model.model.training
    assert model.model.config.resid_pdrop == 0.1 and model.model.config.attn_pdrop == 0.1
    assert model.model.config._attn_implementation == "sdpa"  # what transformers trains with by default
    assert "model.transformer.h.0.attn.c_attn.weight" in dict(model.named_parameters())
    torch.manual_seed(3)
    a = loss_fn(model(*inputs))
    torch.manual_seed(3)
    b = model.model(input_ids=inputs[0], labels=model.labels).loss
    assert torch.equal(a, b)  # the wrapper adds nothing to the model's own loss
    torch.manual_seed(4)
    assert not torch.equal(loss_fn(model(*inputs)), a)  # dropout is on


@pytest.mark.parametrize("arch", list(TINY))
def test_fake_and_real_builds_have_the_same_parameters_and_ties(arch):
    """trace builds on fake tensors without initialising weights; export/verify build for real:
    both must be the same module (names, shapes, which parameters are shared)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def layout(model):
        return ([(n, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)],
                [(n, tuple(b.shape)) for n, b in model.named_buffers(remove_duplicate=False)],
                len(list(model.parameters())))

    real = layout(models.build(f"hf:{arch}", **TINY[arch])[0])
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = layout(models.build(f"hf:{arch}", **TINY[arch])[0])
    assert fake == real


# -- hf:PATH/config.json -------------------------------------------------------------------------

def _save_gpt2_config(folder, **fields):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=64, **fields)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(folder)
    return folder / "config.json"


def test_config_json_builds_its_model_with_batch_and_seq(tmp_path):
    path = _save_gpt2_config(tmp_path)
    for spec in (f"hf:{path}", f"hf:{tmp_path}"):
        model, (ids,), loss_fn = models.build(spec, batch=3, seq=8)
        assert type(model.model).__name__ == "GPT2LMHeadModel" and ids.shape == (3, 8)
        assert model.model.config.n_layer == 1 and ids.max() < 64
        assert loss_fn(model(ids)).ndim == 0
    _, (ids,), _ = models.build(f"hf:{path}")
    assert ids.shape == (8, 32)  # defaults: batch 8, seq min(128, n_positions)


def test_config_json_without_architectures_uses_the_model_type(tmp_path):
    from transformers import BertConfig

    BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
               vocab_size=64, max_position_embeddings=16).save_pretrained(tmp_path)
    model, (ids,), _ = models.build(f"hf:{tmp_path}", batch=2)
    assert type(model.model).__name__ == "BertForMaskedLM" and ids.shape == (2, 16)


@pytest.mark.slow
def test_config_json_traces(tmp_path):
    from bonsai_core.trace import trace_model

    traced = trace_model(f"hf:{_save_gpt2_config(tmp_path)}", batch=2, seq=8)
    assert traced.graph.summary()["forward_nodes"] > 20


def test_config_parsed_from_bytes_as_the_explorer_uploads_it(tmp_path):
    data = _save_gpt2_config(tmp_path).read_bytes()
    model, (ids,), _ = hf.build_from_config(hf.parse_config(data, "upload.json"), source="upload.json", batch=2, seq=4)
    assert ids.shape == (2, 4)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "needs a \"model_type\""),
    ('{"model_type": "no-such-model"}', "transformers cannot make a config"),
    ('{"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"]}', "is not supported"),
    ('{"model_type": "gpt2", "auto_map": {"AutoModelForCausalLM": "evil.Model"}, "architectures": ["Evil"]}',
     "is not supported"),
    ('{"model_type": "gpt2", "n_layer": "two", "architectures": ["GPT2LMHeadModel"]}',
     "cannot make a config|building GPT2LMHeadModel from it failed"),
])
def test_bad_config_files_are_clear_model_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ModelError, match=message):
        models.build(f"hf:{path}")


def test_config_json_refuses_shape_options_and_too_long_sequences(tmp_path):
    path = _save_gpt2_config(tmp_path)
    with pytest.raises(ModelError, match="fixes the model's shape.*layers"):
        models.build(f"hf:{path}", layers=4)
    with pytest.raises(ModelError, match="longer than the 32 positions"):
        models.build(f"hf:{path}", seq=64)


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, options, message", [
    ("hf:gpt3", {}, "Unknown Hugging Face architecture 'gpt3'.*hf:gpt2"),
    ("hf:missing/config.json", {}, "Cannot read the model config"),
    ("hf:vit", {"seq": 8}, "hf:vit has no option 'seq'"),
    ("hf:gpt2", {"width": 30, "heads": 4}, "width=30 must be a positive multiple of 4"),
    ("hf:vit", {"image": 20}, "image=20 must be a positive multiple of 8"),
    ("hf:gpt2", {"layers": 0}, "must be a positive whole number"),
])
def test_bad_hf_specs_are_clear_model_errors(spec, options, message):
    with pytest.raises(ModelError, match=message):
        models.build(spec, **options)


def test_missing_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    with pytest.raises(ModelError, match="pip install transformers==5.23.0"):
        models.build("hf:gpt2")


def test_cli_reports_hf_errors_without_a_traceback(capsys, tmp_path):
    assert main(["trace", "hf:gpt3", "-o", str(tmp_path / "g.json")]) == 1
    err = capsys.readouterr().err
    assert "Unknown Hugging Face architecture" in err and "Traceback" not in err


def test_bonsai_zoo_lists_hf_architectures_with_options(capsys):
    assert main(["zoo", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    for arch, entry in hf.ARCHS.items():
        assert listed[f"hf:{arch}"]["options"] == entry.options
    assert listed["hf:vit"]["options"] == {"batch": 8, "image": 32, "width": 128, "layers": 2, "heads": 4}
    assert main(["zoo"]) == 0
    assert "hf:PATH" in capsys.readouterr().out


def test_bench_reads_hf_model_specs():
    assert ModelSpec.parse("hf:gpt2") == ModelSpec("hf:gpt2")
    assert ModelSpec.parse("hf:gpt2:layers=2,seq=64") == ModelSpec("hf:gpt2", (("layers", 2), ("seq", 64)))
    assert ModelSpec.parse("gpt:layers=2") == ModelSpec("gpt", (("layers", 2),))
    assert ModelSpec.parse("tests.user_model:make") == ModelSpec("tests.user_model:make")


def _save(config, folder, architecture: str | None = None):
    config.architectures = [architecture] if architecture else None
    config.save_pretrained(folder)
    return f"hf:{folder}"


def _predicts_the_eager_peak(spec: str, **options) -> None:
    from bonsai_core.measure import measure_step
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.trace import trace_model

    traced = trace_model(spec, **options)
    model, inputs, loss_fn = models.build(spec, **options)
    measured = measure_step(model, inputs, loss_fn, frozen=traced.frozen_params)
    # T5's trace holds one 8-byte scalar constant as fixed memory that its eager step makes per call
    assert traced.graph.fixed_mem == pytest.approx(measured.fixed, abs=8)
    assert no_remat_peak(traced.graph) == pytest.approx(measured.peak, rel=0.05)  # the trace's no-remat peak within 5% of eager's


def test_a_model_whose_constructor_reads_tensor_values_builds_on_real_uninitialised_tensors(tmp_path):
    """ConvNeXt computes its drop-path rates with ``torch.linspace(...).tolist()`` in ``__init__``,
    which fake tensors cannot answer: it is built on real, uninitialised tensors and traced."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from transformers import ConvNextConfig

    spec = _save(ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10), tmp_path,
                 "ConvNextForImageClassification")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, (pixels,), _ = models.build(spec, batch=2, image=32)
        assert isinstance(pixels, FakeTensor) and not isinstance(next(model.parameters()), FakeTensor)
    _predicts_the_eager_peak(spec, batch=2, image=32)


def test_roberta_positions_start_after_the_padding_id(tmp_path):
    """RoBERTa numbers positions from pad_token_id + 1: a table of 34 holds 32 tokens."""
    from transformers import RobertaConfig

    spec = _save(RobertaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               vocab_size=64, max_position_embeddings=34, pad_token_id=1), tmp_path)
    assert hf.read_config(hf.load_config_file(tmp_path / "config.json")).options["seq"] == 32
    with pytest.raises(ModelError, match="seq=33 is longer than the 32 positions"):
        models.build(spec, batch=2, seq=33)
    model, inputs, loss_fn = models.build(spec, batch=2, seq=32)
    assert torch.isfinite(loss_fn(model(*inputs)))  # every position inside the table


def test_a_model_type_with_several_classes_uses_the_first(tmp_path):
    """DeiT's image-classification entry is (plain head, head with distillation teacher)."""
    from transformers import DeiTConfig

    spec = _save(DeiTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64, num_labels=10), tmp_path)
    model, _, _ = models.build(spec, batch=2)
    assert type(model.model).__name__ == "DeiTForImageClassification"


def test_seq2seq_lm_trains_on_its_own_loss_with_the_input_as_labels(tmp_path):
    """T5 without "architectures": its seq2seq LM class, labels = input ids (shifted right into the
    decoder by the model), the model's own cross entropy; the trace predicts the eager peak."""
    from transformers import T5Config

    spec = _save(T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2, vocab_size=64,
                          decoder_start_token_id=0, dropout_rate=0.0), tmp_path)
    model, (ids,), loss_fn = models.build(spec, batch=2, seq=8)
    assert type(model.model).__name__ == "T5ForConditionalGeneration"
    with torch.no_grad():
        logits = model.model(input_ids=ids, labels=ids).logits
        assert loss_fn(model(ids)) == pytest.approx(float(F.cross_entropy(logits.flatten(0, 1), ids.flatten())))
    _predicts_the_eager_peak(spec, batch=2, seq=8)


def test_mixture_of_experts_traces_its_float32_grouped_matmuls_as_eager_runs_them(tmp_path):
    """Mixtral's experts run as ``aten._grouped_mm`` (transformers 5's default experts implementation),
    whose kernels take float32 but whose shape function in torch refuses all but bfloat16: the trace
    failed with a screen of fake-tensor log. It traces, holds the grouped matmuls eager runs (2 forward,
    2 x 2 backward) and predicts the eager peak; where eager fails too (rows of 30 floats, not
    16-byte multiples), the trace fails in one line naming the op, and nothing is logged."""
    import logging

    from transformers import MixtralConfig

    from bonsai_core.measure import measure_step
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.trace import trace_model

    sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 num_local_experts=4, num_experts_per_tok=2, vocab_size=64, max_position_embeddings=16)
    spec = _save(MixtralConfig(intermediate_size=64, **sizes), tmp_path / "aligned")
    traced = trace_model(spec, batch=2, seq=16)
    assert traced.graph.ops.count("aten._grouped_mm.default") == 6
    model, inputs, loss_fn = models.build(spec, batch=2, seq=16)
    measured = measure_step(model, inputs, loss_fn, frozen=traced.frozen_params)
    assert traced.graph.fixed_mem == measured.fixed
    assert no_remat_peak(traced.graph) == pytest.approx(measured.peak, rel=0.05)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.addHandler(handler)
    try:
        with pytest.raises(ModelError, match=r"aten\._grouped_mm\.default.*not multiples of 16 bytes") as e:
            trace_model(_save(MixtralConfig(intermediate_size=30, **sizes), tmp_path / "unaligned"), batch=2, seq=16)
    finally:
        log.removeHandler(handler)
    assert "\n" not in str(e.value) and not records
