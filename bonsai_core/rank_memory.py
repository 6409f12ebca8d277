"""What holds a rank's bytes over a schedule and at its live peak: the one account the result pages, the
explorer's per-rank chart and ``scripts/peak_breakdown.py`` read, each naming the parts its own way. After
each op the rank holds

- its fixed tensors, by kind (:func:`fixed_by_kind`: ``Graph.fixed_tensors``, sharded by FSDP);
- what it holds beyond the graph's tensors (:func:`working`), as the simulator adds it to the timeline:
  FSDP's working memory by part (rule 7, :func:`bonsai_core.fsdp.working_parts`) or, on a pipeline rank,
  the other microbatches in flight with FSDP's gradients (rule 11, :func:`bonsai_core.in_flight.working`);
- the graph's tensors held, forward and backward (:func:`tensors_held`, from ``SimResult.residency``).

These add up to ``SimResult.timeline``; the optimizer step after the last op may hold the live peak instead
(:func:`optimizer_holds_peak`). Pure functions of a graph, a schedule's ops and their ``SimResult``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from bonsai_core.fsdp import working_parts
from bonsai_core.graph import Graph
from bonsai_core.in_flight import working as microbatches_in_flight
from bonsai_core.schedule import SimResult

IN_FLIGHT = "other microbatches in flight, FSDP's gradients"
UNLISTED = "unlisted"  # the kind of a graph's fixed bytes when it lists no fixed tensors

Ops = Sequence[tuple[str, int]]


def fixed_by_kind(graph: Graph) -> dict[str, int]:
    """``fixed_mem`` by kind of fixed tensor, the kinds in the order the graph lists them first; one
    ``UNLISTED`` part for a graph that lists none."""
    if not graph.fixed_tensors:
        return {UNLISTED: graph.fixed_mem} if graph.fixed_mem else {}
    out: dict[str, int] = {}
    for _, nbytes, kind in graph.fixed_tensors:
        out[kind] = out.get(kind, 0) + nbytes
    return out


def working(graph: Graph, ops: Ops, sim: SimResult) -> dict[str, np.ndarray]:
    """int64[len(ops)] per part of what the rank holds beyond ``fixed_mem`` and the graph's tensors: on a
    pipeline rank ``IN_FLIGHT`` alone, else FSDP's parts (``bonsai_core.fsdp.WORKING_PARTS``); empty for
    a rank with neither."""
    in_flight = microbatches_in_flight(graph, ops, sim.residency)
    if in_flight is not None:
        return {IN_FLIGHT: in_flight}
    return working_parts(graph, ops) if graph.fsdp is not None else {}


def tensors_held(graph: Graph, sim: SimResult) -> tuple[np.ndarray, np.ndarray]:
    """int64[len(ops)] twice: the bytes of the graph's forward tensors held after each op (saved activations,
    the loss's forward outputs), then of its backward tensors (gradients in flight, temporaries)."""
    return (sim.residency.bytes_held(graph.mem, among=graph.is_forward),
            sim.residency.bytes_held(graph.mem, among=~graph.is_forward))


@dataclass(frozen=True)
class AtPeak:
    """What holds a rank's bytes at its live peak; they add up to ``SimResult.peak``."""

    fixed: dict[str, int]  # by kind (fixed_by_kind)
    working: dict[str, int]  # beyond the graph's tensors, by part (working)
    forward: int  # the graph's forward tensors held (tensors_held)
    backward: int  # its backward tensors held
    optimizer_step: int  # where the optimizer step holds the peak, its bytes above fixed_mem (the parts above: 0)


def at_peak(graph: Graph, ops: Ops, sim: SimResult) -> AtPeak:
    """The parts at the live peak (``SimResult.peak_op``), or the optimizer step's bytes where it holds it."""
    fixed = fixed_by_kind(graph)
    if optimizer_holds_peak(graph, ops, sim):
        return AtPeak(fixed, {}, 0, 0, graph.optimizer_peak - graph.fixed_mem)
    i = sim.peak_op
    forward, backward = tensors_held(graph, sim)
    beyond = {name: int(v[i]) for name, v in working(graph, ops, sim).items()}
    return AtPeak(fixed, beyond, int(forward[i]), int(backward[i]), 0)


def optimizer_holds_peak(graph: Graph, ops: Ops, sim: SimResult) -> bool:
    """Whether the live peak is the optimizer step's after the last op (``Graph.optimizer_peak``)."""
    return graph.optimizer is not None and sim.peak_op == len(ops) - 1 and sim.peak == graph.optimizer_peak


def peak_at(graph: Graph, ops: Ops, sim: SimResult) -> str:
    """The op the rank's live peak follows: its phase, aten op and node name (the optimizer step if there)."""
    if optimizer_holds_peak(graph, ops, sim):
        return "the optimizer step"
    kind, node = ops[sim.peak_op][0], ops[sim.peak_op][1]
    if kind == "compute" and ("compute", node) in ops[:sim.peak_op]:
        kind = "recompute"
    return f"{graph.phases[node]} `{graph.ops[node]}` (node {graph.names[node]}, its {kind})"


def held_at_peak(graph: Graph, sim: SimResult, largest: int = 4) -> list[dict[str, Any]]:
    """The graph's tensors held at the live peak grouped by phase and shape, the ``largest`` groups by bytes (how
    many, their bytes, the ops that made them): the saved block inputs, the loss's logits shards and the like."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for v in sorted(set(sim.residency.live_at(sim.peak_op).tolist())):
        if graph.mem[v] == 0:
            continue
        group = groups.setdefault((graph.phases[v], graph.shapes[v]), {
            "phase": graph.phases[v], "shape": graph.shapes[v], "count": 0, "bytes": 0, "ops": []})
        group["count"] += 1
        group["bytes"] += int(graph.mem[v])
        if graph.ops[v] not in group["ops"]:
            group["ops"].append(graph.ops[v])
    return sorted(groups.values(), key=lambda g: -g["bytes"])[:largest]


def after_peak(graph: Graph, sim: SimResult) -> int:
    """The step's highest live memory once every backward tensor held at its live peak is freed (0 if the step
    ends first): how far below its peak the rest of the backward stays, the blocks' backward where the peak is
    the loss's."""
    res, i = sim.residency, sim.peak_op
    at_peak = (res.start <= i) & (i < res.end)
    backward = ~graph.is_forward[res.node] & (graph.mem[res.node] > 0)
    gone = int(res.end[at_peak & backward].max(initial=i + 1))
    return int(sim.timeline[gone:].max()) if gone < len(sim.timeline) else 0
