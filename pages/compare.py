"""Compare: overhead against memory over a budget sweep (the Pareto front), solver cost against
granularity, and two configurations side by side at the sidebar's budget."""

from __future__ import annotations

import time

import numpy as np
import streamlit as st

from bonsai_core.units import format_bytes
from explorer import ahead, compute, module_chart, module_graph, pair, plots, state, sweeps, timeline

st.title("Compare methods")
s = state.settings()
g = state.model().graph
reference = compute.no_remat(g).peak
methods = compute.methods()

st.subheader("Budget sweep")
c1, c2, c3 = st.columns([3, 3, 1])
# the sidebar's method against the quick heuristics; the exact solvers are a tick away (and slower)
quick = [m for m in dict.fromkeys([s.method, "chen", "dtr", "coop"]) if m in methods]
chosen = c1.multiselect("Methods", methods, default=quick, key="sweep_methods",
                        help="Each point is a full solve at that budget with the sidebar's options.")
low, high = c2.slider("Budgets (% of the no-remat peak)", 5, 100, (40, 100), step=5, key="sweep_range")
points = c3.number_input("Points", 2, 40, 7, key="sweep_points")
if st.button("Run the sweep", type="primary", key="sweep_run", disabled=not chosen):
    bar = st.progress(0.0, text="Solving…")
    started, limit = time.perf_counter(), dict(s.options).get("time_limit")
    limit_text = f"; at most {limit:g} s per solve" if limit else ""

    def progress(i: int, jobs: int, method: str, budget: int) -> None:
        bar.progress(i / jobs, text=f"{method} at {100 * budget / reference:.0f}% ({i + 1}/{jobs}, "
                     f"{time.perf_counter() - started:.0f} s so far{limit_text})")

    found = sweeps.budget_sweep(g, chosen, sweeps.budgets(reference, low, high, points), state.options_for, progress)
    bar.progress(1.0, text=f"Done: {len(found.rows)} schedules, {len(found.failures)} budgets out of reach.")
    st.session_state["sweep"] = (g.hash, found)

kept = st.session_state.get("sweep")
if kept and kept[0] == g.hash:
    found = kept[1]
    if found.rows:
        st.plotly_chart(plots.sweep_figure(found.rows, reference, theme=state.theme()), width="stretch",
                        key="sweep_plot")
    table = sweeps.sweep_table(found, reference)
    st.dataframe(table, hide_index=True, width="stretch", key="sweep_table",
                 column_config={"peak (bytes)": st.column_config.NumberColumn(format="%d"),
                                "budget (bytes)": st.column_config.NumberColumn(format="%d")})
    st.download_button("Download the sweep (CSV)", table.to_csv(index=False), file_name=f"{g.name.split('(')[0]}-sweep.csv",
                       mime="text/csv", key="sweep_csv", icon=":material/download:")
    if found.failures:
        with st.expander(f"{len(found.failures)} budgets out of reach"):
            for method, budget, error in found.failures:
                st.markdown(f"- **{method}** at {100 * budget / reference:.0f}%: {error}")
else:
    st.caption("Pick methods and a budget range, then run the sweep: each point is a full solve (cached).")

st.subheader("Solver cost against granularity")
takes = [m for m in methods if compute.names_option(m, "granularity")] or methods
c1, c2 = st.columns([3, 3])
gm = c1.multiselect("Methods", takes, default=[m for m in takes if m != "none"][:1] or takes[:1], key="gran_methods")
values = c2.text_input("Granularities", key="gran_values",
                       value=sweeps.default_granularities(max(2, int(g.is_forward.sum()))))
if st.button("Run at the sidebar's budget", key="gran_run", disabled=not gm):
    try:
        grans = sweeps.parse_granularities(values)
    except ValueError:
        state.show_error(f"Cannot read the granularities {values!r}.", "Give whole numbers >= 1, e.g. 4, 8, 16.")
        grans = []
    bar = st.progress(0.0, text="Solving…")

    def progress(i: int, jobs: int, method: str, k: int) -> None:
        bar.progress(i / jobs, text=f"{method}, granularity {k} ({i + 1}/{jobs})")

    found = sweeps.granularity_sweep(g, s.budget, gm, grans, state.options_for, progress)
    bar.progress(1.0, text=f"Done: {len(found.rows)} solves.")
    st.session_state["granularity_sweep"] = (g.hash, found)

kept = st.session_state.get("granularity_sweep")
if kept and kept[0] == g.hash:
    found = kept[1]
    if found.rows:
        st.plotly_chart(plots.granularity_figure(found.rows), width="stretch", key="gran_plot")
        st.dataframe(found.rows, hide_index=True, width="stretch")
    for method, k, error in found.failures:
        state.show_error(f"{method}, granularity {k}: {error}")


# -- two configurations side by side ------------------------------------------------------------------

def side_config(col, side: str, default: str) -> tuple[str, compute.Options]:
    """One side's method, granularity and own options, drawn in ``col``; its options for ``compute.solve``
    (the sidebar's time limit and backend, and what this side sets)."""
    methods = compute.methods()
    ss = st.session_state
    if ss.get(f"side_{side}_method") not in methods:
        ss[f"side_{side}_method"] = default
    method = col.selectbox(f"Method {side.upper()}", methods, key=f"side_{side}_method")
    granularity = None
    if compute.names_option(method, "granularity"):
        top = max(2, int(g.is_forward.sum()))
        k = col.number_input(f"Granularity {side.upper()} (0: the method's default)", 0, top, 0,
                             key=f"side_{side}_granularity",
                             help="Largest segment, in forward ops; 0 leaves it to the method (bonsai: auto).")
        granularity = int(k) or None
    specs = compute.method_options(method)
    box = col.expander(f"{method}'s options ({side.upper()})") if specs else col
    own = {spec.name: state.option_widget(method, spec, key=f"side_{side}_{method}_{spec.name}",
                                          label=f"{spec.name} ({side.upper()})", where=box) for spec in specs}
    defaults = {spec.name: spec.default for spec in specs}
    base = [(k, v) for k, v in s.options if k in ("time_limit", "backend")]
    return method, pair.config_options(base, compute.accepted_options(method), granularity, own, defaults)


def offer_budget_both_fit(configs) -> None:
    """The smallest slider position above the current budget at which both sides fit, with a button
    that moves the slider there (a few cached solves, 5% apart)."""
    reference = compute.no_remat(g).peak
    start = int(state.settings().percent) + 1
    for pct in [*range(start + (-start) % 5, 100, 5), 100]:
        budget = ahead.budget_at(pct, reference)
        if all(compute.solve(g, budget, m, o, state.settings().reserved).ok for m, o in configs):
            st.info(f"Both fit at **{pct}%** of the no-remat peak ({format_bytes(budget)}).", icon=":material/info:")
            st.button(f"Set the budget to {pct}%", key="pair_budget", on_click=_set_budget, args=(pct,))
            return


def _set_budget(pct: int) -> None:
    st.session_state["budget_pct"] = pct


def side_by_side() -> None:
    """Two configurations at the sidebar's budget: memory curves, lifetimes, module boxes, table."""
    st.subheader("Two methods side by side")
    s_ = state.settings()
    st.caption(f"Both solved at the sidebar's budget, **{format_bytes(s_.budget)}** ({s_.percent:.1f}% of the no-remat "
               "peak), each schedule checked by the simulator. Pick a method for each side (the same method at two "
               "granularities works too).")
    methods = compute.methods()
    candidates = [m for m in dict.fromkeys(("chen", "bonsai", "dtr", *methods)) if m in methods and m != s_.method]
    if "side_b_method" not in st.session_state:  # opens on a partner that fits this budget, when one does
        limit = [(k, v) for k, v in s_.options if k in ("time_limit", "backend")]
        other = next((m for m in candidates[:4] if compute.solve(g, s_.budget, m, tuple(limit), s_.reserved).ok),
                     candidates[0] if candidates else s_.method)
    else:
        other = candidates[0] if candidates else s_.method
    ca, cb = st.columns(2)
    configs = [side_config(ca, "a", s_.method), side_config(cb, "b", other)]
    outs = []
    for side, (method, options) in zip("AB", configs):
        with st.spinner(f"Solving {side}: **{method}** under {format_bytes(s_.budget)}…", show_time=True):
            outs.append(compute.solve(g, s_.budget, method, options, s_.reserved))
    failed = [(side, o) for side, o in zip("AB", outs) if not o.ok]
    for side, o in failed:
        state.show_error(f"{side}, {o.method}: {o.error}", "Raise the budget in the sidebar or pick another method.")
    if failed:
        offer_budget_both_fit(configs)
        return
    names = pair.distinct_labels(*(pair.label(o.method, o.options) for o in outs))

    # memory over schedule steps, one chart: the same y scale
    none = compute.solve(g, None, "none")
    curves = [plots.curve(name, o.sim.timeline, compute.op_costs(g, o.schedule), o.sim.peak, o.sim.peak_op,
                          pair.CATEGORY_FILLS[i + 1], "ops") for i, (name, o) in enumerate(zip(names, outs))]
    curves.append(plots.curve("no remat", none.sim.timeline, compute.op_costs(g, none.schedule), none.sim.peak,
                              none.sim.peak_op, plots.method_colour("none"), "ops", dash="dash"))
    x_domain = (0.0, float(max(len(o.schedule.ops) for o in outs)))
    st.vega_lite_chart(spec=plots.memory_chart(curves, s_.budget, g.peak_lower_bound, "ops", height=360,
                                               x_domain=x_domain, budget_label=outs[0].bound.label),
                       width="stretch", key="side_memory")

    # the module boxes, coloured by who recomputes them
    tree, _, _, depth, blocks = compute.module_structure(g) if g.modules else (None,) * 5
    computed = [o.sim.times_computed for o in outs]
    diff = None
    if g.modules:
        boxes, layout = compute.boxes_at(g, depth)
        kinds = pair.categories(*(pair.recomputed_boxes(g, boxes, c) for c in computed))
        diff = pair.difference(boxes, kinds)
        stats = module_graph.box_stats(g, boxes, None, np.maximum(*computed))
        st.vega_lite_chart(spec=module_chart.module_chart(boxes, layout, stats, tree.paths, tree.parent, blocks,
                                                          theme=state.theme(), fills=pair.fills(kinds)),
                           width="stretch", key="side_modules")
        legend = " · ".join(f":{c}-background[{n}]" for c, n in zip(("gray", "blue", "orange", "violet"),
                                                                    ("neither", f"only {names[0]}", f"only {names[1]}",
                                                                     "both")))
        st.caption(f"Module boxes at fold depth {depth}, coloured by which schedule recomputes them: {legend}. "
                   "Outlined in red: recomputed by either; hover for the ops, bytes and time.")

    # the tensor lifetimes, one chart per side, same x and y scales
    modules = timeline.node_modules(g)
    groups = list(dict.fromkeys(modules.kind))
    lifetimes = [timeline.bars(g, o.sim.residency, modules) for o in outs]
    y_top = max((g.fixed_mem + float(np.max(b.offset + b.bytes, initial=0))) / timeline.MIB for b in lifetimes)
    for i, (name, o, b) in enumerate(zip(names, outs, lifetimes)):
        x = np.arange(1, len(o.schedule.ops) + 1, dtype=float)
        step = max(0, min(o.sim.peak_op, len(x) - 1))
        frame = timeline.bar_frame(b, x, step, g.fixed_mem)
        st.markdown(f"**{name}**: tensor lifetimes (grey line: its peak, step {step}; red outline: a recomputed "
                    "tensor's second life)")
        st.vega_lite_chart(spec=timeline.timeline_chart(frame, groups, x[step], x_domain, "schedule step (op)",
                                                         height=300, y_top=1.05 * y_top),
                           width="stretch", key=f"side_timeline_{'ab'[i]}")

    sides = [pair.Side(name, o.sim.peak, o.sim.overhead, o.sim.recomputes,
                       len(o.plan.recomputed) if o.plan else None,
                       (diff.a if i == 0 else diff.b) if diff else ())
             for i, (name, o) in enumerate(zip(names, outs))]
    st.markdown(pair.verdict(*sides))
    st.table(pair.table(*sides, none.sim.peak, diff or pair.Difference((), (), ())), hide_index=True)


state.follow_budget(side_by_side)
