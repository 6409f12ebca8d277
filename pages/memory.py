"""Memory: memory over time of the chosen schedule against no remat and any other method ticked, and the
allocator's address space at one chosen moment."""

from __future__ import annotations

import numpy as np
import streamlit as st

from bonsai_core import solvers
from bonsai_core.allocator import layout_at
from bonsai_core.budget import format_bytes
from bonsai_core.errors import BudgetError
from explorer import compute, plots, state

st.title("Memory over time")
g = state.model().graph
base = compute.no_remat(g)

c1, c2, c3 = st.columns([3, 2, 2])
others = [m for m in solvers.available_methods() if m not in (state.settings().method, "none")]
extra = c1.multiselect("Also show", others, key="memory_others", help="Solved at the same budget and options.")
x_mode = c2.radio("x axis", ["time", "ops"], key="memory_x", horizontal=True,
                  format_func=lambda x: "compute time" if x == "time" else "schedule step")
has_allocator = compute.allocator_replay() is not None
reserved_on = c3.toggle("Reserved bytes (allocator model)", key="memory_reserved", value=has_allocator,
                        disabled=not has_allocator,
                        help="Bytes the caching allocator holds, fragmentation included: the thin dotted line in each "
                             "schedule's colour." if has_allocator else
                        "The allocator model (bonsai_core.allocator) is not in this checkout.")


def allocation(outcome: compute.Outcome):
    """The allocator replay of a solved schedule when the toggle is on (None otherwise)."""
    if not reserved_on:
        return None
    result = compute.replay(g, outcome)
    if isinstance(result, str):
        st.warning(f"Allocator replay of {outcome.method}: {result}")
        return None
    reserved = getattr(result, "reserved", None)
    return None if reserved is None or len(reserved) != len(outcome.schedule.ops) else result


def address_space(s: state.Settings) -> None:
    """Where each tensor sits in the allocator after one op of one of the shown schedules."""
    st.caption("Where each tensor sits in the allocator after one op of the steady-state step, the full arena: "
               "parameters, gradients, the batch and Adam's state are pinned where a training loop allocated them, "
               "and activations fill the free ranges between them. A request needs one free range large enough, "
               "which is why contiguity matters. The placement is the allocator model's replay (best fit), not a "
               "pool method's own.")
    a1, a2 = st.columns([1, 3])
    solved = {m: state.outcome(m) for m in [s.method, *extra]}
    choices = [m for m, o in solved.items() if o.ok] or ["none"]
    picked = a1.selectbox("Schedule", choices, key="memory_address_method")
    policy = a1.radio("Allocator", ["caching", "arena"], key="memory_address_policy", horizontal=True,
                      format_func=lambda p: "PyTorch caching" if p == "caching" else "one pool of the budget",
                      help="PyTorch's caching allocator (2 / 20 MiB segments), or a single pre-reserved pool of the "
                           "budget's size (plus the optimizer state), as Coop's runs in.")
    outcome = solved.get(picked) or compute.solve(g, None, "none")
    n_ops = len(outcome.schedule.ops)
    op = a2.slider("After op", 0, n_ops - 1, value=max(0, min(outcome.sim.peak_op, n_ops - 1)), key="memory_address_op",
                   help="Starts at the schedule's live peak.")
    kind, node = outcome.schedule.ops[op]
    try:
        blocks = layout_at(g, outcome.schedule, op, capacity=s.budget if policy == "arena" else None, policy=policy)
    except BudgetError as e:
        state.show_error(str(e), "Pick the caching allocator, or raise the budget in the sidebar.")
    else:
        title = f"{picked}, after op {op}: {kind} {g.names[node]}"
        st.plotly_chart(plots.address_figure(blocks, title), width="stretch", key="memory_address_plot")
        free = [b.size for b in blocks if b.kind == "free"]
        st.caption(f"{len(blocks)} blocks · free {format_bytes(sum(free))} in {len(free)} ranges, the largest "
                   f"{format_bytes(max(free, default=0))}.")


def memory_over_time() -> None:
    """The plot and the table at the sidebar's budget, and the address space when open."""
    s = state.settings()
    curves, rows, errors = [], [], []
    for i, method in enumerate([s.method, *extra]):
        out = state.outcome(method)
        if not out.ok:
            errors.append((method, out.error))
            continue
        alloc = allocation(out)
        curves.append(plots.curve(method, out.sim.timeline, compute.op_costs(g, out.schedule), out.sim.peak,
                                  out.sim.peak_op, plots.method_colour(method, i), x_mode,
                                  reserved=None if alloc is None else np.asarray(alloc.reserved)))
        row = {"schedule": method, "peak": format_bytes(out.sim.peak),
               "peak % of no remat": f"{100 * out.sim.peak / base.peak:.1f}",
               "overhead %": f"{100 * out.sim.overhead:.2f}", "ops": len(out.schedule.ops),
               "recomputed ops": out.sim.recomputes}
        if alloc is not None:
            row |= {"reserved peak": format_bytes(alloc.reserved_peak),
                    "fragmentation %": f"{100 * float(alloc.fragmentation):.1f}"}
        rows.append(row)
    if not any(r["schedule"] == "none" for r in rows):  # no remat is the reference line
        none = compute.solve(g, None, "none")
        alloc = allocation(none)
        curves.append(plots.curve("no remat", base.timeline, compute.op_costs(g, none.schedule), base.peak, base.peak_op,
                                  plots.method_colour("none"), x_mode, dash="dash",
                                  reserved=None if alloc is None else np.asarray(alloc.reserved)))
        row = {"schedule": "no remat", "peak": format_bytes(base.peak), "peak % of no remat": "100.0",
               "overhead %": "0.00", "ops": len(none.schedule.ops), "recomputed ops": 0}
        if alloc is not None:
            row |= {"reserved peak": format_bytes(alloc.reserved_peak),
                    "fragmentation %": f"{100 * float(alloc.fragmentation):.1f}"}
        rows.append(row)

    for method, error in errors:
        state.show_error(f"{method}: {error}", "Raise the budget in the sidebar or pick another method."
                         if method == s.method else "Raise the budget in the sidebar or untick the method.")
    # keyed, and the budget only in its datasets: each drag updates the chart's data in place (plots.memory_chart)
    st.vega_lite_chart(spec=plots.memory_chart(curves, s.budget, g.peak_lower_bound, x_mode), width="stretch",
                       key="memory_plot")
    st.table(rows, hide_index=True)  # a static table: a data grid cost each browser 0.1 CPU-s more per drag

    # Drawn only while open (a lazy expander): the address map is a second plotly chart that every budget
    # change would redraw, about 40% of a browser tab's work per slider move (docs/EXPLORER.md).
    address = st.expander("Address space at one moment", key="memory_address_open", on_change="rerun")
    if address.open:
        with address:
            address_space(s)


state.follow_budget(memory_over_time)
