"""SimResult.residency, the simulator's per-step live set: the bytes of the nodes live after each op plus
the fixed memory are the timeline, under recomputation, in-place writes (rule 8) and offloads (rule 9)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bonsai_core import solvers
from bonsai_core.costmodel import PROFILES
from bonsai_core.fsdp import with_fsdp, working_profile
from bonsai_core.graph import Graph
from bonsai_core.offload import offloadable, with_offloads
from bonsai_core.regions import block_stack
from bonsai_core.schedule import COMPUTE, FREE, Schedule, SimResult, no_remat_peak, none_schedule, simulate
from explorer.state import DEFAULT_GRAPH
from tests.graphs import chain
from tests.test_inplace import _toy
from tests.test_offload import BACKWARD_TO_B1, FORWARD, LAST, M, cpu


@pytest.fixture(scope="module")
def gpt() -> Graph:
    return Graph.from_dict(json.loads(DEFAULT_GRAPH.read_text()))


def assert_live_sets_add_up(graph: Graph, sim: SimResult, ops: list[tuple[str, int]]) -> None:
    """At every op the live nodes' bytes plus the fixed memory (and FSDP's working memory) are the timeline."""
    beyond = graph.fixed_mem + (working_profile(graph, ops) if graph.fsdp is not None else 0)
    assert np.array_equal(sim.residency.bytes_held(graph.mem) + beyond, sim.timeline)
    for i in range(len(ops)):
        assert int(graph.mem[sim.residency.live_at(i)].sum()) + np.broadcast_to(beyond, len(ops))[i] == sim.timeline[i], i


def test_the_live_set_follows_computes_and_frees_and_marks_recomputed_copies():
    g = chain(2)  # f0 f1 b1 b0
    ops = [(COMPUTE, 0), (COMPUTE, 1), (FREE, 0), (COMPUTE, 2), (FREE, 1), (COMPUTE, 0), (COMPUTE, 3),
           (FREE, 0), (FREE, 2), (FREE, 3)]
    sim = simulate(g, ops)
    r = sim.residency
    assert r.node.tolist() == [0, 1, 2, 0, 3] and r.start.tolist() == [0, 1, 3, 5, 6]
    assert r.end.tolist() == [2, 4, 8, 7, 9] and r.recomputed.tolist() == [False, False, False, True, False]
    assert r.live_at(3).tolist() == [1, 2] and r.live_at(6).tolist() == [0, 2, 3] and r.live_at(9).tolist() == []
    assert_live_sets_add_up(g, sim, ops)


def test_an_input_written_in_place_leaves_the_live_set_at_the_write():
    g = _toy()
    ops = none_schedule(g).ops
    at_r = ops.index((COMPUTE, 2))
    sim = simulate(g, ops)
    assert 1 not in sim.residency.live_at(at_r) and 2 in sim.residency.live_at(at_r)
    assert_live_sets_add_up(g, sim, ops)


def test_an_offloaded_node_stays_live_until_its_copy_ends_and_comes_back_with_its_reload():
    ops = [*FORWARD, *BACKWARD_TO_B1, ("reload", 0), *LAST]
    sim = simulate(chain(3, mem=M), cpu(ops))
    r = sim.residency
    assert 0 in r.live_at(4) and 0 not in r.live_at(5)  # freed at op 3, its copy ends before b2 (op 5)
    reload = ops.index(("reload", 0))
    assert r.start[r.node == 0].tolist() == [0, reload] and not r.recomputed.any()
    assert_live_sets_add_up(chain(3, mem=M), sim, ops)


def test_the_live_set_adds_up_on_traced_schedules(gpt):
    budget = int(0.6 * no_remat_peak(gpt))
    link = PROFILES["h100"].host_link_bytes_per_s
    offloaded = with_offloads(gpt, none_schedule(gpt).ops, np.flatnonzero(offloadable(gpt)), link)
    for ops in (none_schedule(gpt).ops, solvers.solve(gpt, budget, method="chen").ops,
                solvers.solve(gpt, budget, method="dtr").ops, offloaded):
        sim = simulate(gpt, Schedule(graph=gpt.name, method="test", ops=ops, host_budget=2**40))
        assert_live_sets_add_up(gpt, sim, ops)


def test_fsdp_working_memory_is_outside_the_live_set(gpt):
    sharded = with_fsdp(gpt, 2, [(path, first, last, 2**20) for path, first, last in block_stack(gpt)], 2**20)
    ops = none_schedule(sharded).ops
    sim = simulate(sharded, ops)
    assert working_profile(sharded, ops).any()
    assert_live_sets_add_up(sharded, sim, ops)
