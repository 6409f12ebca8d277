"""The Compare page's side-by-side view on the default GPT, driven headless with AppTest: bonsai against
chen at 60%, and one method at two settings."""

from __future__ import annotations

import json

import pyarrow as pa
from streamlit.testing.v1 import AppTest

from bonsai_core import solvers
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.units import format_bytes
from explorer import compute, module_graph, pair
from tests.test_app import app, goto


def charts(at: AppTest) -> list[tuple[str, dict, dict]]:
    """The page's Vega-Lite charts as (kind, spec, datasets), kind by their data: memory, modules, timeline."""
    out = []
    for chart in at.get("vega_lite_chart"):
        data = {d.name: pa.ipc.open_stream(d.data.data).read_pandas() for d in chart.proto.datasets}
        kind = "memory" if "lines" in data else "modules" if "boxes" in data else "timeline"
        out.append((kind, json.loads(chart.proto.spec), data))
    return out


def side_table(at: AppTest):
    return next(t.value for t in at.table if "recomputed modules" in t.value.columns)


def test_bonsai_and_chen_side_by_side_at_60_percent_on_the_default_model():
    at = app()
    at.slider(key="budget_pct").set_value(60).run()
    at = goto(at, "compare")
    assert at.selectbox(key="side_a_method").value == "bonsai"
    assert at.selectbox(key="side_b_method").value == "chen"
    assert not at.error

    g = at.session_state["model"].graph
    budget = at.session_state["settings"].budget
    assert budget == int(0.6 * no_remat_peak(g)) or abs(budget - 0.6 * no_remat_peak(g)) < 2
    # each side is the method's own schedule at that budget as the explorer asks for it (bonsai: checkpoint
    # regions, compute.DEFAULTS), checked by the simulator
    plans = {m: solvers.solve(g, budget, m, time_limit=20.0, **compute.DEFAULTS.get(m, {})) for m in ("bonsai", "chen")}
    sims = {m: simulate(g, plans[m]) for m in plans}
    assert all(s.peak <= budget for s in sims.values())

    table = side_table(at)
    assert table["schedule"].tolist() == ["A: bonsai", "B: chen", "B − A"]
    assert table["peak"].tolist()[:2] == [format_bytes(sims["bonsai"].peak), format_bytes(sims["chen"].peak)]
    assert table["overhead %"].tolist()[:2] == [f"{100 * sims[m].overhead:.2f}" for m in ("bonsai", "chen")]
    dover = 100 * (sims["chen"].overhead - sims["bonsai"].overhead)
    assert table["overhead %"].iloc[2] == f"{dover:+.2f}"

    shown = charts(at)
    assert [k for k, _, _ in shown] == ["memory", "modules", "timeline", "timeline"]
    # one memory chart: both schedules and no remat on one y scale, over schedule steps
    lines = shown[0][2]["lines"]
    assert set(lines.schedule) == {"A: bonsai", "B: chen", "no remat"}
    peaks = shown[0][2]["peaks"].set_index("schedule")["mib"]
    assert abs(peaks["A: bonsai"] - sims["bonsai"].peak / 2**20) < 1e-6
    assert abs(peaks["B: chen"] - sims["chen"].peak / 2**20) < 1e-6

    # the module boxes coloured by who recomputes them, as computed by hand from the two schedules
    boxes_data = shown[1][2]["boxes"]
    fwd = boxes_data[boxes_data.part == "forward"].set_index("name")["fill"]
    tree = module_graph.module_tree(g)
    boxes = module_graph.module_boxes(g, module_graph.default_depth(g, tree), tree)
    again = {}
    for m in ("bonsai", "chen"):
        computed = sims[m].times_computed
        again[m] = {boxes.names[boxes.of[v]] for v in range(g.n)
                    if computed[v] > 1 and g.is_forward[v] and not g.is_view[v]}
    for name, fill in fwd.items():
        a, b = name in again["bonsai"], name in again["chen"]
        assert fill == pair.CATEGORY_FILLS[a + 2 * b], name
    assert set(fwd.index) == set(boxes.names)
    assert (fwd == pair.CATEGORY_FILLS[pair.ONLY_B]).any()  # chen recomputes modules bonsai keeps
    assert table["recomputed modules"].iloc[0].startswith(f"{len(again['bonsai'])}: ")
    assert table["recomputed modules"].iloc[1].startswith(f"{len(again['chen'])}: ")

    # two lifetime charts on the same x and y extents, each with its own recomputed lifetimes
    (_, _, ta), (_, _, tb) = shown[2], shown[3]
    assert ta["extent"].equals(tb["extent"]) and ta["extent"]["y"].max() > 0
    assert ta["bars"]["recomputed"].any() and tb["bars"]["recomputed"].any()
    assert len(ta["bars"]) != len(tb["bars"]) or not ta["bars"]["x"].equals(tb["bars"]["x"])


def test_one_method_at_two_settings_is_named_apart_and_a_failed_side_is_an_error():
    at = goto(app(), "compare")
    at.selectbox(key="side_a_method").set_value("chen").run()
    at.selectbox(key="side_a_chen_variant").set_value("sqrt").run()
    assert not at.exception
    table = side_table(at)
    assert table["schedule"].tolist()[:2] == ["A: chen (variant sqrt)", "B: chen"]
    at.slider(key="budget_pct").set_value(5).run()  # below what any schedule fits
    assert not at.exception
    assert any(e.value.startswith("A, chen:") for e in at.error)
    assert not any("recomputed modules" in t.value.columns for t in at.table)
