"""The compiled step (bonsai_core/trace/compiled.py): traced through inductor's own programs on fake
tensors, and measured for real at the CPU allocator (bonsai_core/allocations.py)."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from bonsai_core.errors import BonsaiError, ModelError
from bonsai_core.graph import Graph
from bonsai_core.schedule import no_remat_peak
from bonsai_core.trace import built_for_tracing, trace_model
from bonsai_core.trace.compiled import compiled, trace_compiled_step
from bonsai_core.trace.inductor import inductor_without_kernels


def allocations_of_known_sizes() -> tuple[int, int]:
    """In a hooked process: 4 MB and 1 MB allocated, the 4 MB freed, 1 MB more: (live, peak) over the start."""
    from bonsai_core import allocations

    base = allocations.live_bytes()
    allocations.reset_peak()
    x = torch.empty(1000, 1000)
    y = torch.empty(250_000)
    del x
    z = torch.empty(500, 500)
    live, peak = allocations.live_bytes() - base, allocations.peak_bytes() - base
    del y, z
    return live, peak


def test_the_allocation_hook_counts_what_the_cpu_allocator_hands_out() -> None:
    from bonsai_core.allocations import hooked, run_hooked

    assert not hooked()
    assert run_hooked(allocations_of_known_sizes) == (2_000_000, 5_000_000)


def test_a_cpu_convolutions_scratch_is_what_its_kernel_allocates(tmp_path, monkeypatch) -> None:
    """Without oneDNN a CPU convolution allocates the im2col columns of the whole batch (batch x C_in x kh x
    kw x H_out x W_out floats), frees them before it returns, and returns only its output: the probe
    measures those bytes, and the compiled trace holds them in a node only that call reads."""
    from bonsai_core.trace.scratch import scratch_bytes, signature

    monkeypatch.setenv("BONSAI_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 3, 16, 16).to(memory_format=torch.channels_last)
    w = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last)
    call = signature("aten.convolution.default", (x, w, None, [1, 1], [2, 2], [1, 1], False, [0, 0], 1), {})
    with torch.backends.mkldnn.flags(enabled=False):
        assert scratch_bytes([call]) == [4 * (3 * 5 * 5) * (16 * 16) * 4]

    with FakeTensorMode(allow_non_fake_inputs=True), torch.backends.mkldnn.flags(enabled=False):
        model = nn.Sequential(nn.Conv2d(3, 8, 5, padding=2), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                              nn.Linear(2048, 10))
        graph = trace_compiled_step(model, (torch.randn(4, 3, 16, 16),), lambda out: out.square().mean(), "model")
    scratch = [v for v in range(graph.n) if graph.ops[v] == "scratch"]
    assert [graph.names[u] for v in scratch for u in graph.users(v)] == ["convolution_1", "convolution_backward_1"]
    assert int(graph.mem[scratch[0]]) == 4 * (3 * 5 * 5) * (16 * 16) * 4


def _mlp() -> tuple[nn.Module, torch.Tensor, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    return model, torch.randn(32, 64), nn.CrossEntropyLoss()


class _LiveBytes(TorchDispatchMode):
    """The bytes of the storages made inside it while alive, and their peak: counted apart from the
    recorder, on the same kind of fake run."""

    def __init__(self, fixed: set[int]) -> None:
        super().__init__()
        self.fixed, self.sizes, self.live, self.peak = fixed, {}, 0, 0

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.sizes and key not in self.fixed:
                    self.sizes[key] = st.nbytes()
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)


def _mlp_traced_and_run(grads_set_to_none: bool) -> tuple[Graph, _LiveBytes, nn.Module]:
    """The MLP's compiled step traced, and the same step run a second time and counted apart: every storage
    it makes, from its making to its death (the first run made the gradients; ``grads_set_to_none``: set
    to None before the second, else kept and counted as fixed)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, x, loss = _mlp()
        y = torch.randint(0, 10, (32,))
        graph = trace_compiled_step(model, (x,), lambda out: loss(out, y), name="mlp")
        with inductor_without_kernels(), compiled(model, "model") as runnable:
            loss(runnable(x), y).backward()
            if grads_set_to_none:
                model.zero_grad(set_to_none=True)
            kept = () if grads_set_to_none else tuple(p.grad for p in model.parameters())
            live = _LiveBytes({t.untyped_storage()._cdata for t in (*model.parameters(), *kept, x, y)})
            with live:
                loss(runnable(x), y).backward()
    return graph, live, model


def test_a_compiled_step_is_recorded_as_inductor_runs_it() -> None:
    graph, live, _ = _mlp_traced_and_run(grads_set_to_none=False)
    fused = [op for op in graph.ops if op.startswith("inductor.cpp_fused")]
    assert fused, "inductor's fused kernels are nodes"
    assert any("gelu" in op for op in fused)
    assert "aten.gelu.default" not in graph.ops  # fused away: no buffer of its own
    assert graph.name == "mlp compiled (model)"
    assert no_remat_peak(graph) - graph.fixed_mem == live.peak


def test_a_compiled_step_with_its_gradients_set_to_none_is_predicted_as_it_runs() -> None:
    """The compiled backward's outputs are the gradients (as an eager trace's are), not in-place adds into
    kept buffers: set to None, each is made by the step and held to its end, as the run counted apart holds
    them; zeroed in place, the same graph holds them until AccumulateGrad takes them."""
    from bonsai_core.optimizer import gradient_nodes, with_grads

    graph, live, model = _mlp_traced_and_run(grads_set_to_none=True)
    made = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    grads = sum(t[1] for t in graph.fixed_tensors if t[2] == "grad")
    assert sum(int(graph.mem[graph.storage_of(v)]) for v in gradient_nodes(graph)) == grads == made
    none = with_grads(graph, "none")
    assert no_remat_peak(none) - none.fixed_mem == live.peak
    assert live.live == made  # the gradients outlive the step


def test_a_compiled_transformer_runs_fused_kernels_over_the_same_fixed_memory() -> None:
    eager = trace_model("gpt", layers=1, kernels="cpu").graph
    compiled_graph = trace_model("gpt", layers=1, compile="model").graph
    assert compiled_graph.n < eager.n
    assert not {"aten.gelu.default", "aten.native_layer_norm.default"} & set(compiled_graph.ops)  # fused away
    assert compiled_graph.fixed_mem == eager.fixed_mem
    assert "compiled (model)" in compiled_graph.name


@pytest.fixture(scope="module")
def titan_peaks() -> dict[str, int]:
    pytest.importorskip("torchtitan")
    options = {"layers": 2, "seq": 128, "batch": 2}
    return {ac: no_remat_peak(trace_model("torchtitan:llama3:debugmodel", compile="blocks", ac=ac, **options).graph)
            for ac in (None, "torchtitan-selective", "torchtitan-full", "budget:0.3")}


def test_torchtitans_own_checkpointing_under_compile_holds_less(titan_peaks: dict[str, int]) -> None:
    assert titan_peaks["torchtitan-full"] < titan_peaks["torchtitan-selective"] < titan_peaks[None]
    assert titan_peaks["budget:0.3"] < titan_peaks[None]


def test_the_blocks_are_the_graphs_modules_under_compile() -> None:
    pytest.importorskip("torchtitan")
    graph = trace_model("torchtitan:llama3:debugmodel", compile="blocks", layers=2, seq=128, fsdp=2).graph
    paths = {path for path, _, _ in graph.modules}
    assert {"layers.0", "layers.1", "tok_embeddings", "norm", "output"} <= paths
    assert graph.fsdp is not None and graph.fsdp["world"] == 2


@pytest.mark.parametrize("args, says", [
    (["--ac", "torchtitan-full"], "give --compile with it"),
    (["--compile", "--ac", "torchtitan-full"], "for torchtitan: models"),
    (["--compile", "--ac", "budget:2"], "budget:F with F from 0"),
    (["--compile", "model", "--fsdp", "2"], "give --compile blocks"),
    (["--compile", "--cp", "2"], "not traced yet"),
    (["--compile", "--tp", "2"], "give --compile blocks"),
    (["--compile", "blocks", "--tp", "2"], "for torchtitan: models"),
])
def test_compile_options_that_cannot_run_are_refused(args: list[str], says: str, tmp_path, capsys) -> None:
    from bonsai_core.cli import main

    assert main(["trace", "gpt", "--layers", "1", *args, "-o", str(tmp_path / "g.json")]) == 1
    assert says in capsys.readouterr().err


def test_the_one_call_refuses_a_compile_it_cannot_trace() -> None:
    import bonsai_core as bonsai

    model, x, loss = _mlp()
    y = torch.randint(0, 10, (32,))
    with pytest.raises(BonsaiError, match="compile='graph'"):
        bonsai.plan(model, (x,), lambda out: loss(out, y), budget="80%", compile="graph", cache=False)
    with pytest.raises(BonsaiError, match="TP 2: a compiled tensor, context or pipeline parallel rank is not traced"):
        bonsai.plan(model, (x,), lambda out: loss(out, y), budget="80%", compile=True, tp=2, cache=False)
    with pytest.raises(ModelError):
        trace_model("gpt", layers=1, compile="blocks", ac="torchtitan-full")


# -- predicted against measured: real compiles (tens of seconds each on a CPU) ---------------------

def _predicted_transient(spec: str, options: dict, mode: str, checkpointing: str | None = None) -> int:
    with built_for_tracing(spec, 0, **options) as (model, inputs, loss_fn):
        graph = trace_compiled_step(model, inputs, loss_fn, mode, name=spec, checkpointing=checkpointing,
                                    kernels="cpu")
    return no_remat_peak(graph) - graph.fixed_mem


@pytest.mark.slow
@pytest.mark.parametrize("spec, options, mode, checkpointing", [
    ("gpt", {"layers": 1}, "model", None),
    ("hf:llama", {"layers": 1}, "model", None),
    ("hf:gpt2", {"layers": 1}, "model", None),
    ("hf:resnet", {}, "model", None),  # convolutions (oneDNN's scratch), BatchNorm, max-pooling
    ("resnet", {"batch": 4, "width": 8, "layers": 1}, "model", "budget:0.5"),
    ("torchtitan:llama3:debugmodel", {"layers": 2, "seq": 256}, "blocks", "torchtitan-selective"),
    ("torchtitan:llama3:debugmodel", {"layers": 2, "seq": 256}, "blocks", "budget:0.5"),
])
def test_a_compiled_cpu_step_is_predicted_as_measured(spec: str, options: dict, mode: str,
                                                      checkpointing: str | None) -> None:
    from bonsai_core.measure import measure_compiled

    if spec.startswith("torchtitan:"):
        pytest.importorskip("torchtitan")
    predicted = _predicted_transient(spec, options, mode, checkpointing)
    measured = measure_compiled(spec, options, mode, checkpointing=checkpointing)
    assert predicted == measured.transient


@pytest.mark.slow
@pytest.mark.parametrize("spec, options, budget", [("gpt", {"layers": 2}, "70%"), ("resnet", {}, "80%")])
def test_the_one_calls_plan_under_compile_keeps_its_budget_as_measured(spec: str, options: dict, budget: str) -> None:
    import bonsai_core as bonsai
    from bonsai_core import models
    from bonsai_core.measure import measure_compiled

    model, inputs, loss_fn = models.build(spec, **options)
    made = bonsai.plan(model, inputs, loss_fn, budget=budget, compile=True, cache=False, device="cpu")
    measured = measure_compiled(spec, options, "model", save=made.save)
    assert made.report.compiled == "model" and made.save
    assert measured.transient + made.report.fixed_memory == made.report.predicted_peak <= made.report.budget


def test_the_same_plan_compiled_is_the_one_calls_compiled_step(monkeypatch) -> None:
    """training.compiled_plan (the explorer's compiled curve): a plan's checkpoint regions laid onto the model
    of a spec as bonsai.plan(compile=True) lays them, and the compiled step's peak that call predicts."""
    import bonsai_core as bonsai
    from bonsai_core import models, training
    from bonsai_core.errors import ScheduleError
    from bonsai_core.schedule import Schedule
    from bonsai_core.training import compiled_plan

    # one compiled trace per plan budget search (the call searches with the pointwise saves and without): whichever
    # plan the call keeps is the one compiled_plan must lay out again; the searches' whole length runs in the slow
    # stage, test_the_one_calls_plan_under_compile_keeps_its_budget_as_measured; the secant's next budget is
    # test_the_compiled_search_steps_by_the_secant_of_what_it_traced's
    monkeypatch.setattr(training, "COMPILED_TRIES", 1)
    model, inputs, loss_fn = models.build("gpt", layers=1)
    made = bonsai.plan(model, inputs, loss_fn, budget="70%", compile=True, cache=False, device="cpu")
    graph, save = compiled_plan("gpt", made.graph, made.schedule, "model", layers=1, kernels="cpu")
    assert save == made.save and save
    assert no_remat_peak(graph) == made.report.predicted_peak
    unplanned, none = compiled_plan("gpt", made.graph, None, "model", layers=1, kernels="cpu")
    assert none == {} and no_remat_peak(unplanned) == made.report.no_remat_peak > made.report.predicted_peak
    with pytest.raises(ScheduleError, match="not on"):
        compiled_plan("gpt", made.graph, Schedule("other", "none", [], graph_hash="0" * 16), "model", layers=1)


# -- the one call's checkpoints under torch.compile of each block ------------------------------------

class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).sin()


@pytest.mark.parametrize("transformers_loaded", [True, False])
def test_blocks_with_plans_that_differ_in_a_number_compile_each_with_its_own(transformers_loaded: bool,
                                                                            monkeypatch) -> None:
    """Blocks share one compiled function, and a plan that differs from the last one in a number (the
    first block keeps addmm's call 0, the second its call 1) recompiles it: dynamo's automatic dynamic
    shapes would make that number symbolic, and the checkpoint's policy no constant. Each block compiles
    with its own policy (two graphs, gradients as eager), and a block compiled alone has a frame for
    dynamo to trace whether transformers (whose caches the call takes out) is loaded or not."""
    from torch._dynamo.utils import counters

    from bonsai_core.export_runtime import checkpointing

    if transformers_loaded:
        pytest.importorskip("transformers.cache_utils")
    else:
        monkeypatch.setattr(checkpointing, "kv_cache_type", lambda: None)
    torch.manual_seed(0)
    model, x = nn.Sequential(_Block(), _Block()), torch.randn(4, 16)
    model(x).sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    checkpointing.apply_saves(model, {"0": {"aten.addmm.default": [0]}, "1": {"aten.addmm.default": [1]}})
    torch._dynamo.reset()
    counters.clear()
    try:
        for name, block in list(model.named_children()):
            model.register_module(name, torch.compile(block, fullgraph=True, backend="aot_eager"))
        model(x).sum().backward()
        assert counters["stats"]["unique_graphs"] == 2
    finally:
        torch._dynamo.reset()
    assert all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), eager))


def test_more_distinct_block_plans_than_dynamos_recompile_limit_are_refused_in_words() -> None:
    """Each distinct block plan is one compilation of the blocks' shared function: past dynamo's recompile
    limit fullgraph=True fails, and the trace says why and what to raise."""
    from bonsai_core.export_runtime import checkpointing

    # torch's own patch (monkeypatch's undo leaves dynamo's config without the key for later tests)
    with torch._dynamo.config.patch(recompile_limit=2), FakeTensorMode():
        model, x = nn.Sequential(*(_Block() for _ in range(3))), torch.randn(4, 16)
        checkpointing.apply_saves(model, {str(i): {"aten.addmm.default": [i]} for i in range(3)})
        with pytest.raises(ModelError, match=r"recompile_limit \(2\) times.*raise that limit"):
            trace_compiled_step(model, (x,), lambda out: out.sum(), "blocks")


def _distinct_block_plans(units: list, blocks: list[str]) -> int:
    return len({tuple(sorted((u.path[len(b):], str(u.saves)) for u in units if u.path == b or u.path.startswith(b + ".")))
                for b in blocks})


def test_blocks_share_plans_up_to_dynamos_recompile_limit() -> None:
    """Four block plans under a limit of two: the cheapest merge first (a plan into the one freeing 3 bytes
    more, for one block), then the blocks without a plan take the plan freeing the least of those freeing
    more; a unit outside the blocks stays, and no block frees less than it did."""
    from bonsai_core.export.checkpoint import Unit
    from bonsai_core.trace.compiled import shared_block_plans

    blocks = [f"layers.{i}" for i in range(6)]
    modules = {"", "layers", "out", *blocks, *(f"{b}.attn" for b in blocks)}
    units = [Unit("out", {"aten.mm.default": [0]}, 3, 5),
             Unit("layers.0", {"aten.mm.default": [0]}, 10, 100), Unit("layers.3", {"aten.mm.default": [1]}, 10, 103),
             Unit("layers.1.attn", {}, 4, 50), Unit("layers.4.attn", {}, 4, 50)]
    shared = shared_block_plans(units, blocks, 2, modules)
    assert _distinct_block_plans(units, blocks) == 4 and _distinct_block_plans(shared, blocks) == 2
    assert {u.path: u.saves for u in shared} == {
        "out": {"aten.mm.default": [0]}, "layers.0": {"aten.mm.default": [1]}, "layers.3": {"aten.mm.default": [1]},
        **{f"layers.{i}.attn": {} for i in (1, 2, 4, 5)}}
    assert shared_block_plans(units, blocks, 4, modules) is units


def test_block_plans_that_cannot_be_shared_past_the_recompile_limit_are_refused_in_words() -> None:
    from bonsai_core.export.checkpoint import Unit
    from bonsai_core.trace.compiled import shared_block_plans

    units = [Unit("0.attn", {}, 4, 50), Unit("1.mlp", {}, 4, 50)]
    with pytest.raises(ModelError, match=r"2 distinct ways.*recompile_limit \(1\)"):
        shared_block_plans(units, ["0", "1"], 1, {"0", "1", "0.attn", "1.mlp"})


def test_plans_shared_across_blocks_compile_under_dynamos_recompile_limit() -> None:
    """Three blocks with three plans fail a limit of two (above); shared, they compile. The input requires
    grad, as a transformer's embedding output does: a block whose input differs from the others' (not
    requiring grad, another shape) is one more compilation, whatever its plan."""
    from bonsai_core.export.checkpoint import Unit
    from bonsai_core.export_runtime import checkpointing
    from bonsai_core.trace.compiled import shared_block_plans

    with torch._dynamo.config.patch(recompile_limit=2), FakeTensorMode():
        model, x = nn.Sequential(*(_Block() for _ in range(3))), torch.randn(4, 16, requires_grad=True)
        units = [Unit(str(i), {"aten.addmm.default": calls}, 6, 64 * (3 - len(calls)))
                 for i, calls in enumerate(([0], [1], [0, 1]))]
        shared = shared_block_plans(units, ["0", "1", "2"], 2, {p for p, _ in model.named_modules()})
        checkpointing.apply_saves(model, {u.path: u.saves for u in shared})
        graph = trace_compiled_step(model, (x,), lambda out: out.sum(), "blocks")
    assert _distinct_block_plans(units, ["0", "1", "2"]) == 3 and _distinct_block_plans(shared, ["0", "1", "2"]) == 2
    assert graph.n > 0


@pytest.mark.parametrize("tried, low, high, expected", [
    ([(100, 90)], 100, 1000, 110),  # fits 10 under: shifted up by 10
    ([(100, 130)], 0, 100, 70),  # 30 over: down by 30
    ([(100, 90), (120, 110)], 100, 120, 110),  # the secant through both sides
    ([(100, 99), (200, 199)], 100, 200, 112),  # the secant at 101, kept an eighth of the bracket in
    ([], 0, 100, 50),  # nothing traced yet: the bisection
])
def test_the_compiled_search_steps_by_the_secant_of_what_it_traced(tried, low, high, expected) -> None:
    from bonsai_core.training import _next_plan_budget

    assert _next_plan_budget(tried, 100, low, high) == expected


# -- the partitioner's choices as on the device the plan is for -----------------------------------

class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 256, 64))


def _attention_runs(kernels: str) -> list[str]:
    """The phases of the CPU flash kernel's forward runs in the attention step compiled under torch's memory
    budget 0.5, its partitioner choosing as on ``kernels``' device."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = trace_compiled_step(_Attention(), (torch.randn(2, 256, 64),), lambda y: y.square().mean(),
                                    checkpointing="budget:0.5", kernels=kernels)
    return ["forward" if graph.is_forward[i] else "backward" for i, op in enumerate(graph.ops)
            if op == "aten._scaled_dot_product_flash_attention_for_cpu.default"]


def test_the_partitioner_recomputes_attention_as_its_device_would() -> None:
    """On the CPU the partitioner takes its flash kernel as free to recompute (it is not in its list of
    compute-intensive ops); on a GPU the flash kernel it stands for is, so the plan for a GPU saves it."""
    from torch._functorch import partitioners

    from bonsai_core.trace.compiled import partitioner_for

    assert _attention_runs("cpu") == ["forward", "backward"]
    assert _attention_runs("cuda") == ["forward"]
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    with partitioner_for("cuda"):
        assert cpu_flash in partitioners.get_default_op_list().compute_intensive_ops
    assert cpu_flash not in partitioners.get_default_op_list().compute_intensive_ops  # put back


def test_an_extern_kernels_out_overload_without_a_meta_kernel_gets_one_while_compiling() -> None:
    """A Float8 linear's matmul runs in inductor's wrapper as ``_scaled_mm(..., out=buf)``, which has no meta
    kernel: on fake tensors torch would run the real CPU kernel on zeros (minutes on an 8B block). Within the
    compiled trace its shape comes from the functional overload's meta kernel, and a wrong ``out`` is refused."""
    scaled_mm = torch.ops.aten._scaled_mm
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(scaled_mm.out.name(), "Meta")
    with FakeTensorMode(), inductor_without_kernels():
        a = torch.randn(64, 32).to(torch.float8_e4m3fn)
        b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
        scale = torch.ones(())
        out = torch.empty(64, 16, dtype=torch.bfloat16)
        assert scaled_mm.out(a, b, scale, scale, out_dtype=torch.bfloat16, out=out) is out
        with pytest.raises(RuntimeError, match=r"out is torch.bfloat16 \(64, 15\), the result torch.bfloat16 \(64, 16\)"):
            scaled_mm.out(a, b, scale, scale, out_dtype=torch.bfloat16, out=torch.empty(64, 15, dtype=torch.bfloat16))
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(scaled_mm.out.name(), "Meta")  # taken off again


@pytest.mark.slow
def test_float8_linears_under_torchtitans_selective_ac_save_what_the_bf16_step_saves() -> None:
    """torchtitan's Float8 linears (torchao) traced compiled under its selective AC of December 2024: the
    policy sees each float8 matmul as the ``aten.mm`` the linear calls, so the forward saves the same
    bf16 tensors as without Float8, and beyond them at most the two fp32 scales of each linear's operands."""
    from bonsai_core.bench.compiled import peak_parts
    from bonsai_core.solvers import solve

    saved = {}
    for float8 in (False, True):
        graph = trace_model("torchtitan:llama3:debugmodel", layers=2, seq=256, batch=2, fsdp=2, compile="blocks",
                            ac="torchtitan-selective-2024-12", float8=float8).graph
        saved[float8] = peak_parts(graph, solve(graph, 2**60, "none"))["saved forward tensors"]
        assert any(op.startswith("aten._scaled_mm") for op in graph.ops) == float8
    linears = 2 * 7  # wq, wk, wv, wo, w1, w2, w3 in each of the 2 blocks
    assert 0 <= saved[True] - saved[False] <= linears * 2 * 4


@pytest.mark.parametrize("peaks, costs, expected", [
    ((90, 90), (5.0, 7.0), True),     # both fit: the smaller compiled compute
    ((90, 90), (7.0, 5.0), False),
    ((110, 90), (5.0, 7.0), False),   # only one fits: that one, however costly
    ((120, 110), (5.0, 7.0), False),  # neither fits: the smaller compiled peak
    (None, (5.0, 7.0), False),        # one search refuses: the other's plan
])
def test_under_compile_the_plan_saving_ops_inside_segments_and_the_plan_of_whole_segments_compete(
        monkeypatch, peaks, costs, expected) -> None:
    """bonsai under compile searches with save_ops and without it and keeps the fitting compiled plan of least
    compute: saved matmul outputs with fused recomputation between them win on some budgets, whole segments
    on others."""
    from bonsai_core import training
    from bonsai_core.errors import BudgetError

    def fitted(step, graph, limit, method, options, seconds, best_effort=False):
        i = 0 if options["save_ops"] else 1
        if peaks is None and i == 0:
            raise BudgetError("no plan")
        peak = 90 if peaks is None else peaks[i]
        return options["save_ops"], {}, training._Layout(peak, {}, 0, {}, 0, 0, 0, costs[i])

    monkeypatch.setattr(training, "_fitted", fitted)
    assert training._fitted_both(None, None, 100, "bonsai", {"space": "regions"}, {}, False)[0] is expected
    monkeypatch.setattr(training, "_fitted", lambda *a, **k: (_ for _ in ()).throw(BudgetError("none")))
    with pytest.raises(BudgetError):
        training._fitted_both(None, None, 100, "bonsai", {}, {}, False)


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(16, 16).tril().sum(0).sqrt()  # built inside: self-contained
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.w(x * rstd) * mask


def test_under_compile_the_plan_leaves_the_pointwise_ops_its_levels_save_to_the_kernels_that_read_them() -> None:
    """A pointwise op's output saved under compile holds bytes to the backward and splits the kernel that
    would recompute it (the 8B step's RMSNorm rsqrt): of the ops a plan saves inside its segments, the
    pointwise ones are recomputed; matmuls and self-contained nodes stay saved."""
    from bonsai_core.regions import CheckpointPlan, forward_positions
    from bonsai_core.solvers.bonsai_coef import self_contained
    from bonsai_core.trace import trace_step
    from bonsai_core.training import _is_pointwise, _pointwise_unsaved

    graph = trace_step(_Norm(), (torch.randn(4, 16, requires_grad=True),), lambda out: out.sum()).graph
    forward = [v for v in range(graph.n) if graph.is_forward[v]]
    constant = self_contained(graph)[forward_positions(graph)[forward]]
    by_op = {graph.ops[v]: v for v in forward}
    saved = [by_op["aten.rsqrt.default"], by_op["aten.addmm.default"], *[v for v, c in zip(forward, constant) if c]]
    plan = CheckpointPlan.of([forward], [0], saved=saved)
    assert any(_is_pointwise(graph.ops[v]) for v, c in zip(forward, constant) if c)  # the mask's ops
    assert _pointwise_unsaved(graph, plan).saved == frozenset(saved) - {by_op["aten.rsqrt.default"]}
    unchanged = CheckpointPlan.of([forward], [0], saved=saved[1:])
    assert _pointwise_unsaved(graph, unchanged) is unchanged
    assert not _is_pointwise("aten.mul") and not _is_pointwise("aten.nosuch.default") and _is_pointwise("aten.mul.Tensor")
