"""Write an export folder (``checkpointed.py``, ``schedule.json``, ``README.md``) and load one back."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bonsai_core.errors import ScheduleError
from bonsai_core.export.program import ExportError, StepSignature, generate_program, step_signature
from bonsai_core.export.readme import readme
from bonsai_core.optimizer import OPTIMIZERS, with_optimizer
from bonsai_core.schedule import Schedule, simulate
from bonsai_core.trace import Traced

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


def trace_for_schedule(model: str, options: dict[str, Any], schedule: Schedule, *, profile: str | None = None,
                       seed: int = 0, autocast: str | None = None) -> Traced:
    """Trace ``model`` with ``options`` and check that ``schedule`` was made for that graph.

    ``profile`` is the cost model the graph was traced with (it changes node costs, so the graph
    hash); None tries the default first, then the others. A graph traced with an optimizer
    (``bonsai trace --optimizer``) is recognised by its hash, and the returned graph has it. ``autocast`` ("bf16" | "fp16") traces under
    ``torch.autocast``. Raises ScheduleError on a mismatch."""
    from bonsai_core.costmodel import DEFAULT_PROFILE, PROFILES
    from bonsai_core.trace import trace_model

    profiles = [profile] if profile else [DEFAULT_PROFILE, *(p for p in PROFILES if p != DEFAULT_PROFILE)]
    first = None
    for p in profiles:
        traced = trace_model(model, profile=p, seed=seed, autocast=autocast, **options)
        if schedule.graph_hash in (None, traced.graph.hash):
            return traced
        for name in OPTIMIZERS[1:]:  # a graph traced with `--optimizer`: the same step, its optimizer added
            with_step = with_optimizer(traced.graph, name)
            if schedule.graph_hash == with_step.hash:
                return dataclasses.replace(traced, graph=with_step)
        first = first or traced
        if traced.graph.name != schedule.graph:  # another model or size: no cost model makes it match
            break
    assert first is not None
    raise ScheduleError(
        f"This schedule was made for graph {schedule.graph!r} (hash {schedule.graph_hash}), but {model!r} with "
        f"options {options or '{}'}{f' and autocast {autocast}' if autocast else ''} traces to "
        f"{first.graph.name!r} (hash {first.graph.hash} with cost model {profiles[0]}). Export with the model and "
        "options (--batch, --layers, --autocast, ...) you traced the schedule's graph with, or solve again for "
        "this graph.")


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
        constants = constants_of(traced)
        if constants:
            torch.save(constants, out / "constants.pt")
        saved = Schedule(graph=graph.name, method=schedule.method, ops=list(schedule.ops), budget=schedule.budget,
                         graph_hash=graph.hash, stats={**schedule.stats, **sim.stats()}, extra=schedule.extra)
        (out / "schedule.json").write_text(json.dumps(saved.to_dict(), separators=(",", ":")) + "\n")
        (out / "README.md").write_text(readme(info, schedule, out.resolve()))
    except OSError as e:
        raise ExportError(f"Cannot write the export to {str(out)!r}: {e.strerror}. Choose a writable folder.") from None
    return out


def load_export(out_dir: str | Path) -> ModuleType:
    """Import ``out_dir/checkpointed.py`` as a fresh module (as a user's ``import checkpointed`` would)."""
    path = Path(out_dir) / "checkpointed.py"
    if not path.is_file():
        raise ExportError(f"{str(path)!r} does not exist: pass the folder that `bonsai export` wrote.")
    # the standard recipe, without sys.modules: the generated file must load this way
    spec = importlib.util.spec_from_file_location(f"_bonsai_export_{uuid.uuid4().hex}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
