"""The module graph: a training step as one box per module call, the backward pass mirrored under it.

Pure functions of a graph (and a schedule, for the numbers on the boxes): no Streamlit, no plotting.
The Graph page draws what :func:`module_boxes` and :func:`box_layout` return (``explorer/module_chart.py``).

**Forward ops.** The graph's ``modules`` field gives every module call's span of forward nodes (first,
last). A forward op belongs to the innermost call whose span holds it (a separated output, ``getitem``,
goes with its op). At fold depth ``d`` (1: the calls directly under the model) a call deeper than ``d``
is folded into its ancestor at depth ``d``: that ancestor is one box. A visible call that has visible
calls inside it is drawn as a frame around them, and its own ops between them (a residual ``add``, a
``gelu`` between two linears, the loss after the head) are boxes of their own, one per run of
consecutive ops, named after their ops. A run made only of views goes with the box of the tensor it
views. So every forward op is in exactly one box at every depth.

**Backward ops** (the rule behind "each backward region under its forward module"). The joint graph
does not say which forward op a backward op differentiates, so each backward op gets an *anchor*, a
forward op, from what it reads, and is drawn in the backward box under its anchor's box:

1. *It reads activations* (forward tensors: the saved inputs and outputs of the op it differentiates).
   Let ``lo`` be the latest of them (a ``getitem`` stands for its op): the differentiated op is ``lo``'s
   producer, or an op that reads ``lo`` (a weight gradient reads the linear's input; ``gelu_backward``
   reads gelu's input). The gradient it reads comes from the backward of later ops: every anchor up its
   gradient chain bounds the differentiated op from above (``hi``). The anchor is the forward op
   ``<name>`` when the op is ``<name>_backward`` (``threshold_backward``: ``relu``) and one of ``lo`` or its
   readers is that op; else the latest non-view reader of ``lo`` before ``hi``; else ``lo``.
2. *It reads only gradients, several of them* (an ``add`` of two gradients of one tensor, the ``cat`` of
   q, k and v's gradients): the gradients come from different readers of one tensor, so its anchor is
   that tensor: the latest forward node that two or more of its readers lead from to the gradients'
   anchors (a residual stream's ``add`` of gradients goes with the ``add`` that made the stream).
3. *It reads one gradient*: a ``<name>_backward`` goes with the latest forward ``<name>`` whose output
   has the gradient's shape (an embedding's gradient reads no activation, only the indices); another
   op goes with the ops that read the same gradient and activations (the input gradient of a linear
   goes with its weight gradient, which reads the linear's input); when none does, with the op that
   made the gradient.
4. Nothing to go by (no forward op read, no anchored gradient): the loss's box.

Rule 1 is exact for named backward ops and for ops whose inputs stay within one module; at a module's
border (an op whose saved activation is its input, made by the module before) it relies on ``hi``.
``tests/test_module_graph.py`` checks the rule on the default GPT op by op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bonsai_core.graph import Graph

# <name>_backward ops whose forward op has another name
FORWARD_OF_BACKWARD = {"threshold": ("relu", "threshold"), "embedding_dense": ("embedding",),
                       "nll_loss": ("nll_loss_forward",), "nll_loss2d": ("nll_loss2d_forward",),
                       "native_batch_norm": ("native_batch_norm", "_native_batch_norm_legit_functional",
                                             "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"),
                       "slice": ("slice",), "select": ("select",)}


def op_name(op: str) -> str:
    """``aten.add.Tensor`` -> ``add``; other names as they are."""
    parts = op.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "aten" else op


def forward_names(op: str) -> tuple[str, ...]:
    """The forward op names of a ``<name>_backward`` (or ``_backward_data``) op: ``gelu_backward`` ->
    ``("gelu",)``, ``threshold_backward`` -> ``("relu", "threshold")``; () for any other op."""
    name = op_name(op)
    for suffix in ("_backward_data", "_backward"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            return FORWARD_OF_BACKWARD.get(base, (base,))
    return ()


# -- the module tree and which call each forward op belongs to ---------------------------------------

@dataclass(frozen=True)
class ModuleTree:
    """The graph's module calls (``Graph.modules``) as a tree: each call's parent is the call whose path
    is the longest prefix of its own (``blocks.0`` for ``blocks.0.attn``; -1: the model itself), and its
    depth counts the calls above it plus one (``model.model.layers.3`` is at depth 3 when ``model`` and
    ``model.model`` are calls and ``model.model.layers``, a ModuleList, is not)."""

    paths: tuple[str, ...]
    first: np.ndarray  # int64: first forward node id
    last: np.ndarray  # int64: last forward node id (inclusive)
    parent: np.ndarray  # int64, -1 for a top-level call
    depth: np.ndarray  # int64, 1 for a top-level call

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if len(self.depth) else 0

    def ancestor_at(self, call: int, depth: int) -> int:
        """``call`` itself, or its ancestor at ``depth`` when it is deeper."""
        while call >= 0 and self.depth[call] > depth:
            call = int(self.parent[call])
        return call

    def is_within(self, call: int, outer: int) -> bool:
        """Whether ``call`` is ``outer`` or inside it (-1 is the model: everything is inside it)."""
        while call >= 0 and call != outer:
            call = int(self.parent[call])
        return call == outer


def module_tree(graph: Graph) -> ModuleTree:
    """O(calls · depth)."""
    paths = tuple(p for p, _, _ in graph.modules)
    index = {p: i for i, p in enumerate(paths)}
    parent = np.full(len(paths), -1, dtype=np.int64)
    for i, path in enumerate(paths):
        prefix = path
        while "." in prefix:
            prefix = prefix.rsplit(".", 1)[0]
            if prefix in index:
                parent[i] = index[prefix]
                break
    depth = np.ones(len(paths), dtype=np.int64)
    for i in range(len(paths)):
        p = parent[i]
        while p >= 0:
            depth[i] += 1
            p = parent[p]
    return ModuleTree(paths, np.array([f for _, f, _ in graph.modules], dtype=np.int64),
                      np.array([last for _, _, last in graph.modules], dtype=np.int64), parent, depth)


def forward_owners(graph: Graph, tree: ModuleTree) -> np.ndarray:
    """int64[n]: the innermost call whose span holds each forward node (-1: none, the model's own op;
    and every backward node). A separated output (``getitem``) goes with its op when the op's call is
    inside the getitem's. O(sum of spans)."""
    owner = np.full(graph.n, -1, dtype=np.int64)
    width = tree.last - tree.first
    for call in sorted(range(len(tree.paths)), key=lambda c: (-width[c], tree.depth[c])):  # inner ones last
        owner[tree.first[call]:tree.last[call] + 1] = call
    owner[~graph.is_forward] = -1
    for v in np.flatnonzero(graph.is_forward).tolist():
        deps = graph.deps(v)
        if graph.ops[v] == "getitem" and len(deps) == 1 and tree.is_within(int(owner[deps[0]]), int(owner[v])):
            owner[v] = owner[deps[0]]
    return owner


# -- which forward op each backward op goes with ------------------------------------------------------

def backward_anchors(graph: Graph) -> np.ndarray:
    """int64[n]: for each backward node, the forward node it is drawn with (the module docstring's four
    rules); -1 for forward nodes. O(n + edges), plus a local search per gradient sum. Data deps only: a
    tensor the model's code holds (``Graph.held``) is read by no op."""
    graph = graph.without_held()
    n = graph.n
    fwd = graph.is_forward
    op_of = np.where((graph.output_of >= 0) & fwd, graph.output_of, np.arange(n))  # getitem -> its op
    anchor = np.full(n, -1, dtype=np.int64)
    reads_activations = np.zeros(n, dtype=bool)
    bound = np.full(n, n, dtype=np.int64)  # hi: the least anchor up each node's gradient chain
    backward = np.flatnonzero(~fwd).tolist()
    for b in backward:  # rule 1
        deps = graph.deps(b).tolist()
        acts = [int(op_of[d]) for d in deps if fwd[d]]
        grads = [d for d in deps if not fwd[d]]
        hi = min([int(anchor[g]) if reads_activations[g] else int(bound[g]) for g in grads], default=n)
        bound[b] = hi
        if acts:
            reads_activations[b] = True
            anchor[b] = _differentiated_op(graph, b, max(acts), hi)
            bound[b] = min(hi, int(anchor[b]))
    for b in backward:  # rules 2-4, in execution order: the gradients a node reads are placed before it
        if reads_activations[b]:
            continue
        grads = [d for d in graph.deps(b).tolist() if not fwd[d]]
        anchors = sorted({int(anchor[g]) for g in grads if anchor[g] >= 0})
        if len(anchors) > 1:
            anchor[b] = _fork(graph, anchors)
        elif grads:
            anchor[b] = _named_by_shape(graph, b, grads[0], int(bound[b]))
            if anchor[b] < 0:
                anchor[b] = _sibling_anchor(graph, b, grads, anchor, reads_activations)
            if anchor[b] < 0 and anchors:
                anchor[b] = anchors[0]
        if anchor[b] < 0:
            anchor[b] = _loss_node(graph)
    return anchor


def _differentiated_op(graph: Graph, b: int, lo: int, hi: int) -> int:
    """Rule 1: the forward op backward node ``b`` differentiates, given the latest activation it reads
    (``lo``, an op) and the least anchor up its gradient chain (``hi``)."""
    readers = [int(u) for u in graph.users(lo) if graph.is_forward[u] and not graph.is_view[u]
               and graph.output_of[u] < 0]
    wanted = forward_names(graph.ops[b])
    named = [v for v in [lo, *readers] if op_name(graph.ops[v]) in wanted]
    if named:
        return max(named)
    before = [u for u in readers if u < hi]
    return max(before) if before else lo


def _fork(graph: Graph, anchors: list[int]) -> int:
    """Rule 2: the tensor whose gradients a node adds up (or concatenates): the latest forward node read
    by two or more different ops, each leading to (or being) one of ``anchors``, that together lead to
    all of them. Searched in a window below the earliest anchor that grows until it is found; the
    earliest anchor if there is none."""
    low = anchors[0]
    window = 64
    while True:
        floor = max(0, low - window)
        leads_to = [_ancestors(graph, a, floor) for a in anchors]
        for t in range(low - 1, floor - 1, -1):
            if not graph.is_forward[t] or not all(t in reach for reach in leads_to):
                continue
            readers = [set(u for u in graph.users(t).tolist() if u in reach) for reach in leads_to]
            if all(readers) and len(set.union(*readers)) > 1:
                return t
        if floor == 0:
            return low
        window *= 4


def _ancestors(graph: Graph, v: int, floor: int) -> set[int]:
    """Forward nodes ``v`` depends on (itself included) with ids >= ``floor``."""
    seen = {v}
    stack = [v]
    while stack:
        for d in graph.deps(stack.pop()).tolist():
            if d >= floor and d not in seen and graph.is_forward[d]:
                seen.add(d)
                stack.append(d)
    return seen


def _named_by_shape(graph: Graph, b: int, grad: int, hi: int) -> int:
    """Rule 3, for ``<name>_backward`` reading no activation (an embedding's gradient reads only the
    indices, an input): the latest forward ``<name>`` before ``hi`` whose output has the gradient's
    shape; -1 when ``b`` is not such an op or none fits."""
    wanted = forward_names(graph.ops[b])
    if not wanted:
        return -1
    shape = graph.shapes[grad].split("], ")[0]
    for v in range(min(hi, graph.n) - 1, -1, -1):
        if graph.is_forward[v] and op_name(graph.ops[v]) in wanted and graph.shapes[v].split("], ")[0] == shape:
            return v
    return -1


def _sibling_anchor(graph: Graph, b: int, grads: list[int], anchor: np.ndarray, reads_activations: np.ndarray) -> int:
    """Rule 3: the latest anchor of the nodes that read the same gradient tensor as ``b`` (its storage:
    the gradient and every view of it) and read activations; -1 when none does."""
    found = -1
    for g in grads:
        base = graph.storage_of(g, stop_before=graph.is_forward)  # the gradient's storage, not a forward tensor's
        family, stack = {base}, [base]
        while stack:
            for u in graph.users(stack.pop()).tolist():
                if u != b and reads_activations[u]:
                    found = max(found, int(anchor[u]))
                if graph.alias_of[u] >= 0 and u not in family:  # a view of the gradient: its readers too
                    family.add(u)
                    stack.append(u)
    return found


def _loss_node(graph: Graph) -> int:
    forward = np.flatnonzero(graph.is_forward)
    return int(forward[-1]) if len(forward) else 0


# -- boxes at a fold depth ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Boxes:
    """The module graph at one fold depth: ``count`` boxes in forward order, each with a forward part
    and, mirrored under it, a backward part.

    ``of[v]`` is node v's box (forward and backward nodes alike). A box is a module call (``call[k] >=
    0``) or a run of a call's own ops (``call[k] == -1``, ``parent[k]`` the call, -1 for the model).
    ``frames`` are the visible calls with boxes inside them, drawn around those."""

    of: np.ndarray  # int64[n]
    names: tuple[str, ...]  # full name: module path, or "<parent path>: <ops>"
    labels: tuple[str, ...]  # short, for the box
    call: np.ndarray  # int64[count]: module call, or -1 for a run of ops
    parent: np.ndarray  # int64[count]: the visible call the box is drawn in, -1 for the model
    depth: int
    frames: tuple[int, ...]  # calls drawn as frames around their boxes

    @property
    def count(self) -> int:
        return len(self.names)


MOST_COLUMNS = 24  # a wide page (about 1100 px of chart) gives each column room for a short 12 px label


def default_depth(graph: Graph, tree: ModuleTree | None = None, most: int = 40, columns: int = MOST_COLUMNS) -> int:
    """The fold depth a model opens at: the deepest with at most ``most`` boxes in at most ``columns``
    columns, so that their horizontal labels fit (a transformer's blocks opened into attention and MLP
    when there are few blocks), and never above its repeated blocks (a transformer's layers, a ResNet's
    blocks: 32 of them stay 32 boxes rather than one)."""
    tree = module_tree(graph) if tree is None else tree
    if not tree.paths:
        return 1
    from bonsai_core.regions import block_stack

    owners = forward_owners(graph, tree)
    def fits_at(d: int) -> bool:
        boxes = module_boxes(graph, d, tree, owners)
        return boxes.count <= most and int(box_layout(graph, boxes).x.max(initial=0)) + 1 <= columns

    fits = [d for d in range(1, tree.max_depth + 1) if fits_at(d)]
    blocks = block_stack(graph)
    block_depth = int(tree.depth[tree.paths.index(blocks[0][0])]) if blocks else 1
    return max(fits + [block_depth])


def module_boxes(graph: Graph, depth: int, tree: ModuleTree | None = None, owners: np.ndarray | None = None,
                 anchors: np.ndarray | None = None) -> Boxes:
    """The boxes at fold ``depth`` (module docstring). ``tree``, ``owners`` and ``anchors`` may be passed
    when already computed. O(n)."""
    tree = module_tree(graph) if tree is None else tree
    owners = forward_owners(graph, tree) if owners is None else owners
    has_children = np.zeros(len(tree.paths), dtype=bool)
    for c in range(len(tree.paths)):
        if tree.parent[c] >= 0 and tree.depth[c] <= depth:
            has_children[tree.parent[c]] = True
    forward = np.flatnonzero(graph.is_forward).tolist()

    # each forward node's key: ("call", c) for a leaf box, ("ops", c) for its call c's own ops
    keys = []
    for v in forward:
        c = tree.ancestor_at(int(owners[v]), depth)
        keys.append(("ops", c) if c < 0 or has_children[c] else ("call", c))
    of = np.full(graph.n, -1, dtype=np.int64)
    names: list[str] = []
    labels: list[str] = []
    call: list[int] = []
    parent: list[int] = []
    box_of_call: dict[int, int] = {}
    runs: list[list[int]] = []  # the forward nodes of each box
    previous, k = None, -1
    for v, key in zip(forward, keys):
        kind, c = key
        if kind == "call" and c in box_of_call:
            k = box_of_call[c]
        elif kind == "ops" and previous == key:
            pass  # the run goes on: the previous node's box
        else:
            k = len(names)
            if kind == "call":
                box_of_call[c] = k
                names.append(tree.paths[c])
                labels.append(_short_label(tree.paths[c]))
                call.append(c)
                parent.append(int(tree.parent[c]) if tree.parent[c] >= 0 else -1)
            else:
                names.append("")  # named once its ops are known
                labels.append("")
                call.append(-1)
                parent.append(c)
            runs.append([])
        of[v] = k
        runs[k].append(v)
        previous = key

    # a run of views only goes with the box of the tensor it views
    keep = np.ones(len(names), dtype=bool)
    for k, members in enumerate(runs):
        if call[k] < 0 and all(graph.is_view[v] or graph.output_of[v] >= 0 for v in members):
            base = next(u for u in graph.view_chain(members[0]) if not graph.is_view[u] or of[u] != k)
            if of[base] != k and of[base] >= 0:
                of[members] = of[base]
                keep[k] = False
    renumber = np.cumsum(keep) - 1
    of[of >= 0] = renumber[of[of >= 0]]
    names = [nm for nm, kept in zip(names, keep) if kept]
    labels = [lb for lb, kept in zip(labels, keep) if kept]
    call = [c for c, kept in zip(call, keep) if kept]
    parent = [p for p, kept in zip(parent, keep) if kept]
    seen: dict[str, int] = {}
    for k in range(len(names)):
        if call[k] < 0:
            members = np.flatnonzero((of == k) & graph.is_forward).tolist()
            labels[k] = _ops_label(graph, members)
            names[k] = f"{tree.paths[parent[k]] if parent[k] >= 0 else 'model'}: {labels[k]}"
            seen[names[k]] = seen.get(names[k], 0) + 1
            if seen[names[k]] > 1:  # a block's second residual add: "blocks.0: add (2)"
                names[k] += f" ({seen[names[k]]})"

    anchors = backward_anchors(graph) if anchors is None else anchors
    back = ~graph.is_forward
    of[back] = of[anchors[back]]
    frames = tuple(np.flatnonzero(has_children).tolist())
    return Boxes(of, tuple(names), tuple(labels), np.asarray(call, dtype=np.int64),
                 np.asarray(parent, dtype=np.int64), depth, frames)


def _short_label(path: str) -> str:
    """The last part of a module path, with its parent's when it is an index (``layers.3``)."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _ops_label(graph: Graph, members: Sequence[int]) -> str:
    """A run of a call's own ops named by its ops, the costliest first: ``add``, ``gelu``,
    ``bmm, _softmax +14`` (14 more ops); views named only when there is nothing else."""
    computed = [v for v in members if not graph.is_view[v] and graph.ops[v] != "getitem"] or list(members)
    cost: dict[str, float] = {}
    for v in computed:
        name = op_name(graph.ops[v])
        cost[name] = cost.get(name, 0.0) + float(graph.cost[v])
    names = sorted(cost, key=lambda name: -cost[name])[:2]
    rest = sum(op_name(graph.ops[v]) not in names for v in computed)
    return ", ".join(names) + (f" +{rest}" if rest else "")


# -- the numbers on each box ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BoxStats:
    """Per box: its ops, bytes and compute time in each pass, its segment and what recomputation does
    in it under one schedule."""

    forward_ops: np.ndarray  # int64[count]
    backward_ops: np.ndarray
    forward_bytes: np.ndarray  # int64: bytes of its forward ops' outputs
    backward_bytes: np.ndarray
    forward_cost: np.ndarray  # float64 seconds
    backward_cost: np.ndarray
    segment: np.ndarray  # int64: the segment holding most of its forward ops (-1: no segments)
    segments: tuple[tuple[int, ...], ...]  # every segment it touches
    recomputed_ops: np.ndarray  # int64: forward ops (not views) computed more than once
    saved_bytes: np.ndarray  # int64: bytes of those ops (held from forward to backward without recomputation)
    recompute_cost: np.ndarray  # float64 seconds: the extra computes' time


def box_stats(graph: Graph, boxes: Boxes, segments: Sequence[Sequence[int]] | None = None,
              computed: np.ndarray | None = None) -> BoxStats:
    """``segments``: a checkpoint plan's segments (``schedule.extra``), if any; ``computed``: how many
    times the schedule computes each node (None: once each). O(n)."""
    k = boxes.count
    fwd = graph.is_forward
    of = boxes.of

    def per_box(mask: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(of[mask], weights=None if weights is None else weights[mask], minlength=k)

    computed = np.ones(graph.n, dtype=np.int64) if computed is None else np.asarray(computed)
    again = (computed > 1) & ~graph.is_view  # a view recomputed is free: nothing to show
    seg_of = np.full(graph.n, -1, dtype=np.int64)
    for i, members in enumerate(segments or ()):
        seg_of[list(members)] = i
    majority = np.full(k, -1, dtype=np.int64)
    touched: list[tuple[int, ...]] = [()] * k
    if segments:
        for box in range(k):
            segs = seg_of[(of == box) & fwd]
            segs = segs[segs >= 0]
            if len(segs):
                values, counts = np.unique(segs, return_counts=True)
                majority[box] = values[np.argmax(counts)]
                touched[box] = tuple(values.tolist())
    return BoxStats(
        per_box(fwd).astype(np.int64), per_box(~fwd).astype(np.int64),
        per_box(fwd, graph.mem.astype(float)).astype(np.int64), per_box(~fwd, graph.mem.astype(float)).astype(np.int64),
        per_box(fwd, graph.cost), per_box(~fwd, graph.cost), majority, tuple(touched),
        per_box(fwd & again).astype(np.int64), per_box(fwd & again, graph.mem.astype(float)).astype(np.int64),
        per_box(again, graph.cost * (computed - 1)))


# -- the layout ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BoxLayout:
    """Where each box goes: its column ``x`` (the layer) and its forward part's centre ``y`` (rows, 0 at
    the top); its backward part sits at ``-y`` under a gap (the caller mirrors). ``edges``: (from box,
    to box) of the forward pass with the bends of each (``routes``)."""

    x: np.ndarray  # int64[count]
    y: np.ndarray  # float64[count]
    edges: tuple[tuple[int, int], ...]
    routes: tuple[tuple[tuple[float, float], ...] | None, ...]
    backward_edges: tuple[tuple[int, int], ...]  # (box whose gradient flows, box it flows to)
    crossings: int


def box_edges(graph: Graph, boxes: Boxes) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(forward edges, backward edges) between boxes: a box's op reads another box's op in the same
    pass (data deps: not what the model's code holds). Each pair once, sorted. O(edges)."""
    graph = graph.without_held()
    src = np.repeat(np.arange(graph.n), np.diff(graph.dep_ptr))  # the reader of each dep entry
    dst = graph.dep_idx
    a, b = boxes.of[dst], boxes.of[src]
    same_pass = graph.is_forward[dst] == graph.is_forward[src]
    fwd = same_pass & graph.is_forward[src] & (a != b)
    bwd = same_pass & ~graph.is_forward[src] & (a != b)
    forward = sorted({(int(x), int(y)) for x, y in zip(a[fwd], b[fwd])})
    backward = sorted({(int(x), int(y)) for x, y in zip(a[bwd], b[bwd])})
    return forward, backward


def box_layout(graph: Graph, boxes: Boxes) -> BoxLayout:
    """The layered layout of the boxes' forward edges (``explorer/sugiyama.py``); the backward pass is
    drawn as its mirror image. O(boxes + edges) plus the layout's sweeps."""
    from explorer.sugiyama import sugiyama_layout

    forward, backward = box_edges(graph, boxes)
    layout = sugiyama_layout(boxes.count, forward)
    return BoxLayout(layout.layer, layout.y, tuple(forward),
                     tuple(None if r is None else tuple(r) for r in layout.routes), tuple(backward), layout.crossings)
