"""The Memory page's tensor lifetimes, step scrubber and reasons, and the first visit's tour, driven
headless with Streamlit's AppTest on the default GPT and on hf:gpt2."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from explorer import compute
from tests.test_app import APP, app, goto


def charts(at: AppTest) -> dict[str, tuple[dict, dict]]:
    """The page's Vega-Lite charts by their first dataset's name ("lines": memory, "bars": lifetimes)."""
    out = {}
    for chart in at.get("vega_lite_chart"):
        data = {d.name: pa.ipc.open_stream(d.data.data).read_pandas() for d in chart.proto.datasets}
        out["memory" if "lines" in data else "timeline"] = (json.loads(chart.proto.spec), data)
    return out


def step_line(at: AppTest) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("step "))


def check_scrubber(at: AppTest) -> None:
    shown = charts(at)
    assert set(shown) == {"memory", "timeline"}
    outcome = at.session_state["cursor_of"]
    peak_step = at.slider(key="memory_step").value
    cursor = shown["memory"][1]["cursor"]["x"].iloc[0]
    assert shown["timeline"][1]["cursor"]["x"].iloc[0] == cursor
    assert step_line(at).startswith(f"step {peak_step}: ")
    at.slider(key="memory_step").set_value(3).run()
    assert not at.exception
    moved = charts(at)
    assert moved["memory"][1]["cursor"]["x"].iloc[0] < cursor  # the cursor went back to step 3
    assert moved["timeline"][1]["cursor"]["x"].iloc[0] == moved["memory"][1]["cursor"]["x"].iloc[0]
    assert step_line(at).startswith("step 3: ")
    bars = moved["timeline"][1]["bars"]
    assert len(bars) > 1 and outcome.ops  # the fixed band and the tensors


def test_the_memory_page_shows_lifetimes_and_the_scrubber_moves_the_cursor():
    at = goto(app(), "memory")
    check_scrubber(at)
    assert any("Tensor lifetimes of" in c.value for c in at.caption)


def test_the_lifetimes_rows_are_built_once_per_plan_and_a_step_moves_only_which_are_alive():
    at = goto(app(), "memory")
    g, s = at.session_state["model"].graph, at.session_state["settings"]
    plan = compute.solve(g, s.budget, s.method, s.options)
    assert plan.schedule is at.session_state["cursor_of"]  # the page's plan
    assert compute.lifetime_rows(g, plan, "time") is compute.lifetime_rows(g, plan, "time")
    before = charts(at)["timeline"][1]["bars"]
    at.slider(key="memory_step").set_value(3).run()
    after = charts(at)["timeline"][1]["bars"]
    assert not before.alive.equals(after.alive)
    assert before.drop(columns="alive").equals(after.drop(columns="alive"))


def test_the_why_panel_explains_each_recomputed_region():
    at = goto(app(), "memory")  # bonsai at 70% on the default GPT recomputes segments
    at.session_state["memory_why_open"] = True  # what opening the expander does
    at.run()
    assert not at.exception
    reasons = [m.value for m in at.markdown if m.value.startswith("- **segment ")]
    assert reasons and all("off the peak" in r for r in reasons)


def test_the_tour_shows_on_a_first_visit_and_closes_for_good():
    at = app()
    assert at.markdown[0].value.startswith("**Tour 1/3")
    at.button(key="tour_next").click().run()
    assert at.markdown[0].value.startswith("**Tour 2/3")
    at.button(key="tour_close").click().run()
    assert not any(m.value.startswith("**Tour") for m in at.markdown)
    goto(at, "memory")
    assert not any(m.value.startswith("**Tour") for m in at.markdown)


def test_a_link_opens_without_the_tour():
    at = AppTest.from_file("../" + APP, default_timeout=60)
    at.query_params["budget"] = "60"
    at.run()
    assert not at.exception
    assert not any(m.value.startswith("**Tour") for m in at.markdown)


def test_the_scrubber_on_hf_gpt2():
    pytest.importorskip("transformers")
    at = AppTest.from_file("../" + APP, default_timeout=120)
    at.session_state["model"] = compute.trace_model("hf:gpt2", ())
    at.run()
    assert not at.exception
    at.switch_page("../pages/memory.py").run()
    assert not at.exception and not at.error
    check_scrubber(at)
