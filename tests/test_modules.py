"""The user's module structure in the graph (``Graph.modules``) and what Bonsai does with it."""

import pytest

from bonsai_core.errors import GraphError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, block_plans, block_stack, plan_schedule
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import solve
from bonsai_core.solvers.bonsai import build
from bonsai_core.trace import trace_model
from tests.graphs import chain

GPT4 = dict(batch=2, seq=32, width=64, layers=4, heads=2, vocab=128)


@pytest.fixture(scope="module")
def gpt4() -> Graph:
    return trace_model("gpt", **GPT4).graph


def _span(graph: Graph, path: str) -> tuple[int, int]:
    return next((first, last) for p, first, last in graph.modules if p == path)


def test_the_trace_records_every_block_and_its_parts(gpt4):
    paths = [p for p, _, _ in gpt4.modules]
    assert [p for p in paths if p.count(".") == 1] == [f"blocks.{i}" for i in range(4)]
    for i in range(4):
        first, last = _span(gpt4, f"blocks.{i}")
        # a pre-norm block: from its first layer norm to its last residual add, forward nodes only
        assert gpt4.ops[first] == "aten.native_layer_norm.default" and gpt4.ops[last] == "aten.add.Tensor"
        assert gpt4.is_forward[first:last + 1].all()
        for part in ("attn", "fc", "out"):
            a, b = _span(gpt4, f"blocks.{i}.{part}")
            assert first <= a <= b <= last
    assert [p for p, _, _ in block_stack(gpt4)] == [f"blocks.{i}" for i in range(4)]


def test_a_hugging_face_model_gets_its_blocks_too():
    g = trace_model("hf:gpt2", layers=2, width=32, heads=2, seq=16, vocab=64, batch=2).graph
    assert [p for p, _, _ in block_stack(g)] == ["model.transformer.h.0", "model.transformer.h.1"]
    first, last = _span(g, "model.transformer.h.1.mlp.act")  # GPT-2's tanh GELU: a run of elementwise ops
    assert {g.ops[v] for v in range(first, last + 1)} >= {"aten.tanh.default", "aten.pow.Tensor_Scalar"}


def test_modules_survive_json_and_bad_entries_are_refused(gpt4):
    assert Graph.from_dict(gpt4.to_dict()).modules == gpt4.modules
    doc = chain(3).to_dict()  # forward nodes 0..2, backward 3..5
    assert Graph.from_dict({**doc, "modules": [["layer", 0, 1]]}).modules == (("layer", 0, 1),)
    for bad, words in [([["layer", 2, 1]], "first <= last"), ([["layer", 0, 4]], "forward node ids"),
                       ([["layer", 0]], "triples"), ("layer", "triples")]:
        with pytest.raises(GraphError, match=words):
            Graph.from_dict({**doc, "modules": bad})


def test_block_plans_checkpoint_every_kth_block(gpt4):
    blocks = block_stack(gpt4)
    plans = dict(block_plans(gpt4))
    assert list(plans) == ["per-block every 1", "per-block every 2", "per-block every 4"]
    for k, plan in zip((1, 2, 4), plans.values()):
        recomputed = [plan.segments[i] for i in sorted(plan.recomputed)]
        assert recomputed == [tuple(range(first, last + 1)) for _, first, last in blocks[::k]]
        assert simulate(gpt4, plan_schedule(gpt4, plan, "test")).recomputes > 0


def test_module_calls_are_bonsai_candidates(gpt4):
    """Each call is a candidate; one that ends with a multi-output op (a LayerNorm) takes in the op's
    separated outputs listed after it (its statistics: the simulator's separated-output rule)."""
    from bonsai_core.segment import splits_an_output

    seg = build(gpt4).seg
    pos = {int(v): p for p, v in enumerate(seg.forward)}
    spans = set(zip(seg.starts.tolist(), seg.ends.tolist()))
    riding = splits_an_output(gpt4, seg.forward)
    taken_in = 0
    for _, first, last in gpt4.modules:
        end = pos[last] + 1
        while riding[end]:
            end += 1
        taken_in += end > pos[last] + 1
        assert (pos[first], end) in spans
    assert taken_in > 0


def test_bonsai_is_never_above_per_block_checkpointing(gpt4):
    """Wherever a per-block plan fits, bonsai meets its peak at no more compute (its fallback plans and
    candidates contain the plan; the ILP may find a cheaper one)."""
    for label, plan in block_plans(gpt4):
        per_block = simulate(gpt4, plan_schedule(gpt4, plan, "test"))
        s = solve(gpt4, per_block.peak, method="bonsai")
        sim = simulate(gpt4, s)
        assert sim.peak <= per_block.peak, label
        assert sim.compute_cost <= per_block.compute_cost * (1 + 1e-9), (label, s.stats)


def test_graphs_without_modules_have_no_block_plans_and_no_module_regions():
    g = chain(6)
    assert g.modules == () and block_stack(g) == [] and block_plans(g) == []
    with pytest.raises(SolverError, match="records no module calls"):
        solve(g, no_remat_peak(g), method="bonsai", regions="modules")


def test_module_regions_recompute_module_calls_only(gpt4):
    calls = {tuple(range(first, last + 1)) for _, first, last in gpt4.modules}
    budget = (gpt4.peak_lower_bound + no_remat_peak(gpt4)) // 2
    s = solve(gpt4, budget, method="bonsai", regions="modules")
    plan = CheckpointPlan.from_extra(s.extra)
    assert plan.recomputed and all(plan.segments[i] in calls for i in plan.recomputed)
    assert simulate(gpt4, s).peak <= budget and s.stats["regions"] == "modules"
