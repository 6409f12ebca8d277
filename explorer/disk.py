"""What the explorer keeps on disk, so that it outlives a server: uploaded Hugging Face configs (data,
never run) and every plan solved (a schedule or the method's error), keyed by the graph's hash.

The folder is ``$BONSAI_EXPLORER_CACHE``, else ``$XDG_CACHE_HOME/bonsai/explorer``, else
``~/.cache/bonsai/explorer``. A plan is kept under the graph's content hash, the method, its options,
the bound (live or reserved) and the budget, and under a digest of bonsai_core's sources: any change to
the solvers or the simulator starts a new store, so a kept plan is always what this code would solve.
Kept plans are simulated again when they are read (every schedule shown is validated). Beside a plan,
its allocator replay (what the Memory page draws; a second or two on the largest steps) is kept too, with
a digest of the plan it replays, so that a drag in a new server reads both. A model's traced step is kept
too, under its name, its options, bonsai_core's sources and the libraries' versions, so that a new server
does not trace it again. For a sweep's child process (:mod:`explorer.background`), the graph it works on (under
its hash) and its job; from it, bonsai's reach on the graph. Nothing here imports Streamlit.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from bonsai_core.allocator.replaying import AllocResult
from bonsai_core.errors import BonsaiError, ModelError
from bonsai_core.schedule import Schedule

ROOT = Path(__file__).resolve().parent.parent
KEY = re.compile(r"^[0-9a-f]{16}$")


def folder() -> Path:
    if os.environ.get("BONSAI_EXPLORER_CACHE"):
        return Path(os.environ["BONSAI_EXPLORER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bonsai" / "explorer"


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: another server reading it sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_bytes(data)
    os.replace(part, path)


# -- uploaded configs --------------------------------------------------------------------------------

def store_config(data: bytes, filename: str) -> str:
    """Keep an uploaded config.json under its content's hash, in a folder of its own with its file name
    (so a model traced from it is ``hf:PATH`` like any config file); returns the key (16 hex digits)."""
    key = hashlib.sha256(data).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(filename).name).strip(".-") or "config.json"
    if not name.endswith(".json"):
        name += ".json"
    if not any((folder() / "configs" / key).glob("*.json")):
        _write(folder() / "configs" / key / name, data)
    return key


def stored_config(key: str) -> Path:
    """The file of the config ``key`` names; ModelError when this server holds none."""
    found = sorted((folder() / "configs" / key).glob("*.json")) if KEY.match(key) else []
    if not found:
        raise ModelError(f"this server holds no uploaded config {key!r}: upload the config.json on the Model page "
                         "(Hugging Face tab) and trace it again")
    return found[0]


# -- solved plans ------------------------------------------------------------------------------------

@functools.cache
def code_digest() -> str:
    """A digest of bonsai_core's sources: what every plan and its simulation depend on."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "bonsai_core").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _plan_path(graph_hash: str, method: str, options: tuple, reserved: str | None, budget: int | None) -> Path:
    settings = json.dumps([method, [[k, repr(v)] for k, v in options], reserved], sort_keys=True)
    digest = hashlib.sha256(settings.encode()).hexdigest()[:16]
    return folder() / "plans" / code_digest() / graph_hash / digest / f"{budget}.json.gz"


def save_plan(graph_hash: str, method: str, options: tuple, reserved: str | None, budget: int | None,
              schedule: Schedule | None, error: str | None, seconds: float) -> None:
    """Keep one solve: its schedule, or the error the method gave (a budget it cannot meet), and its time."""
    record: dict[str, Any] = {"seconds": seconds}
    if schedule is not None:
        record["schedule"] = schedule.to_dict()
    else:
        record["error"] = error
    try:
        _write(_plan_path(graph_hash, method, options, reserved, budget),
               gzip.compress(json.dumps(record, separators=(",", ":")).encode(), 5))
    except OSError:  # a full or read-only disk: the plan is still cached in memory
        pass


def has_plan(graph_hash: str, method: str, options: tuple, reserved: str | None, budget: int | None) -> bool:
    return _plan_path(graph_hash, method, options, reserved, budget).exists()


def load_plan(graph_hash: str, method: str, options: tuple, reserved: str | None,
              budget: int | None) -> tuple[Schedule | None, str | None, float] | None:
    """(schedule or None, error or None, seconds) of a kept solve, None when none is kept (or it cannot be read)."""
    path = _plan_path(graph_hash, method, options, reserved, budget)
    try:
        record = json.loads(gzip.decompress(path.read_bytes()))
        if "schedule" in record:
            return Schedule.from_dict(record["schedule"]), None, float(record.get("seconds", 0.0))
        return None, str(record["error"]), float(record.get("seconds", 0.0))
    except (OSError, ValueError, EOFError, KeyError, BonsaiError):  # absent, or not a file this wrote
        return None


# -- allocator replays, beside their plans -----------------------------------------------------------

REPLAY_ARRAYS = ("live", "reserved", "largest_free")  # AllocResult's per-op arrays; the rest are scalars


def plan_digest(schedule: Schedule) -> str:
    """A digest of the whole plan document (ops, device, stats): a replay kept for another plan is not read."""
    return hashlib.sha256(json.dumps(schedule.to_dict(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _replay_path(graph_hash: str, method: str, options: tuple, reserved: str | None, budget: int | None) -> Path:
    plan = _plan_path(graph_hash, method, options, reserved, budget)
    return plan.with_name(plan.name.removesuffix(".json.gz") + ".replay.npz")


def save_replay(graph_hash: str, method: str, options: tuple, reserved: str | None, budget: int | None,
                schedule: Schedule, result: AllocResult) -> None:
    """Keep ``result``, the allocator replay of ``schedule``, beside the plan of these settings."""
    scalars = {f.name: _plain(getattr(result, f.name)) for f in dataclasses.fields(result) if f.name not in REPLAY_ARRAYS}
    out = io.BytesIO()
    np.savez_compressed(out, **{name: getattr(result, name) for name in REPLAY_ARRAYS},
                        about=np.array(json.dumps({"plan": plan_digest(schedule), **scalars})))
    try:
        _write(_replay_path(graph_hash, method, options, reserved, budget), out.getvalue())
    except OSError:  # a full or read-only disk: the replay is still cached in memory
        pass


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def load_replay(graph_hash: str, method: str, options: tuple, reserved: str | None, budget: int | None,
                schedule: Schedule) -> AllocResult | None:
    """The kept allocator replay of ``schedule`` (these settings' plan), None when none is kept for this very
    plan (or it cannot be read)."""
    try:
        with np.load(_replay_path(graph_hash, method, options, reserved, budget), allow_pickle=False) as kept:
            about = json.loads(str(kept["about"]))
            if about.pop("plan") != plan_digest(schedule):
                return None
            return AllocResult(**{name: np.asarray(kept[name]) for name in REPLAY_ARRAYS}, **about)
    except (OSError, ValueError, KeyError, TypeError, EOFError):  # absent, or not a file this wrote
        return None


# -- what a sweep's child process reads and writes (explorer.background) -----------------------------

def _graph_path(graph_hash: str) -> Path:
    return folder() / "graphs" / f"{graph_hash}.json.gz"


def _write_graph(path: Path, graph: Any) -> None:
    _write(path, gzip.compress(json.dumps(graph.to_dict(), separators=(",", ":")).encode(), 5))


def _read_graph(path: Path) -> Any:
    """The graph kept at ``path``, None when none is (or it cannot be read)."""
    from bonsai_core.graph import Graph

    try:
        return Graph.from_dict(json.loads(gzip.decompress(path.read_bytes())))
    except (OSError, ValueError, EOFError, BonsaiError):  # absent, or not a file this wrote
        return None


def save_graph(graph: Any) -> None:
    """Keep ``graph`` under its content hash (once), for a child process to read. OSError when the disk cannot."""
    path = _graph_path(graph.hash)
    if not path.exists():
        _write_graph(path, graph)


def load_graph(graph_hash: str) -> Any:
    """The graph :func:`save_graph` kept under ``graph_hash``, None when none is kept (or it is not that graph)."""
    graph = _read_graph(_graph_path(graph_hash))
    return graph if graph is not None and graph.hash == graph_hash else None


def save_job(data: bytes) -> Path:
    """Write a child process's job under a name of its own; its path. OSError when the disk cannot."""
    path = folder() / "jobs" / f"{hashlib.sha256(data).hexdigest()[:16]}.{os.getpid()}.json"
    _write(path, data)
    return path


def _reach_path(graph_hash: str) -> Path:
    return folder() / "plans" / code_digest() / graph_hash / "reach.json"


def save_reach(graph_hash: str, reach: int | None, bound: tuple[int, int, int]) -> None:
    """Keep bonsai's reach on a graph (the smallest budget it meets with its default options; None: none found in
    its time) and the checkpoint regions' bound (:class:`bonsai_core.regions.RegionBound`'s fields)."""
    try:
        _write(_reach_path(graph_hash), json.dumps({"reach": reach, "region_bound": list(bound)}).encode())
    except OSError:
        pass


def load_reach(graph_hash: str) -> tuple[int | None, tuple[int, int, int]] | None:
    """(reach, region bound's fields) :func:`save_reach` kept for the graph, None when none is kept."""
    try:
        record = json.loads(_reach_path(graph_hash).read_bytes())
        reach, bound = record["reach"], tuple(int(x) for x in record["region_bound"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (None if reach is None else int(reach)), bound


# -- traced steps -----------------------------------------------------------------------------------

TRACED_WITH = ("torch", "transformers", "torchtitan")  # what a trace depends on besides bonsai_core


@functools.cache
def _libraries() -> list[str]:
    from importlib import metadata

    found = []
    for name in TRACED_WITH:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} absent")
    return found


def _trace_path(name: str, options: tuple) -> Path:
    settings = json.dumps([name, [[k, repr(v)] for k, v in options], _libraries()])
    return folder() / "traces" / code_digest() / f"{hashlib.sha256(settings.encode()).hexdigest()[:16]}.json.gz"


def save_trace(name: str, options: tuple, graph: Any) -> None:
    """Keep model ``name``'s step traced at ``options`` (a zoo, ``hf:`` or torchtitan name: an uploaded config's
    path names its content), under bonsai_core's and the libraries' versions: a new server reads it instead of
    tracing again (the 8B step: some 20 s of CPU)."""
    try:
        _write_graph(_trace_path(name, options), graph)
    except OSError:  # a full or read-only disk: the trace is still cached in memory
        pass


def load_trace(name: str, options: tuple) -> Any:
    """The step :func:`save_trace` kept for ``name`` at ``options`` (a Graph), None when none is kept."""
    return _read_graph(_trace_path(name, options))
