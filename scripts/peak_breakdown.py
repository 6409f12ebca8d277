"""Where a schedule's reserved peak on an FSDP rank comes from, and what holding selective checkpointing's
saved outputs to their block's recompute would add.

    python scripts/peak_breakdown.py GRAPH.json SCHEDULE.json [--policy expandable|caching]

At the op of the live peak: the fixed bytes (by kind of fixed tensor), the forward tensors resident (the
saved activations, and the loss's forward outputs), the backward tensors resident (the transients), FSDP2's
buffers (rule 7: unsharded blocks, all-gather outputs, held gradients, reduce-scatter input), then the
allocator model's reserved peak and its extra over the live peak. For a schedule whose plan saves nodes
(``extra["saved"]``, SAC's MUST_SAVE), the same numbers with every saved node held until its block's rebuild
in the backward pass, as ``torch.utils.checkpoint``'s ``_CachingTorchDispatchMode`` holds every MUST_SAVE
output in its storage until the recompute consumes it (the regions' schedules free it after its last
reader; :func:`bonsai_core.regions.hold_saved`).
"""

from __future__ import annotations

import argparse

from bonsai_core.bench.compiled import peak_parts
from bonsai_core.graph import Graph, load_graph
from bonsai_core.regions import CheckpointPlan, hold_saved
from bonsai_core.schedule import Schedule, load_schedule

GiB = 2**30


def breakdown(graph: Graph, schedule: Schedule, policy: str) -> dict[str, float | str]:
    """GiB of each part at the live peak, the reserved peak and the allocator's extra (:func:`peak_parts`)."""
    return {k: v / GiB if isinstance(v, int) else v for k, v in peak_parts(graph, schedule, policy).items()}


def saved_held_to_rebuild(graph: Graph, schedule: Schedule) -> Schedule:
    """``schedule`` with each saved node held until its segment's rebuild (:func:`bonsai_core.regions.hold_saved`)."""
    ops = hold_saved(graph, CheckpointPlan.from_extra(schedule.extra), list(schedule.ops))
    return Schedule(graph=schedule.graph, method=schedule.method, ops=ops, graph_hash=schedule.graph_hash,
                    extra=schedule.extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graph")
    parser.add_argument("schedule")
    parser.add_argument("--policy", choices=("expandable", "caching"), default="expandable")
    args = parser.parse_args()
    graph, schedule = load_graph(args.graph), load_schedule(args.schedule)
    rows = [("as planned", breakdown(graph, schedule, args.policy))]
    if (schedule.extra or {}).get("saved"):
        rows.append(("saved outputs held to the rebuild", breakdown(graph, saved_held_to_rebuild(graph, schedule), args.policy)))
    for title, parts in rows:
        print(f"{schedule.method} on {graph.name}, {title}:")
        for name, value in parts.items():
            print(f"  {name}: {value:.2f} GiB" if isinstance(value, float) else f"  {name}: {value}")


if __name__ == "__main__":
    main()
