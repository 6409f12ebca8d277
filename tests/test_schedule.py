import pytest

from bonsai_core.errors import ScheduleError
from bonsai_core.graph import Graph
from bonsai_core.schedule import (Schedule, load_schedule, no_remat_peak, none_schedule, schedule_ops,
                                  save_schedule, simulate)

from tests.graphs import chain


def test_none_schedule_of_a_chain_keeps_all_activations_until_backward():
    g = chain(4, mem=10, fixed_mem=100)
    sim = simulate(g, none_schedule(g))
    # at b3: f0..f3 + b3 resident; at b2: f0..f2 + b3 + b2, then b3 freed ... peak is 5 tensors
    assert sim.peak == 100 + 50
    assert sim.recomputes == 0 and sim.overhead == 0.0
    assert sim.timeline.max() == sim.peak and sim.timeline[-1] == 100 + 0  # output b0 freed


def test_compute_cost_counts_recomputation():
    g = chain(2)
    ops = [("compute", 0), ("compute", 1), ("free", 0), ("compute", 2), ("free", 1),
           ("compute", 0), ("compute", 3), ("free", 0), ("free", 2), ("free", 3)]
    sim = simulate(g, ops)
    assert sim.compute_cost == 5.0 and sim.recomputes == 1 and sim.overhead == pytest.approx(0.25)


@pytest.mark.parametrize("ops, words", [
    ([("compute", 1)], "not resident"),
    ([("compute", 0), ("compute", 0)], "already resident"),
    ([("free", 0)], "not resident"),
    ([("compute", 0), ("compute", 1), ("compute", 2)], "never computes node 3"),
    ([("compute", 9)], "names no node"),
    ([("drop", 0)], "kind"),
])
def test_each_broken_rule_is_named(ops, words):
    with pytest.raises(ScheduleError, match=words):
        simulate(chain(2), ops)


def _view_graph() -> Graph:
    return Graph.from_nodes("v", 0, [
        dict(name="a", op="x", cost=1, mem=8, deps=[]),
        dict(name="va", op="view", cost=0, mem=0, deps=[0], alias_of=0),
        dict(name="b", op="x", cost=1, mem=4, deps=[1]),
    ])


def test_a_view_keeps_its_base_alive():
    g = _view_graph()
    with pytest.raises(ScheduleError, match="view"):
        simulate(g, [("compute", 0), ("compute", 1), ("free", 0)])
    ops = schedule_ops(g, range(3))
    assert ops.index(("free", 1)) < ops.index(("free", 0))
    assert simulate(g, ops).peak == 12


def test_schedule_for_another_graph_is_refused(tmp_path):
    g, h = chain(2), chain(3)
    s = none_schedule(g)
    save_schedule(s, tmp_path / "s.json")
    with pytest.raises(ScheduleError, match="another graph|not for"):
        simulate(h, load_schedule(tmp_path / "s.json"))


def test_schedule_json_round_trip(tmp_path):
    g = chain(3)
    s = none_schedule(g)
    s.stats = {"peak": 1}
    save_schedule(s, tmp_path / "s.json")
    t = load_schedule(tmp_path / "s.json")
    assert t.ops == s.ops and t.stats == s.stats and t.graph_hash == g.hash


@pytest.mark.parametrize("doc, words", [
    ({"format": "bonsai-graph"}, "not a bonsai-schedule"),
    ({"format": "bonsai-schedule", "version": 1, "ops": [["compute"]]}, "Op 0"),
    ({"format": "bonsai-schedule", "version": 1, "ops": [["compute", "1"]]}, "Op 0"),
    ({"format": "bonsai-schedule", "version": 1, "ops": "all"}, "'ops'"),
])
def test_bad_schedule_documents(doc, words):
    with pytest.raises(ScheduleError, match=words):
        Schedule.from_dict(doc)


def test_no_remat_peak_is_the_none_peak(chain4):
    assert no_remat_peak(chain4) == simulate(chain4, none_schedule(chain4)).peak


def test_schedule_ops_frees_a_copy_before_its_recomputation():
    g = chain(2)  # f0 f1 b1 b0
    ops = schedule_ops(g, [0, 1, 2, 0, 3])
    assert ops == [("compute", 0), ("compute", 1), ("free", 0), ("compute", 2), ("free", 1),
                   ("compute", 0), ("compute", 3), ("free", 3), ("free", 0), ("free", 2)]
    assert simulate(g, ops).recomputes == 1


def test_schedule_ops_rejects_impossible_sequences():
    with pytest.raises(ScheduleError, match="before its input"):
        schedule_ops(chain(2), [1, 0, 2, 3])
    with pytest.raises(ScheduleError, match="still needed"):  # the live view pins the base's first copy
        schedule_ops(_view_graph(), [0, 1, 0, 2])
