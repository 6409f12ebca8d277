"""The rebuilds of a schedule in words: "at backward step 326, before blocks.1.attn's backward:
recompute blocks.1.attn.qkv + split (3.5 MiB, 41 µs)".

The events themselves are the simulator's (``SimResult.events``, ``bonsai_core.schedule``); this only
names them by module and finds the one under the step cursor. Pure (no Streamlit).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bonsai_core.graph import Graph
from bonsai_core.schedule import RecomputeEvent
from bonsai_core.units import format_bytes
from explorer.module_graph import op_name
from explorer.timeline import Modules

MOST_MODULES = 3  # recomputed modules named per event, then "+N more"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def module_names(graph: Graph, nodes, modules: Modules) -> list[str]:
    """The module calls that ran ``nodes``, in order, each once: views and a multi-output op's parts left
    out (they cost nothing), and an op a call runs between its inner calls named with it
    (``blocks.1: gelu``; ``model: add`` between the model's own calls)."""
    parents = {path.rsplit(".", 1)[0] for path, _, _ in graph.modules if "." in path}
    names = []
    for v in nodes:
        if graph.alias_of[v] >= 0 or graph.output_of[v] >= 0:
            continue
        path = modules.path[v]
        if path in ("", "forward", "backward"):
            names.append(f"model: {op_name(graph.ops[v])}")
        else:
            names.append(f"{path}: {op_name(graph.ops[v])}" if path in parents else path)
    return list(dict.fromkeys(names)) or list(dict.fromkeys(modules.path[v] for v in nodes))


def recomputed_modules(graph: Graph, event: RecomputeEvent, modules: Modules) -> list[str]:
    """What the rebuild recomputes, in the order it runs it (:func:`module_names`)."""
    return module_names(graph, event.nodes, modules)


def where(graph: Graph, event: RecomputeEvent, modules: Modules, code: bool = False) -> str:
    """``before blocks.1.mlp's backward`` (the op that needs the rebuild), or the end of the step;
    ``code``: the module in backticks (markdown)."""
    if event.before < 0:
        return "at the end of the step"
    v = event.before
    name = f"`{modules.path[v]}`" if code else modules.path[v]
    return f"before {name}'s {'forward' if graph.is_forward[v] else 'backward'}"


def _pass(graph: Graph, event: RecomputeEvent) -> str:
    return "backward" if event.before >= 0 and not graph.is_forward[event.before] else "forward"


def event_rows(graph: Graph, events: Sequence[RecomputeEvent], modules: Modules) -> list[dict]:
    """One row per rebuild, for a table: step, pass, where, what, bytes brought back, time."""
    rows = []
    for i, e in enumerate(events):
        names = recomputed_modules(graph, e, modules)
        what = " + ".join(names[:MOST_MODULES]) + (f" +{len(names) - MOST_MODULES} more" if len(names) > MOST_MODULES else "")
        rows.append({"#": i + 1, "step": e.start,
                     "pass": _pass(graph, e),
                     "when": where(graph, e, modules), "recompute": what, "ops": len(e.nodes),
                     "brings back": format_bytes(e.bytes), "time": _time(e.cost)})
    return rows


def event_line(graph: Graph, event: RecomputeEvent, modules: Modules) -> str:
    """The rebuild in one sentence."""
    names = recomputed_modules(graph, event, modules)
    what = " + ".join(f"`{n}`" for n in names[:MOST_MODULES]) + (
        f" and {len(names) - MOST_MODULES} more" if len(names) > MOST_MODULES else "")
    return (f"At {_pass(graph, event)} step {event.start}, {where(graph, event, modules, code=True)}: recompute "
            f"{what} ({len(event.nodes)} ops, {format_bytes(event.bytes)} back, {_time(event.cost)}).")


def current(events: Sequence[RecomputeEvent], step: int | None) -> int | None:
    """The index of the rebuild running at ``step`` (start ≤ step ≤ end), else None."""
    if step is None:
        return None
    return next((i for i, e in enumerate(events) if e.start <= step <= e.end), None)


def event_nodes(event: RecomputeEvent) -> np.ndarray:
    """int64[]: the nodes the rebuild recomputes and the node that needs them (lit on the graph)."""
    return np.asarray([*event.nodes, *([event.before] if event.before >= 0 else [])], dtype=np.int64)
