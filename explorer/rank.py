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
from explorer.plots import RECOMPUTE, column_tops

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
    """Long rows (x, part, its MiB, lo, hi in MiB, i) at the points where some part changes, at most the
    highest of the stack in each of ``columns`` columns (:func:`~explorer.plots.column_tops`: the peak
    exact; every point of a band is a polygon vertex the browser rebuilds on each drag, which made this
    chart most of a browser's work per drag on torchtitan's 8B step): each part's band stacked here,
    from ``lo`` to ``hi``, in the order of ``parts``; ``i`` orders a part's points along its band.
    Stacked here, not by Vega-Lite: on the compute-time axis the ops that take no time (frees, views)
    share their x with the op before them, and Vega-Lite stacks every row of one x on top of each other,
    a part's own points included, which multiplied the chart's height. Compact on the wire: 32-bit
    floats, the part's name a category."""
    if not len(x):
        return pd.DataFrame(columns=["x", "part", "mib", "lo", "hi", "i"])
    stack = np.vstack(list(parts.values()))
    keep = np.ones(stack.shape[1], dtype=bool)
    keep[1:] = (stack[:, 1:] != stack[:, :-1]).any(axis=0)
    keep[-1] = True
    idx = np.flatnonzero(keep)
    x = np.asarray(x, dtype=float)
    idx = idx[column_tops(x[idx], stack[:, idx].sum(axis=0), columns)]
    tops = np.cumsum(stack[:, idx], axis=0) / 2**20
    names = list(parts)
    return pd.DataFrame({"x": np.tile(x[idx], len(parts)).astype(np.float32),
                         "part": pd.Categorical.from_codes(np.repeat(np.arange(len(names)), len(idx)), names),
                         "mib": (stack[:, idx] / 2**20).ravel().astype(np.float32),
                         "lo": (tops - stack[:, idx] / 2**20).ravel().astype(np.float32),
                         "hi": tops.ravel().astype(np.float32),
                         "i": np.tile(np.arange(len(idx), dtype=np.int32), len(parts))})


COLOURS = ("#0072B2", "#56B4E9", "#E69F00", "#F0E442", "#CC79A7", "#009E73", "#999999", "#6b4c9a")


def chart(parts: dict[str, np.ndarray], x: np.ndarray, x_title: str, budget: int | None = None,
          height: int = 320) -> dict:
    """The parts stacked over the step as a Vega-Lite spec (a legend names each; the budget as a rule)."""
    names = list(parts)
    spec = {
        "height": height,
        "usermeta": {"embedOptions": {"renderer": "hybrid"}},
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
                          "tooltip": [{"field": "part"}, {"field": "mib", "format": ".2f", "title": "MiB"}]}},
            {"data": {"name": "budget"}, "mark": {"type": "rule", "color": RECOMPUTE, "strokeDash": [6, 4], "strokeWidth": 2},
             "encoding": {"y": {"field": "mib", "type": "quantitative"}}},
        ],
    }
    return spec
