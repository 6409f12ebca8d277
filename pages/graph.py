"""Graph: the operator graph coloured by segment, recomputed segments ringed in red."""

from __future__ import annotations

import numpy as np
import streamlit as st

from explorer import compute, plots, state

LARGE = 600  # above this many ops the graph opens collapsed

st.title("Operator graph")


@st.cache_resource(show_spinner=False, hash_funcs=compute.GRAPH_HASH, max_entries=8)
def full_layout(graph):
    return plots.layered_layout(graph)


def segmented_graph() -> None:
    """The graph coloured by the segments of the schedule at the sidebar's budget."""
    g = state.model().graph
    out = state.outcome()
    segments = out.schedule.extra.get("segments") if out.ok else None
    recomputed_segments = out.schedule.extra.get("recomputed", []) if out.ok else []
    recomputed = compute.recomputed_nodes(g, out.schedule) if out.ok else np.zeros(g.n, dtype=bool)

    if not out.ok:
        state.show_error(out.error,
                         "The graph is drawn without a schedule; change the budget or method in the sidebar.")
    if segments:
        colouring = (f"Colour and shape: the {len(segments)} segments of the **{out.method}** schedule; "
                     f"{len(recomputed_segments)} recomputed (red ring).")
    else:
        colouring = (f"The **{out.method}** schedule has no segments: forward ops are coloured and shaped in blocks "
                     "of consecutive ops" + (", recomputed ops ringed in red." if recomputed.any() else "."))
    st.caption("Forward ops run left to right along the top, backward ops (grey diamonds) right to left along "
               "the bottom. " + colouring)

    c1, c2, c3 = st.columns([2, 2, 3])
    default_view = "collapsed" if g.n > LARGE else "every op"
    view = (c1.segmented_control("View", ["collapsed", "every op"], key="graph_view", default=default_view)
            or default_view)
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
        st.caption(f"**{drill}**: {len(members)} ops, {len(nodes) - len(members)} neighbours (faded).")
    elif view == "collapsed":
        fig = plots.collapsed_figure(g, groups, pos, recomputed)
    else:
        fig = plots.graph_figure(g, np.arange(g.n), pos, groups.of, groups.names, recomputed)
    st.plotly_chart(fig, width="stretch", key="graph_plot")


state.follow_budget(segmented_graph)
