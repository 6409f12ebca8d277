"""explorer/timeline.py: lifetimes against the simulator, module labels, the step line, the reasons."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bonsai_core import solvers
from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import no_remat_peak, none_schedule, recomputes, simulate
from bonsai_core.units import format_bytes
from explorer import plots, timeline
from explorer.state import DEFAULT_GRAPH
from tests.graphs import chain


@pytest.fixture(scope="module")
def gpt() -> Graph:
    return Graph.from_dict(json.loads(DEFAULT_GRAPH.read_text()))


@pytest.fixture(scope="module")
def plan(gpt):
    """Chen's plan on the default GPT at 60%: recomputed segments, and quick to solve."""
    budget = int(0.6 * no_remat_peak(gpt))
    return solvers.solve(gpt, budget, method="chen"), budget


def alive_bytes(b: timeline.Bars, n_ops: int) -> np.ndarray:
    return np.array([int(b.bytes[timeline.alive_at(b, i)].sum()) for i in range(n_ops)])


def test_the_bars_add_up_to_the_simulators_timeline(gpt, plan):
    schedule, _ = plan
    sim = simulate(gpt, schedule)
    b = timeline.bars(gpt, sim.residency)
    assert b.threshold == 0 and b.count.sum() == len(b.start)
    assert np.array_equal(alive_bytes(b, len(schedule.ops)) + gpt.fixed_mem, sim.timeline)
    assert b.recomputed.sum() == len({i for i in np.flatnonzero(recomputes(schedule.ops, sim.events))
                                      if gpt.mem[schedule.ops[i][1]] > 0})


def test_first_fit_offsets_never_overlap_while_alive(gpt, plan):
    schedule, _ = plan
    b = timeline.bars(gpt, simulate(gpt, schedule).residency)
    for i in range(0, len(schedule.ops), 7):
        idx = np.flatnonzero(timeline.alive_at(b, i))
        spans = sorted((int(b.offset[j]), int(b.offset[j] + b.bytes[j])) for j in idx)
        assert all(a[1] <= c[0] for a, c in zip(spans, spans[1:])), i


def test_small_tensors_are_grouped_per_module_past_the_bar_limit(gpt, plan):
    schedule, _ = plan
    sim = simulate(gpt, schedule)
    full = timeline.bars(gpt, sim.residency)
    small = timeline.bars(gpt, sim.residency, max_bars=40)
    assert small.threshold > 0 and len(small.start) < len(full.start)
    assert small.count.sum() == len(full.start)  # every tensor in exactly one bar
    grouped = small.count > 1
    assert grouped.any() and all(label.endswith("under " + timeline.format_bytes(small.threshold))
                                 for label in np.array(small.label)[grouped])
    # a group is as high as its members' most bytes alive at once: never more than the live total
    assert (alive_bytes(small, len(schedule.ops)) >= 0).all()
    assert int(small.bytes[grouped].max()) <= sim.peak - gpt.fixed_mem


def test_nodes_take_their_innermost_module_and_backward_ops_the_module_they_read(gpt):
    m = timeline.node_modules(gpt)
    qkv = next(v for v in range(gpt.n) if m.path[v] == "blocks.1.attn.qkv")
    assert m.group[qkv] == "blocks.1"
    gelu_back = [v for v in range(gpt.n) if "gelu_backward" in gpt.ops[v]]
    assert gelu_back and all(m.path[v].startswith("blocks.") for v in gelu_back)
    assert all(m.path[v] for v in range(gpt.n))


def test_a_graph_without_modules_labels_by_pass():
    g = chain(4)
    m = timeline.node_modules(g)
    assert set(m.path) <= {"forward", "backward"}


def test_the_step_line_says_compute_free_and_recompute_with_what_needs_it(gpt, plan):
    schedule, _ = plan
    ops = schedule.ops
    flags = recomputes(ops, simulate(gpt, schedule).events)
    first = timeline.step_line(gpt, ops, 0)
    v = ops[0][1]
    assert first == (f"step 0: compute {gpt.names[v]} (embedding, forward, tok): "
                     f"+{timeline.format_bytes(int(gpt.mem[v]))}")
    j = int(np.flatnonzero(flags)[0])
    line = timeline.step_line(gpt, ops, j)
    assert line.startswith(f"step {j}: recompute blocks.") and " back), needed by " in line
    # the rebuild ends at the first op that is neither a recompute nor a free: the op that needs it
    end = j
    while flags[end + 1] or ops[end + 1][0] == "free":
        end += 1
    needer = ops[end + 1][1]
    assert line.endswith(f"({gpt.names[needer]})")
    freed_then_back = next(i for i, (k, u) in enumerate(ops) if k == "free"
                           and any(k2 == "compute" and u2 == u for k2, u2 in ops[i + 1:]))
    assert ", recomputed at step " in timeline.step_line(gpt, ops, freed_then_back)


def test_reasons_match_the_plan_simulated_without_each_region(gpt, plan):
    schedule, budget = plan
    base = simulate(gpt, schedule)
    extra = CheckpointPlan.from_extra(schedule.extra)
    reasons = timeline.reasons(gpt, schedule, budget)
    assert [r.segment for r in reasons] == sorted(extra.recomputed)
    r = reasons[0]
    without = CheckpointPlan(extra.segments, extra.recomputed - {r.segment}, frozenset(), extra.saved)
    sim = simulate(gpt, plan_schedule(gpt, without, "chen"))
    assert r.frees_at_peak == sim.peak - base.peak
    assert r.cost == pytest.approx(base.compute_cost - sim.compute_cost)
    assert r.alternative is not None and r.alternative not in extra.recomputed
    line = timeline.reason_line(r, budget)
    assert line.startswith(f"**segment {r.segment}**") and "off the peak" in line


def test_no_remat_has_nothing_to_explain_but_its_bars_still_add_up(gpt):
    schedule = none_schedule(gpt)
    sim = simulate(gpt, schedule)
    b = timeline.bars(gpt, sim.residency)
    assert not b.recomputed.any()
    assert np.array_equal(alive_bytes(b, len(schedule.ops)) + gpt.fixed_mem, sim.timeline)


def test_the_chart_shares_the_memory_curves_x_axis_and_moves_only_data(gpt, plan):
    schedule, _ = plan
    sim = simulate(gpt, schedule)
    c = plots.curve("chen", sim.timeline, np.ones(len(schedule.ops)), sim.peak, sim.peak_op, "#000", "ops")
    b = timeline.bars(gpt, simulate(gpt, schedule).residency)
    specs = []
    for step in (3, 100):
        frame = timeline.bar_frame(b, c.x, step, gpt.fixed_mem)
        assert frame["alive"].sum() == 1 + timeline.alive_at(b, step).sum()  # the fixed band is always alive
        specs.append(timeline.timeline_chart(frame, list(frame["group"]), c.x[step], (0.0, c.x[-1]), "step"))
        memory = plots.memory_chart([c], None, x_mode="ops", cursor=c.x[step], x_domain=(0.0, c.x[-1]))
        assert memory["datasets"]["cursor"]["x"].tolist() == [c.x[step]]
        assert memory["datasets"]["extent"]["x"].tolist() == specs[-1]["datasets"]["extent"]["x"].tolist()
        assert "scale" not in memory["layer"][0]["encoding"]["x"]
    without = [{k: v for k, v in s.items() if k != "datasets"} for s in specs]
    assert without[0] == without[1]  # a keyed chart then updates its data in place


def test_the_specs_do_not_change_with_the_budget(gpt):
    """Only the datasets move with the budget: a changed spec would remount both charts on every drag."""
    modules = timeline.node_modules(gpt)
    groups = sorted(set(modules.group))
    specs = []
    for pct in (0.6, 0.8):
        schedule = solvers.solve(gpt, int(pct * no_remat_peak(gpt)), method="chen")
        sim = simulate(gpt, schedule)
        c = plots.curve("chen", sim.timeline, np.ones(len(schedule.ops)), sim.peak, sim.peak_op, "#000", "ops")
        b = timeline.bars(gpt, sim.residency, modules)
        frame = timeline.bar_frame(b, c.x, 5, gpt.fixed_mem)
        chart = timeline.timeline_chart(frame, groups, c.x[5], (0.0, c.x[-1]), "step")
        memory = plots.memory_chart([c], pct, x_mode="ops", cursor=c.x[5], x_domain=(0.0, c.x[-1]))
        specs.append([{k: v for k, v in s.items() if k != "datasets"} for s in (chart, memory)])
    assert specs[0] == specs[1]


def test_a_bars_tooltip_is_one_field_that_says_all_of_it(gpt, plan):
    schedule, _ = plan
    sim = simulate(gpt, schedule)
    b = timeline.bars(gpt, sim.residency)
    frame = timeline.bar_frame(b, np.arange(1, len(schedule.ops) + 1, dtype=float), 5, gpt.fixed_mem)
    spec = timeline.timeline_chart(frame, list(frame["group"]), 5.0, (0.0, float(len(schedule.ops))), "step")
    assert spec["layer"][0]["encoding"]["tooltip"] == {"field": "tip"}
    i = int(np.flatnonzero(b.recomputed)[0])
    tip = frame["tip"].iloc[i + 1]  # after the fixed band's row
    for said in (b.label[i], b.op[i], format_bytes(int(b.bytes[i])), f"steps {b.start[i]}–{b.end[i]}", "recomputed"):
        assert said in tip


def test_the_charts_that_say_their_data_is_finite_hold_finite_numbers_only(gpt, plan):
    """Their specs tell Vega-Lite to test no value for validity (plots.FINITE_DATA): a NaN or an infinity
    would then be drawn, not left out."""
    schedule, budget = plan
    sim = simulate(gpt, schedule)
    c = plots.curve("chen", sim.timeline, np.ones(len(schedule.ops)), sim.peak, sim.peak_op, "#000", "ops")
    frame = timeline.bar_frame(timeline.bars(gpt, sim.residency), c.x, 5, gpt.fixed_mem)
    specs = [plots.memory_chart([c], budget, gpt.peak_lower_bound, "ops", cursor=c.x[5], x_domain=(0.0, c.x[-1]),
                                events=[(c.x[9], "↻1", "a rebuild")]),
             timeline.timeline_chart(frame, list(frame["group"]), c.x[5], (0.0, c.x[-1]), "step")]
    for spec in specs:
        assert spec["config"] == plots.FINITE_DATA
        for data in spec["datasets"].values():
            numbers = data.select_dtypes("number").to_numpy(dtype=float)
            assert np.isfinite(numbers).all()
