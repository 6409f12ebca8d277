import numpy as np
import pytest

from bonsai_core.errors import ScheduleError
from bonsai_core.graph import Graph
from bonsai_core import schedule
from bonsai_core.schedule import (Schedule, hold_separated_outputs, load_schedule, no_remat_peak, none_schedule,
                                  schedule_ops, save_schedule, simulate)

from tests.graphs import chain


def test_none_schedule_of_a_chain_keeps_all_activations_until_backward():
    g = chain(4, mem=10, fixed_mem=100)
    sim = simulate(g, none_schedule(g))
    # at b3: f0..f3 + b3 resident; at b2: f0..f2 + b3 + b2, then b3 freed ... peak is 5 tensors
    assert sim.peak == 100 + 50
    assert sim.recomputes == 0 and sim.overhead == 0.0
    assert sim.timeline.max() == sim.peak and sim.timeline[-1] == 100 + 0  # output b0 freed


def test_recompute_events_name_each_rebuild_in_order_with_the_op_that_needs_it():
    g = chain(3, mem=10)  # f0 f1 f2, then b2 b1 b0 (node 3 + i)
    ops = [("compute", 0), ("compute", 1), ("free", 0), ("compute", 2), ("free", 1), ("compute", 3), ("free", 2),
           ("compute", 0), ("compute", 1), ("compute", 4), ("free", 3), ("free", 1), ("compute", 5), ("free", 0),
           ("free", 4), ("free", 5)]
    sim = simulate(g, ops)
    assert [(e.start, e.end, e.nodes, e.before) for e in sim.events] == [(7, 8, (0, 1), 4)]
    assert sim.events[0].bytes == 20 and sim.events[0].cost == 2.0
    assert sum(len(e.nodes) for e in sim.events) == sim.recomputes == 2
    assert sim.times_computed.tolist() == [2, 2, 1, 1, 1, 1]


def test_a_plan_without_recomputation_has_no_events():
    g = chain(4)
    sim = simulate(g, none_schedule(g))
    assert sim.events == () and sim.times_computed.tolist() == [1] * g.n


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


def test_bytes_held_beyond_the_graph_are_one_more_entry_of_the_simulator(monkeypatch):
    """A rule that holds bytes beyond the graph's tensors (as rule 7's FSDP buffers do) is a function of the
    graph, the ops and the live set added to BEYOND_THE_GRAPH: the timeline and the peak count it."""
    g = chain(2, mem=10)
    ops = none_schedule(g).ops
    plain = simulate(g, ops)

    def one_byte_per_op_index(graph, ops, residency):
        return np.arange(len(ops), dtype=np.int64)

    monkeypatch.setattr(schedule, "BEYOND_THE_GRAPH", schedule.BEYOND_THE_GRAPH + (one_byte_per_op_index,))
    held = simulate(g, ops)
    assert held.timeline.tolist() == (plain.timeline + np.arange(len(ops))).tolist()
    assert held.peak == int(held.timeline.max()) and held.peak_op == int(held.timeline.argmax())


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


def _dropout_with_mask() -> Graph:
    """x -> dropout (a multi-output op) -> its mask as a node of its own (``getitem``, 25 bytes) and
    y; the backward reads y and the mask."""
    return Graph("dropout", 1000, names=["x", "dropout", "mask", "y", "grad"],
                 ops=["aten.mm", "aten.native_dropout", "getitem", "aten.mm", "aten.mul"],
                 phases=["forward", "forward", "forward", "forward", "backward"],
                 cost=[1, 1, 1e-9, 1, 1], mem=[10, 100, 25, 100, 100], deps=[[], [0], [1], [1], [3, 2]],
                 alias_of=[None] * 5)


def test_a_separated_output_is_taken_again_only_from_a_new_run_of_its_op():
    """The mask's bytes come from the dropout kernel: freed, then taken again from the dropout's node
    that never ran again, it would be the copy a real run kept all along (the export held it in its
    op's output list: measured above the prediction). The simulator refuses it; rerunning the op
    makes it legal; hold_separated_outputs keeps the mask resident instead, as a real run does."""
    g = _dropout_with_mask()
    assert g.output_of.tolist() == [-1, -1, 1, -1, -1]
    taken_again = [("compute", 0), ("compute", 1), ("compute", 2), ("free", 2), ("compute", 3), ("compute", 2),
                   ("compute", 4)]
    with pytest.raises(ScheduleError, match="has not run since"):
        simulate(g, taken_again)
    rerun = [("compute", 0), ("compute", 1), ("compute", 2), ("free", 2), ("compute", 3), ("free", 1),
             ("compute", 1), ("compute", 2), ("compute", 4)]
    assert simulate(g, rerun).recomputes == 2
    held = hold_separated_outputs(g, taken_again)
    assert held == [("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3), ("compute", 4)]
    assert simulate(g, held).peak == 1000 + 10 + 100 + 25 + 100 + 100
    # every method's sequences go through it: a sequence that takes the mask twice is the plain one
    twice, once = schedule_ops(g, [0, 1, 2, 3, 2, 4]), schedule_ops(g, [0, 1, 2, 3, 4])
    assert [op for op in twice if op[0] == "compute"] == [op for op in once if op[0] == "compute"]
    assert simulate(g, twice).peak == simulate(g, once).peak


def test_simulated_shares_one_simulation_until_the_schedule_changes():
    g = chain(4, mem=10, fixed_mem=100)
    s = none_schedule(g)
    first = schedule.simulated(g, s)
    assert schedule.simulated(g, s) is first  # kept on the schedule
    assert first.peak == simulate(g, s).peak
    s.ops = [op for op in s.ops if op != ("free", 7)] + [("free", 7)]  # b0 freed last: another schedule
    again = schedule.simulated(g, s)
    assert again is not first and again.peak == simulate(g, s).peak
    s.ops[-1] = ("compute", 0)  # changed in place: the ops are compared by content, not by the list
    assert schedule.simulated(g, s).recomputes == 1
    other = chain(5, mem=10, fixed_mem=100)
    with pytest.raises(ScheduleError):  # another graph's check, not this one's result
        schedule.simulated(other, none_schedule(g))
