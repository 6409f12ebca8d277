"""Memory: memory over time of the chosen schedule against no remat and any other method ticked, and the
allocator's address space at one chosen moment."""

from __future__ import annotations

import time

import numpy as np
import streamlit as st

from bonsai_core.allocator import layout_at
from bonsai_core.errors import BudgetError
from bonsai_core.units import format_bytes
from explorer import compute, plots, rank, state, timeline

st.title("Memory over time")
g = state.model().graph
base = compute.no_remat(g)

c1, c2, c3 = st.columns([3, 2, 2])
bounded = state.settings().reserved  # the plans bound this allocator's reserved bytes (None: live bytes)
others = [m for m in compute.methods() if m not in (state.settings().method, "none")]
extra = c1.multiselect("Also show", others, key="memory_others", help="Solved at the same budget and options.")
x_mode = c2.radio("x axis", ["time", "ops"], key="memory_x", horizontal=True,
                  format_func=lambda x: "compute time" if x == "time" else "schedule step")
if bounded:  # always drawn: they are what the budget bounds (a toggle of its own keeps the user's choice)
    reserved_on = c3.toggle("Reserved bytes (allocator model)", key="memory_reserved_bound", value=True, disabled=True,
                            help="These plans were solved for the allocator's reserved bytes (sidebar, Solver options), "
                                 "so their reserved bytes are drawn: the thin dotted line in each schedule's colour.")
else:  # off by default: these plans are solved for live bytes, and the allocator's reserve (above the no-remat
    # live peak at some budgets) would read as if checkpointing did not help
    reserved_on = c3.toggle("Reserved bytes (allocator model)", key="memory_reserved", value=False,
                            help="Bytes the caching allocator holds, fragmentation included: the thin dotted line in "
                                 "each schedule's colour, labelled at its peak.")


def allocation(outcome: compute.Outcome):
    """The allocator replay of a solved schedule when the toggle is on (None otherwise)."""
    if not reserved_on:
        return None
    result = compute.replay(g, outcome)
    if isinstance(result, str):
        st.warning(f"Allocator replay of {outcome.method}: {result}")
        return None
    return result


def reserved_bound_caption(out: compute.Outcome) -> str:
    """What the budget line means for plans solved for the allocator's reserved bytes."""
    bound = out.bound
    met = (f" **{out.method}** met it with a live budget of {format_bytes(bound.live_budget)}: reserved peak "
           f"{format_bytes(bound.reserved_peak)}, live peak {format_bytes(out.sim.peak)}." if out.ok else "")
    return (f"Dashed red: the **reserved-bytes bound** these plans were solved against, {format_bytes(bound.budget)} of "
            f"what {compute.ALLOCATORS[bound.reserved]} reserves (the allocator model, the fixed tensors outside its "
            "pool). Each method was asked for lower live budgets until the reserved bytes of its plan (dotted, "
            "labelled at their peak) fit under it, so the live bytes (solid) stay below it by the allocator's rounding "
            "and cached free blocks." + met)


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


def bars_of(outcome: compute.Outcome) -> tuple[timeline.Modules, timeline.Bars]:
    """The chosen schedule's lifetime bars, computed once per plan for every session (a drag back to a budget
    draws them at once)."""
    return compute.node_modules(g), compute.lifetime_bars(g, outcome)


def scrubber(outcome: compute.Outcome) -> int:
    """A slider over the chosen schedule's steps and a play button; returns the step. Playing reruns
    this fragment every PLAY_SECONDS, a hundredth of the schedule further each time."""
    ss = st.session_state
    last = len(outcome.schedule.ops) - 1
    at = state.step(outcome)  # shared with the Graph page's event list; a new schedule starts at its peak
    playing = ss.get("memory_playing", False)
    if playing:
        at = min(last, at + max(1, last // 100))
        state.set_step(outcome, at)
        if at >= last:
            ss["memory_playing"] = playing = False
    ss["memory_step"] = at
    c1, c2 = st.columns([2, 13], vertical_alignment="bottom")
    if c1.button("Pause" if playing else "Play", icon=":material/pause:" if playing else ":material/play_arrow:",
                 key="memory_play", help="Step through the schedule."):
        ss["memory_playing"] = not playing
        if not playing and at >= last:
            state.set_step(outcome, 0)
        st.rerun(scope="fragment")
    step = c2.slider(f"Step through {outcome.method}'s schedule", 0, last, key="memory_step",
                     on_change=lambda: state.set_step(outcome, ss["memory_step"]),
                     help="The grey line on both charts; starts at the schedule's peak.")
    st.markdown(timeline.step_line(g, outcome.schedule.ops, step, compute.node_modules(g), outcome.sim.events))
    return step


PLAY_SECONDS = 0.4


def lifetimes(outcome: compute.Outcome, chosen: plots.Curve, step: int, x_domain: tuple[float, float]) -> None:
    """The tensor lifetimes of the chosen schedule under the memory curve, on the same x axis."""
    modules, b = bars_of(outcome)
    frame = timeline.with_alive(compute.lifetime_rows(g, outcome, x_mode), b, step)
    x_title = "elapsed compute time (ms)" if x_mode == "time" else "schedule step (op)"
    groups = list(dict.fromkeys(modules.kind))  # of the graph, in its order, not the schedule's: the spec stays the same
    st.vega_lite_chart(spec=timeline.timeline_chart(frame, groups, chosen.x[step], x_domain, x_title),
                       width="stretch", key="memory_timeline")
    alive = timeline.alive_at(b, step)
    st.caption(f"Tensor lifetimes of **{outcome.method}**: one bar per tensor from the step that computes it to the "
               f"step that frees it, stacked where a first-fit allocator would place it, above the fixed memory; "
               f"outlined in red: a recomputed tensor's second life. Coloured by the module that made it (a "
               f"backward op by the module whose activations it reads). At step {step}: "
               f"{int(b.count[alive].sum())} tensors alive, {format_bytes(int(b.bytes[alive].sum()))}."
               + (f" Tensors under {format_bytes(b.threshold)} are grouped per module ({len(b.start)} bars)."
                  if b.threshold else ""))


def why(outcome: compute.Outcome, budget: int) -> None:
    """Why this plan: each recomputed region of a checkpoint plan, what it buys and what it costs."""
    # drawn even when there is nothing to explain: a page whose length changed with the budget would
    # resize the charts above (a scroll bar coming or going) and redraw them from scratch
    box = st.expander("Why this plan", key="memory_why_open", on_change="rerun")
    if not box.open:
        return
    regions = sorted(outcome.plan.recomputed) if outcome.plan else []
    if not regions:
        box.caption(f"{outcome.method}'s schedule has no recomputed checkpoint regions to explain"
                    + (" (it recomputes single ops: see the step line)." if outcome.sim.recomputes else "."))
        return
    ss = st.session_state
    kept = ss.get("memory_why")
    if kept is None or kept[0] is not outcome.schedule or kept[1] != budget:
        kept = ss["memory_why"] = (outcome.schedule, budget, [])
    shown = kept[2]
    if len(shown) < min(len(regions), WHY_AT_ONCE) or ss.pop("memory_why_more", False):
        todo = regions[len(shown):len(shown) + WHY_AT_ONCE]
        with st.spinner(f"Simulating the plan without each of {len(todo)} regions…"):
            shown += timeline.reasons(g, outcome.schedule, budget, compute.node_modules(g), regions=todo)
    with box:
        st.caption("Measured with the simulator, not the solver's model: each region's plan is simulated again "
                   "without it (the bytes it takes off the peak, the compute it costs), and with each of the kept "
                   "segments recomputed in its place (the next best).")
        for r in shown:
            st.markdown("- " + timeline.reason_line(r, budget))
        if len(shown) < len(regions):
            st.button(f"Explain {min(WHY_AT_ONCE, len(regions) - len(shown))} more of {len(regions) - len(shown)}",
                      key="memory_why_more_button", on_click=lambda: ss.update(memory_why_more=True))


WHY_AT_ONCE = 12  # regions explained per click: each costs a few simulations of the whole schedule


def per_rank(out: compute.Outcome, chosen: plots.Curve | None, budget: int) -> None:
    """One FSDP rank's memory over the step, by what holds it."""
    parts = state.rank_breakdown(out)
    x = chosen.x if chosen is not None else np.arange(1, len(out.schedule.ops) + 1, dtype=float)
    st.subheader(f"One rank's memory of {g.fsdp['world']} (FSDP)")
    st.vega_lite_chart(spec=rank.chart(parts, x, "elapsed compute time (ms)" if x_mode == "time" and chosen is not None
                                       else "schedule step (op)", budget), width="stretch", key="memory_rank")
    peak = out.sim.peak_op
    st.caption(f"**{out.method}**'s schedule on one of {g.fsdp['world']} ranks, stacked: at its peak (step {peak}) "
               + ", ".join(f"{r['part']} {r['bytes']}" for r in rank.at_peak(parts, peak)) + ". The FSDP parts are "
               "the simulator's (bonsai_core.fsdp); the allocator's extra is its model's replay.")


COMPILED_COLOUR = "#CC79A7"  # the compiled curves: a colour no method's eager curve has here


def compiled_beside(chosen: compute.Outcome, base, budget: int) -> None:
    """The chosen plan eager and compiled (its checkpoint regions laid onto submodules, the step compiled),
    and each step without a plan, over the share of the step; the two peaks and what compiling frees."""
    m = state.model()
    if not m.compiled:
        if state.compiled_on():  # the Model page's switch is on, but not for this model
            st.info(compute.compile_refusal(m) or "This model was traced with the Compiled switch off: trace it again "
                    "on the Model page (Hugging Face or torchtitan tab) with the switch on to see its compiled curve.",
                    icon=":material/info:")
        return
    st.subheader("The same plan, compiled")
    if chosen.plan is None and chosen.sim.recomputes:
        st.info(f"{chosen.method}'s schedule recomputes single ops, which torch.utils.checkpoint cannot apply, so it "
                "has no compiled form: pick bonsai or chen (checkpoint regions) for the compiled curve.",
                icon=":material/info:")
        return
    with st.spinner(f"Compiling the step with this plan's checkpoints ({compute.COMPILE_MODES[m.compiled]}) through "
                    "inductor…", show_time=True):
        planned = compute.compiled_step(m, chosen.schedule)
        reference = compute.compiled_step(m, None)
    failed = next((r for r in (planned, reference) if isinstance(r, str)), None)
    if failed:
        state.show_error(failed, "The eager curves above are unaffected; trace it again with the switch off.")
        return
    label = "no remat" if chosen.method == "none" else chosen.method
    curves = [plots.curve(f"eager: {label}", chosen.sim.timeline, np.zeros(len(chosen.sim.timeline)), chosen.sim.peak,
                          chosen.sim.peak_op, plots.method_colour(chosen.method), "share"),
              plots.curve(f"compiled: {label}", planned.timeline, np.zeros(len(planned.timeline)), planned.peak,
                          planned.peak_op, COMPILED_COLOUR, "share")]
    if chosen.method != "none":
        curves += [plots.curve("eager: no remat", base.timeline, np.zeros(len(base.timeline)), base.peak, base.peak_op,
                               plots.method_colour("none"), "share", dash="dash"),
                   plots.curve("compiled: no remat", reference.timeline, np.zeros(len(reference.timeline)), reference.peak,
                               reference.peak_op, COMPILED_COLOUR, "share", dash="dash")]
    st.vega_lite_chart(spec=plots.memory_chart(curves, budget, None, "share", height=360), width="stretch",
                       key="memory_compiled_plot")
    freed = chosen.sim.peak - planned.peak
    c = st.columns(3)
    c[0].metric("eager peak", format_bytes(chosen.sim.peak), help=f"{label}'s schedule as simulated on the eager graph.")
    c[1].metric("compiled peak", format_bytes(planned.peak), help="The same plan's checkpoints under torch.compile.")
    c[2].metric("compiling frees", f"{format_bytes(freed)} ({freed / chosen.sim.peak:.1%})" if freed >= 0 else
                f"none: {format_bytes(-freed)} more", help="Eager peak less compiled peak, of the same plan.")
    st.caption(compiled_caption(chosen, planned, reference, base.peak, label))


def compiled_caption(chosen: compute.Outcome, planned: compute.Compiled, reference: compute.Compiled, eager_none: int,
                     label: str) -> str:
    """What the compiled chart shows, in words, with both steps' peaks."""
    freed = chosen.sim.peak - planned.peak
    regions = ", ".join(f"`{r}`" for r in planned.regions[:6]) + (f" and {len(planned.regions) - 6} more"
                                                                    if len(planned.regions) > 6 else "")
    laid = (f"its checkpoint regions laid onto {len(planned.regions)} submodule(s) ({regions}) as `bonsai.plan` lays "
            "them, " if planned.regions else "no checkpoints, ")
    return (f"**{label}** eager (the plan simulated on the traced graph, {len(chosen.schedule.ops)} steps) and the same "
            f"plan compiled ({laid}the step compiled through inductor: {planned.kernels} kernels and buffers, "
            f"{len(planned.timeline)} steps). Eager peak {format_bytes(chosen.sim.peak)} ({chosen.sim.peak:,} B), "
            f"compiled peak {format_bytes(planned.peak)} ({planned.peak:,} B): compiling "
            + (f"frees {format_bytes(freed)} ({freed:,} B, {freed / chosen.sim.peak:.1%})" if freed >= 0 else
               f"holds {format_bytes(-freed)} ({-freed:,} B) more")
            + f". Without a plan (dashed): eager {format_bytes(eager_none)}, compiled {format_bytes(reference.peak)}. "
            "The checkpoints can hold a plan less tightly than it is simulated (a region rebuilt whole, its inputs kept "
            "until then), so a compiled curve can sit above the eager one. "
            "The two steps run different numbers of ops (eager ops, inductor's fused kernels), so each curve is drawn "
            "over the share of its step done. Inductor compiles for the CPU here: a GPU's Triton back-end fuses "
            "what it fuses.")


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
        curves.append(plots.curve(method, out.sim.timeline, compute.step_costs(g, out), out.sim.peak,
                                  out.sim.peak_op, plots.method_colour(method, i), x_mode,
                                  reserved=None if alloc is None else np.asarray(alloc.reserved)))
        if out.sim.offloaded_bytes:  # rule 9: the pinned host bytes, a line of their own
            host = out.sim.host_timeline
            curves.append(plots.curve(f"{method}: on host", host, compute.step_costs(g, out), out.sim.host_peak,
                                      int(np.argmax(host)), plots.method_colour(method, i), x_mode, dash="dot"))
        row = {"schedule": method, "peak": format_bytes(out.sim.peak),
               "peak % of no remat": f"{100 * out.sim.peak / base.peak:.1f}",
               "overhead %": f"{100 * out.sim.overhead:.2f}", "ops": len(out.schedule.ops),
               "recomputed ops": out.sim.recomputes}
        if alloc is not None:
            row |= {"reserved peak": format_bytes(alloc.reserved_peak),
                    "fragmentation %": f"{100 * float(alloc.fragmentation):.1f}"}
        if bounded:
            row["live budget met"] = format_bytes(out.bound.live_budget)
        rows.append(row)
    reference = None
    if not any(r["schedule"] == "none" for r in rows):  # no remat is the reference line
        none = compute.solve(g, None, "none", (), bounded)  # replayed as the plans are (compute.replay)
        alloc = allocation(none)
        reference = plots.curve("no remat", base.timeline, compute.step_costs(g, none), base.peak, base.peak_op,
                                plots.method_colour("none"), x_mode, dash="dash",
                                reserved=None if alloc is None else np.asarray(alloc.reserved))
        row = {"schedule": "no remat", "peak": format_bytes(base.peak), "peak % of no remat": "100.0",
               "overhead %": "0.00", "ops": len(none.schedule.ops), "recomputed ops": 0}
        if alloc is not None:
            row |= {"reserved peak": format_bytes(alloc.reserved_peak),
                    "fragmentation %": f"{100 * float(alloc.fragmentation):.1f}"}
        if bounded:
            row["live budget met"] = "—"
        rows.append(row)

    chosen = state.outcome(s.method)
    state.stand_in_note(chosen)
    chart_slot = st.container()
    step = scrubber(chosen) if chosen.ok else None
    if chosen.ok:
        state.events_table(chosen, key="memory_events")
        step = state.step(chosen)  # a click on an event moved it
    drawn = [*curves, *([reference] if reference is not None else [])]
    x_domain = (0.0, max(float(c.x[-1]) for c in drawn if len(c.x))) if drawn else None
    on_chosen = step is not None and bool(curves) and curves[0].label == s.method
    cursor = float(curves[0].x[step]) if on_chosen else None
    # one mark per block's run of rebuilds (a 32-layer model: 33 marks, not 113), numbered as the events
    marks = [(float(curves[0].x[chosen.sim.events[first].start]), f"↻{first + 1}" + (f"–{last + 1}" if last > first else ""),
              words.replace("`", ""))
             for first, last, words in compute.rebuilds(g, chosen).marks] if on_chosen else []
    with chart_slot:
        for method, error in errors:
            state.show_error(f"{method}: {error}", "Raise the budget in the sidebar or pick another method."
                             if method == s.method else "Raise the budget in the sidebar or untick the method.")
        # keyed, and the budget only in its datasets: each drag updates the chart's data in place (plots.memory_chart)
        st.vega_lite_chart(spec=plots.memory_chart(curves, s.budget, g.peak_lower_bound, x_mode,
                                                   cursor=cursor, x_domain=x_domain if cursor is not None else None,
                                                   events=marks, budget_label=chosen.bound.label, reference=reference),
                           width="stretch", key="memory_plot")
        if bounded:
            st.caption(reserved_bound_caption(chosen))
        elif reserved_on:
            st.caption("Dotted: the bytes PyTorch's caching allocator would reserve for each schedule (the allocator "
                       "model's replay: live tensors plus its rounding and cached free blocks). These plans were solved "
                       "for live bytes, so only the solid lines are held under the budget; What fits can budget the "
                       "reserved bytes instead.")
    if cursor is not None:
        lifetimes(chosen, curves[0], step, x_domain)
        why(chosen, s.budget)
    st.table(rows, hide_index=True)  # a static table: a data grid cost each browser 0.1 CPU-s more per drag
    if chosen.ok:
        compiled_beside(chosen, base, s.budget)
    if g.fsdp is not None and chosen.ok:
        per_rank(chosen, curves[0] if on_chosen else None, s.budget)

    # Drawn only while open (a lazy expander): the address map is a second plotly chart that every budget
    # change would redraw, about 40% of a browser tab's work per slider move, as measured in Chromium.
    address = st.expander("Address space at one moment", key="memory_address_open", on_change="rerun")
    if address.open:
        with address:
            address_space(s)
    if st.session_state.get("memory_playing"):  # the next frame: this fragment again, a step further
        time.sleep(PLAY_SECONDS)
        st.rerun(scope="fragment")


state.follow_budget(memory_over_time)
