"""One plan per transformer block, made for a pipeline stage of one model and applied to the stages of another
of the same block structure (a 405B stage's plan on the debugmodel's stages).

**The form.** A block plan is torchtitan's selective checkpointing generalised (``bonsai_core.solvers.torchtitan``):
every block of the stage recomputed (``torch.utils.checkpoint`` around ``layers.<i>``), saving the outputs of
the block's ops named in ``saves``, ``{op name: [k, ...]}``, the k-th call of that name in the block's forward
(counted afresh in each block, as the SAC policy counts them: ``bonsai_core.export_runtime.checkpointing.policy``,
a fused attention kernel under the one name ``scaled_dot_product_attention``). The choice is over the block's
matmuls and its attention: their calls are the same in a tensor parallel bf16 block and an unsharded fp32 one
(tensor parallel adds collectives and casts, never a matmul), so the plan transfers node for node where the
views and casts around them do not.

**The choice.** Of every subset of those calls, the one of least recomputation whose simulated peak on the
stage's rank graph is within the budget (each subset scheduled as the plan's checkpoint regions,
:func:`bonsai_core.regions.plan_schedule`, and judged by the simulator with the pipeline's microbatches in
flight, rule 11). One plan for every block: compiled blocks share one function (as
:func:`bonsai_core.trace.compiled.shared_block_plans` needs) and a stage of another depth takes it unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any

from bonsai_core.errors import BudgetError
from bonsai_core.export_runtime.checkpointing import SAME_OP, apply_saves
from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, plan_schedule
from bonsai_core.schedule import Schedule, simulate
from bonsai_core.solvers.torchtitan import MM, full_plan
from bonsai_core.units import format_bytes

ATTENTION = "scaled_dot_product_attention"  # SAC's one name for the fused attention kernels
CHOSEN_FROM = (MM, ATTENTION)  # the ops a block plan saves: a block's matmuls and its attention

BlockSaves = dict[str, list[int]]  # op name -> the calls (k-th of that name in a block's forward) saved


def op_name(op: str) -> str:
    """An op as SAC's policy names it (the fused attention kernels as one)."""
    return SAME_OP.get(op, op)


def block_calls(graph: Graph) -> dict[str, int]:
    """How many calls of each op of :data:`CHOSEN_FROM` the first block of ``graph``'s block stack runs forward."""
    plan = full_plan(graph)
    first = plan.segments[min(plan.recomputed)]
    counts = {name: 0 for name in CHOSEN_FROM}
    for v in first:
        name = op_name(graph.ops[v])
        if name in counts:
            counts[name] += 1
    return counts


def block_saves_plan(graph: Graph, saves: BlockSaves, full: CheckpointPlan | None = None) -> CheckpointPlan:
    """Every block of ``graph``'s block stack recomputed, saving in each the calls ``saves`` names; ``full``:
    the graph's :func:`full_plan`, when the caller has it."""
    plan = full if full is not None else full_plan(graph)
    saved: list[int] = []
    for i in sorted(plan.recomputed):
        seen: dict[str, int] = {}
        for v in plan.segments[i]:
            name = op_name(graph.ops[v])
            k = seen.get(name, 0)
            seen[name] = k + 1
            if k in saves.get(name, ()):
                saved.append(v)
    return CheckpointPlan.of(plan.segments, sorted(plan.recomputed), saved=saved)


def block_saves_schedule(graph: Graph, saves: BlockSaves, full: CheckpointPlan | None = None) -> Schedule:
    """The schedule of :func:`block_saves_plan` (its saved outputs held to their block's rebuild, as SAC holds them)."""
    return plan_schedule(graph, block_saves_plan(graph, saves, full), "block-saves")


def candidates(graph: Graph) -> list[BlockSaves]:
    """Every subset of the block's matmul and attention calls, as block saves."""
    calls = [(name, k) for name, n in block_calls(graph).items() for k in range(n)]
    out = []
    for size in range(len(calls) + 1):
        for chosen in itertools.combinations(calls, size):
            saves: BlockSaves = {}
            for name, k in chosen:
                saves.setdefault(name, []).append(k)
            out.append(saves)
    return out


def plan_stage(graph: Graph, budget: int) -> tuple[BlockSaves, Any]:
    """The block saves of least recomputation whose simulated peak on ``graph`` (a pipeline rank) is within
    ``budget`` bytes (of those, the lowest peak: a call no backward reads costs nothing to drop), and that
    plan's simulation. BudgetError when not even saving nothing fits."""
    best, full = None, full_plan(graph)
    for saves in candidates(graph):
        sim = simulate(graph, block_saves_schedule(graph, saves, full))
        if sim.peak <= budget and (best is None or (sim.compute_cost, sim.peak) < (best[1].compute_cost, best[1].peak)):
            best = (saves, sim)
    if best is None:
        floor = simulate(graph, block_saves_schedule(graph, {}, full)).peak
        raise BudgetError(f"No block plan of {graph.name!r} fits in {format_bytes(budget)}: every block recomputed "
                          f"whole peaks at {format_bytes(floor)} ({floor} bytes).")
    return best


def as_save(saves: BlockSaves, block_paths: list[str]) -> dict[str, BlockSaves]:
    """The block plan on each of ``block_paths`` (a model part's blocks), as ``apply_saves`` takes a plan."""
    return {path: {name: list(ks) for name, ks in saves.items()} for path in block_paths}


def part_blocks(part: Any) -> list[str]:
    """The paths of a torchtitan model part's transformer blocks (``layers.<i>``; a pipeline stage keeps its own)."""
    return [f"layers.{name}" for name in part.layers.keys()]


def describe(saves: BlockSaves, calls: dict[str, int]) -> str:
    """The block plan in words: which of the block's matmuls and attention it saves."""
    parts = []
    for name in CHOSEN_FROM:
        ks = saves.get(name, [])
        short = "mm" if name == MM else "attention"
        parts.append(f"{short} {sorted(ks)} of {calls.get(name, 0)}" if ks else f"no {short} (of {calls.get(name, 0)})")
    return "every block recomputed, saving " + ", ".join(parts)


class BlockPlan:
    """A block plan applied as a plan is (``Plan.apply``'s interface): each transformer block of a model part
    checkpointed, saving the plan's calls (``bonsai_core.export_runtime.checkpointing.apply_saves``)."""

    def __init__(self, saves: BlockSaves) -> None:
        self.saves = saves

    def apply(self, part: Any) -> Any:
        apply_saves(part, as_save(self.saves, part_blocks(part)), "a transformer block")
        return part
