"""When each tensor is alive: the lifetimes of a schedule's tensors, the module that made each one,
one line per schedule step saying what happens, and why a checkpoint plan recomputes what it does.

Pure functions of a graph and a schedule (no Streamlit), so the Memory page only draws them.
The lifetimes are the simulator's own (``SimResult.residency``), so at every step the bars alive plus
``fixed_mem`` add up to the simulator's timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, block_stack, plan_schedule
from bonsai_core.schedule import RecomputeEvent, Residency, Schedule, held_bytes, recompute_events, simulate
from bonsai_core.units import format_bytes

MAX_BARS = 1500  # above this many tensor lifetimes, small tensors are grouped per module


# -- which module made each tensor ------------------------------------------------------------------

@dataclass(frozen=True)
class Modules:
    """Per node: the innermost module call that ran it (``path``), the coarser group it belongs to
    (``group``: its block in the model's block stack, else the top-level module) and the kind it is
    coloured by on the lifetimes (``kind``: in a block of the stack its part named for every block,
    ``layers.*.attention``, so that 32 blocks take one colour per part, not 32). Backward nodes take
    the module of the forward nodes they read (the activations a backward op consumes are its module's),
    else that of the backward nodes they read (the gradient they carry on), else "backward"."""

    path: tuple[str, ...]
    group: tuple[str, ...]
    kind: tuple[str, ...] = ()  # the lifetimes' colour: in a block of the stack, its part, named for every block

    def kind_of(self, v: int) -> str:
        return self.kind[v] if self.kind else self.group[v]


def block_pattern(path: str, block: str) -> str:
    """``path`` (a module inside the stack's block ``block``) named for every block of the stack, one
    level below it: ``layers.5.attention.wq`` in ``layers.5`` -> ``layers.*.attention``; the block's own
    ops -> ``layers.*``."""
    head, _, _ = block.rpartition(".")
    star = f"{head}.*" if head else "*"
    inside = path[len(block) + 1:].split(".")[0] if path.startswith(block + ".") else ""
    return f"{star}.{inside}" if inside else star


def node_modules(graph: Graph) -> Modules:
    """O(n · modules) for the forward nodes, O(edges) for the backward ones."""
    n = graph.n
    path = [""] * n
    width = np.full(n, np.iinfo(np.int64).max)
    for name, first, last in graph.modules:  # the innermost (narrowest) call wins
        for v in range(first, min(last, n - 1) + 1):
            if last - first < width[v]:
                width[v], path[v] = last - first, name
    blocks = block_stack(graph)
    group = [""] * n
    for v in range(n):
        if path[v]:
            block = next((b for b, first, last in blocks if first <= v <= last), None)
            group[v] = block or path[v].split(".")[0]
    for v in range(n):
        if graph.is_forward[v]:
            if not path[v]:  # an op between module calls (a getitem, the loss): its input's module
                read = [int(d) for d in graph.deps(v) if path[d] not in ("", "forward")]
                path[v], group[v] = (path[max(read)], group[max(read)]) if read else ("forward", "forward")
            continue
        read = [int(d) for d in graph.deps(v) if graph.is_forward[d] and path[d] not in ("", "forward")]
        if not read:  # only gradients: the module whose gradient it carries on
            read = [int(d) for d in graph.deps(v) if path[d] not in ("", "forward", "backward")]
        if read:
            d = max(read)  # the latest forward activation it reads: the op it differentiates
            path[v], group[v] = path[d], group[d]
        else:
            path[v] = group[v] = "backward"
    stacked = {b for b, _, _ in blocks}
    kind = [block_pattern(path[v], group[v]) if group[v] in stacked else group[v] for v in range(n)]
    return Modules(tuple(path), tuple(group), tuple(kind))


# -- lifetimes ------------------------------------------------------------------------------------

def first_fit(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """int64[k]: an offset (bytes) for each interval, the lowest at which it overlaps no interval alive
    at the same time, taking them in order of start: where a simple first-fit allocator with no
    fragmentation-avoiding tricks would put them. O(k · alive)."""
    offset = np.zeros(len(start), dtype=np.int64)
    alive: list[tuple[int, int, int]] = []  # (offset, size, end), sorted by offset
    for i in np.argsort(start, kind="stable").tolist():
        s, need = int(start[i]), int(size[i])
        alive = [a for a in alive if a[2] > s]
        at = 0
        for off, sz, _ in alive:
            if off - at >= need:
                break
            at = max(at, off + sz)
        offset[i] = at
        alive.append((at, need, int(end[i])))
        alive.sort()
    return offset


@dataclass(frozen=True)
class Bars:
    """What the timeline draws: one bar per lifetime, or per group of small lifetimes of one module."""

    start: np.ndarray  # int64 op index
    end: np.ndarray  # int64 op index
    bytes: np.ndarray  # int64 bar height: a tensor's bytes, or a group's most bytes alive at once
    offset: np.ndarray  # int64 bytes below the bar (first fit)
    recomputed: np.ndarray  # bool
    label: tuple[str, ...]  # the tensor's name, or "N tensors under X"
    op: tuple[str, ...]
    module: tuple[str, ...]  # innermost module path
    group: tuple[str, ...]  # colour group: the module's kind (Modules.kind)
    count: np.ndarray  # int64 tensors in the bar
    threshold: int  # tensors under this many bytes were grouped (0: none)


def bars(graph: Graph, residency: Residency, modules: Modules | None = None, max_bars: int = MAX_BARS) -> Bars:
    """The lifetimes of a schedule's tensors with bytes (``SimResult.residency``; views share their
    base's bytes and are left out) as bars. When there are more than ``max_bars``, the lifetimes under
    a size threshold (the one leaving about half of ``max_bars`` tensors on their own) are grouped by
    module, pass, whether recomputed and when they are freed (to a 200th of the schedule): one bar from
    the group's first compute to its last free, as high as the most bytes of it alive at once.
    O(len(ops) + bars · alive)."""
    modules = modules or node_modules(graph)
    with_bytes = graph.mem[residency.node] > 0
    node, life_start, life_end, recomputed = (a[with_bytes] for a in (residency.node, residency.start, residency.end,
                                                                       residency.recomputed))
    life_bytes = graph.mem[node].astype(np.int64)
    k = len(node)
    threshold = 0
    if k > max_bars:
        threshold = int(np.sort(life_bytes)[::-1][max_bars // 2])
    alone = life_bytes > threshold if threshold else np.ones(k, dtype=bool)
    idx = np.flatnonzero(alone)
    start, end, size = [life_start[idx]], [life_end[idx]], [life_bytes[idx]]
    rec, count = [recomputed[idx]], [np.ones(len(idx), dtype=np.int64)]
    label = [graph.names[v] for v in node[idx].tolist()]
    op = [graph.ops[v] for v in node[idx].tolist()]
    module = [modules.path[v] for v in node[idx].tolist()]
    group = [modules.kind_of(v) for v in node[idx].tolist()]
    small = np.flatnonzero(~alone)
    if len(small):
        # tensors of one module freed about together (within a 200th of the schedule): a group's bar
        # then spans about what its members do, not from the first to the last of a whole module's
        bucket = max(1, residency.n_ops // 200)
        keys: dict[tuple[str, bool, bool, int], list[int]] = {}
        for i in small.tolist():
            v = int(node[i])
            key = (modules.path[v], bool(graph.is_forward[v]), bool(recomputed[i]), int(life_end[i]) // bucket)
            keys.setdefault(key, []).append(i)
        g_start, g_end, g_size, g_rec, g_count = [], [], [], [], []
        for (path, forward, again, _), members in keys.items():
            m = np.asarray(members)
            s0, e0 = int(life_start[m].min()), int(life_end[m].max())
            g_start.append(s0), g_end.append(e0)
            g_size.append(int(held_bytes(life_start[m] - s0, life_end[m] - s0, life_bytes[m], e0 - s0 + 1).max()))
            g_rec.append(again), g_count.append(len(m))
            label.append(f"{len(m)} tensors under {format_bytes(threshold)}")
            op.append("forward ops" if forward else "backward ops")
            module.append(path)
            group.append(modules.kind_of(int(node[m[0]])))
        start.append(np.asarray(g_start)), end.append(np.asarray(g_end)), size.append(np.asarray(g_size))
        rec.append(np.asarray(g_rec, dtype=bool)), count.append(np.asarray(g_count))
    start_a, end_a, size_a = (np.concatenate(a).astype(np.int64) for a in (start, end, size))
    return Bars(start_a, end_a, size_a, first_fit(start_a, end_a, size_a), np.concatenate(rec).astype(bool),
                tuple(label), tuple(op), tuple(module), tuple(group), np.concatenate(count).astype(np.int64), threshold)


def reason_line(r: Reason, budget: int | None) -> str:
    """One recomputed region's reason in words."""
    line = (f"**segment {r.segment}** ({r.modules}; {r.ops} ops): recomputing it takes "
            f"{format_bytes(max(r.frees_at_peak, 0))} off the peak for {r.cost * 1e6:.1f} µs of compute.")
    if r.alternative is None:
        return line + " The plan keeps no other segment to recompute instead."
    swap = f"segment {r.alternative} ({r.alternative_modules})"
    if r.alternative_fits:
        return line + (f" Next best: recompute {swap} instead, peak {format_bytes(r.alternative_peak)}, "
                       f"{r.alternative_cost * 1e6:.1f} µs.")
    return line + (f" No other single segment in its place fits the budget: the closest, {swap}, "
                   f"peaks at {format_bytes(r.alternative_peak)}"
                   + (f", {format_bytes(r.alternative_peak - budget)} over." if budget is not None else "."))


def alive_at(b: Bars, step: int) -> np.ndarray:
    """bool[bars]: the bars resident after op ``step``."""
    return (b.start <= step) & (step < b.end)


# -- one line per step ----------------------------------------------------------------------------

def _short(op: str) -> str:
    """aten.gelu_backward.default -> gelu_backward."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else op


def step_line(graph: Graph, ops: Sequence[tuple[str, int]], i: int, modules: Modules | None = None,
              events: Sequence[RecomputeEvent] | None = None) -> str:
    """What op ``i`` of the schedule does, in one line: a compute (and whose module), a recompute (the
    bytes the rebuild it belongs to brings back and the op that needs them), or a free (and whether the
    tensor comes back later). ``events``: the schedule's rebuilds (``SimResult.events``; found from
    ``ops`` when not given). O(len(ops))."""
    modules = modules or node_modules(graph)
    kind, v = ops[i]
    v = int(v)
    name, where = graph.names[v], modules.path[v]
    if kind == "free":
        later = next((j for j in range(i + 1, len(ops)) if ops[j][0] == "compute" and int(ops[j][1]) == v), None)
        tail = (f", recomputed at step {later}" if later is not None
                else ", not needed again" if graph.mem[v] else "")
        freed = (f"−{format_bytes(int(graph.mem[v]))}" if graph.mem[v] else
                 "no bytes of its own (a view: its base holds them)" if graph.alias_of[v] >= 0 else "no bytes")
        return f"step {i}: free {name} ({where}): {freed}{tail}"
    events = recompute_events(graph, ops) if events is None else events
    rebuild = next((e for e in events if e.start <= i <= e.end), None)
    if rebuild is None:
        pass_ = "forward" if graph.is_forward[v] else "backward"
        return (f"step {i}: compute {name} ({_short(graph.ops[v])}, {pass_}, {where}): "
                f"+{format_bytes(int(graph.mem[v]))}")
    needer = rebuild.before
    need = f", needed by {_short(graph.ops[needer])} ({graph.names[needer]})" if needer >= 0 else ""
    return (f"step {i}: recompute {where}: {name} ({rebuild.nodes.index(v) + 1} of {len(rebuild.nodes)} ops rebuilt, "
            f"{format_bytes(rebuild.bytes)} back){need}")


# -- why this plan --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reason:
    """One recomputed region of a checkpoint plan, measured with the simulator."""

    segment: int
    modules: str  # the module calls the segment's ops belong to
    ops: int
    frees_at_peak: int  # the plan's peak without recomputing it minus the plan's peak
    cost: float  # seconds its rebuild adds
    alternative: int | None  # the kept segment that, recomputed instead, fits the budget at the least
    # cost (or, when none fits, gives the lowest peak); None when the plan keeps no segment
    alternative_modules: str
    alternative_peak: int | None
    alternative_cost: float | None  # seconds its rebuild would add
    alternative_fits: bool


def _modules_of(members: Sequence[int], modules: Modules) -> str:
    """The module calls a segment's ops ran in, one level below their block (blocks.1.attn, blocks.1.fc)."""
    names = list(dict.fromkeys(".".join(modules.path[v].split(".")[:len(modules.group[v].split(".")) + 1])
                               for v in members))
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def reasons(graph: Graph, schedule: Schedule, budget: int | None, modules: Modules | None = None,
            regions: Sequence[int] | None = None, max_simulations: int = 300) -> list[Reason]:
    """For each recomputed segment of a bonsai/chen plan (``schedule.extra``; ``regions``: only those
    segment indices): the bytes it takes off the
    peak and the compute it costs (the plan re-simulated without it), and the next-best region: of the
    kept segments (those with the most bytes, as many as keep the simulations to about
    ``max_simulations``, at least 3 per region), the one that, recomputed in its place,
    fits ``budget`` at the least compute, or when no single swap fits, the one with the lowest peak.
    O(recomputed · alternatives) simulations."""
    modules = modules or node_modules(graph)
    plan = CheckpointPlan.from_extra(schedule.extra)
    base = simulate(graph, schedule)

    def measure(recomputed: set[int]) -> tuple[int, float]:
        p = CheckpointPlan(plan.segments, frozenset(recomputed), plan.drop_outputs & frozenset(recomputed), plan.saved)
        sim = simulate(graph, plan_schedule(graph, p, schedule.method))
        return sim.peak, sim.compute_cost

    kept = [s for s in range(len(plan.segments)) if s not in plan.recomputed]
    kept.sort(key=lambda s: -int(graph.mem[list(plan.segments[s])].sum()))
    todo = sorted(plan.recomputed if regions is None else set(regions) & plan.recomputed)
    kept = kept[:max(3, max_simulations // max(len(todo), 1) - 1)]
    out = []
    for r in todo:
        without = set(plan.recomputed) - {r}
        peak, cost = measure(without)
        best: tuple[tuple[bool, float], float, int, int] | None = None
        for s in kept:
            alt_peak, alt_cost = measure(without | {s})
            fits = budget is None or alt_peak <= budget
            rank = (not fits, alt_cost if fits else float(alt_peak))
            if best is None or rank < best[0]:
                best = (rank, alt_cost, s, alt_peak)
        members = plan.segments[r]
        out.append(Reason(
            segment=r, modules=_modules_of(members, modules), ops=len(members),
            frees_at_peak=int(peak - base.peak), cost=float(base.compute_cost - cost),
            alternative=None if best is None else best[2],
            alternative_modules="" if best is None else _modules_of(plan.segments[best[2]], modules),
            alternative_peak=None if best is None else best[3],
            alternative_cost=None if best is None else float(best[1] - cost),
            alternative_fits=best is not None and not best[0][0]))
    return out


# -- the chart ------------------------------------------------------------------------------------

MIB = 2**20
FIXED = "fixed (parameters, gradients, batch)"


def bar_frame(b: Bars, x: np.ndarray, step: int, fixed_mem: int) -> "pd.DataFrame":
    """The bars as the chart's rows (:func:`bar_rows`), with whether each is alive after op ``step``."""
    return with_alive(bar_rows(b, x, fixed_mem), b, step)


def bar_rows(b: Bars, x: np.ndarray, fixed_mem: int) -> "pd.DataFrame":
    """The bars as the chart's rows but for the step: x from the compute's position on the memory curve's x
    axis (``x[i]`` after op i) to the free's, y in MiB above ``fixed_mem`` (drawn as its own band, the first
    row), and what its tooltip says (:func:`bar_tip`). Compact on the wire: 32-bit floats, the group's name a
    category."""
    import pandas as pd

    ends = np.append(np.asarray(x, dtype=float), float(x[-1]) if len(x) else 0.0)
    groups = list(dict.fromkeys((FIXED, *b.group)))
    code = {g: i for i, g in enumerate(groups)}
    return pd.DataFrame({
        "x": np.r_[0.0, ends[b.start]].astype(np.float32),
        "x2": np.r_[ends[-1], ends[np.minimum(b.end, len(x))]].astype(np.float32),
        "y": np.r_[0.0, (fixed_mem + b.offset) / MIB].astype(np.float32),
        "y2": np.r_[fixed_mem / MIB, (fixed_mem + b.offset + b.bytes) / MIB].astype(np.float32),
        "group": pd.Categorical.from_codes([0] + [code[g] for g in b.group], groups),
        "tip": [f"{FIXED} · {format_bytes(fixed_mem)} · the whole step",
                *(bar_tip(*bar) for bar in zip(b.label, b.op, b.module, b.bytes, b.start, b.end, b.recomputed))],
        "recomputed": np.r_[False, b.recomputed]})


def with_alive(rows: "pd.DataFrame", b: Bars, step: int) -> "pd.DataFrame":
    """:func:`bar_rows` with whether each bar is alive after op ``step`` (the fixed band always is)."""
    return rows.assign(alive=np.r_[True, alive_at(b, step)])


def bar_tip(tensor: str, op: str, module: str, size: int, start: int, end: int, recomputed: bool) -> str:
    """A bar's tooltip as one line: the browser builds every bar's tooltip on each drag, one expression per
    field (Streamlit's Vega interprets them), so one field rather than six."""
    return (" · ".join(part for part in (tensor, op, module) if part) + f" · {format_bytes(int(size))} · alive at "
            f"steps {start}–{end}" + (" · recomputed" if recomputed else ""))


def timeline_chart(frame, groups: Sequence[str], cursor_x: float, x_domain: tuple[float, float], x_title: str,
                   height: int = 420, y_top: float | None = None) -> dict:
    """The lifetimes as a Vega-Lite spec: a rectangle per bar coloured by module group (recomputed
    lifetimes outlined in red, those not alive at the cursor faded) and the cursor as a rule. Like the
    memory chart, everything that moves is in the named datasets, so a keyed chart updates in place:
    ``groups`` (the colour legend's order) must not depend on the schedule, and ``x_domain`` is drawn
    as unseen points, not set as the scale's domain; so is ``y_top`` (MiB), when given, so that two
    charts drawn one under the other share their y scale."""
    import pandas as pd

    from explorer.plots import FINITE_DATA

    x = {"field": "x", "type": "quantitative", "title": x_title}
    colour_domain = [FIXED, *[g for g in dict.fromkeys(groups) if g != FIXED]]
    colour = {"field": "group", "type": "nominal", "title": "made by", "sort": colour_domain,
              "scale": {"domain": colour_domain, "range": ["#bbbbbb", *TIMELINE_COLOURS]},
              "legend": {"orient": "bottom", "columns": 6, "symbolType": "square", "labelLimit": 160}}
    return {
        "height": height,
        "usermeta": {"embedOptions": {"renderer": "hybrid"}},
        "config": FINITE_DATA,
        "datasets": {"bars": frame, "cursor": pd.DataFrame({"x": [float(cursor_x)]}),
                     "extent": pd.DataFrame({"x": [float(v) for v in x_domain],
                                             "y": [0.0, float(y_top) if y_top is not None else 0.0]})},
        "layer": [
            {"data": {"name": "bars"},
             "mark": {"type": "rect", "strokeWidth": 1.5},
             "encoding": {
                 "x": x, "x2": {"field": "x2"},
                 "y": {"field": "y", "type": "quantitative", "title": "memory (MiB)", "axis": {"minExtent": 48, "maxExtent": 48}},
                 "y2": {"field": "y2"}, "color": colour,
                 "stroke": {"condition": {"test": "datum.recomputed", "value": RECOMPUTED_STROKE}, "value": None},
                 "opacity": {"condition": {"test": "datum.alive", "value": 0.95}, "value": 0.3},
                 "tooltip": {"field": "tip"}}},
            {"data": {"name": "cursor"}, "mark": {"type": "rule", "strokeWidth": 2, "color": "#888"},
             "encoding": {"x": x}},
            # unseen: the memory chart's x range, so that both charts get the same x axis (plots.memory_chart)
            {"data": {"name": "extent"}, "mark": {"type": "point", "opacity": 0},
             "encoding": {"x": x} if y_top is None else {"x": x, "y": {"field": "y", "type": "quantitative"}}},
        ],
    }


RECOMPUTED_STROKE = "#d62728"
# Tableau's 20 colours without its reds (red marks a recomputed lifetime)
TIMELINE_COLOURS = ("#4e79a7", "#a0cbe8", "#f28e2b", "#ffbe7d", "#59a14f", "#8cd17d", "#b6992d", "#f1ce63",
                    "#499894", "#86bcb6", "#79706e", "#bab0ac", "#d37295", "#fabfd2", "#b07aa1", "#d4a6c8",
                    "#9d7660", "#d7b5a6")
