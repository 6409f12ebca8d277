"""A tensor parallel rank's step compiled (bonsai_core/rank.py with compile, bonsai_core/trace/compiled.py):
torchtitan's order (Float8 linears, tensor parallel with torchao's Float8 styles, full checkpointing, each
block compiled), recorded on the rank's local shards."""

from __future__ import annotations

import pytest

from bonsai_core.fsdp import with_fsdp
from bonsai_core.graph import block_stack
from bonsai_core.parallel import layout_of
from bonsai_core.rank import trace
from bonsai_core.schedule import simulate
from bonsai_core.solvers import solve

pytest.importorskip("torchtitan")
pytest.importorskip("torchao")

MODEL = "torchtitan:llama3:debugmodel"
SIZES = dict(layers=2, seq=256, batch=2)


@pytest.fixture(scope="module")
def ranks():
    """The TP 2 rank eager (torchtitan's full checkpointing as a plan) and compiled (its apply_ac, Float8)."""
    layout = layout_of(tp=2)
    eager = trace(MODEL, layout, **SIZES).graph
    compiled = trace(MODEL, layout, compile="blocks", ac="torchtitan-full", float8=True, **SIZES).graph
    return eager, compiled


def _bytes_of(graph, kind: str) -> int:
    return sum(nbytes for _, nbytes, k in graph.fixed_tensors if k == kind)


def test_a_compiled_tensor_parallel_rank_holds_its_local_shards(ranks):
    """Parameters as the rank's DTensor shards hold them (the eager rank's bytes), nothing counted at the
    global shape: no constant but scalars (a DTensor wrapper read as an earlier storage would be one) and no tensor larger than the
    rank's logits shard (DTensor's sharding propagation runs ops on fake global-shape tensors)."""
    eager, compiled = ranks
    assert _bytes_of(compiled, "param") == _bytes_of(eager, "param") > 0
    # what the step reads from before it: scalars at most (Float8's), never a wrapper's global-shape bytes
    assert all(nbytes <= 8 for _, nbytes, kind in compiled.fixed_tensors if kind == "constant")
    vocab, tokens = 2048, SIZES["batch"] * SIZES["seq"]
    assert max(compiled.mem) <= tokens * vocab // 2 * 4  # fp32 logits shard: vocab sharded over TP 2
    assert any("all_gather_into_tensor" in op for op in compiled.ops)  # sequence parallel's collectives
    assert "float8" in compiled.name and "compiled (blocks, torchtitan-full)" in compiled.name


def test_compiled_blocks_under_full_checkpointing_hold_what_eager_blocks_hold(ranks):
    """Full checkpointing saves each block's sequence-sharded input, compiled or not: the plain compiled
    step's peak over its fixed bytes is the eager step's under torchtitan's full plan, within the small
    tensors (statistics, RNG states) in which the two traces differ."""
    eager, compiled = ranks
    eager_peak = simulate(eager, solve(eager, None, "torchtitan-full")).peak - eager.fixed_mem
    compiled_peak = simulate(compiled, solve(compiled, 2**60, "none")).peak - compiled.fixed_mem
    assert abs(compiled_peak - eager_peak) <= 0.05 * eager_peak, (compiled_peak, eager_peak)


def _sharded_over_two(graph):
    """``graph`` as one of 2 FSDP ranks holds it, ``fully_shard`` on each block."""
    return with_fsdp(graph, 2, [(path, first, last, 0) for path, first, last in block_stack(graph)], root=0)


def test_fsdp_shards_a_compiled_ranks_replicated_gradient_as_its_parameter(ranks):
    """DTensor's embedding backward has no row-wise strategy: the vocabulary-sharded embedding's gradient is
    replicated, on the rank at the full vocabulary (both traces record it so, as ``AccumulateGrad`` keeps it
    without FSDP). FSDP2 redistributes it to its parameter's shard before the reduce-scatter, pairing each
    ``<name>.grad`` with its parameter ``<name>``: the compiled rank names its gradients so, and sharded its
    gradients are the eager rank's, each its parameter's bytes."""
    eager, compiled = ranks
    params = {name for name, _, kind in compiled.fixed_tensors if kind == "param"}
    assert all(name.removesuffix(".grad") in params for name, _, kind in compiled.fixed_tensors if kind == "grad")
    assert _bytes_of(compiled, "grad") == _bytes_of(eager, "grad") > _bytes_of(eager, "param")
    eager, compiled = map(_sharded_over_two, ranks)
    assert _bytes_of(compiled, "grad") == _bytes_of(eager, "grad") == _bytes_of(eager, "param")


@pytest.mark.slow
def test_a_compiled_fsdp_and_tensor_parallel_rank_holds_the_eager_ranks_gradients():
    """The debugmodel's FSDP 2 x TP 2 rank, compiled block by block: its sharded gradients are the eager
    rank's, each its parameter's bytes, the vocabulary-sharded embedding's included."""
    layout = layout_of(fsdp=2, tp=2)
    eager = trace(MODEL, layout).graph
    compiled = trace(MODEL, layout, compile="blocks").graph
    assert _bytes_of(compiled, "grad") == _bytes_of(eager, "grad") == _bytes_of(eager, "param")


@pytest.mark.parametrize("layout, kwargs, says", [
    (dict(tp=2, cp=2), dict(compile="blocks"), "not traced yet"),
    (dict(tp=2, pp=2), dict(compile="blocks"), "not traced yet"),
    (dict(tp=2), dict(compile="model"), "give --compile blocks"),
    (dict(tp=2), dict(float8=True), "give --compile"),
])
def test_a_compiled_rank_it_cannot_trace_is_refused(layout, kwargs, says):
    from bonsai_core.errors import BonsaiError

    with pytest.raises(BonsaiError, match=says):
        trace(MODEL, layout_of(**layout), **kwargs, **SIZES)
