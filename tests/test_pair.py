"""explorer/pair.py: the options of each side, which modules each of two schedules recomputes, and the
table of their difference (the Compare page's side-by-side view)."""

from __future__ import annotations

import numpy as np
import pytest

from bonsai_core.graph import load_graph
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import simulate
from explorer import module_graph, pair
from explorer.state import DEFAULT_GRAPH


@pytest.fixture(scope="module")
def gpt():
    g = load_graph(str(DEFAULT_GRAPH))
    tree = module_graph.module_tree(g)
    boxes = module_graph.module_boxes(g, module_graph.default_depth(g, tree), tree)
    return g, boxes


def test_a_side_passes_the_sidebars_generic_options_and_its_own_changed_ones_only():
    base = [("time_limit", 20.0), ("granularity", 12), ("backend", "scip")]
    defaults = {"variant": "auto", "segments": None}
    got = pair.config_options(base, None, 8, {"variant": "sqrt", "segments": None}, defaults)
    assert got == (("backend", "scip"), ("granularity", 8), ("time_limit", 20.0), ("variant", "sqrt"))
    # the sidebar's granularity is not this side's; a default value is not passed; nor what the method does not take
    got = pair.config_options(base, {"time_limit", "variant"}, None, {"variant": "auto"}, {"variant": "auto"})
    assert got == (("time_limit", 20.0),)


def test_the_two_sides_are_named_apart_even_for_one_method():
    a = pair.label("bonsai", (("granularity", 4), ("time_limit", 20.0)))
    b = pair.label("bonsai", (("time_limit", 20.0),))
    assert (a, b) == ("bonsai (granularity 4)", "bonsai")
    assert pair.distinct_labels("chen", "chen") == ("A: chen", "B: chen")


def test_a_box_is_recomputed_when_one_of_its_forward_non_view_ops_is_computed_twice(gpt):
    g, boxes = gpt
    computed = np.ones(g.n, dtype=np.int64)
    fwd = np.flatnonzero(g.is_forward & ~g.is_view)
    v = int(fwd[len(fwd) // 2])
    computed[v] = 2
    view = np.flatnonzero(g.is_forward & g.is_view)
    computed[view[boxes.of[view] != boxes.of[v]][0]] = 2  # a view computed again frees nothing: not counted
    computed[np.flatnonzero(~g.is_forward)[0]] = 2  # nor a backward op
    got = pair.recomputed_boxes(g, boxes, computed)
    assert np.flatnonzero(got).tolist() == [int(boxes.of[v])]


def test_the_boxes_of_two_plans_split_into_only_a_only_b_and_both(gpt):
    g, boxes = gpt
    fwd = [v for v in range(g.n) if g.is_forward[v]]
    segments = [fwd[i:i + 20] for i in range(0, len(fwd), 20)]
    plans = [plan_schedule(g, CheckpointPlan.of(segments, chosen), "t") for chosen in ((1, 3), (3, 5))]
    rec = [pair.recomputed_boxes(g, boxes, simulate(g, p).times_computed) for p in plans]
    kinds = pair.categories(*rec)
    diff = pair.difference(boxes, kinds)

    def again(plan):  # by hand: the boxes of the forward, non-view ops the plan computes a second time
        seen, out = set(), set()
        for kind, v in plan.ops:
            if kind == "compute":
                if v in seen and g.is_forward[v] and not g.is_view[v]:
                    out.add(boxes.names[boxes.of[v]])
                seen.add(v)
        return out

    a, b = again(plans[0]), again(plans[1])
    assert a and b and a != b
    assert set(diff.only_a) == a - b and set(diff.only_b) == b - a and set(diff.both) == a & b
    assert diff.only_a and diff.only_b and diff.both
    assert set(diff.a) == a and set(diff.b) == b
    assert list(diff.both) == [n for n in boxes.names if n in diff.both]  # forward order
    assert pair.fills(kinds).count(pair.CATEGORY_FILLS[pair.BOTH]) == len(diff.both)
    assert pair.categories([True, False, True, False], [True, True, False, False]).tolist() == [
        pair.BOTH, pair.ONLY_B, pair.ONLY_A, pair.NEITHER]


def test_the_table_has_each_side_and_their_signed_difference():
    a = pair.Side("A: bonsai", 20 * 2**20, 0.10, 12, 4, ("x", "y"))
    b = pair.Side("B: chen", 19 * 2**20, 0.30, 40, 3, ("y", "z", "w"))
    diff = pair.Difference(("x",), ("z", "w"), ("y",))
    rows = pair.table(a, b, 40 * 2**20, diff)
    assert [r["schedule"] for r in rows] == ["A: bonsai", "B: chen", "B − A"]
    assert rows[0]["peak % of no remat"] == "50.0" and rows[1]["overhead %"] == "30.00"
    assert rows[0]["recomputed modules"] == "2: x, y"
    d = rows[2]
    assert d["peak"] == "−1.00 MiB" and d["peak % of no remat"] == "-2.5" and d["overhead %"] == "+20.00"
    assert d["recomputed ops"] == "+28" and d["recomputed regions"] == "-1"
    assert d["recomputed modules"] == "only A: x; only B: z, w; both: 1"
    assert pair.verdict(a, b) == "B peaks 1.00 MiB lower; A recomputes 20.00 points of overhead less."
    no_segments = pair.Side("B: dtr", a.peak, a.overhead, 5, None, ())
    assert pair.table(a, no_segments, 40 * 2**20, diff)[2]["recomputed regions"] == "—"
    assert pair.verdict(a, no_segments) == "Both peak at the same height; the same recomputation overhead."
