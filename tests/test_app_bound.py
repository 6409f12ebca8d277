"""In AppTest: a plan solved for the allocator's reserved bytes shows its bound on
the memory charts, and torchtitan's Llama 3 is chosen on the Model page."""

from __future__ import annotations

import pytest

from tests.test_app import app, goto, memory_chart

# On the default GPT the caching allocator reserves 36.17 MiB for no remat (its live peak: 31.24 MiB),
# above the slider's range: an exact budget between them is one a reserved plan meets with recomputation.
RESERVED_BUDGET = "34MiB"


def bounded(policy: str = "caching"):
    at = app(timeout=120)
    at.sidebar.selectbox(key="method").set_value("chen").run()
    at.sidebar.text_input(key="budget_text").input(RESERVED_BUDGET).run()
    at.sidebar.selectbox(key="budget_bound").set_value(policy).run()
    assert not at.exception
    return at


def levels_text(at) -> str:
    levels = memory_chart(at)[1]["levels"]
    return levels.loc[levels.kind == "budget", "text"].iloc[0]


def test_a_plan_solved_for_reserved_bytes_draws_its_bound_and_the_reserved_bytes_under_it():
    at = goto(bounded(), "memory")
    assert not at.error, [e.value for e in at.error]
    assert levels_text(at) == "reserved-bytes bound 34.00 MiB"
    data = memory_chart(at)[1]
    assert {"chen", "no remat"} <= set(data["reserved"].schedule)  # drawn without the toggle: they are bounded
    chen = data["reserved"][data["reserved"].schedule == "chen"]
    assert chen.mib.max() <= 34.0 + 1e-6  # the plan's reserved bytes under its bound
    assert data["lines"][data["lines"].schedule == "chen"].mib.max() < chen.mib.max()  # live below reserved
    assert any("**reserved-bytes bound**" in c.value and "live budget of" in c.value for c in at.caption)
    assert "live budget met" in at.table[0].value.columns
    assert at.query_params["bound"] == "caching"  # in the link


def test_the_solve_page_names_the_bound_and_a_live_plan_keeps_the_plain_budget():
    at = goto(bounded(), "solve")
    assert levels_text(at) == "reserved-bytes bound 34.00 MiB"
    assert any(c.value.startswith("Solved for reserved bytes") for c in at.caption)
    at.sidebar.selectbox(key="budget_bound").set_value("live").run()
    assert levels_text(at) == "budget 34.00 MiB"
    assert not any(c.value.startswith("Solved for reserved bytes") for c in at.caption)
    goto(at, "memory")
    assert memory_chart(at)[1]["reserved"].empty  # off by default again for live plans


def test_a_reserved_bound_out_of_reach_is_an_error_not_a_traceback():
    at = app(timeout=120)
    at.sidebar.selectbox(key="method").set_value("chen").run()
    at.sidebar.selectbox(key="budget_bound").set_value("caching").run()  # 70%: below what the allocator reserves
    goto(at, "memory")
    assert not at.exception
    assert any("reserves at most" in e.value for e in at.error)
    assert levels_text(at).startswith("reserved-bytes bound")


def test_what_fits_budgets_reserved_bytes_by_default_under_a_reserved_bound():
    at = goto(bounded("expandable"), "fit")
    assert at.toggle(key="fit_reserved").value
    assert "expandable segments" in at.toggle(key="fit_reserved").help


def test_a_link_restores_the_reserved_bound():
    at = app()
    at.query_params["bound"] = "expandable"
    at.session_state["view_restored"] = False
    at.run()
    assert at.sidebar.selectbox(key="budget_bound").value == "expandable"


def titan_tab(seq: int):
    """The Model page's torchtitan tab (what opening it sets: it runs only while open), debugmodel with one
    block at ``seq``."""
    pytest.importorskip("torchtitan")
    at = app(timeout=180)
    at.session_state["model_tab"] = "torchtitan"
    at.run()
    assert not at.exception
    at.number_input(key="titan_debugmodel_layers").set_value(1).run()
    at.number_input(key="titan_debugmodel_seq").set_value(seq).run()
    return at


def test_torchtitan_llama_is_traced_from_the_model_page():
    at = titan_tab(64)
    assert at.selectbox(key="titan_flavour").value == "debugmodel"
    assert any("Slow to trace" in c.value for c in at.caption)
    at.button(key="titan_trace").click().run()
    assert not at.exception, at.exception
    model = at.session_state["model"]
    assert model.zoo == "torchtitan:llama3:debugmodel" and model.options == {"layers": 1, "seq": 64}
    assert "layers.0.attention" in {path for path, _, _ in model.graph.modules}  # torchtitan's module paths
    assert at.query_params["model"] == "torchtitan:llama3:debugmodel"  # a link that traces it again
    # one block, its gradients set to None as torchtitan's loop leaves them: its lower bound is its whole peak
    at.sidebar.slider(key="budget_pct").set_value(100).run()
    goto(at, "graph")
    assert not at.error, [e.value for e in at.error]
    assert any(c.value.startswith("One box per module call") for c in at.caption)
    goto(at, "fit")  # What fits traces it again at other sizes
    assert at.selectbox(key="fit_vary").options == ["batch", "seq"]


def test_torchtitan_llama_is_traced_per_fsdp_rank_as_torchtitan_shards_it():
    """FSDP ranks on the torchtitan tab: the step one of N ranks holds, sharded in torchtitan 0.2.2's units
    (bf16 mixed precision), its rank breakdown on the Fit page, and a link that traces it again so."""
    at = titan_tab(256)
    at.number_input(key="titan_fsdp").set_value(4).run()
    at.button(key="titan_trace").click().run()
    assert not at.exception, at.exception
    model = at.session_state["model"]
    assert model.options == {"fsdp": 4, "layers": 1, "seq": 256}
    fsdp = model.graph.fsdp
    assert fsdp["world"] == 4 and fsdp["param_dtype"] == "bf16"
    assert [u[0] for u in fsdp["units"]] == ["tok_embeddings", "layers.0", "norm,output"]
    assert at.query_params["size"] == "fsdp:4,layers:1,seq:256"
    at.sidebar.slider(key="budget_pct").set_value(95).run()  # on a rank this small the unsharded units set the peak
    goto(at, "fit")
    assert not at.exception, at.exception
    assert any("One rank's memory of 4" in h.value for h in at.subheader)
    at.multiselect(key="fit_methods").set_value(["none", "chen"]).run()
    at.button(key="fit_run").click().run()  # from the session's own step (its gradients set to None), batch 1
    assert not at.exception and not at.error, (at.exception, at.error)
    result = at.session_state["fit_result"][1]
    assert result.reused == [1] and list(at.dataframe[0].value["method"]) == ["none", "chen"]
    goto(at, "export")  # the plan is applied per rank by the one call, not exported as one process's step
    assert not at.exception, at.exception
    assert any("one of 4 FSDP ranks" in i.value and "plan_for(" in i.value for i in at.info)
    assert not [b for b in at.button if b.key == "export_build"]


def test_torchtitan_llama_is_traced_per_pipeline_rank_with_its_layout():
    """TP, CP, PP degrees on the torchtitan tab: one pipeline rank of the layout, its breakdown (with the
    microbatches in flight) on the Fit page, and a link that traces it again so."""
    at = titan_tab(64)
    at.number_input(key="titan_debugmodel_layers").set_value(4).run()
    at.number_input(key="titan_debugmodel_batch").set_value(2).run()
    at.number_input(key="titan_pp").set_value(2).run()
    at.number_input(key="titan_tp").set_value(2).run()
    at.number_input(key="titan_rank").set_value(1).run()
    at.button(key="titan_trace").click().run()
    assert not at.exception, at.exception
    model = at.session_state["model"]
    assert model.graph.parallel["layout"]["tp"] == 2 and model.graph.parallel["pipeline"]["rank"] == 1
    assert at.query_params["size"] == "batch:2,layers:4,pp:2,pp_schedule:1f1b,rank:1,seq:64,tp:2"
    at.sidebar.slider(key="budget_pct").set_value(100).run()
    goto(at, "fit")
    assert not at.exception, at.exception
    assert any("TP 2 x PP 2" in h.value for h in at.subheader)
    assert any("Pipeline rank 1 of 2" in c.value for c in at.caption)
