"""Export: the schedule as JSON, and the runnable model that replays it (a zip)."""

from __future__ import annotations

import json
import re
import shlex

import streamlit as st

from bonsai_core.errors import BonsaiError
from bonsai_core.units import format_bytes
from explorer import compute, state

st.title("Export")


def cli_commands(m: compute.Model, s: state.Settings) -> str:
    """The command lines that make the same schedule and model."""
    flags = " ".join(f"--{k} {v}" for k, v in sorted(m.options.items()))
    solve_flags = " ".join([f"--{k.replace('_', '-')} {v}" if k in compute.GENERIC_OPTIONS else f"--option {k}={v}"
                            for k, v in compute.with_defaults(s.method, s.options)]
                           + (["--reserved"] if s.reserved else []) + (["--expandable-segments"]
                                                                       if s.reserved == "expandable" else []))
    spec = shlex.quote(m.spec_in_commands)
    lines = [f"bonsai trace {spec} {flags}".rstrip() + " -o graph.json",
             f"bonsai solve graph.json --budget {s.budget} --method {s.method} {solve_flags}".rstrip()
             + " -o schedule.json",
             f"bonsai export {spec} {flags}".rstrip() + " schedule.json -o checkpointed/",
             f"bonsai verify {spec} {flags}".rstrip() + " checkpointed/ --device cuda   # on the GPU machine"]
    return "\n".join(lines)


def per_rank_note(m: compute.Model, s: state.Settings, live_peak: int) -> str:
    """How a plan for one of N FSDP ranks reaches a run: the one call on each rank before ``fully_shard``
    (the replay back-end writes one unsharded process's step, so it does not export it)."""
    world = m.graph.fsdp["world"]
    # the one call budgets live bytes: under a reserved bound, the live peak of this page's plan
    budget = live_peak if s.reserved else s.budget
    optimizer = m.graph.optimizer["name"] if m.graph.optimizer else "none"
    common = f'{budget}, method="{s.method}", fsdp={world}, optimizer="{optimizer}"'
    call = (f"`made = bonsai_core.torchtitan.plan_for(model, batch, seq, {common})`, then `made.apply(model)`, then "
            "torchtitan's `parallelize_llama` (its `apply_fsdp`)"
            if m.zoo and m.zoo.startswith(compute.TITAN_FAMILY) else
            f"`bonsai_core.checkpoint(model, batch, loss_fn, budget={common})`, then `fully_shard` on each block and on "
            "the model")
    return (f"This plan is for one of {world} FSDP ranks, so it is applied to the model on each rank before sharding, "
            f"not exported as one process's step: {call}. The call traces your model again and plans it for its "
            "sharding (`plan_for`: torchtitan's; `bonsai_core.checkpoint`: the `reshard_after_forward` and "
            "`mixed_precision` you pass)" + (" (the budget is this plan's live peak: the call budgets live bytes)" if s.reserved else "")
            + ("; give your optimizer (`optimizer=\"adamw\"`) to count its state, which this graph leaves out. "
               if m.graph.optimizer is None else ". ")
            + "docs/REAL_RUNS.md shows it in a torchtitan run. The schedule and graph JSON above are this page's plan.")


def export() -> None:
    """The schedule at the sidebar's budget, to download or to build into a runnable model."""
    s = state.settings()
    m = state.model()
    g = m.graph
    out = state.outcome(stand_in=False)  # the plan of this budget itself, never the sweep's nearest
    if not out.ok:
        state.show_error(out.error, "Nothing to export yet: raise the budget or pick another method in the sidebar.")
        return

    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{(m.spec_in_commands or g.name).split('(')[0]}-{s.method}-{s.budget}")
    st.subheader("Schedule")
    st.markdown(f"The **{s.method}** schedule of **{g.name}** under **{format_bytes(s.budget)}**: {len(out.schedule.ops)} "
                f"ops, peak {format_bytes(out.sim.peak)}, overhead {100 * out.sim.overhead:.2f}% (bonsai-schedule JSON, "
                "version 1; replay it with `bonsai simulate graph.json schedule.json`).")
    c1, c2 = st.columns(2)
    c1.download_button("Download schedule JSON", json.dumps(out.schedule.to_dict(), separators=(",", ":")),
                       file_name=f"{stem}.schedule.json", mime="application/json", type="primary", key="dl_schedule")
    c2.download_button("Download graph JSON", json.dumps(g.to_dict(), separators=(",", ":")),
                       file_name=f"{stem}.graph.json", mime="application/json", key="dl_graph")

    st.subheader("Runnable checkpointed model")
    if g.fsdp is not None:
        st.info(per_rank_note(m, s, out.sim.peak), icon=":material/info:")
    elif m.zoo is None:
        st.info(f"This graph came from an upload ({m.label}), so the explorer cannot rebuild its model to export it. "
                "Export schedules of uploaded graphs with the JSON above; to get a runnable model, trace the model "
                "with `bonsai trace package.module:factory -o graph.json` and use `bonsai export`.")
    else:
        st.markdown("A folder with `checkpointed.py`, `schedule.json` and a `README.md`, zipped. `checkpointed.py` "
                    "replays the schedule: the traced training step (forward, loss, backward, as aten ops) written out "
                    "as straight-line Python in the schedule's order, a recomputation being the same line run again and "
                    "a free a `del`, so the real step allocates what the simulator counted. It does not use "
                    "`torch.utils.checkpoint` and runs with plain PyTorch, sharing your model's parameters. "
                    "`bonsai export --backend checkpoint` applies it to your own module with `torch.utils.checkpoint` "
                    "instead.")
        if st.button("Build the checkpointed model", key="export_build"):
            with st.spinner("Exporting…"):
                try:
                    st.session_state["export_zip"] = (g.hash, s, compute.export_zip(m.zoo, m.options, out.schedule,
                                                                                    stem))
                except BonsaiError as e:
                    state.show_error(str(e))
                except Exception as e:  # an exporter failure: a message, not a traceback
                    state.show_error(f"The export failed ({type(e).__name__}: {e}).",
                                     "Download the schedule JSON and run `bonsai export` to see the full error.")
        built = st.session_state.get("export_zip")
        if built and built[0] == g.hash and built[1] == s:
            st.download_button("Download the checkpointed model (.zip)", built[2], file_name=f"{stem}.zip",
                               mime="application/zip", type="primary", key="dl_zip")
            flags = " ".join(f"--{k} {v}" for k, v in sorted(m.options.items()))
            st.markdown("**Run it on a GPU machine** (same torch version). Check it against the original model — "
                        "loss, gradients, predicted vs measured peak (`torch.cuda.max_memory_allocated`):")
            st.code(f"unzip {stem}.zip\nbonsai verify {shlex.quote(m.spec_in_commands)} {flags} {stem}/ --device cuda"
                    .replace("  ", " "),
                    language="bash")
            st.markdown("Or train with it in plain PyTorch (no bonsai needed; the zip's README.md has the details):")
            st.code(f'import sys; sys.path.insert(0, "{stem}")\nimport checkpointed\n\n'
                    "ck = checkpointed.load(model)          # shares model's parameters\n"
                    "loss = ck(*inputs, loss_fn=loss_fn)    # same loss as loss_fn(model(*inputs))\n"
                    "loss.backward()                        # the scheduled backward pass\n"
                    "optimizer.step(); optimizer.zero_grad()", language="python")
        st.caption("Or from the command line:")
        st.code(cli_commands(m, s), language="bash")


state.follow_budget(export)
