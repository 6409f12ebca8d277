"""The offload columns of Bonsai's segment ILP (``offload=True``): keep, recompute or offload each
saved tensor (simulator rule 9, docs/DESIGN.md; the full model in docs/BONSAI.md).

One binary ``off[v]`` per offload candidate v: a saved tensor (``offload.offloadable``) whose copies
fit in the plain plan's compute on the memory axis. Offloaded, v is copied to host right after its
compute and freed after its last forward reader, so its bytes leave the memory rows from the first
step that starts after both (``gone``), and it is reloaded so that the copy ends as its first backward
reader starts (``back``): a step of -mem[v] at ``gone`` and +mem[v] at ``back`` in the memory rows, as
a recomputed candidate's steps are. The times are the plain plan's compute clock; the schedule's are
the simulator's (``offload.with_offloads`` places the ops on the real clock), which judges the plan.

Rows:

* ``off[v] <= keep[atom of v]``: only a tensor the plan keeps is offloaded (a recomputed one is
  dropped anyway);
* **one copy at a time per direction**: copies whose intervals on the plain clock overlap are never
  offloaded together (one row per copy start, over the copies running then: the cliques of an
  interval graph). So every chosen copy runs from its issue at the link's bandwidth, and the model's
  ``gone`` and ``back`` hold on the plain clock; queueing that would still end in time is given up;
* the pinned host bytes of every offloaded tensor together within the host memory (a bound: they
  need not all be on the host at once).

Objective term: each offload is priced at 1% of its round trip (a tie-break: the copies are hidden by
construction, so a useless offload costs nothing else, and the model should not make one).

Size: one variable per candidate and at most two interval rows per candidate, each over the copies
overlapping it: O(saved tensors) variables and rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from bonsai_core.graph import Graph
from bonsai_core.offload import offloadable
from bonsai_core.segment import Segmentation
from bonsai_core.solvers.bonsai_coef import PlainProfile, point_of

TIE_BREAK = 0.01  # share of a round trip an offload costs in the objective


@dataclass(frozen=True)
class OffloadColumns:
    """The offload candidates of one segmentation and their coefficients."""

    nodes: np.ndarray  # int64[V]: node ids
    atom: np.ndarray  # int64[V]: the atom holding each
    steps: sp.csr_matrix  # (points, V) bytes: -mem at ``gone``, +mem at ``back`` on the memory axis
    d2h: sp.csr_matrix  # rows: cliques of overlapping device-to-host copies
    h2d: sp.csr_matrix  # rows: cliques of overlapping host-to-device copies
    mem: np.ndarray  # int64[V]
    cost: np.ndarray  # float64[V]: the objective's price, seconds


def offload_columns(graph: Graph, seg: Segmentation, plain: PlainProfile, link_bytes_per_s: float,
                    points: int) -> OffloadColumns:
    """The candidates whose copies fit between their compute and their first backward reader on the
    plain clock, with their steps on a memory axis of ``points`` points. O(n + edges + overlaps)."""
    m = len(seg.forward)
    order, pos = plain.order, plain.seq_pos
    cost = graph.cost[order]
    end = np.cumsum(cost)
    start = end - cost
    candidates = np.flatnonzero(offloadable(graph) & (pos < m))
    first_backward = np.full(graph.n, np.iinfo(np.int64).max)  # each node's first backward reader
    last_forward = pos.copy()  # each node's last forward reader (itself if none)
    for v in range(graph.n):
        users = graph.users(v)
        if not len(users):
            continue
        up = pos[users]
        forward = up < m
        if forward.any():
            last_forward[v] = max(last_forward[v], int(up[forward].max()))
        if (~forward).any():
            first_backward[v] = int(up[~forward].min())
    nodes, atoms, gone, back, copy_start, copy_end, reload_start, reload_end = ([] for _ in range(8))
    for v in candidates.tolist():
        p = int(pos[v])
        users = graph.users(v)
        # a recomputed reader's rebuild precedes the first backward op reading it: count back from there
        b = min([int(first_backward[v])] + [int(first_backward[u]) for u in users.tolist() if pos[u] < m])
        c = float(graph.mem[v]) / link_bytes_per_s
        q_gone = max(int(np.searchsorted(start, end[p] + c, side="left")), int(last_forward[v]) + 1)
        q_back = int(np.searchsorted(end, start[b] - c, side="right"))  # the reload is issued before this op
        if q_back <= q_gone or q_back > b:
            continue
        nodes.append(v)
        atoms.append(int(np.searchsorted(seg.atom_ptr, p, side="right") - 1))
        gone.append(point_of(q_gone, m, rebuild=True))
        back.append(point_of(q_back, m, rebuild=True))
        copy_start.append(end[p])
        copy_end.append(end[p] + c)
        reload_start.append(end[q_back - 1] if q_back > 0 else 0.0)
        reload_end.append((end[q_back - 1] if q_back > 0 else 0.0) + c)
    count = len(nodes)
    mem = graph.mem[np.asarray(nodes, dtype=np.int64)].astype(np.int64)
    cols = np.arange(count)
    steps = sp.coo_matrix((np.concatenate([-mem, mem]).astype(np.float64),
                           (np.concatenate([gone, back]).astype(np.int64), np.concatenate([cols, cols]))),
                          shape=(points, count)).tocsr()
    return OffloadColumns(nodes=np.asarray(nodes, dtype=np.int64), atom=np.asarray(atoms, dtype=np.int64),
                          steps=steps, d2h=overlap_cliques(np.asarray(copy_start), np.asarray(copy_end)),
                          h2d=overlap_cliques(np.asarray(reload_start), np.asarray(reload_end)), mem=mem,
                          cost=TIE_BREAK * 2 * mem / link_bytes_per_s)


def overlap_cliques(starts: np.ndarray, ends: np.ndarray) -> sp.csr_matrix:
    """(rows, len(starts)) 0/1: for each interval's start, the intervals [start, end) running then
    (the maximal cliques of an interval graph are among these), rows with one interval dropped.
    ``rows @ x <= 1`` lets no two chosen intervals overlap. O(V log V + overlaps)."""
    count = len(starts)
    if not count:
        return sp.csr_matrix((0, 0))
    by_start = np.argsort(starts, kind="stable")
    rows, cols = [], []
    running: list[int] = []
    r = 0
    for i in by_start.tolist():
        running = [j for j in running if ends[j] > starts[i]] + [i]
        if len(running) > 1:
            rows += [r] * len(running)
            cols += running
            r += 1
    return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(r, count))
