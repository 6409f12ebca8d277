"""A small layered ("Sugiyama") layout for a DAG: layers, crossing reduction, coordinates.

The module graph (``explorer/module_graph.py``) draws a few dozen to a few thousand boxes left to right;
graphviz is not a dependency, and networkx has layering (``topological_generations``) but no crossing
reduction or coordinate assignment, so the classic four steps are written out here, plainly:

1. **Layers** (:func:`longest_path_layers`): a node one layer right of its latest input; a source (a
   node nothing feeds) one layer left of its first reader, so it sits next to where it is used.
2. **Dummy nodes** (:func:`route_long_edges`): an edge spanning several layers passes through one
   point per layer between them, so it can bend around the boxes in its way. Edges from one node share
   those points (a *bus*): a tensor read by all 32 blocks of a transformer is one line along them,
   with a tap into each block, not 32 parallel lines.
3. **Order within each layer** (:func:`order_layers`): barycentre sweeps, down and up, each node moved
   to the mean position of its neighbours in the layer before (after); the order with the fewest
   crossings (:func:`count_crossings`) is kept.
4. **Coordinates** (:func:`assign_coordinates`): each node pulled towards the mean height of its
   neighbours (a box by the boxes at the other end of its short edges), then the layer's heights made to
   keep their order and spacing with the least weighted squared movement (:func:`spaced_fit`: scipy's
   isotonic regression on the heights less the gaps); boxes weigh more than dummy points, so chains run
   straight and the buses bend around them.

Everything is a pure function of its inputs (no plotting), tested in ``tests/test_module_graph.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import isotonic_regression

NODE_GAP = 0.4  # space between two boxes of one layer (box heights are given by the caller)
DUMMY_GAP = 0.25  # space next to a dummy point (a bend of a long edge)
DUMMY_WEIGHT = 0.001  # how much a dummy point resists being moved, against 1 for a box
SWEEPS = 6  # barycentre sweeps (each one down and one up)
SHORT_SPAN = 3  # an edge spanning at most this many layers pulls the boxes at its ends together


@dataclass(frozen=True)
class Layout:
    """Where each node goes: ``layer`` (the x column) and ``y`` (its centre), and for each edge given,
    the bends it passes through (``routes[i]``: (x, y) points, [] for an edge between neighbouring
    layers, None for an edge the layout ignores: one that runs right to left)."""

    layer: np.ndarray  # int64[n]
    y: np.ndarray  # float64[n]
    routes: list[list[tuple[float, float]] | None]
    crossings: int  # edge crossings between neighbouring layers, bends included


def sugiyama_layout(n: int, edges: Sequence[tuple[int, int]], heights: Sequence[float] | None = None,
                    sweeps: int = SWEEPS) -> Layout:
    """Lay out ``n`` nodes, numbered in an order every edge should follow (a topological order; an edge
    (u, v) with u >= v is drawn but not laid out). ``heights``: each node's height (1 by default)."""
    heights = np.ones(n) if heights is None else np.asarray(heights, dtype=float)
    forward = sorted({(int(u), int(v)) for u, v in edges if u < v})
    layer = longest_path_layers(n, forward)
    graph = route_long_edges(layer, forward)
    order = order_layers(graph, sweeps)
    sizes = np.concatenate([heights, np.zeros(graph.count - n)])
    y = assign_coordinates(graph, order, sizes)
    routes: list[list[tuple[float, float]] | None] = []
    for u, v in edges:
        bends = graph.bends.get((int(u), int(v))) if u < v else None
        routes.append(None if bends is None else [(float(graph.layer[d]), float(y[d])) for d in bends])
    return Layout(layer, y[:n], routes, count_crossings(graph, order))


# -- 1. layers --------------------------------------------------------------------------------------

def longest_path_layers(n: int, edges: Sequence[tuple[int, int]]) -> np.ndarray:
    """int64[n]: each node one layer right of its latest input (edges (u, v) with u < v; nodes
    numbered topologically); a source with readers one layer left of its first reader. O(n + edges)."""
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges:
        preds[v].append(u)
        succs[u].append(v)
    layer = np.zeros(n, dtype=np.int64)
    for v in range(n):
        if preds[v]:
            layer[v] = max(layer[u] for u in preds[v]) + 1
    for v in reversed(range(n)):  # sources move right, next to their first reader
        if not preds[v] and succs[v]:
            layer[v] = min(layer[s] for s in succs[v]) - 1
    return layer - layer.min() if n else layer


# -- 2. long edges ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayeredGraph:
    """The nodes and the dummy points of long edges (ids ``n..count-1``), every edge between neighbouring
    layers; ``bends[(u, v)]``: the dummy ids edge (u, v) passes through, in order."""

    n: int
    count: int
    layer: np.ndarray  # int64[count]
    preds: list[list[int]]
    succs: list[list[int]]
    bends: dict[tuple[int, int], list[int]]
    owner: np.ndarray  # int64[count]: the node a dummy carries an edge of (itself for a node)


def route_long_edges(layer: np.ndarray, edges: Sequence[tuple[int, int]]) -> LayeredGraph:
    """Split every edge that spans more than one layer at each layer in between, sharing the dummy
    points of one source's edges (a bus along its readers). O(n + edges + layers spanned)."""
    n = len(layer)
    layers = list(layer.tolist())
    owner = list(range(n))
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    bus: dict[tuple[int, int], int] = {}  # (source, layer) -> its dummy point there
    bends: dict[tuple[int, int], list[int]] = {}

    def link(a: int, b: int) -> None:
        if b not in succs[a]:
            succs[a].append(b)
            preds[b].append(a)

    def point(source: int, at: int) -> int:
        if (source, at) not in bus:
            bus[(source, at)] = len(layers)
            layers.append(at)
            owner.append(source)
            preds.append([])
            succs.append([])
        return bus[(source, at)]

    for u, v in edges:
        path = [point(u, at) for at in range(layers[u] + 1, layers[v])]
        bends[(u, v)] = path
        for a, b in zip([u] + path, path + [v]):
            link(a, b)
    return LayeredGraph(n, len(layers), np.asarray(layers, dtype=np.int64), preds, succs, bends,
                        np.asarray(owner, dtype=np.int64))


# -- 3. order within layers -------------------------------------------------------------------------

def order_layers(graph: LayeredGraph, sweeps: int = SWEEPS) -> list[list[int]]:
    """Each layer's node ids, top to bottom: barycentre sweeps from the nodes' given order (a dummy
    point right after its source's position), keeping the order with the fewest crossings."""
    depth = int(graph.layer.max()) + 1 if graph.count else 0
    order: list[list[int]] = [[] for _ in range(depth)]
    for v in sorted(range(graph.count), key=lambda v: (int(graph.owner[v]), v)):
        order[graph.layer[v]].append(v)
    best, best_crossings = [list(o) for o in order], count_crossings(graph, order)
    for _ in range(sweeps):
        for at in range(1, depth):  # down: by the inputs' positions
            order[at] = _by_barycentre(order[at], graph.preds, _positions(order[at - 1]))
        for at in range(depth - 2, -1, -1):  # up: by the readers' positions
            order[at] = _by_barycentre(order[at], graph.succs, _positions(order[at + 1]))
        crossings = count_crossings(graph, order)
        if crossings < best_crossings:
            best, best_crossings = [list(o) for o in order], crossings
        if best_crossings == 0:
            break
    return best


def _positions(nodes: list[int]) -> dict[int, int]:
    return {v: i for i, v in enumerate(nodes)}


def _by_barycentre(nodes: list[int], neighbours: list[list[int]], where: dict[int, int]) -> list[int]:
    """``nodes`` sorted by the mean position of their neighbours in the next layer (``where``); a node with
    none keeps its place (its own position as its key)."""
    def key(item: tuple[int, int]) -> float:
        i, v = item
        near = [where[u] for u in neighbours[v] if u in where]
        return sum(near) / len(near) if near else float(i)

    return [v for _, v in sorted(enumerate(nodes), key=key)]


def count_crossings(graph: LayeredGraph, order: list[list[int]]) -> int:
    """Pairs of edges that cross between neighbouring layers, for this order. O(edges log edges)."""
    total = 0
    for at in range(len(order) - 1):
        top, below = _positions(order[at]), _positions(order[at + 1])
        ends = sorted((top[u], below[v]) for u in order[at] for v in graph.succs[u] if v in below)
        total += _inversions([b for _, b in ends])
    return total


def _inversions(xs: list[int]) -> int:
    """Pairs i < j with xs[i] > xs[j] (merge sort)."""
    if len(xs) < 2:
        return 0
    mid = len(xs) // 2
    left, right = xs[:mid], xs[mid:]
    count = _inversions(left) + _inversions(right)
    left.sort()
    right.sort()
    j = 0
    for x in left:  # for each of left, the right ones below it
        while j < len(right) and right[j] < x:
            j += 1
        count += j
    return count


# -- 4. coordinates ---------------------------------------------------------------------------------

def assign_coordinates(graph: LayeredGraph, order: list[list[int]], sizes: np.ndarray,
                       rounds: int = 8) -> np.ndarray:
    """float64[count]: each node's centre height. Nodes are pulled towards their neighbours (down and up
    sweeps), keeping each layer's order and spacing (:func:`spaced_fit`); the top is at 0."""
    y = np.zeros(graph.count)
    weight = np.where(np.arange(graph.count) < graph.n, 1.0, DUMMY_WEIGHT)
    gaps = [_gaps(nodes, sizes, graph.n) for nodes in order]
    for nodes, gap in zip(order, gaps):
        y[nodes] = np.concatenate([[0.0], np.cumsum(gap)]) if nodes else []
    near_preds: list[list[int]] = [[] for _ in range(graph.n)]  # boxes at the other end of short edges
    near_succs: list[list[int]] = [[] for _ in range(graph.n)]
    for u, v in graph.bends:
        if graph.layer[v] - graph.layer[u] <= SHORT_SPAN:
            near_preds[v].append(u)
            near_succs[u].append(v)
    for _ in range(rounds):
        for layers, neighbours, near in ((range(len(order)), graph.preds, near_preds),
                                         (range(len(order) - 1, -1, -1), graph.succs, near_succs)):
            for at in layers:
                nodes = order[at]
                if not nodes:
                    continue
                wanted = np.array([_pull(y, near[v] if v < graph.n else [], neighbours[v], v) for v in nodes])
                y[nodes] = spaced_fit(wanted, gaps[at], weight[nodes])
    real = y[:graph.n]
    top = (real - sizes[:graph.n] / 2).min() if graph.n else 0.0
    return y - top


def _pull(y: np.ndarray, near: list[int], neighbours: list[int], v: int) -> float:
    """The height node ``v`` is pulled to: the mean height of ``near``, the boxes at the other end of its
    short edges (spanning at most ``SHORT_SPAN`` layers, through their bends), when it has any; else of
    its ``neighbours`` in the next layer (a dummy point's, or a box fed only by long edges). Long edges do
    not pull boxes: the taps of a bus running along 32 blocks, each pulling a little to one side, would
    add up to a staircase, as would a branch skipping a layer (``up_proj`` beside ``gate_proj`` and its
    activation) if only the branch with a box in every layer pulled."""
    chosen = near or neighbours
    return float(np.mean(y[chosen])) if chosen else float(y[v])


def _gaps(nodes: list[int], sizes: np.ndarray, n: int) -> np.ndarray:
    """The least distance between the centres of each pair of neighbours in a layer."""
    if len(nodes) < 2:
        return np.zeros(0)
    a, b = np.asarray(nodes[:-1]), np.asarray(nodes[1:])
    space = np.where((a < n) & (b < n), NODE_GAP, DUMMY_GAP)
    return (sizes[a] + sizes[b]) / 2 + space


def spaced_fit(wanted: np.ndarray, gaps: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The heights y closest to ``wanted`` (least weighted squared distance) with y[i+1] - y[i] >=
    gaps[i]: shifted by the gaps, an isotonic regression (``scipy.optimize.isotonic_regression``, which
    pools adjacent violators). O(k)."""
    offset = np.concatenate([[0.0], np.cumsum(gaps)])
    return isotonic_regression(np.asarray(wanted, dtype=float) - offset, weights=np.asarray(weight, dtype=float)).x + offset
