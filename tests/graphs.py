"""Small hand-made graphs for tests."""

from __future__ import annotations

from bonsai_core.graph import Graph


def chain(n: int, mem: int = 10, cost: float = 1.0, fixed_mem: int = 0) -> Graph:
    """A forward chain of n ops and its mirrored backward chain (2n nodes): the textbook remat case.

    Forward f_i reads f_{i-1}; backward b_i reads b_{i+1} and f_i (as a real backward pass does)."""
    nodes = [dict(name=f"f{i}", op="f", phase="forward", cost=cost, mem=mem, deps=[i - 1] if i else [])
             for i in range(n)]
    for i in reversed(range(n)):
        deps = [i] + ([len(nodes) - 1] if i < n - 1 else [])
        nodes.append(dict(name=f"b{i}", op="b", phase="backward", cost=cost, mem=mem, deps=sorted(deps)))
    return Graph.from_nodes(f"chain{n}", fixed_mem, nodes)


def mask_far_from_use(fixed_mem: int = 0) -> Graph:
    """A dropout (a multi-output op) whose mask, a node of its own (``getitem``, 40 bytes), is read only
    by the last backward node, while the dropout's output is read until the one before. Freeing the
    mask and taking it again from the resident dropout would lower the peak by its 40 bytes at a
    nanosecond's cost, but its bytes come only from the dropout kernel (the simulator's separated-output rule): the peak
    without it is 341; 301 needs the dropout recomputed after its last backward reader, with the mask."""
    nodes = [dict(name="x", op="aten.mm", phase="forward", cost=1.0, mem=10, deps=[]),
             dict(name="dropout", op="aten.native_dropout", phase="forward", cost=1.0, mem=100, deps=[0]),
             dict(name="mask", op="getitem", phase="forward", cost=1e-9, mem=40, deps=[1]),
             dict(name="h", op="aten.mm", phase="forward", cost=1.0, mem=100, deps=[1]),
             dict(name="loss", op="aten.sum", phase="forward", cost=1.0, mem=1, deps=[3]),
             dict(name="grad_h", op="aten.mm", phase="backward", cost=1.0, mem=100, deps=[3, 4]),
             dict(name="grad_dropout", op="aten.mm", phase="backward", cost=1.0, mem=100, deps=[1, 5]),
             dict(name="grad_x", op="aten.mul", phase="backward", cost=1.0, mem=10, deps=[2, 6])]
    return Graph.from_nodes("mask-far-from-use", fixed_mem, nodes)


def stacked_blocks(blocks: int, width: int = 1024, shared: bool = False) -> Graph:
    """A transformer-shaped step with a ``modules`` field: an embedding, ``blocks`` blocks (``blocks.i``
    holding ``ln1``, ``attn`` (two parallel projections q, k and their product), a residual add of the
    block's own, ``ln2`` and ``mlp``, another residual add), a head and a loss; the backward pass as
    autograd builds it: one op per forward op, reading its gradient and the forward op's inputs, the
    gradients of a tensor read twice added up by an ``add`` of their own."""
    nodes: list[dict] = []
    modules: list[list] = []

    def op(name: str, deps: list[int], op_: str = "aten.mm.default") -> int:
        nodes.append(dict(name=name, op=op_, phase="forward", cost=1e-6, mem=width, deps=sorted(deps)))
        return len(nodes) - 1

    def view(name: str, base: int) -> int:
        nodes.append(dict(name=name, op="aten.view.default", phase="forward", cost=0.0, mem=0, deps=[base],
                          alias_of=base))
        return len(nodes) - 1

    def module(path: str, first: int) -> None:
        modules.append([path, first, len(nodes) - 1])

    x = op("emb", [], "aten.embedding.default")
    module("emb", x)
    rope = None
    if shared:
        rope = op("rope", [], "aten.cos.default")
        module("rope", rope)
    for i in range(blocks):
        start = len(nodes)
        ln1 = op(f"ln1_{i}", [x], "aten.native_layer_norm.default")
        module(f"blocks.{i}.ln1", ln1)
        first = len(nodes)
        q = op(f"q_{i}", [view(f"q_in_{i}", ln1)])  # a linear reads a view of its input, as traced
        k = op(f"k_{i}", [view(f"k_in_{i}", ln1)])
        o = op(f"o_{i}", [q, k] + ([rope] if shared else []), "aten.bmm.default")
        module(f"blocks.{i}.attn", first)
        h = op(f"add1_{i}", [x, o], "aten.add.Tensor")
        ln2 = op(f"ln2_{i}", [h], "aten.native_layer_norm.default")
        module(f"blocks.{i}.ln2", ln2)
        fc = op(f"fc_{i}", [ln2])
        act = op(f"gelu_{i}", [fc], "aten.gelu.default")
        out = op(f"out_{i}", [act])
        module(f"blocks.{i}.mlp", fc)
        x = op(f"add2_{i}", [h, out], "aten.add.Tensor")
        module(f"blocks.{i}", start)
    head = op("head", [x])
    module("head", head)
    loss = op("loss", [head], "aten.nll_loss_forward.default")

    forward = list(nodes)
    partial: dict[int, list[int]] = {}  # forward node -> backward nodes holding part of its gradient
    for f in reversed(range(len(forward))):
        parts = partial.get(f, [])
        if len(parts) > 1:
            nodes.append(dict(name=f"sum_grad_{f}", op="aten.add.Tensor", phase="backward", cost=1e-6, mem=width,
                              deps=sorted(parts)))
            parts = [len(nodes) - 1]
        deps = sorted(set(parts) | set(forward[f]["deps"]) | ({f} if f == loss else set()))
        if not forward[f]["deps"] or "alias_of" in forward[f]:  # a view's gradient is a view of the gradient
            deps = sorted(set(parts))
        nodes.append(dict(name=f"grad_{forward[f]['name']}", op="aten.mm.default", phase="backward", cost=1e-6,
                          mem=width, deps=deps))
        for d in forward[f]["deps"]:
            partial.setdefault(d, []).append(len(nodes) - 1)
    modules.sort(key=lambda m: (m[1], -m[2]))
    return Graph.from_nodes(f"blocks{blocks}", 0, nodes, modules=modules)


def residual_stream(blocks: int, mem: int = 2**28) -> Graph:
    """A residual stream: x_i = x_{i-1} + m_i, where m_i = mm(x_{i-1}) costs ten times the add; the
    backward op of block i reads x_{i-1}, m_i and the gradient before it. Dropping the cheap x's and
    keeping the m's is the cheapest choice at the first backward op, but x_{i-1} rebuilt for block i's
    backward op needs every dropped x before it: a chain rebuilt whole and held until each link's
    backward op. ``mem`` bytes per tensor (GiB-scale rows keep the MILP's memory rows above its
    tolerances)."""
    nodes = [dict(name="x0", op="aten.embedding.default", phase="forward", cost=1.0, mem=mem, deps=[])]
    xs, ms = [0], []
    for i in range(1, blocks + 1):
        nodes.append(dict(name=f"m{i}", op="aten.mm.default", phase="forward", cost=10.0, mem=mem, deps=[xs[-1]]))
        ms.append(len(nodes) - 1)
        nodes.append(dict(name=f"x{i}", op="aten.add.Tensor", phase="forward", cost=1.0, mem=mem,
                          deps=[xs[-1], ms[-1]]))
        xs.append(len(nodes) - 1)
    nodes.append(dict(name="loss", op="aten.sum.default", phase="forward", cost=1.0, mem=2**20, deps=[xs[-1]]))
    grad = len(nodes) - 1
    for i in range(blocks, 0, -1):
        nodes.append(dict(name=f"g{i}", op="aten.mm.default", phase="backward", cost=10.0, mem=mem,
                          deps=sorted([grad, xs[i - 1], ms[i - 1]])))
        grad = len(nodes) - 1
    return Graph.from_nodes(f"residual-stream{blocks}", 0, nodes)


def fsdp_chain(n: int = 4, mem: int = 10, params: int = 800) -> Graph:
    """:func:`chain` as one of 2 FSDP ranks: ``params`` bytes of parameters (and as many of gradients), two
    blocks of the forward chain's halves holding them all."""
    from bonsai_core.fsdp import with_fsdp

    graph = chain(n, mem).with_fields(fixed_tensors=[["w", params, "param"], ["w.grad", params, "grad"]],
                                      fixed_mem=2 * params)
    half = n // 2
    return with_fsdp(graph, 2, [("blocks.0", 0, half - 1, params // 2), ("blocks.1", half, n - 1, params // 2)], 0)
