"""In-place writes during the step (simulator rule 8): what the tracer records, how the simulator and the
allocator model count them, and how coop and dtr run them (Coop's recomputable in-place)."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from bonsai_core.allocator import layout_at, replay
from bonsai_core.solvers.pool import pool_replay
from bonsai_core.errors import GraphError
from bonsai_core.graph import Graph
from bonsai_core.models.zoo import CrossEntropyLoss
from bonsai_core.schedule import COMPUTE, FREE, inplace_writes, no_remat_peak, none_schedule, simulate
from bonsai_core.solvers import solve
from bonsai_core.trace import trace_model, trace_step


def _toy(inplace: bool = True) -> Graph:
    """x -> a -> r (relu_ of a) -> loss, and the backward reading r: a is r's input and dies with it."""
    nodes = [dict(name="x", phase="forward", cost=1, mem=100, deps=[]),
             dict(name="a", phase="forward", cost=1, mem=1000, deps=[0]),
             dict(name="r", phase="forward", cost=1, mem=1000, deps=[1], inplace_of=1 if inplace else None),
             dict(name="loss", phase="forward", cost=1, mem=4, deps=[2]),
             dict(name="grad", phase="backward", cost=1, mem=100, deps=[0, 2, 3])]
    return Graph.from_nodes("toy", 0, nodes)


# -- the graph field ---------------------------------------------------------------------------------

def test_the_field_round_trips_and_graphs_without_it_keep_their_hash():
    g = _toy()
    assert Graph.from_dict(g.to_dict()).inplace_of.tolist() == [-1, -1, 1, -1, -1]
    plain = _toy(inplace=False)
    assert "inplace_of" not in plain.to_dict()["nodes"][2]
    assert plain.hash != g.hash and g.node(2).inplace_of == 1 and plain.node(2).inplace_of is None


@pytest.mark.parametrize("change, message", [
    (dict(inplace_of=0), "does not read it"),
    (dict(mem=500), "same bytes"),
])
def test_an_impossible_inplace_write_is_refused(change, message):
    data = _toy().to_dict()
    data["nodes"][2].update(change)
    with pytest.raises(GraphError, match=message):
        Graph.from_dict(data)


def test_a_write_into_an_input_read_later_is_refused():
    data = _toy().to_dict()
    data["nodes"][4]["deps"] = [0, 1, 2, 3]  # the backward reads a, which r overwrote
    with pytest.raises(GraphError, match="reads 1 after it"):
        Graph.from_dict(data)


# -- the simulator and the allocator model -------------------------------------------------------------

def test_the_simulator_counts_an_inplace_step_once():
    g, plain = _toy(), _toy(inplace=False)
    ops = none_schedule(g).ops
    at_r = ops.index((COMPUTE, 2))
    assert inplace_writes(g, ops) == {at_r: ops.index((FREE, 1))}
    with_rule, without = simulate(g, ops), simulate(plain, ops)
    assert without.timeline[at_r] == 2100 and with_rule.timeline[at_r] == 1100
    # after the free of a the two agree: r holds the bytes a held
    assert (with_rule.timeline[at_r + 1:] == without.timeline[at_r + 1:]).all()
    assert (without.peak, with_rule.peak) == (2100, 1204)
    # the per-op bound knows it too: at r only a's bytes (and x's are not r's input)
    assert (plain.peak_lower_bound, g.peak_lower_bound) == (2000, 1204)


def test_an_input_kept_after_the_write_is_not_overwritten():
    g = _toy()
    ops = [(COMPUTE, 0), (COMPUTE, 1), (COMPUTE, 2), (COMPUTE, 3), (FREE, 1), (COMPUTE, 4)]
    assert inplace_writes(g, ops) == {}
    assert simulate(g, ops).timeline[2] == 2100


def test_the_allocator_model_writes_the_output_into_its_inputs_block():
    g = _toy()
    ops = none_schedule(g).ops
    at_r = ops.index((COMPUTE, 2))
    before = {p.name: p.addr for p in layout_at(g, ops, at_r - 1)}
    after = {p.name: p.addr for p in layout_at(g, ops, at_r)}
    assert after["r"] == before["a"] and "a" not in after
    in_place = replay(g, ops, capacity=10**6, policy="arena", full=False)
    copied = replay(g, ops, capacity=10**6, policy="arena", full=False, inplace_writes=False)
    assert in_place.reserved[at_r] < copied.reserved[at_r]


# -- the tracer --------------------------------------------------------------------------------------

class _Block(nn.Module):
    """A residual MLP block written the way CNN code often is: ReLU(inplace=True), ``out += x``, ``relu_``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin1, self.bn, self.act = nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(inplace=True)
        self.lin2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin2(self.act(self.bn(self.lin1(x))))
        out += x
        return torch.relu_(out)


def _traced_block() -> Graph:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), nn.Linear(16, 4)).train()
    return trace_step(model, (torch.randn(8, 16),), CrossEntropyLoss(torch.randint(0, 4, (8,))), name="block").graph


@pytest.fixture(scope="module")
def block() -> Graph:
    return _traced_block()


def test_the_tracer_records_each_activation_eager_overwrites(block):
    written = np.flatnonzero(block.inplace_of >= 0)
    assert [block.ops[v] for v in written] == ["aten.relu.default", "aten.add.Tensor", "aten.relu.default"] * 2
    for v in written:
        u = int(block.inplace_of[v])
        assert block.is_forward[v] and u in block.deps(v) and block.mem[u] == block.mem[v]
    # the relu_ after the residual add overwrites the add's output, itself written into the linear's
    add, relu = written[1], written[2]
    assert block.inplace_of[relu] == add and block.ops[block.inplace_of[add]] == "aten.addmm.default"


def test_a_model_without_inplace_ops_records_none():
    assert not (trace_model("gpt", batch=2, seq=16, width=32, layers=1, heads=2, vocab=64).graph.inplace_of >= 0).any()


@pytest.mark.parametrize("spec, options, count, op", [
    ("hf:resnet", {}, 8, "aten.add.Tensor"),  # transformers: hidden_state += residual
    ("tests.real_models:resnet18_bn", dict(batch=4, image=32, width=16), 17, "aten.relu.default"),  # torchvision style
])
def test_models_we_did_not_write_have_their_inplace_ops_recorded(spec, options, count, op):
    g = trace_model(spec, **options).graph
    written = np.flatnonzero(g.inplace_of >= 0)
    assert len(written) == count and {g.ops[v] for v in written} == {op}
    plain = Graph.from_dict({**g.to_dict(), "nodes": [{k: x for k, x in nd.items() if k != "inplace_of"}
                                                      for nd in g.to_dict()["nodes"]]})
    assert no_remat_peak(g) <= no_remat_peak(plain)


# -- coop and dtr: recomputable in-place ---------------------------------------------------------------

def test_dtr_writes_in_place_where_a_fresh_output_would_not_fit():
    g = _toy()
    s = solve(g, 1204, "dtr", budget_hint=False)
    assert s.stats["evictions"] == 0 and simulate(g, s).peak == 1204
    with pytest.raises(Exception, match="cannot run node 2"):
        solve(g, 1204, "dtr", budget_hint=False, inplace_writes=False)


@pytest.mark.parametrize("method, options", [("coop", {}), ("dtr", {"allocator": True, "full_arena": True}),
                                             ("dtr", {})])
@pytest.mark.parametrize("frac", [0.95, 0.85, 0.75])
def test_eviction_runs_write_in_place_and_their_pool_replays_block_for_block(block, method, options, frac):
    budget = max(int(frac * no_remat_peak(block)), block.peak_lower_bound)
    for inplace in (True, False):
        try:
            s = solve(block, budget, method, budget_hint=False, inplace_writes=inplace, **options)
        except Exception:  # noqa: BLE001 (a heuristic may not train in every pool; the others are checked)
            continue
        written = inplace_writes(block, s.ops)
        assert s.stats["inplace_writes"] is inplace
        if not inplace and s.stats.get("allocator") == "arena":  # copy-on-write: a block of its own each time
            assert pool_replay(block, s).reserved_peak == s.stats["pool_high_water"]
        if inplace:
            assert written, "every run computes the block's in-place ops at least once, in place"
            if s.stats.get("allocator") == "arena":
                assert pool_replay(block, s).reserved_peak == s.stats["pool_high_water"]
