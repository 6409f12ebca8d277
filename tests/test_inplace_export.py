"""The replay export runs in place what the simulator's rule 8 credits (``schedule.inplace_writes``).

At every schedule position where the simulator gives a node its input's bytes (``inplace_of``, the input
freed right after), the generated program calls the op's in-place overload (``aten.relu_``,
``aten.add_``) on that input, and nowhere else; the step still computes eager's loss and gradients, and
its measured peak is the predicted one. ``tests.export_models:inplace_block`` has its peak at an in-place
``relu_``, so a functional program would measure above the prediction there.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from bonsai_core.export import export_traced, step_signature, verify_export
from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, FREE, Schedule, inplace_writes, none_schedule, simulate
from bonsai_core.trace import trace_model
from tests.test_export import checkpoint_every_other, recompute_before_use
from tests.marks import sweep

MODEL = "tests.export_models:inplace_block"
# (at batch <= 3 this size's BatchNorm statistics are over a quarter of their outputs and stay in the
# op's node, which then holds more bytes than the residual add: no in-place write is recorded)
HF_RESNET = dict(batch=4, image=32, width=8, layers=1)
ATOL = 1e-5


@pytest.fixture(scope="module")
def block():
    return trace_model(MODEL), step_signature(MODEL, {})


def in_place_positions(out, graph: Graph, ops: list[tuple[str, int]]) -> set[int]:
    """Schedule positions whose generated line calls an in-place overload (``torch.ops.aten.<op>_.``),
    after checking that the program has one line per compute, in the schedule's order."""
    text = (out / "checkpointed.py").read_text()
    program = text[text.index("def forward_part"):]
    lines = [(int(m[1]), m[2]) for m in re.finditer(r"^\s+v(\d+) = (.+?)  # (.+)$", program, re.M)
             if m[3] == graph.names[int(m[1])]]  # a compute's line ends with its node's name
    computes = [p for p, (kind, _) in enumerate(ops) if kind == COMPUTE]
    assert [v for v, _ in lines] == [ops[p][1] for p in computes]
    return {p for p, (_, call) in zip(computes, lines) if re.match(r"torch\.ops\.aten\.\w+_\.", call)}


def functional(graph: Graph) -> Graph:
    """``graph`` without its in-place writes: what a program running every op out of place would use."""
    data = graph.to_dict()
    for node in data["nodes"]:
        node.pop("inplace_of", None)
    return Graph.from_dict(data)


def _export_and_verify(traced, signature, schedule: Schedule, out, model: str, options: dict):
    out = export_traced(traced, signature, schedule, out, spec={"model": model, "options": options})
    graph = traced.graph
    assert in_place_positions(out, graph, schedule.ops) == set(inplace_writes(graph, schedule.ops))
    v = verify_export(model, options, out, repeats=0)
    assert v.loss_diff <= ATOL and v.max_grad_diff <= ATOL and v.max_grad_diff_grads_none <= ATOL
    assert v.max_buffer_diff <= ATOL and not v.grads_none_mismatch
    # the autograd engine's 4-byte loss seed, and where the peak is a recomputed batch norm (recompute_before_use
    # at level 2, since the block's scaled input `y` is held to the head as the model's code holds it), the
    # running statistics it makes again (getitem_3/4, 0 bytes in the graph; the program copies them into
    # the buffers): 72 bytes over measured there
    assert abs(v.measured_peak - v.predicted_peak) <= 128
    assert v.predicted_peak == simulate(graph, schedule).peak
    return v


def test_the_in_place_writes_at_the_peak_are_run_in_place(block, tmp_path):
    traced, signature = block
    g = traced.graph
    schedule = none_schedule(g)
    writes = inplace_writes(g, schedule.ops)
    assert len(writes) == int((g.inplace_of >= 0).sum()) == 4  # relu_, ReLU(inplace=True) twice, out += identity
    out_of_place = simulate(functional(g), schedule.ops)
    assert out_of_place.peak_op in writes  # run out of place, the step peaks where it holds the scaled input twice
    assert out_of_place.peak >= simulate(g, schedule).peak + int(g.mem[0]) // 2
    v = _export_and_verify(traced, signature, schedule, tmp_path, MODEL, {})
    assert v.loss_diff == 0 and v.max_grad_diff == 0  # the same kernels eager runs


@pytest.mark.parametrize("make", [checkpoint_every_other, recompute_before_use])
@pytest.mark.parametrize("level", [0, 2])
def test_recomputed_in_place_writes_are_run_in_place_again(block, tmp_path, make, level):
    traced, signature = block
    schedule = make(traced.graph, level)
    computes = [v for kind, v in schedule.ops if kind == COMPUTE]
    _export_and_verify(traced, signature, schedule, tmp_path, MODEL, {})
    if make is recompute_before_use and level == 2:  # every droppable node is rebuilt, relu_1 among them
        assert computes.count(11) > 1 and len(inplace_writes(traced.graph, schedule.ops)) > 4


def test_an_input_kept_past_the_write_gets_a_fresh_output(block, tmp_path):
    """A schedule that frees u later than right after v (another compute between) gets no rule-8 credit
    there: the export runs that op out of place, and the peak is still as predicted."""
    traced, signature = block
    g = traced.graph
    ops = list(none_schedule(g).ops)
    writes = inplace_writes(g, ops)
    p = min(writes)  # the first relu_ on the scaled input
    free = ops.pop(writes[p])
    ops.insert(p + 2, free)  # after the next compute
    assert ops[p + 1][0] == COMPUTE and free == (FREE, int(g.inplace_of[ops[p][1]]))
    schedule = Schedule(g.name, "test-late-free", ops, graph_hash=g.hash)
    assert p not in inplace_writes(g, ops) and len(inplace_writes(g, ops)) == len(writes) - 1
    _export_and_verify(traced, signature, schedule, tmp_path, MODEL, {})


@pytest.mark.parametrize("make", sweep(["recompute", "none"]))
def test_hf_resnet_residual_adds_are_run_in_place(tmp_path, make):
    """transformers' ResNet adds each residual in place (``hidden_state += residual``)."""
    traced = trace_model("hf:resnet", **HF_RESNET)
    g = traced.graph
    schedule = none_schedule(g) if make == "none" else recompute_before_use(g, 1)
    assert int((g.inplace_of >= 0).sum()) == 4 and np.all(np.array(g.ops)[g.inplace_of >= 0] == "aten.add.Tensor")
    assert inplace_writes(g, schedule.ops)
    _export_and_verify(traced, step_signature("hf:resnet", HF_RESNET), schedule, tmp_path, "hf:resnet", HF_RESNET)
