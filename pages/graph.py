"""Graph: the training step as module boxes (forward on top, the backward pass mirrored under it), or
op by op, coloured by the schedule's segments, recomputed parts in red."""

from __future__ import annotations

import numpy as np
import streamlit as st

from bonsai_core.units import format_bytes
from explorer import compute, events, module_chart, module_graph, plots, state

LARGE = 600  # above this many ops the op-level graph opens collapsed
NONE = "(none)"

st.title("Operator graph")


@st.cache_resource(show_spinner=False, hash_funcs=compute.GRAPH_HASH, max_entries=8)
def full_layout(graph):
    return plots.layered_layout(graph)


module_structure, boxes_at = compute.module_structure, compute.boxes_at  # shared with the Compare page


def segmented_graph() -> None:
    """The graph coloured by the segments of the schedule at the sidebar's budget."""
    g = state.model().graph
    out = state.outcome()
    state.stand_in_note(out)
    plan = out.plan  # the checkpoint regions of a segment method (None: single ops, or no schedule)
    segments = plan.segments if plan else None
    recomputed_segments = sorted(plan.recomputed) if plan else []
    recomputed = out.sim.times_computed > 1 if out.ok else np.zeros(g.n, dtype=bool)

    if not out.ok:
        state.show_error(out.error,
                         "The graph is drawn without a schedule; change the budget or method in the sidebar.")
    if segments:
        colouring = (f"Colour: the {len(segments)} segments of the **{out.method}** schedule; "
                     f"{len(recomputed_segments)} recomputed (red).")
    else:
        colouring = (f"The **{out.method}** schedule has no segments: colours mark blocks"
                     + (", recomputed ops in red." if recomputed.any() else "."))

    views = ["modules", "collapsed", "every op"] if g.modules else ["collapsed", "every op"]
    default_view = "modules" if g.modules else "collapsed" if g.n > LARGE else "every op"
    view = st.segmented_control("View", views, key="graph_view", default=default_view) or default_view
    if view == "modules":
        module_view(g, out, segments, recomputed_segments, recomputed, colouring)
    else:
        op_view(g, view, segments, recomputed_segments, recomputed, colouring)


def module_view(g, out, segments, recomputed_segments, recomputed, colouring: str) -> None:
    """One box per module call, the backward pass mirrored under it; a box opens its ops."""
    tree, _, _, start_depth, blocks = module_structure(g)
    ss = st.session_state
    c1, c2 = st.columns([2, 3])
    depth = start_depth
    if tree.max_depth > 1:
        ss.setdefault("graph_depth", start_depth)
        if not 1 <= ss["graph_depth"] <= tree.max_depth:  # a new model may be shallower
            ss["graph_depth"] = start_depth
        depth = c1.slider("Fold depth", 1, tree.max_depth, key="graph_depth",
                          help="1: the calls directly under the model. Deeper opens each call into the calls inside "
                               "it (a block into attention and MLP), drawn in a frame.")
    boxes, layout = boxes_at(g, depth)
    names = [NONE, *boxes.names]
    follow_click(names)
    chosen = c2.selectbox("Open a module", names, key="graph_module",
                          help="Its ops, forward and backward, op by op. Clicking a box opens it too.")
    computed = out.sim.times_computed if out.ok else None  # the simulator's count
    stats = module_graph.box_stats(g, boxes, segments, computed)
    st.caption(f"One box per module call at fold depth {depth}, forward left to right; under each box, mirrored, "
               "its backward ops (∇: the ops whose gradients flow from it). " + colouring
               + " A recomputed box is marked ↻ and outlined in red, with the bytes recomputing it frees and its "
               "recompute time. Click a box to open its ops; scroll to zoom, drag to pan.")
    chart = st.container()
    now = state.events_table(out, key="graph_events") if out.ok else None
    lit = (frozenset(np.unique(boxes.of[events.event_nodes(out.sim.events[now])]).tolist())
           if now is not None else frozenset())
    colours = plots.segment_colours(segments, state.node_modules(g).path) if segments else None
    spec = module_chart.module_chart(boxes, layout, stats, tree.paths, tree.parent, blocks, theme=state.theme(),
                                     segment_colours=colours, lit=lit)
    chart.vega_lite_chart(spec=spec, width="stretch", key="module_graph", on_select="rerun",
                          selection_mode=module_chart.SELECTION)
    if now is not None:
        st.caption("Outlined thick on the graph: the boxes of this rebuild and the op that needs it.")
    if chosen != NONE:
        module_ops(g, boxes, boxes.names.index(chosen), stats, segments, recomputed_segments, recomputed)


def follow_click(names: list[str]) -> None:
    """A box clicked in the chart (its selection, from the last run) opens in "Open a module"; a box
    no longer drawn (another fold depth) closes."""
    ss = st.session_state
    event = ss.get("module_graph")
    picked = (event or {}).get("selection", {}).get(module_chart.SELECTION) or []
    name = picked[0].get("name") if picked else None
    if name and name != ss.get("graph_module_clicked"):
        ss["graph_module_clicked"] = name
        if name in names:
            ss["graph_module"] = name
    if ss.get("graph_module", NONE) not in names:
        ss["graph_module"] = NONE


def module_ops(g, boxes, k: int, stats, segments, recomputed_segments, recomputed) -> None:
    """One box's ops, forward and backward, op by op."""
    nodes = np.flatnonzero(boxes.of == k)
    fwd = int(g.is_forward[nodes].sum())
    again = (f" {int(stats.recomputed_ops[k])} recomputed: they free {format_bytes(int(stats.saved_bytes[k]))} "
             f"between the passes for {stats.recompute_cost[k] * 1e3:.3f} ms of recomputation."
             if stats.recomputed_ops[k] else "")
    st.caption(f"**{boxes.names[k]}**: {fwd} forward ops ({format_bytes(int(stats.forward_bytes[k]))}, "
               f"{stats.forward_cost[k] * 1e3:.3f} ms), {len(nodes) - fwd} backward ops "
               f"({format_bytes(int(stats.backward_bytes[k]))}, {stats.backward_cost[k] * 1e3:.3f} ms)." + again)
    groups = plots.node_groups(g, segments, recomputed_segments)
    local = plots.layered_layout(g, nodes)
    fig = plots.graph_figure(g, nodes, local, groups.of[nodes], groups.names, recomputed[nodes])
    labelled(fig, g, nodes, local, largest=len(nodes))  # an opened module: any of its ops may be named
    st.plotly_chart(fig, width="stretch", key="module_ops_plot")


def labelled(fig, g, nodes, pos, largest: int = 40) -> None:
    """Horizontal 12 px labels, as many as fit without overlapping: the blocks, their parts, the kinds of
    the ``largest`` ops (``plots.op_labels``)."""
    modules = state.node_modules(g)
    plots.draw_labels(fig, plots.op_labels(g, nodes, pos, modules.path, modules.group, largest),
                      plots.padded(pos[:, 0]))


def op_view(g, view: str, segments, recomputed_segments, recomputed, colouring: str) -> None:
    """The op-level graph: every op, or one marker per segment or block ("collapsed"); a drill-down."""
    st.caption("Forward ops run left to right along the top, backward ops (grey diamonds) right to left along "
               "the bottom. " + colouring.replace("Colour:", "Colour and shape:").replace("(red)", "(red ring)"))
    c2, c3 = st.columns([2, 3])
    block = c2.number_input("Block size (ops)", 4, 256, 16, step=4, key="graph_block",
                            help="Ops per block where there are no segments (and in the backward pass).")
    groups = plots.node_groups(g, segments, recomputed_segments, block=int(block))
    names = ["(whole graph)"] + list(groups.names)
    drill = c3.selectbox("Drill into", names, key="graph_drill",
                         help="Show one segment or block op by op, with the ops it reads and feeds (faded).")

    pos = full_layout(g)
    if drill != "(whole graph)":
        k = names.index(drill) - 1
        members = np.flatnonzero(groups.of == k)
        near = set(members.tolist())
        for v in members.tolist():
            near.update(g.deps(v).tolist())
            near.update(g.users(v).tolist())
        nodes = np.array(sorted(near))
        local = plots.layered_layout(g, nodes)
        fig = plots.graph_figure(g, nodes, local, groups.of[nodes], groups.names, recomputed[nodes],
                                 context=~np.isin(nodes, members))
        labelled(fig, g, nodes, local)
        st.caption(f"**{drill}**: {len(members)} ops, {len(nodes) - len(members)} neighbours (faded).")
    elif view == "collapsed":
        fig = plots.collapsed_figure(g, groups, pos, recomputed)
        modules = state.node_modules(g)
        plots.draw_labels(fig, plots.collapsed_labels(g, groups, pos, modules.path, modules.group),
                          plots.padded(pos[:, 0]), (*plots.group_centres(groups, pos), plots.collapsed_sizes(g, groups)))
    else:
        fig = plots.graph_figure(g, np.arange(g.n), pos, groups.of, groups.names, recomputed)
        labelled(fig, g, np.arange(g.n), pos)
    st.plotly_chart(fig, width="stretch", key="graph_plot")


state.follow_budget(segmented_graph)
