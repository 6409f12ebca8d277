"""The Model page's Hugging Face tab, driven headless with Streamlit's AppTest."""

from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

from tests.test_app import app as explorer_app

pytest.importorskip("transformers")

TINY_GPT2 = dict(batch=2, seq=16, width=32, layers=1, heads=2, vocab=64)


def app() -> AppTest:
    return explorer_app(timeout=120)  # building a transformers model takes longer than the zoo's


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


@pytest.mark.slow  # ~10 s of CPU (importing transformers, a first trace) on this machine
def test_tracing_hf_gpt2_at_a_tiny_size_replaces_the_model():
    at = app()
    at.selectbox(key="hf_arch").set_value("gpt2").run()
    for k, v in TINY_GPT2.items():
        at.number_input(key=f"hf_gpt2_{k}").set_value(v)
    at.button(key="hf_trace").click().run()
    assert not at.exception and not at.error
    model = at.session_state["model"]
    assert model.zoo == "hf:gpt2" and model.options == TINY_GPT2  # what the export page rebuilds
    assert model.graph.name.startswith("hf:gpt2(batch=2")
    assert metric(at, "operators") == str(model.graph.n)
    assert int(metric(at, "parameters").replace(",", "")) == model.parameters > 0


def _gpt2_config_bytes(tmp_path) -> bytes:
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    return (tmp_path / "config.json").read_bytes()


@pytest.mark.slow
def test_an_uploaded_config_json_is_traced_with_its_size_options(tmp_path):
    at = app()
    at.file_uploader(key="hf_config").upload("config.json", _gpt2_config_bytes(tmp_path), "application/json").run()
    assert not at.exception and not at.error
    assert any("GPT2LMHeadModel" in c.value for c in at.caption)
    at.number_input(key="hf_config_batch").set_value(2)
    at.number_input(key="hf_config_seq").set_value(8)
    at.button(key="hf_config_trace").click().run()
    assert not at.exception and not at.error
    model = at.session_state["model"]
    assert model.source == "hf-config" and model.zoo.startswith("hf:") and model.link.startswith("hf-config:")
    assert "GPT2LMHeadModel" in model.label and "batch=2" in model.label and model.parameters > 0
    # a model like any other: its link traces it again in a new session, What fits searches its sizes,
    # Export builds it (before: the link dropped it, What fits refused it, Export offered JSON only)
    assert at.query_params["model"] == model.link and at.query_params["size"] == "batch:2,seq:8"
    fresh = AppTest.from_file("../explorer/app.py", default_timeout=120)
    fresh.query_params.update(dict(at.query_params))
    fresh.run()
    assert not fresh.exception and not fresh.sidebar.warning
    assert fresh.session_state["model"].graph.hash == model.graph.hash
    at.switch_page("../pages/fit.py").run()
    assert not at.exception and not at.info and at.selectbox(key="fit_vary").options == ["batch", "seq"]
    at.multiselect(key="fit_methods").set_value(["none", "chen"]).run()
    at.button(key="fit_run").click().run()  # searched from the session's own step, batch 2
    assert not at.exception and not at.error, (at.exception, at.error)
    assert list(at.dataframe[0].value["method"]) == ["none", "chen"]
    assert at.session_state["fit_result"][1].reused == [2]
    at.sidebar.slider(key="budget_pct").set_value(90).run()
    at.switch_page("../pages/export.py").run()
    assert not at.exception and any(b.key == "export_build" for b in at.button)
    assert "bonsai trace hf:config.json --batch 2 --seq 8" in at.code[-1].value
    at.button(key="export_build").click().run()
    assert not at.exception and not at.error, (at.exception, at.error)
    assert at.session_state["export_zip"][2][:2] == b"PK"  # the zip, offered as for any zoo model


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"]}).encode(), "not supported"),
    (b" " * (300 * 1024), "at most 256 KiB"),
])
def test_a_bad_config_upload_is_an_error_not_a_traceback(content, message):
    at = app()
    at.file_uploader(key="hf_config").upload("config.json", content, "application/json").run()
    assert not at.exception
    assert any(message in e.value for e in at.error)
    assert not at.get("button") or all(b.key != "hf_config_trace" for b in at.button)
