"""Trace a model's training step (forward + loss + backward) into a :class:`Graph`.

The joint graph comes from AOTAutograd (``aot_export_module(..., trace_joint=True)``): functional
aten ops, exactly the kernels eager autograd runs, in execution order. Zoo models are built under
``FakeTensorMode``, so even GPT-2 small traces without allocating its weights or activations.

How FX nodes become graph nodes:

* placeholders (parameters, buffers, the batch) are not nodes: their bytes, and those of the
  parameter gradients, are ``fixed_mem``. Views of them are not nodes either.
* ``getitem`` of a multi-output op is that op's node (its ``mem`` is all outputs added up).
* ``detach`` / ``alias`` are identities and fold into their input.
* other views (``view``, ``t``, ``transpose``, ``split``, ``_unsafe_view``, ...) are view nodes: ``alias_of`` their
  base, ``mem`` 0, ``cost`` 0.
* every other op is a compute node whose ``mem`` is its outputs' storage bytes and whose ``cost``
  comes from a roofline of FLOPs (``torch.utils.flop_counter``) and bytes moved on a device profile.
* nodes up to the loss are ``forward``, the rest ``backward``; nodes that no output needs are dropped.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from bonsai_core.costmodel import DEFAULT_PROFILE, PROFILES, DeviceProfile, op_cost
from bonsai_core.errors import ModelError
from bonsai_core.graph import Graph
from bonsai_core.tensors import storage_bytes, tensors_in



# What torch says when a closure holds a tensor that tracing cannot lift as an input.
_CAPTURED_CONSTANT_SIGNS = ("fake buffer", "_tensor_constant", "convert all Tensors to FakeTensors")
_IDENTITY_OPS = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default"}


@dataclass
class Traced:
    """A traced step: the graph, plus the FX module and its node names for the exporter."""

    graph: Graph
    module: fx.GraphModule
    fx_names: list[str]  # FX node name of each graph node
    seconds: float


class _Step(nn.Module):
    """``model`` followed by ``loss_fn``, returning the loss: the module AOTAutograd traces."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn  # registered as a submodule when it is one, so its buffers are lifted

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.loss_fn(self.model(*inputs)),)


def trace_zoo(name: str, profile: str = DEFAULT_PROFILE, seed: int = 0, **options: Any) -> Traced:
    """Build a zoo model (or ``package.module:factory``) under FakeTensorMode and trace its step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bonsai_core import zoo

    label = name if not options else name + "(" + ", ".join(f"{k}={v}" for k, v in sorted(options.items())) + ")"
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, inputs, loss_fn = zoo.build(name, seed=seed, **options)
        return trace_step(model, inputs, loss_fn, name=label, profile=profile)


def trace_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
               name: str = "model", profile: str = DEFAULT_PROFILE) -> Traced:
    """Trace one training step of ``model`` on ``inputs`` with ``loss_fn`` into a Graph."""
    from torch._functorch.aot_autograd import aot_export_module

    if profile not in PROFILES:
        raise ModelError(f"Unknown cost model {profile!r}; choose one of: {', '.join(PROFILES)}.")
    start = time.perf_counter()
    try:
        gm, signature = aot_export_module(_Step(model, loss_fn), tuple(inputs), trace_joint=True,
                                          output_loss_index=0)
    except Exception as e:  # torch raises many types here; the user needs the message, not the stack
        if any(sign in str(e) for sign in _CAPTURED_CONSTANT_SIGNS):
            raise ModelError("The loss function (or model) captures tensors, such as targets, as constants. "
                             "Make loss_fn an nn.Module that holds them as buffers, like "
                             "bonsai_core.zoo.CrossEntropyLoss.") from None
        raise ModelError(f"Tracing {name!r} failed ({type(e).__name__}): {e}") from None
    graph, fx_names = _to_graph(gm, signature, name, PROFILES[profile])
    return Traced(graph, gm, fx_names, time.perf_counter() - start)


# -- FX -> Graph ---------------------------------------------------------------------------------

_LEAF = -1  # a placeholder, or a view of one: part of fixed_mem, not a node


def _to_graph(gm: fx.GraphModule, signature: Any, name: str, profile: DeviceProfile) -> tuple[Graph, list[str]]:
    loss_fx = signature.backward_signature.loss_output
    fixed = 0
    grad_params = set(signature.backward_signature.gradients_to_parameters.values())
    ids: dict[fx.Node, int] = {}  # FX node -> our node id, or _LEAF
    nodes: list[dict[str, Any]] = []
    fx_names: list[str] = []
    phase = "forward"
    outputs: list[int] = []

    # the tensors fixed_mem is made of, in a training loop's allocation order (graph 'fixed_tensors')
    kind_of = {**{k: "param" for k in signature.inputs_to_parameters},
               **{k: "buffer" for k in signature.inputs_to_buffers}}
    fixed_tensors: list[tuple[str, int, str]] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ids[node] = _LEAF
            fixed += storage_bytes(node.meta.get("val"))
            fixed_tensors.append((node.name, storage_bytes(node.meta.get("val")), kind_of.get(node.name, "input")))
            continue
        if node.op == "output":
            outputs = [ids[a] for a in tree_flatten(node.args)[0] if isinstance(a, fx.Node) and ids[a] != _LEAF]
            continue
        if node.op == "get_attr":
            ids[node] = _LEAF
            fixed += storage_bytes(getattr(gm, node.target, None))
            fixed_tensors.append((node.name, storage_bytes(getattr(gm, node.target, None)), "constant"))
            continue
        if node.target is operator.getitem:
            ids[node] = ids[node.args[0]]
        else:
            op = str(node.target)
            inputs = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
            base = _view_base(node, inputs)
            if op in _IDENTITY_OPS and inputs:
                ids[node] = ids[inputs[0]]
            elif base is not None and ids[base] == _LEAF:
                ids[node] = _LEAF
            else:
                dep_ids = sorted({ids[a] for a in inputs if ids[a] != _LEAF})
                is_view = base is not None
                nodes.append({
                    "name": node.name, "op": op, "phase": phase, "deps": dep_ids,
                    "alias_of": ids[base] if is_view else None,
                    "mem": 0 if is_view else storage_bytes(node.meta.get("val")),
                    "cost": 0.0 if is_view else _cost(node, profile),
                    "shape": _shape_str(node.meta.get("val")),
                })
                fx_names.append(node.name)
                ids[node] = len(nodes) - 1
        if node.name == loss_fx:
            phase = "backward"

    # parameter gradients live in buffers for the whole step (DESIGN.md: part of fixed_mem)
    params = dict(gm.named_parameters())
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for ph_name, p_name in signature.inputs_to_parameters.items():
        if p_name in grad_params:
            grad_bytes = storage_bytes(placeholders[ph_name].meta.get("val", params.get(p_name)))
            fixed += grad_bytes
            fixed_tensors.append((f"{ph_name}.grad", grad_bytes, "grad"))
    order = {"param": 0, "buffer": 0, "constant": 0, "grad": 1, "input": 2}  # construction, zeros_like grads, batch
    fixed_tensors.sort(key=lambda t: order[t[2]])
    return _prune(name, fixed, nodes, fx_names, outputs, fixed_tensors)


def _prune(name: str, fixed: int, nodes: list[dict[str, Any]], fx_names: list[str],
           outputs: list[int], fixed_tensors: list[tuple[str, int, str]] = ()) -> tuple[Graph, list[str]]:
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
    return Graph.from_nodes(name, fixed, kept, fixed_tensors), [fx_names[i] for i in keep]


def _view_base(node: fx.Node, inputs: list[fx.Node]) -> fx.Node | None:
    """The input whose storage all of this op's outputs share, or None for an op that allocates.

    Storage identity of the traced (fake) values, not the op's schema, decides: it also catches
    ``_unsafe_view`` and ops returning lists of views (``split``), which schemas do not mark."""
    outs = tensors_in(node.meta.get("val"))
    owners: dict[int, fx.Node] = {}
    for a in inputs:
        for t in tensors_in(a.meta.get("val")):
            owners.setdefault(t.untyped_storage()._cdata, a)
    bases = [owners.get(t.untyped_storage()._cdata) for t in outs]
    return bases[0] if bases and all(b is not None for b in bases) else None


def _shape_str(val: Any) -> str:
    ts = tensors_in(val)
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in ts[:3]) + (" ..." if len(ts) > 3 else "")


def _cost(node: fx.Node, profile: DeviceProfile) -> float:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    return op_cost(profile, node.target, args, kwargs, node.meta.get("val"))
