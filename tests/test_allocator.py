"""The address-level allocator model: PyTorch caching-allocator rules, the arena, and replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bonsai_core.allocator import (LARGE_BUFFER, SMALL_BUFFER, Allocator, fragmentation_at_peak, replay,
                                   round_size, segment_size)
from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph, load_graph
from bonsai_core.schedule import none_schedule, simulate
from tests.graphs import chain

MiB = 2**20


def test_sizes_round_up_to_512_bytes():
    assert [round_size(b) for b in (1, 511, 512, 513, 1024)] == [512, 512, 512, 1024, 1024]


def test_segment_sizes_follow_the_caching_allocator():
    assert segment_size(512) == SMALL_BUFFER
    assert segment_size(MiB) == SMALL_BUFFER
    assert segment_size(MiB + 512) == LARGE_BUFFER
    assert segment_size(11 * MiB) == 12 * MiB  # rounded up to 2 MiB


def test_small_requests_share_one_small_segment_and_split_it():
    a = Allocator()
    b0, b1 = a.malloc(0, 1000), a.malloc(1, 1000)
    assert a.reserved == SMALL_BUFFER and len(a.heads) == 1
    assert (b0.addr, b0.size, b1.addr) == (0, 1024, 1024)


def test_large_block_is_not_split_when_less_than_1mib_would_remain():
    a = Allocator()
    a.malloc(0, 19 * MiB + MiB // 2)  # 20 MiB segment, 0.5 MiB left: not split
    assert a.by_owner[0].size == LARGE_BUFFER and a.largest_free == 0
    a2 = Allocator()
    a2.malloc(0, 2 * MiB)  # 18 MiB left: split
    assert a2.by_owner[0].size == 2 * MiB and a2.largest_free == 18 * MiB


def test_best_fit_takes_the_smallest_free_block_that_fits():
    a = Allocator()
    for i, size in enumerate((4096, 512, 2048, 512, 8192, 512)):
        a.malloc(i, size)
    a.free(0)  # 4096 B hole at 0
    a.free(2)  # 2048 B hole
    assert a.malloc(9, 2000).addr == a.by_owner[1].addr + 512  # the 2048 B hole, not the 4096 B one


def test_free_merges_neighbours_and_reuses_the_hole():
    a = Allocator()
    for i in range(3):
        a.malloc(i, 512)
    a.free(0)
    a.free(1)
    assert a.largest_free == SMALL_BUFFER - 3 * 512 and len(a.free_blocks["small"]) == 2
    assert a.malloc(5, 1024).addr == 0  # the merged 1024 B hole at the bottom


def test_segments_are_never_merged_so_a_hole_spanning_them_is_useless():
    a = Allocator()
    a.malloc(0, 2 * MiB)
    a.malloc(1, 15 * MiB)  # both in one 20 MiB segment; 3 MiB left, split
    a.malloc(2, 12 * MiB)  # own 12 MiB segment
    a.free(1)
    a.free(2)
    # 18 MiB free in the first segment and 12 MiB in the second, but not 25 MiB contiguous
    assert a.largest_free == 18 * MiB
    reserved = a.reserved
    a.malloc(3, 25 * MiB)
    assert a.reserved == reserved + 26 * MiB


def test_capacity_stops_segment_growth():
    a = Allocator(capacity=LARGE_BUFFER)
    assert a.malloc(0, 2 * MiB) is not None
    assert a.malloc(1, 19 * MiB) is None  # would need a second segment


def test_arena_places_right_side_requests_at_the_top():
    a = Allocator(capacity=10 * 4096, policy="arena")
    left = a.malloc(0, 4096, side="left")
    right = a.malloc(1, 4096, side="right")
    assert left.addr == 0 and right.addr + right.size == 10 * 4096
    assert a.footprint == 10 * 4096  # the high-water mark reached the top
    assert [b.owner for b in a.blocks()] == [0, -1, 1]


def test_fragmentation_is_measured_on_the_reserved_plateau():
    live = np.array([10, 40, 30, 60, 20])
    reserved = np.array([50, 100, 100, 100, 100])
    assert fragmentation_at_peak(live, reserved) == pytest.approx(0.4)


def _graph_with_sizes(sizes: list[int], fixed: int = 0) -> Graph:
    nodes = [dict(name=f"f{i}", op="f", phase="forward", cost=1.0, mem=s, deps=[i - 1] if i else [])
             for i, s in enumerate(sizes)]
    return Graph.from_nodes("sizes", fixed, nodes)


def test_replay_live_equals_the_simulator_timeline_and_reserved_covers_it():
    g = chain(6, mem=3 * MiB, fixed_mem=1000)
    r = replay(g, none_schedule(g))
    sim = simulate(g, none_schedule(g))
    assert np.array_equal(r.live, sim.timeline) and r.peak == sim.peak
    assert np.all(r.reserved >= r.live) and r.reserved_peak == r.reserved.max()
    assert np.all(np.diff(r.reserved) >= 0)  # nothing is released back
    assert r.stats()["reserved_peak"] == r.reserved_peak and 0 <= r.fragmentation < 1


def test_views_allocate_nothing():
    nodes = [dict(name="a", op="f", phase="forward", cost=1.0, mem=MiB, deps=[]),
             dict(name="v", op="view", phase="forward", cost=0.0, mem=0, deps=[0], alias_of=0),
             dict(name="b", op="f", phase="forward", cost=1.0, mem=512, deps=[1])]
    g = Graph.from_nodes("views", 0, nodes)
    r = replay(g, none_schedule(g))
    assert r.reserved_peak == SMALL_BUFFER  # a 1 MiB block and a 512 B block in one small segment


def test_growing_sizes_fragment_the_caching_allocator():
    # 2, 6 and 12 MiB fill one 20 MiB segment; the 24 MiB request fits in none of their freed
    # blocks and reserves its own: 44 MiB reserved for at most 36 MiB live
    g = _graph_with_sizes([2 * MiB, 6 * MiB, 12 * MiB, 24 * MiB])
    r = replay(g, none_schedule(g))
    assert (r.peak, r.reserved_peak, r.segments) == (36 * MiB, 44 * MiB, 2)
    assert r.fragmentation == pytest.approx(1 - 36 / 44)


def test_replay_under_a_too_small_capacity_raises_budget_error():
    g = _graph_with_sizes([12 * MiB, 12 * MiB])
    with pytest.raises(BudgetError, match="runs out"):
        replay(g, none_schedule(g), capacity=20 * MiB)


def test_arena_replay_reports_the_high_water_mark():
    g = chain(4, mem=4096)
    r = replay(g, none_schedule(g), capacity=10 * MiB, policy="arena")
    assert r.reserved_peak == r.peak  # a chain's frees leave no holes below the top in best fit


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5 * MiB), min_size=2, max_size=12), st.randoms(use_true_random=False))
def test_blocks_never_overlap_and_tile_each_segment(sizes, rnd):
    a = Allocator()
    live = []
    for i, s in enumerate(sizes):
        a.malloc(i, s)
        live.append(i)
        if rnd.random() < 0.5:
            a.free(live.pop(rnd.randrange(len(live))))
    for seg in a.segments():
        for x, y in zip(seg, seg[1:]):
            assert x.addr + x.size == y.addr  # contiguous, no overlap
            assert not (x.free and y.free)  # free neighbours are always merged
    assert a.allocated == sum(a.by_owner[o].size for o in live)
    assert a.reserved == sum(sum(b.size for b in seg) for seg in a.segments())


def test_cli_simulate_allocator_prints_reserved_peak(tmp_path, capsys):
    from bonsai_core.cli import main

    g = load_graph("assets/gpt-default.json")
    sched = tmp_path / "s.json"
    sched.write_text(json.dumps(none_schedule(g).to_dict()))
    assert main(["simulate", "assets/gpt-default.json", str(sched), "--allocator", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["reserved_peak"] >= stats["peak"] and 0 <= stats["fragmentation"] < 1


# -- the full arena -------------------------------------------------------------------------------

def _tiny_step(param_bytes: int = 4096, batch: int = 1024) -> Graph:
    """A forward op reading a param-less input, a loss, and two parameter-gradient outputs."""
    nodes = [dict(name="h", op="aten.mm.default", phase="forward", cost=1.0, mem=8192, deps=[]),
             dict(name="loss", op="f", phase="forward", cost=1.0, mem=512, deps=[0]),
             dict(name="g1", op="g", phase="backward", cost=1.0, mem=param_bytes, deps=[0, 1]),
             dict(name="g0", op="g", phase="backward", cost=1.0, mem=2 * param_bytes, deps=[0, 1])]
    return Graph.from_nodes("tiny-step", 2 * 3 * param_bytes + batch, nodes)


def test_fixed_tensors_are_derived_in_a_training_loops_order():
    from bonsai_core.allocator import fixed_tensors, optimizer_bytes

    g = _tiny_step()
    tensors = fixed_tensors(g, "adam")
    assert [t.kind for t in tensors] == ["param", "param", "grad", "grad", "batch"] + ["optimizer"] * 4
    assert [t.nbytes for t in tensors[:2]] == [8192, 4096]  # parameter order: reverse of backward's
    assert sum(t.nbytes for t in tensors if t.kind != "optimizer") == g.fixed_mem
    assert optimizer_bytes(tensors) == 2 * (8192 + 4096)
    assert optimizer_bytes(fixed_tensors(g, "sgd")) == 0


def test_full_arena_leaves_the_first_batch_as_a_hole_between_pinned_tensors():
    from bonsai_core.allocator import full_arena

    g = _tiny_step()
    alloc, extra = full_arena(g, capacity=g.fixed_mem + 64 * 1024, policy="arena")
    layout = [(b.owner >= g.n, b.size) for b in alloc.blocks()]
    # params + grads pinned at the bottom, the 1 KiB hole of step 1's batch, the Adam moments, the new batch
    assert layout[:5] == [(True, 8192), (True, 4096), (True, 8192), (True, 4096), (False, 1024)]
    assert all(pinned for pinned, _ in layout[5:10]) and extra == 2 * (8192 + 4096)
    assert alloc.pinned_bytes == g.fixed_mem + extra


def test_copy_on_write_updates_move_the_parameters_and_adam_state():
    """Coop's recomputable in-place keeps the optimizer's writes at their addresses; copy-on-write
    takes a new block for each parameter and moment before freeing the old one."""
    from bonsai_core.allocator import full_arena

    g = _tiny_step()
    capacity = g.fixed_mem + 64 * 1024

    def pinned(updates):
        alloc, extra = full_arena(g, capacity, policy="arena", updates=updates)
        return alloc, [(b.addr, b.size) for b in alloc.blocks() if b.owner >= g.n]

    (inplace, at), (copy, moved) = pinned("inplace"), pinned("copy")
    assert inplace.pinned_bytes == copy.pinned_bytes and sorted(s for _, s in at) == sorted(s for _, s in moved)
    params_and_state = {8192, 4096}
    assert at != moved and [a for a, s in at if s in params_and_state][:2] == [0, 8192]  # params first, in place
    assert copy.high_water > inplace.high_water  # each copy is taken while its original still lives
    with pytest.raises(ValueError, match="updates"):
        full_arena(g, capacity, policy="arena", updates="twice")


def test_full_arena_replay_counts_the_optimizer_state_as_live_and_reserved():
    from bonsai_core.allocator import fixed_tensors, optimizer_bytes

    g = _tiny_step()
    extra = optimizer_bytes(fixed_tensors(g))
    plain, full = replay(g, none_schedule(g), full=False), replay(g, none_schedule(g))
    assert full.peak == plain.peak + extra
    assert np.array_equal(full.live, plain.live + extra) and np.all(full.reserved >= full.live)
    arena = replay(g, none_schedule(g), capacity=g.fixed_mem + 64 * 1024, policy="arena", full=True)
    assert arena.reserved_peak >= arena.peak


@pytest.mark.slow
def test_traced_graphs_list_their_fixed_tensors():
    from bonsai_core.allocator import fixed_tensors, optimizer_bytes
    from bonsai_core.trace import trace_model

    g = trace_model("resnet", batch=2, image=16, layers=1).graph  # conv weight grads are not separate outputs
    kinds = [k for _, _, k in g.fixed_tensors]
    assert sum(b for _, b, _ in g.fixed_tensors) == g.fixed_mem
    assert kinds.index("grad") > max(i for i, k in enumerate(kinds) if k == "param")  # grads after params
    assert optimizer_bytes(fixed_tensors(g)) == 2 * sum(b for _, b, k in g.fixed_tensors if k == "grad")


def test_fixed_tensors_field_round_trips_and_old_graphs_still_load():
    import json

    from bonsai_core.allocator import fixed_tensors

    base = _tiny_step()
    g = Graph.from_nodes(base.name, base.fixed_mem, [base.node(v).__dict__ | {"deps": list(base.node(v).deps)}
                                                     for v in range(base.n)],
                         [["w", 4096, "param"], ["x", 2048, "input"], ["w.grad", 4096, "grad"],
                          ["c", base.fixed_mem - 10240, "constant"]])
    assert [t.kind for t in fixed_tensors(g)] == ["param", "batch", "grad", "constant", "optimizer", "optimizer"]
    data = g.to_dict()
    assert Graph.from_dict(json.loads(json.dumps(data))).fixed_tensors == g.fixed_tensors
    del data["fixed_tensors"]  # a graph written before the field existed
    assert Graph.from_dict(data).fixed_tensors == ()
    data["fixed_tensors"] = [["w", g.fixed_mem + 1, "param"]]
    with pytest.raises(Exception, match="add up to"):
        Graph.from_dict(data)


def test_address_figure_draws_every_block_at_its_address_by_kind():
    from bonsai_core.allocator import layout_at
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import none_schedule
    from explorer.plots import address_figure

    g = load_graph("assets/gpt-default.json")
    s = none_schedule(g)
    blocks = layout_at(g, s, len(s.ops) // 2)
    fig = address_figure(blocks)
    bars = {t.name: t for t in fig.data}
    assert {"parameters (pinned)", "gradients (pinned)", "optimizer state (pinned)",
            "activations (evictable)"} <= set(bars)
    assert sum(len(t.x) for t in fig.data) == len(blocks)
    act = [b for b in blocks if b.kind == "activation"]
    assert list(bars["activations (evictable)"].base) == [b.addr / 2**20 for b in act]


def test_memory_page_shows_the_address_space_at_the_chosen_op():
    from tests.test_app import app, goto, plot_spec

    at = goto(app(), "memory")
    assert not at.error
    assert len(at.get("plotly_chart")) == 0  # closed: not drawn on every budget change
    at.session_state["memory_address_open"] = True  # what opening the expander does
    at.run()
    spec = plot_spec(at)  # the address map: the page's Plotly chart (memory over time is Vega-Lite)
    names = {t["name"] for t in spec["data"]}
    assert {"parameters (pinned)", "optimizer state (pinned)", "activations (evictable)"} <= names
    at.slider(key="memory_address_op").set_value(0).run()
    assert not at.exception
    assert "after op 0" in plot_spec(at)["layout"]["title"]["text"]
    at.radio(key="memory_address_policy").set_value("arena").run()
    assert not at.exception


def test_release_and_retry_frees_cached_segments_when_the_capacity_is_reached():
    a = Allocator(capacity=24 * MiB)
    a.malloc(0, 12 * MiB)  # its own 12 MiB segment
    a.free(0)  # cached, holding nothing
    assert a.reserved == 12 * MiB
    assert a.malloc(1, 14 * MiB) is not None  # 12 + 14 > 24: the empty segment is released first
    assert a.reserved == 14 * MiB and len(list(a.segments())) == 1
    a.malloc(2, 4 * MiB)  # a 20 MiB segment would pass the capacity; nothing left to release
    assert a.malloc(3, 9 * MiB) is None


# -- expandable segments --------------------------------------------------------------------------

def test_expandable_segments_grow_a_freed_run_by_the_missing_pages_only():
    def reserved_after(policy: str) -> int:
        a = Allocator(policy=policy)
        for owner, size in enumerate((2 * MiB, 6 * MiB, 12 * MiB)):
            a.malloc(owner, size)
        for owner in range(3):
            a.free(owner)
        a.malloc(3, 24 * MiB)
        return a.reserved

    # caching: the freed 20 MiB segment cannot serve 24 MiB, a second segment of 24 MiB is reserved;
    # expandable: the freed run at the segment's end grows by one 20 MiB page
    assert (reserved_after("caching"), reserved_after("expandable")) == (44 * MiB, 40 * MiB)


def test_expandable_segments_cannot_join_a_free_run_across_a_held_block():
    # the none schedule keeps the 12 MiB block while the 24 MiB one is computed: the free 8 MiB below
    # it is not next to unmapped space, so 24 MiB takes two new pages (60 MiB; caching reserves 44)
    g = _graph_with_sizes([2 * MiB, 6 * MiB, 12 * MiB, 24 * MiB])
    r = replay(g, none_schedule(g), policy="expandable", full=False)
    assert (r.peak, r.reserved_peak, r.segments) == (36 * MiB, 60 * MiB, 1)


def test_expandable_segments_map_small_requests_in_2_mib_pages():
    a = Allocator(policy="expandable")
    a.malloc(0, 100)
    a.malloc(1, 3 * MiB)
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER  # one page of each pool


def test_expandable_segments_unmap_free_pages_to_serve_a_request_within_the_capacity():
    a = Allocator(capacity=40 * MiB, policy="expandable")
    a.malloc(0, 30 * MiB)  # two 20 MiB pages
    a.malloc(1, 8 * MiB)  # fits in the second page's rest
    a.free(0)
    # 30 MiB is free at [0, 30): the page [0, 20) lies wholly inside it and is unmapped on a miss
    assert a.malloc(2, 32 * MiB) is None  # would need two pages more: 80 MiB > 40 MiB even after unmapping
    assert a.reserved == 20 * MiB and a.release_cached() == 0
    assert a.malloc(3, 12 * MiB) is not None  # maps [0, 20) again
    assert a.reserved == 40 * MiB


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 45 * MiB), min_size=2, max_size=14), st.randoms(use_true_random=False))
def test_expandable_blocks_tile_the_segment_and_reserved_counts_mapped_pages(sizes, rnd):
    a = Allocator(policy="expandable")
    live = []
    for i, s in enumerate(sizes):
        assert a.malloc(i, s) is not None
        live.append(i)
        if rnd.random() < 0.5:
            a.free(live.pop(rnd.randrange(len(live))))
        if rnd.random() < 0.3:
            a.release_cached()
    mapped = 0
    for seg in a.segments():
        for x, y in zip(seg, seg[1:]):
            assert x.addr + x.size == y.addr
            assert not (x.usable and y.usable) and (x.mapped or y.mapped)  # merged neighbours
        mapped += sum(b.size for b in seg if b.mapped)
        assert all(b.mapped for b in seg if not b.free)
    assert a.reserved == mapped
    assert a.allocated == sum(a.by_owner[o].size for o in live) <= a.reserved


# -- budgeting reserved bytes ---------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["caching", "expandable"])
def test_solve_reserved_bounds_the_allocator_models_reserved_peak(policy):
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve_reserved

    g = load_graph("assets/gpt-default.json")
    budget = int(no_remat_peak(g) * 1.2)
    s = solve_reserved(g, budget, "chen", policy=policy)
    r = replay(g, s, policy=policy, full=False)
    assert r.reserved_peak == s.stats["reserved_peak"] <= budget == s.budget
    assert s.stats["live_budget"] <= budget and s.stats["allocator"] == policy


def test_solve_reserved_names_its_lowest_reserved_peak_when_the_budget_cannot_be_met():
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve_reserved

    g = load_graph("assets/gpt-default.json")
    with pytest.raises(BudgetError, match="lowest reserved peak"):
        solve_reserved(g, int(no_remat_peak(g) * 0.6), "chen")


def test_solve_reserved_shares_one_time_limit_and_asks_below_each_plans_peak(monkeypatch):
    """``--time-limit`` bounds the whole reserved call: each live-budget solve gets half of what the earlier left.
    Each next live budget is below the last plan's live peak: bonsai answers a budget its last plan
    meets with that plan again (reused), which would reserve as much (the torchtitan 8B step at batch 1
    stayed 672 KB over 80 GiB for 12 solves)."""
    import bonsai_core.solvers as solvers
    from bonsai_core.schedule import no_remat_peak

    g = load_graph("assets/gpt-default.json")
    asked, real_solve = [], solvers.solve

    def recorded(graph, budget, method, **options):
        schedule = real_solve(graph, budget, method, **options)
        asked.append((options["time_limit"], budget, schedule.stats["peak"]))
        return schedule

    monkeypatch.setattr(solvers, "solve", recorded)
    s = solvers.solve_reserved(g, int(no_remat_peak(g) * 1.1), "bonsai", policy="caching", time_limit=60)
    assert s.stats["reserved_solves"] == len(asked) >= 2  # the first live budget reserves too much
    limits, budgets, peaks = zip(*asked)
    assert limits[0] <= 30 and all(later < earlier for earlier, later in zip(limits, limits[1:]))
    assert all(later < peak for peak, later in zip(peaks, budgets[1:]))
    assert 60 - 2 * limits[-1] <= s.stats["wall_seconds"] <= 60


def test_cli_expandable_segments_needs_the_allocator_it_models(tmp_path, capsys):
    from bonsai_core.cli import main

    g = "assets/gpt-default.json"
    assert main(["solve", g, "--budget", "90%", "--expandable-segments", "-o", str(tmp_path / "s.json")]) == 1
    assert "--reserved" in capsys.readouterr().err
    assert main(["solve", g, "--budget", "130%", "--reserved", "--expandable-segments", "--method", "chen",
                 "-o", str(tmp_path / "s.json"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["allocator"] == "expandable" and stats["reserved_peak"] <= stats["budget"]
    assert main(["simulate", g, str(tmp_path / "s.json"), "--allocator", "--expandable-segments"]) == 0
    assert "expandable allocator: reserved peak" in capsys.readouterr().out


# -- streams, FSDP2's buffers and the optimizer step's temporaries

def test_a_block_freed_on_one_stream_is_not_reused_by_another_stream():
    """The caching allocator keeps free blocks per stream: a request on the reduce-scatter stream does not
    take the compute stream's cached block (it reserves a segment of its own), one on the compute stream
    does. With expandable segments each stream grows a segment of its own."""
    for policy in ("caching", "expandable"):
        a = Allocator(policy=policy)
        a.malloc(0, 30 * MiB)
        a.free(0)
        reserved = a.reserved
        a.malloc(1, 30 * MiB, stream="reduce_scatter")
        assert a.reserved >= reserved + 30 * MiB, policy
        again = a.reserved
        a.malloc(2, 30 * MiB)
        assert a.reserved == again, policy
        assert {a.pools[b.segment] for b in (a.by_owner[1], a.by_owner[2])} == {"large@reduce_scatter", "large"}


def test_replay_places_fsdp_buffers_on_their_streams_and_the_optimizer_step():
    """An FSDP rank's replay allocates the all-gather outputs on the copy-in stream and the reduce-scatter
    outputs on the reduce-scatter stream, holds the gradients FSDP holds, frees everything by the end, and
    reserves at least the optimizer step's bytes (AdamW's foreach temporaries after the last op)."""
    from bonsai_core.allocator import run_step
    from bonsai_core.optimizer import with_optimizer
    from bonsai_core.trace import trace_model

    graph = with_optimizer(trace_model("gpt", batch=1, seq=16, width=64, layers=2, heads=2, vocab=64, fsdp=2,
                                       mixed_precision="bf16").graph, "adamw")
    ops = none_schedule(graph).ops
    alloc = Allocator()
    run_step(alloc, graph, ops, simulate(graph, ops).residency, None)
    assert {"small@all_gather_copy_in", "small@reduce_scatter"} <= set(alloc.pools)
    assert alloc.allocated == 0 and not alloc.by_owner
    for policy in ("caching", "expandable"):
        result = replay(graph, none_schedule(graph), policy=policy, full=False)
        assert result.reserved_peak >= max(simulate(graph, none_schedule(graph)).peak, graph.optimizer_peak)


def test_a_pipeline_rank_replays_every_microbatch_in_its_schedule_s_order():
    """1F1B rank 0 of 2 with 2 microbatches of a chain f0 f1 b1 b0, every tensor 12 MiB (one 12-MiB segment
    each under the caching allocator): F0 F1 hold 4 tensors, B0's b1 a fifth, then its frees make room for
    its b0 and for B1. So 5 segments, 60 MiB, where one microbatch's step reserves 3; with expandable
    segments (20-MiB pages) 3 pages against 2."""
    from bonsai_core.parallel import layout_of, with_batch, with_layout
    from bonsai_core.in_flight import actions

    graph = chain(2, mem=12 * MiB)
    layout = with_batch(layout_of(pp=2, rank=0), 2, 64)
    pipeline = {"schedule": "1f1b", "degree": 2, "rank": 0, "microbatches": 2, "microbatch_size": 1,
                "stages": [[0, 0, graph.n - 1]], "actions": [list(a) for a in actions(layout)]}
    rank = with_layout(graph, layout, pipeline=pipeline)
    ops = none_schedule(rank).ops
    assert pipeline["actions"] == [["F", 0, 0], ["F", 0, 1], ["B", 0, 0], ["B", 0, 1]]
    caching = replay(rank, ops, full=False)
    # live after each op of F0 F1 (f0 f1 each), B0 B1 (b1, free f1, b0, free b0, b1, f0 each): 12 24 | 36 48 |
    # 60 48 60 48 36 24 | 36 24 36 24 12 0; per op of the schedule the most over its actions, rule 11's timeline
    assert list(caching.live // MiB) == [36, 48, 60, 48, 60, 48, 36, 24]
    assert np.array_equal(caching.live, simulate(rank, ops).timeline)
    assert caching.reserved_peak == 60 * MiB and caching.peak == 60 * MiB
    assert replay(graph, ops, full=False).reserved_peak == 36 * MiB
    assert replay(rank, ops, full=False, policy="expandable").reserved_peak == 60 * MiB
    assert replay(graph, ops, full=False, policy="expandable").reserved_peak == 40 * MiB


def test_solve_reserved_takes_the_live_solve_made_already_as_its_first_answer():
    """bonsai fit solves a fixed plan live first (to skip a method that cannot recompute less); the reserved solve
    starts from that answer: the same plan and reserved peak as solving again, and the same refusal."""
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve, solve_reserved

    g = load_graph("assets/gpt-default.json")
    budget = int(no_remat_peak(g) * 1.2)
    given_plan = solve_reserved(g, budget, "none", policy="expandable",
                                solved=solve(g, budget, "none"))
    again = solve_reserved(g, budget, "none", policy="expandable")
    assert given_plan.ops == again.ops and given_plan.stats["reserved_peak"] == again.stats["reserved_peak"]
    other = solve(g, int(no_remat_peak(g) * 0.8), "chen")  # the answer given is the one judged, not solved again
    assert solve_reserved(g, budget, "none", policy="expandable", solved=other).ops == other.ops != again.ops
    low = no_remat_peak(g) - 1
    with pytest.raises(BudgetError) as refused:
        solve(g, low, "none")
    with pytest.raises(BudgetError, match="found no schedule"):
        solve_reserved(g, low, "none", policy="expandable", solved=refused.value)
