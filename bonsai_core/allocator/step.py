"""What every replayed step shares, the whole step's (:mod:`bonsai_core.allocator.replaying`) and a pipeline
rank's (:mod:`bonsai_core.allocator.pipelined`): the block events of a schedule's live set, the optimizer
step's temporaries, and the error of a request the pool cannot serve."""

from __future__ import annotations

from typing import Callable

from bonsai_core.allocator.policies import Allocator
from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.schedule import FREE, Residency
from bonsai_core.units import format_bytes

FSDP_OWNERS = 2**50  # owner ids of FSDP2's buffers in the allocator (nodes are below graph.n, fixed tensors just above)


def out_of_pool(alloc: Allocator, capacity: int | None, outside: int, i: int, what: str, nbytes: int) -> BudgetError:
    """The error of a request at op ``i`` that the pool of ``capacity`` cannot serve."""
    return BudgetError(
        f"The allocator runs out of its {format_bytes(capacity)} pool at op {i} ({what}, {format_bytes(nbytes)}): "
        f"{format_bytes(alloc.footprint + outside)} is in use and its largest free block is "
        f"{format_bytes(alloc.largest_free)}. Replay without a capacity to see the reserved peak this schedule needs.")


def blocks_taken_and_given(ops: list[tuple[str, int]], residency: Residency, holds: list[bool],
                           inplace: bool) -> tuple[dict[int, int], dict[int, list[int]]]:
    """The block events of a schedule's live set: {op position: the node whose block the op's output takes
    in place, or -1 for a new block}, and {op position: the nodes whose blocks go before its output's}.
    Copy-on-write (``inplace`` False): an output written in place gets a new block, and its input's goes at
    the input's own free, the first op after the write that frees it."""
    copies = [(node, start, end, taken) for node, start, end, taken in zip(
        residency.node.tolist(), residency.start.tolist(), residency.end.tolist(), residency.taken.tolist()) if holds[node]]
    starts = {start: -1 for _, start, _, _ in copies}
    ends: dict[int, list[int]] = {}
    for node, _, end, taken in copies:
        if taken and inplace:
            starts[end] = node
        elif taken:
            ends.setdefault(next(j for j in range(end + 1, len(ops)) if ops[j] == (FREE, node)), []).append(node)
        elif end < len(ops):
            ends.setdefault(end, []).append(node)
    return starts, ends


def parameter_bytes(graph: Graph) -> list[int]:
    """The bytes of each trainable parameter, which the optimizer step's temporaries take
    (``_foreach_sqrt(exp_avg_sq)``): its optimizer state's first tensor (``exp_avg``, ``momentum_buffer``:
    ``zeros_like`` the parameter), or where there is none its gradient buffer (a fixed tensor of kind ``grad``)."""
    from bonsai_core.optimizer import STATES

    states = STATES[graph.optimizer["name"]] if graph.optimizer is not None else ()
    first = "." + states[0] if states else None
    found = [t[1] for t in graph.fixed_tensors if first and t[2] == "optimizer" and t[0].endswith(first) and t[1] > 0]
    return found or [t[1] for t in graph.fixed_tensors if t[2] == "grad" and t[1] > 0]


def optimizer_step(alloc: Allocator, graph: Graph, malloc: Callable[..., None], i: int) -> None:
    """The optimizer step's temporaries after the last op: per trainable parameter (its bytes,
    :func:`parameter_bytes`), as many tensors as :data:`bonsai_core.optimizer.STEP_TEMPORARIES` says,
    allocated together (one foreach kernel), then freed."""
    from bonsai_core.optimizer import STEP_TEMPORARIES

    if graph.optimizer is None:
        return
    per_param = STEP_TEMPORARIES[graph.optimizer["name"]]
    sizes = parameter_bytes(graph) * per_param
    owners = [FSDP_OWNERS - 1 - k for k in range(len(sizes))]
    for owner, nbytes in zip(owners, sizes):
        malloc(owner, nbytes, "the optimizer step's temporaries", i)
    for owner in owners:
        alloc.free(owner)
