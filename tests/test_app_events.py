"""In AppTest: the recompute events (listed on Graph and Memory, moving a shared step cursor,
marked on the memory curve, lighting the graph's boxes), labels on every graph view, one FSDP rank's
memory by part, Compare opening on a pair that fits, the tour advancing once its step is done."""

from __future__ import annotations

import numpy as np
import pytest

from bonsai_core.schedule import simulate
from bonsai_core.trace import trace_model
from explorer import compute, rank, timeline
from tests.test_app import app, goto, memory_chart, module_boxes_shown, plot_spec

FSDP_GPT = dict(batch=2, seq=16, width=32, layers=3, heads=2, vocab=64)


def at_budget(pct: int):
    at = app()
    at.sidebar.slider(key="budget_pct").set_value(pct).run()
    return at


def test_memory_page_lists_the_simulators_recompute_events_and_marks_them_on_the_curve():
    at = goto(at_budget(50), "memory")
    out = at.session_state["cursor_of"]
    g = at.session_state["model"].graph
    sim = simulate(g, out)
    assert len(sim.events) >= 3  # bonsai at 50% rebuilds several regions in the backward pass
    table = next(d for d in at.dataframe if "recompute" in d.value.columns)
    assert list(table.value["step"]) == [e.start for e in sim.events]
    assert table.value["when"].str.startswith("before ").all()
    marks = memory_chart(at)[1]["events"]
    # one mark per block's run of rebuilds, numbered as the events: ln_f, then blocks.1's three, blocks.0's two
    assert list(marks["mark"]) == ["↻1", "↻2–4", "↻5–6"] and len(sim.events) == 6
    assert list(marks["x"]) == sorted(marks["x"])
    # hovered, each names its rebuilds' patterns as the table numbers them
    assert marks["text"][0].startswith("pattern 1: At backward step")
    assert marks["text"][1].startswith("patterns 2, 3, 4: 3 rebuilds in blocks.1")


def test_an_event_moves_the_shared_cursor_and_lights_its_boxes_on_the_graph():
    at = goto(at_budget(50), "memory")
    schedule = at.session_state["cursor_of"]
    g = at.session_state["model"].graph
    second = simulate(g, schedule).events[1]
    at.session_state["cursor_step"] = second.end  # what a click on the event's row does (state.set_step)
    goto(at, "graph")
    boxes = module_boxes_shown(at)
    lit = set(boxes[boxes.lit].name)
    assert lit and any(m.value.startswith("**↻2**") for m in at.markdown)
    first = timeline.node_modules(g).path[second.nodes[0]]  # the module the rebuild starts in
    assert any(first.startswith(name) for name in lit), (first, lit)
    goto(at, "memory")
    assert at.slider(key="memory_step").value == second.end  # the same cursor on the Memory page


def test_every_graph_view_carries_labels():
    at = goto(at_budget(50), "graph")
    boxes = module_boxes_shown(at)
    assert boxes.label.str.len().gt(0).all()
    for view in ("every op", "collapsed"):
        at.segmented_control(key="graph_view").set_value(view).run()
        labels = [t for t in plot_spec(at)["data"] if t.get("name") == "labels"]
        assert labels and {"blocks.0", "blocks.1"} <= set(labels[0]["text"])
        assert labels[0]["textfont"]["size"] >= 12
    at.segmented_control(key="graph_view").set_value("modules").run()
    at.selectbox(key="graph_module").set_value("blocks.0.attn").run()
    labels = [t for t in plot_spec(at)["data"] if t.get("name") == "labels"]
    assert labels and "addmm" in labels[0]["text"]


@pytest.fixture(scope="module")
def fsdp_gpt():
    return trace_model("gpt", fsdp=4, **FSDP_GPT).graph


def test_one_fsdp_ranks_memory_by_part_on_memory_and_what_fits(fsdp_gpt):
    at = app()
    at.session_state["model"] = compute.Model(fsdp_gpt, "json", "gpt-fsdp4.json")
    at.run()
    at.sidebar.slider(key="budget_pct").set_value(85).run()  # FSDP's buffers leave bonsai no plan below 75% here
    goto(at, "memory")
    assert any(s.value.startswith("One rank's memory of 4") for s in at.subheader)
    chart = next(c for c in at.get("vega_lite_chart") if any(d.name == "parts" for d in c.proto.datasets))
    assert chart is not None
    out = state_outcome(at)
    parts = rank.breakdown(fsdp_gpt, out.schedule.ops, out.sim)
    assert (sum(parts.values()) == out.sim.timeline).all()  # the parts add up to the simulator's timeline
    assert parts["all-gathered blocks"].max() > 0 and parts[rank.ACTIVATIONS].max() > 0
    goto(at, "fit")
    assert any(s.value.startswith("One rank's memory of 4") for s in at.subheader)
    table = at.table[0].value
    assert rank.SHARDED in set(table["part"]) and "all-gathered blocks" in set(table["part"])


def drawn_tops(spec: dict) -> np.ndarray:
    """The top of the stacked chart at each of its points (MiB) as Vega-Lite draws the area layer of
    ``rank.chart``: stacked by Vega-Lite (its default for an area with a colour field), every row of
    one x value lands on the rows before it; not stacked, a band reaches its ``y`` field."""
    layer = spec["layer"][0]
    y = layer["encoding"]["y"]
    rows = spec["datasets"]["parts"]
    if y.get("stack", "zero") in (None, False):
        return rows[y["field"]].to_numpy()
    return rows.groupby("x")[y["field"]].sum().to_numpy()


@pytest.mark.parametrize("x_mode", ["time", "ops"])
def test_one_ranks_chart_is_as_high_as_the_simulators_timeline_on_both_axes(fsdp_gpt, x_mode):
    """On the compute-time axis the ops that take no time share an x: stacked by Vega-Lite, the chart
    stood several times above the rank's memory (800,000 MiB for about 105 GiB on torchtitan's 8B step)."""
    from bonsai_core import solvers
    from explorer import plots

    ref = compute.no_remat(fsdp_gpt).peak
    schedule = solvers.solve(fsdp_gpt, int(0.85 * ref), "bonsai")
    sim = simulate(fsdp_gpt, schedule)
    parts = rank.breakdown(fsdp_gpt, schedule.ops, sim)
    x = plots.curve("bonsai", sim.timeline, compute.op_costs(fsdp_gpt, schedule), sim.peak, sim.peak_op, "#000",
                    x_mode).x
    assert len(np.unique(x)) < len(x) or x_mode == "ops"  # frees share the time of the op before them
    spec = rank.chart(parts, x, "x")
    assert drawn_tops(spec).max() == pytest.approx(sim.timeline.max() / 2**20)
    assert drawn_tops(spec).min() >= 0


def test_a_ranks_band_is_sent_only_where_it_moves_and_draws_as_every_point_does(fsdp_gpt, monkeypatch):
    from bonsai_core import solvers
    from explorer import plots

    schedule = solvers.solve(fsdp_gpt, int(0.85 * compute.no_remat(fsdp_gpt).peak), "bonsai")
    parts = rank.breakdown(fsdp_gpt, schedule.ops, simulate(fsdp_gpt, schedule))
    x = np.arange(1, len(schedule.ops) + 1, dtype=float)
    sent = rank.frame(parts, x)
    monkeypatch.setattr(rank, "band_changes", lambda lo, hi: np.ones(len(lo), dtype=bool))
    every = rank.frame(parts, x)
    assert len(sent) < len(every)
    assert len(sent[sent.part == rank.SHARDED]) == 2  # a constant band: its first and last point
    for name in parts:  # each band, step after step, as its every point draws it
        mine, full = sent[sent.part == name], every[every.part == name]
        at = np.searchsorted(mine.i.to_numpy(), full.i.to_numpy(), side="right") - 1
        for edge in ("lo", "hi"):
            assert (mine[edge].to_numpy()[at] == full[edge].to_numpy()).all()
    assert sent.hi.max() == every.hi.max()
    spec = rank.chart(parts, x, "step")  # told finite (plots.FINITE_DATA), and it is
    assert spec["config"] == plots.FINITE_DATA and np.isfinite(spec["datasets"]["parts"][["x", "lo", "hi"]]).all().all()


def state_outcome(at):
    g = at.session_state["model"].graph
    s = at.session_state["settings"]
    return compute.solve(g, s.budget, s.method, s.options)


def test_compare_opens_on_a_pair_that_fits_at_50_percent():
    at = goto(at_budget(50), "compare")
    assert at.selectbox(key="side_b_method").value != "chen"  # chen cannot fit 50% of the default GPT
    assert not at.error


def test_the_tour_advances_when_its_step_is_done():
    at = app()
    assert at.markdown[0].value.startswith("**Tour 1/3")
    goto(at, "memory")
    assert at.markdown[0].value.startswith("**Tour 2/3")
    at.sidebar.slider(key="budget_pct").set_value(55).run()
    assert at.markdown[0].value.startswith("**Tour 3/3")


def test_a_free_of_a_view_says_it_frees_no_bytes():
    from bonsai_core.graph import load_graph
    from explorer.state import DEFAULT_GRAPH

    g = load_graph(DEFAULT_GRAPH)
    out = compute.solve(g, None, "none")
    ops = out.schedule.ops
    i = next(j for j, (k, v) in enumerate(ops) if k == "free" and g.alias_of[v] >= 0)
    assert "−0 B" not in timeline.step_line(g, ops, i) and "a view" in timeline.step_line(g, ops, i)
    assert np.all(out.sim.times_computed == 1)
