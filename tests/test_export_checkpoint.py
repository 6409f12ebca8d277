"""The checkpoint back-end: a region plan applied to the user's own module (torch.utils.checkpoint + SAC).

Each case: trace a small model, solve a real method under a budget (the peak lower bound plus a
share of the headroom to the no-remat peak, as in tests/test_export.py), export with
``export_checkpoint``, and run ``verify_checkpoint``: the same loss and gradients as the original at the
traced batch size and at another one, and the measured CPU peak within 10% of the simulator's
prediction at the traced size (below the original model's measured peak).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn as nn

from bonsai_core.export import ExportError
from bonsai_core.export.checkpoint import export_checkpoint
from bonsai_core.export.folder import export_backend
from bonsai_core.export.verify import load_checkpointed, verify_checkpoint
from bonsai_core.models.zoo import CrossEntropyLoss
from bonsai_core.regions import CheckpointPlan
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import solve
from bonsai_core.trace import trace_model

GPT = dict(batch=2, seq=16, width=32, layers=2, heads=2, vocab=64)
ATOL = 1e-5
PEAK_TOLERANCE = 0.10
OTHER_BATCH = 3


def hf_gpt2(batch: int = 2, seq: int = 16, layers: int = 2, width: int = 32, heads: int = 2, vocab: int = 64):
    """Hugging Face GPT-2 (``GPT2LMHeadModel`` from a small config, no weights) behind the few lines a
    training script writes around it: input ids in, logits out. Eager attention and an explicit
    all-ones attention mask keep the step traceable on this branch (``hf:gpt2`` is another branch's)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "eager"
    idx = torch.randint(0, vocab, (batch, seq + 1))
    return CausalLM(GPT2LMHeadModel(config)), (idx[:, :-1].contiguous(),), \
        CrossEntropyLoss(idx[:, 1:].contiguous(), flatten=True)


class CausalLM(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


HF_GPT2 = "tests.test_export_checkpoint:hf_gpt2"


_graphs: dict = {}
_schedules: dict = {}


def solved(model: str, options: dict, method: str, share: float, **solve_options):
    """(graph, schedule), traced and solved once per session (tracing and the ILP dominate test time);
    bonsai's plans in checkpoint regions."""
    key = (model, tuple(sorted(options.items())))
    if key not in _graphs:
        _graphs[key] = trace_model(model, **options).graph
    graph = _graphs[key]
    if method == "bonsai":  # the checkpoint back-end applies checkpoint regions
        solve_options.setdefault("space", "regions")
    run = (key, method, share, tuple(sorted(solve_options.items())))
    if run not in _schedules:
        lb = graph.peak_lower_bound
        _schedules[run] = solve(graph, int(lb + share * (no_remat_peak(graph) - lb)), method=method, **solve_options)
    return graph, _schedules[run]


@pytest.fixture(scope="module")
def gpt_export(tmp_path_factory):
    """The zoo gpt's bonsai schedule (budget share 0.5), exported once."""
    _, schedule = solved("gpt", GPT, "bonsai", 0.5)
    return export_checkpoint("gpt", GPT, schedule, tmp_path_factory.mktemp("gpt") / "ck")


def check_export(tmp_path, model: str, options: dict, method: str, share: float, **solve_options) -> None:
    graph, schedule = solved(model, options, method, share, **solve_options)
    sim = simulate(graph, schedule)
    assert sim.recomputes > 0, "the schedule must recompute something"
    out = export_checkpoint(model, options, schedule, tmp_path / "ck")
    exported = load_checkpointed(out)
    assert exported.SAVE, "at least one submodule is checkpointed"
    assert exported.INFO["dropped_bytes"] > exported.INFO["unrealised_dropped_bytes"]

    at_traced = verify_checkpoint(model, options, out, repeats=1)
    assert at_traced.loss_diff <= ATOL and at_traced.max_grad_diff <= ATOL, at_traced.to_dict()
    assert at_traced.predicted_peak == sim.peak
    assert abs(at_traced.peak_error) <= PEAK_TOLERANCE, at_traced.to_dict()
    # the back-end's own prediction (what the checkpoints really run, simulated) is the closer one
    assert abs(at_traced.measured_peak / at_traced.realised_peak - 1) <= PEAK_TOLERANCE, at_traced.to_dict()
    assert at_traced.measured_peak < at_traced.original_peak, at_traced.to_dict()

    other = verify_checkpoint(model, options, out, batch=OTHER_BATCH, repeats=1)
    assert other.batch == OTHER_BATCH and not other.traced_size and other.predicted_peak is None
    assert other.loss_diff <= ATOL and other.max_grad_diff <= ATOL, other.to_dict()


@pytest.mark.parametrize("method,share", [("bonsai", 0.5), pytest.param("bonsai", 0.7, marks=pytest.mark.slow),
                                          pytest.param("chen", 0.7, marks=pytest.mark.slow)])
def test_zoo_gpt_trains_the_same_within_the_predicted_peak(tmp_path, method, share):
    check_export(tmp_path, "gpt", GPT, method, share)


# Free-form plans (regions "any") on HF GPT-2: eager autograd holds what the simulator frees at last
# use (a backward node keeps its saved tensors until the whole node has run: gelu_new's last mul, 16 KiB
# here; a tied weight's first partial gradient waits in the engine's input buffer for the last one:
# GPT-2's wte, 8 KiB), and the plan's regions do not all line up with submodules. Measured: +10.08% over
# the plan at share 0.5 (423,816 vs 385,024 B) and +8.96% at 0.7 (468,616 vs 430,080 B) since in-place
# ops and getitem outputs are placed in their submodules (before: +11.2% and +10.5%). Since the trace
# holds a tied weight's earlier gradients (2026-12-04) both shares meet the check.


@pytest.mark.slow
@pytest.mark.parametrize("share", [0.5, 0.7])
def test_hf_gpt2_bonsai_trains_the_same_within_the_predicted_peak(tmp_path, share):
    check_export(tmp_path, HF_GPT2, {}, "bonsai", share)


# eager attention: the numbers of these tests and of docs/EXPORT.md were measured with it
HF_SOURCE_GPT2 = {"layers": 2, "width": 32, "heads": 2, "seq": 16, "vocab": 64, "batch": 2, "attention": "eager"}


@pytest.mark.parametrize("model,options,share", [
    ("gpt", GPT, 0.5),
    pytest.param("gpt", {}, 0.5, marks=pytest.mark.slow),  # the default size (8 x 128 tokens, width 128)
    # passes since a segment saves only data-independent nodes (the mask made by ones_like(ids) was taken
    # for the data's root, so every op before the mask's use counted as self-contained and was saved)
    pytest.param(HF_GPT2, {}, 0.5, marks=pytest.mark.slow),
    pytest.param("hf:gpt2", HF_SOURCE_GPT2, 0.5, marks=pytest.mark.slow),  # dropout 0.1, as the CPU runs it
    pytest.param("hf:gpt2", HF_SOURCE_GPT2, 0.7, marks=pytest.mark.slow),
    # BatchNorm: the run's in-place `num_batches_tracked += 1` and `native_batch_norm` are traced in
    # functional form, and its statistics are getitem nodes; each must still be found in its block
    ("tests.user_model:make_batchnorm_cnn", {}, 0.85),
])
def test_module_region_plans_are_followed_by_the_checkpoints(tmp_path, model, options, share):
    """bonsai with ``regions="modules"`` recomputes module calls only: the checkpoints run the plan
    itself (the back-end's realised peak is the plan's, up to a boundary view) and the measured peak meets the 10% of the issue, also where the
    free-form plan does not (the xfails here)."""
    check_export(tmp_path, model, options, "bonsai", share, regions="modules")
    info = load_checkpointed(tmp_path / "ck").INFO
    assert info["realised_peak"] <= 1.03 * info["predicted_peak"], info


@pytest.mark.slow
def test_hf_source_gpt2_bonsai(tmp_path):
    """hf:gpt2 (eager attention, dropout 0.1), a free-form plan: the graph holds what eager's backward
    pass holds (through views too), so the plan is solved for the lifetimes the checkpoints run.
    Measured 423,560 B against the schedule's 415,628 (+1.9%; realised 426,380), gradients equal."""
    check_export(tmp_path, "hf:gpt2", HF_SOURCE_GPT2, "bonsai", 0.5)


def test_general_schedules_are_refused_with_a_pointer_to_replay(tmp_path):
    _, schedule = solved("gpt", GPT, "dtr", 0.5)
    with pytest.raises(ExportError, match="--backend replay"):
        export_checkpoint("gpt", GPT, schedule, tmp_path / "ck")


def test_export_loads_with_the_standard_importlib_recipe_and_applies_once(gpt_export):
    out = gpt_export
    spec = importlib.util.spec_from_file_location("checkpointed", out / "checkpointed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not in sys.modules first
    assert module.INFO["backend"] == "checkpoint" == export_backend(out)
    assert "checkpointed" not in sys.modules
    from bonsai_core import models

    net, inputs, loss_fn = models.build("gpt", **GPT)
    assert module.apply(net) is net
    with pytest.raises(ValueError, match="already checkpointed"):
        module.apply(net)
    with pytest.raises(ValueError, match="no submodule"):
        module.apply(nn.Linear(2, 2))
    with torch.no_grad():  # no backward: the checkpoints just run the forward
        net(*inputs)
    assert (out / "schedule.json").is_file() and "apply(model)" in (out / "README.md").read_text()


def test_bf16_autocast_on_cpu(gpt_export):
    v = verify_checkpoint("gpt", GPT, gpt_export, autocast="bf16", repeats=1)
    # the checkpoint re-runs the recomputation under the forward's autocast state: the same bf16 kernels
    assert v.loss_diff <= 1e-3 and v.max_grad_diff <= 1e-3, v.to_dict()
    assert v.predicted_peak is None  # the schedule's bytes are fp32 ones


@pytest.mark.slow
def test_torch_compile_aot_eager(gpt_export):
    """torch.compile traces the checkpoints as its own checkpoint op (about 30 s on a loaded 2-core
    machine with the aot_eager backend; inductor worked too in a manual run but took minutes)."""
    from bonsai_core import models

    module = load_checkpointed(gpt_export)

    def step(compiled: bool):
        net, inputs, loss_fn = models.build("gpt", **GPT)
        run = torch.compile(module.apply(net), backend="aot_eager") if compiled else net
        loss = loss_fn(run(*inputs))
        loss.backward()
        return float(loss), {n: p.grad for n, p in net.named_parameters()}

    torch._dynamo.reset()
    try:
        loss, grads = step(True)
    finally:
        torch._dynamo.reset()
    ref_loss, ref = step(False)
    assert abs(loss - ref_loss) <= ATOL
    assert max(float((grads[n] - ref[n]).abs().max()) for n in ref) <= ATOL


# -- the recomputation runs what the forward ran (SDPA, key/value caches, state a forward changes) -----------

def check_verifies(tmp_path, model: str, options: dict, share: float, **solve_options):
    """Export a bonsai plan and run ``verify_checkpoint`` at the traced batch and another: no problem in
    verify's own words (loss, gradients, the measured peak within its tolerance of the prediction, or of
    what the checkpoints run when they follow the plan in part) and below the original's peak."""
    graph, schedule = solved(model, options, "bonsai", share, **solve_options)
    assert simulate(graph, schedule).recomputes > 0, "the schedule must recompute something"
    out = export_checkpoint(model, options, schedule, tmp_path / "ck")
    info = load_checkpointed(out).INFO
    assert load_checkpointed(out).SAVE and not info["not_checkpointed"], info
    v = verify_checkpoint(model, options, out, repeats=1)
    assert not v.problems() and v.measured_peak < v.original_peak, v.to_dict()
    other = verify_checkpoint(model, options, out, batch=OTHER_BATCH, repeats=1)
    assert other.loss_diff <= ATOL and other.max_grad_diff <= ATOL, other.to_dict()
    return v


SDPA_GPT2 = "tests.export_models:hf_gpt2"  # as a user builds it: SDPA, dropout 0.1, use_cache on (the default)
SDPA_LLAMA = "tests.export_models:hf_llama"


@pytest.mark.parametrize("model,regions", [
    (SDPA_GPT2, "modules"),
    pytest.param(SDPA_GPT2, "any", marks=pytest.mark.slow),
    pytest.param(SDPA_LLAMA, "modules", marks=pytest.mark.slow),
    pytest.param(SDPA_LLAMA, "any", marks=pytest.mark.slow),
])
def test_sdpa_models_with_a_kv_cache_train_the_same(tmp_path, model, regions):
    """transformers fills a key/value cache in each attention (``use_cache`` is on by default): a
    checkpointed attention recomputed with that cache would append to it again and run other ops
    (torch's "aten.slice.Tensor encountered during backward but not found in storage"). The
    checkpoints hide the cache from the submodules they wrap, as transformers' own checkpointing does."""
    check_verifies(tmp_path, model, {}, 0.5, regions=regions)


class _Memory(nn.Module):
    """Attends over every input seen since the model's forward reset it, as a key/value cache does: a
    state its forward changes and reads back. Functional ops only, no submodule to fall back to."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x if self.seen is None else torch.cat([self.seen, x], 1)
        scores = torch.softmax(torch.tanh(x @ self.weight) @ self.seen.transpose(1, 2), -1)
        return x + torch.tanh(scores @ self.seen)


class _MemoryNet(nn.Module):
    def __init__(self, width: int, layers: int, nested: bool) -> None:
        super().__init__()
        blocks = [nn.Sequential(_Memory(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
                  if nested else _Memory(width) for _ in range(layers)]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.modules():
            if isinstance(m, _Memory):
                m.seen = None
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(1)


def memory_net(batch: int = 2, seq: int = 8, width: int = 16, layers: int = 4, nested: int = 1):
    return (_MemoryNet(width, layers, bool(nested)), (torch.randn(batch, seq, width),),
            CrossEntropyLoss(torch.randint(0, 4, (batch,))))


MEMORY = "tests.test_export_checkpoint:memory_net"


def _memory_plan(nested: int):
    graph, schedule = solved(MEMORY, {"nested": nested}, "bonsai", 0.3 if nested else 0.6)
    assert simulate(graph, schedule).recomputes > 0
    return schedule


def test_a_submodule_whose_recomputation_differs_is_left_out(tmp_path):
    """Each block's recomputation would see its memory filled by the forward: the export leaves the
    blocks (and their memories) out, says why, checkpoints what is left, and the step trains the same."""
    out = export_checkpoint(MEMORY, {"nested": 1}, _memory_plan(1), tmp_path / "ck")
    exported = load_checkpointed(out)
    left_out = exported.INFO["not_checkpointed"]
    memories = {f"blocks.{i}{s}" for i in range(4) for s in ("", ".0")}
    assert len(left_out) >= 4 and set(left_out) <= memories
    assert not set(exported.SAVE) & memories  # no memory is checkpointed (one the layout does not pick is not tried)
    assert all("changes state" in why for why in left_out.values()), left_out
    assert exported.SAVE and not set(exported.SAVE) & set(left_out)
    v = verify_checkpoint(MEMORY, {"nested": 1}, out, repeats=1)
    assert v.loss_diff <= ATOL and v.max_grad_diff <= ATOL, v.to_dict()
    assert "not checkpointed" in (out / "README.md").read_text()


def test_a_plan_no_submodule_can_follow_faithfully_is_refused_at_export(tmp_path):
    with pytest.raises(ExportError, match="cannot apply this plan.*--backend replay"):
        export_checkpoint(MEMORY, {"nested": 0}, _memory_plan(0), tmp_path / "ck")
    assert not (tmp_path / "ck" / "checkpointed.py").exists()


def test_recomputation_mismatch_follows_sacs_pairing():
    from bonsai_core.export.checkpoint import recomputation_mismatch

    fwd = [["aten.ones.default", ((4, 4),)], ["aten.tril.default", ((4, 4),)], ["aten.mm.default", ((2, 4),)],
           ["aten.relu.default", ((2, 4),)], ["aten.mm.default", ((2, 2),)]]
    assert recomputation_mismatch(fwd, fwd) is None
    assert recomputation_mismatch(fwd, fwd[:3]) is None  # stopped early
    assert recomputation_mismatch(fwd, fwd[2:]) is None  # a cached constant skipped: the pairs hold
    assert "more often" in recomputation_mismatch(fwd, [*fwd[:2], *fwd[:2]])  # an op the forward ran once
    grown = [fwd[0], fwd[1], ["aten.mm.default", ((2, 8),)]]
    assert "shapes" in recomputation_mismatch(fwd, grown)
    assert "order" in recomputation_mismatch(fwd, [fwd[3], fwd[0]])
    assert "aten.slice.Tensor" in recomputation_mismatch(fwd, [fwd[0], ["aten.slice.Tensor", ((4, 2),)]])


def test_module_region_plans_that_save_ops_inside_modules_are_applied_as_sac_policies(tmp_path):
    """regions="modules" gets bonsai's per-op freedom (save_ops): at share 0.7 of the zoo GPT the plan
    saves matmul outputs inside its checkpointed modules and costs less than whole-module plans
    (measured: +6.96% against +13.91%); the export writes those ops as MUST_SAVE, trains the same, and
    the measured peak is within the tolerance of the prediction. The back-end's realised peak, what the
    checkpoints really run, is the plan's to the byte (377,728 B; 370,048 B while the policy saved only
    what the backward pass reads, recomputing the matmuls the plan keeps for the recomputation, and
    378,240 B while layer norm's statistics were left out of their block's recomputation)."""
    graph, schedule = solved("gpt", GPT, "bonsai", 0.7, regions="modules", save_ops=True)
    whole = solve(graph, schedule.budget, "bonsai", regions="modules", save_ops=False, reuse=False)
    assert schedule.stats["overhead"] < whole.stats["overhead"]
    saved = CheckpointPlan.from_extra(schedule.extra).saved
    matmuls = ("aten.addmm.default", "aten.bmm.default")
    assert any(graph.ops[v] in matmuls for v in saved)
    check_export(tmp_path, "gpt", GPT, "bonsai", 0.7, regions="modules", save_ops=True)
    exported = load_checkpointed(tmp_path / "ck")
    # the matmuls' outputs reach the model's code as their _unsafe_view (3-D linear, bmm): saved there
    assert any("aten._unsafe_view.default" in saves for saves in exported.SAVE.values())
    assert exported.INFO["realised_peak"] == exported.INFO["predicted_peak"]


def test_a_recomputation_that_stops_early_holds_what_a_later_forward_op_reads():
    """torch.utils.checkpoint stops a unit's recomputation where its last saved tensor is packed: the
    frames running it still hold a tensor that a later op of the unit reads (ATen's recurrent layer its
    input projection, read by its last steps and the stack of its outputs), so the simulation holds it to
    the stop. Here t = mm(x) is read only by the add after the sigmoid, whose output the backward pass reads."""
    import numpy as np

    from bonsai_core.export.checkpoint import held_at_stop, realised_ops
    from bonsai_core.graph import Graph
    from bonsai_core.schedule import COMPUTE, FREE

    def node(name, op, phase, mem, deps):
        return dict(name=name, op=op, phase=phase, cost=1.0, mem=mem, deps=deps)

    graph = Graph.from_nodes("stops-early", 0, [
        node("x", "aten.mm.default", "forward", 10, []), node("t", "aten.mm.default", "forward", 100, [0]),
        node("y", "aten.sigmoid.default", "forward", 10, [0]), node("out", "aten.add.Tensor", "forward", 10, [1, 2]),
        node("loss", "aten.sum.default", "forward", 1, [3]), node("grad_out", "aten.ones_like.default", "backward", 10, [4]),
        node("grad_y", "aten.sigmoid_backward.default", "backward", 10, [2, 5]),
        node("grad_x", "aten.mm.default", "backward", 10, [6])])
    unit = (np.array([1, 2, 3]), np.array([2]))  # the unit drops y, and rebuilds t and y
    assert held_at_stop(graph, [1, 2], 2) == {1, 2}  # y is the backward's anyway
    ops = realised_ops(graph, [unit], graph.read_by_backward)
    rebuilt_t = [i for i, op in enumerate(ops) if op == (COMPUTE, 1)][1]
    rebuilt_y = ops.index((COMPUTE, 2), rebuilt_t)
    assert rebuilt_y < ops.index((FREE, 1), rebuilt_t)
    assert simulate(graph, ops).timeline[rebuilt_y] >= 10 + 100 + 10  # x (the unit's input), t and y
