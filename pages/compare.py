"""Compare: overhead against memory over a budget sweep (the Pareto front), and solver cost
against granularity."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import streamlit as st

from bonsai_core import solvers
from explorer import compute, plots, state


def sweep_table(rows: list[dict], failures: list[tuple], reference: int) -> pd.DataFrame:
    """One row per solve of the sweep, failures included (with their error), by method then budget."""
    solved = [{"method": r["method"], "budget %": round(100 * r["budget"] / reference, 1), "budget (bytes)": r["budget"],
               "peak (bytes)": r["peak"], "peak %": round(100 * r["peak"] / reference, 2),
               "overhead %": round(100 * r["overhead"], 3), "solve seconds": round(r["solve_seconds"], 4), "error": ""}
              for r in rows]
    failed = [{"method": m, "budget %": round(100 * b / reference, 1), "budget (bytes)": b, "error": e}
              for m, b, e in failures]
    columns = ["method", "budget %", "budget (bytes)", "peak (bytes)", "peak %", "overhead %", "solve seconds", "error"]
    return pd.DataFrame(solved + failed, columns=columns).sort_values(["method", "budget (bytes)"], kind="stable")


st.title("Compare methods")
s = state.settings()
g = state.model().graph
reference = compute.no_remat(g).peak
methods = solvers.available_methods()

st.subheader("Budget sweep")
c1, c2, c3 = st.columns([3, 3, 1])
# the sidebar's method against the quick heuristics; the exact solvers are a tick away (and slower)
quick = [m for m in dict.fromkeys([s.method, "chen", "dtr", "coop"]) if m in methods]
chosen = c1.multiselect("Methods", methods, default=quick, key="sweep_methods",
                        help="Each point is a full solve at that budget with the sidebar's options.")
low, high = c2.slider("Budgets (% of the no-remat peak)", 5, 100, (40, 100), step=5, key="sweep_range")
points = c3.number_input("Points", 2, 40, 7, key="sweep_points")
if st.button("Run the sweep", type="primary", key="sweep_run", disabled=not chosen):
    budgets = [int(reference * p / 100) for p in np.linspace(low, high, int(points))]
    bar = st.progress(0.0, text="Solving…")
    rows, failures = [], []
    jobs = [(m, b) for m in chosen for b in budgets]
    started, limit = time.perf_counter(), dict(s.options).get("time_limit")
    limit_text = f"; at most {limit:g} s per solve" if limit else ""
    for i, (method, budget) in enumerate(jobs):
        bar.progress(i / len(jobs), text=f"{method} at {100 * budget / reference:.0f}% ({i + 1}/{len(jobs)}, "
                     f"{time.perf_counter() - started:.0f} s so far{limit_text})")
        out = compute.solve(g, budget, method, state.options_for(method))
        if out.ok:
            rows.append({"method": method, "budget": budget, "peak": out.sim.peak, "overhead": out.sim.overhead,
                         "solve_seconds": float(out.schedule.stats.get("solve_seconds", out.wall_seconds))})
        else:
            failures.append((method, budget, out.error))
    bar.progress(1.0, text=f"Done: {len(rows)} schedules, {len(failures)} budgets out of reach.")
    st.session_state["sweep"] = (g.hash, rows, failures)

sweep = st.session_state.get("sweep")
if sweep and sweep[0] == g.hash:
    _, rows, failures = sweep
    if rows:
        st.plotly_chart(plots.sweep_figure(rows, reference, theme=state.theme()), width="stretch", key="sweep_plot")
    table = sweep_table(rows, failures, reference)
    st.dataframe(table, hide_index=True, width="stretch", key="sweep_table",
                 column_config={"peak (bytes)": st.column_config.NumberColumn(format="%d"),
                                "budget (bytes)": st.column_config.NumberColumn(format="%d")})
    st.download_button("Download the sweep (CSV)", table.to_csv(index=False), file_name=f"{g.name.split('(')[0]}-sweep.csv",
                       mime="text/csv", key="sweep_csv", icon=":material/download:")
    if failures:
        with st.expander(f"{len(failures)} budgets out of reach"):
            for method, budget, error in failures:
                st.markdown(f"- **{method}** at {100 * budget / reference:.0f}%: {error}")
else:
    st.caption("Pick methods and a budget range, then run the sweep: each point is a full solve (cached).")

st.subheader("Solver cost against granularity")
takes = [m for m in methods if compute.names_option(m, "granularity")] or methods
c1, c2 = st.columns([3, 3])
gm = c1.multiselect("Methods", takes, default=[m for m in takes if m != "none"][:1] or takes[:1], key="gran_methods")
n_fwd = max(2, int(g.is_forward.sum()))
values = c2.text_input("Granularities", key="gran_values",
                       value=", ".join(str(v) for v in sorted({max(1, int(n_fwd * f)) for f in (0.02, 0.05, 0.1, 0.2)})))
if st.button("Run at the sidebar's budget", key="gran_run", disabled=not gm):
    try:
        grans = sorted({int(v) for v in values.replace(",", " ").split()})
        if not grans or min(grans) < 1:
            raise ValueError
    except ValueError:
        state.show_error(f"Cannot read the granularities {values!r}.", "Give whole numbers >= 1, e.g. 4, 8, 16.")
        grans = []
    bar = st.progress(0.0, text="Solving…")
    rows, failures = [], []
    jobs = [(m, k) for m in gm for k in grans]
    for i, (method, k) in enumerate(jobs):
        bar.progress(i / max(len(jobs), 1), text=f"{method}, granularity {k} ({i + 1}/{len(jobs)})")
        options = dict(state.options_for(method))
        options["granularity"] = k
        out = compute.solve(g, s.budget, method, tuple(sorted(options.items())))
        if out.ok:
            st_ = out.schedule.stats
            rows.append({"method": method, "granularity": k, "variables": st_.get("variables", 0),
                         "constraints": st_.get("constraints", 0),
                         "solve_seconds": float(st_.get("solve_seconds", out.wall_seconds)),
                         "overhead %": round(100 * out.sim.overhead, 3)})
        else:
            failures.append((method, k, out.error))
    bar.progress(1.0, text=f"Done: {len(rows)} solves.")
    st.session_state["granularity_sweep"] = (g.hash, s.budget, rows, failures)

gs = st.session_state.get("granularity_sweep")
if gs and gs[0] == g.hash:
    _, budget, rows, failures = gs
    if rows:
        st.plotly_chart(plots.granularity_figure(rows), width="stretch", key="gran_plot")
        st.dataframe(rows, hide_index=True, width="stretch")
    for method, k, error in failures:
        state.show_error(f"{method}, granularity {k}: {error}")
