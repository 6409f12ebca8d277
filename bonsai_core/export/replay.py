"""The ``replay`` back-end: the traced joint graph written out as straight-line Python in a schedule's order.

One line per ``compute`` op (a recomputation is the same line run again) and a ``del`` per ``free`` op,
split at the loss into ``forward_part`` and ``backward_part``, below the runtime
(``bonsai_core/export_runtime/runtime.py``, copied as text) in ``checkpointed.py``. ``StepSignature``
records the joint graph's placeholders (parameters, buffers, the batch) so the runtime can feed them in
``aot_export_module``'s order. ``export_model`` traces, generates and writes the folder.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from bonsai_core.errors import ScheduleError
from bonsai_core.export.folder import ExportError, schedule_info, trace_for_schedule, write_folder
from bonsai_core.export.readme import replay_readme
from bonsai_core.schedule import COMPUTE, FREE, OFFLOAD, RELOAD, WAIT, Schedule, inplace_writes, simulate
from bonsai_core.trace import Traced, built_for_tracing
from bonsai_core.trace.to_graph import IDENTITY_OPS

# Kernels the tracer picked for its own device, and the runtime helpers (same arguments and outputs)
# that call the kernel of the device the step runs on: a program runs wherever its batch is.
PORTABLE_OPS = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": "sdpa_forward",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": "sdpa_backward",
    # SDPA with dropout (bonsai_core.attention): the kernel on CUDA, its equivalent on the CPU
    "aten._scaled_dot_product_efficient_attention.default": "efficient_attention_forward",
    "aten._scaled_dot_product_efficient_attention_backward.default": "efficient_attention_backward",
}
# Substrings of aten op names that exist for one device only; no exported program may call one.
DEVICE_SPECIFIC = ("_for_cpu", "cudnn", "miopen", "mkldnn", "_cuda", "cuda_", "_mps", "_xpu", "onednn", "fbgemm")

RUNTIME = Path(__file__).resolve().parent.parent / "export_runtime" / "runtime.py"


def export_model(model: str, options: dict[str, Any], schedule: Schedule, out_dir: str | Path, *,
                 profile: str | None = None, seed: int = 0, autocast: str | None = None) -> Path:
    """Trace ``model`` (a zoo name or ``package.module:factory``) with ``options``, check that
    ``schedule`` was made for that graph, and write the runnable export to ``out_dir``.

    ``profile`` and ``autocast`` as in :func:`trace_for_schedule`. Returns ``out_dir``.
    """
    traced = trace_for_schedule(model, options, schedule, profile=profile, seed=seed, autocast=autocast)
    optimizer = traced.graph.optimizer["name"] if traced.graph.optimizer else None
    return export_traced(traced, step_signature(model, options, seed), schedule, out_dir,
                         spec={"model": model, "options": dict(options), "seed": seed, "autocast": autocast,
                               "optimizer": optimizer})


def export_traced(traced: Traced, signature: StepSignature, schedule: Schedule, out_dir: str | Path,
                  spec: dict[str, Any] | None = None) -> Path:
    """Write the export of an already traced step (``export_model`` without the tracing)."""
    graph = traced.graph
    if schedule.graph_hash not in (None, graph.hash):
        raise ScheduleError(f"This schedule was made for graph hash {schedule.graph_hash}, not {graph.hash} "
                            f"({graph.name!r}): solve again for this graph.")
    sim = simulate(graph, schedule)  # raises ScheduleError on any broken rule
    info = {**schedule_info(graph, schedule, sim, "replay"), **(spec or {})}
    program = generate_program(traced, signature, schedule, info, sim.times_computed)
    return write_folder(out_dir, RUNTIME.read_text() + "\n\n" + program, graph, schedule, sim,
                        lambda folder: replay_readme(info, schedule, folder), constants=constants_of(traced))


def constants_of(traced: Traced) -> dict[str, torch.Tensor]:
    """The tensors the traced model created itself (FX ``get_attr``: masks, position ids, empty
    tensors), as plain CPU tensors that ``torch.load(..., weights_only=True)`` reads back."""
    from torch._subclasses.fake_tensor import FakeTensor

    gm = traced.module
    constants = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        t = getattr(gm, node.target)
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type == "meta":
            raise ExportError(f"The traced step holds a constant {node.target!r} ({type(t).__name__}) whose values "
                              "tracing did not keep. Make it a buffer of the model (register_buffer) so it becomes an "
                              "input of the step.")
        constants[node.target] = t.detach().to("cpu").clone()
    return constants


@dataclass(frozen=True)
class StepSignature:
    """What the joint graph's placeholders are, in ``aot_export_module``'s order: parameters, buffers,
    then the model's inputs. Names are relative to their owner (``model`` or ``loss_fn``)."""

    params: list[tuple[str, tuple[int, ...], str, bool]]
    buffers: list[tuple[str, str, tuple[int, ...], str]]
    inputs: list[tuple[tuple[int, ...], str]]

def step_signature(model: str, options: dict[str, Any], seed: int = 0) -> StepSignature:
    """The placeholders of ``model``'s traced step (built on fake tensors: no real memory)."""
    with built_for_tracing(model, seed, **options) as (net, inputs, loss_fn):
        refuse_fused_recurrent(net)
        return signature_of(net, inputs, loss_fn)


def refuse_fused_recurrent(model: torch.nn.Module) -> None:
    """ExportError for a model with a recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): eager runs
    it as one fused kernel, which the replay cannot write out as eager runs it. The trace holds the
    kernel (a float32 CPU ``nn.LSTM``: ``bonsai_core.recurrent``, its dropout between layers drawn by
    other ops than eager's) or torch's decomposition of it (per-step ops, no dropout between layers in
    torch 2.13), so with ``dropout > 0`` the exported step would draw other random numbers than eager
    under the same seed."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.RNNBase):
            dropout = (f", with dropout {module.dropout:g} between its {module.num_layers} layers drawn inside it"
                       if module.dropout and module.num_layers > 1 and module.training else "")
            raise ExportError(
                f"Module {name or '(the model itself)'!r} ({type(module).__name__}) runs one fused recurrent "
                f"kernel{dropout}. The replay back-end would run the trace's form of it (its aten ops, the "
                "dropout between layers drawn by other ops), not the same step as eager. Export with --backend "
                "checkpoint: it recomputes the module with its own kernel and the same random numbers.")


def signature_of(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Any) -> StepSignature:
    """The placeholder order ``aot_export_module`` gives ``trace._Step(model, loss_fn)``."""
    if isinstance(loss_fn, torch.nn.Module) and any(True for _ in loss_fn.parameters()):
        raise ExportError("The loss function has parameters; export supports losses whose tensors are buffers "
                          "(targets), like bonsai_core.models.zoo.CrossEntropyLoss. Move learnable parts into the model.")
    params = [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
              for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = [("model", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers(remove_duplicate=False)]
    if isinstance(loss_fn, torch.nn.Module):
        buffers += [("loss_fn", n, tuple(b.shape), str(b.dtype)) for n, b in loss_fn.named_buffers(remove_duplicate=False)]
    return StepSignature(params, buffers, [(tuple(x.shape), str(x.dtype)) for x in inputs])

def generate_program(traced: Traced, signature: StepSignature, schedule: Schedule, info: dict[str, Any],
                     times_computed: np.ndarray) -> str:
    """Python source of the scheduled step: ``forward_part``, ``backward_part``, ``PROGRAM`` and ``load``;
    ``times_computed``: the simulator's count of each node's computes (``SimResult.times_computed``).

    The joint graph's outputs are, in AOTAutograd's order: the new values of mutated buffers
    (``traced.buffer_writes``), the loss, then one gradient per trainable parameter (none for
    ``traced.frozen_params``). O(len(ops) + FX nodes). Raises ExportError for ops or constants it
    cannot write out."""
    signature, placeholders, constants, writer, nodes = _collect(traced, signature)
    outputs = _step_outputs(traced, signature, writer)
    ops = schedule.ops
    split, carried = _split_at_loss(ops, outputs.loss_node)
    body = _Body(ops, nodes, traced.graph.names, writer, outputs, _replayed(times_computed, nodes), *_multi_outputs(ops, nodes, writer),
                 _in_place(traced, ops, nodes, writer), traced.graph.dep_lists)
    unpack = "(" + "".join(f"a{i}, " for i in range(len(placeholders) + len(constants))) + ") = args"
    carried_vars = "".join(f"{name}, " for name in carried)
    fwd = [unpack, "rng = {}", *outputs.first_lines, *body.lines(range(split), False),
           f"return loss, [{carried_vars}], rng"]
    bwd = [unpack]
    if carried:
        bwd += [f"({carried_vars}) = alive", "alive.clear()  # the schedule's del statements now free them"]
    bwd += body.lines(range(split, len(ops)), True) or ["pass"]
    return _program_text(info, signature, constants, split, len(ops), fwd, bwd)


def _collect(traced: Traced, signature: StepSignature) -> tuple[StepSignature, list[fx.Node], list[str], _Writer, list[fx.Node]]:
    """The placeholders (checked against ``signature``), tensor constants, expression writer and
    graph nodes (FX) of the traced step, the signature without the hidden names of tied parameters."""
    gm = traced.module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    hidden = set(getattr(traced, "hidden_aliases", ()))
    if hidden:  # unused names of tied parameters were traced without a placeholder (trace.Traced)
        signature = replace(signature, params=[p for p in signature.params if p[0] not in hidden])
    _check_signature(placeholders, signature)
    constants = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    writer = _Writer(placeholders, {name: v for v, name in enumerate(traced.fx_names)}, constants)
    fx_of = {n.name: n for n in gm.graph.nodes}
    return signature, placeholders, constants, writer, [fx_of[name] for name in traced.fx_names]


@dataclass
class _StepOutputs:
    """What the joint graph returns, placed on the graph nodes whose compute writes it out."""

    loss_node: int  # the graph node holding the loss
    loss_fx: fx.Node  # the loss as the joint graph returns it
    emits: dict[int, list[tuple[int, str]]]  # graph node -> (parameter index, gradient expression)
    first_lines: list[str]  # buffer writes of placeholders only: before anything runs
    writes: dict[int, list[str]]  # graph node -> buffer writes after its first compute
    rebind: dict[int, str]  # graph node -> the line that makes it the buffer it was written into


def _step_outputs(traced: Traced, signature: StepSignature, writer: _Writer) -> _StepOutputs:
    """The loss, the parameter gradients and the buffer writes of the joint graph's outputs."""
    gm = traced.module
    buffer_writes = list(getattr(traced, "buffer_writes", ()))
    frozen = set(getattr(traced, "frozen_params", ()))
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    results = list(out_node.args[0])
    written, loss_fx, grad_fx = results[:len(buffer_writes)], results[len(buffer_writes)], results[len(buffer_writes) + 1:]
    trainable = [j for j, p in enumerate(signature.params) if p[3] and p[0] not in frozen]
    if len(grad_fx) != len(trainable):
        raise ExportError(f"The traced step returns {len(grad_fx)} gradients for {len(trainable)} trainable "
                          "parameters; the graph does not match the model's parameters.")
    loss_node = writer.root(loss_fx)
    emits: dict[int, list[tuple[int, str]]] = {}
    for j, g in zip(trainable, grad_fx):
        if g is not None:
            emits.setdefault(writer.root(g), []).append((j, writer.expr(g)))
    return _StepOutputs(loss_node, loss_fx, emits, *_buffer_writes(written, buffer_writes, signature, writer))


def _buffer_writes(written: list[fx.Node], buffer_writes: list[tuple[Any, str]], signature: StepSignature,
                   writer: _Writer) -> tuple[list[str], dict[int, list[str]], dict[int, str]]:
    """Lines writing each mutated buffer in place right after its new value is first computed, as eager
    BatchNorm updates its running statistics during the forward pass: (before anything runs, per node,
    rebinds of a node that is the buffer itself)."""
    first_lines: list[str] = []
    writes: dict[int, list[str]] = {}
    rebind: dict[int, str] = {}  # at every compute of a written node (a recomputation need not write again)
    buffer_index = {f"{owner}.{name}": k for k, (owner, name, *_) in enumerate(signature.buffers)}
    for value, (_, buffer) in zip(written, buffer_writes):
        if buffer not in buffer_index:
            raise ExportError(f"The traced step writes buffer {buffer!r}, which the model and loss do not have.")
        target, expr = f"a{len(signature.params) + buffer_index[buffer]}", writer.expr(value)
        line = f"{target}.copy_({expr})  # {buffer}"
        try:
            root = writer.root(value)
        except ExportError:  # a value made of placeholders only: write it before anything runs
            first_lines.append(line)
            continue
        writes.setdefault(root, []).append(line)
        if expr == f"v{root}":  # then the node is the buffer: its own copy goes, as the trace counts it (no bytes)
            rebind[root] = f"v{root} = {target}  # written into {buffer}"
    return first_lines, writes, rebind


def _split_at_loss(ops: list[tuple[str, int]], loss_node: int) -> tuple[int, list[str]]:
    """Where ``forward_part`` ends (after the loss's compute and the frees right after it), and the
    variables alive there, which it hands to ``backward_part``: ``v<id>`` for a node on the device,
    ``h<id>`` for its host copy (rule 9)."""
    split = next(i for i, (k, v) in enumerate(ops) if k == COMPUTE and v == loss_node) + 1
    while split < len(ops) and ops[split][0] == FREE:
        split += 1
    alive: set[tuple[str, int]] = set()
    for kind, v in ops[:split]:
        if kind in (COMPUTE, RELOAD):
            alive.add(("v", v))
            alive.discard(("h", v))
        elif kind == FREE:
            alive.discard(("v", v))
        elif kind == OFFLOAD:
            alive.add(("h", v))
    return split, [f"{prefix}{v}" for prefix, v in sorted(alive, key=lambda a: (a[1], a[0] == "h"))]


def _replayed(times_computed: np.ndarray, nodes: list[fx.Node]) -> set[int]:
    """Random ops that are computed again: they draw the same numbers, the generator state before the
    first compute kept and restored around each recomputation (what torch.utils.checkpoint does)."""
    return {v for v in np.flatnonzero(times_computed > 1).tolist() if _is_random(nodes[v])}


def _in_place(traced: Traced, ops: list[tuple[str, int]], nodes: list[fx.Node], writer: _Writer) -> set[int]:
    """Schedule positions of the computes the simulator's rule 8 runs in place (:func:`inplace_writes`):
    each is written with its op's in-place overload on its first argument, the tensor of the node u it
    overwrites (``inplace_of``), so the ``del v<u>`` right after it frees nothing, as simulated. The
    program runs outside autograd (``_ScheduledStep``'s forward, and its backward without
    ``create_graph``), so nothing saved for a gradient sees the overwritten values."""
    positions = set(inplace_writes(traced.graph, ops))
    for p in positions:
        v = ops[p][1]
        u = int(traced.graph.inplace_of[v])
        first = nodes[v].args[0] if nodes[v].args else None
        if not isinstance(first, fx.Node) or writer.root(first) != u:
            raise ExportError(f"Node {v} ({traced.graph.names[v]!r}) is recorded as overwriting node {u} in place, "
                              f"but its first argument is not node {u}'s value; trace the model again.")
    return positions


def _multi_outputs(ops: list[tuple[str, int]], nodes: list[fx.Node], writer: _Writer
                   ) -> tuple[dict[int, tuple[int, Any]], set[int], dict[int, list[int]]]:
    """(getitem node -> (its op, output index), ops held as lists, schedule position of such an op's
    compute -> output slots no getitem reads from that copy).

    A multi-output op whose outputs are also nodes of their own (``getitem`` nodes, e.g. a batch norm's
    saved statistics) is held as a list; each such node takes its output over (the op's slot is
    cleared), so that output lives as long as its own node, as the simulator counts it. (A schedule
    never takes it again from the same copy of the op: the separated-output rule the simulator checks.)"""
    getitem_of = {v: (writer.root(n.args[0]), n.args[1]) for v, n in enumerate(nodes) if n.target is operator.getitem}
    split_ops = {op for op, _ in getitem_of.values()}
    getitems = {op: [(g, i) for g, (o, i) in getitem_of.items() if o == op] for op in split_ops}
    unread: dict[int, list[int]] = {}
    pending: set[int] = set()
    for p in range(len(ops) - 1, -1, -1):
        kind, v = ops[p]
        if kind not in (COMPUTE, FREE):  # a host copy and its reload are the same copy (rule 9)
            continue
        if v in split_ops:
            if kind == COMPUTE:
                unread[p] = [i for g, i in getitems[v] if g not in pending]
            pending -= {g for g, _ in getitems[v]}
        elif kind == COMPUTE and v in getitem_of:
            pending.add(v)
    return getitem_of, split_ops, unread


@dataclass
class _Body:
    """Writes schedule ops as program lines; ``computed`` carries over from the forward to the backward part."""

    ops: list[tuple[str, int]]
    nodes: list[fx.Node]
    names: list[str]
    writer: _Writer
    outputs: _StepOutputs
    replayed: set[int]
    getitem_of: dict[int, tuple[int, Any]]
    split_ops: set[int]
    unread: dict[int, list[int]]
    in_place: set[int]  # schedule positions of computes written with the in-place overload (rule 8)
    deps: tuple[tuple[int, ...], ...]  # each graph node's inputs (Graph.dep_lists)
    computed: set[int] = field(default_factory=set)
    reloading: set[int] = field(default_factory=set)  # reloaded nodes no compute has waited for yet

    def lines(self, positions: range, backward: bool) -> list[str]:
        """The lines of the ops at ``positions``: a ``del`` per free, a call per compute, the copies of
        rule 9 (``offload`` and ``reload`` on the copy streams, ``ready`` where compute waits for one)."""
        lines = []
        for p in positions:
            kind, v = self.ops[p]
            if kind == FREE:
                lines.append(f"del v{v}")
            elif kind == OFFLOAD:
                if v in self.split_ops:
                    raise ExportError(f"The schedule offloads node {v} ({self.names[v]!r}), a multi-output op whose "
                                      "other outputs are nodes of their own; the program holds them together. "
                                      "Offload only what offload.offloadable allows.")
                lines.append(f"h{v} = offload(v{v})")
            elif kind == WAIT:
                lines.append(f"ready(h{v})")
            elif kind == RELOAD:
                lines += [f"v{v} = reload(h{v}, dev)", f"del h{v}"]
                self.reloading.add(v)
            else:
                waits = sorted(self.reloading.intersection(self.deps[v]))
                self.reloading.difference_update(waits)
                lines += [f"ready(v{d})" for d in waits] + self.compute(p, v, backward)
        return lines

    def compute(self, p: int, v: int, backward: bool) -> list[str]:
        """The lines of one compute of ``v`` (at schedule position ``p``), with what its first compute emits."""
        out = self.outputs
        call = self.writer.call(self.nodes[v], in_place=p in self.in_place)
        line = f"v{v} = {f'list({call})' if v in self.split_ops else call}  # {self.names[v]}"
        lines = []
        if v in self.replayed and v in self.computed:
            lines += [f"with replay_rng(rng[{v}], dev):", "    " + line]
        else:
            if v in self.replayed:
                lines.append(f"rng[{v}] = rng_state(dev)")
            lines.append(line)
        lines += [f"v{v}[{i}] = None  # no node reads it from this copy" for i in self.unread.get(p, ())]
        if v in self.getitem_of:
            op, index = self.getitem_of[v]
            lines.append(f"v{op}[{index}] = None  # v{v} holds it now")
        if v not in self.computed:
            self.computed.add(v)
            if v == out.loss_node:
                lines.append(f"loss = {self.writer.expr(out.loss_fx)}")
            lines += out.writes.get(v, [])
            for j, expr in out.emits.get(v, ()):
                if not backward:
                    raise ExportError("A parameter gradient is computed before the loss; the schedule is malformed.")
                lines.append(f"emit({j}, {expr})")
        if v in out.rebind:
            lines.append(out.rebind[v])
        return lines


def _program_text(info: dict[str, Any], signature: StepSignature, constants: list[str], split: int, n_ops: int,
                  fwd: list[str], bwd: list[str]) -> str:
    """The generated module: its tables, ``forward_part``, ``backward_part``, ``PROGRAM`` and ``load``."""

    def indent(lines: list[str]) -> str:
        return "\n".join("    " + line for line in lines)

    return (
        "# ---- generated by `bonsai export` from the schedule below: do not edit ----\n"
        f"INFO = {info!r}\n"
        f"PARAMS = {signature.params!r}\n"
        f"BUFFERS = {signature.buffers!r}\n"
        f"INPUTS = {signature.inputs!r}\n"
        f"CONSTANTS = {constants!r}  # tensors the model created while traced, in constants.pt\n\n\n"
        "def forward_part(args, dev):\n"
        f'    """Schedule ops 0..{split - 1}: the forward pass up to the loss."""\n'
        f"{indent(fwd)}\n\n\n"
        "def backward_part(args, alive, rng, dev, emit):\n"
        f'    """Schedule ops {split}..{n_ops - 1}: recomputations and the backward pass."""\n'
        f"{indent(bwd)}\n\n\n"
        "PROGRAM = Program(PARAMS, BUFFERS, INPUTS, CONSTANTS, forward_part, backward_part, INFO)\n\n\n"
        "def load(model: nn.Module, grads: str = \"autograd\") -> Checkpointed:\n"
        '    """Wrap ``model`` (same class and shapes as exported) to train with the schedule:\n'
        "    ``loss = load(model)(*inputs, loss_fn=loss_fn); loss.backward()``. See README.md.\"\"\"\n"
        "    return Checkpointed(model, PROGRAM, grads, load_constants(__file__, CONSTANTS))\n"
    )


def _is_random(node: fx.Node) -> bool:
    """Whether the op draws from the random number generator (dropout, bernoulli, rand*, ...)."""
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def _check_signature(placeholders: list[fx.Node], sig: StepSignature) -> None:
    """ExportError unless the traced placeholders have the shapes of the model's parameters, buffers and batch."""
    expected = [p[1] for p in sig.params] + [b[2] for b in sig.buffers] + [x[0] for x in sig.inputs]
    got = [tuple(getattr(n.meta.get("val"), "shape", ())) for n in placeholders]
    if expected != got:
        raise ExportError(f"The traced step has {len(got)} inputs (parameters, buffers, batch) of shapes {got[:4]}..., "
                          f"but the model has {len(expected)} of shapes {expected[:4]}...: the model factory must "
                          "build the same model each time.")


class _Writer:
    """Writes FX nodes and their arguments as Python expressions over ``a<i>`` (placeholders),
    ``v<id>`` (graph nodes) and ``dev`` (the device the step runs on)."""

    def __init__(self, placeholders: list[fx.Node], graph_ids: dict[str, int], constants: list[str]) -> None:
        self.ph = {n: i for i, n in enumerate(placeholders)}
        self.const = {name: len(placeholders) + i for i, name in enumerate(constants)}  # after the placeholders
        self.ids = graph_ids

    def root(self, node: fx.Node) -> int:
        """The graph node whose value ``node`` reads (through getitem and identities)."""
        if node.name in self.ids:
            return self.ids[node.name]
        if node.target is operator.getitem or str(node.target) in IDENTITY_OPS:
            return self.root(node.args[0])
        raise ExportError(f"FX node {node.name!r} is no node of the traced graph.")

    def expr(self, a: Any) -> str:
        if isinstance(a, fx.Node):
            if a.op == "placeholder":
                return f"a{self.ph[a]}"
            if a.op == "get_attr":
                return f"a{self.const[a.target]}"
            if a.name in self.ids:
                return f"v{self.ids[a.name]}"
            if a.target is operator.getitem:
                return f"{self.expr(a.args[0])}[{a.args[1]!r}]"
            if str(a.target) in IDENTITY_OPS:
                return self.expr(a.args[0])
            if a.op == "call_function":  # a view of a parameter or input: free to recompute at each use
                return self.call(a)
            raise ExportError(f"FX node {a.name!r} ({a.op}) cannot be exported: only aten ops, parameters, buffers, "
                              "inputs and tensor constants are supported.")
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

    def call(self, node: fx.Node, in_place: bool = False) -> str:
        """The call of ``node``'s op on its arguments; with ``in_place``, of the op's in-place overload
        (:func:`in_place_form`), which writes the result into the first argument."""
        if node.target is operator.getitem:  # an output of a multi-output op that is a node of its own
            return f"{self.expr(node.args[0])}[{node.args[1]!r}]"
        if not isinstance(node.target, torch._ops.OpOverload):
            raise ExportError(f"FX node {node.name!r} calls {node.target!r}, not an aten op; it cannot be exported.")
        target = in_place_form(node) if in_place else node.target
        name = str(target)
        if name not in PORTABLE_OPS and any(sign in name for sign in DEVICE_SPECIFIC):
            raise ExportError(f"FX node {node.name!r} calls {name}, a kernel of one device only; the export would not "
                              "run elsewhere. Report the op: it needs a device-neutral form in PORTABLE_OPS.")
        args = [self.expr(a) for a in node.args] + [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()]
        return f"{PORTABLE_OPS.get(name, f'torch.ops.{name}')}({', '.join(args)})"


def in_place_form(node: fx.Node) -> torch._ops.OpOverload:
    """The in-place overload of ``node``'s aten op, same overload name (``aten.relu.default`` ->
    ``aten.relu_.default``, ``aten.add.Tensor`` -> ``aten.add_.Tensor``): what eager ran where the
    trace recorded ``inplace_of``. ExportError when the op has none (or only a device-specific
    helper in PORTABLE_OPS stands for it)."""
    from bonsai_core.modules import in_place_overload

    op = node.target
    overload = in_place_overload(op)
    if overload is None or str(op) in PORTABLE_OPS:
        raise ExportError(f"FX node {node.name!r} ({op}) is recorded as an in-place write, but {op} has no in-place "
                          "overload to run it with; trace the model again with this version of bonsai.")
    return overload
