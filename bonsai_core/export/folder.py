"""What both back-ends share around an export folder: finding the traced step a schedule was made for,
the ``INFO`` every ``checkpointed.py`` carries, writing the folder (``checkpointed.py``, ``schedule.json``,
``README.md``) and loading it back."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from bonsai_core.errors import BonsaiError, ScheduleError
from bonsai_core.graph import Graph
from bonsai_core.optimizer import OPTIMIZERS, with_optimizer
from bonsai_core.schedule import Schedule, SimResult
from bonsai_core.trace import Traced


class ExportError(BonsaiError):
    """A schedule or model cannot be exported (wrong graph, unsupported op or constant)."""


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


BACKENDS = ("replay", "checkpoint")


def schedule_info(graph: Graph, schedule: Schedule, sim: SimResult, backend: str) -> dict[str, Any]:
    """The part of ``INFO`` (in ``checkpointed.py``) both back-ends write: the back-end (one of
    :data:`BACKENDS`), the graph, the schedule and the simulator's prediction for it; each back-end
    appends its own keys."""
    return {"backend": backend, "graph": graph.name, "graph_hash": graph.hash, "method": schedule.method, "budget": schedule.budget,
            "predicted_peak": sim.peak, "fixed_mem": graph.fixed_mem, "recomputes": sim.recomputes,
            "overhead": sim.overhead, "offloaded_bytes": sim.offloaded_bytes, "predicted_host_peak": sim.host_peak}


def write_folder(out_dir: str | Path, source: str, graph: Graph, schedule: Schedule, sim: SimResult,
                 readme: Callable[[Path], str], constants: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``checkpointed.py`` (``source``), ``constants.pt`` (when ``constants``), ``schedule.json``
    (``schedule`` stamped with ``graph``'s hash and ``sim``'s stats) and ``README.md`` (``readme`` of the
    folder's absolute path) to ``out_dir``; an unwritable folder is an ExportError. Returns ``out_dir``."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpointed.py").write_text(source)
        if constants:
            torch.save(constants, out / "constants.pt")
        saved = Schedule(graph=graph.name, method=schedule.method, ops=list(schedule.ops), budget=schedule.budget,
                         graph_hash=graph.hash, stats={**schedule.stats, **sim.stats()}, extra=schedule.extra,
                         device=schedule.device, host_budget=schedule.host_budget)
        (out / "schedule.json").write_text(json.dumps(saved.to_dict(), separators=(",", ":")) + "\n")
        (out / "README.md").write_text(readme(out.resolve()))
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


def export_backend(out_dir: str | Path) -> str:
    """The back-end that wrote the export in ``out_dir`` (one of :data:`BACKENDS`), as its ``INFO``
    says; a folder written before ``INFO`` named it is the replay back-end's when it defines ``PROGRAM``."""
    module = load_export(out_dir)
    return getattr(module, "INFO", {}).get("backend") or ("replay" if hasattr(module, "PROGRAM") else "checkpoint")
