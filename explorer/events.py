"""The rebuilds of a schedule in words: "at backward step 326, before blocks.1.attn's backward:
recompute blocks.1.attn.qkv + split (3.5 MiB, 41 µs)", and their pattern: the same rebuild repeated in
every block of the model's block stack said once ("before layers.*'s backward: recompute
layers.*.feed_forward.w2, in layers.0–31").

The events themselves are the simulator's (``SimResult.events``, ``bonsai_core.schedule``); this only
names them by module, groups them, and finds the one under the step cursor. Pure (no Streamlit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bonsai_core.graph import Graph, block_stack
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


# -- patterns: the same rebuild in every block, said once ------------------------------------------

@dataclass(frozen=True)
class Pattern:
    """Rebuilds that differ only in the block of the stack they run in."""

    what: str  # what each recomputes, named for every block (``layers.*.attention + layers.*.feed_forward``)
    when: str  # before which op, named for every block
    kind: str  # "forward" or "backward"
    ops: int  # ops each rebuild recomputes
    events: tuple[int, ...]  # the rebuilds (indices of ``SimResult.events``), in order
    blocks: tuple[int, ...]  # the stack's blocks they run in (indices of ``block_stack``), ascending


def _for_every_block(name: str, stack: Sequence[str]) -> tuple[str, int | None]:
    """``name`` with a block of the stack named ``<parent>.*``, and which block it named (None: none)."""
    for i, block in enumerate(stack):
        if name.startswith(block) and name[len(block):len(block) + 1] in ("", ".", ":", "'"):
            parent = block.rpartition(".")[0]
            return (f"{parent}.*" if parent else "*") + name[len(block):], i
    return name, None


def event_block(graph: Graph, event: RecomputeEvent, modules: Modules, stack: Sequence[str]) -> int | None:
    """The block of the stack (its index) most of a rebuild's ops ran in; None when none did."""
    where = {b: i for i, b in enumerate(stack)}
    found = [where[modules.group[v]] for v in event.nodes if modules.group[v] in where]
    return max(set(found), key=found.count) if found else None


def patterns(graph: Graph, events: Sequence[RecomputeEvent], modules: Modules) -> list[Pattern]:
    """The schedule's rebuilds grouped by what they do with the block left out: rebuilds recomputing the
    same modules of different blocks, before the same op of their block, the same number of ops, are one
    pattern; a rebuild in no block (or alone) is a pattern of its own. In the order of each pattern's
    first rebuild."""
    stack = [b for b, _, _ in block_stack(graph)]
    groups: dict[tuple, list[tuple[int, int | None]]] = {}
    for i, e in enumerate(events):
        named = [_for_every_block(n, stack) for n in recomputed_modules(graph, e, modules)]
        when, _ = _for_every_block(where(graph, e, modules).removeprefix("before "), stack)
        key = (" + ".join(n for n, _ in named[:MOST_MODULES]) + (f" +{len(named) - MOST_MODULES} more"
                                                                   if len(named) > MOST_MODULES else ""),
               when, _pass(graph, e), len(e.nodes))
        groups.setdefault(key, []).append((i, event_block(graph, e, modules, stack)))
    out = []
    for (what, when, kind, ops), found in groups.items():
        if len(found) == 1:  # no repeat: its own names
            e = events[found[0][0]]
            names = recomputed_modules(graph, e, modules)
            what = " + ".join(names[:MOST_MODULES]) + (f" +{len(names) - MOST_MODULES} more"
                                                        if len(names) > MOST_MODULES else "")
            when = where(graph, e, modules).removeprefix("before ")
        out.append(Pattern(what, when if when.startswith("at the end") else f"before {when}", kind, ops,
                           tuple(i for i, _ in found), tuple(sorted({b for _, b in found if b is not None}))))
    return out


def block_ranges(blocks: Sequence[int], stack: Sequence[str]) -> str:
    """``layers.0–31``, ``layers.0–3, 5, 7–9``: the blocks as runs of consecutive indices."""
    if not blocks:
        return ""
    parent = stack[blocks[0]].rpartition(".")[0]
    index = [int(stack[b].rpartition(".")[2]) for b in blocks]
    runs, start = [], index[0]
    for a, b in zip(index, index[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}–{a}")
            start = b
    return (f"{parent}." if parent else "") + ", ".join(runs)


def pattern_rows(graph: Graph, events: Sequence[RecomputeEvent], found: Sequence[Pattern]) -> list[dict]:
    """One row per pattern, for a table: what, when, which blocks, how many rebuilds, bytes and time."""
    stack = [b for b, _, _ in block_stack(graph)]
    rows = []
    for k, p in enumerate(found):
        back = [events[i].bytes for i in p.events]
        rows.append({"#": k + 1, "pass": p.kind, "when": p.when, "recompute": p.what,
                     "blocks": (f"{block_ranges(p.blocks, stack)} ({len(p.blocks)})" if p.blocks else "—"),
                     "rebuilds": len(p.events), "ops each": p.ops,
                     "brings back": format_bytes(int(sum(back))) + (f" ({format_bytes(int(max(back)))} each)"
                                                                    if len(back) > 1 else ""),
                     "time": _time(sum(events[i].cost for i in p.events))})
    return rows


def block_marks(graph: Graph, events: Sequence[RecomputeEvent], modules: Modules,
                found: Sequence[Pattern] = ()) -> list[tuple[int, int, str]]:
    """The memory chart's marks: one per run of consecutive rebuilds in the same block (a block's
    rebuilds, back to back in the backward pass), as (first rebuild, last rebuild, words); a rebuild in
    no block is a mark of its own. With the rebuilds' patterns (``found``, :func:`patterns`) the words
    start with the patterns a mark's rebuilds belong to, numbered as the table's rows."""
    pattern_of = {i: k for k, p in enumerate(found) for i in p.events}
    stack = [b for b, _, _ in block_stack(graph)]
    marks: list[list[int]] = []
    last: object = object()
    for i, e in enumerate(events):
        b = event_block(graph, e, modules, stack)
        if b is None or b != last or not marks:
            marks.append([i, i])
        else:
            marks[-1][1] = i
        last = b
    out = []
    for first, final in marks:
        b = event_block(graph, events[first], modules, stack)
        words = (event_line(graph, events[first], modules) if first == final else
                 f"{final - first + 1} rebuilds in {stack[b]}: "
                 + " ".join(event_line(graph, events[i], modules) for i in range(first, final + 1)))
        numbers = sorted({pattern_of[i] + 1 for i in range(first, final + 1) if i in pattern_of})
        if numbers:
            words = f"pattern{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}: {words}"
        out.append((first, final, words))
    return out
