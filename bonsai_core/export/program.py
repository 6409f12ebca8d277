"""The exported *program*: the traced joint graph written out as straight-line Python in a schedule's order.

One line per ``compute`` op (a recomputation is the same line run again) and a ``del`` per ``free`` op,
split at the loss into ``forward_part`` and ``backward_part``. ``StepSignature`` records the joint graph's
placeholders (parameters, buffers, the batch) so the runtime can feed them in ``aot_export_module``'s order.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from bonsai_core.errors import BonsaiError
from bonsai_core.schedule import COMPUTE, FREE, Schedule
from bonsai_core.trace import Traced

_IDENTITY_OPS = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default"}  # as trace.py folds them

class ExportError(BonsaiError):
    """A schedule or model cannot be exported (wrong graph, unsupported op or constant)."""


@dataclass(frozen=True)
class StepSignature:
    """What the joint graph's placeholders are, in ``aot_export_module``'s order: parameters, buffers,
    then the model's inputs. Names are relative to their owner (``model`` or ``loss_fn``)."""

    params: list[tuple[str, tuple[int, ...], str, bool]]
    buffers: list[tuple[str, str, tuple[int, ...], str]]
    inputs: list[tuple[tuple[int, ...], str]]

def step_signature(model: str, options: dict[str, Any], seed: int = 0) -> StepSignature:
    """The placeholders of ``model``'s traced step (built on fake tensors: no real memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bonsai_core import zoo

    with FakeTensorMode(allow_non_fake_inputs=True):
        net, inputs, loss_fn = zoo.build(model, seed=seed, **options)
        return signature_of(net, inputs, loss_fn)


def signature_of(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any) -> StepSignature:
    """The placeholder order ``aot_export_module`` gives ``trace._Step(model, loss_fn)``."""
    if isinstance(loss_fn, torch.nn.Module) and any(True for _ in loss_fn.parameters()):
        raise ExportError("The loss function has parameters; export supports losses whose tensors are buffers "
                          "(targets), like bonsai_core.zoo.CrossEntropyLoss. Move learnable parts into the model.")
    params = [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
              for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = [("model", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers(remove_duplicate=False)]
    if isinstance(loss_fn, torch.nn.Module):
        buffers += [("loss_fn", n, tuple(b.shape), str(b.dtype)) for n, b in loss_fn.named_buffers(remove_duplicate=False)]
    return StepSignature(params, buffers, [(tuple(x.shape), str(x.dtype)) for x in inputs])

def generate_program(traced: Traced, signature: StepSignature, schedule: Schedule, info: dict[str, Any]) -> str:
    """Python source of the scheduled step: ``forward_part``, ``backward_part``, ``PROGRAM`` and ``load``.

    O(len(ops) + FX nodes). Raises ExportError for ops or constants it cannot write out."""
    graph, gm = traced.graph, traced.module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    _check_signature(placeholders, signature)
    writer = _Writer(placeholders, {name: v for v, name in enumerate(traced.fx_names)})
    fx_of = {n.name: n for n in gm.graph.nodes}
    nodes = [fx_of[name] for name in traced.fx_names]

    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    results = list(out_node.args[0])
    loss_fx, grad_fx = results[0], results[1:]
    trainable = [j for j, p in enumerate(signature.params) if p[3]]
    if len(grad_fx) != len(trainable):
        raise ExportError(f"The traced step returns {len(grad_fx)} gradients for {len(trainable)} trainable "
                          "parameters; the graph does not match the model's parameters.")
    loss_node = writer.root(loss_fx)
    emits: dict[int, list[tuple[int, str]]] = {}
    for j, g in zip(trainable, grad_fx):
        if g is None:
            continue
        emits.setdefault(writer.root(g), []).append((j, writer.expr(g)))

    ops = schedule.ops
    split = next(i for i, (k, v) in enumerate(ops) if k == COMPUTE and v == loss_node) + 1
    while split < len(ops) and ops[split][0] == FREE:
        split += 1
    alive: set[int] = set()
    for kind, v in ops[:split]:
        (alive.add if kind == COMPUTE else alive.discard)(v)
    carried = sorted(alive)

    computed: set[int] = set()

    def body(part: list[tuple[str, int]], backward: bool) -> list[str]:
        lines = []
        for kind, v in part:
            if kind == FREE:
                lines.append(f"del v{v}")
                continue
            lines.append(f"v{v} = {writer.call(nodes[v])}  # {graph.names[v]}")
            if v not in computed:
                computed.add(v)
                if v == loss_node:
                    lines.append(f"loss = {writer.expr(loss_fx)}")
                for j, expr in emits.get(v, ()):
                    if not backward:
                        raise ExportError("A parameter gradient is computed before the loss; the schedule is malformed.")
                    lines.append(f"emit({j}, {expr})")
        return lines

    forward_ops, backward_ops = ops[:split], ops[split:]
    unpack = "(" + "".join(f"a{i}, " for i in range(len(placeholders))) + ") = args"
    carried_vars = "".join(f"v{v}, " for v in carried)
    fwd = [unpack, *body(forward_ops, False), f"return loss, [{carried_vars}]"]
    bwd = [unpack]
    if carried:
        bwd += [f"({carried_vars}) = alive", "alive.clear()  # the schedule's del statements now free them"]
    bwd += body(backward_ops, True) or ["pass"]

    def indent(lines: list[str]) -> str:
        return "\n".join("    " + line for line in lines)

    return (
        "# ---- generated by `bonsai export` from the schedule below: do not edit ----\n"
        f"INFO = {info!r}\n"
        f"PARAMS = {signature.params!r}\n"
        f"BUFFERS = {signature.buffers!r}\n"
        f"INPUTS = {signature.inputs!r}\n\n\n"
        "def forward_part(args, dev):\n"
        f'    """Schedule ops 0..{split - 1}: the forward pass up to the loss."""\n'
        f"{indent(fwd)}\n\n\n"
        "def backward_part(args, alive, dev, emit):\n"
        f'    """Schedule ops {split}..{len(ops) - 1}: recomputations and the backward pass."""\n'
        f"{indent(bwd)}\n\n\n"
        "PROGRAM = Program(PARAMS, BUFFERS, INPUTS, forward_part, backward_part, INFO)\n\n\n"
        "def load(model: nn.Module, grads: str = \"autograd\") -> Checkpointed:\n"
        '    """Wrap ``model`` (same class and shapes as exported) to train with the schedule:\n'
        "    ``loss = load(model)(*inputs, loss_fn=loss_fn); loss.backward()``. See README.md.\"\"\"\n"
        "    return Checkpointed(model, PROGRAM, grads)\n"
    )


def _check_signature(placeholders: list[fx.Node], sig: StepSignature) -> None:
    expected = [p[1] for p in sig.params] + [b[2] for b in sig.buffers] + [x[0] for x in sig.inputs]
    got = [tuple(getattr(n.meta.get("val"), "shape", ())) for n in placeholders]
    if expected != got:
        raise ExportError(f"The traced step has {len(got)} inputs (parameters, buffers, batch) of shapes {got[:4]}..., "
                          f"but the model has {len(expected)} of shapes {expected[:4]}...: the model factory must "
                          "build the same model each time.")


class _Writer:
    """Writes FX nodes and their arguments as Python expressions over ``a<i>`` (placeholders),
    ``v<id>`` (graph nodes) and ``dev`` (the device the step runs on)."""

    def __init__(self, placeholders: list[fx.Node], graph_ids: dict[str, int]) -> None:
        self.ph = {n: i for i, n in enumerate(placeholders)}
        self.ids = graph_ids

    def root(self, node: fx.Node) -> int:
        """The graph node whose value ``node`` reads (through getitem and identities)."""
        if node.name in self.ids:
            return self.ids[node.name]
        if node.target is operator.getitem or str(node.target) in _IDENTITY_OPS:
            return self.root(node.args[0])
        raise ExportError(f"FX node {node.name!r} is no node of the traced graph.")

    def expr(self, a: Any) -> str:
        if isinstance(a, fx.Node):
            if a.op == "placeholder":
                return f"a{self.ph[a]}"
            if a.name in self.ids:
                return f"v{self.ids[a.name]}"
            if a.target is operator.getitem:
                return f"{self.expr(a.args[0])}[{a.args[1]!r}]"
            if str(a.target) in _IDENTITY_OPS:
                return self.expr(a.args[0])
            if a.op == "call_function":  # a view of a parameter or input: free to recompute at each use
                return self.call(a)
            raise ExportError(f"FX node {a.name!r} ({a.op}) cannot be exported: only aten ops, parameters, buffers "
                              "and inputs are supported (no tensor constants captured by the model).")
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.expr(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, torch.device):
            return "dev"  # traced on one device; runs on the device of the batch
        if isinstance(a, float):
            return repr(a) if math.isfinite(a) else ("math.nan" if math.isnan(a) else ("math.inf" if a > 0 else "-math.inf"))
        if a is None or isinstance(a, (bool, int, str)):
            return repr(a)
        if isinstance(a, (torch.dtype, torch.memory_format, torch.layout)):
            return str(a)
        raise ExportError(f"Cannot write the constant {a!r} ({type(a).__name__}) into the exported program.")

    def call(self, node: fx.Node) -> str:
        if not isinstance(node.target, torch._ops.OpOverload):
            raise ExportError(f"FX node {node.name!r} calls {node.target!r}, not an aten op; it cannot be exported.")
        args = [self.expr(a) for a in node.args] + [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()]
        return f"torch.ops.{node.target}({', '.join(args)})"
