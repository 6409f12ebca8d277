"""The heuristic methods: chen (√n / greedy checkpointing), dtr and coop (dynamic rematerialization)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings, strategies as st

from bonsai_core.allocator import Allocator, fixed_tensors, fragmentation_at_peak, optimizer_bytes, replay
from bonsai_core.solvers.coop import cost_density_sides, op_type_sides
from bonsai_core.solvers.pool import pool_replay
from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph, load_graph
from bonsai_core.regions import CheckpointPlan
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import solve
from bonsai_core.solvers.chen import forward_articulation_points, greedy_cuts, plan_from_cuts, sqrt_cuts
from bonsai_core.solvers.coop import coop_policy, min_cost_window
from bonsai_core.solvers.dtr import dtr_policy
from bonsai_core.solvers.eviction import Runtime
from tests.graphs import chain


@pytest.fixture(scope="module")
def gpt() -> Graph:
    return load_graph("assets/gpt-default.json")


# -- chen -------------------------------------------------------------------------------------------

def test_every_inner_chain_node_is_an_articulation_point():
    assert forward_articulation_points(chain(6)) == [1, 2, 3, 4]


def test_sqrt_cuts_split_a_chain_into_about_sqrt_n_segments():
    g = chain(16)
    plan = plan_from_cuts(g, sqrt_cuts(g))
    assert len(plan.segments) == 4
    assert plan.recomputed == frozenset({0, 1, 2})  # all but the last


def test_greedy_cuts_balance_bytes_not_op_counts():
    nodes = [dict(name=f"f{i}", op="f", phase="forward", cost=1.0, mem=m, deps=[i - 1] if i else [])
             for i, m in enumerate([100, 1, 1, 1, 100, 1, 1, 1])]
    g = Graph.from_nodes("uneven", 0, nodes)
    # the running sum passes 100 bytes at f1 (101) and again at f4 (1 + 1 + 100): equal bytes, not ops
    assert greedy_cuts(g, 100) == [1, 4]


def test_chen_without_budget_lowers_the_peak_of_a_long_chain():
    g = chain(16)
    s = solve(g, None, "chen")
    assert s.stats["peak"] < no_remat_peak(g) and s.stats["overhead"] > 0
    assert CheckpointPlan.from_extra(s.extra).segments  # exported like any checkpoint plan


def test_chen_picks_the_cheapest_plan_that_fits_the_budget():
    g = chain(16)
    full = no_remat_peak(g)
    assert solve(g, full, "chen").stats["overhead"] == 0  # one segment, nothing recomputed
    s = solve(g, int(full * 0.6), "chen")
    assert s.stats["peak"] <= full * 0.6 and s.stats["overhead"] > 0


def test_chen_simulates_only_plans_cheaper_than_one_that_fits_and_returns_what_trying_them_all_returns(gpt):
    from bonsai_core.regions import plan_schedule
    from bonsai_core.solvers.chen import candidate_plans, solve_chen

    plans = [(label, plan_schedule(gpt, plan, "chen")) for label, plan in candidate_plans(gpt, "auto")]
    sims = [(simulate(gpt, schedule), i) for i, (_, schedule) in enumerate(plans)]
    for share in (0.55, 0.6, 0.7, 0.8, 0.9):
        budget = int(no_remat_peak(gpt) * share)
        fitting = [((sim.compute_cost, sim.peak, i), i) for sim, i in sims if sim.feasible(budget)]
        label, schedule = plans[min(fitting)[1]]
        found = solve_chen(gpt, budget)
        assert (found.stats["plan"], found.ops) == (label, schedule.ops)
        assert found.stats["plans_tried"] < len(plans)  # those that cost more than one that fits: not simulated


def test_chen_names_the_smallest_budget_it_can_meet(gpt):
    with pytest.raises(BudgetError, match=r"lowest peak of its \d+ plans is .* \((\d+) bytes\)") as e:
        solve(gpt, int(no_remat_peak(gpt) * 0.45), "chen")
    smallest = int(str(e.value).split("(")[-2].split(" bytes")[0])
    assert solve(gpt, smallest, "chen").stats["peak"] == smallest


# -- dtr --------------------------------------------------------------------------------------------

def test_dtr_without_pressure_recomputes_nothing():
    g = chain(8)
    s = solve(g, None, "dtr")
    assert s.stats["recomputes"] == 0 and s.stats["peak"] == no_remat_peak(g)


@pytest.mark.parametrize("heuristic", ["dtr", "dtr_eq", "local", "lru", "size"])
def test_dtr_fits_a_chain_in_a_third_of_its_peak_by_recomputing(heuristic):
    g = chain(12)
    budget = no_remat_peak(g) // 3
    s = solve(g, budget, "dtr", heuristic=heuristic)
    assert s.stats["peak"] <= budget and s.stats["recomputes"] > 0 and s.stats["evictions"] > 0


def _leaves_then_reader(costs: list[float], size: int = 4096, request: int | None = None) -> Graph:
    """Leaves f_i (given costs) and a node x that reads none of them, then one backward reader of all."""
    nodes = [dict(name=f"f{i}", op="f", phase="forward", cost=c, mem=size, deps=[]) for i, c in enumerate(costs)]
    nodes.append(dict(name="x", op="x", phase="forward", cost=1.0, mem=request or size, deps=[]))
    nodes.append(dict(name="b", op="b", phase="backward", cost=1.0, mem=512, deps=list(range(len(costs) + 1))))
    return Graph.from_nodes("leaves", 0, nodes)


def _run_until_x(g: Graph, rt: Runtime, policy) -> None:
    for v in range(g.n - 2):
        rt.compute(v, policy)


def test_dtr_evicts_the_tensor_of_lowest_cost_per_byte_and_staleness():
    g = _leaves_then_reader([1.0, 5.0, 0.1, 5.0])
    rt = Runtime(g, budget=4 * 4096)
    policy = dtr_policy("local")
    _run_until_x(g, rt, policy)
    rt.make_room(g.n - 2, policy)  # x needs one more 4096-byte slot
    assert [v for k, v in rt.ops if k == "free"] == [2]  # h = 0.1 / 5 s, below f0's 1 / 10.1 s


def test_estar_adds_each_adjacent_evicted_component_once():
    g = chain(5)
    rt = Runtime(g, budget=None)
    for v in range(5):
        rt.compute(v, dtr_policy())
    rt.evict(1)
    rt.evict(3)
    for exact in (True, False):
        assert rt.estar_cost(2, exact) == pytest.approx(3.0)  # itself + f1 (input) + f3 (user)
        assert rt.estar_cost(4, exact) == pytest.approx(2.0)  # itself + f3 to rebuild it


def _diamonds(depth: int) -> Graph:
    """a0 -> (b0, c0) -> a1 -> (b1, c1) -> a2 ...: 2**depth paths from a0 to the last node."""
    nodes = [dict(name="a0", op="f", phase="forward", cost=1.0, mem=512, deps=[])]
    for i in range(depth):
        a = len(nodes) - 1
        nodes += [dict(name=f"b{i}", op="f", phase="forward", cost=1.0, mem=512, deps=[a]),
                  dict(name=f"c{i}", op="f", phase="forward", cost=1.0, mem=512, deps=[a]),
                  dict(name=f"a{i + 1}", op="f", phase="forward", cost=1.0, mem=512, deps=[a + 1, a + 2])]
    return Graph.from_nodes("diamonds", 0, nodes)


def test_estar_of_a_deep_diamond_counts_every_evicted_ancestor_once():
    # summing rebuild costs per path would charge a0 2**40 times; e* is the component's cost
    depth = 40
    g = _diamonds(depth)
    rt = Runtime(g, budget=None)
    for v in range(g.n):
        rt.compute(v, dtr_policy())
    for v in range(g.n - 1):
        rt.evict(v)
    for exact in (True, False):
        assert rt.estar_cost(g.n - 1, exact) == pytest.approx(float(g.n))


def test_union_find_classes_stay_merged_after_a_rebuild_but_lose_its_cost():
    g = chain(5)
    rt = Runtime(g, budget=None)
    for v in range(5):
        rt.compute(v, dtr_policy())
    for v in (1, 2, 3):
        rt.evict(v)
    rt.compute(2, dtr_policy())  # f1 and f3 are no longer connected through evicted tensors
    assert rt.estar_cost(4, exact=True) == pytest.approx(2.0)  # f4 + f3
    assert rt.estar_cost(4, exact=False) == pytest.approx(3.0)  # f4 + {f1, f3}: DTR's over-approximation


def test_banishing_locks_the_users_it_leaves_unrebuildable():
    g = chain(4)
    rt = Runtime(g, budget=None, deallocation="banish")
    rt.run(dtr_policy())
    assert all(rt.banished[v] for v in range(3))  # every input freed for good after its last read
    rt2 = Runtime(g, budget=None, deallocation="banish")
    policy = dtr_policy()
    for v in range(2):
        rt2.compute(v, policy)
    rt2.uses_left[0] = 0
    rt2.release(0)
    assert rt2.banished[0] and rt2.locked[1] and not rt2.evictable(1)


def test_dtr_under_the_allocator_keeps_evicting_until_one_block_fits():
    # f0..f3 fill the pool; x needs two adjacent slots; the lowest-h tensors are not neighbours
    g = _leaves_then_reader([1.0, 10.0, 1.0, 10.0], request=8192)
    rt = Runtime(g, budget=4 * 4096, allocator=Allocator(4 * 4096, "arena"))
    policy = dtr_policy("local")
    _run_until_x(g, rt, policy)
    rt.make_room(g.n - 2, policy)
    evicted = [v for k, v in rt.ops if k == "free"]
    assert len(evicted) == 3 and set(evicted[:2]) == {0, 2}  # two scattered frees fit nothing


def test_coop_evicts_one_contiguous_window_instead():
    g = _leaves_then_reader([1.0, 10.0, 1.0, 10.0], request=8192)
    rt = Runtime(g, budget=4 * 4096, allocator=Allocator(4 * 4096, "arena"))
    policy = coop_policy("recompute")
    _run_until_x(g, rt, policy)
    rt.make_room(g.n - 2, policy)
    evicted = sorted(v for k, v in rt.ops if k == "free")
    assert len(evicted) == 2 and evicted in ([0, 1], [1, 2], [2, 3])
    assert sum(g.cost[evicted]) == 11.0


def test_the_free_share_after_eviction_counts_what_scattered_evictions_leave_unused():
    # OneFlow's memory fragmentation rate: the pool's free share once the search has made room. A full
    # pool of four slots, a request of two: DTR's two scattered frees fit nothing and a third follows (3 of
    # 4 slots free, one the request will not use), coop's window frees exactly two adjacent slots
    g = _leaves_then_reader([1.0, 10.0, 1.0, 10.0], request=8192)
    after = {}
    for name, policy in (("dtr", dtr_policy("local")), ("coop", coop_policy("recompute"))):
        rt = Runtime(g, budget=4 * 4096, allocator=Allocator(4 * 4096, "arena"))
        _run_until_x(g, rt, policy)
        rt.make_room(g.n - 2, policy)
        assert rt.free_at_failure == [0.0]
        after[name] = rt.free_after_eviction
    assert after == {"dtr": [0.75], "coop": [0.5]}


def test_dte_scores_the_free_range_an_eviction_leaves():
    # f0..f3 fill a 5-slot pool; f1 and f3 are then freed: f0 (cost 1.2, staleness 21) borders one free
    # slot, f2 (cost 1, staleness 10) one free slot below and two above; x needs three slots
    g = _leaves_then_reader([1.2, 10.0, 1.0, 10.0], request=3 * 4096)
    first = {}
    for heuristic in ("dtr", "dte"):
        rt = Runtime(g, budget=5 * 4096, allocator=Allocator(5 * 4096, "arena"))
        policy = dtr_policy(heuristic)
        _run_until_x(g, rt, policy)
        for t in (1, 3):
            rt._free(t)
        rt.make_room(g.n - 2, policy)
        first[heuristic] = [v for k, v in rt.ops if k == "free"][2:]
    # h_DTR: 1.2 / (4096 * 21) < 1 / (4096 * 10), so f0 goes first, frees a range too small, and f2 follows;
    # DTE: 1.2 / (8192 * 21) > 1 / (16384 * 10): f2 alone leaves the range x needs
    assert first == {"dtr": [0, 2], "dte": [2]}
    with pytest.raises(SolverError, match="allocator=True"):
        solve(g, 16 * 4096, "dtr", heuristic="dte")


def test_the_event_log_lists_each_request_and_its_evictions(gpt):
    s = solve(gpt, int(0.7 * no_remat_peak(gpt)), "coop")
    log = s.extra["evictions"]
    assert len(log) == s.stats["alloc_failures"] and sum(len(ev) for _, _, ev in log) == s.stats["evictions"]
    for op, v, evicted in log:
        # the request's frees come right before the compute of the node that needed room
        assert s.ops[op: op + len(evicted)] == [("free", t) for t in evicted]
        assert s.ops[op + len(evicted)] == ("compute", v)


def test_min_cost_window_skips_pinned_blocks():
    inf = math.inf
    assert min_cost_window([4, 4, 4, 4], [0.0, inf, 1.0, 1.0], 8) == (2, 4, 2.0)
    assert min_cost_window([4, 4, 4], [0.0, inf, 0.0], 8) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.one_of(st.just(math.inf), st.floats(0, 10))), min_size=1,
                max_size=10), st.integers(1, 20))
def test_min_cost_window_matches_brute_force(blocks, request):
    sizes, costs = [b[0] for b in blocks], [b[1] for b in blocks]
    brute = min((sum(costs[i:j]) for i in range(len(blocks)) for j in range(i + 1, len(blocks) + 1)
                 if sum(sizes[i:j]) >= request and not any(map(math.isinf, costs[i:j]))), default=None)
    found = min_cost_window(sizes, costs, request)
    assert (found is None) == (brute is None)
    if found is not None:
        i, j, cost = found
        assert sum(sizes[i:j]) >= request and cost == pytest.approx(brute, abs=1e-9)


def test_cheap_tensor_partitioning_sends_cheap_per_byte_tensors_left():
    g = _leaves_then_reader([1.0, 10.0, 2.0, 20.0])
    side = cost_density_sides(g)
    assert [side(v) for v in range(4)] == ["left", "right", "left", "right"]


def test_op_type_partitioning_sends_matmul_and_conv_outputs_right(gpt):
    side = op_type_sides(gpt)
    for v in range(gpt.n):
        # "aten.mm.default" -> "mm"; a graph's own "getitem" nodes (outputs of multi-output ops) are no kernel
        expensive = gpt.ops[v].split(".")[1:2] in (["mm"], ["addmm"], ["bmm"], ["convolution"], ["convolution_backward"])
        assert (side(v) == "right") == expensive, gpt.ops[v]


# -- on a traced graph -----------------------------------------------------------------------------

@pytest.mark.parametrize("method,options", [("dtr", {}), ("dtr", {"allocator": True}),
                                            ("dtr", {"allocator": True, "full_arena": True}),
                                            ("dtr", {"heuristic": "dtr_eq"}),
                                            ("coop", {}), ("coop", {"partition": "cost_density"}),
                                            ("coop", {"partition": "none", "window_cost": "recompute",
                                                      "full_arena": False}),
                                            ("chen", {})])
def test_heuristic_schedules_of_gpt_fit_62_percent_and_pass_the_simulator(gpt, method, options):
    # 62%: at exactly 60% coop's full arena has no contiguous window for one request (docs/HEURISTICS.md)
    budget = int(no_remat_peak(gpt) * 0.62)
    s = solve(gpt, budget, method, **options)
    sim = simulate(gpt, s)
    assert sim.peak <= budget and sim.recomputes > 0
    adam = optimizer_bytes(fixed_tensors(gpt))
    assert s.stats.get("pool_high_water", 0) <= budget + (adam if s.stats.get("full_arena") else 0)
    r = replay(gpt, s)  # the full arena: the optimizer state is live too
    assert r.reserved_peak >= r.peak == sim.peak + adam


@pytest.mark.parametrize("method", ["dtr", "coop"])
def test_dynamic_methods_name_a_budget_that_works_when_this_one_does_not(gpt, method):
    with pytest.raises(BudgetError, match=r"nothing left to evict.*It does run under .* \((\d+) bytes") as e:
        solve(gpt, gpt.peak_lower_bound + 1, method)
    works = int(str(e.value).split("(")[-1].split(" bytes")[0])
    assert solve(gpt, works, method).stats["peak"] <= works


@pytest.mark.parametrize("method,options", [("dtr", {}), ("coop", {}), ("chen", {}),
                                            ("dtr", {"allocator": True, "full_arena": True})])
def test_a_tiny_time_limit_gives_a_clear_error_or_a_schedule_in_time(gpt, method, options):
    budget = int(no_remat_peak(gpt) * 0.6)
    start = time.perf_counter()
    try:
        s = solve(gpt, budget, method, time_limit=1e-4, **options)
        assert s.stats["status"] == "time_limit" and s.stats["peak"] <= budget
    except SolverError as e:
        assert "time limit" in str(e)
    assert time.perf_counter() - start < 2.0


def test_the_budget_bisection_stops_at_the_time_limit(gpt):
    start = time.perf_counter()
    with pytest.raises(BudgetError):
        solve(gpt, gpt.peak_lower_bound + 1, "coop", time_limit=0.3)
    assert time.perf_counter() - start < 1.5


def test_solvers_declare_every_option():
    import inspect

    from bonsai_core.solvers.chen import solve_chen
    from bonsai_core.solvers.coop import solve_coop
    from bonsai_core.solvers.dtr import solve_dtr

    for fn in (solve_chen, solve_coop, solve_dtr):
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds
        with pytest.raises(TypeError):
            fn(chain(4), None, no_such_option=1)


@pytest.mark.slow
def test_coop_beats_dtr_in_the_same_pool_on_gpt2_small():
    # docs/HEURISTICS.md: both in the same full-arena pool at 80% of the no-remat peak
    from bonsai_core.models.zoo import GPT2_SMALL
    from bonsai_core.trace import trace_model

    g = trace_model("gpt", **GPT2_SMALL).graph
    budget = int(0.8 * no_remat_peak(g))
    coop = solve(g, budget, "coop")
    dtr = solve(g, budget, "dtr", allocator=True, full_arena=True)
    assert coop.stats["overhead"] < 0.75 * dtr.stats["overhead"]
    assert coop.stats["free_at_failure"] <= dtr.stats["free_at_failure"]
    pool = budget + optimizer_bytes(fixed_tensors(g))
    assert coop.stats["pool_high_water"] <= pool and dtr.stats["pool_high_water"] <= pool


# -- one definition of fragmentation ----------------------------------------------------------------

@pytest.mark.parametrize("method,options", [("coop", {}), ("coop", {"partition": "cost_density"}),
                                            ("dtr", {"allocator": True, "full_arena": True}),
                                            ("dtr", {"allocator": True, "heuristic": "dte"})])
def test_a_pool_replay_is_the_runs_own_pool_block_for_block(gpt, method, options):
    s = solve(gpt, int(0.65 * no_remat_peak(gpt)), method, **options)
    r = pool_replay(gpt, s)
    assert r.reserved_peak == s.stats["pool_high_water"] and r.policy == "arena"
    assert not any("fragmentation" in k or k == "pool_waste" for k in s.stats)  # the allocator's alone


def test_the_bench_table_and_simulate_report_one_fragmentation(gpt, tmp_path, capsys):
    import json

    from bonsai_core.bench import heuristics as bench
    from bonsai_core.cli import main

    budget = int(0.65 * no_remat_peak(gpt))
    row = bench.run(gpt, budget, "coop", 30.0, measure=True)
    s = solve(gpt, budget, "coop", budget_hint=False)
    (tmp_path / "s.json").write_text(json.dumps(s.to_dict()))
    reports = {}
    for flags in ([], ["--arena"]):
        assert main(["simulate", "assets/gpt-default.json", str(tmp_path / "s.json"), "--allocator", *flags,
                     "--json"]) == 0
        reports[bool(flags)] = json.loads(capsys.readouterr().out)["fragmentation"]
    own, caching = pool_replay(gpt, s), replay(gpt, s)
    assert row["own_fragmentation"] == reports[True] == own.fragmentation == fragmentation_at_peak(own.live, own.reserved)
    assert row["caching_fragmentation"] == reports[False] == caching.fragmentation
