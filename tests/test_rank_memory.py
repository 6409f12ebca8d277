"""What holds a rank's bytes (``bonsai_core.rank_memory``): the parts add up to the simulator's timeline and, at
the live peak, to the peak; which op the peak follows and which tensors hold it, grouped by phase and shape."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bonsai_core.fsdp import WORKING_PARTS, with_fsdp
from bonsai_core.graph import Graph
from bonsai_core.optimizer import with_optimizer
from bonsai_core.rank_memory import (UNLISTED, after_peak, at_peak, fixed_by_kind, held_at_peak, peak_at, tensors_held,
                                     working)
from bonsai_core.regions import block_stack
from bonsai_core.schedule import simulate
from bonsai_core.solvers import solve
from explorer.state import DEFAULT_GRAPH
from tests.graphs import chain


@pytest.fixture(scope="module")
def fsdp_rank() -> Graph:
    """The explorer's default graph as one of 2 FSDP ranks, with AdamW."""
    gpt = Graph.from_dict(json.loads(DEFAULT_GRAPH.read_text()))
    blocks = [(path, first, last, 2**20) for path, first, last in block_stack(gpt)]
    return with_optimizer(with_fsdp(gpt, 2, blocks, 2**20), "adamw")


@pytest.mark.parametrize("method", ["none", "chen"])
def test_an_fsdp_ranks_parts_add_up_to_the_timeline_and_at_the_peak_to_the_peak(fsdp_rank, method):
    schedule = solve(fsdp_rank, None, method)
    sim = simulate(fsdp_rank, schedule)
    beyond = working(fsdp_rank, schedule.ops, sim)
    assert list(beyond) == list(WORKING_PARTS) and beyond["all-gathered blocks"].any()
    assert np.array_equal(sum(fixed_by_kind(fsdp_rank).values()) + sum(beyond.values())
                          + sum(tensors_held(fsdp_rank, sim)), sim.timeline)
    held = at_peak(fsdp_rank, schedule.ops, sim)
    assert "optimizer" in held.fixed and held.optimizer_step == 0
    assert sum(held.fixed.values()) + sum(held.working.values()) + held.forward + held.backward == sim.peak


def test_where_the_optimizer_step_holds_the_peak_it_is_the_one_part_beside_the_fixed_tensors():
    graph = with_optimizer(chain(3, mem=10).with_fields(fixed_tensors=[["w", 100, "param"], ["w.grad", 100, "grad"]],
                                                        fixed_mem=200), "adamw")
    schedule = solve(graph, None, "none")
    sim = simulate(graph, schedule)
    held = at_peak(graph, schedule.ops, sim)
    assert sim.peak == graph.optimizer_peak > sim.timeline.max()
    assert held.fixed == {"param": 100, "grad": 100, "optimizer": 200}
    assert (held.working, held.forward, held.backward) == ({}, 0, 0)
    assert sum(held.fixed.values()) + held.optimizer_step == sim.peak
    assert peak_at(graph, schedule.ops, sim) == "the optimizer step"


def test_a_graph_listing_no_fixed_tensors_holds_its_fixed_bytes_as_one_unlisted_part():
    assert fixed_by_kind(chain(2, fixed_mem=7)) == {UNLISTED: 7}
    assert fixed_by_kind(chain(2)) == {}


def test_a_chains_peak_is_its_first_backward_op_holding_every_forward_tensor():
    graph = chain(3, mem=10)
    schedule = solve(graph, None, "none")
    sim = simulate(graph, schedule)
    assert peak_at(graph, schedule.ops, sim).startswith("backward `b` (node b")
    held = held_at_peak(graph, sim)
    forward = next(g for g in held if g["phase"] == "forward")
    assert (forward["count"], forward["bytes"], forward["ops"]) == (3, 30, ["f"])
    assert sum(g["bytes"] for g in held) == sim.peak - graph.fixed_mem


def test_held_groups_are_the_largest_first_and_at_most_the_number_asked():
    graph = chain(4, mem=10)
    schedule = solve(graph, None, "none")
    sim = simulate(graph, schedule)
    held = held_at_peak(graph, sim, largest=1)
    assert len(held) == 1 and held[0]["phase"] == "forward" and held[0]["bytes"] == 40


def test_a_peak_at_a_nodes_second_compute_is_named_its_recompute():
    graph = chain(2, mem=10)
    ops = [("compute", 0), ("compute", 1), ("free", 0), ("compute", 2), ("compute", 0), ("compute", 3)]
    assert peak_at(graph, ops, SimpleNamespace(peak_op=4, peak=30)) == "forward `f` (node f0, its recompute)"
    assert peak_at(graph, ops, SimpleNamespace(peak_op=3, peak=30)) == "backward `b` (node b1, its compute)"


def test_after_the_backward_tensors_held_at_a_chains_peak_are_freed_it_holds_one_tensor_less():
    graph = chain(3, mem=10)  # peak 40 at b2 (f0, f1, f2, b2), again at b1 while b2 lives; after b2: 30
    sim = simulate(graph, solve(graph, None, "none"))
    assert (sim.peak, after_peak(graph, sim)) == (40, 30)
