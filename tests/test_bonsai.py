import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest

from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, plan_schedule, useful_saved
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import solve
from bonsai_core.solvers import bonsai as B
from bonsai_core.solvers.chen import candidate_plans
from tests.graphs import chain
from tests.marks import sweep

ASSET = Path(__file__).resolve().parent.parent / "assets" / "gpt-default.json"


@pytest.fixture(scope="module")
def gpt() -> Graph:
    return Graph.from_dict(json.loads(ASSET.read_text()))


def random_net(seed: int, n: int = 6, views: bool = False) -> Graph:
    """A small training graph with skip connections and uneven sizes: forward f_i reads f_{i-1} and
    sometimes an earlier f; backward g_i reads g_{i+1}, f_i and f_i's inputs (as real backward ops do).
    With ``views``, some f_i is followed by a view of it, which the next op reads (and, sometimes, the
    backward pass too): the view must stay in its base's segment."""
    rng = np.random.default_rng(seed)
    nodes, fdeps, ids = [], [], []  # ids[i]: f_i's node id (views shift it)
    for i in range(n):
        deps = [len(nodes) - 1] if nodes else []
        if i >= 2 and rng.random() < (0.3 if views else 0.4):
            deps.append(ids[int(rng.integers(0, i - 1))])
        deps = sorted(set(deps)) if views else deps
        nodes.append(dict(name=f"f{i}", phase="forward", cost=float(rng.uniform(1, 4)),
                          mem=int(rng.integers(1, 9)) * 8, deps=deps))
        fdeps.append(deps)
        ids.append(len(nodes) - 1)
        if views and i < n - 1 and rng.random() < 0.5:
            nodes.append(dict(name=f"v{i}", phase="forward", cost=0.0, mem=0, deps=[ids[-1]], alias_of=ids[-1]))
    for i in reversed(range(n)):
        f = ids[i]
        deps = {f, *fdeps[i]} | ({len(nodes) - 1} if i < n - 1 else set())
        if views and f + 1 < len(nodes) and nodes[f + 1].get("alias_of") == f and rng.random() < 0.5:
            deps.add(f + 1)  # the backward pass reads the view
        nodes.append(dict(name=f"g{i}", phase="backward", cost=float(rng.uniform(1, 4)),
                          mem=int(rng.integers(1, 9)) * 8, deps=sorted(deps)))
    return Graph.from_nodes(f"{'viewed' if views else 'net'}{seed}", 16, nodes)


def reader_net(seed: int, n: int = 6) -> Graph:
    """Forward ops like linear/relu/mul/add: each backward op g_i reads g_{i+1} and, by kind, f_i's
    inputs, its output, both or neither. A backward op that reads an op's inputs but not its output
    makes candidates whose rebuild must keep inputs alive past their plain free (ext > 0)."""
    rng = np.random.default_rng(seed)
    nodes, fdeps = [], []
    for i in range(n):
        deps = [i - 1] if i else []
        if i >= 2 and rng.random() < 0.4:
            deps.append(int(rng.integers(0, i - 1)))
        fdeps.append(deps)
        nodes.append(dict(name=f"f{i}", phase="forward", cost=float(rng.integers(1, 4)),
                          mem=int(rng.integers(1, 5)), deps=deps))
    for i in reversed(range(n)):
        kind = rng.integers(4)  # 0: inputs, 1: output, 2: both, 3: neither
        deps = ({len(nodes) - 1} if i < n - 1 else set()) | (set(fdeps[i]) if kind in (0, 2) else set()) | \
            ({i} if kind in (1, 2) else set())
        nodes.append(dict(name=f"g{i}", phase="backward", cost=float(rng.integers(1, 4)),
                          mem=int(rng.integers(1, 5)), deps=sorted(deps)))
    return Graph.from_nodes(f"reader{seed}", 0, nodes)


def masked_net(seed: int, n: int = 5) -> Graph:
    """Like random_net, with one op f_k that also reads a constant built inside the forward pass (``ones``
    then ``tril``, reading no other node, as an attention mask): a segment holding it and f_k's input can
    save the constant instead of rebuilding it. g_k reads the mask, as masked_fill's backward does."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, n))
    nodes, fdeps, ids = [], [], []
    for i in range(n):
        if i == k:
            nodes.append(dict(name="ones", phase="forward", cost=float(rng.integers(1, 4)), mem=1, deps=[]))
            nodes.append(dict(name="tril", phase="forward", cost=float(rng.integers(1, 4)), mem=1,
                              deps=[len(nodes) - 1]))
        deps = [ids[-1]] if ids else []
        if i >= 2 and rng.random() < 0.4:
            deps.append(ids[int(rng.integers(0, i - 1))])
        if i == k:
            deps.append(len(nodes) - 1)
        fdeps.append(sorted(deps))
        ids.append(len(nodes))
        nodes.append(dict(name=f"f{i}", phase="forward", cost=float(rng.integers(1, 4)),
                          mem=int(rng.integers(1, 9)), deps=sorted(deps)))
    for i in reversed(range(n)):
        deps = {ids[i], *fdeps[i]} | ({len(nodes) - 1} if i < n - 1 else set())
        nodes.append(dict(name=f"g{i}", phase="backward", cost=float(rng.integers(1, 4)),
                          mem=int(rng.integers(1, 9)), deps=sorted(deps)))
    return Graph.from_nodes(f"masked{seed}", 4, nodes)


MUL8 = {"format": "bonsai-graph", "version": 1, "name": "mul8", "fixed_mem": 0, "nodes": [
    {"id": 0, "name": "a", "phase": "forward", "cost": 1, "mem": 2, "deps": []},
    {"id": 1, "name": "b1", "phase": "forward", "cost": 1, "mem": 1, "deps": [0]},
    {"id": 2, "name": "b2", "phase": "forward", "cost": 1, "mem": 1, "deps": [1]},
    {"id": 3, "name": "c", "phase": "forward", "cost": 1, "mem": 1, "deps": [0, 2]},
    {"id": 4, "name": "g_c", "phase": "backward", "cost": 1, "mem": 1, "deps": [0, 2]},
    {"id": 5, "name": "g_b2", "phase": "backward", "cost": 1, "mem": 1, "deps": [1, 4]},
    {"id": 6, "name": "g_b1", "phase": "backward", "cost": 1, "mem": 1, "deps": [1, 5]},
    {"id": 7, "name": "g_a", "phase": "backward", "cost": 1, "mem": 1, "deps": [6]}]}


def all_plans(graph: Graph):
    """Every checkpoint plan: each split of the forward pass into contiguous segments at the allowed
    cuts (before every op; never before a view that would split it from its base), with each subset
    of the segments recomputed."""
    from bonsai_core.segment import atom_boundaries

    fwd, cuts_allowed = atom_boundaries(graph)
    fwd = fwd.tolist()
    inner = [c for c in cuts_allowed.tolist() if 0 < c < len(fwd)]
    m = len(fwd)
    for cuts in itertools.product([False, True], repeat=len(inner)):
        bounds = [0] + [c for c, on in zip(inner, cuts) if on] + [m]
        segments = [fwd[a:b] for a, b in zip(bounds, bounds[1:])]
        for rec in itertools.product([False, True], repeat=len(segments)):
            yield CheckpointPlan.of(segments, [i for i, r in enumerate(rec) if r])


def brute_force(graph: Graph) -> list[tuple[int, float]]:
    """(simulated peak, compute cost) of every checkpoint plan."""
    return [p[:2] for p in brute_force_plans(graph)]


def brute_force_plans(graph: Graph) -> list[tuple[int, float, CheckpointPlan]]:
    out = []
    for plan in all_plans(graph):
        sim = simulate(graph, plan_schedule(graph, plan, "brute"))
        out.append((sim.peak, sim.compute_cost, plan))
    return out


def modelled_peak(built, plan: CheckpointPlan) -> int:
    """The segment model's peak of any plan whose recomputed segments are candidates (pruned or not),
    computed from the coefficients directly (independent of which candidates the ILP keeps)."""
    from bonsai_core.solvers.bonsai_coef import memory_steps

    seg = built.seg
    pos = {int(v): i for i, v in enumerate(seg.forward)}
    index = {(int(a), int(b)): c for c, (a, b) in enumerate(zip(seg.starts, seg.ends))}
    cols = [index[(min(pos[v] for v in plan.segments[i]), max(pos[v] for v in plan.segments[i]) + 1)]
            for i in sorted(plan.recomputed)]
    memory = built.plain.memory
    steps = memory_steps(built.coef, np.asarray(cols, dtype=np.int64), len(seg.forward), points=len(memory))
    return int((memory + np.cumsum(np.asarray(steps.sum(axis=1)).ravel())).max())


@pytest.mark.parametrize("graph", [Graph.from_dict(MUL8)] + [reader_net(s, n) for s, n in ((0, 7), (1, 6), (3, 7), (4, 5), (7, 7), (11, 6))],
                         ids=lambda g: g.name)
def test_pruning_is_exact_in_the_model_when_rebuilds_keep_inputs_alive(graph):
    """Graphs with ext > 0 on many candidates: at every budget, the ILP's optimum equals the cheapest
    plan whose *modelled* peak fits (so pruning lost nothing), the result never costs less than the
    true optimum nor peaks over the budget, and it is the true optimum wherever the model is exact.
    Both pruning rules are at work on these graphs (candidates that never lower the memory, and
    candidates dominated by one inside them)."""
    from bonsai_core.solvers.bonsai_coef import lowers_memory

    m = int(graph.is_forward.sum())
    built = B.build(graph, m, save_ops=False)
    plans = [(p, c, modelled_peak(built, plan)) for p, c, plan in brute_force_plans(graph)]
    assert any(built.coef.ext[c] > 0 for c in range(built.seg.count))
    useful = int(lowers_memory(built.coef, len(built.seg.forward)).sum())
    assert len(built.candidates) < useful < built.seg.count
    for budget in sorted({p for p, _, _ in plans} | {q for _, _, q in plans}):
        true_best = min((c for p, c, _ in plans if p <= budget), default=None)
        model_best = min((c for _, c, q in plans if q <= budget), default=None)
        if true_best is None:
            continue
        schedule = solve(graph, budget, "bonsai", space="regions", granularity=m, save_ops=False)
        st = schedule.stats
        assert st["peak"] <= budget and st["compute_cost"] >= true_best - 1e-9
        if model_best is not None:  # the ILP's own optimum, whichever plan was returned
            ilp = st["objective"] if st["plan_source"] == "ilp" else st["ilp_overhead"]
            assert graph.total_cost * (1 + ilp) == pytest.approx(model_best), budget
            assert st["compute_cost"] <= model_best + 1e-9
        if all(q == p for p, _, q in plans if p <= budget):
            assert st["compute_cost"] == pytest.approx(true_best), budget


def all_plans_saving_ops(graph: Graph, built):
    """Every checkpoint plan, each recomputed segment saving the ops of one of ``built``'s density
    levels inside it (level 0: none), as (plan, modelled peak from the coefficients of each segment's
    level)."""
    from bonsai_core.solvers.bonsai_coef import memory_steps

    seg, memory = built.seg, built.plain.memory
    pos = {int(v): i for i, v in enumerate(seg.forward)}
    index = {(int(a), int(b)): c for c, (a, b) in enumerate(zip(seg.starts, seg.ends))}
    for plan in all_plans(graph):
        rec = sorted(plan.recomputed)
        spans = [(min(pos[v] for v in plan.segments[i]), max(pos[v] for v in plan.segments[i]) + 1) for i in rec]
        for levels in itertools.product(range(len(built.pinned)), repeat=len(rec)):
            saved = [int(seg.forward[p]) for (a, b), lv in zip(spans, levels) for p in range(a, b) if built.pinned[lv][p]]
            total = np.zeros(len(memory))
            for (a, b), lv in zip(spans, levels):
                col = np.array([index[a, b]], dtype=np.int64)
                steps = memory_steps(built.coefs[False, lv], col, len(seg.forward), points=len(memory))
                total += np.cumsum(np.asarray(steps.sum(axis=1)).ravel())
            yield CheckpointPlan(plan.segments, plan.recomputed, frozenset(), frozenset(saved)), \
                int(np.ceil((memory + total).max()))


@pytest.mark.parametrize("graph", sweep([reader_net(1, 5), random_net(2, 5)]), ids=lambda g: g.name)
def test_saving_ops_inside_recomputed_segments_is_optimal_in_its_model(graph):
    """Against every plan whose recomputed segments each save one density level's ops (selective
    checkpointing's MUST_SAVE): the model bounds every plan's simulated peak; at every budget the ILP's
    optimum is the cheapest plan whose modelled peak fits, the schedule fits, it is the true optimum
    where the model is exact, and it never costs more than whole-segment plans (save_ops=False)."""
    m = int(graph.is_forward.sum())
    built = B.build(graph, m, save_self_contained=False, save_ops=True)
    assert len(built.pinned) > 1 and (built.levels > 0).any()  # levels with columns of their own
    plans = []
    for plan, modelled in all_plans_saving_ops(graph, built):
        sim = simulate(graph, plan_schedule(graph, useful_saved(graph, plan), "brute"))
        plans.append((sim.peak, sim.compute_cost, modelled))
    assert all(q >= p for p, _, q in plans)
    cheaper_somewhere = False
    for budget in sorted({p for p, _, _ in plans}):
        true_best = min(c for p, c, _ in plans if p <= budget)
        model_best = min((c for _, c, q in plans if q <= budget), default=None)
        st = solve(graph, budget, "bonsai", space="regions", granularity=m, save_self_contained=False, save_ops=True, reuse=False).stats
        assert st["peak"] <= budget and st["compute_cost"] >= true_best - 1e-9
        if model_best is not None and st["plan_source"] == "ilp":
            assert graph.total_cost * (1 + st["objective"]) == pytest.approx(model_best), budget
        if all(q == p for p, _, q in plans if p <= budget):
            assert st["compute_cost"] == pytest.approx(true_best), budget
        try:
            whole = solve(graph, budget, "bonsai", space="regions", granularity=m, save_self_contained=False, save_ops=False,
                          reuse=False).stats["compute_cost"]
        except BudgetError:
            whole = np.inf
        assert st["compute_cost"] <= whole + 1e-9


# f1 is a costly op (a matmul) between two cheap ones; f2 reads f1 and, as a residual add does, f0.
# Segments alone must keep f0 (f2 reads it from outside any segment without f2) or rebuild f1; a
# recomputed [f0 f1 f2] that saves f1 drops f0 and rebuilds only f0.
SKIP_OVER_MATMUL = {"format": "bonsai-graph", "version": 1, "name": "skip_over_matmul", "fixed_mem": 0, "nodes": [
    {"id": 0, "name": "f0", "phase": "forward", "cost": 1, "mem": 8, "deps": []},
    {"id": 1, "name": "f1", "phase": "forward", "cost": 20, "mem": 2, "deps": [0]},
    {"id": 2, "name": "f2", "phase": "forward", "cost": 1, "mem": 2, "deps": [1, 0]},
    {"id": 3, "name": "f3", "phase": "forward", "cost": 1, "mem": 1, "deps": [2]},
    {"id": 4, "name": "g3", "phase": "backward", "cost": 1, "mem": 1, "deps": [2]},
    {"id": 5, "name": "g2", "phase": "backward", "cost": 1, "mem": 1, "deps": [4]},
    {"id": 6, "name": "g1", "phase": "backward", "cost": 1, "mem": 1, "deps": [5, 0, 1]},
    {"id": 7, "name": "g0", "phase": "backward", "cost": 1, "mem": 1, "deps": [6]}]}


def test_a_recomputed_segment_saves_its_costly_op_and_drops_the_cheap_ones_around_it():
    g = Graph.from_dict(SKIP_OVER_MATMUL)
    budget = 12  # the no-remat peak is 13: f0 must go before g3 runs
    whole = solve(g, budget, "bonsai", space="regions", save_ops=False, reuse=False).stats
    st = solve(g, budget, "bonsai", space="regions", save_ops=True, reuse=False)
    plan = CheckpointPlan.from_extra(st.extra)
    assert st.stats["peak"] <= budget and 1 in plan.saved
    assert st.stats["compute_cost"] == pytest.approx(g.total_cost + 1)  # f0 rebuilt, f1 not
    assert whole["compute_cost"] > st.stats["compute_cost"]


# The forward pass peaks at f2 unless f0, read by f1 and the backward pass, is freed after f1: only a
# segment that drops its output can do that.
FORWARD_PEAK = {"format": "bonsai-graph", "version": 1, "name": "forward_peak", "fixed_mem": 0, "nodes": [
    {"id": 0, "name": "f0", "phase": "forward", "cost": 1, "mem": 8, "deps": []},
    {"id": 1, "name": "f1", "phase": "forward", "cost": 1, "mem": 1, "deps": [0]},
    {"id": 2, "name": "f2", "phase": "forward", "cost": 1, "mem": 8, "deps": [1]},
    {"id": 3, "name": "g2", "phase": "backward", "cost": 1, "mem": 1, "deps": [1]},
    {"id": 4, "name": "g1", "phase": "backward", "cost": 1, "mem": 1, "deps": [0, 3]},
    {"id": 5, "name": "g0", "phase": "backward", "cost": 1, "mem": 1, "deps": [4]}]}


def all_plans_saving_self_contained(graph: Graph):
    """Every checkpoint plan, each recomputed segment saving its self-contained nodes when it holds
    others too (bonsai's default)."""
    from bonsai_core.segment import segment
    from bonsai_core.solvers.bonsai_coef import self_contained

    seg = segment(graph, 1)
    constant = dict(zip(seg.forward.tolist(), self_contained(graph).tolist()))
    for plan in all_plans(graph):
        saved = []
        for i in plan.recomputed:
            constants = [v for v in plan.segments[i] if constant[v]]
            if len(constants) < len(plan.segments[i]):
                saved += constants
        yield CheckpointPlan(plan.segments, plan.recomputed, frozenset(), frozenset(saved))


@pytest.mark.parametrize("graph", sweep([masked_net(s, n) for s, n in ((0, 5), (1, 5), (3, 5), (8, 5), (2, 6), (5, 6))], 2),
                         ids=lambda g: g.name)
def test_saving_self_contained_is_optimal_in_its_model(graph):
    """Graphs with a mask-like constant, against every plan whose recomputed segments save their
    self-contained nodes: the model bounds every plan's simulated peak; at every budget the ILP's
    optimum is the cheapest plan whose modelled peak fits, the schedule fits, and it is the true
    optimum where the model is exact."""
    m = int(graph.is_forward.sum())
    built = B.build(graph, m, save_ops=False)
    assert built.saving.any()
    plans = []
    for plan in all_plans_saving_self_contained(graph):
        sim = simulate(graph, plan_schedule(graph, useful_saved(graph, plan), "brute"))
        plans.append((sim.peak, sim.compute_cost, modelled_peak(built, plan)))
    assert all(q >= p for p, _, q in plans)
    for budget in sorted({p for p, _, _ in plans} | {q for _, _, q in plans}):
        true_best = min((c for p, c, _ in plans if p <= budget), default=None)
        model_best = min((c for _, c, q in plans if q <= budget), default=None)
        if true_best is None:
            continue
        st = solve(graph, budget, "bonsai", space="regions", granularity=m, save_ops=False).stats
        assert st["peak"] <= budget and st["compute_cost"] >= true_best - 1e-9
        if model_best is not None:
            ilp = st["objective"] if st["plan_source"] == "ilp" else st["ilp_overhead"]
            assert graph.total_cost * (1 + ilp) == pytest.approx(model_best), budget
        if all(q == p for p, _, q in plans if p <= budget):
            assert st["compute_cost"] == pytest.approx(true_best), budget


def test_a_segment_saves_the_mask_instead_of_rebuilding_it():
    """masked_net(1): at 36 bytes the cheapest plan recomputes the segment f1, ones, tril, f2 but saves
    tril (cost 29); ``ones``, which only tril reads, is then neither saved nor rebuilt (saved, SAC's
    storage would hold it to the rebuild for nothing). Rebuilding the mask too costs 30."""
    g = masked_net(1, 5)
    s = solve(g, 36, "bonsai", space="regions", granularity=5, save_ops=False)
    assert s.stats["compute_cost"] == pytest.approx(29) and s.stats["self_contained_saved"] == 1
    plan = CheckpointPlan.from_extra(s.extra)
    assert [g.names[v] for v in sorted(plan.saved)] == ["tril"]
    assert solve(g, 36, "bonsai", space="regions", granularity=5, save_self_contained=False, save_ops=False).stats["compute_cost"] == pytest.approx(30)


def test_the_data_starts_at_the_first_op_that_reads_it_not_at_a_mask_made_from_its_shape():
    """Hugging Face LMs build ``attention_mask = ones_like(input_ids)`` before the embedding reads the
    ids. The mask is self-contained; the embedding and every op after it that reads it are not (taking
    the mask for the data's root made bonsai save a block's matmuls as "self-contained")."""
    from bonsai_core.solvers.bonsai_coef import self_contained

    g = Graph.from_nodes("hf_like", 0, [
        dict(name="ones_like", op="aten.ones_like.default", cost=1, mem=4, deps=[]),
        dict(name="embedding", op="aten.embedding.default", cost=1, mem=8, deps=[]),
        dict(name="addmm", op="aten.addmm.default", cost=4, mem=8, deps=[1]),
        dict(name="mask_bias", op="aten.sub.Tensor", cost=1, mem=4, deps=[0]),
        dict(name="scores", op="aten.add.Tensor", cost=1, mem=8, deps=[2, 3]),
        dict(name="loss", op="aten.sum.default", cost=1, mem=4, deps=[4]),
        dict(name="loss_grad", op="aten.ones_like.default", phase="backward", cost=1, mem=4, deps=[5]),
        dict(name="scores_grad", op="aten.expand.default", phase="backward", cost=1, mem=8, deps=[6]),
    ])
    assert dict(zip(g.names, self_contained(g).tolist())) == {
        "ones_like": True, "embedding": False, "addmm": False, "mask_bias": True, "scores": False, "loss": False}


def all_plans_dropping_outputs(graph: Graph):
    """Every checkpoint plan, each recomputed segment with its outputs kept or dropped (the valid ones:
    no dropped output read by a recomputed segment)."""
    from bonsai_core.errors import ScheduleError
    from bonsai_core.regions import dropped_nodes

    for plan in all_plans(graph):
        rec = sorted(plan.recomputed)
        for flags in itertools.product([False, True], repeat=len(rec)):
            opened = CheckpointPlan(plan.segments, plan.recomputed, frozenset(i for i, f in zip(rec, flags) if f))
            try:
                dropped_nodes(graph, opened)
            except ScheduleError:
                continue
            yield opened


def modelled_peak_dropping_outputs(built, plan: CheckpointPlan) -> int:
    """:func:`modelled_peak` with segments that drop their outputs: their coefficients come from
    ``built.coefs`` (a segment whose outputs no later forward op reads is the same as kept)."""
    from bonsai_core.solvers.bonsai_coef import memory_steps

    seg, m = built.seg, len(built.seg.forward)
    pos = {int(v): i for i, v in enumerate(seg.forward)}
    index = {(int(a), int(b)): c for c, (a, b) in enumerate(zip(seg.starts, seg.ends))}
    memory = built.plain.memory
    total = np.zeros(len(memory))
    for i in sorted(plan.recomputed):
        c = index[(min(pos[v] for v in plan.segments[i]), max(pos[v] for v in plan.segments[i]) + 1)]
        opened = built.coefs[True, 0]
        has_readers = opened.reader_ptr[c + 1] > opened.reader_ptr[c]
        coef = opened if i in plan.drop_outputs and has_readers else built.coef
        total += np.asarray(memory_steps(coef, np.array([c]), m, points=len(memory)).sum(axis=1)).ravel()
    return int((memory + np.cumsum(total)).max())


@pytest.mark.parametrize("graph", sweep([Graph.from_dict(FORWARD_PEAK), Graph.from_dict(MUL8), random_net(0, n=5),
                                         random_net(1, 5, views=True), random_net(2, 5, views=True), reader_net(4, 5),
                                         random_net(4, n=6), reader_net(0, 6), reader_net(3, 6)], 6),
                         ids=lambda g: g.name)
def test_dropping_outputs_is_optimal_in_its_model_and_never_worse(graph):
    """drop_outputs=True against every plan of the larger space: the model bounds every plan's peak; at
    every budget the ILP's optimum is
    the cheapest plan whose modelled peak fits (outputs kept or dropped), the schedule fits the
    budget, and it never costs more than the plan with outputs kept, nor than the true optimum of the
    larger space where the model is exact."""
    m = int(graph.is_forward.sum())
    built = B.build(graph, m, drop_outputs=True, save_ops=False)
    plans = []
    for plan in all_plans_dropping_outputs(graph):
        sim = simulate(graph, plan_schedule(graph, plan, "brute"))
        plans.append((sim.peak, sim.compute_cost, modelled_peak_dropping_outputs(built, plan)))
    assert built.drops_outputs.any()  # the larger space is at work on these graphs
    assert all(q >= p for p, _, q in plans)  # the model bounds every plan's simulated peak
    for budget in sorted({p for p, _, _ in plans} | {q for _, _, q in plans}):
        true_best = min((c for p, c, _ in plans if p <= budget), default=None)
        model_best = min((c for _, c, q in plans if q <= budget), default=None)
        if true_best is None:
            continue
        st = solve(graph, budget, "bonsai", space="regions", granularity=m, drop_outputs=True, save_ops=False).stats
        assert st["peak"] <= budget and st["compute_cost"] >= true_best - 1e-9
        if model_best is not None:
            ilp = st["objective"] if st["plan_source"] == "ilp" else st["ilp_overhead"]
            assert graph.total_cost * (1 + ilp) == pytest.approx(model_best), budget
        try:
            kept = solve(graph, budget, "bonsai", space="regions", granularity=m, save_ops=False).stats["compute_cost"]
        except BudgetError:
            kept = np.inf
        assert st["compute_cost"] <= kept + 1e-9, budget
        if all(q == p for p, _, q in plans if p <= budget):
            assert st["compute_cost"] == pytest.approx(true_best), budget


def test_dropping_an_output_frees_it_after_its_last_forward_reader():
    """FORWARD_PEAK: recomputing f0 with its output dropped saves its 8 bytes from f2 on (after f1, its
    reader, which must be kept); the model's peak of that plan is the simulator's."""
    from bonsai_core.solvers.bonsai_coef import coefficients

    g = Graph.from_dict(FORWARD_PEAK)
    built = B.build(g, 3, drop_outputs=True, save_ops=False)
    c = next(c for c in range(built.seg.count) if (built.seg.starts[c], built.seg.ends[c]) == (0, 1))
    opened = coefficients(g, built.seg, built.plain, drop_outputs=True)
    assert opened.save_pos[opened.save_ptr[c]:opened.save_ptr[c + 1]].tolist() == [2]
    assert opened.reader_atom[opened.reader_ptr[c]:opened.reader_ptr[c + 1]].tolist() == [1]
    assert built.coef.saved[c] == 0  # with its output kept, f0 saves nothing
    plan = CheckpointPlan.of([[0], [1], [2]], [0], [0])  # f0 alone, its output dropped
    assert simulate(g, plan_schedule(g, plan, "bonsai")).peak == modelled_peak_dropping_outputs(built, plan) == 10
    assert solve(g, 10, "bonsai", space="regions", granularity=3, drop_outputs=True, save_ops=False).stats["peak"] <= 10


def test_a_segment_may_drop_only_outputs_that_kept_segments_read():
    """regions: a dropped output read by a recomputed segment is refused with the nodes named; read by
    a kept segment it is freed after that read and rebuilt before its first backward reader."""
    from bonsai_core.errors import ScheduleError
    from bonsai_core.regions import dropped_nodes

    g = chain(4)
    ids = np.flatnonzero(g.is_forward).tolist()
    with pytest.raises(ScheduleError, match="drops its outputs.*recomputed segment 1"):
        dropped_nodes(g, CheckpointPlan.of([ids[:2], ids[2:]], [0, 1], [0]))
    with pytest.raises(ScheduleError, match="not recomputed"):
        dropped_nodes(g, CheckpointPlan.of([ids[:2], ids[2:]], [1], [0]))
    closed = dropped_nodes(g, CheckpointPlan.of([ids[:2], ids[2:]], [0]))
    opened = dropped_nodes(g, CheckpointPlan.of([ids[:2], ids[2:]], [0], [0]))
    assert not closed[ids[1]] and opened[ids[1]] and opened[ids[0]] == closed[ids[0]]
    plan = CheckpointPlan.of([ids[:2], ids[2:]], [0], [0])
    assert CheckpointPlan.from_extra(plan.to_extra()) == plan
    assert simulate(g, plan_schedule(g, plan, "bonsai")).peak > 0  # the simulator accepts the schedule


def test_mul8_meets_budget_4_at_the_optimum():
    """The issue's smallest case: recomputing b1, b2 (with a, their segment's boundary) fits 4 bytes
    at cost 9; the old `saved > ext` rule pruned it and claimed 5 bytes were needed."""
    g = Graph.from_dict(MUL8)
    s = solve(g, 4, "bonsai", space="regions", save_ops=False)
    assert s.stats["peak"] <= 4 and s.stats["compute_cost"] == pytest.approx(9)
    plan = CheckpointPlan.from_extra(s.extra)
    rebuilt = {v for i in plan.recomputed for v in plan.segments[i]}
    assert {1, 2} <= rebuilt and 3 not in rebuilt


@pytest.mark.parametrize("graph", [chain(5), chain(6, mem=8), random_net(0), random_net(1), random_net(2),
                                   random_net(3, n=7), *(random_net(seed, views=True) for seed in range(3))],
                         ids=lambda g: g.name)
def test_bonsai_matches_brute_force_over_all_checkpoint_plans(graph):
    plans = brute_force(graph)
    peaks = sorted({p for p, _ in plans})
    m = int(graph.is_forward.sum())
    for budget in peaks:
        best = min(c for p, c in plans if p <= budget)
        schedule = solve(graph, budget, "bonsai", space="regions", granularity=m, save_ops=False)
        assert schedule.stats["peak"] <= budget
        assert schedule.stats["compute_cost"] == pytest.approx(best, rel=1e-6), budget
        assert schedule.stats["tightened_by"] == 0


@pytest.mark.parametrize("granularity", range(1, 7))
def test_every_granularity_meets_every_budget_its_candidates_meet_and_finer_never_wins(granularity):
    """At each budget some checkpoint plan meets, bonsai at a set granularity must meet it whenever a
    plan made of that granularity's candidates (or a Chen plan) does, and at the optimum of those
    plans (the model is exact on chains); the coarser granularity never costs more."""
    g = chain(6)
    plans = brute_force_plans(g)
    built = B.build(g, granularity, save_ops=False)
    spans = set(zip(built.seg.starts.tolist(), built.seg.ends.tolist()))
    pos = {int(v): i for i, v in enumerate(built.seg.forward)}

    def expressible(plan):
        return all((min(pos[v] for v in plan.segments[i]), max(pos[v] for v in plan.segments[i]) + 1) in spans
                   for i in plan.recomputed)

    for budget in sorted({p for p, _, _ in plans}):
        best = min((c for p, c, plan in plans if p <= budget and expressible(plan)), default=None)
        if best is None:
            continue
        s = solve(g, budget, "bonsai", space="regions", granularity=granularity, save_ops=False)  # a BudgetError here fails the test
        assert s.stats["peak"] <= budget and s.stats["granularity"] == granularity
        assert s.stats["compute_cost"] == pytest.approx(best), budget
        coarse = solve(g, budget, "bonsai", space="regions", granularity=6, save_ops=False)
        assert coarse.stats["compute_cost"] <= s.stats["compute_cost"] + 1e-9


@pytest.mark.parametrize("graph", [chain(6), random_net(1), reader_net(2, n=6), random_net(0, views=True)],
                         ids=lambda g: g.name)
def test_auto_granularity_meets_every_budget_a_checkpoint_plan_meets_on_small_graphs(graph):
    plans = brute_force(graph)
    for budget in sorted({p for p, _ in plans}):
        s = solve(graph, budget, "bonsai", space="regions", save_ops=False)  # a BudgetError here fails the test
        assert s.stats["peak"] <= budget and s.stats["granularity_mode"] == "auto"
        assert s.stats["compute_cost"] <= min(c for p, c in plans if p <= budget) * 1.0 + 1e-9 or \
            s.stats["model_slack"] > 0


@pytest.mark.parametrize("name", ["resnet", "unet", "vgg", "mlp"])
def test_simulated_peak_respects_the_budget_on_zoo_graphs(traced_zoo, name):
    g = traced_zoo[name].graph
    plain = no_remat_peak(g)
    for frac in (0.9, 0.7, 0.55):
        budget = max(int(plain * frac), g.peak_lower_bound)  # below that, solve() refuses before bonsai runs
        try:
            s = solve(g, budget, "bonsai", space="regions")
        except BudgetError as e:
            smallest = int(re.search(r"\((\d+) bytes\)", str(e)).group(1))
            assert smallest > budget
            s = solve(g, smallest, "bonsai", space="regions")  # the budget it names is one it meets
            budget = smallest
        assert s.stats["peak"] <= budget and s.stats["tightened_by"] == 0
        assert s.stats["model_peak"] >= s.stats["peak"]


def test_model_bounds_the_simulated_peak_of_every_plan_it_can_express(gpt):
    """The memory model is conservative: for random covers and recomputed sets, the modelled peak is
    never below the simulator's (and on these graphs almost always equal)."""
    rng = np.random.default_rng(0)
    for granularity in (None, 5, 60):
        built = B.build(gpt, granularity)
        starts, ends = built.seg.starts[built.candidates], built.seg.ends[built.candidates]
        atoms = built.seg.atom_ptr
        exact = 0
        for _ in range(25):
            rec = np.zeros(len(starts))
            pos = 0
            while pos < len(built.seg.forward):
                options = np.flatnonzero(starts == pos)
                if len(options) and rng.random() < 0.6:
                    c = rng.choice(options)
                    rec[c] = 1
                    pos = ends[c]
                else:  # keep the atom
                    pos = atoms[np.searchsorted(atoms, pos, side="right")]
            plan = built.plan(rec)
            assert built.rec_of(plan) is not None and (built.rec_of(plan) == rec).all()
            sim = simulate(gpt, plan_schedule(gpt, useful_saved(gpt, plan), "bonsai")).peak
            predicted = built.predicted_peak(rec)
            assert predicted >= sim
            exact += predicted == sim
        # Measured with atoms cut before every op (finer covers, more adjacent recomputed segments
        # whose shared inputs and rebuilds the model counts twice): 13/25 exact at auto granularity
        # (slack up to 12.4%), 24 and 21 at 5 and 60; with atoms that glued every view to its base it
        # was 20, 25 and 23 (seeds 1-3 at auto: 10, 8, 18 against 23, 23, 20). A drop below this is
        # a regression.
        assert exact >= 12


def test_rebudget_reuses_the_built_problem_and_matches_a_fresh_solve(gpt):
    plain = no_remat_peak(gpt)
    budgets = [int(plain * f) for f in (0.9, 0.75, 0.9)]
    B._cache.clear()
    first = solve(gpt, budgets[0], "bonsai", space="regions", granularity=30)
    built = B.build(gpt, 30)
    second = solve(gpt, budgets[1], "bonsai", space="regions", granularity=30)
    third = solve(gpt, budgets[2], "bonsai", space="regions", granularity=30)
    assert B.build(gpt, 30) is built
    assert not first.stats["cached"] and second.stats["cached"] and third.stats["cached"]
    assert third.stats["compute_cost"] == pytest.approx(first.stats["compute_cost"])
    B._cache.clear()
    fresh = solve(gpt, budgets[1], "bonsai", space="regions", granularity=30)
    assert fresh.stats["compute_cost"] == pytest.approx(second.stats["compute_cost"])
    assert second.stats["peak"] <= budgets[1] < first.stats["peak"]


def test_a_plan_is_reused_exactly_over_the_budgets_it_fits_below_the_one_it_was_solved_for(gpt):
    plain = no_remat_peak(gpt)
    B._cache.clear()
    high = int(plain * 0.86)
    first = solve(gpt, high, "bonsai", space="regions", gap=0.0)
    low = max(first.stats["model_peak"], first.stats["peak"])
    assert low < high and "reused_from" not in first.stats
    for budget in (low, (low + high) // 2, high):
        again = solve(gpt, budget, "bonsai", space="regions", gap=0.0)
        assert again.stats["reused_from"] == high and again.stats["solve_seconds"] == 0.0
        assert again.extra == first.extra and again.budget == budget and again.stats["peak"] <= budget
        fresh = solve(gpt, budget, "bonsai", space="regions", gap=0.0, reuse=False)  # what solving would have found
        assert "reused_from" not in fresh.stats
        assert again.stats["compute_cost"] == pytest.approx(fresh.stats["compute_cost"])
    below = solve(gpt, low - 1, "bonsai", space="regions", gap=0.0)  # the plan does not fit: solved
    assert "reused_from" not in below.stats and below.stats["peak"] < low
    assert first.budget == high  # the remembered plan is a copy: reuses did not change the first answer
    other_gap = solve(gpt, (low + high) // 2, "bonsai", space="regions", gap=0.01)  # other options, other plans
    assert "reused_from" not in other_gap.stats


def test_infeasible_budget_names_the_smallest_budget_bonsai_meets(gpt):
    lower = gpt.peak_lower_bound
    with pytest.raises(BudgetError, match="smallest budget") as info:
        solve(gpt, lower, "bonsai", space="regions", granularity=10)
    smallest = int(re.search(r"\((\d+) bytes\)", str(info.value)).group(1))
    assert smallest > lower
    assert solve(gpt, smallest, "bonsai", space="regions", granularity=10).stats["peak"] <= smallest
    with pytest.raises(BudgetError):
        solve(gpt, smallest - 4096, "bonsai", space="regions", granularity=10)


@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_both_backends_agree_and_report_their_stats(gpt, backend):
    budget = int(no_remat_peak(gpt) * 0.75)
    s = solve(gpt, budget, "bonsai", space="regions", backend=backend, time_limit=60, gap=1e-4)  # proven, so both agree
    st = s.stats
    for key in ("status", "gap", "variables", "constraints", "build_seconds", "solve_seconds", "segments",
                "candidates", "ilp_candidates"):
        assert key in st
    assert st["status"] == "optimal" and st["backend"] == backend
    assert st["variables"] >= st["ilp_candidates"]
    other = solve(gpt, budget, "bonsai", space="regions", backend="scip" if backend == "highs" else "highs", time_limit=60, gap=1e-4)
    assert st["compute_cost"] == pytest.approx(other.stats["compute_cost"], rel=1e-4)


def test_schedule_carries_the_plan_for_the_explorer_and_exporter(gpt):
    s = solve(gpt, int(no_remat_peak(gpt) * 0.7), "bonsai", space="regions")
    plan = CheckpointPlan.from_extra(s.extra)
    assert plan.recomputed and s.stats["recomputes"] > 0
    assert simulate(gpt, plan_schedule(gpt, plan, "bonsai")).peak == s.stats["peak"]


def test_no_budget_means_nothing_recomputed(gpt):
    s = solve(gpt, None, "bonsai", space="regions")
    assert s.stats["overhead"] == pytest.approx(0.0) and not s.extra["recomputed"]


def test_cli_json_stays_pure_json_with_the_highs_banner(tmp_path):
    """HiGHS prints a banner on stdout at its first use in a process; `bonsai solve --json` must
    still print exactly one JSON object on stdout."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "solve", str(ASSET), "--budget", "80%",
                          "--method", "bonsai", "--backend", "highs", "--json", "-o", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["method"] == "bonsai"


@pytest.mark.slow
def test_gpt2_small_solves_to_optimality():
    from bonsai_core.models.zoo import GPT2_SMALL
    from bonsai_core.trace import trace_model

    g = trace_model("gpt", **GPT2_SMALL).graph
    # Default options (HiGHS, gap 1%): within 1% of the model's optimum; times are in docs/results/bonsai.md.
    for frac in (0.9, 0.7):
        s = solve(g, int(no_remat_peak(g) * frac), "bonsai", time_limit=300, space="regions")
        assert s.stats["status"] == "optimal" or (s.stats["gap"] is not None and s.stats["gap"] <= 0.01)


def test_bonsai_meets_every_budget_chen_meets_at_no_more_overhead(gpt):
    """Chen's plans are in bonsai's space (their segments are candidates, and they are simulated as
    fallback plans), so wherever one fits, bonsai fits at an overhead no higher."""
    plain = no_remat_peak(gpt)
    lowest = min(simulate(gpt, plan_schedule(gpt, plan, "chen")).peak
                 for _, plan in candidate_plans(gpt, "auto"))
    for budget in sorted({int(plain * 0.7), max(int(plain * 0.5), lowest), lowest}):
        chen = solve(gpt, budget, "chen")
        s = solve(gpt, budget, "bonsai", space="regions")  # a BudgetError here fails the test
        assert s.stats["peak"] <= budget
        assert s.stats["overhead"] <= chen.stats["overhead"] + 1e-9, budget


def test_time_limit_bounds_the_whole_call_and_says_when_nothing_was_found(gpt):
    B._cache.clear()
    with pytest.raises(BudgetError, match="time limit"):
        solve(gpt, int(no_remat_peak(gpt) * 0.6), "bonsai", time_limit=1e-9, space="regions")
    s = solve(gpt, int(no_remat_peak(gpt) * 0.6), "bonsai", time_limit=60, space="regions")
    assert s.stats["status"] in ("optimal", "feasible")


def test_stats_say_which_granularity_auto_chose_and_a_set_one_is_kept(gpt):
    from bonsai_core.segment import default_granularity

    budget = int(no_remat_peak(gpt) * 0.7)
    auto = solve(gpt, budget, "bonsai", space="regions")
    assert auto.stats["granularity_mode"] == "auto" and auto.stats["granularity"] in B.auto_ladder(gpt)
    assert auto.stats["granularities_tried"][0] == default_granularity(gpt)
    fixed = solve(gpt, budget, "bonsai", space="regions", granularity=7)
    assert fixed.stats["granularity"] == 7 and fixed.stats["granularity_mode"] == "set"


@pytest.mark.parametrize("bad", [-0.1, 1.0, "1%", True])
def test_bad_gap_is_refused_with_a_clear_message(bad):
    from bonsai_core.errors import SolverError

    with pytest.raises(SolverError, match="relative MIP gap"):
        solve(chain(3), None, "bonsai", space="regions", gap=bad)


@pytest.mark.parametrize("graph", sweep([random_net(0), random_net(3), random_net(1, 5, views=True), random_net(2, 5, views=True),
                                         reader_net(1, n=6), Graph.from_dict(MUL8), masked_net(0, n=5)], 6),
                         ids=lambda g: g.name)
def test_no_checkpoint_plan_peaks_below_the_region_bound(graph):
    """Every plan, with its recomputed segments keeping or dropping their outputs, peaks at or above
    ``region_peak_bound``; where the plain peak is in the backward pass the bound is that peak's
    backward part plus the op's inputs, so it is above the per-op lower bound or equal to it."""
    from bonsai_core.regions import region_peak_bound

    bound = region_peak_bound(graph)
    peaks = [simulate(graph, plan_schedule(graph, plan, "brute")).peak for plan in all_plans_dropping_outputs(graph)]
    assert min(peaks) >= bound.peak >= graph.fixed_mem
    assert bound.node >= 0 and not graph.is_forward[bound.node]


def test_the_region_bound_is_met_on_a_graph_whose_peak_is_a_backward_tensor():
    """The backward pass's big tensor g1 (an input gradient bundled with a weight gradient) is held by
    its view v1 until g3 reads it; at g2 every plan holds g1 and g2, so no plan goes below
    fixed + g1 + g2, and dropping f0 (read again only by g3) until g3 is all a plan can do."""
    nodes = [dict(name="f0", phase="forward", cost=1, mem=4, deps=[]),
             dict(name="f1", phase="forward", cost=1, mem=4, deps=[0]),
             dict(name="loss", phase="forward", cost=1, mem=1, deps=[1]),
             dict(name="g1", phase="backward", cost=1, mem=40, deps=[1, 2]),
             dict(name="v1", phase="backward", cost=0, mem=0, deps=[3], alias_of=3),
             dict(name="g2", phase="backward", cost=1, mem=30, deps=[4]),
             dict(name="g3", phase="backward", cost=1, mem=2, deps=[0, 4])]
    g = Graph.from_nodes("held-gradient", 100, nodes)
    from bonsai_core.regions import region_peak_bound

    bound = region_peak_bound(g)
    assert g.names[bound.node] == "g2" and bound.peak == 100 + 40 + 30 and bound.backward_bytes == 70
    assert no_remat_peak(g) == bound.peak + 4  # f0 is live at g2 in the plain schedule
    assert min(p for p, _ in brute_force(g)) == bound.peak
    assert solve(g, bound.peak, "bonsai", space="regions", reuse=False).stats["peak"] == bound.peak


def test_a_small_unet_reaches_only_the_region_bound_and_moccasin_goes_below_it():
    """The traced small U-Net: its plain peak is in the backward pass, where the concat's input
    gradient (with its conv's weight gradient, one node) is held by the skip slice until the encoder's
    backward adds it. Bonsai with dropped outputs reaches the bound every checkpoint plan obeys, to
    within the loss the step holds to its end (the bound counts backward tensors and the op's inputs,
    not the 8-byte loss); below the bound, its error names the bound and moccasin, which recomputes
    that backward op."""
    from bonsai_core.regions import region_peak_bound
    from bonsai_core.trace import trace_model

    g = trace_model("unet", batch=1, image=4, layers=1, width=16).graph
    bound = region_peak_bound(g)
    peak = no_remat_peak(g)
    assert g.peak_lower_bound < bound.peak < peak and bound.peak > 0.98 * peak
    assert g.names[bound.node] == "convolution_backward_4"
    loss = int(g.mem[g.names.index("nll_loss2d_forward")])
    s = solve(g, bound.peak + loss, "bonsai", space="regions", drop_outputs=True, reuse=False)
    assert s.stats["peak"] == bound.peak + loss
    with pytest.raises(BudgetError, match="No checkpoint plan fits below") as info:
        solve(g, bound.peak - 1, "bonsai", space="regions", drop_outputs=True, reuse=False)
    assert "moccasin" in str(info.value)
    half = (g.peak_lower_bound + peak) // 2
    m = solve(g, half, "moccasin", time_limit=60)
    recomputed = {v for k, v in m.ops if k == "compute"}
    twice = [v for v in recomputed if sum(1 for k, u in m.ops if k == "compute" and u == v) > 1]
    assert m.stats["peak"] <= half and any(not g.is_forward[v] for v in twice)


def test_solve_seconds_is_the_wall_time_of_the_whole_call_and_says_where_it_went(gpt):
    """The reported time includes the model's build (a cold cache here), the MILP, the simulator's
    checks and the fallback plans: it is the call's wall time, split by part."""
    import time

    B._cache.clear()
    start = time.perf_counter()
    s = solve(gpt, int(no_remat_peak(gpt) * 0.6), "bonsai", reuse=False, space="regions")
    wall = time.perf_counter() - start
    st = s.stats
    assert {"profile", "build", "solve", "validate"} <= set(st["time_split"])
    assert st["time_split"]["build"] > 0
    assert sum(st["time_split"].values()) <= st["solve_seconds"] + 1e-2
    assert st["solve_seconds"] <= st["wall_seconds"] <= wall
    assert st["solve_seconds"] >= st["milp_seconds"] + st["time_split"]["build"] - 1e-2
