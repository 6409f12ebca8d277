"""The module graph as a Vega-Lite chart: boxes, frames, edges, labels (``explorer/module_graph.py``
computes them; this only draws).

Vega-Lite rather than Plotly: it draws a thousand rectangles on a canvas quickly, a click on any point
of a box selects it (Streamlit returns the selection), and each label is clipped to its box's width as
the chart is zoomed. Pure: the spec is a dict, checked in tests without a browser.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bonsai_core.units import format_bytes
from explorer.module_graph import BoxLayout, Boxes, BoxStats
from explorer.plots import FOREGROUND, RECOMPUTE, SEGMENT_PALETTE

BOX_WIDTH = 0.84  # of a column
BOX_HEIGHT = 1.0  # rows (the layout's unit)
BAND_GAP = 0.5  # rows between the forward band and the mirrored backward band
ROW_PX = 96  # a row's height in pixels (a box is one row tall), within the chart's height limits
NEUTRAL = "#C5CAD3"  # a box outside the model's block stack, with no segment to colour it by
SELECTION = "pick"  # the name of the click selection (Streamlit returns it under this name)


def short_time(seconds: float) -> str:
    """``1.2 s``, ``3.45 ms``, ``12.3 µs``."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def text_colour(fill: str) -> str:
    """Black or white, whichever reads better on ``fill`` (a #RRGGBB colour)."""
    r, g, b = (int(fill[i:i + 2], 16) / 255 for i in (1, 3, 5))
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#111111" if lum > 0.45 else "#FFFFFF"


def label_px(text: str) -> int:
    """About how wide a 12 px bold label is drawn, with the box's padding."""
    return int(7.2 * len(text)) + 6


def box_fills(boxes: Boxes, stats: BoxStats, blocks: list[str], segment_colours: list[str] | None = None) -> list[str]:
    """Each box's colour: its segment's (most of its forward ops; ``segment_colours``, one per segment,
    else by index), or, without segments, its block's in the model's block stack (``blocks``: their
    paths), else a neutral grey."""
    fills = []
    for k in range(boxes.count):
        if stats.segment[k] >= 0:
            s = int(stats.segment[k])
            fills.append(segment_colours[s] if segment_colours else SEGMENT_PALETTE[s % len(SEGMENT_PALETTE)])
            continue
        name = boxes.names[k]
        block = next((i for i, b in enumerate(blocks) if name == b or name.startswith((b + ".", b + ":"))), None)
        fills.append(NEUTRAL if block is None else SEGMENT_PALETTE[block % len(SEGMENT_PALETTE)])
    return fills


def _rows(boxes: Boxes, layout: BoxLayout, stats: BoxStats, fills: list[str], mirror: float,
          lit: frozenset[int] = frozenset()) -> pd.DataFrame:
    """One row per box and pass: its rectangle, colours, labels and hover numbers."""
    rows = []
    for k in range(boxes.count):
        x, y = float(layout.x[k]), float(layout.y[k])
        recomputed = bool(stats.recomputed_ops[k])
        segs = stats.segments[k]
        segment = ("—" if not segs else f"segment {segs[0]}" if len(segs) == 1
                   else f"segments {segs[0]}–{segs[-1]}")
        common = {
            "box": k, "name": boxes.names[k], "x0": x - BOX_WIDTH / 2, "x1": x + BOX_WIDTH / 2, "xc": x,
            "fill": fills[k], "recomputed": recomputed, "segment": segment, "lit": k in lit,
            "stroke": RECOMPUTE if recomputed else "#8C8C8C",
            "recompute": (f"{int(stats.recomputed_ops[k])} ops, frees {format_bytes(int(stats.saved_bytes[k]))}, "
                          f"+{stats.recompute_cost[k] * 1e3:.3f} ms" if recomputed else "no"),
        }
        for part, yc, ops, nbytes, cost in (
                ("forward", y, stats.forward_ops[k], stats.forward_bytes[k], stats.forward_cost[k]),
                ("backward", mirror - y, stats.backward_ops[k], stats.backward_bytes[k], stats.backward_cost[k])):
            if part == "backward" and not ops:
                continue
            numbers = (f"↻ {format_bytes(int(stats.saved_bytes[k]), 3)} · {short_time(stats.recompute_cost[k])}"
                       if recomputed and part == "forward" else format_bytes(int(nbytes), 3))
            label = boxes.labels[k] if part == "forward" else "∇ " + boxes.labels[k]
            # a block of a long stack (layers.17) keeps its index where its name does not fit
            short = (label.rsplit(".", 1)[1] if label.rsplit(".", 1)[-1].isdigit() and "." in label else label)
            short = short.removeprefix("∇ ")  # under its forward box, in the band marked backward
            rows.append({**common, "part": part, "y0": yc - BOX_HEIGHT / 2, "y1": yc + BOX_HEIGHT / 2, "yc": yc,
                         "label": label, "short": short, "label_px": label_px(label), "short_px": label_px(short),
                         "numbers": numbers, "ops": int(ops), "bytes": format_bytes(int(nbytes)),
                         "ms": round(float(cost) * 1e3, 4),
                         "ink": text_colour(fills[k]) if part == "forward" else None})
    return pd.DataFrame(rows)


def _frames(boxes: Boxes, tree_paths: tuple[str, ...], tree_parent: np.ndarray, layout: BoxLayout) -> pd.DataFrame:
    """A frame around the forward boxes of each visible call that has visible calls inside it, padded by
    how many frames it holds, with room for its label at the top."""
    inside: dict[int, list[int]] = {c: [] for c in boxes.frames}
    for k in range(boxes.count):
        c = int(boxes.call[k]) if boxes.call[k] >= 0 else int(boxes.parent[k])
        c = int(tree_parent[c]) if boxes.call[k] >= 0 and c >= 0 else c
        while c >= 0:
            if c in inside:
                inside[c].append(k)
            c = int(tree_parent[c])
    nesting = {c: 0 for c in inside}
    for c in sorted(inside, key=lambda c: len(inside[c])):  # inner frames first
        p = int(tree_parent[c])
        while p >= 0 and p not in inside:
            p = int(tree_parent[p])
        if p >= 0:
            nesting[p] = max(nesting[p], nesting[c] + 1)
    rows = []
    for c, members in inside.items():
        if not members:
            continue
        pad = 0.1 + 0.12 * nesting[c]
        rows.append({"frame": tree_paths[c], "label": tree_paths[c], "part": "forward",
                     "x0": float(layout.x[members].min()) - BOX_WIDTH / 2 - pad,
                     "x1": float(layout.x[members].max()) + BOX_WIDTH / 2 + pad,
                     "y0": float(layout.y[members].min()) - BOX_HEIGHT / 2 - pad - 0.25,
                     "y1": float(layout.y[members].max()) + BOX_HEIGHT / 2 + pad})
    return pd.DataFrame(rows, columns=["frame", "label", "part", "x0", "x1", "y0", "y1"])


def _mirrored_frames(frames: pd.DataFrame, mirror: float) -> pd.DataFrame:
    """The forward frames and their mirror images in the backward band (unlabelled, no label room)."""
    back = frames.assign(part="backward", label="", y0=mirror - frames.y1, y1=mirror - frames.y0 - 0.25)
    return pd.concat([frames, back], ignore_index=True)


def _edges(layout: BoxLayout, mirror: float) -> pd.DataFrame:
    """Forward edges as polylines through their bends (left to right), and the backward pass's edges as
    the mirror image of the forward edge they reverse (right to left), else straight."""
    rows = []
    half = BOX_WIDTH / 2
    routes = dict(zip(layout.edges, layout.routes))
    for i, ((u, v), route) in enumerate(zip(layout.edges, layout.routes)):
        points = [(layout.x[u] + half, layout.y[u]), *(route or []), (layout.x[v] - half, layout.y[v])]
        rows += [{"edge": f"f{i}", "i": j, "x": float(px), "y": float(py), "part": "forward"}
                 for j, (px, py) in enumerate(points)]
    for i, (u, v) in enumerate(layout.backward_edges):  # the gradient flows from box u to box v
        route = routes.get((v, u))
        if route is not None:
            points = [(layout.x[v] + half, layout.y[v]), *route, (layout.x[u] - half, layout.y[u])][::-1]
        else:
            points = [(layout.x[u] - half if layout.x[u] > layout.x[v] else layout.x[u] + half, layout.y[u]),
                      (layout.x[v] + half if layout.x[u] > layout.x[v] else layout.x[v] - half, layout.y[v])]
        rows += [{"edge": f"b{i}", "i": j, "x": float(px), "y": float(mirror - py), "part": "backward"}
                 for j, (px, py) in enumerate(points)]
    frame = pd.DataFrame(rows, columns=["edge", "i", "x", "y", "part"])
    return frame.astype({"x": "float32", "y": "float32"})


def module_chart(boxes: Boxes, layout: BoxLayout, stats: BoxStats, tree_paths: tuple[str, ...],
                 tree_parent: np.ndarray, blocks: list[str], height: int | None = None,
                 theme: str | None = None, fills: list[str] | None = None, segment_colours: list[str] | None = None,
                 lit: frozenset[int] = frozenset()) -> dict:
    """The Vega-Lite spec of the module graph: forward boxes left to right on top, each box's backward
    part mirrored under it, frames around nested calls, edges through the layout's bends. Click a box to
    select it (param ``pick``, field ``name``: outlined thick); scroll to zoom, drag to pan. ``theme``
    ("light", "dark" or None) sets the colour of the labels on the backward band. ``fills`` (one colour
    per box) replaces the segment colours (the Compare page colours boxes by which of two schedules
    recomputes them). ``segment_colours``: one per segment (``plots.segment_colours``); ``lit``: the boxes
    of the recompute event under the step cursor, drawn with a thick halo."""
    frames = _frames(boxes, tree_paths, tree_parent, layout)
    lefts = [*(layout.x - BOX_WIDTH / 2), *frames.x0]
    rights = [*(layout.x + BOX_WIDTH / 2), *frames.x1]
    top = min([*(layout.y - BOX_HEIGHT / 2), *frames.y0], default=0.0) - 0.45  # room for "forward →"
    bottom = max([*(layout.y + BOX_HEIGHT / 2), *frames.y1], default=1.0)
    mirror = 2 * bottom + BAND_GAP  # a forward height y is drawn at mirror - y in the backward band
    if height is None:
        height = int(np.clip((mirror - 2 * top) * ROW_PX, 360, 1000))
    fills = box_fills(boxes, stats, blocks, segment_colours) if fills is None else list(fills)
    boxes_data = _rows(boxes, layout, stats, fills, mirror, lit)
    frames = _mirrored_frames(frames, mirror)
    edges = _edges(layout, mirror)
    left = min(lefts, default=0.0)
    bands = pd.DataFrame([{"y": top + 0.2, "x": left, "text": "forward →"},
                          {"y": mirror - top - 0.2, "x": left, "text": "← backward (gradients)"}])
    x_domain = [left - 0.1, max(rights, default=1.0) + 0.1]
    x = {"field": "x0", "type": "quantitative", "axis": None,
         "scale": {"domain": x_domain, "zero": False, "nice": False}}
    y = {"field": "y0", "type": "quantitative", "axis": None,
         "scale": {"domain": [top, mirror - top], "reverse": True, "zero": False, "nice": False}}
    col_px = "abs(scale('x', 1) - scale('x', 0))"  # a column's width in pixels, as zoomed
    row_px = "abs(scale('y', 1) - scale('y', 0))"
    # labels always horizontal (a projector's audience does not tilt its head), 12 px, cut to the box's
    # width; shown when the box has room for a few letters, else on zoom; the numbers under them
    label_shown = f"(colpx * {BOX_WIDTH} >= min(24, datum.short_px) && rowpx * {BOX_HEIGHT} >= 16)"
    shown_text = f"colpx * {BOX_WIDTH} >= datum.label_px || datum.short_px >= 24 ? datum.label : datum.short"
    numbers_shown = f"(colpx * {BOX_WIDTH} >= 44 && rowpx * {BOX_HEIGHT} >= 36)"
    tooltip = [{"field": "name", "title": "module"}, {"field": "part", "title": "pass"},
               {"field": "ops", "title": "ops"}, {"field": "bytes", "title": "output bytes"},
               {"field": "ms", "title": "compute (ms)"}, {"field": "segment", "title": "segment"},
               {"field": "recompute", "title": "recomputed"}]
    spec = {
        "height": height,
        "width": "container",
        "usermeta": {"embedOptions": {"renderer": "hybrid", "actions": False}},  # boxes on a canvas, text as SVG
        "config": {"view": {"stroke": None}},
        "datasets": {"boxes": boxes_data, "frames": frames, "edges": edges, "bands": bands},
        "params": [{"name": "colpx", "expr": col_px}, {"name": "rowpx", "expr": row_px}],
        "layer": [
            {"data": {"name": "frames"},
             "mark": {"type": "rect", "fill": "#8C8C8C", "fillOpacity": 0.06, "stroke": "#8C8C8C",
                      "strokeWidth": 1, "cornerRadius": 6},
             "encoding": {"x": x, "x2": {"field": "x1"}, "y": y, "y2": {"field": "y1"},
                          "tooltip": [{"field": "frame", "title": "module"}]}},
            {"data": {"name": "frames"}, "transform": [{"filter": "datum.label !== ''"}],
             "mark": {"type": "text", "align": "left", "baseline": "top", "dx": 4, "dy": 2, "fontSize": 12,
                      "color": "#8C8C8C", "limit": {"expr": "max(0, 6 * colpx)"},
                      "opacity": {"expr": "colpx >= 8 ? 1 : 0"}},
             "encoding": {"x": x, "y": y, "text": {"field": "label"}}},
            {"data": {"name": "edges"},
             "mark": {"type": "line", "interpolate": "monotone", "strokeWidth": 1.2, "color": "#8C8C8C",
                      "opacity": 0.7},
             "encoding": {"x": {**x, "field": "x"}, "y": {**y, "field": "y"}, "detail": {"field": "edge"},
                          "order": {"field": "i"},
                          "strokeDash": {"condition": {"test": "datum.part === 'backward'", "value": [4, 3]},
                                         "value": [1, 0]}}},
            # the boxes of the recompute event under the step cursor: a thick halo around them
            {"data": {"name": "boxes"}, "transform": [{"filter": "datum.lit"}],
             "mark": {"type": "rect", "cornerRadius": 5, "fillOpacity": 0, "strokeWidth": 7, "strokeOpacity": 0.9,
                      "stroke": FOREGROUND.get(theme, FOREGROUND[None])},
             "encoding": {"x": x, "x2": {"field": "x1"}, "y": y, "y2": {"field": "y1"}}},
            {"data": {"name": "boxes"},
             "params": [{"name": SELECTION, "select": {"type": "point", "fields": ["name"], "on": "click",
                                                        "clear": "dblclick"}},
                        {"name": "zoom", "select": {"type": "interval"}, "bind": "scales"}],
             "mark": {"type": "rect", "cornerRadius": 3, "cursor": "pointer"},
             "encoding": {"x": x, "x2": {"field": "x1"}, "y": y, "y2": {"field": "y1"},
                          "fill": {"field": "fill", "type": "nominal", "scale": None},
                          "fillOpacity": {"condition": {"test": "datum.part === 'backward'", "value": 0.45},
                                          "value": 1},
                          "stroke": {"condition": {"param": SELECTION, "empty": False,
                                                   "value": FOREGROUND.get(theme, FOREGROUND[None])},
                                     "field": "stroke", "type": "nominal", "scale": None},
                          "strokeWidth": {"condition": [{"param": SELECTION, "empty": False, "value": 4},
                                                        {"test": "datum.recomputed", "value": 3}],
                                          "value": 0.8},
                          "strokeDash": {"condition": {"test": "datum.recomputed && datum.part === 'backward'",
                                                       "value": [4, 2]}, "value": [1, 0]},
                          "tooltip": tooltip}},
            {"data": {"name": "boxes"}, "transform": [{"calculate": shown_text, "as": "shown"}],
             "mark": {"type": "text", "fontSize": 12, "fontWeight": 600, "baseline": "middle",
                      "dy": {"expr": f"{numbers_shown} ? -7 : 0"},
                      "limit": {"expr": f"max(0, colpx * {BOX_WIDTH} - 6)"}},
             "encoding": {"x": {**x, "field": "xc"}, "y": {**y, "field": "yc"}, "text": {"field": "shown"},
                          "opacity": {"condition": {"test": label_shown, "value": 1}, "value": 0},
                          "color": {"condition": {"test": "datum.ink", "field": "ink", "type": "nominal",
                                                  "scale": None}, "value": FOREGROUND.get(theme, FOREGROUND[None])},
                          "tooltip": tooltip}},
            {"data": {"name": "boxes"}, "transform": [{"filter": "datum.part === 'forward'"}],
             "mark": {"type": "text", "fontSize": 12, "baseline": "middle", "dy": 9,
                      "opacity": {"expr": f"{numbers_shown} ? 1 : 0"},
                      "limit": {"expr": f"max(0, colpx * {BOX_WIDTH} - 6)"}},
             "encoding": {"x": {**x, "field": "xc"}, "y": {**y, "field": "yc"}, "text": {"field": "numbers"},
                          "color": {"field": "ink", "type": "nominal", "scale": None}, "tooltip": tooltip}},
            # the recomputed badge, on the box's top edge: a mark of its own, not a hue
            {"data": {"name": "boxes"}, "transform": [{"filter": "datum.recomputed && datum.part === 'forward'"}],
             "mark": {"type": "text", "text": "↻", "fontSize": 16, "fontWeight": 700, "color": RECOMPUTE,
                      "baseline": "middle", "dy": -1},
             "encoding": {"x": {**x, "field": "xc"}, "y": {**y, "field": "y0"}, "tooltip": tooltip}},
            {"data": {"name": "bands"},
             "mark": {"type": "text", "align": "left", "baseline": "middle", "fontSize": 12, "color": "#8C8C8C",
                      "fontStyle": "italic"},
             "encoding": {"x": {**x, "field": "x"}, "y": {**y, "field": "y"}, "text": {"field": "text"}}},
        ],
    }
    return spec
