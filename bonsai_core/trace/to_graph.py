"""FX -> Graph: the joint FX graph AOTAutograd traced, as a bonsai :class:`Graph`.

How FX nodes become graph nodes:

* placeholders (parameters, buffers, the batch) are not nodes: their bytes, and those of the
  parameter gradients, are ``fixed_mem``. Views of them are not nodes either.
* ``getitem`` of a multi-output op is that op's node (its ``mem`` is all outputs added up), except,
  for forward ops, the used outputs after the first that are at most a quarter of its size (batch
  norm's statistics, dropout's mask): each is a node of its own (op ``getitem``, ``deps`` = the op's
  node, ``mem`` its bytes, a nanosecond of ``cost``), so the big output dies when eager frees it.
* ``detach`` / ``alias`` are identities and fold into their input.
* other views (``view``, ``t``, ``transpose``, ``split``, ``_unsafe_view``, ...) are view nodes: ``alias_of`` their
  base, ``mem`` 0, ``cost`` 0.
* every other op is a compute node whose ``mem`` is its outputs' storage bytes and whose ``cost``
  comes from a roofline of FLOPs (``torch.utils.flop_counter``) and bytes moved on a device profile.
  The storage is the one the kernel leaves, where it differs from the fake tensor's: a reduced loss
  of :data:`UNREDUCED_STORAGE_LOSSES` keeps the whole unreduced buffer (:func:`_unreduced_loss_bytes`).
* nodes that no output needs are dropped.
* what eager holds beyond the functional graph: a tied parameter's earlier gradients until its last
  one (the last gradient node reads them).

Phases: a node is ``forward`` if eager runs it in the forward pass: it comes no later than the loss
in execution order, or a buffer update (below) needs it. The rest is ``backward``. The loss is the
step's user output (``signature.user_outputs``), not ``backward_signature.loss_output``, which
counts the mutated buffers among the outputs and so names a BatchNorm statistic when there is one.

BatchNorm and other buffer mutations: AOTAutograd returns each mutated buffer's new value (running
mean / var, ``num_batches_tracked``) as an extra graph output. Eager writes them into the buffers in
place, and the buffers are already ``fixed_mem``, so those outputs add no bytes to their node: a
batch norm node's ``mem`` is its output and saved statistics only, and the ``num_batches_tracked + 1``
node has ``mem`` 0. :attr:`bonsai_core.trace.Traced.buffer_writes` lists them for the exporter,
which must copy them back into the module's buffers.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from bonsai_core.costmodel import DeviceProfile, op_cost
from bonsai_core.graph import Graph
from bonsai_core.tensors import storage_bytes, tensors_in

_UNMARKED_VIEWS = {"aten._unsafe_view.default"}  # views whose schema does not say so
# identities; a collective's wait returns the tensor it waited for (its functional schema and fake kernel
# say a new one, eager's kernel gives back its argument)
IDENTITY_OPS = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default",
                "_c10d_functional.wait_tensor.default"}

# Losses whose ATen kernel computes the unreduced loss into its output tensor and then resizes that
# tensor to the 0-d mean or sum, which keeps its storage: the loss (alive through the backward pass)
# holds input-sized bytes, where the fake tensor is 4. ``mse_loss`` and ``smooth_l1_loss`` through their
# structured meta function (``build_borrowing_binary_op`` then ``resize_({})``, run for every device),
# ``soft_margin_loss`` through its one kernel for every device (``resize_({})``), ``binary_cross_entropy``
# through its CPU and its CUDA kernel alike (``empty_like(input)`` then ``resize_as_``). Measured on
# the CPU (tests/test_trace.py); the CUDA paths are read from ATen's source.
UNREDUCED_STORAGE_LOSSES = {"aten.mse_loss.default", "aten.smooth_l1_loss.default",
                            "aten.soft_margin_loss.default", "aten.binary_cross_entropy.default"}

_NOT_A_NODE = -1  # a placeholder, or a view of one: part of fixed_mem, not a node
_WHOLE_OUTPUT = -1  # every output of an op (a single-output op whose value is a buffer's new value)
# Cost of a node that takes one output of a multi-output op: no kernel runs, but the format wants
# every non-view node to cost something, so a nanosecond of bookkeeping.
_GETITEM_COST = 1e-9


def _placeholder_tensors(step: nn.Module, inputs: tuple[torch.Tensor, ...], signature: Any) -> dict[str, torch.Tensor]:
    """The tensor each placeholder was traced from (parameter, buffer or batch tensor): their storages
    say which placeholders share memory (AOTAutograd's fake copies of real tensors do not keep that)."""
    from bonsai_core.tensors import local_tensor

    named = {**dict(step.named_parameters(remove_duplicate=False)), **dict(step.named_buffers(remove_duplicate=False))}
    tensors = {ph: local_tensor(named[n]) for ph, n in {**signature.inputs_to_parameters, **signature.inputs_to_buffers}.items()
               if n in named}
    tensors.update((ph, t) for ph, t in zip(signature.user_inputs, inputs) if isinstance(t, torch.Tensor))
    return tensors


def _to_graph(gm: fx.GraphModule, signature: Any, name: str, profile: DeviceProfile,
              originals: dict[str, torch.Tensor]) -> tuple[Graph, list[str]]:
    fx_nodes = list(gm.graph.nodes)
    forward = _forward_nodes(fx_nodes, signature)
    written = _buffer_outputs(fx_nodes, signature)
    fixed_tensors = _fixed_tensors(gm, signature, originals)
    ids: dict[fx.Node, int] = {}  # FX node -> our node id, or _NOT_A_NODE
    nodes: list[dict[str, Any]] = []
    fx_names: list[str] = []
    outputs: list[int] = []
    split: dict[fx.Node, set[int]] = {}  # multi-output op -> outputs that are nodes of their own

    def add(node: fx.Node, op: str, deps: list[int], alias_of: int | None, mem: int, cost: float) -> None:
        computed_by = node.args[0] if node.target is operator.getitem else node  # an output's phase is its op's
        phase = "forward" if computed_by in forward else "backward"
        nodes.append({"name": node.name, "op": op, "phase": phase, "deps": deps, "alias_of": alias_of,
                      "mem": mem, "cost": cost, "shape": _shape_str(node.meta.get("val"))})
        fx_names.append(node.name)
        ids[node] = len(nodes) - 1

    for node in fx_nodes:
        if node.op in ("placeholder", "get_attr"):
            ids[node] = _NOT_A_NODE
            continue
        if node.op == "output":
            outputs = [ids[a] for a in tree_flatten(node.args)[0] if isinstance(a, fx.Node) and ids[a] != _NOT_A_NODE]
            continue
        if node.target is operator.getitem:
            op_node, index = node.args
            if index in split.get(op_node, ()):
                mem = 0 if index in written.get(op_node, ()) else storage_bytes(op_node.meta["val"][index])
                add(node, "getitem", [ids[op_node]], None, mem, _GETITEM_COST)
            else:
                ids[node] = ids[op_node]
            continue
        op = str(node.target)
        inputs = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
        base = _view_base(node, inputs)
        deps = sorted({ids[a] for a in inputs if ids[a] != _NOT_A_NODE})
        if op in IDENTITY_OPS and inputs:
            ids[node] = ids[inputs[0]]
        elif base is not None and ids[base] == _NOT_A_NODE:
            ids[node] = _NOT_A_NODE
        elif base is not None:
            add(node, op, deps, ids[base], 0, 0.0)
        else:
            split[node] = _separate_outputs(node) if node in forward else set()
            add(node, op, deps, None, _output_bytes(node, written.get(node, set()) | split[node]), _cost(node, profile))
    _hold_tied_gradients(nodes, ids, fx_nodes, signature, originals)
    from bonsai_core.trace.descriptors import Signature

    if isinstance(signature, Signature):
        _hold_handler_arguments(nodes, ids, fx_nodes, forward)
    return _prune(name, fixed_tensors, nodes, fx_names, outputs)


def _hold_handler_arguments(nodes: list[dict[str, Any]], ids: dict[fx.Node, int], fx_nodes: list[fx.Node],
                            forward: set[fx.Node]) -> None:
    """A DTensor step's backward pass runs some autograd nodes as several local ops (loss parallel's
    ``nll_loss_backward`` handler: a scatter, ``exp`` of the saved log-probabilities, an add and a
    product), where autograd holds the node's saved tensors and incoming gradient, and the handler its
    arguments, until the node's backward returns: its last local op reads them (as held deps). The local
    ops of one autograd node are the backward FX nodes of one ``seq_nr`` in a row."""
    group: list[fx.Node] = []

    def close() -> None:
        members = [ids[n] for n in group if ids.get(n, _NOT_A_NODE) != _NOT_A_NODE
                   and nodes[ids[n]]["phase"] == "backward"]  # an identity folds into its (maybe forward) input
        if len(set(members)) < 2:
            return
        inside = set(members)
        last = max((v for v in inside if nodes[v]["alias_of"] is None), default=-1)
        outside = {d for v in inside for d in nodes[v]["deps"] if d not in inside and d < last}
        extra = outside - set(nodes[last]["deps"])
        if extra:
            nodes[last]["deps"] = sorted(set(nodes[last]["deps"]) | extra)
            nodes[last]["held"] = sorted(set(nodes[last].get("held", ())) | extra)

    for node in fx_nodes:
        if node.op != "call_function" or node in forward:
            continue
        if group and node.meta.get("seq_nr") != group[0].meta.get("seq_nr"):
            close()
            group = []
        group.append(node)
    close()



def _hold_tied_gradients(nodes: list[dict[str, Any]], ids: dict[fx.Node, int], fx_nodes: list[fx.Node],
                         signature: Any, originals: dict[str, torch.Tensor]) -> None:
    """A tied parameter (an embedding shared with the LM head) gets one gradient per use, each an output
    of the joint graph. Eager's autograd engine holds the earlier ones in the parameter's input buffer
    until the last is computed and added, so the last gradient node reads the earlier ones (in place)."""
    placeholder = {param: ph for ph, param in signature.inputs_to_parameters.items()}
    by_name = {n.name: n for n in fx_nodes}
    tied: dict[int, list[int]] = {}
    for out_name, param in signature.backward_signature.gradients_to_parameters.items():
        tensor = originals.get(placeholder.get(param, ""))
        node = by_name.get(out_name)
        if isinstance(tensor, torch.Tensor) and node is not None and ids.get(node, _NOT_A_NODE) != _NOT_A_NODE:
            tied.setdefault(tensor.untyped_storage()._cdata, []).append(ids[node])
    for grads in tied.values():
        grads = sorted(set(grads))
        if len(grads) > 1:
            last = nodes[grads[-1]]
            last["deps"] = sorted(set(last["deps"]) | set(grads[:-1]))


def _loss_node(fx_nodes: list[fx.Node], signature: Any) -> fx.Node:
    """The loss: the step's one user output. (``backward_signature.loss_output`` indexes all outputs,
    mutated buffers first, so with a batch norm it names a running statistic.)"""
    (loss_name,) = signature.user_outputs
    return next(n for n in fx_nodes if n.name == loss_name)


def _forward_nodes(fx_nodes: list[fx.Node], signature: Any) -> set[fx.Node]:
    """The FX nodes eager runs in the forward pass: those up to the loss in execution order, and
    whatever computes a buffer's new value (in case a loss module updates a buffer after the loss)."""
    loss = _loss_node(fx_nodes, signature)
    forward = set(fx_nodes[:fx_nodes.index(loss) + 1])
    by_name = {n.name: n for n in fx_nodes}
    stack = [by_name[fx_name] for fx_name in signature.buffers_to_mutate]
    while stack:
        n = stack.pop()
        if n not in forward:
            forward.add(n)
            stack.extend(n.all_input_nodes)
    return forward


def _buffer_outputs(fx_nodes: list[fx.Node], signature: Any) -> dict[fx.Node, set[int]]:
    """For each op, which of its outputs are a buffer's new value (``_WHOLE_OUTPUT`` for a single output).

    Eager writes these into the buffer in place (``running_mean.mul_(...).add_(...)``), and the buffer
    is fixed_mem already, so they add no bytes to their op's node."""
    by_name = {n.name: n for n in fx_nodes}
    written: dict[fx.Node, set[int]] = {}
    for fx_name in signature.buffers_to_mutate:
        n = by_name[fx_name]
        if n.target is operator.getitem:
            written.setdefault(n.args[0], set()).add(n.args[1])
        else:
            written.setdefault(n, set()).add(_WHOLE_OUTPUT)
    return written


def _separate_outputs(node: fx.Node) -> set[int]:
    """Outputs of a forward multi-output op that become nodes of their own: the used outputs after
    the first that are at most a quarter of its size (batch norm's statistics, dropout's mask).

    Eager frees each output when its last reader is done; one node holding them all would keep a
    batch norm's normalised output (or dropout's output) alive as long as the statistics (the mask)
    that the backward pass reads much later. The output's node follows its op's node, and in the
    forward pass nothing is freed between the two (an op's inputs are saved for the backward pass or
    read by the next op), so the kernel's moment of allocating all outputs at once is counted right.
    Such an output's bytes come only from its op's kernel, so the simulator lets a schedule compute
    its node again only after the op's node (``Graph.output_of``, the simulator's separated-output rule). What it misses is a
    recomputation of the op while such an output's node is resident: the kernel allocates that
    output again for a moment. The size limit bounds that to a quarter of the op's output
    (max-pooling's int64 indices, twice its output, stay with their op).
    Backward ops keep one node: their outputs (an input gradient with the weight gradients) die
    together within an op or two, and splitting them would let frees slip between the kernel and
    its output nodes."""
    outs = node.meta.get("val")
    used = sorted({u.args[1] for u in node.users if u.target is operator.getitem and u.users})
    if len(used) < 2 or not isinstance(outs, (tuple, list)):
        return set()
    first = storage_bytes(outs[used[0]])
    return {i for i in used[1:] if 4 * storage_bytes(outs[i]) <= first}


def _output_bytes(node: fx.Node, excluded: set[int]) -> int:
    """Storage bytes of the op's outputs, less the excluded ones (written into buffers, or nodes of
    their own)."""
    val = node.meta.get("val")
    if _WHOLE_OUTPUT in excluded:
        return 0
    if str(node.target) in UNREDUCED_STORAGE_LOSSES:
        return max(storage_bytes(val), _unreduced_loss_bytes(node))
    if excluded and isinstance(val, (tuple, list)):
        val = [v for i, v in enumerate(val) if i not in excluded]
    return storage_bytes(val)


def _unreduced_loss_bytes(node: fx.Node) -> int:
    """Bytes of the unreduced loss a :data:`UNREDUCED_STORAGE_LOSSES` kernel computes: one element of the
    output's dtype for each element of its input and target broadcast together."""
    input, target = (a.meta["val"] for a in node.args[:2])
    return math.prod(torch.broadcast_shapes(input.shape, target.shape)) * node.meta["val"].element_size()


def _fixed_tensors(gm: fx.GraphModule, signature: Any, originals: dict[str, torch.Tensor]) -> list[tuple[str, int, str]]:
    """The tensors ``fixed_mem`` is made of, as ``(name, bytes, kind)`` in a training loop's allocation
    order (the graph's optional ``fixed_tensors``): parameters, buffers and captured constants when the
    model is built, the gradients of the trainable parameters (frozen ones have none), then the batch.
    They live for the whole step (DESIGN.md). A storage (of the tensor a placeholder was traced from,
    ``originals``) counts once: a tied parameter (GPT-2's wte = lm_head) is two placeholders of one
    storage, with one ``.grad``, and a loss buffer that is the batch itself (language-model targets =
    the input ids) is one storage, whatever its kinds."""
    kind_of = {**{k: "param" for k in signature.inputs_to_parameters},
               **{k: "buffer" for k in signature.inputs_to_buffers}}
    grad_params = set(signature.backward_signature.gradients_to_parameters.values())
    seen: set[tuple[int, bool]] = set()
    model, grads, batch = [], [], []
    # a gradient's own elements where they outnumber its parameter's: a tensor-parallel gradient DTensor
    # may be replicated where its parameter is sharded (an embedding sharded by vocabulary)
    by_name = {n.name: n for n in gm.graph.nodes}
    grad_elements: dict[str, int] = {}
    for out, param in signature.backward_signature.gradients_to_parameters.items():
        value = by_name[out].meta.get("val") if out in by_name else None
        if isinstance(value, torch.Tensor):
            grad_elements[param] = max(grad_elements.get(param, 0), value.numel())

    def add(to: list, name: str, value: Any, kind: str, elements: int = 0) -> None:
        traced_from = originals.get(name.removesuffix(".grad"), value)
        storage = traced_from.untyped_storage()._cdata if isinstance(traced_from, torch.Tensor) else id(value)
        key = (storage, kind == "grad")  # a gradient is counted by its parameter's storage, but is another
        if key not in seen:
            seen.add(key)
            nbytes = storage_bytes(value)
            if elements > value.numel():
                nbytes = elements * value.element_size()
            to.append((name, nbytes, kind))

    seed = set(getattr(signature, "tangents", ()))  # the loss's seed gradient (the descriptors' export), not held
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value, kind = node.meta.get("val"), kind_of.get(node.name, "input")
            if node.name in seed or not isinstance(value, torch.Tensor):  # a DTensor's mesh is no tensor
                continue
            add(batch if kind == "input" else model, node.name, value, kind)
            param = signature.inputs_to_parameters.get(node.name)
            if param in grad_params:
                add(grads, f"{node.name}.grad", value, "grad", grad_elements.get(param, 0))
        elif node.op == "get_attr":
            add(model, node.name, getattr(gm, node.target, None), "constant")
    return model + grads + batch


def _prune(name: str, fixed_tensors: list[tuple[str, int, str]], nodes: list[dict[str, Any]],
           fx_names: list[str], outputs: list[int]) -> tuple[Graph, list[str]]:
    """Keep the nodes some output needs, renumbered in order."""
    needed = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v not in needed:
            needed.add(v)
            stack.extend(nodes[v]["deps"])
    keep = sorted(needed)
    new_id = {old: new for new, old in enumerate(keep)}
    kept = []
    for old in keep:
        nd = dict(nodes[old])
        nd["deps"] = [new_id[d] for d in nd["deps"]]
        nd["alias_of"] = None if nd["alias_of"] is None else new_id[nd["alias_of"]]
        kept.append(nd)
    fixed = sum(t[1] for t in fixed_tensors)
    return Graph.from_nodes(name, fixed, kept, fixed_tensors), [fx_names[i] for i in keep]


def _view_base(node: fx.Node, inputs: list[fx.Node]) -> fx.Node | None:
    """The input whose storage all of this op's outputs share, or None for an op that allocates.

    Storage identity of the traced (fake) values decides: it also catches ``_unsafe_view`` and ops
    returning lists of views (``split``), which schemas do not mark. When the values do not share
    storages although the op is a view (fake copies of a real model's parameters can lose their
    storage identity), the op's schema decides: outputs that alias ``self`` without writing it."""
    outs = tensors_in(node.meta.get("val"))
    owners: dict[int, fx.Node] = {}
    for a in inputs:
        for t in tensors_in(a.meta.get("val")):
            owners.setdefault(t.untyped_storage()._cdata, a)
    bases = [owners.get(t.untyped_storage()._cdata) for t in outs]
    if bases and all(b is not None for b in bases):
        return bases[0]
    return _schema_view_base(node)


def _schema_view_base(node: fx.Node) -> fx.Node | None:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    aliases = [r.alias_info for r in schema.returns]
    is_view = str(node.target) in _UNMARKED_VIEWS or all(a is not None and not a.is_write for a in aliases)
    return node.args[0] if is_view else None


def _shape_str(val: Any) -> str:
    ts = tensors_in(val)
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in ts[:3]) + (" ..." if len(ts) > 3 else "")


def _cost(node: fx.Node, profile: DeviceProfile) -> float:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    return op_cost(profile, node.target, args, kwargs, node.meta.get("val"))
