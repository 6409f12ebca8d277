"""One FSDP rank's memory over the step, by what holds it: the sharded state, the root unit and the
inputs, the blocks all-gathered, the gradients held until their reduce-scatter, the collective
buffers, the saved activations, the step's other tensors (transients) and, when the allocator model
replayed the schedule, the allocator's extra (reserved minus live). On a pipeline rank, the other
microbatches in flight instead of FSDP's blocks and buffers.

The parts are :mod:`bonsai_core.rank_memory`'s, named and grouped for the chart; they add up to the
simulator's timeline (plus the allocator's extra). Pure.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from bonsai_core import rank_memory
from bonsai_core.fsdp import SHARDED_KINDS
from bonsai_core.graph import Graph
from bonsai_core.schedule import SimResult
from explorer.plots import FINITE_DATA, RECOMPUTE, column_tops

SHARDED = "sharded state (1/N of parameters, gradients, optimizer)"
ROOT = "root unit unsharded, inputs"
ACTIVATIONS = "saved activations"
TRANSIENTS = "transients (gradients in flight, temporaries)"
ALLOCATOR = "allocator's extra (reserved − live)"
IN_FLIGHT = f"{rank_memory.IN_FLIGHT} (pipeline)"


def breakdown(graph: Graph, ops: Sequence[tuple[str, int]], sim: SimResult,
              reserved: np.ndarray | None = None, live: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """int64[len(ops)] per part, in the order to stack them; ``reserved`` and ``live``: the allocator
    model's replay of the same schedule (its extra is left out without them)."""
    n = len(ops)
    sharded = sum(nbytes for kind, nbytes in rank_memory.fixed_by_kind(graph).items() if kind in SHARDED_KINDS)
    parts = {SHARDED: np.full(n, sharded, dtype=np.int64), ROOT: np.full(n, graph.fixed_mem - sharded, dtype=np.int64)}
    parts.update({IN_FLIGHT if name == rank_memory.IN_FLIGHT else name: bytes_held
                  for name, bytes_held in rank_memory.working(graph, ops, sim).items()})
    parts[ACTIVATIONS], parts[TRANSIENTS] = rank_memory.tensors_held(graph, sim)
    if reserved is not None and live is not None:
        parts[ALLOCATOR] = np.maximum(np.asarray(reserved, dtype=np.int64) - np.asarray(live, dtype=np.int64), 0)
    return parts


def at_peak(parts: dict[str, np.ndarray], step: int) -> list[dict]:
    """The parts at one step, for a table."""
    from bonsai_core.units import format_bytes

    return [{"part": name, "bytes": format_bytes(int(v[step]))} for name, v in parts.items()]


COLUMNS = 600  # the stacked chart's points: its highest in each of this many columns (about 2 px each)


def frame(parts: dict[str, np.ndarray], x: np.ndarray, columns: int = COLUMNS) -> pd.DataFrame:
    """Long rows (x, part, lo, hi in MiB, i) at the points where some part changes, at most the highest of
    the stack in each of ``columns`` columns (:func:`~explorer.plots.column_tops`: the peak exact), and of
    those, for each part, only the points where its band moves (:func:`band_changes`): every point of a band
    is a polygon vertex the browser encodes again on each drag, which made this chart most of a browser's
    work per drag on torchtitan's 8B step. Each part's band is stacked here, from ``lo`` to ``hi``, in the
    order of ``parts``; ``i`` orders a part's points along its band. Stacked here, not by Vega-Lite: on the
    compute-time axis the ops that take no time (frees, views) share their x with the op before them, and
    Vega-Lite stacks every row of one x on top of each other, a part's own points included, which multiplied
    the chart's height. Compact on the wire: 32-bit floats, the part's name a category."""
    if not len(x):
        return pd.DataFrame(columns=["x", "part", "lo", "hi", "i"])
    stack = np.vstack(list(parts.values()))
    keep = np.ones(stack.shape[1], dtype=bool)
    keep[1:] = (stack[:, 1:] != stack[:, :-1]).any(axis=0)
    keep[-1] = True
    idx = np.flatnonzero(keep)
    x = np.asarray(x, dtype=float)
    idx = idx[column_tops(x[idx], stack[:, idx].sum(axis=0), columns)]
    hi = np.cumsum(stack[:, idx], axis=0) / 2**20
    lo = hi - stack[:, idx] / 2**20
    names = list(parts)
    rows = [(k, np.flatnonzero(band_changes(lo[k], hi[k]))) for k in range(len(names))]
    part = np.concatenate([np.full(len(at), k) for k, at in rows])
    at = np.concatenate([at for _, at in rows])
    return pd.DataFrame({"x": x[idx][at].astype(np.float32),
                         "part": pd.Categorical.from_codes(part, names),
                         "lo": lo[part, at].astype(np.float32), "hi": hi[part, at].astype(np.float32),
                         "i": at.astype(np.int32)})


def band_changes(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """bool[len(lo)]: the points a step-after band from ``lo`` to ``hi`` needs, drawn as all of them draw it:
    the first, the last and each where either edge moves (a constant part is two points)."""
    moved = np.ones(len(lo), dtype=bool)
    moved[1:-1] = (lo[1:-1] != lo[:-2]) | (hi[1:-1] != hi[:-2])
    return moved


COLOURS = ("#0072B2", "#56B4E9", "#E69F00", "#F0E442", "#CC79A7", "#009E73", "#999999", "#6b4c9a")


def chart(parts: dict[str, np.ndarray], x: np.ndarray, x_title: str, budget: int | None = None,
          height: int = 320) -> dict:
    """The parts stacked over the step as a Vega-Lite spec (a legend names each; the budget as a rule)."""
    names = list(parts)
    spec = {
        "height": height,
        "usermeta": {"embedOptions": {"renderer": "hybrid"}},
        "config": FINITE_DATA,
        "datasets": {"parts": frame(parts, x),
                     "budget": pd.DataFrame({"mib": [budget / 2**20] if budget is not None else []})},
        "layer": [
            {"data": {"name": "parts"},
             "mark": {"type": "area", "interpolate": "step-after", "opacity": 0.9},
             "encoding": {"x": {"field": "x", "type": "quantitative", "title": x_title},
                          "y": {"field": "hi", "type": "quantitative", "stack": None, "title": "memory per rank (MiB)"},
                          "y2": {"field": "lo"},
                          "color": {"field": "part", "type": "nominal", "title": None, "sort": names,
                                    "scale": {"domain": names, "range": list(COLOURS[:len(names)])},
                                    "legend": {"orient": "bottom", "columns": 2, "labelLimit": 400, "labelFontSize": 12}},
                          "order": {"field": "i", "type": "quantitative"},  # along the band: a vertical step at a shared x
                          # the part's name only: a band's tooltip is its first point's, whichever point is hovered
                          "tooltip": {"field": "part"}}},
            {"data": {"name": "budget"}, "mark": {"type": "rule", "color": RECOMPUTE, "strokeDash": [6, 4], "strokeWidth": 2},
             "encoding": {"y": {"field": "mib", "type": "quantitative"}}},
        ],
    }
    return spec
