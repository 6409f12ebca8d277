"""Which saved tensors a schedule may offload to host memory, and a schedule's ops with them offloaded
(simulator rule 9, docs/DESIGN.md): the one place every method turns "offload v" into ops.

A saved tensor here is a forward node that the backward pass reads: offloaded, it is copied to host
memory right after its compute, freed on the device after its last forward reader, and reloaded before
its first backward reader, early enough that the copy is hidden by the compute before that reader
when the link allows (a prefetch).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, FREE, OFFLOAD, RELOAD, WAIT

Ops = list[tuple[str, int]]


def offloadable(graph: Graph) -> np.ndarray:
    """bool[n]: the nodes rule 9 lets a method offload as saved tensors: forward, holding bytes (not a
    view, no view of it: a view keeps its base's storage alive), not a step output, read by the
    backward pass, and not a multi-output op whose other outputs are nodes of their own
    (``Graph.output_of``: a dropout with its mask; the run holds such an op's outputs together)."""
    has_view = np.zeros(graph.n, dtype=bool)
    has_view[graph.alias_of[graph.is_view]] = True
    has_view[graph.output_of[graph.output_of >= 0]] = True
    return graph.is_forward & ~graph.is_view & ~has_view & ~graph.is_output & (graph.mem > 0) & graph.read_by_backward


def with_offloads(graph: Graph, ops: Sequence[tuple[str, int]], nodes: Iterable[int], link_bytes_per_s: float,
                  synchronous: bool = False) -> Ops:
    """``ops`` (a schedule computing each of ``nodes`` once, in the forward pass) with every node of
    ``nodes`` offloaded: ``offload v`` right after its compute, ``free v`` after its last forward
    reader (or at once), and ``reload v`` issued before its first backward reader as far back as the
    copy takes on the compute clock (the computes' costs counted back), but not before that free. The
    schedule's own ``free v`` after its last reader then frees the reloaded copy. ``synchronous``: a
    ``wait v`` right after the free (compute waits for the copy; what a run whose copies end when issued
    does, such as the CPU's). O(len(ops) + edges)."""
    ops = list(ops)
    chosen = sorted(set(int(v) for v in nodes))
    if not chosen:
        return ops
    cost = graph.cost
    wanted = set(chosen)
    position: dict[int, int] = {}
    reads: dict[int, list[int]] = {v: [] for v in chosen}
    backward_start = len(ops)
    for i, (kind, v) in enumerate(ops):
        if kind != COMPUTE:
            continue
        if v in position and v in wanted:
            raise ValueError(f"node {v} is computed more than once; only a node computed once is offloaded")
        position[v] = i
        if not graph.is_forward[v]:
            backward_start = min(backward_start, i)
        for d in graph.deps(v).tolist():
            if d in reads:
                reads[d].append(i)
    after: dict[int, Ops] = {}  # position -> ops inserted right after it
    before: dict[int, Ops] = {}  # position -> ops inserted right before it
    clock = np.cumsum([cost[v] if kind == COMPUTE else 0.0 for kind, v in ops])  # end of each op
    for v in chosen:
        at = position[v]
        late = [p for p in reads[v] if p >= backward_start]
        if not late:
            continue  # read in the forward pass only: nothing to keep for the backward pass
        first_backward = late[0]
        last_forward = max([p for p in reads[v] if p < backward_start], default=at)
        after.setdefault(at, []).append((OFFLOAD, v))
        after.setdefault(last_forward, []).extend([(FREE, v)] + ([(WAIT, v)] if synchronous else []))
        copy = graph.mem[v] / link_bytes_per_s
        start = clock[first_backward - 1] - copy  # the reload's copy should begin by then
        issue = int(np.searchsorted(clock, start, side="right"))  # the first op still running at that time
        issue = min(max(issue, last_forward + 1), first_backward)
        before.setdefault(issue, []).append((RELOAD, v))
    out: Ops = []
    for i, op in enumerate(ops):
        out += before.get(i, [])
        out.append(op)
        out += after.get(i, [])
    return out


def with_reloads(graph: Graph, ops: Sequence[tuple[str, int]], link_bytes_per_s: float) -> Ops:
    """``ops``, whose ``reload v`` ops sit right before the op that reads the copy they bring back, with
    ``offload v`` right after v's first compute (the host copy those reloads read) and each reload issued
    earlier: a prefetch, so the copy is hidden by compute when the link allows. The reloads share one copy
    stream, so they are timed from the last back: each copy ends when its reader starts or when the next
    reload's copy starts, whichever is earlier, and is issued at the op running when it must start (the
    computes' costs counted back), but not before the free of v's previous copy. A node is reloaded at
    most once (rule 9 keeps the host copy until its reload). O(len(ops))."""
    ops = list(ops)
    reloaded = [v for kind, v in ops if kind == RELOAD]
    if len(set(reloaded)) != len(reloaded):
        raise ValueError("a node is reloaded more than once; its host copy serves one reload")
    wanted = set(reloaded)
    clock = np.cumsum([graph.cost[v] if kind == COMPUTE else 0.0 for kind, v in ops])  # end of each op
    first: dict[int, int] = {}
    last_free: dict[int, int] = {}
    reloads: list[tuple[int, int, int]] = []  # (position, node, the earliest position it may be issued at)
    for i, (kind, v) in enumerate(ops):
        if v not in wanted:
            continue
        if kind == COMPUTE:
            first.setdefault(v, i)
        elif kind == FREE:
            last_free[v] = i
        elif kind == RELOAD:
            if v not in first or v not in last_free:
                raise ValueError(f"node {v} is reloaded before its first copy was computed and freed")
            reloads.append((i, v, last_free[v] + 1))
    moved: dict[int, Ops] = {}  # position -> reloads issued right before it
    stream_free = np.inf  # the start of the next reload's copy (the stream is busy from then)
    for i, v, earliest in reversed(reloads):
        end = min(clock[i - 1] if i else 0.0, stream_free)
        start = end - graph.mem[v] / link_bytes_per_s
        issue = min(max(int(np.searchsorted(clock, start, side="right")), earliest), i)  # the op running then
        stream_free = max(start, clock[issue - 1] if issue else 0.0)  # a later issue starts the copy later
        moved.setdefault(issue, []).insert(0, (RELOAD, v))
    offload_after = {i: v for v, i in first.items()}
    out: Ops = []
    for i, op in enumerate(ops):
        out += moved.get(i, [])
        if op[0] != RELOAD:
            out.append(op)
        if i in offload_after:
            out.append((OFFLOAD, offload_after[i]))
    return out
