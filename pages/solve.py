"""Solve: the schedule for the sidebar's budget and method, re-solved on every change."""

from __future__ import annotations

import streamlit as st

from bonsai_core.units import format_bytes
from explorer import ahead, compute, events, plots, state

st.title("Solve")


def schedule() -> None:
    """The schedule at the sidebar's budget: its numbers, memory over time and segments."""
    s = state.settings()
    g = state.model().graph
    reference = compute.no_remat(g).peak
    out = state.outcome()
    opts = ", ".join(f"{k}={v}" for k, v in s.options) or "method defaults"
    st.caption(f"**{s.method}** on **{g.name}** under **{format_bytes(s.budget)}** ({s.percent:.1f}% of the no-remat "
               f"peak), options: {opts}. Every change in the sidebar re-solves; results are cached and kept on disk"
               + (", and every position of the slider (and, with the granularity set, every granularity offered) is "
                  "solved in the background, its progress under the slider: once swept, each answers at once."
                  if ahead.enabled() else "."))
    state.stand_in_note(out)

    if not out.ok:
        state.show_error(out.error,
                         "Raise the budget in the sidebar, pick another method, or give the solver more time.")
        offer_op_level_method(g, s, reference)
        return

    stats = out.schedule.stats
    status = str(stats.get("status", "—"))
    gap = stats.get("gap")
    proven = compute.gap_words(out)
    c = st.columns(4)
    c[0].metric("status", status, proven, delta_color="off", delta_arrow="off",
                help="optimal, or feasible: the best schedule found within the gap asked for or the time limit"
                + (f"; gap to the solver's bound {100 * gap:.2f}%." if isinstance(gap, (int, float)) else "."))
    c[1].metric("peak", format_bytes(out.sim.peak), f"{100 * out.sim.peak / reference - 100:+.1f}% vs no remat",
                delta_color="inverse")
    c[2].metric("compute overhead", f"{100 * out.sim.overhead:.2f}%", help="Recomputed time / one plain step.")
    c[3].metric("recomputed ops", out.sim.recomputes)
    late = compute.out_of_time(out)
    if late:
        st.warning(late, icon=":material/timer_off:")
    chosen = stats.get("granularity")  # what a segment method used ("auto" picks it: the solver says which)
    c = st.columns(5 if chosen is not None else 4)
    c[0].metric("variables", stats.get("variables", "—"))
    c[1].metric("constraints", stats.get("constraints", "—"))
    build, solve = stats.get("build_seconds"), stats.get("solve_seconds")
    c[2].metric("build time", f"{build:.3f} s" if isinstance(build, (int, float)) else "—")
    reused = stats.get("reused_from")
    c[3].metric("solve time", f"{solve:.3f} s" if isinstance(solve, (int, float)) else "—",
                help=f"Whole call including simulation: {out.wall_seconds:.3f} s (first time; then cached)."
                + (" Where it went: " + ", ".join(f"{k} {v:.2f} s" for k, v in stats["time_split"].items()) + "."
                   if stats.get("time_split") else "")
                + (f" Not solved again: the plan found at {format_bytes(reused)} fits this budget, so it is just as close "
                   "to this budget's optimum." if reused is not None else ""))
    if chosen is not None:
        asked = dict(s.options).get("granularity")
        c[4].metric("granularity", chosen, help="Largest segment, in forward ops: "
                    + (f"set to {asked} in the sidebar." if asked is not None else "the method's own choice."))

    timeline = plots.curve(s.method, out.sim.timeline, compute.op_costs(g, out.schedule), out.sim.peak, out.sim.peak_op,
                           plots.method_colour(s.method))
    base = compute.no_remat(g)
    plain = compute.solve(g, None, "none")
    reference_curve = plots.curve("no remat", base.timeline, compute.op_costs(g, plain.schedule), base.peak,
                                  base.peak_op, plots.method_colour("none"), dash="dot")
    curves = [timeline, reference_curve] if s.method != "none" else [timeline]
    bound = out.bound
    st.vega_lite_chart(spec=plots.memory_chart(curves, s.budget, g.peak_lower_bound, height=300,
                                               budget_label=bound.label), width="stretch", key="solve_plot")
    if bound.reserved:
        st.caption(f"Solved for reserved bytes: the dashed line is the **reserved-bytes bound**, on what "
                   f"{compute.ALLOCATORS[bound.reserved]} reserves (the allocator model), not on the live bytes drawn. "
                   f"{s.method} met it with a live budget of {format_bytes(bound.live_budget)}: reserved peak "
                   f"{format_bytes(bound.reserved_peak)}. The Memory page draws the reserved bytes over the step.")

    plan = out.plan
    if plan and plan.segments:
        segments, rec, opened, saved = plan.segments, plan.recomputed, plan.drop_outputs, plan.saved
        st.subheader(f"{len(segments)} segments, {len(rec)} recomputed" +
                     (f" ({len(opened)} with their outputs dropped)" if opened else "") +
                     (f", {len(saved)} ops saved inside them" if saved else ""))
        if saved:
            st.caption("**saved ops**: ops inside a recomputed segment that the plan keeps anyway (held from the "
                       "forward pass to the backward, like an unrecomputed segment's), so its rebuild starts from them "
                       "instead of recomputing them.")
        modules = state.node_modules(g)
        st.dataframe([{"segment": i, "modules": segment_modules(g, seg, modules), "ops": len(seg),
                       "bytes": format_bytes(int(g.mem[list(seg)].sum())),
                       "cost (µs)": round(float(g.cost[list(seg)].sum()) * 1e6, 2), "recomputed": i in rec,
                       **({"outputs dropped": i in opened} if opened else {}),
                       **({"saved ops": len(saved.intersection(seg))} if saved else {})}
                      for i, seg in enumerate(segments)], hide_index=True, width="stretch")


def segment_modules(g, members, modules) -> str:
    """The module calls a segment's ops ran in, in order (three, then how many more)."""
    names = events.module_names(g, members, modules)
    return ", ".join(names[:3]) + (f" +{len(names) - 3} more" if len(names) > 3 else "")


OP_LEVEL = "moccasin"  # its schedules may recompute any op, backward ones too: beyond checkpoint regions
PREVIEW_SECONDS = 1.0  # moccasin's solve shown beside bonsai's error; past it, the switch runs it in full


def offer_op_level_method(g, s: state.Settings, reference: int) -> None:
    """Bonsai missed a budget that a schedule can fit: how low its checkpoint regions reach on this
    graph, what the op-level method does at this budget, and a button that switches to it."""
    if s.method != "bonsai" or s.budget < g.peak_lower_bound:
        return
    reach = compute.bonsai_reach(g)
    bound = compute.region_bound(g)
    try:  # a preview: a drag over budgets bonsai misses must not wait for a long solve at each one
        other = compute.solve(g, s.budget, OP_LEVEL, state.options_for(OP_LEVEL), s.reserved, _cap=PREVIEW_SECONDS)
    except compute.Unfinished:
        other = None
    text = ("On this graph bonsai's checkpoint regions reach "
            + (f"**{format_bytes(reach)}** at best ({100 * reach / reference:.1f}% of the no-remat peak)"
               if reach is not None else "no budget it could find in 20 s")
            + (f"; no checkpoint plan at all goes below {format_bytes(bound.peak)} ({100 * bound.peak / reference:.1f}%): "
               f"when `{g.names[bound.node]}` runs, every plan holds {format_bytes(bound.backward_bytes)} of backward "
               "tensors and that op's inputs" if bound.node >= 0 else "")
            + f". Op-level schedules, which may recompute backward ops too, are held only by the per-op bound, "
            f"{format_bytes(g.peak_lower_bound)} ({100 * g.peak_lower_bound / reference:.1f}%). ")
    if other is None:
        st.info(text + f"**{OP_LEVEL}** did not finish within {PREVIEW_SECONDS:g} s here; switching runs it with "
                "the sidebar's time limit.", icon=":material/info:")
    elif not other.ok:
        st.info(text + f"**{OP_LEVEL}** found no schedule within this budget either: {other.error}",
                icon=":material/info:")
        return
    else:
        st.info(text + f"**{OP_LEVEL}** meets this budget: peak {format_bytes(other.sim.peak)}, overhead "
                f"{100 * other.sim.overhead:+.2f}%.", icon=":material/info:")
    if st.button(f"Switch to {OP_LEVEL}", key="switch_method", on_click=_switch_method, args=(OP_LEVEL,)):
        st.rerun()  # the whole app: the sidebar's method selector is outside this fragment


def _switch_method(method: str) -> None:
    st.session_state["method"] = method


state.follow_budget(schedule)
