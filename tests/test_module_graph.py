"""The module graph (explorer/module_graph.py), its layered layout (explorer/sugiyama.py) and its chart
(explorer/module_chart.py): grouping ops into module boxes, the backward ops under their module, the
layout's layers, order and coordinates."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from bonsai_core.graph import Graph, load_graph
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import simulate
from explorer import module_chart, module_graph, sugiyama
from explorer.state import DEFAULT_GRAPH
from tests.graphs import chain, stacked_blocks


@pytest.fixture(scope="module")
def gpt() -> Graph:
    return load_graph(DEFAULT_GRAPH)


def node(graph: Graph, name: str) -> int:
    return graph.names.index(name)


def box_name(graph: Graph, boxes: module_graph.Boxes, name: str) -> str:
    return boxes.names[boxes.of[node(graph, name)]]


# -- the layered layout ------------------------------------------------------------------------------

def test_a_chain_is_one_straight_row_without_crossings():
    layout = sugiyama.sugiyama_layout(6, [(i, i + 1) for i in range(5)])
    assert layout.layer.tolist() == [0, 1, 2, 3, 4, 5]
    assert np.ptp(layout.y) == pytest.approx(0.0)
    assert layout.crossings == 0
    assert layout.routes == [[]] * 5


def test_a_source_sits_one_layer_before_its_first_reader():
    # 0 -> 1 -> 2 -> 3, and 4 (no inputs) read by 3: 4 goes to layer 2, not 0
    layer = sugiyama.longest_path_layers(5, [(0, 1), (1, 2), (2, 3), (3, 4)][:3] + [(2, 3)])
    assert layer.tolist()[:4] == [0, 1, 2, 3]
    layer = sugiyama.longest_path_layers(5, [(0, 1), (1, 2), (2, 4), (3, 4)])
    assert layer.tolist() == [0, 1, 2, 2, 3]


def test_long_edges_bend_once_per_layer_and_edges_from_one_node_share_their_bends():
    # a residual: 0 feeds 1 -> 2 -> 3 and, skipping, 3 and 4
    edges = [(0, 1), (1, 2), (2, 3), (0, 3), (3, 4), (0, 4)]
    layered = sugiyama.route_long_edges(sugiyama.longest_path_layers(5, edges), edges)
    assert len(layered.bends[(0, 3)]) == 2 and len(layered.bends[(0, 4)]) == 3
    assert layered.bends[(0, 4)][:2] == layered.bends[(0, 3)]  # one bus, not two parallel lines
    assert layered.count == 5 + 3
    layout = sugiyama.sugiyama_layout(5, edges)
    assert all(len(r) == layout.layer[v] - layout.layer[u] - 1 for (u, v), r in zip(edges, layout.routes))


def test_barycentre_ordering_removes_a_crossing_that_the_given_order_has():
    # 0 -> 3 and 1 -> 2: in the given order (2 above 3) the two edges cross
    layered = sugiyama.route_long_edges(np.array([0, 0, 1, 1]), [(0, 3), (1, 2)])
    assert sugiyama.count_crossings(layered, [[0, 1], [2, 3]]) == 1
    assert sugiyama.count_crossings(layered, sugiyama.order_layers(layered)) == 0


def test_crossings_are_counted_as_a_brute_force_count_would():
    rng = np.random.default_rng(0)
    for _ in range(20):
        top, below = list(range(5)), list(range(5, 10))
        edges = sorted({(int(rng.integers(0, 5)), int(rng.integers(5, 10))) for _ in range(8)})
        layered = sugiyama.route_long_edges(np.array([0] * 5 + [1] * 5), edges)
        brute = sum((a < c) != (b < d) and a != c and b != d
                    for (a, b), (c, d) in itertools.combinations(edges, 2))
        assert sugiyama.count_crossings(layered, [top, below]) == brute


def test_spaced_fit_keeps_order_and_gaps_with_the_least_movement():
    assert sugiyama.spaced_fit(np.array([0.0, 5.0]), np.array([1.0]), np.ones(2)).tolist() == [0.0, 5.0]
    fitted = sugiyama.spaced_fit(np.array([1.0, 1.0, 1.0]), np.array([1.0, 1.0]), np.ones(3))
    assert fitted.tolist() == pytest.approx([0.0, 1.0, 2.0])  # centred on what they wanted
    fitted = sugiyama.spaced_fit(np.array([0.0, 0.0]), np.array([2.0]), np.array([1.0, 0.01]))
    assert fitted[0] == pytest.approx(0.0, abs=0.05)  # the heavy one stays, the light one moves
    rng = np.random.default_rng(1)
    for _ in range(20):  # against a brute-force least-squares fit on a grid
        wanted = rng.normal(size=3)
        gaps = rng.uniform(0.5, 1.5, size=2)
        fitted = sugiyama.spaced_fit(wanted, gaps, np.ones(3))
        assert np.all(np.diff(fitted) >= gaps - 1e-9)
        a, s1, s2 = np.meshgrid(np.linspace(-4, 4, 161), np.linspace(0, 4, 81), np.linspace(0, 4, 81))
        best = ((a - wanted[0]) ** 2 + (a + gaps[0] + s1 - wanted[1]) ** 2
                + (a + gaps[0] + s1 + gaps[1] + s2 - wanted[2]) ** 2).min()
        assert np.sum((fitted - wanted) ** 2) <= best + 1e-9


def pooled_adjacent_violators(wanted: np.ndarray, gaps: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The fit spaced_fit computed before it called scipy: the isotonic regression of the heights less
    the gaps, by pooling adjacent violators, plus the gaps."""
    offset = np.concatenate([[0.0], np.cumsum(gaps)])
    blocks: list[list[float]] = []  # [mean, weight, count]
    for t, w in zip((wanted - offset).tolist(), weight.tolist()):
        blocks.append([t, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.concatenate([np.full(c, m) for m, _, c in blocks]) + offset


def test_spaced_fit_is_the_pooled_adjacent_violators_fit():
    """scipy's isotonic regression gives what the hand-written pooling gave, to rounding (measured: at
    most 6e-14 apart over 20000 random layers), boxes and dummy points weighted as the layout weighs them."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        k = int(rng.integers(1, 30))
        wanted = np.round(rng.normal(size=k) * rng.choice([1, 10, 100]), int(rng.integers(0, 3)))
        gaps = rng.uniform(0, 3, size=k - 1)
        weight = np.where(rng.random(k) < 0.3, sugiyama.DUMMY_WEIGHT, 1.0)
        fitted = sugiyama.spaced_fit(wanted, gaps, weight)
        assert np.allclose(fitted, pooled_adjacent_violators(wanted, gaps, weight), rtol=0, atol=1e-9)


# -- boxes -------------------------------------------------------------------------------------------

def test_the_module_tree_nests_calls_by_their_paths(gpt):
    tree = module_graph.module_tree(gpt)
    depth = dict(zip(tree.paths, tree.depth.tolist()))
    assert depth["blocks.0"] == 1 and depth["blocks.0.attn"] == 2 and depth["blocks.0.attn.qkv"] == 3
    assert tree.paths[tree.parent[tree.paths.index("blocks.1.fc")]] == "blocks.1"
    assert tree.max_depth == 3


@pytest.mark.parametrize("make", [lambda: load_graph(DEFAULT_GRAPH), lambda: stacked_blocks(3)], ids=["gpt", "blocks"])
def test_every_op_is_in_exactly_one_box_at_every_depth_the_innermost_visible_call(make):
    graph = make()
    tree = module_graph.module_tree(graph)
    owners = module_graph.forward_owners(graph, tree)
    for depth in range(1, tree.max_depth + 1):
        boxes = module_graph.module_boxes(graph, depth, tree, owners)
        assert np.all(boxes.of >= 0) and np.all(boxes.of < boxes.count)  # every op, forward and backward
        assert len(set(boxes.names)) == boxes.count
        for k in range(boxes.count):
            assert (boxes.of[graph.is_forward] == k).any(), boxes.names[k]  # no box without forward ops
        for v in np.flatnonzero(graph.is_forward & ~graph.is_view):  # views may join the box they view
            call = tree.ancestor_at(int(owners[v]), depth)
            k = boxes.of[v]
            if boxes.call[k] >= 0:
                assert boxes.call[k] == call, (depth, graph.names[v])
            else:  # a run of its call's own ops, drawn inside that call's frame
                assert boxes.parent[k] == call and (call < 0 or call in boxes.frames), (depth, graph.names[v])


def test_fold_depth_names_the_boxes_a_student_expects(gpt):
    assert module_graph.module_boxes(gpt, 1).names == (
        "tok", "model: arange", "pos", "model: add", "blocks.0", "blocks.1", "ln_f", "head",
        "model: _log_softmax, nll_loss_forward")
    boxes = module_graph.module_boxes(gpt, 3)
    assert boxes.names[4:10] == ("blocks.0.ln1", "blocks.0.attn.qkv", "blocks.0.attn: clone, bmm +6",
                                 "blocks.0.attn.proj", "blocks.0: add", "blocks.0.ln2")
    assert [module_graph.module_tree(gpt).paths[c] for c in boxes.frames] == ["blocks.0", "blocks.0.attn", "blocks.1",
                                                                              "blocks.1.attn"]
    assert box_name(gpt, boxes, "getitem_1") == "blocks.0.ln1"  # an op's separated outputs go with it
    # 26 columns at depth 3 leave too little room for a label; depth 2's 22 fit (MOST_COLUMNS)
    assert module_graph.default_depth(gpt) == 2 and module_graph.default_depth(gpt, columns=30) == 3


def test_each_backward_op_goes_with_the_forward_op_it_differentiates_on_a_synthetic_step():
    graph = stacked_blocks(3)
    anchors = module_graph.backward_anchors(graph)
    boxes = module_graph.module_boxes(graph, 2)
    for b in np.flatnonzero(~graph.is_forward):
        name = graph.names[b]
        truth = node(graph, name.removeprefix("grad_")) if name.startswith("grad_") else int(name.rsplit("_", 1)[1])
        if graph.is_view[truth]:  # a view's gradient: with the op that reads the view
            assert boxes.of[anchors[b]] == boxes.of[truth], name
        else:
            assert anchors[b] == truth, (name, graph.names[anchors[b]])


def test_each_backward_op_of_the_default_gpt_sits_under_its_module(gpt):
    boxes = module_graph.module_boxes(gpt, 3)
    expected = {
        "native_layer_norm_backward_1": "blocks.1.ln2",  # reads its layer norm's mean and rstd
        "gelu_backward": "blocks.1: gelu",  # reads only gelu's input, fc's output: named after its op
        "mm_5": "blocks.1.fc", "mm_6": "blocks.1.fc", "sum_2": "blocks.1.fc",  # input grad, weight grad, bias grad
        "mm_3": "blocks.1.out",  # the input gradient reads no activation: with the weight gradient
        "add_5": "blocks.1: add",  # the residual stream's two gradients added: where the stream forks
        "cat": "blocks.1.attn: clone, bmm +6",  # q, k, v's gradients joined: where split made them
        "_softmax_backward_data": "blocks.1.attn: clone, bmm +6",
        "mm_10": "blocks.1.attn.qkv",
        "embedding_dense_backward": "pos", "embedding_dense_backward_1": "tok",  # the second reads only indices
        "nll_loss_backward": "model: _log_softmax, nll_loss_forward",
    }
    assert {name: box_name(gpt, boxes, name) for name in expected} == expected
    blocks = module_graph.module_boxes(gpt, 1)
    for b in np.flatnonzero(~gpt.is_forward):  # at block level: the block whose ops it differentiates
        name = gpt.names[b]
        if 151 <= b <= 200:
            assert box_name(gpt, blocks, name) == "blocks.1", name


def test_a_chain_of_modules_lays_out_straight_with_no_crossings():
    graph = chain(6)
    graph = Graph.from_dict({**graph.to_dict(), "modules": [[f"layer{i}", i, i] for i in range(6)]})
    boxes = module_graph.module_boxes(graph, 1)
    layout = module_graph.box_layout(graph, boxes)
    assert boxes.names == tuple(f"layer{i}" for i in range(6))
    assert layout.x.tolist() == list(range(6)) and np.ptp(layout.y) == pytest.approx(0.0)
    assert layout.crossings == 0
    assert layout.backward_edges == tuple((i + 1, i) for i in range(5))  # gradients flow right to left


@pytest.mark.parametrize("shared", [False, True], ids=["blocks", "a tensor every block reads"])
def test_32_blocks_lay_out_in_a_row_quickly_and_the_parallel_branches_do_not_cross(shared):
    graph = stacked_blocks(32, shared=shared)
    start = time.perf_counter()
    boxes = module_graph.module_boxes(graph, 1)
    layout = module_graph.box_layout(graph, boxes)
    assert time.perf_counter() - start < 2.0
    assert boxes.count == 32 + 3 + shared  # emb, the blocks, head, the loss (and rope)
    assert layout.crossings == 0 and np.ptp(layout.y[[boxes.names.index(f"blocks.{i}") for i in range(32)]]) < 0.05
    opened = module_graph.module_boxes(graph, 2)
    layout = module_graph.box_layout(graph, opened)
    assert layout.crossings == 0 or shared  # rope's bus crosses the residual stream's
    attn = [k for k, name in enumerate(opened.names) if name.endswith(".attn")]
    assert len(attn) == 32 and np.ptp(layout.y[attn]) < 0.05  # the blocks line up (within a 20th of a box)


# -- the numbers and the chart ---------------------------------------------------------------------------

def test_box_stats_add_up_to_the_graph_and_count_what_a_plan_recomputes(gpt):
    boxes = module_graph.module_boxes(gpt, 1)
    stats = module_graph.box_stats(gpt, boxes)
    assert stats.forward_ops.sum() == gpt.is_forward.sum() and stats.backward_ops.sum() == (~gpt.is_forward).sum()
    assert stats.forward_bytes.sum() == gpt.mem[gpt.is_forward].sum()
    assert not stats.recomputed_ops.any() and (stats.segment == -1).all()

    block0 = [p for p, _, _ in gpt.modules if p == "blocks.0"]
    first, last = next((f, last) for p, f, last in gpt.modules if p == block0[0])
    forward = np.flatnonzero(gpt.is_forward)
    segments = [forward[forward < first].tolist(), forward[(forward >= first) & (forward <= last)].tolist(),
                forward[forward > last].tolist()]
    schedule = plan_schedule(gpt, CheckpointPlan.of(segments, [1]), "test")
    computed = simulate(gpt, schedule).times_computed
    stats = module_graph.box_stats(gpt, boxes, segments, computed)
    k = boxes.names.index("blocks.0")
    again = (computed > 1) & ~gpt.is_view
    assert stats.recomputed_ops[k] == again.sum() > 0 and stats.recomputed_ops.sum() == again.sum()
    assert stats.saved_bytes[k] == gpt.mem[again].sum()
    assert stats.recompute_cost[k] == pytest.approx(gpt.cost[again].sum())
    assert stats.segment[k] == 1 and stats.segment[boxes.names.index("tok")] == 0


def chart_data(spec: dict, name: str):
    return spec["datasets"][name]


def test_the_chart_mirrors_each_box_backward_part_under_it_and_marks_recomputed_boxes(gpt):
    tree = module_graph.module_tree(gpt)
    boxes = module_graph.module_boxes(gpt, 3)
    layout = module_graph.box_layout(gpt, boxes)
    forward = np.flatnonzero(gpt.is_forward)
    computed = np.ones(gpt.n, dtype=np.int64)
    qkv = boxes.names.index("blocks.0.attn.qkv")
    computed[(boxes.of == qkv) & gpt.is_forward & ~gpt.is_view] = 2
    stats = module_graph.box_stats(gpt, boxes, [forward.tolist()], computed)
    spec = module_chart.module_chart(boxes, layout, stats, tree.paths, tree.parent, [])
    rows = chart_data(spec, "boxes")
    fwd, bwd = rows[rows.part == "forward"].set_index("box"), rows[rows.part == "backward"].set_index("box")
    assert len(fwd) == boxes.count and set(bwd.index) <= set(fwd.index)
    assert (bwd.xc == fwd.xc[bwd.index]).all()  # straight under its forward module
    assert bwd.y0.min() > fwd.y1.max()  # the whole backward band below the forward band
    assert (rows.recomputed == (rows.box == qkv)).all()
    assert set(rows[rows.recomputed].stroke) == {module_chart.RECOMPUTE}
    assert fwd.numbers[qkv].startswith("↻ ")  # the bytes it frees and its recompute time, on the box
    frames = chart_data(spec, "frames")
    assert set(frames[frames.part == "forward"].frame) == {"blocks.0", "blocks.0.attn", "blocks.1", "blocks.1.attn"}
    params = [p["name"] for layer in spec["layer"] for p in layer.get("params", [])]
    assert module_chart.SELECTION in params  # a click on a box selects it
    # recomputed is a badge of its own (not only a hue): a text layer of forward recomputed boxes
    badges = [layer for layer in spec["layer"] if layer["mark"].get("text") == "↻"]
    assert badges and "datum.recomputed" in badges[0]["transform"][0]["filter"]
    texts = [layer["mark"] for layer in spec["layer"] if layer["mark"]["type"] == "text"]
    assert all(m.get("fontSize", 12) >= 12 and "angle" not in m for m in texts)  # horizontal, 12 px or more
    lit = module_chart.module_chart(boxes, layout, stats, tree.paths, tree.parent, [], lit=frozenset({qkv}))
    assert set(chart_data(lit, "boxes").query("lit").box) == {qkv}
    assert {**lit, "datasets": None} == {**spec, "datasets": None}  # the event under the cursor: data only


def test_a_new_schedule_changes_the_chart_data_not_its_spec(gpt):
    """A budget drag re-solves: the browser updates a chart in place when only its datasets change."""
    tree = module_graph.module_tree(gpt)
    boxes = module_graph.module_boxes(gpt, 3)
    layout = module_graph.box_layout(gpt, boxes)
    forward = np.flatnonzero(gpt.is_forward).tolist()
    plain = module_graph.box_stats(gpt, boxes)
    again = module_graph.box_stats(gpt, boxes, [forward[:50], forward[50:]], np.where(gpt.is_forward, 2, 1))
    specs = [module_chart.module_chart(boxes, layout, stats, tree.paths, tree.parent, [])
             for stats in (plain, again)]
    assert not specs[0]["datasets"]["boxes"].equals(specs[1]["datasets"]["boxes"])
    assert [{**spec, "datasets": None} for spec in specs][0] == {**specs[1], "datasets": None}


def test_labels_on_fills_have_the_contrast_of_black_or_white_text():
    assert module_chart.text_colour("#F0E442") == "#111111"  # yellow: black text
    assert module_chart.text_colour("#0072B2") == "#FFFFFF"  # blue: white text
