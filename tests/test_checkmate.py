"""Checkmate's MILP against an exhaustive search of its stage model on tiny graphs."""

import itertools
import math
import random
import time

import pytest

from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import solve
from bonsai_core.solvers import checkmate, stages, views
from tests.graphs import chain, mask_far_from_use


# -- an exhaustive search of the stage model --------------------------------------------------
# An exhaustive search of Checkmate's stage model, for checking the op-level solvers on tiny graphs.
#
# Independent of the solvers' code: a dynamic programme over stages whose state is the set of nodes
# kept resident from one stage to the next (and, to check Moccasin, how often each node was computed).
# Stage t computes a subset of the nodes before t in listed order, then node t; within a stage a node
# is freed as soon as nothing later in the stage reads it (directly or through a resident view) and it
# is not kept for the next stage. Exponential: for graphs of at most about 8 nodes.


def _keepers(graph: Graph) -> list[set[int]]:
    """Nodes whose computation needs v resident: its consumers, and those of its views."""
    out = [set(graph.users(v).tolist()) for v in range(graph.n)]
    for v in reversed(range(graph.n)):
        if graph.alias_of[v] >= 0:
            out[int(graph.alias_of[v])] |= out[v]
    return out


def _stage_peak(graph: Graph, kept: frozenset[int], computed: list[int], keep_next: frozenset[int],
                keepers: list[set[int]]) -> int:
    mem = graph.mem.tolist()

    def needed(i: int, rest: list[int]) -> bool:
        return i in keep_next or any(j in keepers[i] for j in rest)

    resident = {i for i in kept if needed(i, computed)}
    peak = 0
    for pos, k in enumerate(computed):
        resident.add(k)
        peak = max(peak, graph.fixed_mem + sum(mem[i] for i in resident))
        resident = {i for i in resident if needed(i, computed[pos + 1:])}
    return peak


def stage_optimum(graph: Graph, budget: int, copies: int | None = None) -> float:
    """The least total compute cost of a stage-model schedule peaking at most ``budget`` (with at
    most ``copies`` computations of each node, if given); ``math.inf`` if none fits."""
    n = graph.n
    deps = [set(graph.deps(v).tolist()) for v in range(n)]
    keepers = _keepers(graph)
    alias = graph.alias_of.tolist()
    cost = graph.cost.tolist()
    states: dict[tuple[frozenset[int], tuple[int, ...]], float] = {(frozenset(), (0,) * n): 0.0}
    for t in range(n):
        nxt: dict[tuple[frozenset[int], tuple[int, ...]], float] = {}
        for (kept, counts), so_far in states.items():
            candidates = [i for i in range(t) if i not in kept]
            for r in range(len(candidates) + 1):
                for chosen in itertools.combinations(candidates, r):
                    computed = list(chosen) + [t]
                    if copies is not None and any(counts[i] >= copies for i in chosen):
                        continue
                    have, ok = set(kept), True
                    for k in computed:
                        if not deps[k] <= have:
                            ok = False
                            break
                        have.add(k)
                    if not ok:
                        continue
                    new_counts = list(counts)
                    for k in computed:
                        new_counts[k] += 1
                    cost_here = so_far + sum(cost[k] for k in computed)
                    pool = sorted(i for i in have if keepers[i]) if t < n - 1 else []
                    for m in range(len(pool) + 1):
                        for keep in itertools.combinations(pool, m):
                            keep_next = frozenset(keep)
                            if any(alias[v] >= 0 and alias[v] not in keep_next for v in keep_next):
                                continue  # a kept view keeps its base
                            if _stage_peak(graph, kept, computed, keep_next, keepers) > budget:
                                continue
                            key = (keep_next, tuple(new_counts) if copies is not None else (0,) * n)
                            if cost_here < nxt.get(key, math.inf):
                                nxt[key] = cost_here
        states = nxt
    return min(states.values(), default=math.inf)


# -- test graphs --------------------------------------------------------------------------------


def weighted_chain(costs: list[float], mems: list[int], fixed_mem: int = 0) -> Graph:
    """chain(n) with a cost and a size per forward op (its backward op gets the same)."""
    n = len(costs)
    nodes = [dict(name=f"f{i}", phase="forward", cost=costs[i], mem=mems[i], deps=[i - 1] if i else [])
             for i in range(n)]
    for i in reversed(range(n)):
        deps = [i] + ([len(nodes) - 1] if i < n - 1 else [])
        nodes.append(dict(name=f"b{i}", phase="backward", cost=costs[i], mem=mems[i], deps=sorted(deps)))
    return Graph.from_nodes(f"wchain{n}", fixed_mem, nodes)


def view_dag() -> Graph:
    """A forward pass with a view and a skip connection, and its backward pass."""
    return Graph.from_nodes("viewdag", 7, [
        dict(name="a", phase="forward", cost=3.0, mem=10, deps=[]),
        dict(name="v", op="aten.view.default", phase="forward", cost=0.0, mem=0, deps=[0], alias_of=0),
        dict(name="b", phase="forward", cost=1.0, mem=20, deps=[1]),
        dict(name="c", phase="forward", cost=2.0, mem=10, deps=[0, 2]),
        dict(name="gc", phase="backward", cost=1.0, mem=10, deps=[3]),
        dict(name="gb", phase="backward", cost=1.0, mem=20, deps=[2, 4]),
        dict(name="ga", phase="backward", cost=1.0, mem=10, deps=[1, 5]),
    ])


def random_dag(seed: int, n: int = 7) -> Graph:
    """A random DAG of n nodes, each reading one or two earlier nodes, with one view."""
    rng = random.Random(seed)
    nodes = [dict(name="n0", phase="forward", cost=rng.uniform(0.5, 3), mem=rng.randint(1, 5) * 8, deps=[])]
    nodes.append(dict(name="view", phase="forward", cost=0.0, mem=0, deps=[0], alias_of=0))
    for v in range(2, n):
        deps = sorted(set(rng.sample(range(v), min(v, rng.randint(1, 2)))))
        nodes.append(dict(name=f"n{v}", phase="forward" if v < n // 2 else "backward",
                          cost=rng.uniform(0.5, 3), mem=rng.randint(1, 5) * 8, deps=deps))
    return Graph.from_nodes(f"random{seed}", 16, nodes)


def budgets(graph: Graph, count: int = 4) -> list[int]:
    lo, hi = graph.peak_lower_bound, no_remat_peak(graph)
    return sorted({lo + (hi - lo) * k // (count - 1) for k in range(count)})


GRAPHS = [weighted_chain([1.0, 3.0, 2.0], [10, 30, 20]),
          weighted_chain([2.0, 1.0, 4.0, 1.0], [20, 10, 10, 30], fixed_mem=5),
          view_dag(), random_dag(1), random_dag(2), random_dag(3)]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.name)
def test_checkmate_reaches_the_exhaustive_stage_model_optimum(graph):
    # The MILP's stages are the nodes that are not views (a view's consumers read its base).
    small, _ = views.contract_views(graph)
    for budget in budgets(graph):
        best = stage_optimum(small, budget)
        if math.isinf(best):
            with pytest.raises(BudgetError):
                solve(graph, budget, "checkmate", time_limit=30)
            continue
        schedule = solve(graph, budget, "checkmate", time_limit=30)
        assert schedule.stats["status"] == "optimal"
        assert schedule.stats["objective"] == pytest.approx(best, rel=1e-6)
        assert schedule.stats["compute_cost"] == pytest.approx(schedule.stats["objective"], rel=1e-6)
        assert schedule.stats["peak"] <= budget
        assert best <= stage_optimum(graph, budget)  # views as stages of their own only constrain


def test_contracting_views_rewires_their_consumers_to_the_base():
    g = view_dag()
    small, kept = views.contract_views(g)
    assert kept.tolist() == [0, 2, 3, 4, 5, 6] and small.n == 6 and not small.is_view.any()
    assert small.deps(1).tolist() == [0] and small.deps(5).tolist() == [0, 4]  # b and ga read a


def test_expanding_views_computes_a_chain_of_unread_views_after_its_base():
    g = Graph.from_nodes("views", 0, [
        dict(name="a", cost=1.0, mem=8, deps=[]),
        dict(name="v1", cost=0.0, mem=0, deps=[0], alias_of=0),
        dict(name="v2", cost=0.0, mem=0, deps=[1], alias_of=1),  # read by nothing
        dict(name="b", cost=1.0, mem=8, deps=[0]),
    ])
    small, kept = views.contract_views(g)
    assert small.n == 2 and views.expand_views(g, kept.tolist()) == [0, 1, 2, 3]
    assert solve(g, None, "checkmate", time_limit=30).stats["peak"] == 16


def test_expanding_views_recomputes_a_view_only_for_a_new_copy_of_its_base():
    g = view_dag()
    assert views.expand_views(g, [0, 2, 3, 4, 5, 6]) == [0, 1, 2, 3, 4, 5, 6]
    assert views.expand_views(g, [0, 2, 3, 4, 5, 0, 6]) == [0, 1, 2, 3, 4, 5, 0, 1, 6]


def fan_in() -> Graph:
    """A big node X read by p, q and r, all three read by one op: computing r needs X, p and q
    resident, 130 bytes, more than any single op's 110 (the lower bound)."""
    return Graph.from_nodes("fanin", 0, [
        dict(name="X", cost=1.0, mem=100, deps=[]),
        *[dict(name=x, cost=1.0, mem=10, deps=[0]) for x in "pqr"],
        dict(name="out", cost=1.0, mem=10, deps=[1, 2, 3]),
    ])


def test_an_infeasible_budget_names_the_lower_bound_and_a_budget_that_fits():
    g = fan_in()
    assert g.peak_lower_bound == 110 and math.isinf(stage_optimum(g, 129)) and stage_optimum(g, 130) == 5.0
    with pytest.raises(BudgetError, match=r"below 110 B .* fits in 130 B") as refused:
        solve(g, 120, "checkmate", time_limit=30)
    assert refused.value.stats["variables"] > 0 and refused.value.stats["constraints"] > 0  # the model it built
    assert solve(g, 130, "checkmate", time_limit=30).stats["peak"] == 130


def test_scip_backend_reaches_the_same_optimum():
    g = view_dag()
    budget = budgets(g)[1]
    highs = solve(g, budget, "checkmate", backend="highs", time_limit=30)
    scip = solve(g, budget, "checkmate", backend="scip", time_limit=30)
    assert scip.stats["backend"] == "scip" and scip.stats["status"] == "optimal"
    assert scip.stats["compute_cost"] == pytest.approx(highs.stats["compute_cost"], rel=1e-6)


def test_resolving_at_another_budget_reuses_the_cached_model():
    g = weighted_chain([1.0, 2.0, 1.5, 1.0], [10, 20, 10, 10])
    first = solve(g, no_remat_peak(g), "checkmate", time_limit=30)
    tight = g.peak_lower_bound
    again = solve(g, tight, "checkmate", time_limit=30)
    assert first.stats["build_seconds"] > 0 and again.stats["build_seconds"] == 0.0
    assert first.stats["compute_cost"] == pytest.approx(g.total_cost)
    best = stage_optimum(g, tight)
    assert best > g.total_cost and again.stats["compute_cost"] == pytest.approx(best)


def test_fixed_memory_counts_against_the_budget():
    light, heavy = chain(3), chain(3, fixed_mem=100)
    budget = budgets(light)[1]
    assert solve(heavy, budget + 100, "checkmate", time_limit=30).stats["compute_cost"] == pytest.approx(
        solve(light, budget, "checkmate", time_limit=30).stats["compute_cost"])


def test_model_size_is_reported_and_grows_quadratically():
    small = solve(chain(3), None, "checkmate", time_limit=30).stats
    large = solve(chain(6), None, "checkmate", time_limit=30).stats
    assert small["variables"] > 0 and small["constraints"] > 0
    assert large["variables"] > 3 * small["variables"]  # 2x the nodes, about 4x the variables
    for key in ("status", "gap", "build_seconds", "solve_seconds"):
        assert key in small


def test_graphs_over_the_size_limit_are_refused_with_a_pointer_to_bonsai():
    with pytest.raises(SolverError, match=r"6 nodes that are not views .* limited to 5 nodes.*bonsai"):
        solve(chain(3), None, "checkmate", max_nodes=5)
    assert checkmate.MAX_NODES >= 100


def test_past_the_time_limit_the_best_schedule_found_comes_with_its_gap():
    g, limit = chain(10), 4.0  # HiGHS finds schedules in a second or two here, and may not prove one optimal
    budget = int(0.7 * no_remat_peak(g))
    start = time.perf_counter()
    schedule = solve(g, budget, "checkmate", time_limit=limit)
    assert time.perf_counter() - start < limit + 10  # the build counts; slack for a loaded machine
    status, gap = schedule.stats["status"], schedule.stats["gap"]
    assert (status, gap) == ("optimal", 0.0) or (status == "feasible" and 0 < gap <= 1)
    assert schedule.stats["peak"] <= budget


def test_a_time_limit_too_short_for_any_schedule_says_none_was_found():
    g, limit = chain(30), 0.5
    start = time.perf_counter()
    with pytest.raises(SolverError, match="time limit of 0.5 s"):
        solve(g, int(0.5 * no_remat_peak(g)), "checkmate", time_limit=limit, warm_start=False)
    assert time.perf_counter() - start < limit + 10


def test_warm_started_the_same_short_limit_returns_a_schedule():
    """chen meets the budget in milliseconds: that start is the MILP's incumbent from the outset."""
    g, limit = chain(30), 0.5
    budget = int(0.5 * no_remat_peak(g))
    start = time.perf_counter()
    schedule = solve(g, budget, "checkmate", time_limit=limit)
    assert time.perf_counter() - start < limit + 10
    assert schedule.stats["peak"] <= budget and schedule.stats["warm_start"].startswith("chen")


def test_the_stage_sequence_puts_recomputations_before_each_stages_node():
    assert stages.stage_sequence([[], [], [0], [1, 0]]) == [0, 1, 0, 2, 0, 1, 3]


def test_effective_users_of_a_base_include_its_views_users():
    users = stages.effective_users(view_dag())
    assert users[0].tolist() == [1, 2, 3, 6] and users[1].tolist() == [2, 6]


def test_cli_json_output_stays_one_json_object_on_stdout(tmp_path):
    import json
    import subprocess
    import sys

    from bonsai_core.graph import save_graph

    save_graph(chain(3), tmp_path / "g.json")
    done = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "solve", str(tmp_path / "g.json"), "--budget",
                           "80%", "--method", "checkmate", "--time-limit", "30", "--json", "-o",
                           str(tmp_path / "s.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["method"] == "checkmate"  # HiGHS' banner went to stderr


def test_a_separated_output_is_recomputed_only_with_its_op():
    """The mask's bytes come only from the dropout kernel (the simulator's separated-output rule): taking it again from the
    resident dropout would cost a nanosecond and is no schedule at all. Under 301 bytes the MILP
    must rerun the dropout (and its input) after the dropout's last backward reader, with the mask."""
    from bonsai_core.schedule import simulate

    g = mask_far_from_use()
    assert no_remat_peak(g) == 341
    s = solve(g, 301, "checkmate")
    sim = simulate(g, s)
    recomputed = sorted(v for v in range(g.n) if sum(1 for k, u in s.ops if k == "compute" and u == v) > 1)
    assert sim.peak <= 301 and recomputed == [0, 1, 2], (sim.peak, s.ops)
