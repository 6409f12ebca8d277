"""The lower bound on the compute cost of every schedule within a budget (``bonsai_core.bound``): never
above the op-level optimum (an exhaustive search over every schedule the simulator accepts, checkmate's
proven optima), never above any method's schedule, and its parts checked on their own."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bonsai_core.bound import BoundParts, Tensors, closure_at, lagrangian, lower_bound, spine, unsharded_at, _Lp
from bonsai_core.errors import BonsaiError
from bonsai_core.fsdp import working_profile
from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, no_remat_peak, simulate
from bonsai_core.solvers import solve
from tests.graphs import chain
from tests.strategies import graphs
from tests.test_checkmate import GRAPHS as CHECKMATE_GRAPHS, budgets

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def op_level_optimum(graph: Graph, budget: int) -> float:
    """The least compute cost of any schedule within ``budget`` (``math.inf``: none fits): Dijkstra over
    (resident set, computed set), a compute costing its node's cost and a free nothing, by the
    simulator's rules 1-4 and 8 (a node written in place of its input, which is freed at once, counts
    that input's bytes once). For graphs of a few nodes."""
    n = graph.n
    deps = [sum(1 << int(d) for d in graph.deps(v)) for v in range(n)]
    mem, cost = graph.mem.tolist(), graph.cost.tolist()
    views = [0] * n
    for v in np.flatnonzero(graph.is_view).tolist():
        views[int(graph.alias_of[v])] |= 1 << v
    inplace = graph.inplace_of.tolist()
    everything = (1 << n) - 1
    best = {(0, 0): 0.0}
    heap = [(0.0, 0, 0)]
    while heap:
        spent, resident, ever = heapq.heappop(heap)
        if best.get((resident, ever), math.inf) < spent:
            continue
        if ever == everything:
            return spent
        live = graph.fixed_mem + sum(mem[v] for v in range(n) if resident >> v & 1)
        moves = []
        for v in range(n):
            bit = 1 << v
            if resident & bit:
                if not resident & views[v]:
                    moves.append((0.0, resident & ~bit, ever))
            elif deps[v] & resident == deps[v]:
                if live + mem[v] <= budget:
                    moves.append((cost[v], resident | bit, ever | bit))
                u = inplace[v]
                if u >= 0 and not resident & views[u] and live + mem[v] - mem[u] <= budget:
                    moves.append((cost[v], (resident | bit) & ~(1 << u), ever | bit))
        for price, r, e in moves:
            if spent + price < best.get((r, e), math.inf) - 1e-15:
                best[(r, e)] = spent + price
                heapq.heappush(heap, (spent + price, r, e))
    return math.inf


def budgets_of(graph: Graph, count: int = 5) -> list[int]:
    low, high = graph.peak_lower_bound, no_remat_peak(graph)
    return sorted({low + (high - low) * k // (count - 1) for k in range(count)})


def byte_sized_views() -> Graph:
    """Tensors of 1-3 bytes (a coefficient of 1/GiB, which HiGHS drops) and two views: at budget 4 the
    only schedules recompute n0 and n1 for n6 after n5, cost 7/128."""
    c = 1 / 128
    return Graph.from_nodes("byte-sized views", 0, [
        dict(name="n0", phase="forward", cost=c, mem=1, deps=[]),
        dict(name="n1", phase="backward", cost=c, mem=2, deps=[]),
        dict(name="n2", phase="backward", cost=c, mem=1, deps=[0, 1]),
        dict(name="n3", phase="backward", cost=c, mem=3, deps=[]),
        dict(name="n4", phase="backward", cost=c, mem=1, deps=[]),
        dict(name="n5", phase="backward", cost=0.0, mem=0, deps=[2, 3], alias_of=2),
        dict(name="n6", phase="backward", cost=0.0, mem=0, deps=[0, 1, 5], alias_of=0),
    ])


@SETTINGS
@given(graphs(max_nodes=8))
@example(byte_sized_views())
def test_the_bound_is_never_above_the_op_level_optimum(g):
    for budget in budgets_of(g):
        best = op_level_optimum(g, budget)
        bound = lower_bound(g, budget)
        assert bound.cost <= best * (1 + 1e-9) + 1e-15, (budget, bound, best)
        if math.isinf(bound.cost):
            assert math.isinf(best)


def inplace_chain() -> Graph:
    """f0 -> f1 (written in place of f0) -> f2, and their backward ops: rule 8 lowers f1's step."""
    return Graph.from_nodes("inplace", 3, [
        dict(name="f0", phase="forward", cost=2.0, mem=40, deps=[]),
        dict(name="f1", phase="forward", cost=1.0, mem=40, deps=[0], inplace_of=0),
        dict(name="f2", phase="forward", cost=3.0, mem=20, deps=[1]),
        dict(name="b2", phase="backward", cost=3.0, mem=20, deps=[1, 2]),
        dict(name="b1", phase="backward", cost=1.0, mem=40, deps=[1, 3]),
        dict(name="b0", phase="backward", cost=2.0, mem=40, deps=[4]),
    ])


@pytest.mark.parametrize("graph", [*CHECKMATE_GRAPHS, inplace_chain(), chain(4, mem=8, fixed_mem=3)],
                         ids=lambda g: g.name)
def test_the_bound_is_never_above_the_exhaustive_optimum_nor_checkmates_proven_one(graph):
    for budget in sorted(set(budgets(graph)) | set(budgets_of(graph))):
        bound = lower_bound(graph, budget)
        best = op_level_optimum(graph, budget)
        assert bound.cost <= best * (1 + 1e-9) + 1e-12
        try:
            found = solve(graph, budget, "checkmate", time_limit=30)
        except BonsaiError:
            continue
        if found.stats["status"] == "optimal":
            assert bound.cost <= found.stats["compute_cost"] * (1 + 1e-9)


@SETTINGS
@given(graphs(max_nodes=12), st.floats(0.0, 1.0))
def test_no_method_computes_less_than_the_bound(g, share):
    budget = int(g.peak_lower_bound + share * (no_remat_peak(g) - g.peak_lower_bound))
    bound = lower_bound(g, budget)
    for method in ("none", "chen", "dtr", "bonsai", "moccasin", "checkmate"):
        try:
            found = solve(g, budget, method, time_limit=10)
        except BonsaiError:
            continue
        assert found.stats["compute_cost"] >= bound.cost * (1 - 1e-9), (method, bound)


@SETTINGS
@given(graphs(max_nodes=12), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), st.booleans())
def test_the_parts_kept_across_budgets_give_each_budget_its_own_bound(g, shares, offload):
    parts = BoundParts(g, offload=offload)  # built once, then reused at every budget, in any order
    for share in shares:
        budget = int(g.peak_lower_bound + share * (no_remat_peak(g) - g.peak_lower_bound))
        kept, fresh = lower_bound(g, budget, offload=offload, parts=parts), lower_bound(g, budget, offload=offload)
        assert (kept.cost, kept.node, kept.how) == (fresh.cost, fresh.node, fresh.how)


def test_parts_of_another_setting_are_refused():
    g = chain(4, mem=10)
    with pytest.raises(ValueError, match="another graph or offload"):
        lower_bound(g, no_remat_peak(g), offload=True, parts=BoundParts(g))


def test_no_schedule_fits_below_the_per_op_bound():
    g = chain(4, mem=10)
    assert math.isinf(lower_bound(g, g.peak_lower_bound - 1).cost)
    assert lower_bound(g, no_remat_peak(g)).recompute == 0.0


def test_a_solver_infeasible_verdict_is_no_proof_and_byte_sized_tensors_keep_the_bound_tight():
    g = byte_sized_views()
    assert op_level_optimum(g, 4) == pytest.approx(7 / 128)
    assert lower_bound(g, 4).cost == pytest.approx(7 / 128)  # n0 and n1 recomputed: both bounds see it


def test_the_spine_is_a_dependency_path():
    g = chain(5)
    path = spine(g).tolist()
    assert len(path) == g.n
    assert all(a in g.deps(b).tolist() for a, b in zip(path, path[1:]))


def test_a_chain_at_its_tightest_budget_must_recompute_and_the_bound_says_so():
    g = chain(4, mem=10)
    budget = g.peak_lower_bound
    best = op_level_optimum(g, budget)
    bound = lower_bound(g, budget)
    assert best > g.total_cost
    assert g.total_cost < bound.cost <= best


def test_the_lagrangian_of_any_dual_is_at_most_the_lp_optimum():
    # minimise x0 + 2 x1 s.t. x0 + x1 >= 1, x in [0, 1]^2: optimum 1
    import scipy.sparse as sp

    lp = _Lp(np.array([1.0, 2.0]), sp.csr_matrix(np.array([[1.0, 1.0]])), np.array([1.0]), np.array([np.inf]),
             np.zeros(2), np.ones(2))
    assert lagrangian(lp, np.array([1.0])) == pytest.approx(1.0)
    for y in (-1.0, 0.0, 0.5, 1.5, 3.0):
        assert lagrangian(lp, np.array([y])) <= 1.0 + 1e-12


def test_closure_at_a_node_counts_the_inputs_a_recomputation_needs():
    # f0 -> f1 -> f2; the backward reads f2 and f1, never f0. At b2 within 32 bytes (b2's output and f2
    # take 30) f1 cannot stay: recomputing it needs f0, which does not fit either, so f0 is recomputed
    # too (5 in all). The LP: 80% of each (4.0); without the inputs' rule, 80% of f1 (2.4)
    g = Graph.from_nodes("closure", 0, [
        dict(name="f0", phase="forward", cost=2.0, mem=12, deps=[]),
        dict(name="f1", phase="forward", cost=3.0, mem=10, deps=[0]),
        dict(name="f2", phase="forward", cost=1.0, mem=20, deps=[1]),
        dict(name="b2", phase="backward", cost=1.0, mem=10, deps=[2]),
        dict(name="b1", phase="backward", cost=1.0, mem=5, deps=[1, 3]),
        dict(name="b0", phase="backward", cost=1.0, mem=10, deps=[4]),
    ])
    assert closure_at(g, 32, 3, Tensors(g)) == pytest.approx(4.0)
    assert op_level_optimum(g, 32) == pytest.approx(g.total_cost + 5.0)
    assert g.total_cost + 4.0 <= lower_bound(g, 32).cost + 1e-12 <= op_level_optimum(g, 32) + 1e-12


@pytest.fixture(scope="module")
def fsdp_gpt():
    from bonsai_core.trace import trace_model

    return trace_model("gpt", fsdp=2, batch=2, seq=16, width=32, layers=2, heads=2, vocab=64).graph


def test_fsdp_holds_at_least_the_unsharded_block_the_bound_counts(fsdp_gpt):
    # rule 7 in every schedule: while a node runs, its block's parameters are unsharded
    held = unsharded_at(fsdp_gpt)
    assert held.max() > 0
    budget = int(0.7 * no_remat_peak(fsdp_gpt))
    for method in ("none", "chen", "dtr", "bonsai"):
        try:
            schedule = solve(fsdp_gpt, budget, method, time_limit=30)
        except BonsaiError:
            continue
        profile = working_profile(fsdp_gpt, schedule.ops)
        for i, (kind, v) in enumerate(schedule.ops):
            if kind == COMPUTE:
                assert profile[i] >= held[v], (method, fsdp_gpt.names[v])
        assert schedule.stats["compute_cost"] >= lower_bound(fsdp_gpt, budget).cost * (1 - 1e-9)


def test_the_offload_bound_is_at_most_every_offloading_plan_and_the_plain_one():
    from bonsai_core.trace import trace_model

    g = trace_model("gpt", batch=2, seq=16, width=32, layers=2, heads=2, vocab=64).graph
    for share in (0.5, 0.7):
        budget = int(share * no_remat_peak(g))
        with_host = lower_bound(g, budget, offload=True)
        assert with_host.cost <= lower_bound(g, budget).cost + 1e-15
        for method, options in (("dtr", {"offload": True}), ("bonsai", {"offload": True, "space": "regions"})):
            try:
                found = solve(g, budget, method, time_limit=30, **options)
            except BonsaiError:
                continue
            assert simulate(g, found).compute_cost >= with_host.cost * (1 - 1e-9)
