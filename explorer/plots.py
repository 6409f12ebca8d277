"""Plotly figures, the memory chart's Vega-Lite spec and the layouts behind them: pure functions of a
graph, schedules and numbers.

No Streamlit here, so every figure can be built and checked in a test. Sizes are shown in MiB,
times in milliseconds.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from bonsai_core.graph import Graph, block_stack
from bonsai_core.units import format_bytes

MIB = 2**20
# Okabe & Ito's colour-blind-safe palette (its black left out: it vanishes on the dark theme). Hue is
# never the only channel: segments also cycle through SEGMENT_SYMBOLS (3 is coprime to 7, so neighbours
# differ in shape and a (colour, shape) pair repeats only every 21 segments), methods have a symbol each.
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
# Segments and blocks: the same without its vermillion (next to RECOMPUTE's red, a recomputed outline
# vanished on a vermillion box), its grey in that place
SEGMENT_PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#999999", "#CC79A7")
SEGMENT_SYMBOLS = ("circle", "square", "triangle-up")
METHOD_COLOURS = {"none": "#999999", "bonsai": "#009E73", "checkmate": "#0072B2", "moccasin": "#CC79A7",
                  "chen": "#E69F00", "dtr": "#D55E00", "coop": "#56B4E9"}
METHOD_SYMBOLS = {"none": "star", "bonsai": "circle", "checkmate": "square", "moccasin": "diamond",
                  "chen": "triangle-up", "dtr": "x", "coop": "cross"}
OTHER_SYMBOLS = ("pentagon", "hexagon", "triangle-down", "star-square", "hourglass")
RECOMPUTE = "#d62728"
BACKWARD = "#a9acb0"  # a mid grey: visible on the light and the dark background
# Lines drawn in the text colour of Streamlit's light and dark themes; "unknown" (the theme is not known
# yet) is a grey with at least 3:1 contrast against both backgrounds (WCAG's minimum for graphics).
FOREGROUND = {"light": "#31333F", "dark": "#FAFAFA", None: "#8C8C8C"}
FONT = dict(family="Inter, system-ui, sans-serif", size=13)


def method_colour(method: str, i: int = 0) -> str:
    return METHOD_COLOURS.get(method, PALETTE[i % len(PALETTE)])


def method_symbol(method: str, i: int = 0) -> str:
    return METHOD_SYMBOLS.get(method, OTHER_SYMBOLS[i % len(OTHER_SYMBOLS)])


def segment_style(group: int) -> tuple[str, str]:
    """(colour, marker symbol) of segment or block ``group``."""
    return SEGMENT_PALETTE[group % len(SEGMENT_PALETTE)], SEGMENT_SYMBOLS[group % len(SEGMENT_SYMBOLS)]


def segment_colours(segments: Sequence[Sequence[int]], node_paths: Sequence[str]) -> list[str]:
    """A colour per segment fixed by the module its first op ran in (``node_paths``: each node's module
    path), not by its index, so a segment keeps its colour while the budget moves the others; a segment
    that would take its predecessor's colour takes the next one."""
    colours: list[str] = []
    for members in segments:
        k = zlib.crc32(node_paths[int(members[0])].encode()) % len(SEGMENT_PALETTE) if len(members) else 0
        if colours and SEGMENT_PALETTE[k] == colours[-1]:
            k = (k + 1) % len(SEGMENT_PALETTE)
        colours.append(SEGMENT_PALETTE[k])
    return colours


LAYOUT = dict(margin=dict(l=10, r=10, t=40, b=10), font=FONT, hoverlabel=dict(font_size=12),
              legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0),
              plot_bgcolor="rgba(0,0,0,0)")


def _style(fig: go.Figure, height: int = 420) -> go.Figure:
    fig.update_layout(LAYOUT, height=height)
    return fig


# -- memory over time -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Curve:
    """One schedule's memory timeline, ready to draw."""

    label: str
    x: np.ndarray  # elapsed compute time (ms) or op index after each op
    live: np.ndarray  # bytes resident after each op
    peak: int
    peak_x: float
    colour: str
    dash: str = "solid"
    reserved: np.ndarray | None = None  # allocator-reserved bytes after each op, when known


def curve(label: str, timeline: np.ndarray, op_costs: np.ndarray, peak: int, peak_op: int, colour: str,
          x_mode: str = "time", dash: str = "solid", reserved: np.ndarray | None = None) -> Curve:
    """A curve over elapsed compute time (``x_mode="time"``: recomputation stretches it), over op
    index (``"ops"``) or over the share of the step's ops done (``"share"``, 0 to 1: steps of different
    lengths, an eager and a compiled one, side by side). O(len(ops))."""
    x = curve_x(op_costs, x_mode)
    peak_x = float(x[peak_op]) if 0 <= peak_op < len(x) else 0.0
    return Curve(label, x, np.asarray(timeline), int(peak), peak_x, colour, dash, reserved)


def curve_x(op_costs: np.ndarray, x_mode: str = "time") -> np.ndarray:
    """Each op's x on a memory chart (:func:`curve`'s ``x_mode``) from the compute time each op adds."""
    if x_mode == "time":
        return np.cumsum(op_costs) * 1e3
    x = np.arange(1, len(op_costs) + 1, dtype=float)
    return x / max(1, len(op_costs)) if x_mode == "share" else x


def _steps(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The points where a step line (``line_shape="hv"``) changes, and its last, at most the
    :func:`envelope` of a chart's columns: the same drawing from half the points or fewer (every budget
    change sends and redraws them in each browser; 7,700 change points on torchtitan's 8B step)."""
    y = np.asarray(y)
    keep = np.ones(len(y), dtype=bool)
    keep[1:-1] = y[1:-1] != y[:-2]
    x, y = np.asarray(x)[keep], y[keep]
    kept = envelope(x, y)
    return x[kept], y[kept]


COLUMNS = 1200  # a chart's width in pixels, about: more points than 4 per column draw nothing more


def envelope(x: np.ndarray, y: np.ndarray, columns: int = COLUMNS) -> np.ndarray:
    """The indices of the points that draw a step line at ``columns`` columns of x as all of them do: in
    each column its first point, its lowest, its highest and its last (so every peak and trough stays,
    exactly); all of them when there are no more than four per column."""
    n = len(y)
    if n <= 4 * columns:
        return np.arange(n)
    x = np.asarray(x, dtype=float)
    span = max(float(x[-1] - x[0]), 1e-12)
    column = np.minimum(((x - x[0]) / span * columns).astype(np.int64), columns - 1)
    starts = np.flatnonzero(np.r_[True, column[1:] != column[:-1]])
    ends = np.r_[starts[1:], n] - 1
    lows = np.minimum.reduceat(np.asarray(y), starts)
    highs = np.maximum.reduceat(np.asarray(y), starts)
    keep = np.zeros(n, dtype=bool)
    keep[starts] = keep[ends] = True
    seg = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
    keep |= (np.asarray(y) == lows[seg]) & _first_in(seg, np.asarray(y) == lows[seg])
    keep |= (np.asarray(y) == highs[seg]) & _first_in(seg, np.asarray(y) == highs[seg])
    return np.flatnonzero(keep)


def column_tops(x: np.ndarray, y: np.ndarray, columns: int) -> np.ndarray:
    """The indices of the highest point in each of ``columns`` columns of x (the first such), the first and
    the last point: a filled step area drawn from them covers, column by column, what it covers drawn from all of them
    (at that resolution a column is filled up to its highest point whatever lies under it), the peak exact;
    all of them when there is at most one per column."""
    n = len(y)
    if n <= columns:
        return np.arange(n)
    x, y = np.asarray(x, dtype=float), np.asarray(y)
    span = max(float(x[-1] - x[0]), 1e-12)
    column = np.minimum(((x - x[0]) / span * columns).astype(np.int64), columns - 1)
    starts = np.flatnonzero(np.r_[True, column[1:] != column[:-1]])
    seg = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
    highs = np.maximum.reduceat(y, starts)
    keep = (y == highs[seg]) & _first_in(seg, y == highs[seg])
    keep[0] = keep[-1] = True
    return np.flatnonzero(keep)


def _first_in(seg: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``mask`` left True only at its first True within each run of equal ``seg``."""
    hit = np.flatnonzero(mask)
    first = np.zeros(len(mask), dtype=bool)
    if len(hit):
        first[hit[np.r_[True, seg[hit][1:] != seg[hit][:-1]]]] = True
    return first


# METHOD_SYMBOLS / OTHER_SYMBOLS (Plotly's names) as Vega's built-in shapes, each still its own
VEGA_SHAPES = {"circle": "circle", "square": "square", "diamond": "diamond", "triangle-up": "triangle-up",
               "cross": "cross", "x": "triangle-left", "star": "triangle-right", "pentagon": "wedge",
               "hexagon": "arrow", "triangle-down": "triangle", "star-square": "stroke", "hourglass": "triangle-down"}


DASHES = {"dash": [6, 4], "dot": [2, 3]}
# The charts' data is finite: told so, Vega-Lite adds no validity test of each row's fields (a filter, or a
# line's "defined"), expressions that Streamlit's Vega interprets for every row on each drag
FINITE_DATA = {"mark": {"invalid": None}}


def _only(kind: str) -> list[dict]:
    """A Vega-Lite transform keeping the ``levels`` row of one kind."""
    return [{"filter": f"datum.kind === '{kind}'"}]


def _points(x: np.ndarray, mib: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"x": np.asarray(x, dtype=np.float32), "mib": np.asarray(mib, dtype=np.float32)})


def _dataset(parts: list[tuple[str, pd.DataFrame]]) -> pd.DataFrame:
    """One dataset of the chart from its curves' (label, points), compact on the wire (every drag sends it
    to each browser): no index column, 32-bit floats, the schedule's name as a category (about a quarter of
    the bytes), made from its codes (converting a column of names took most of the chart's time)."""
    names = list(dict.fromkeys(label for label, _ in parts))
    codes = [np.full(len(points), names.index(label)) for label, points in parts]
    frame = pd.concat([points for _, points in parts], ignore_index=True) if parts else _points([], [])
    return frame.assign(schedule=pd.Categorical.from_codes(np.concatenate(codes) if codes else [], names))


def _event_marks(events: Sequence[tuple[float, str, str]], top: int, curves: Sequence[Curve]) -> pd.DataFrame:
    """The recompute marks' rows: each at the top of the chart, its label blank where it would overlap
    a label placed before it (``placed_labels``, on a chart about 1100 px wide)."""
    xs = [float(ex) for ex, _, _ in events]
    right = max([float(c.x[-1]) for c in curves if len(c.x)] + xs + [1e-9])
    shown = set(placed_labels(xs, [label for _, label, _ in events], (0.0, right)))
    return pd.DataFrame([{"x": ex, "mib": 1.1 * top / MIB, "mark": label if i in shown else "", "text": words}
                         for i, (ex, label, words) in enumerate(events)], columns=["x", "mib", "mark", "text"])


# the points a pointer finds on a memory chart's lines (each column's first, lowest, highest and last): their
# Voronoi diagram is built anew on each drag
HOVER_COLUMNS = COLUMNS // 4
X_TITLES = {"time": "elapsed compute time (ms)", "ops": "schedule step (op)",
            "share": "share of the step (its ops eager, its kernels compiled)"}
X_UNITS = {"time": "ms", "ops": "op", "share": "share"}


def memory_chart(curves: Sequence[Curve], budget: int | None, lower_bound: int | None = None,
                 x_mode: str = "time", height: int = 440, cursor: float | None = None,
                 x_domain: tuple[float, float] | None = None,
                 events: Sequence[tuple[float, str, str]] = (), budget_label: str = "budget",
                 reference: Curve | None = None) -> dict:
    """Memory over time of each curve (its colour, dash and a few markers of its method's symbol), the
    budget line and each curve's peak, as a Vega-Lite spec for ``st.vega_lite_chart``.

    Everything that moves with the budget (the lines, peaks, budget and its label) is in the named
    ``datasets``; the spec around them depends only on which curves are shown and the x axis. Streamlit
    then updates a keyed chart's data in place when the budget slider moves, where a Plotly chart is
    mounted and drawn anew on every change (about half of a browser's work per drag, as measured in Chromium).
    The "hybrid" renderer draws the marks on a canvas and the text as SVG, readable in the page.
    ``cursor`` (an x value) adds a vertical rule, in a dataset of its own; ``x_domain`` spans the x axis
    over at least that range (unseen points in a dataset: a domain in the spec would change the spec, and
    so remount the chart, whenever it moves) and fixes the y axis's width, so that a chart drawn under it
    with the same range (the tensor lifetimes) lines up. ``events``: (x, label, words) of each recompute mark
    (an event, or a block's run of them), marked by a thin rule and its label (↻1, ↻2–4, ...) at the top, the
    words on hover; labels that would overlap their left neighbour are left out (the rule stays). A reserved line
    (allocator model) is labelled at its peak: a dotted line never stands without a name.
    ``budget_label`` names the budget line ("reserved-bytes bound" for a plan that bounds the
    allocator's reserved bytes: ``compute.Bound.label``). ``reference``, a curve drawn after ``curves`` that
    stays the same as the budget moves (no remat), has its line and markers in datasets of their own
    (``reference_lines``, ``reference_marks``): their bytes do not change with the budget, and Streamlit's
    chart in the browser keeps a dataset whose bytes it already has rather than loading it again."""
    lines, hovered, reserved, marks, peaks, reserved_peaks = [], [], [], [], [], []
    curves = [*curves, *([reference] if reference is not None else [])]
    for c in curves:
        x, live = _steps(c.x, c.live / MIB)
        points = _points(x, live)
        lines.append((c.label, points))
        hovered.append((c.label, points.iloc[envelope(x, live, HOVER_COLUMNS)]))
        # a few markers along each line, the method's symbol: curves differ by more than hue
        marked = np.unique(np.linspace(0, len(x) - 1, min(12, len(x))).round().astype(int))
        marks.append((c.label, points.iloc[marked]))
        if c.reserved is not None:
            reserved.append((c.label, _points(*_steps(c.x, np.asarray(c.reserved) / MIB))))
            at = int(np.argmax(c.reserved))
            reserved_peaks.append({"x": float(c.x[at]), "mib": float(c.reserved[at]) / MIB, "schedule": c.label,
                                   "text": f"{c.label} reserved {format_bytes(int(c.reserved[at]))}"})
        peaks.append({"x": c.peak_x, "mib": c.peak / MIB, "schedule": c.label, "text": f"peak {format_bytes(c.peak)}"})
    tops = [c.peak for c in curves] + [int(np.max(c.reserved)) for c in curves if c.reserved is not None]
    top = max(tops + ([budget] if budget is not None else []) + [1])
    levels = [{"mib": value / MIB, "kind": kind, "text": f"{text} {format_bytes(value)}"}
              for value, kind, text in ((budget, "budget", budget_label), (lower_bound, "lower bound", "lower bound"))
              if value is not None]
    levels.append({"mib": 1.15 * top / MIB, "kind": "top", "text": ""})

    moving = len(curves) - (reference is not None)  # the curves before the reference
    labels = [c.label for c in curves]
    x = {"field": "x", "type": "quantitative", "title": X_TITLES[x_mode]}
    y = {"field": "mib", "type": "quantitative", "title": "memory (MiB)"}
    if x_domain is not None:
        y["axis"] = {"minExtent": 48, "maxExtent": 48}
    colour = {"field": "schedule", "type": "nominal", "title": None, "legend": {"orient": "top"},
              "scale": {"domain": labels, "range": [c.colour for c in curves]}}
    shape = {"field": "schedule", "type": "nominal", "title": None, "legend": {"orient": "top"},  # merged with colour
             "scale": {"domain": labels, "range": [VEGA_SHAPES[method_symbol("none" if c.label == "no remat" else c.label, i)]
                                                   for i, c in enumerate(curves)]}}
    # a condition, not a scale: a scale would be a third legend to merge with the colour's
    dash = {"condition": [{"test": f"datum.schedule === {json.dumps(c.label)}", "value": DASHES[c.dash]}
                          for c in curves if c.dash in DASHES], "value": [1, 0]}
    line = {"encoding": {"x": x, "y": y, "color": colour, "strokeDash": dash},
            "mark": {"type": "line", "interpolate": "step-after", "strokeWidth": 2}}
    markers = {"encoding": {"x": x, "y": y, "color": colour, "shape": shape},
               "mark": {"type": "point", "filled": True, "size": 60, "opacity": 1}}
    spec = {
        "height": height,
        "usermeta": {"embedOptions": {"renderer": "hybrid"}},
        "config": FINITE_DATA,
        "datasets": {"lines": _dataset(lines[:moving]), "reference_lines": _dataset(lines[moving:]),
                     "hover": _dataset(hovered), "reserved": _dataset(reserved),
                     "marks": _dataset(marks[:moving]), "reference_marks": _dataset(marks[moving:]),
                     "peaks": pd.DataFrame(peaks, columns=["x", "mib", "schedule", "text"]), "levels": pd.DataFrame(levels),
                     "reserved_peaks": pd.DataFrame(reserved_peaks, columns=["x", "mib", "schedule", "text"]),
                     "events": _event_marks(events, top, curves)},
        "layer": [
            {"data": {"name": "reserved"}, "encoding": {"x": x, "y": y, "color": colour},
             "mark": {"type": "line", "interpolate": "step-after", "strokeWidth": 1, "strokeDash": [2, 2]}},
            {"data": {"name": "reserved_peaks"}, "encoding": {"x": x, "y": y, "color": colour, "text": {"field": "text"}},
             "mark": {"type": "text", "dy": -8, "fontSize": 12, "fontStyle": "italic"}},
            # recompute events: a thin rule at each and its number on top (the words on hover)
            {"data": {"name": "events"}, "encoding": {"x": x, "tooltip": {"field": "text"}},
             "mark": {"type": "rule", "color": RECOMPUTE, "strokeWidth": 1, "opacity": 0.5, "strokeDash": [3, 3]}},
            {"data": {"name": "events"}, "encoding": {"x": x, "y": y, "text": {"field": "mark"}, "tooltip": {"field": "text"}},
             "mark": {"type": "text", "color": RECOMPUTE, "fontSize": 12, "fontWeight": 600, "baseline": "bottom"}},
            {**line, "data": {"name": "reference_lines"}},
            {**line, "data": {"name": "lines"},
             "params": [{"name": "zoom", "select": {"type": "interval", "encodings": ["x"]}, "bind": "scales"}]},
            {**markers, "data": {"name": "reference_marks"}},
            {**markers, "data": {"name": "marks"}},
            # the point of a line nearest the pointer, with its value
            {"data": {"name": "hover"}, "mark": {"type": "point", "filled": True, "size": 70},
             "params": [{"name": "hover", "select": {"type": "point", "on": "pointerover", "nearest": True,
                                                     "clear": "pointerout"}}],
             "encoding": {"x": x, "y": y, "color": colour,
                          "opacity": {"condition": {"param": "hover", "empty": False, "value": 1}, "value": 0},
                          "tooltip": [{"field": "schedule", "title": "schedule"},
                                      {"field": "mib", "title": "MiB", "format": ".2f"},
                                      {"field": "x", "title": X_UNITS[x_mode], "format": ".4~f"}]}},
            {"data": {"name": "peaks"}, "encoding": {"x": x, "y": y, "color": colour, "tooltip": {"field": "text"}},
             "mark": {"type": "point", "shape": "triangle-down", "filled": True, "size": 110, "opacity": 1,
                      "stroke": "white", "strokeWidth": 1}},
            {"data": {"name": "peaks"}, "encoding": {"x": x, "y": y, "color": colour, "text": {"field": "text"}},
             "mark": {"type": "text", "dy": -12, "fontSize": 11}},
            # unseen: takes the y scale up to the "top" level, room above the peaks for their labels
            {"data": {"name": "levels"}, "encoding": {"y": y}, "mark": {"type": "point", "opacity": 0}},
            {"data": {"name": "levels"}, "transform": _only("budget"), "encoding": {"y": y},
             "mark": {"type": "rule", "color": RECOMPUTE, "strokeWidth": 2, "strokeDash": [6, 4]}},
            {"data": {"name": "levels"}, "transform": _only("budget"), "encoding": {"y": y, "text": {"field": "text"}},
             "mark": {"type": "text", "color": RECOMPUTE, "align": "left", "baseline": "bottom", "x": 4, "dy": -3}},
            {"data": {"name": "levels"}, "transform": _only("lower bound"), "encoding": {"y": y},
             "mark": {"type": "rule", "color": "#999", "strokeWidth": 1, "strokeDash": [2, 2]}},
            {"data": {"name": "levels"}, "transform": _only("lower bound"),
             "encoding": {"y": y, "text": {"field": "text"}},
             "mark": {"type": "text", "color": "#888", "align": "right", "baseline": "top", "x": {"expr": "width - 4"},
                      "dy": 3}},
        ],
    }
    if cursor is not None:
        spec["datasets"]["cursor"] = pd.DataFrame({"x": [float(cursor)]})
        spec["layer"].append({"data": {"name": "cursor"}, "encoding": {"x": x},
                              "mark": {"type": "rule", "strokeWidth": 2, "color": "#888"}})
    if x_domain is not None:
        spec["datasets"]["extent"] = pd.DataFrame({"x": [float(v) for v in x_domain]})
        spec["layer"].append({"data": {"name": "extent"}, "encoding": {"x": x}, "mark": {"type": "point", "opacity": 0}})
    return spec


# -- the operator graph ----------------------------------------------------------------------------

def layers(graph: Graph, nodes: np.ndarray | None = None) -> np.ndarray:
    """int64[len(nodes)]: longest-path depth of each node within the induced subgraph, with every
    backward node placed after every forward one (so the two passes read as two bands). O(n + edges)."""
    nodes = np.arange(graph.n) if nodes is None else np.asarray(nodes)
    index = {int(v): i for i, v in enumerate(nodes)}
    depth = np.zeros(len(nodes), dtype=np.int64)
    for i, v in enumerate(nodes.tolist()):  # ids are a topological order
        ds = [index[d] for d in graph.deps(v).tolist() if d in index]
        if ds:
            depth[i] = depth[ds].max() + 1
    fwd = graph.is_forward[nodes]
    if fwd.any() and (~fwd).any():
        depth[~fwd] = np.maximum(depth[~fwd], depth[fwd].max() + 1)
    return depth


def layered_layout(graph: Graph, nodes: np.ndarray | None = None) -> np.ndarray:
    """float[len(nodes), 2]: a layered DAG layout. The forward pass runs left to right along the
    top band and the backward pass right to left along the bottom band, so each activation sits
    above the backward ops that read it. Within a layer, nodes are spaced evenly in their order,
    centred on the layer (as networkx's ``multipartite_layout`` places them). O(n + edges)."""
    nodes = np.arange(graph.n) if nodes is None else np.asarray(nodes)
    depth = layers(graph, nodes)
    if len(nodes) == 1:
        return np.zeros((1, 2))
    xy = np.column_stack([depth, _centred_ranks(depth)]).astype(float)
    fwd = graph.is_forward[nodes]
    y = np.zeros(len(nodes))
    for band in (fwd, ~fwd):  # spread each pass over its own band, whatever the other's width
        if band.any():
            yb = xy[band, 1]
            y[band] = (yb - yb.min()) / max(float(np.ptp(yb)), 1e-9) if np.ptp(yb) > 0 else 0.5
    out = np.zeros((len(nodes), 2))
    if fwd.all() or (~fwd).all():
        out[:, 0], out[:, 1] = depth, y
        return out
    f_max = max(int(depth[fwd].max()), 1)
    b_min, b_max = int(depth[~fwd].min()), int(depth[~fwd].max())
    out[fwd, 0] = depth[fwd]
    out[fwd, 1] = 0.25 + 0.75 * y[fwd]
    # mirror the backward pass onto the same width, loss end on the right
    out[~fwd, 0] = f_max - (depth[~fwd] - b_min) * (f_max / max(b_max - b_min, 1))
    out[~fwd, 1] = -0.25 - 0.75 * y[~fwd]
    return out


def _centred_ranks(layer: np.ndarray) -> np.ndarray:
    """float[len(layer)]: each item's position among the items of its layer (in order), less the
    layer's middle position."""
    layer = np.asarray(layer, dtype=np.int64)
    counts = np.bincount(layer)
    order = np.argsort(layer, kind="stable")
    ranks = np.empty(len(layer))
    ranks[order] = np.arange(len(layer)) - (np.cumsum(counts) - counts)[layer[order]]
    return ranks - (counts[layer] - 1) / 2


def _hover(graph: Graph, v: int, group: str, recomputed: bool) -> str:
    return (f"<b>{graph.names[v]}</b> (#{v})<br>{graph.ops[v]}<br>{graph.shapes[v] or '—'}<br>"
            f"{format_bytes(int(graph.mem[v]))} · {graph.cost[v] * 1e6:.2f} µs<br>{graph.phases[v]} · {group}"
            + ("<br><b>recomputed</b>" if recomputed else ""))


def graph_figure(graph: Graph, nodes: np.ndarray, pos: np.ndarray, group: np.ndarray, group_names: Sequence[str],
                 recomputed: np.ndarray, context: np.ndarray | None = None, height: int = 560) -> go.Figure:
    """The operator graph: forward ops (circles) coloured by segment, backward ops (diamonds) grey,
    recomputed ops ringed in red; edges between the drawn nodes. ``group[i]`` is node ``nodes[i]``'s
    segment or block index (-1 for none), ``context`` marks nodes drawn faded (a drill-down's
    neighbours)."""
    nodes = np.asarray(nodes)
    where = {int(v): i for i, v in enumerate(nodes)}
    ex, ey = [], []
    for i, v in enumerate(nodes.tolist()):
        for d in graph.deps(v).tolist():
            j = where.get(d)
            if j is not None:
                ex += [pos[j, 0], pos[i, 0], None]
                ey += [pos[j, 1], pos[i, 1], None]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="rgba(120,120,120,0.25)", width=1),
                               hoverinfo="skip", showlegend=False))
    fwd = graph.is_forward[nodes]
    context = np.zeros(len(nodes), dtype=bool) if context is None else np.asarray(context)
    styles = [segment_style(g) if (f and g >= 0) else (BACKWARD, "diamond") for g, f in zip(group, fwd)]
    colours = np.array([c for c, _ in styles])
    symbols = np.array([m for _, m in styles])
    sizes = 6 + 10 * np.sqrt(graph.mem[nodes] / max(int(graph.mem.max()), 1))
    for mask, name in ((fwd, "forward op"), (~fwd, "backward op")):
        idx = np.flatnonzero(mask)
        if not len(idx):
            continue
        symbol = symbols[idx].tolist()
        hover = [_hover(graph, int(nodes[i]), group_names[group[i]] if group[i] >= 0 else "—", bool(recomputed[i]))
                 for i in idx]
        fig.add_trace(go.Scatter(
            x=pos[idx, 0], y=pos[idx, 1], mode="markers", name=name, text=hover, hoverinfo="text",
            marker=dict(color=colours[idx].tolist(), size=sizes[idx], symbol=symbol,
                        opacity=np.where(context[idx], 0.35, 1.0).tolist(),
                        line=dict(color=[RECOMPUTE if r else "white" for r in recomputed[idx]],
                                  width=[3 if r else 0.5 for r in recomputed[idx]]))))
    if recomputed.any():
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="recomputed",
                                   marker=dict(color="white", size=10, line=dict(color=RECOMPUTE, width=3))))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _style(fig, height)


@dataclass(frozen=True)
class Groups:
    """A partition of the nodes for the collapsed view: segments of the forward pass (or blocks of
    consecutive ops when the schedule has none) and blocks of the backward pass."""

    of: np.ndarray  # int64[n], group index of each node
    names: tuple[str, ...]
    recomputed: np.ndarray  # bool[number of groups]
    forward: np.ndarray  # bool[number of groups]


def node_groups(graph: Graph, segments: Sequence[Sequence[int]] | None, recomputed: Sequence[int] = (),
                block: int = 16) -> Groups:
    """Segments from a schedule's ``extra`` when given, else blocks of ``block`` consecutive forward
    ops; the backward pass in blocks of ``block`` consecutive ops. O(n)."""
    of = np.full(graph.n, -1, dtype=np.int64)
    names: list[str] = []
    rec: list[bool] = []
    fwd: list[bool] = []
    recomputed = set(int(i) for i in recomputed)
    if segments:
        for i, members in enumerate(segments):
            of[list(members)] = len(names)
            names.append(f"segment {i}")
            rec.append(i in recomputed)
            fwd.append(True)
    for phase_forward in (True, False):
        todo = np.flatnonzero((graph.is_forward == phase_forward) & (of < 0))
        for k in range(0, len(todo), block):
            of[todo[k:k + block]] = len(names)
            names.append(f"{'forward' if phase_forward else 'backward'} ops {todo[k]}–{todo[min(k + block, len(todo)) - 1]}")
            rec.append(False)
            fwd.append(phase_forward)
    return Groups(of, tuple(names), np.array(rec, dtype=bool), np.array(fwd, dtype=bool))


def group_centres(groups: Groups, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each group's marker: its members' mean position."""
    k = len(groups.names)
    safe = np.maximum(np.bincount(groups.of, minlength=k), 1)
    return (np.bincount(groups.of, weights=pos[:, 0], minlength=k) / safe,
            np.bincount(groups.of, weights=pos[:, 1], minlength=k) / safe)


def collapsed_sizes(graph: Graph, groups: Groups) -> np.ndarray:
    """Each group's marker size in px: its area grows with the group's bytes."""
    mem = np.bincount(groups.of, weights=graph.mem.astype(float), minlength=len(groups.names))
    return 10 + 30 * np.sqrt(mem / max(mem.max(), 1))


def collapsed_figure(graph: Graph, groups: Groups, pos: np.ndarray, recomputed_nodes: np.ndarray,
                     height: int = 560) -> go.Figure:
    """One marker per group at its members' mean position (area ~ its bytes), edges between groups
    that exchange tensors. O(n + edges)."""
    k = len(groups.names)
    count = np.bincount(groups.of, minlength=k)
    cx, cy = group_centres(groups, pos)
    mem = np.bincount(groups.of, weights=graph.mem.astype(float), minlength=k)
    cost = np.bincount(groups.of, weights=graph.cost, minlength=k)
    size = collapsed_sizes(graph, groups)
    rec_ops = np.bincount(groups.of, weights=recomputed_nodes.astype(float), minlength=k)
    src = np.repeat(np.arange(graph.n), np.diff(graph.dep_ptr))
    a, b = groups.of[graph.dep_idx], groups.of[src]
    pairs = {(int(x), int(y)) for x, y in zip(a, b) if x != y}
    ex, ey = [], []
    for x, y in pairs:
        ex += [cx[x], cx[y], None]
        ey += [cy[x], cy[y], None]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="rgba(120,120,120,0.3)", width=1),
                             hoverinfo="skip", showlegend=False))
    styles = [segment_style(i) if f else (BACKWARD, "diamond") for i, f in enumerate(groups.forward)]
    hover = [f"<b>{groups.names[i]}</b><br>{count[i]} ops · {format_bytes(mem[i])} · {cost[i] * 1e3:.3f} ms"
             + (f"<br><b>recomputed</b> ({int(rec_ops[i])} ops rebuilt)" if groups.recomputed[i] or rec_ops[i] else "")
             for i in range(k)]
    ring = groups.recomputed | (rec_ops > 0)
    fig.add_trace(go.Scatter(
        x=cx, y=cy, mode="markers", text=hover, hoverinfo="text", showlegend=False,
        marker=dict(color=[c for c, _ in styles], size=size, symbol=[m for _, m in styles],
                    line=dict(color=[RECOMPUTE if r else "white" for r in ring], width=[4 if r else 1 for r in ring]))))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _style(fig, height)


LABEL_PX = 12  # the smallest label a projector shows legibly
CHAR_PX = 7.2  # a 12 px label's average character width


def placed_labels(x: Sequence[float], texts: Sequence[str], x_range: tuple[float, float],
                  width_px: float = 1100.0) -> list[int]:
    """The labels (indices) that fit side by side, left to right, on a chart ``width_px`` wide over
    ``x_range``: each kept one starts after the last kept one ends (a label centred on its x)."""
    per_px = max(x_range[1] - x_range[0], 1e-9) / width_px
    kept, right = [], -math.inf
    for i in np.argsort(np.asarray(x, dtype=float), kind="stable").tolist():
        half = (len(texts[i]) * CHAR_PX / 2 + 6) * per_px
        if x[i] - half >= right:
            kept.append(i)
            right = x[i] + half
    return kept


# -- labels of the op-level views: blocks, their parts, the largest ops' kinds ---------------------

LABEL_ROW = 0.13  # data units between rows of labels: about 22 px on a 560 px figure over LABEL_Y
LABEL_Y = (-1.5, 1.5)  # the op-level views' y range: the layout's bands (-1 to 1) and rows of labels around them
LABEL_WIDTH_PX = 900.0  # the narrowest plot the views are drawn in (a 1280 px window with the sidebar open)
LABEL_HEIGHT_PX = 500.0  # their plot area (560 px less the margins)


@dataclass(frozen=True)
class Label:
    """A text to draw centred at (x, y); the higher the priority, the earlier it claims its place."""

    x: float
    y: float
    text: str
    priority: float


def fit_labels(labels: Sequence[Label], x_range: tuple[float, float], y_range: tuple[float, float] = LABEL_Y,
               width_px: float = LABEL_WIDTH_PX, height_px: float = LABEL_HEIGHT_PX,
               markers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> list[Label]:
    """The labels kept, highest priority first: each one whose box (its 12 px text, centred on its point, on a
    plot ``width_px`` by ``height_px``) stays inside the plot and overlaps no box kept before it, nor a
    marker of ``markers`` (x, y, size in px). O(k² + k · markers)."""
    sx = width_px / max(x_range[1] - x_range[0], 1e-9)
    sy = height_px / max(y_range[1] - y_range[0], 1e-9)
    if markers is not None:
        mx, my, ms = ((np.asarray(markers[0], dtype=float) - x_range[0]) * sx,
                      (np.asarray(markers[1], dtype=float) - y_range[0]) * sy, np.asarray(markers[2], dtype=float) / 2)
    kept, boxes = [], []
    for label in sorted(labels, key=lambda lb: -lb.priority):
        half_w, half_h = (len(label.text) * CHAR_PX + 8) / 2, (LABEL_PX + 6) / 2
        cx, cy = (label.x - x_range[0]) * sx, (label.y - y_range[0]) * sy
        box = (cx - half_w, cy - half_h, cx + half_w, cy + half_h)
        if box[0] < 0 or box[2] > width_px or box[1] < 0 or box[3] > height_px:
            continue
        if any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes):
            continue
        if markers is not None and np.any((mx - ms < box[2]) & (box[0] < mx + ms) & (my - ms < box[3]) & (box[1] < my + ms)):
            continue
        kept.append(label)
        boxes.append(box)
    return kept


def _part(graph: Graph, v: int, path: str, group: str, stacked: set[str]) -> str:
    """A node's part of its block of the stack (``stacked``): the call one level below the block (``attn``,
    ``ln1``), or the op it runs between those calls (``gelu``, ``add``); "" for a node outside the stack's
    blocks (its block row names it), a view or a multi-output op's part."""
    from explorer.module_graph import op_name

    if group not in stacked or graph.alias_of[v] >= 0 or graph.output_of[v] >= 0:
        return ""
    if path == group or not path.startswith(group + "."):
        return op_name(graph.ops[v])
    return path[len(group) + 1:].split(".")[0]


def _runs(keys: Sequence[str]) -> list[tuple[int, int, str]]:
    """(start, end, key) of each run of equal consecutive keys ("" left out)."""
    runs, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            if keys[start]:
                runs.append((start, i, keys[start]))
            start = i
    return runs


def op_labels(graph: Graph, nodes: np.ndarray, pos: np.ndarray, paths: Sequence[str], groups: Sequence[str],
              largest: int = 40) -> list[Label]:
    """What the op-level views label, without a hover: above the forward band each block (a run of
    forward ops of one group: ``blocks.0``, ``head``) and under it each of its parts (``ln1``, ``attn``,
    ``gelu``); the kind of the ``largest`` ops (by bytes), under each (a backward op's under the backward band).
    ``paths``/``groups``: each node's
    module and block (``explorer.timeline.node_modules``)."""
    from explorer.module_graph import op_name

    nodes = np.asarray(nodes)
    stacked = {b for b, _, _ in block_stack(graph)}
    fwd = np.flatnonzero(graph.is_forward[nodes] & (graph.alias_of[nodes] < 0) & (graph.output_of[nodes] < 0))
    top = float(pos[fwd, 1].max()) if len(fwd) else 0.0
    labels = []
    for row, key, base in ((2, lambda v: groups[v], 1000.0),
                           (1, lambda v: _part(graph, v, paths[v], groups[v], stacked), 100.0)):
        keys = [key(int(nodes[i])) for i in fwd]
        for a, b, text in _runs(keys):
            members = fwd[a:b]
            labels.append(Label(float(pos[members, 0].mean()), top + row * LABEL_ROW, text, base + b - a))
    mem = graph.mem[nodes].astype(float)
    biggest = np.argsort(-mem, kind="stable")[:largest]
    scale = max(float(mem.max()), 1.0) if len(mem) else 1.0
    backward = ~graph.is_forward[nodes]
    bottom = float(pos[backward, 1].min()) if backward.any() else 0.0
    for i in biggest.tolist():
        if mem[i] > 0:  # a forward op's kind under it; a backward op's under the backward band, clear of its diamonds
            y = bottom - 0.7 * LABEL_ROW if backward[i] else float(pos[i, 1]) - 0.6 * LABEL_ROW
            labels.append(Label(float(pos[i, 0]), y, op_name(graph.ops[int(nodes[i])]), mem[i] / scale))
    return labels


def collapsed_labels(graph: Graph, groups: Groups, pos: np.ndarray, paths: Sequence[str],
                     blocks: Sequence[str]) -> list[Label]:
    """The collapsed view's labels: each block above the forward markers, each segment (or forward block
    of ops) by the parts of the model it spans (``attn + ln2``), each backward marker by its largest op's kind."""
    from explorer.module_graph import op_name

    cx, cy = group_centres(groups, pos)
    stacked = {b for b, _, _ in block_stack(graph)}
    top = float(cy[groups.forward].max()) if groups.forward.any() else 0.0
    labels = [Label(float(np.mean([cx[k] for k in ks])), top + 3 * LABEL_ROW, text, 1000.0 + len(ks))
              for text, ks in _block_runs(graph, groups, blocks)]
    # clear of its marker: half its size and a label's half height, in y units
    clear = (collapsed_sizes(graph, groups) / 2 + LABEL_PX) * (LABEL_Y[1] - LABEL_Y[0]) / LABEL_HEIGHT_PX
    for k in range(len(groups.names)):
        members = np.flatnonzero(groups.of == k)
        if not len(members):
            continue
        if groups.forward[k]:
            parts = list(dict.fromkeys(p for v in members.tolist() if graph.alias_of[v] < 0 and graph.output_of[v] < 0
                                       for p in [_part(graph, v, paths[v], blocks[v], stacked) or blocks[v]]
                                       if p not in ("", "forward", "backward")))
            text = " + ".join(parts[:2]) + (f" +{len(parts) - 2}" if len(parts) > 2 else "")
            labels.append(Label(float(cx[k]), float(cy[k]) + clear[k], text, 100.0 + len(members)))
        else:
            v = int(members[np.argmax(graph.mem[members])])
            labels.append(Label(float(cx[k]), float(cy[k]) - clear[k], op_name(graph.ops[v]),
                                float(graph.mem[members].sum()) / max(float(graph.mem.sum()), 1.0)))
    return labels


def _block_runs(graph: Graph, groups: Groups, blocks: Sequence[str]) -> list[tuple[str, list[int]]]:
    """(block, its forward groups) for each run of forward groups whose first op is in the same block."""
    runs: list[tuple[str, list[int]]] = []
    for k in np.flatnonzero(groups.forward).tolist():
        members = np.flatnonzero(groups.of == k)
        if not len(members):
            continue
        block = blocks[int(members[0])]
        if runs and runs[-1][0] == block:
            runs[-1][1].append(k)
        elif block:
            runs.append((block, [k]))
    return runs


def draw_labels(fig: go.Figure, labels: Sequence[Label], x_range: tuple[float, float],
                markers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> go.Figure:
    """The labels that fit (:func:`fit_labels`, clear of ``markers``) as one text trace, "labels", 12 px,
    horizontal; the figure's axes fixed to the ranges they were fitted in."""
    keep = fit_labels(labels, x_range, markers=markers)
    fig.update_xaxes(range=list(x_range))
    fig.update_yaxes(range=list(LABEL_Y))
    if keep:
        fig.add_trace(go.Scatter(x=[lb.x for lb in keep], y=[lb.y for lb in keep], mode="text",
                                 text=[lb.text for lb in keep], textposition="middle center",
                                 textfont=dict(size=LABEL_PX), hoverinfo="skip", showlegend=False, name="labels"))
    return fig


def padded(values: np.ndarray, share: float = 0.03) -> tuple[float, float]:
    lo, hi = float(np.min(values)), float(np.max(values))
    pad = max((hi - lo) * share, 0.5)
    return lo - pad, hi + pad


# -- comparisons -----------------------------------------------------------------------------------

def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, overhead) points no other point beats on both, sorted by memory. O(p log p)."""
    front: list[tuple[float, float]] = []
    for mem, over in sorted(points):
        if not front or over < front[-1][1]:
            front.append((mem, over))
    return front


def sweep_figure(rows: Sequence[dict], reference: int, height: int = 420, theme: str | None = None) -> go.Figure:
    """Overhead against the peak each method reached, per method (colour and marker symbol), over a
    budget sweep, with the Pareto front over all of them in the theme's text colour (``theme``: "light",
    "dark" or None when unknown). ``rows``: dicts with method, budget, peak, overhead (feasible)."""
    fig = go.Figure()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for i, m in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["budget"])
        fig.add_trace(go.Scatter(
            x=[100 * r["peak"] / reference for r in mine], y=[100 * r["overhead"] for r in mine], name=m,
            mode="lines+markers", line=dict(color=method_colour(m, i), width=2),
            marker=dict(symbol=method_symbol(m, i), size=9),
            customdata=[[100 * r["budget"] / reference, format_bytes(r["peak"])] for r in mine],
            hovertemplate="budget %{customdata[0]:.0f}% · peak %{customdata[1]}<br>overhead %{y:.2f}%<extra>"
                          + m + "</extra>"))
    front = pareto_front([(100 * r["peak"] / reference, 100 * r["overhead"]) for r in rows])
    if front:
        fig.add_trace(go.Scatter(x=[p[0] for p in front], y=[p[1] for p in front], name="Pareto front",
                                 mode="lines", line=dict(color=FOREGROUND.get(theme, FOREGROUND[None]), width=2, dash="dot"),
                                 line_shape="hv"))
    fig.update_xaxes(title="peak memory (% of the no-remat peak)")
    fig.update_yaxes(title="compute overhead (%)", rangemode="tozero")
    return _style(fig, height)


def granularity_figure(rows: Sequence[dict], height: int = 380) -> go.Figure:
    """Solve time and decision variables against granularity, per method."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("solve time (s)", "decision variables"))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for i, m in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["granularity"])
        colour = method_colour(m, i)
        marker = dict(symbol=method_symbol(m, i), size=9)
        fig.add_trace(go.Scatter(x=[r["granularity"] for r in mine], y=[r["solve_seconds"] for r in mine], name=m,
                                 mode="lines+markers", line=dict(color=colour), marker=marker), row=1, col=1)
        fig.add_trace(go.Scatter(x=[r["granularity"] for r in mine], y=[r["variables"] for r in mine], name=m,
                                 mode="lines+markers", line=dict(color=colour), marker=marker, showlegend=False),
                      row=1, col=2)
    fig.update_xaxes(title="granularity (max ops per segment)")
    return _style(fig, height)


# -- the address space at one moment -----------------------------------------------------------------

ADDRESS_COLOURS = {"param": "#4C78A8", "buffer": "#72B7B2", "constant": "#72B7B2", "grad": "#B279A2",
                   "optimizer": "#9D755D", "batch": "#EECA3B", "fsdp": "#54A24B", "activation": "#F58518",
                   "free": "#E8E8E8"}
ADDRESS_LABELS = {"param": "parameters (pinned)", "buffer": "buffers (pinned)", "constant": "constants (pinned)",
                  "grad": "gradients (pinned)", "optimizer": "optimizer state (pinned)", "batch": "batch (pinned)",
                  "fsdp": "FSDP2's unsharded parameters and collective buffers", "activation": "activations (evictable)",
                  "free": "free"}


def address_figure(blocks: Sequence, title: str = "", height: int = 260) -> go.Figure:
    """The allocator's address space at one moment: one horizontal bar per segment, each block an
    address range coloured by what holds it (pinned fixed tensors, evictable activations, free).
    ``blocks`` are :class:`bonsai_core.allocator.Placed` (addr, size, kind, name, segment). O(blocks)."""
    fig = go.Figure()
    segments = sorted({b.segment for b in blocks})
    row = {s: f"segment {i}" for i, s in enumerate(segments)}
    for kind, label in ADDRESS_LABELS.items():
        mine = [b for b in blocks if b.kind == kind]
        if not mine:
            continue
        fig.add_trace(go.Bar(
            name=label, orientation="h", y=[row[b.segment] for b in mine], x=[b.size / MIB for b in mine],
            base=[b.addr / MIB for b in mine],
            marker=dict(color=ADDRESS_COLOURS[kind], line=dict(color="white", width=0.5)),
            customdata=[[b.name, format_bytes(b.size), b.addr / MIB] for b in mine],
            hovertemplate="%{customdata[0]}<br>%{customdata[1]} at %{customdata[2]:.2f} MiB<extra>" + label
                          + "</extra>"))
    fig.update_layout(barmode="overlay", title=title or None, bargap=0.3)
    fig.update_xaxes(title="address (MiB from the pool's start)")
    fig.update_yaxes(autorange="reversed")
    return _style(fig, height)


def fit_figure(attempts: Sequence[dict], vary: str, max_overhead: float, height: int = 380) -> go.Figure:
    """Overhead against the searched size per method (``bonsai_core.fit.Attempt.row()`` dicts): a
    line through the sizes a method fits, grey crosses where it does not, the overhead limit dashed."""
    fig = go.Figure()
    methods = list(dict.fromkeys(a["method"] for a in attempts))
    for i, m in enumerate(methods):
        mine = sorted((a for a in attempts if a["method"] == m), key=lambda a: a["size"])
        ok = [a for a in mine if a["fits"]]
        fig.add_trace(go.Scatter(x=[a["size"] for a in ok], y=[100 * a["overhead"] for a in ok], name=m,
                                 mode="lines+markers", line=dict(color=method_colour(m, i)),
                                 marker=dict(symbol=method_symbol(m, i), size=8),
                                 hovertemplate=f"{m}: {vary} %{{x}}, overhead %{{y:.2f}}%<extra></extra>"))
        bad = [a for a in mine if not a["fits"]]
        if bad:
            fig.add_trace(go.Scatter(x=[a["size"] for a in bad], y=[100 * max_overhead] * len(bad),
                                     name=f"{m}: does not fit", mode="markers", showlegend=False,
                                     marker=dict(symbol="x-thin", size=9, line=dict(width=2, color=method_colour(m, i))),
                                     text=[a["reason"] for a in bad],
                                     hovertemplate=f"{m}: {vary} %{{x}} does not fit: %{{text}}<extra></extra>"))
    fig.add_hline(y=100 * max_overhead, line_dash="dash", line_color="#8C8C8C",
                  annotation_text=f"overhead limit {max_overhead:.0%}", annotation_position="top left")
    fig.update_xaxes(title=vary, type="log", dtick=np.log10(2))
    fig.update_yaxes(title="recompute overhead (%)", rangemode="tozero")
    return _style(fig, height)
