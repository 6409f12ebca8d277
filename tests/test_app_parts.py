"""The explorer's pure parts: upload loaders, layouts, groups, Pareto fronts, figures."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import zipfile

import numpy as np
import pytest

from bonsai_core.errors import GraphError, ModelError
from bonsai_core.graph import load_graph
from bonsai_core.models import pt2
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import none_schedule, simulate
from explorer import loaders, plots
from tests.graphs import chain

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


@functools.cache
def tiny_pt2() -> bytes:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    buf = io.BytesIO()
    torch.export.save(torch.export.export(model, (torch.randn(2, 8),)), buf)
    return buf.getvalue()


def rewrite(data: bytes, edit) -> bytes:
    """A copy of a zip archive with ``edit(name, bytes) -> bytes | None`` applied (None drops it)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            new = edit(info.filename, src.read(info))
            if new is not None:
                dst.writestr(info.filename, new)
    return out.getvalue()


def test_the_default_asset_is_the_gpt_zoo_model_at_its_default_options():
    from bonsai_core.trace import trace_model

    assert load_graph(ROOT / "assets" / "gpt-default.json").hash == trace_model("gpt").graph.hash


def test_a_pt2_upload_traces_a_training_step_with_the_sum_of_squares_loss():
    g = loaders.graph_from_pt2_bytes(tiny_pt2(), name="tiny")
    assert g.name == "tiny"
    assert g.is_forward.any() and (~g.is_forward).any()
    assert any(op.startswith("aten.pow") or op.startswith("aten.mul") for op in g.ops)


def test_a_pt2_with_pickled_weights_is_refused_before_loading():
    def pickle_weights(name: str, body: bytes) -> bytes:
        if name.endswith("weights_config.json"):
            config = json.loads(body)
            for meta in config["config"].values():
                meta["use_pickle"] = True
            return json.dumps(config).encode()
        return body

    with pytest.raises(ModelError, match="cannot be loaded safely.*pickle"):
        loaders.graph_from_pt2_bytes(rewrite(tiny_pt2(), pickle_weights))


def test_a_pt2_with_compiled_code_or_in_the_legacy_format_is_refused():
    with_so = rewrite(tiny_pt2(), lambda n, b: b)
    out = io.BytesIO(with_so)
    with zipfile.ZipFile(out, "a") as z:
        z.writestr("archive/data/aotinductor/model/model.so", b"\x7fELF")
    with pytest.raises(ModelError, match="compiled artifacts"):
        pt2.check_pt2(out.getvalue())
    legacy = rewrite(tiny_pt2(), lambda n, b: None if "/models/" in n else b)
    with pytest.raises(ModelError, match="old format"):
        pt2.check_pt2(legacy)


def test_non_zip_and_oversized_uploads_are_refused_with_what_to_do():
    with pytest.raises(ModelError, match="not a .pt2 archive"):
        pt2.check_pt2(b"print('hello')")
    with pytest.raises(ModelError, match="at most"):
        pt2.check_pt2(b"\0" * (pt2.MAX_PT2_BYTES + 1))


def test_a_graph_json_upload_is_parsed_as_data_and_defects_are_named():
    g = chain(5)
    assert loaders.graph_from_json_bytes(json.dumps(g.to_dict()).encode()).hash == g.hash
    with pytest.raises(GraphError, match="not valid JSON"):
        loaders.graph_from_json_bytes(b"\xff\xfe")
    with pytest.raises(GraphError, match="not a bonsai-graph"):
        loaders.graph_from_json_bytes(b'{"format": "bonsai-schedule"}')
    for empty in (b"", b"  \n"):
        with pytest.raises(GraphError, match="is empty"):
            loaders.graph_from_json_bytes(empty, "graph.json")
    with pytest.raises(GraphError, match="is empty"):
        loaders.graph_from_pt2_bytes(b"", "model.pt2")


def test_layout_puts_forward_on_top_and_backward_mirrored_below():
    g = chain(6)
    pos = plots.layered_layout(g)
    fwd, bwd = pos[g.is_forward], pos[~g.is_forward]
    assert fwd[:, 1].min() > bwd[:, 1].max()
    assert np.all(np.diff(fwd[:, 0]) > 0)  # forward runs left to right
    assert np.all(np.diff(bwd[:, 0]) < 0)  # backward (listed b5..b0) runs right to left
    assert bwd[:, 0].max() == pytest.approx(fwd[:, 0].max())  # the loss end lines up


def test_groups_follow_segments_then_blocks_of_the_backward_pass():
    g = chain(6)
    groups = plots.node_groups(g, [[0, 1, 2], [3, 4, 5]], recomputed=[0], block=4)
    assert groups.names[:2] == ("segment 0", "segment 1")
    assert groups.recomputed.tolist()[:2] == [True, False]
    assert (groups.of >= 0).all()
    assert groups.of[6:].tolist() == [2, 2, 2, 2, 3, 3]
    no_segments = plots.node_groups(g, None, block=4)
    assert no_segments.names[0] == "forward ops 0–3"


def test_pareto_front_keeps_only_points_nothing_beats():
    points = [(50, 10), (60, 5), (55, 12), (70, 5), (80, 0)]
    assert plots.pareto_front(points) == [(50, 10), (60, 5), (80, 0)]


def test_memory_chart_draws_budget_line_and_each_peak_and_moves_them_by_its_data_alone():
    g = chain(8)
    plan = plan_schedule(g, CheckpointPlan.of([[0, 1, 2, 3], [4, 5, 6, 7]], [0]), "bonsai")
    curves = []
    for s in (plan, none_schedule(g)):
        sim = simulate(g, s)
        costs = np.array([g.cost[v] if k == "compute" else 0.0 for k, v in s.ops])
        curves.append(plots.curve(s.method, sim.timeline, costs, sim.peak, sim.peak_op, "#000"))
    spec = plots.memory_chart(curves, budget=120, lower_bound=g.peak_lower_bound)
    data = spec["datasets"]
    assert list(data["lines"].schedule.unique()) == ["bonsai", "none"]
    levels = data["levels"].set_index("kind").mib
    assert levels["budget"] == pytest.approx(120 / plots.MIB)
    assert levels["lower bound"] == pytest.approx(g.peak_lower_bound / plots.MIB)
    assert list(data["peaks"].mib) == pytest.approx([c.peak / plots.MIB for c in curves])
    assert curves[0].x[-1] > curves[1].x[-1]  # recomputation takes longer on the time axis
    shapes = next(layer for layer in spec["layer"] if "shape" in layer["encoding"])["encoding"]["shape"]
    assert len(set(shapes["scale"]["range"])) == 2  # told apart by marker symbol, not hue alone
    # the budget lives in the datasets only: Streamlit then updates the drawn chart's data in place
    moved = plots.memory_chart(curves, budget=90, lower_bound=g.peak_lower_bound)
    assert moved["datasets"]["levels"].mib[0] == pytest.approx(90 / plots.MIB)
    assert json.dumps({**moved, "datasets": None}) == json.dumps({**spec, "datasets": None})


def test_the_pareto_line_follows_the_theme_and_is_never_black():
    rows = [{"method": m, "budget": b, "peak": b, "overhead": o}
            for m, b, o in (("a", 50, 0.3), ("a", 80, 0.1), ("b", 60, 0.2), ("b", 100, 0.0))]
    colours = {}
    for theme in ("light", "dark", None):
        fig = plots.sweep_figure(rows, 100, theme=theme)
        front = next(t for t in fig.data if t.name == "Pareto front")
        colours[theme] = front.line.color
    assert colours["light"] == plots.FOREGROUND["light"] and colours["dark"] == plots.FOREGROUND["dark"]
    assert "black" not in colours.values() and "#000000" not in colours.values()
    # methods differ by marker symbol as well as colour
    symbols = [t.marker.symbol for t in plots.sweep_figure(rows, 100).data if t.name in ("a", "b")]
    assert len(set(symbols)) == 2


def test_neighbouring_segments_differ_in_shape_as_well_as_colour():
    styles = [plots.segment_style(i) for i in range(30)]
    assert all(a[0] != b[0] and a[1] != b[1] for a, b in zip(styles, styles[1:]))
    assert len(set(styles[:21])) == 21  # a (colour, shape) pair repeats only every 21 segments
    g = chain(6)
    fig = plots.graph_figure(g, np.arange(g.n), plots.layered_layout(g), np.array([0, 0, 1, 1, 2, 2] + [-1] * 6),
                             ["segment 0", "segment 1", "segment 2"], np.zeros(g.n, dtype=bool))
    forward = next(t for t in fig.data if t.name == "forward op")
    assert list(forward.marker.symbol) == ["circle", "circle", "square", "square", "triangle-up", "triangle-up"]


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two #rrggbb colours."""
    def luminance(c: str) -> float:
        rgb = [int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        lin = [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_lines_drawn_in_the_foreground_stand_out_on_both_streamlit_backgrounds():
    light, dark = "#FFFFFF", "#0E1117"  # Streamlit's light and dark backgrounds
    assert contrast(plots.FOREGROUND["light"], light) >= 4.5 and contrast(plots.FOREGROUND["dark"], dark) >= 4.5
    assert min(contrast(plots.FOREGROUND[None], light), contrast(plots.FOREGROUND[None], dark)) >= 3.0
    assert min(contrast(plots.BACKWARD, light), contrast(plots.BACKWARD, dark)) >= 2.0


@pytest.mark.parametrize("edit, reason", [
    (lambda d: d["graph_module"]["graph"]["nodes"][0].update(target="torch.os.system"), "not an aten or prims"),
    (lambda d: d.update(guards_code=["__import__('os').system('true')"]), "guard code"),
    (lambda d: d.update(range_constraints={"s0": {"min_val": 1, "max_val": 8}}), "dynamic shapes"),
    (lambda d: d["graph_module"]["graph"]["nodes"][0].update(meta={"expr_str": "s0*2"}), "symbolic shape"),
])
def test_a_pt2_program_that_loading_would_evaluate_is_refused(edit, reason):
    def tamper(name: str, body: bytes) -> bytes:
        if "/models/" in name and name.endswith(".json"):
            doc = json.loads(body)
            edit(doc)
            return json.dumps(doc).encode()
        return body

    with pytest.raises(ModelError, match=reason):
        pt2.check_pt2(rewrite(tiny_pt2(), tamper))


# Machado, Oliveira & Fernandes (2009), severity 1.0: linear RGB -> linear RGB as each dichromat sees it
CVD = {"protanopia": [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]],
       "deuteranopia": [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]],
       "tritanopia": [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602], [0.004733, 0.691367, 0.303900]]}


def seen(colour: str, matrix) -> np.ndarray:
    """``colour`` (#RRGGBB) as a dichromat sees it, in sRGB 0-255."""
    c = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    out = np.clip(np.asarray(matrix) @ linear, 0, 1)
    return 255 * np.where(out <= 0.0031308, 12.92 * out, 1.055 * out ** (1 / 2.4) - 0.055)


@pytest.mark.parametrize("kind", sorted(CVD))
def test_the_recomputed_red_stands_apart_from_every_segment_colour_for_colour_blind_eyes(kind):
    red = seen(plots.RECOMPUTE, CVD[kind])
    distances = [float(np.linalg.norm(seen(c, CVD[kind]) - red)) for c in plots.SEGMENT_PALETTE]
    assert min(distances) >= 80, dict(zip(plots.SEGMENT_PALETTE, distances))
    # the palette's vermillion, which the segments no longer use, would not
    assert float(np.linalg.norm(seen("#D55E00", CVD[kind]) - red)) < 80


def test_segment_colours_follow_the_module_not_the_index():
    paths = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    three = plots.segment_colours([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], paths)
    split = plots.segment_colours([[0, 1], [2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], paths)
    assert three[2] == split[3]  # the segment in "c" keeps its colour when the one before it splits
    assert all(a != b for a, b in zip(split, split[1:]))  # neighbours differ


def test_a_plan_whose_solve_stopped_above_its_gap_says_so():
    from explorer import compute

    g = chain(4)
    schedule = none_schedule(g)

    def outcome(status, gap, options=(("time_limit", 20.0),)):
        schedule.stats = {"status": status, "gap": gap}
        return compute.Outcome("bonsai", 100, options, schedule, simulate(g, schedule))

    assert compute.out_of_time(outcome("optimal", 0.0)) is None
    assert compute.out_of_time(outcome("feasible", 0.009)) is None  # within bonsai's own 1% gap
    assert "gap of 3.0% to its bound (asked: 1%)" in compute.out_of_time(outcome("feasible", 0.03))
    assert compute.out_of_time(outcome("feasible", 0.03, (("gap", 0.05),))) is None  # the user asked for 5%


def test_a_plan_within_the_absolute_gap_of_its_bound_is_as_good_as_optimal_and_says_how_close():
    """The explorer's bonsai stops within 0.05% of the step's compute of its bound (compute.DEFAULTS): 3% of a 1%
    overhead is 0.03% of the step, no warning; the status says both."""
    from explorer import compute

    g = chain(4)
    schedule = none_schedule(g)
    schedule.stats = {"status": "feasible", "gap": 0.03, "objective": 0.01}
    within = compute.Outcome("bonsai", 100, (("time_limit", 20.0),), schedule, simulate(g, schedule))
    assert compute.out_of_time(within) is None
    assert compute.gap_words(within) == ("within 3% of its bound: no plan it searches at this budget is more than "
                                         "0.03% of the step faster")
    assert "gap of 3.0%" in compute.out_of_time(dataclasses.replace(within, options=(("abs_gap", 0.0),)))


def test_a_rebuild_repeated_in_every_block_is_one_pattern_and_a_block_one_mark():
    from bonsai_core.graph import block_stack
    from explorer import events, timeline
    from tests.graphs import stacked_blocks

    g = stacked_blocks(8)
    mlps = [(first, last) for path, first, last in g.modules if path.endswith(".mlp")]
    forward = [v for v in range(g.n) if g.is_forward[v]]
    segments, recomputed, at = [], [], 0
    for first, last in mlps:  # every block's MLP a recomputed region, the stretches between them kept
        segments.append([v for v in forward if at <= v < first])
        segments.append([v for v in forward if first <= v <= last])
        recomputed.append(len(segments) - 1)
        at = last + 1
    segments.append([v for v in forward if v >= at])
    sim = simulate(g, plan_schedule(g, CheckpointPlan.of([s for s in segments if s],
                                                         [r - sum(1 for s in segments[:r] if not s) for r in recomputed]),
                                    "bonsai"))
    modules = timeline.node_modules(g)
    assert len(sim.events) == 8
    found = events.patterns(g, sim.events, modules)
    assert len(found) == 1 and found[0].what == "blocks.*.mlp" and found[0].when == "before blocks.*.mlp's backward"
    assert found[0].blocks == tuple(range(8)) and found[0].events == tuple(range(8))
    row = events.pattern_rows(g, sim.events, found)[0]
    assert row["blocks"] == "blocks.0–7 (8)" and row["rebuilds"] == 8
    assert len(events.block_marks(g, sim.events, modules)) == 8  # one block's rebuilds each
    # hovered, a mark names its pattern as the table numbers it
    assert all(words.startswith("pattern 1: ") for _, _, words in events.block_marks(g, sim.events, modules, found))
    stack = [b for b, _, _ in block_stack(g)]
    assert events.block_ranges([0, 1, 2, 3, 5, 7], stack) == "blocks.0–3, 5, 7"
    assert set(modules.kind) >= {"blocks.*.mlp", "blocks.*.attn", "emb"} and "blocks.3" not in set(modules.kind)


def test_labels_are_kept_by_priority_where_they_overlap_nothing_kept_before():
    labels = [plots.Label(0.0, 0.0, "low", 1.0), plots.Label(0.1, 0.0, "high", 5.0), plots.Label(5.0, 0.0, "apart", 0.5),
              plots.Label(9.99, 0.0, "cut at the edge", 9.0)]
    kept = plots.fit_labels(labels, (-1.0, 10.0))
    assert [lb.text for lb in kept] == ["high", "apart"]  # "low" overlaps "high"; the last would leave the plot
    assert not plots.fit_labels([plots.Label(5.0, 0.0, "on a marker", 1.0)], (-1.0, 10.0),
                                markers=(np.array([5.0]), np.array([0.0]), np.array([20.0])))


def test_the_default_gpts_op_level_views_carry_ten_labels_of_blocks_parts_and_op_kinds():
    from explorer import timeline

    g = load_graph(ROOT / "assets" / "gpt-default.json")
    modules = timeline.node_modules(g)
    pos = plots.layered_layout(g)
    every = [lb.text for lb in plots.fit_labels(plots.op_labels(g, np.arange(g.n), pos, modules.path, modules.group),
                                                plots.padded(pos[:, 0]))]
    assert len(every) >= 10 and {"blocks.0", "blocks.1", "attn", "fc", "addmm"} <= set(every)
    groups = plots.node_groups(g, None)
    collapsed = plots.fit_labels(plots.collapsed_labels(g, groups, pos, modules.path, modules.group),
                                 plots.padded(pos[:, 0]))
    assert len(collapsed) >= 10 and {"blocks.0", "blocks.1"} <= {lb.text for lb in collapsed}


def test_a_long_step_line_keeps_every_column_s_lowest_and_highest_point():
    rng = np.random.default_rng(0)
    y = np.cumsum(rng.integers(-5, 6, 20_000)).astype(float)
    x = np.arange(len(y), dtype=float)
    kept = plots.envelope(x, y, columns=500)
    assert len(kept) <= 4 * 500 and kept[0] == 0 and kept[-1] == len(y) - 1
    assert y[kept].max() == y.max() and y[kept].min() == y.min()  # the peak and the trough, exactly
    column = (x / x[-1] * 500).astype(int).clip(max=499)
    for c in (0, 137, 499):
        inside = column == c
        assert y[kept][column[kept] == c].max() == y[inside].max()
    assert list(plots.envelope(x[:100], y[:100], columns=500)) == list(range(100))  # short: every point


def test_a_filled_area_keeps_every_column_s_highest_point_and_no_more():
    rng = np.random.default_rng(1)
    y = np.cumsum(rng.integers(-5, 6, 20_000)).astype(float)
    x = np.cumsum(rng.random(20_000))
    kept = plots.column_tops(x, y, columns=300)
    assert len(kept) <= 300 + 2 and kept[0] == 0 and kept[-1] == len(y) - 1
    column = np.minimum(((x - x[0]) / (x[-1] - x[0]) * 300).astype(int), 299)
    for c in (0, 42, 299):  # each column's highest point is kept, the first of them
        inside = np.flatnonzero(column == c)
        assert inside[np.argmax(y[inside])] in kept
    assert y[kept].max() == y.max()  # the peak, exactly
    assert list(plots.column_tops(x[:100], y[:100], columns=300)) == list(range(100))  # short: every point


def test_the_memory_chart_s_pointer_finds_fewer_points_than_the_line_has_and_the_peak():
    rng = np.random.default_rng(2)
    live = np.cumsum(rng.integers(-3, 5, 30_000)).astype(np.int64) * 2**20
    c = plots.curve("bonsai", live, np.full(len(live), 1e-4), int(live.max()), int(np.argmax(live)), "#000", "ops")
    data = plots.memory_chart([c], None)["datasets"]
    assert len(data["hover"]) <= 4 * plots.HOVER_COLUMNS < len(data["lines"])
    assert data["hover"].mib.max() == data["lines"].mib.max() == np.float32(live.max() / 2**20)
    assert set(data["hover"].x) <= set(data["lines"].x)
