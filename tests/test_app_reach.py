"""The Solve page on a graph where bonsai's checkpoint regions reach almost nothing (a small U-Net,
bonsai asked for checkpoint regions only: its default's op-level plan meets these budgets): it says how
low bonsai reaches, what moccasin does at the budget, and switches to it in one click."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

APP = "explorer/app.py"
UNET = {"model": "unet", "size": "batch:1,image:4,layers:1,width:16", "method": "bonsai", "budget": "96",
        "o.space": "regions"}


def test_bonsai_missing_a_budget_moccasin_meets_offers_moccasin_in_one_click():
    at = AppTest.from_file("../" + APP, default_timeout=120)
    at.query_params.update(UNET)
    at.run()
    at.switch_page("../pages/solve.py").run()
    assert not at.exception, at.exception
    assert at.session_state["model"].graph.name == "unet(batch=1, image=4, layers=1, width=16)"
    assert any("bonsai" in e.value and "smallest budget" in e.value for e in at.error)
    note = next(i.value for i in at.info if "checkpoint regions reach" in i.value)
    assert "99.3% of the no-remat peak" in note and "91.3%" in note  # bonsai's reach; the per-op bound
    assert "no checkpoint plan at all goes below 259.04 KiB (98.9%)" in note and "convolution_backward_4" in note
    assert "**moccasin**" in note and "meets this budget" in note and "+2.71%" in note
    at.button(key="switch_method").click().run()
    assert not at.exception, at.exception
    assert at.session_state["method"] == "moccasin"
    assert at.sidebar.selectbox(key="method").value == "moccasin"
    assert not at.error
    assert not any("checkpoint regions reach" in i.value for i in at.info)
    assert next(m.value for m in at.metric if m.label == "compute overhead") == "2.71%"


def test_no_offer_where_bonsai_meets_the_budget():
    at = AppTest.from_file("../" + APP, default_timeout=120)
    at.query_params.update({**UNET, "budget": "100"})
    at.run()
    at.switch_page("../pages/solve.py").run()
    assert not at.exception and not at.error
    assert not any("checkpoint regions reach" in i.value for i in at.info)


PREVIEW_SECONDS = 1  # pages/solve.py's: how long the page waits for moccasin beside bonsai's error


def slow_moccasin(graph, budget, *, time_limit=None):
    """Stands in for moccasin: takes longer than the Solve page's preview, then gives the plain schedule."""
    import time

    from bonsai_core.schedule import none_schedule

    time.sleep(PREVIEW_SECONDS + 0.5)
    return none_schedule(graph)


def test_a_slow_op_level_solve_is_not_waited_for_and_the_switch_is_still_offered(monkeypatch):
    from bonsai_core import solvers

    monkeypatch.setitem(solvers.METHODS, "moccasin", ("tests.test_app_reach", "slow_moccasin", "slow stand-in"))
    at = AppTest.from_file("../" + APP, default_timeout=120)
    at.query_params.update({**UNET, "budget": "97"})
    at.run()
    at.switch_page("../pages/solve.py").run()
    assert not at.exception, at.exception
    note = next(i.value for i in at.info if "checkpoint regions reach" in i.value)
    assert f"did not finish within {PREVIEW_SECONDS} s" in note
    at.button(key="switch_method").click().run()
    assert at.session_state["method"] == "moccasin"
