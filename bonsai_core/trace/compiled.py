"""Trace the training step as ``torch.compile`` runs it: inductor's buffers, the partitioner's saved set.

A compiled step holds other tensors than the eager one: AOTAutograd's partitioner chooses what the
forward pass saves for the backward (its min-cut, its ban rules, the checkpointing policies of the
regions it is given), and inductor fuses chains of ops into kernels that allocate only their outputs,
reuses dead buffers and frees each at its last use. None of that is in the eager joint graph.

:func:`trace_compiled_step` compiles the model as the user's run does (:data:`COMPILE_MODES`) with
inductor's real pipeline and runs one step on fake tensors with inductor's generated programs
(:mod:`bonsai_core.trace.inductor`: every allocation, reuse and free as compiled, no kernel run), recorded
storage by storage (:mod:`bonsai_core.trace.recorder`) into a Graph whose plain schedule is that step.
Everything comes from torch's own code; nothing of the partitioner or inductor is modelled here.

Inductor's choices depend on its device: the CPU's C++ back-end fuses what it fuses, a GPU's Triton
back-end what it does. The trace compiles for the device of the model's fake tensors (the CPU). The
partitioner's choices depend on which attention kernel the step runs: traced for a GPU (``kernels="cuda"``)
it treats the CPU's flash kernel as the GPU's flash kernel it stands for (:func:`partitioner_for`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import operator
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from bonsai_core.arguments import CHECKPOINTING, COMPILE_MODES
from bonsai_core.costmodel import DEFAULT_PROFILE, PROFILES
from bonsai_core.errors import ModelError
from bonsai_core.graph import Graph
from bonsai_core.trace.inductor import inductor_without_kernels, kernel_calls
from bonsai_core.trace.recorder import StepRecorder
from bonsai_core.trace.scratch import fill_scratch



def check_compile(mode: str, fsdp: int = 1) -> None:
    """Refuse a compile mode this trace cannot run, saying what to give instead."""
    if mode not in COMPILE_MODES:
        raise ModelError(f"Unknown compile mode {mode!r}; choose one of: {', '.join(COMPILE_MODES)}.")
    if fsdp > 1 and mode != "blocks":
        raise ModelError(f"--compile {mode} with --fsdp {fsdp}: an FSDP rank's step is traced compiled block by block, as "
                         "torchtitan compiles it before sharding; give --compile blocks.")


def check_checkpointing(checkpointing: str | None, model_name: str = "") -> float | None:
    """Refuse a checkpointing this trace cannot apply; the memory budget of ``budget:F`` (else None)."""
    if checkpointing is None:
        return None
    if checkpointing.startswith("budget:"):
        try:
            budget = float(checkpointing.removeprefix("budget:"))
        except ValueError:
            budget = -1.0
        if not 0.0 <= budget <= 1.0:
            raise ModelError(f"--ac {checkpointing}: give budget:F with F from 0 (recompute all it can) to 1 "
                             "(the partitioner's default, fastest) as torch's activation_memory_budget.")
        return budget
    if checkpointing not in CHECKPOINTING:
        raise ModelError(f"Unknown activation checkpointing {checkpointing!r}; choose one of: {', '.join(CHECKPOINTING)}.")
    if model_name and not model_name.startswith("torchtitan:"):
        raise ModelError(f"--ac {checkpointing} is torchtitan's own apply_ac, for torchtitan: models; for {model_name!r} "
                         "give budget:F (torch's memory budget) or plan it with bonsai.checkpoint.")
    return None


@contextlib.contextmanager
def checkpointed(model: nn.Module, checkpointing: str | None) -> Iterator[None]:
    """Within: ``model`` under ``checkpointing`` (:data:`CHECKPOINTING`), applied as the run applies it,
    before compiling; torchtitan's checkpoint wrappers are taken off again on the way out."""
    from torch._functorch import config as functorch_config

    budget = check_checkpointing(checkpointing)
    if checkpointing is None:
        yield
    elif budget is not None:
        with functorch_config.patch(activation_memory_budget=budget):
            yield
    else:
        from torchtitan.config.job_config import ActivationCheckpoint
        from torchtitan.distributed.activation_checkpoint import apply_ac

        from bonsai_core.solvers.torchtitan import torchtitan_save_list

        layers = model.get_submodule("layers")
        originals = dict(layers.named_children())
        mode, _, release = checkpointing.removeprefix("torchtitan-").partition("-")
        apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option="op"), model_compile_enabled=True,
                 op_sac_save_list=torchtitan_save_list(release or "0.2.2"))
        try:
            yield
        finally:
            for name, block in originals.items():
                layers.register_module(name, block)


def float8_linears(model: nn.Module) -> None:
    """Convert ``model``'s linears to Float8 training in place, as torchtitan's ``Float8LinearConverter``
    does by default (torchao's tensorwise float8 linears, no float8 all-gather; its filter keeps a linear
    whose dimensions are not multiples of 16, and the output projection, in high precision). torchtitan's
    converter itself refuses to run without an SM89 GPU, so its three steps are taken here."""
    from functools import partial

    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ModelError("--float8 needs torchao (pip install torchao==0.18.0, requirements-torchtitan.txt).") from None
    from torchao.float8.float8_linear import Float8Linear
    from torchtitan.components.quantization.utils import module_filter_fn

    if any(isinstance(m, Float8Linear) for m in model.modules()):
        return  # converted already (a tensor parallel rank converts before applying its Float8 styles)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=False),
                               module_filter_fn=partial(module_filter_fn, filter_fqns=["output"]))


def block_container(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """The module holding the model's repeated blocks (the largest ModuleList, Sequential or ModuleDict
    of children with parameters) and those children's names in it."""
    best: tuple[nn.Module, list[str]] = (model, [])
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            names = [n for n, m in module.named_children() if any(True for _ in m.parameters())]
            if len(names) > len(best[1]):
                best = (module, names)
    return best


@contextlib.contextmanager
def compiled(model: nn.Module, mode: str) -> Iterator[nn.Module]:
    """``model`` compiled as ``mode`` says (:data:`COMPILE_MODES`), yielded as what the step calls; the
    model is put back as it was, and dynamo's caches emptied, on the way out. An ``hf:`` model's step
    tells transformers that each row holds one sequence in a way dynamo can trace
    (:func:`bonsai_core.models.hf.compiled_with_one_sequence_per_row`), as without compile."""
    from bonsai_core.models.hf import compiled_with_one_sequence_per_row

    check_compile(mode)
    torch._dynamo.reset()
    container, names = block_container(model)
    originals = {n: container.get_submodule(n) for n in names}
    try:
        with compiled_with_one_sequence_per_row(model):
            if mode == "model":
                yield torch.compile(model)
            else:
                if not names:
                    raise ModelError(f"compile={mode!r} compiles each block of the model's block stack, but the model "
                                     "has no ModuleList, Sequential or ModuleDict of blocks; compile the whole model.")
                for n, block in originals.items():
                    container.register_module(n, torch.compile(block, fullgraph=True))
                yield model
    finally:
        for n, block in originals.items():
            container.register_module(n, block)
        torch._dynamo.reset()  # what was compiled here runs no kernel: never let a later real call reuse it


@contextlib.contextmanager
def partitioner_for(kernels: str) -> Iterator[None]:
    """Within: AOTAutograd's partitioner choosing as it does on ``kernels``' device ("cpu" or "cuda"). Its
    compute-intensive ops are never recomputed by its min-cut, and its memory-budget knapsack weighs
    recomputing them by their FLOPs; the list names the GPU's attention kernels, not the CPU's flash
    kernel a trace records in their place (:mod:`bonsai_core.attention`), which it would take as free to
    recompute. For ``"cuda"`` that kernel joins the list; for ``"cpu"`` the partitioner is left as is."""
    from torch._functorch import partitioners

    if kernels == "cpu":
        yield
        return
    original = partitioners.get_default_op_list

    def op_list() -> Any:
        ops = original()
        ops.compute_intensive_ops.add(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
        return ops

    partitioners.get_default_op_list = op_list
    try:
        yield
    finally:
        partitioners.get_default_op_list = original


@contextlib.contextmanager
def rng_states_before_opaque_objects() -> Iterator[None]:
    """Within: AOTAutograd's partitioner passing the RNG states of a checkpointed random op (the CPU's flash
    attention is one) from forward to backward where its runtime reads them. Its ``functionalize_rng_ops``
    appends them to the forward's saved outputs just before the symints and to the backward's inputs just
    before the tangents, behind any opaque objects saved (a tensor-parallel block saves its ``DeviceMesh``),
    while the runtime takes every saved tensor to come before those objects; it would hand the mesh to
    ``save_for_backward``. The states are moved in front of the opaque objects in both graphs. (On a GPU the
    partitioner takes the graph-safe path, whose states are inputs, not saved outputs.)"""
    from torch._functorch import partitioners
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node

    original = partitioners.functionalize_rng_ops

    def is_object(node: Any) -> bool:
        return is_opaque_node(node) or type(getattr(node, "meta", {}).get("val")).__name__ == "FakeScriptObject"

    def reordered(*args: Any, **kwargs: Any) -> Any:
        fw_module, bw_module = original(*args, **kwargs)
        output = next(iter(fw_module.graph.find_nodes(op="output")))
        outs = list(output.args[0])
        states = [n for n in outs if isinstance(n, torch.fx.Node) and n.target is operator.getitem
                  and n.args[0].target is torch._prims.rng_prims.run_and_save_rng_state]
        objects = [i for i, n in enumerate(outs) if is_object(n)]
        if not states or not objects or any(getattr(n, "meta", {}).get("saved_tensor_with_no_vc_check")
                                            for n in outs if isinstance(n, torch.fx.Node)):
            return fw_module, bw_module
        rest = [n for n in outs if not any(n is s for s in states)]
        at = next(i for i, n in enumerate(rest) if is_object(n))
        output.args = (tuple(rest[:at] + states + rest[at:]),)
        placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
        first_object = next((n for n in placeholders if is_object(n)), None)
        if first_object is not None:
            for node in placeholders:
                if node.name.startswith("rng_state_output_"):
                    first_object.prepend(node)
        fw_module.recompile()
        bw_module.recompile()
        return fw_module, bw_module

    partitioners.functionalize_rng_ops = reordered
    try:
        yield
    finally:
        partitioners.functionalize_rng_ops = original


@contextlib.contextmanager
def dtensor_metadata_unrecorded(recorder: StepRecorder) -> Iterator[None]:
    """Within: DTensor's sharding propagation not recorded. To learn an op's output shape it runs the op on
    fake tensors of the global (unsharded) shape in the ambient fake mode, where the recorder would see a
    tensor parallel rank make the whole logits; they are metadata, no memory of the rank."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def unrecorded(self: Any, op_schema: Any) -> Any:
        with recorder.unrecorded():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = unrecorded
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def trace_compiled_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
                        compile: str = "model", name: str = "model", profile: str = DEFAULT_PROFILE,
                        autocast: str | None = None, checkpointing: str | None = None, float8: bool = False,
                        kernels: str = "cuda") -> Graph:
    """One training step of ``model`` (fake tensors, built under the ambient ``FakeTensorMode``) compiled
    as ``compile`` says, recorded as it runs into a Graph (module doc). Gradients persist from step to
    step: a first step compiles and allocates them, and they are the graph's fixed gradient buffers. The
    second step, recorded, runs with every ``.grad`` set to None, as FSDP2 leaves its unsharded parameters'
    (its post-backward takes them) and ``optimizer.zero_grad()`` leaves all: ``AccumulateGrad`` keeps the
    compiled backward's output (or its copy, where the layout is not the parameter's) as ``.grad``. Each
    gradient is then an output of the graph that nothing reads, as in the eager trace: the node where
    ``AccumulateGrad`` took it (:func:`gradients_taken`), which the training loop's rules act on (kept
    buffers: it is freed there, as after the run's ``add_``; set to None: held to the optimizer step; FSDP:
    held to its unit's reduce-scatter). Recorded accumulating into the kept buffers instead, every gradient
    would be an in-place ``add_`` of no bytes, and FSDP and ``with_grads_set_to_none`` would see none.
    The graph's fixed memory is the parameters, the gradients the first step made, the buffers, the batch
    and what the step reads that existed before it (constants). ``checkpointing``:
    see :func:`checkpointed`; ``float8``: the linears first converted (:func:`float8_linears`); ``kernels``:
    the device whose partitioner's choices to trace (:func:`partitioner_for`)."""
    if float8:
        float8_linears(model)
    from bonsai_core.trace.patches import autocast_context

    if profile not in PROFILES:
        raise ModelError(f"Unknown cost model {profile!r}; choose one of: {', '.join(PROFILES)}.")
    device_type = inputs[0].device.type if inputs else "cpu"

    def step(runnable: nn.Module, recorder: StepRecorder | None = None) -> None:
        with autocast_context(autocast, device_type):
            loss = loss_fn(runnable(*inputs))
        if recorder is not None:
            recorder.phase = "backward"
        loss.backward()

    with inductor_without_kernels(), partitioner_for(kernels), rng_states_before_opaque_objects(), \
            torch.enable_grad(), \
            checkpointed(model, checkpointing), compiled(model, compile) as runnable:
        try:
            step(runnable)  # compiles, and allocates the gradients
        except ModelError:
            raise
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            limit = torch._dynamo.config.recompile_limit
            raise ModelError(f"torch.compile could not compile {name!r}: dynamo compiled one function more than "
                             f"torch._dynamo.config.recompile_limit ({limit}) times, which fullgraph=True refuses "
                             "(FailOnRecompileLimitHit). Compiled blocks share one function, compiled once per "
                             "distinct checkpoint plan of a block: raise that limit to the number of blocks (in this "
                             "process and in the run), or compile the whole model.") from None
        except Exception as e:  # dynamo and inductor raise many types; the user needs what failed
            raise ModelError(f"torch.compile could not compile {name!r} ({type(e).__name__}: "
                             f"{(str(e).strip().splitlines() or [''])[0]}). Trace it without compile, or fix what "
                             "torch.compile reports.") from None
        fixed = _fixed_tensors(model, inputs, loss_fn)
        recorder = StepRecorder(PROFILES[profile], {t.untyped_storage()._cdata for _, t, _ in _distinct(fixed)})
        calls: list[list[Any]] = []
        kept = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        try:
            with kernel_calls(recorder.kernel), _module_calls(model, compile, recorder, calls), \
                    dtensor_metadata_unrecorded(recorder), gradients_taken(model, recorder), recorder:
                step(runnable, recorder)
            gc.collect()
            nodes = recorder.finish(outputs=gradient_storages(model))
        finally:
            for n, p in model.named_parameters():
                p.grad = kept[n]
    fill_scratch(nodes, recorder.scratch)
    tensors = [[n, t.untyped_storage().nbytes(), kind] for n, t, kind in _distinct(fixed)]
    tensors += [[f"constant.{i}", b, "constant"] for i, b in enumerate(recorder.constants.values())]
    label = f"{name}{' float8' if float8 else ''} compiled ({compile}" + (f", {checkpointing})" if checkpointing else ")")
    return Graph.from_nodes(label, sum(t[1] for t in tensors), nodes, fixed_tensors=tensors,
                            modules=calls)


@contextlib.contextmanager
def _module_calls(model: nn.Module, mode: str, recorder: StepRecorder, calls: list[list[Any]]) -> Iterator[None]:
    """Within: each forward call of a module that runs eagerly, or of a compiled block, is appended to
    ``calls`` as [path, first node, last node] (``Graph.modules``). A module inside a compiled region
    gets no hook: dynamo would compile the hook into its graph, and the step would not be the user's."""
    if mode == "model":
        yield
        return
    container, names = block_container(model)
    inside = {id(m) for n in names for m in container.get_submodule(n).modules()}
    blocks = {id(container.get_submodule(n)) for n in names}
    hooked = [(path, m) for path, m in model.named_modules() if path and (id(m) not in inside or id(m) in blocks)]
    opened: list[tuple[str, int]] = []

    def pre(path: str) -> Callable[..., None]:
        return lambda *_: opened.append((path, len(recorder.nodes)))

    def post(path: str) -> Callable[..., None]:
        def close(*_: Any) -> None:
            at = next(i for i in range(len(opened) - 1, -1, -1) if opened[i][0] == path)
            _, first = opened.pop(at)
            if len(recorder.nodes) > first and recorder.phase == "forward":
                calls.append([path, first, len(recorder.nodes) - 1])
        return close

    handles = []
    for path, m in hooked:
        handles += [m.register_forward_pre_hook(pre(path)), m.register_forward_hook(post(path))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def gradients_taken(model: nn.Module, recorder: StepRecorder) -> Iterator[None]:
    """Within: each time ``AccumulateGrad`` takes a parameter's gradient (after the compiled backward that made
    it returns), the recorder marks it (:meth:`~bonsai_core.trace.recorder.StepRecorder.taken`): until then it
    lives, whatever the loop then does with it (adds it into a kept buffer and frees it, keeps it, or hands
    it to FSDP's reduce-scatter)."""
    def hook(name: str) -> Callable[[torch.Tensor], None]:
        def took(param: torch.Tensor) -> None:
            for _, t in plain_tensors(name, param.grad):
                recorder.taken(t)
        return took

    handles = [p.register_post_accumulate_grad_hook(hook(n)) for n, p in model.named_parameters() if p.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def gradient_storages(model: nn.Module) -> set[int]:
    """The storages of ``model``'s parameters' gradients (a tensor subclass's plain tensors')."""
    return {t.untyped_storage()._cdata for n, p in model.named_parameters() if p.grad is not None
            for _, t in plain_tensors(n, p.grad)}


def _fixed_tensors(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, kind) of what lives through the step: parameters, their gradients, buffers, the
    batch and the loss function's buffers. A gradient's plain tensors are named ``<plain tensor>.grad``, as
    the eager trace names them: FSDP pairs each with its parameter's (a tensor-parallel gradient replicated
    where its parameter is sharded, as DTensor's embedding backward makes it, is reduce-scattered into the
    parameter's shard)."""
    out = [(n, p, "param") for n, p in model.named_parameters()]
    out += [(m + ".grad", t, "grad") for n, p in model.named_parameters() if p.grad is not None
            for m, t in plain_tensors(n, p.grad)]
    out += [(n, b, "buffer") for n, b in model.named_buffers()]
    if isinstance(loss_fn, nn.Module):
        out += [("loss_fn." + n, b, "buffer") for n, b in loss_fn.named_buffers()]
    out += [(f"input.{i}", x, "input") for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
    return out


def plain_tensors(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``t`` as the plain tensors that hold its bytes, named: itself, or a tensor subclass's inner tensors (a
    DTensor's local shard, a Float8 tensor's data and scale), whose storages the step's ops read and write."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [(name, t)]
    inner, _ = t.__tensor_flatten__()
    return [item for attr in inner if isinstance(getattr(t, attr), torch.Tensor)  # a DTensor's mesh is no tensor
            for item in plain_tensors(f"{name}.{attr}", getattr(t, attr))]


def _distinct(fixed: list[tuple[str, torch.Tensor, str]]) -> list[tuple[str, torch.Tensor, str]]:
    """Each storage once (tied parameters, views of one buffer), a tensor subclass's as its plain tensors'."""
    seen: set[int] = set()
    out = []
    for n, t, kind in [(m, p, kind) for name, tensor, kind in fixed for m, p in plain_tensors(name, tensor)]:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            out.append((n, t, kind))
    return out


def block_paths(model: nn.Module) -> list[str]:
    """The paths in ``model`` of the blocks that ``compile="blocks"`` compiles one by one (:func:`block_container`)."""
    container, names = block_container(model)
    at = next(path for path, m in model.named_modules() if m is container)
    return [f"{at}.{n}" if at else n for n in names]


def shared_block_plans(units: list[Any], blocks: list[str], limit: int, modules: set[str]) -> list[Any]:
    """``units`` (checkpointed submodules: frozen dataclasses with ``path``, ``saves``, ``dropped_bytes``, as
    :class:`bonsai_core.export.checkpoint.Unit`) with at most ``limit`` distinct block plans. Compiled blocks
    share one function, compiled once per distinct plan of a block (its units relative to the block; none
    is a plan too), and dynamo refuses past its ``recompile_limit`` under ``fullgraph=True``. While there
    are more, the blocks of one plan take the plan that frees at least as many bytes and whose submodules
    each of those blocks has (``modules``: the model's paths), the merge adding the fewest freed bytes over
    its blocks (a proxy for the recomputation it adds; never more held, as the eager plan counts it).
    Units outside the blocks are kept."""
    def block_of(path: str) -> str | None:
        return next((b for b in blocks if path == b or path.startswith(b + ".")), None)

    mine: dict[str, list[Any]] = {b: [] for b in blocks}
    outside, merged = [], False
    for unit in units:
        block = block_of(unit.path)
        (outside if block is None else mine[block]).append(unit)

    def plan(block: str) -> tuple:
        return tuple(sorted((u.path[len(block):], tuple((op, tuple(k)) for op, k in sorted(u.saves.items())))
                            for u in mine[block]))

    def fits(units_of: str, members: list[str]) -> bool:
        return all(f"{b}{u.path[len(units_of):]}" in modules for b in members for u in mine[units_of])

    while True:
        groups: dict[tuple, list[str]] = {}
        for block in blocks:
            groups.setdefault(plan(block), []).append(block)
        if len(groups) <= limit:
            break
        merged = True
        freed = {p: sum(u.dropped_bytes for u in mine[members[0]]) for p, members in groups.items()}
        merges = [(len(members) * (freed[target] - freed[p]), freed[target], p, target)
                  for p, members in groups.items() for target, into in groups.items()
                  if target != p and freed[target] >= freed[p] and fits(into[0], members)]
        if not merges:
            raise ModelError(f"The plan checkpoints the model's blocks in {len(groups)} distinct ways, more than "
                             f"torch._dynamo.config.recompile_limit ({limit}) compilations of the blocks' shared "
                             "function allow, and no block's plan applies to the others' submodules; raise that limit "
                             "to the number of blocks (in this process and in the run), or compile the whole model.")
        _, _, p, target = min(merges, key=lambda m: m[:2])
        source = groups[target][0]
        for block in groups[p]:
            mine[block] = [dataclasses.replace(u, path=f"{block}{u.path[len(source):]}") for u in mine[source]]
    return outside + [u for b in blocks for u in mine[b]] if merged else units
