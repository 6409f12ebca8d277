"""torchtitan's activation checkpointing as methods: ``torchtitan-full`` and ``torchtitan-selective``.

torchtitan wraps every transformer block (``model.layers.<i>``) in ``checkpoint_wrapper``
(``torchtitan/distributed/activation_checkpoint.py``, ``apply_ac``); these methods are the same
plans on a traced graph's block stack (:func:`bonsai_core.graph.block_stack`), as checkpoint regions
(:mod:`bonsai_core.regions`): each block its own recomputed segment, the ops between blocks (the
embedding, the final norm, the output projection and the loss) kept.

* ``torchtitan-full`` (``mode = "full"``): a block keeps only its input; its backward pass recomputes
  it whole.
* ``torchtitan-selective`` (``mode = "selective"``, ``selective_ac_option = "op"``, the setting of
  its Llama 3 8B config and of the published Dec-2024 runs): a block keeps the outputs of the ops in
  torchtitan's save list (``_op_sac_save_list``), which become the plan's saved nodes (selective
  activation checkpointing's ``MUST_SAVE``), and recomputes the rest. The policy counts the
  block's ``aten.mm`` calls in forward order, afresh for every block, and recomputes every second one
  (the 2nd, 4th, ...). In a Llama block that saves ``wq``, ``wv``, ``w1`` and ``w2``'s outputs and
  recomputes ``wk``, ``wo`` and ``w3``'s.

The save lists (``release``), read from torchtitan's code:

* ``"0.2.2"`` (``torchtitan/models/llama3/infra/parallelize.py``, the release this project
  supports): ``mm``, the SDPA kernels (flash, memory-efficient, cuDNN, math, fused overrideable),
  ``reduce_scatter_tensor``, ``max``, flex attention and varlen attention;
* ``"2024-12"`` (commit 3f20451bc of 2024-12-26, ``torchtitan/parallelisms/parallelize_llama.py``, what
  the published table ran): ``mm``, flash and memory-efficient SDPA, ``reduce_scatter_tensor``,
  ``abs`` and ``max``.

They differ in ops a bf16 Llama 3 step on flash attention does not run (``abs``, the other attention
kernels), so on torchtitan's Llama both make the same plan. The trace records SDPA as the CPU flash
kernel (``_scaled_dot_product_flash_attention_for_cpu``), which stands for the GPU's flash kernel
(it keeps the same output and logsumexp; :mod:`bonsai_core.attention`), so it counts as flash here.
torchtitan's current main (after 0.3.0) saves every op of the compiler's compute-intensive list
(``mm``, ``addmm``, ``bmm``, convolutions, attention) and ``linear``, still recomputing every second
``mm``/``linear``: the same plan on a Llama, more saved ops on a model with biases (``addmm``).

Both are fixed plans, as in torchtitan: the budget does not change them. Under a budget below the
plan's peak the method raises BudgetError naming that peak. Their schedules hold each saved output
until its block's rebuild (:func:`bonsai_core.regions.hold_saved`, in every plan's schedule): torchtitan runs them as
selective activation checkpointing, whose storage keeps every MUST_SAVE output until the
recomputation consumes it, read or not (a block's last projection, read only by the residual add).
"""

from __future__ import annotations

from typing import Literal


from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.export_runtime.checkpointing import FUSED_ATTENTION
from bonsai_core.graph import Graph, block_stack
from bonsai_core.regions import CheckpointPlan, block_plans, plan_schedule
from bonsai_core.schedule import Schedule, simulated
from bonsai_core.units import format_bytes

Release = Literal["0.2.2", "2024-12"]
MM = "aten.mm.default"
# each list as torchtitan wrote it, with the CPU's flash kernel (traced in place of the GPU's) beside its flash kernel
SAVE_LISTS: dict[str, frozenset[str]] = {
    "0.2.2": frozenset({MM, *FUSED_ATTENTION, "aten._scaled_dot_product_attention_math.default",
                        "_c10d_functional.reduce_scatter_tensor.default", "aten.max.default",
                        "flex_attention", "torch_attn._varlen_attn.default"}),
    "2024-12": frozenset({MM, *FUSED_ATTENTION[:3],  # the flash kernels (CPU and GPU), the memory-efficient one
                          "_c10d_functional.reduce_scatter_tensor.default",
                          "aten.abs.default", "aten.max.default"}),
}


def torchtitan_save_list(release: Release = "0.2.2") -> set:
    """A release's save list as the op overloads torchtitan's ``apply_ac`` takes (``op_sac_save_list``),
    those this torch has."""
    import torch

    if release not in SAVE_LISTS:
        raise SolverError(f"Unknown torchtitan release {release!r}; choose one of: {', '.join(SAVE_LISTS)}.")
    ops = set()
    for name in SAVE_LISTS[release]:
        namespace, _, rest = name.partition(".")
        packet, _, overload = rest.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace, None), packet, None), overload or "default", None)
        if op is not None:
            ops.add(op)
    return ops


def full_plan(graph: Graph) -> CheckpointPlan:
    """Every block of the block stack a recomputed segment (``mode = "full"``)."""
    _require_blocks(graph)
    return block_plans(graph, every=(1,))[0][1]


def selective_plan(graph: Graph, release: Release = "0.2.2") -> CheckpointPlan:
    """:func:`full_plan` with the outputs of the save list's ops saved inside each block, every second
    ``mm`` of a block (counted in forward order) left to recompute (``selective_ac_option = "op"``)."""
    if release not in SAVE_LISTS:
        raise SolverError(f"Unknown torchtitan release {release!r}; choose one of: {', '.join(SAVE_LISTS)}.")
    plan = full_plan(graph)
    save_list = SAVE_LISTS[release]
    saved: list[int] = []
    for i in sorted(plan.recomputed):
        mm_count = 0
        for v in plan.segments[i]:
            op = graph.ops[v]
            if op == MM:
                mm_count += 1
            if op in save_list and not (op == MM and mm_count % 2 == 0):
                saved.append(v)
    return CheckpointPlan.of(plan.segments, sorted(plan.recomputed), saved=saved)


def solve_torchtitan_full(graph: Graph, budget: int | None, *, time_limit: float | None = None) -> Schedule:
    """torchtitan's full activation checkpointing: every transformer block recomputed (module docstring).

    time_limit: seconds (accepted for a uniform interface; the plan is fixed)"""
    return _fixed(graph, budget, full_plan(graph), "torchtitan-full")


def solve_torchtitan_selective(graph: Graph, budget: int | None, *, time_limit: float | None = None,
                               release: Release = "0.2.2") -> Schedule:
    """torchtitan's op-level selective activation checkpointing on every block (module docstring).

    time_limit: seconds (accepted for a uniform interface; the plan is fixed)
    release: whose save list: "0.2.2" (torchtitan 0.2.2) or "2024-12" (the commit of the published Dec-2024 table)"""
    schedule = _fixed(graph, budget, selective_plan(graph, release), "torchtitan-selective")
    schedule.stats["release"] = release
    return schedule


def _fixed(graph: Graph, budget: int | None, plan: CheckpointPlan, method: str) -> Schedule:
    schedule = plan_schedule(graph, plan, method)  # holds the saved outputs as SAC's storage does
    peak = simulated(graph, schedule).peak  # kept on the schedule: solve's own check reuses it
    if budget is not None and peak > budget:
        raise BudgetError(f"Method {method!r} is a fixed plan, as in torchtitan: on {graph.name!r} it peaks at "
                          f"{format_bytes(peak)} ({peak} bytes), over the budget of {format_bytes(budget)}. Raise "
                          "the budget to at least that, or use a method that plans for a budget (bonsai).")
    schedule.stats = {"status": "fixed", "segments": len(plan.segments), "recomputed": len(plan.recomputed),
                      "saved": len(plan.saved)}
    return schedule


def _require_blocks(graph: Graph) -> None:
    if not block_stack(graph) or not block_plans(graph, every=(1,)):
        raise SolverError(f"torchtitan's activation checkpointing wraps each block of a model's block stack "
                          f"(model.layers.0, .1, ...), and {graph.name!r} records none: trace a model with "
                          "repeated blocks (numbered submodules, like a transformer's layers), or use bonsai or chen.")
