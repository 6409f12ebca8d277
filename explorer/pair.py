"""Two schedules side by side (Compare page): what each recomputes, module by module, and the difference.

Pure (no Streamlit): the page solves both configurations through ``compute.solve`` (validated by the
simulator) and hands the schedules here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from bonsai_core.graph import Graph
from bonsai_core.units import format_bytes
from explorer.module_graph import Boxes

NEITHER, ONLY_A, ONLY_B, BOTH = 0, 1, 2, 3
CATEGORIES = ("neither", "only A", "only B", "both")
# Okabe and Ito: blue, orange, purple for the three kinds of recomputed box; grey for the rest
CATEGORY_FILLS = ("#D9D9D9", "#0072B2", "#E69F00", "#CC79A7")


def config_options(base: Sequence[tuple[str, Any]], accepted: set[str] | None, granularity: int | None,
                   own: dict[str, Any], defaults: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The options of one side: the sidebar's generic ones (``base``: time limit, backend), its own
    granularity (None: the method's default) and its own method options, each only when it differs
    from the method's default (``defaults``) and the method takes it (``accepted``; None: any)."""
    chosen = {k: v for k, v in base if k != "granularity"}
    if granularity is not None:
        chosen["granularity"] = int(granularity)
    for name, value in own.items():
        if value is not None and value != defaults.get(name):
            chosen[name] = value
        else:
            chosen.pop(name, None)
    return tuple(sorted((k, v) for k, v in chosen.items() if accepted is None or k in accepted))


def label(method: str, options: Sequence[tuple[str, Any]], generic: Sequence[str] = ("time_limit", "backend")) -> str:
    """A configuration's name: the method and the options that set it apart (``bonsai (granularity 8)``)."""
    shown = [f"{k} {v}" for k, v in options if k not in generic]
    return method + (f" ({', '.join(shown)})" if shown else "")


def distinct_labels(a: str, b: str) -> tuple[str, str]:
    """The two sides' names, prefixed A and B (and so never equal, even for the same configuration)."""
    return f"A: {a}", f"B: {b}"


def recomputed_boxes(graph: Graph, boxes: Boxes, computed: np.ndarray) -> np.ndarray:
    """bool[boxes.count]: boxes with a forward op (not a view) that ``computed`` (times each node is
    computed, ``SimResult.times_computed``) computes more than once."""
    again = (np.asarray(computed) > 1) & graph.is_forward & ~graph.is_view
    return np.bincount(boxes.of[again], minlength=boxes.count) > 0


def categories(recomputed_a: np.ndarray, recomputed_b: np.ndarray) -> np.ndarray:
    """int[k]: per box NEITHER, ONLY_A, ONLY_B or BOTH."""
    a, b = np.asarray(recomputed_a, dtype=bool), np.asarray(recomputed_b, dtype=bool)
    return a.astype(np.int64) + 2 * b.astype(np.int64)


@dataclass(frozen=True)
class Difference:
    """The boxes (module names) each side recomputes, split by who recomputes them."""

    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    both: tuple[str, ...]

    @property
    def a(self) -> tuple[str, ...]:
        return self.only_a + self.both

    @property
    def b(self) -> tuple[str, ...]:
        return self.only_b + self.both


def difference(boxes: Boxes, kinds: np.ndarray) -> Difference:
    """The module names of each kind, in the boxes' order (forward order)."""
    names = list(boxes.names)
    pick = lambda kind: tuple(names[k] for k in np.flatnonzero(np.asarray(kinds) == kind))  # noqa: E731
    return Difference(pick(ONLY_A), pick(ONLY_B), pick(BOTH))


def fills(kinds: np.ndarray) -> list[str]:
    """Each box's colour by who recomputes it."""
    return [CATEGORY_FILLS[int(k)] for k in kinds]


@dataclass(frozen=True)
class Side:
    """What the table needs of one solved side."""

    name: str
    peak: int
    overhead: float  # fraction of the step's compute time
    recomputed_ops: int  # recomputations (simulator's count)
    regions: int | None  # recomputed checkpoint regions (bonsai, chen), None without segments
    modules: tuple[str, ...]  # boxes it recomputes


def _names(names: Sequence[str], most: int = 6) -> str:
    if not names:
        return "—"
    return ", ".join(names[:most]) + (f" +{len(names) - most}" if len(names) > most else "")


def table(a: Side, b: Side, reference: int, diff: Difference) -> list[dict[str, str]]:
    """Rows A, B and B − A: peak (bytes and % of no remat), overhead, recomputations, regions and the
    modules recomputed (the difference row: those only A, only B recomputes)."""
    rows = []
    for side in (a, b):
        rows.append({"schedule": side.name, "peak": format_bytes(side.peak),
                     "peak % of no remat": f"{100 * side.peak / reference:.1f}",
                     "overhead %": f"{100 * side.overhead:.2f}", "recomputed ops": str(side.recomputed_ops),
                     "recomputed regions": "—" if side.regions is None else str(side.regions),
                     "recomputed modules": f"{len(side.modules)}: {_names(side.modules)}"})
    dpeak = b.peak - a.peak
    sign = "+" if dpeak >= 0 else "−"
    regions = ("—" if a.regions is None or b.regions is None else f"{b.regions - a.regions:+d}")
    rows.append({"schedule": "B − A", "peak": f"{sign}{format_bytes(abs(dpeak))}",
                 "peak % of no remat": f"{100 * dpeak / reference:+.1f}",
                 "overhead %": f"{100 * (b.overhead - a.overhead):+.2f}",
                 "recomputed ops": f"{b.recomputed_ops - a.recomputed_ops:+d}", "recomputed regions": regions,
                 "recomputed modules": f"only A: {_names(diff.only_a)}; only B: {_names(diff.only_b)}; "
                                       f"both: {len(diff.both)}"})
    return rows


def verdict(a: Side, b: Side) -> str:
    """One sentence: which side peaks lower and which costs less."""
    if a.peak == b.peak:
        peak = "Both peak at the same height"
    else:
        low, high = (a, b) if a.peak < b.peak else (b, a)
        peak = f"{low.name.split(':')[0]} peaks {format_bytes(high.peak - low.peak)} lower"
    if abs(a.overhead - b.overhead) < 5e-5:
        cost = "the same recomputation overhead"
    else:
        cheap, dear = (a, b) if a.overhead < b.overhead else (b, a)
        cost = (f"{cheap.name.split(':')[0]} recomputes {100 * (dear.overhead - cheap.overhead):.2f} points "
                "of overhead less")
    return f"{peak}; {cost}."
