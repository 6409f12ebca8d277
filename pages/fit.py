"""What fits: the largest micro-batch (or sequence length) each method trains within a GPU's memory
at an acceptable recompute overhead (``bonsai fit``)."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from bonsai_core import fit
from bonsai_core.budget import parse_budget
from bonsai_core.errors import BonsaiError
from bonsai_core.optimizer import OPTIMIZERS
from bonsai_core.units import format_bytes
from explorer import compute, plots, state

st.title("What fits")
m = state.model()
st.caption("For each method, the largest size of the model whose training step fits the GPU's memory with "
           "a recompute overhead under the limit: the model is traced at each size tried, and every method "
           "solves it. The same search as `bonsai fit`.")
if m.graph.fsdp is not None or m.graph.parallel is not None:  # one rank's memory, by part, at its peak
    from explorer import rank

    out = state.outcome(stand_in=False)
    if out.ok:
        layout = (m.graph.parallel or {}).get("layout")
        what = (" x ".join(f"{k.upper().replace('_', ' ')} {v}" for k, v in layout.items()
                           if k in ("dp_replicate", "fsdp", "cp", "tp", "pp") and v > 1)
                if layout else f"{m.graph.fsdp['world']} (FSDP)")
        st.subheader(f"One rank's memory of {what} at its peak")
        pipeline = (m.graph.parallel or {}).get("pipeline")
        if pipeline:
            st.caption(f"Pipeline rank {pipeline['rank']} of {pipeline['degree']} ({pipeline['schedule']}, "
                       f"{pipeline['microbatches']} microbatches of {pipeline['microbatch_size']}): stage(s) "
                       + ", ".join(str(s) for s, _, _ in pipeline["stages"])
                       + ". Each stage's rank is traced with its own rank on the Model page.")
        table = pd.DataFrame(rank.at_peak(state.rank_breakdown(out), out.sim.peak_op))
        st.table(table, hide_index=True)
        st.caption(f"**{out.method}** at {state.settings().percent:.0f}% of the no-remat peak, step {out.sim.peak_op}: "
                   "what one rank holds (the Memory page draws it over the step). A GPU must hold the sum, the "
                   "allocator's extra included.")
sizes = [k for k in ("batch", "seq") if k in compute.size_options(m.zoo)]
if not sizes:
    st.info("What fits traces the model again at other sizes, so it needs a built-in, Hugging Face or torchtitan model "
            "with a batch size: choose one on the Model page.")
    st.stop()

c1, c2, c3 = st.columns(3)
gpu_text = c1.text_input("GPU memory", value=format_bytes(2 * m.graph.peak_lower_bound).replace(" ", ""),
                         key="fit_gpu", help="bytes, or with a unit: 80GiB, 24GB, 512MiB. It starts at twice the "
                         "current model's lower bound on any schedule's peak, a size where the search has something "
                         "to find; type your GPU's memory.")
vary = c2.selectbox("Size to search", sizes, key="fit_vary")
max_overhead = c3.slider("Largest overhead (%)", 0, 50, 10, key="fit_overhead") / 100
c4, c5, c6 = st.columns(3)
methods = c4.multiselect("Methods", compute.methods(), default=["none", "bonsai", "chen", "dtr"],
                         key="fit_methods")
optimizer = c5.selectbox("Optimizer", OPTIMIZERS, index=OPTIMIZERS.index("adamw"), key="fit_optimizer",
                         help="its state is fixed memory; its step after the backward pass can set the peak")
bound = state.settings().reserved  # the sidebar's reserved bound, when set, is this page's default
reserved = c6.toggle("Budget reserved bytes", value=bound is not None, key="fit_reserved",
                     help=f"the GPU's memory bounds what {compute.ALLOCATORS[bound or 'caching']} reserves, "
                          "not only live tensors (the sidebar's Solver options choose the allocator)")
fixed = {k: v for k, v in m.options.items() if k != vary}
st.caption(f"The GPU memory starts at twice this model's lower bound on any schedule's peak "
           f"({format_bytes(m.graph.peak_lower_bound)}), a made-up size for a small model: type your GPU's memory. "
           f"Model: {m.label}; other sizes fixed at "
           + (", ".join(f"{k} {v}" for k, v in fixed.items()) or "their defaults") + ". Each solve stops after 10 s.")

if st.button("Find what fits", type="primary", key="fit_run", disabled=not methods):
    try:
        limit = parse_budget(gpu_text)
        if limit.fraction is not None:
            raise BonsaiError("Give the GPU's memory in bytes or with a unit (80GiB), not as a share.")
        # the search starts at the model's own size, whose step the session has traced (the search adds the
        # optimizer chosen here to the step as traced, then sets the gradients to None where the model's loop
        # does: a torchtitan step's, kept by compute.traced_step), and asks each method only what its answers so
        # far leave open
        current = {**compute.size_defaults(m.zoo), **m.options}.get(vary, 1)
        progress = st.progress(0.0, text=f"Solving {vary} {current}, the model's own…")
        own = (m.graph if m.graph.optimizer is None and not m.graph.grads_set_to_none
               else compute.traced_step(m.zoo, tuple(sorted(m.options.items()))))
        traced = {current: own}
        live = st.empty()
        rows: list[dict] = []
        began = time.perf_counter()

        def answered(a: fit.Attempt) -> None:
            rows.append({vary: a.size, "method": a.method, "fits": "yes" if a.fits else "no",
                         "overhead": f"{a.overhead:+.2%}" if a.overhead is not None else "",
                         "why not": a.reason, "solve (s)": round(a.seconds, 1),
                         "after (s)": round(time.perf_counter() - began, 1)})
            progress.progress(min(0.95, len(rows) / (4 * len(methods))),
                              text=f"{len(rows)} answers in {time.perf_counter() - began:.0f} s; last: {vary} {a.size}, "
                                   f"{a.method} {'fits' if a.fits else 'does not fit'}")
            live.dataframe(rows, hide_index=True, width="stretch")

        with compute.cpu_seconds():  # the time limits count CPU seconds: the same answers on a loaded server
            result = fit.fit(m.zoo, limit.resolve(0), methods, vary=vary, max_overhead=max_overhead, options=fixed,
                             optimizer=optimizer, reserved=(bound or "caching") if reserved else None,
                             solver_options={"time_limit": 10.0}, start=current, traced=traced, answered=answered)
        live.empty()
        progress.progress(1.0, text=f"Done in {time.perf_counter() - began:.0f} s: {len(result.traces)} sizes traced"
                          + (f" ({vary} {current} reused)" if result.reused else "") + f", {len(result.attempts)} solves.")
        st.session_state["fit_result"] = (m.graph.hash, result)
    except BonsaiError as e:
        state.show_error(str(e), "Change the settings and search again.")

saved = st.session_state.get("fit_result")
if saved and saved[0] == m.graph.hash:
    result = saved[1]
    st.subheader(f"Largest {result.vary} within {format_bytes(result.limit)}")
    st.dataframe(pd.DataFrame(fit.table(result)), hide_index=True, width="stretch")
    st.plotly_chart(plots.fit_figure([a.row() for a in result.attempts], result.vary, result.max_overhead),
                    width="stretch", key="fit_chart")
    st.caption(f"Traced {len(result.traces)} sizes in {sum(result.traces.values()):.1f} s"
               + (f" (the model's own, {result.vary} {', '.join(map(str, result.reused))}, taken from the session)"
                  if result.reused else "")
               + f"; {len(result.attempts)} solves in {sum(a.seconds for a in result.attempts):.1f} s. A method is not "
               "solved at a size its answers decide: it fits below a size it fits and not above one it does not.")
