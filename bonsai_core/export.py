"""Schedule -> a runnable checkpointed model, and its verification against the original.

``export_model`` writes a folder that runs with plain PyTorch (no ``bonsai_core`` needed):

* ``checkpointed.py``: a small runtime (``bonsai_core/export_runtime/runtime.py``, copied as text) and a
  generated *program*: the traced AOTAutograd joint graph (forward, loss, backward; aten ops) written
  out as straight-line Python in the schedule's order, one line per ``compute`` op and a ``del`` per
  ``free`` op. A recomputation is the same line run again. ``load(model)`` wraps ``model`` in a
  ``Checkpointed`` module whose ``autograd.Function`` runs the ops up to the loss in ``forward`` and the
  rest in ``backward``; parameter gradients land in ``model``'s ``.grad``.
* ``schedule.json``: the schedule, with the simulator's predicted peak in ``stats``.
* ``README.md``: how to train with it and how to check it on a GPU.

Because every tensor the program creates is a node of the graph and Python frees it at the scheduled
``del``, the real step allocates what the simulator counted: checkpoint-region schedules (bonsai, chen)
and general ones (checkmate, moccasin, dtr, coop) run the same way. ``verify_export`` runs the original
and the exported step side by side and compares loss, gradients and peak memory.
"""

from __future__ import annotations

import importlib.util
import json
import math
import operator
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.fx as fx

from bonsai_core.errors import BonsaiError, ModelError, ScheduleError
from bonsai_core.schedule import COMPUTE, FREE, Schedule, simulate
from bonsai_core.trace import Traced

RUNTIME = Path(__file__).resolve().parent / "export_runtime" / "runtime.py"
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


# -- public API ----------------------------------------------------------------------------------

def export_model(model: str, options: dict[str, Any], schedule: Schedule, out_dir: str | Path, *,
                 profile: str | None = None, seed: int = 0) -> Path:
    """Trace ``model`` (a zoo name or ``package.module:factory``) with ``options``, check that
    ``schedule`` was made for that graph, and write the runnable export to ``out_dir``.

    ``profile`` is the cost model the graph was traced with (it changes node costs, so the graph
    hash); None tries the default first, then the others. Returns ``out_dir``.
    """
    from bonsai_core.costmodel import DEFAULT_PROFILE, PROFILES
    from bonsai_core.trace import trace_zoo

    profiles = [profile] if profile else [DEFAULT_PROFILE, *(p for p in PROFILES if p != DEFAULT_PROFILE)]
    traced = None
    for p in profiles:
        traced = trace_zoo(model, profile=p, seed=seed, **options)
        if schedule.graph_hash in (None, traced.graph.hash):
            break
    assert traced is not None
    if schedule.graph_hash not in (None, traced.graph.hash):
        raise ScheduleError(
            f"This schedule was made for graph {schedule.graph!r} (hash {schedule.graph_hash}), but {model!r} with "
            f"options {options or '{}'} traces to {traced.graph.name!r} (hash {traced.graph.hash}). Export with "
            "the model and options (--batch, --layers, ...) you traced the schedule's graph with, or solve again "
            "for this graph.")
    return export_traced(traced, step_signature(model, options, seed), schedule, out_dir,
                         spec={"model": model, "options": dict(options), "seed": seed})


def export_traced(traced: Traced, signature: StepSignature, schedule: Schedule, out_dir: str | Path,
                  spec: dict[str, Any] | None = None) -> Path:
    """Write the export of an already traced step (``export_model`` without the tracing)."""
    graph = traced.graph
    if schedule.graph_hash not in (None, graph.hash):
        raise ScheduleError(f"This schedule was made for graph hash {schedule.graph_hash}, not {graph.hash} "
                            f"({graph.name!r}): solve again for this graph.")
    sim = simulate(graph, schedule)  # raises ScheduleError on any broken rule
    info = {"graph": graph.name, "graph_hash": graph.hash, "method": schedule.method, "budget": schedule.budget,
            "predicted_peak": sim.peak, "fixed_mem": graph.fixed_mem, "recomputes": sim.recomputes,
            "overhead": sim.overhead, **(spec or {})}
    program = generate_program(traced, signature, schedule, info)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpointed.py").write_text(RUNTIME.read_text() + "\n\n" + program)
        saved = Schedule(graph=graph.name, method=schedule.method, ops=list(schedule.ops), budget=schedule.budget,
                         graph_hash=graph.hash, stats={**schedule.stats, **sim.stats()}, extra=schedule.extra)
        (out / "schedule.json").write_text(json.dumps(saved.to_dict(), separators=(",", ":")) + "\n")
        (out / "README.md").write_text(_readme(info, schedule, out.resolve()))
    except OSError as e:
        raise ExportError(f"Cannot write the export to {str(out)!r}: {e.strerror}. Choose a writable folder.") from None
    return out


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


def load_export(out_dir: str | Path) -> ModuleType:
    """Import ``out_dir/checkpointed.py`` as a fresh module (as a user's ``import checkpointed`` would)."""
    path = Path(out_dir) / "checkpointed.py"
    if not path.is_file():
        raise ExportError(f"{str(path)!r} does not exist: pass the folder that `bonsai export` wrote.")
    name = f"_bonsai_export_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


# -- code generation -----------------------------------------------------------------------------

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
        if node.target is operator.getitem:  # an output of a multi-output op that is a graph node of its own
            return f"{self.expr(node.args[0])}[{node.args[1]!r}]"
        if not isinstance(node.target, torch._ops.OpOverload):
            raise ExportError(f"FX node {node.name!r} calls {node.target!r}, not an aten op; it cannot be exported.")
        args = [self.expr(a) for a in node.args] + [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()]
        return f"torch.ops.{node.target}({', '.join(args)})"


# -- README --------------------------------------------------------------------------------------

def _readme(info: dict[str, Any], schedule: Schedule, folder: Path) -> str:
    from bonsai_core.budget import format_bytes

    model = info.get("model", "MODEL")
    opts = " ".join(f"--{k} {v}" for k, v in (info.get("options") or {}).items())
    regions = ""
    if "segments" in schedule.extra:
        regions = (f"\nThe schedule is a checkpoint-region plan: {len(schedule.extra['segments'])} segments, "
                   f"{len(schedule.extra.get('recomputed', []))} recomputed (``extra`` in schedule.json). The program "
                   "rebuilds each recomputed region once, right before the first backward op that needs it.\n")
    return f"""# Checkpointed `{model}` ({info['method']} schedule)

Made by `bonsai export` for graph `{info['graph']}` (hash `{info['graph_hash']}`).
Predicted peak: **{format_bytes(info['predicted_peak'])}** ({info['predicted_peak']} bytes, of which
{format_bytes(info['fixed_mem'])} fixed: parameters, gradients, buffers, the batch); {info['recomputes']}
recomputations, compute overhead {info['overhead']:+.2%}.
{regions}
## Train with it (plain PyTorch, no bonsai needed)

```python
import sys; sys.path.insert(0, "{folder}")  # this folder
import checkpointed

ck = checkpointed.load(model)          # shares model's parameters
loss = ck(*inputs, loss_fn=loss_fn)    # same loss as loss_fn(model(*inputs))
loss.backward()                        # scheduled backward; gradients land in model's .grad
optimizer.step(); optimizer.zero_grad()
```

* The schedule covers the whole step, loss included, so `ck` computes the loss: pass the same kind of
  loss module you traced with (an `nn.Module` holding its targets as buffers; new targets per batch
  are fine). Under `torch.no_grad()`, `ck(*inputs)` is just `model(*inputs)`.
* Inputs, parameters and targets must have the traced shapes and dtypes (the schedule and its memory
  are made for them); `ck` raises a clear error otherwise.
* Gradients reach autograd one by one, the moment the schedule computes them, so parameter hooks
  and `DistributedDataParallel` work: wrap the checkpointed module, `DDP(ck)`, not `model`.
  `load(model, grads="direct")` writes `.grad` itself instead, bypassing autograd and its hooks.

## Check it on your GPU

```
bonsai verify {model} {opts} {folder} --device cuda
```

runs the original and this model side by side and prints the loss difference, the largest
gradient difference, the predicted peak and the measured peak (`torch.cuda.max_memory_allocated`).
Without bonsai installed, measure it yourself: `torch.cuda.reset_peak_memory_stats()`, one step as
above, then `torch.cuda.max_memory_allocated()` (with `.grad` already allocated, as in steady-state
training). `max_memory_allocated` also counts what the simulator does not model: the caching
allocator's rounding of block sizes, and workspaces that cuBLAS and cuDNN (convolutions) allocate
through it. On CPU (`bonsai verify ... --device cpu`) the measured peak matches the prediction.
"""


# -- verification --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verification:
    """The original and the exported step, side by side on one device."""

    device: str
    loss_original: float
    loss_exported: float
    max_grad_diff: float
    predicted_peak: int
    measured_peak: int
    original_peak: int

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_exported - self.loss_original)

    @property
    def peak_error(self) -> float:
        """(measured - predicted) / predicted."""
        return self.measured_peak / self.predicted_peak - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "loss_diff": self.loss_diff, "peak_error": self.peak_error}


def verify_export(model: str, options: dict[str, Any], out_dir: str | Path, *, device: str = "cpu",
                  seed: int = 0, grads: str = "autograd") -> Verification:
    """Run one step of the original model and of the export on ``device`` (one after the other, so
    only one copy is resident) and compare loss, gradients and peak memory (``measure_step``)."""
    from bonsai_core import zoo
    from bonsai_core.measure import measure_step

    exported = load_export(out_dir)
    predicted = int(exported.INFO["predicted_peak"])
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for, but this PyTorch sees no CUDA device.")

    def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], Any]:
        net, inputs, loss_fn = zoo.build(model, seed=seed, **options)
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn = loss_fn.to(dev)
        return net.to(dev), tuple(x.to(dev) for x in inputs), loss_fn

    net, inputs, loss_fn = build()
    original = measure_step(net, inputs, loss_fn)
    reference = {n: p.grad.detach().cpu() for n, p in net.named_parameters() if p.grad is not None}
    del net, inputs, loss_fn

    net, inputs, loss_fn = build()
    try:
        ck = exported.load(net, grads=grads)
    except ValueError as e:
        raise ModelError(f"The export in {str(out_dir)!r} does not fit {model!r} with these options: {e}") from None

    def step() -> torch.Tensor:
        loss = ck(*inputs, loss_fn=loss_fn)
        loss.backward()
        return loss

    try:
        measured = measure_step(net, inputs, loss_fn, step=step)
    except (TypeError, ValueError) as e:  # the runtime's own checks: shapes, dtypes, loss buffers
        raise ModelError(f"The export in {str(out_dir)!r} does not fit {model!r} with these options: {e}") from None
    diff = max((float((p.grad.detach().cpu() - reference[n]).abs().max()) for n, p in net.named_parameters()
                if n in reference), default=0.0)
    return Verification(device=measured.device, loss_original=original.loss, loss_exported=measured.loss,
                        max_grad_diff=diff, predicted_peak=predicted, measured_peak=measured.peak,
                        original_peak=original.peak)
