"""Model: trace a built-in or Hugging Face model (or an uploaded config.json), or upload a graph / exported program; its summary."""

from __future__ import annotations

from dataclasses import replace

import streamlit as st

from bonsai_core.errors import BonsaiError
from bonsai_core.units import format_bytes
from explorer import compute, state

MAX_CONFIG_BYTES = 256 * 1024  # real config.json files are a few KiB
# how long the Compiled switch makes a trace take at the tabs' defaults, as measured (docs/EXPLORER.md)
HF_COMPILE_SECONDS = ("a trace of hf:llama at its defaults took 16.5 s with the switch on (inductor's cache cold; "
                      "3 s without) and hf:gpt2 9.5 s, and the Memory page's compiled curve of a bonsai plan took 8 "
                      "to 11 s more")
TITAN_COMPILE_SECONDS = "debugmodel at its defaults compiled in 4 s without a plan and 8 s with a plan's checkpoints"

st.title("Model")
st.caption("Trace a training step (forward + loss + backward) into an operator graph, or load one.")

m = state.model()
g = m.graph
summary = g.summary()
reference = compute.no_remat(g).peak
st.subheader(m.label)
if m.note:
    st.info(m.note)
compiled_slot = st.empty()  # the compiled step's summary: filled after the model's (it may compile)
c = st.columns(5)
c[0].metric("operators", summary["nodes"], help=f"{summary['forward_nodes']} forward, "
            f"{summary['backward_nodes']} backward, {summary['views']} views, {summary['edges']} edges"
            + (f"; {summary['inplace_writes']} run in place (relu_, +=): each writes its input's bytes"
               if summary["inplace_writes"] else ""))
params_slot = c[1].empty()  # filled last: counting them imports torch, which the first paint need not wait for
c[2].metric("activation bytes", format_bytes(summary["activation_bytes"]), help="Outputs of all forward ops.")
c[3].metric("no-remat peak", format_bytes(reference), help="Peak of the plain schedule: every op once.")
c[4].metric("lower bound on any peak", format_bytes(summary["peak_lower_bound"]),
            help="Fixed memory + the largest single op with its inputs: no schedule can peak lower.")
c = st.columns(5)
c[0].metric("forward ops", summary["forward_nodes"])
c[1].metric("backward ops", summary["backward_nodes"])
c[2].metric("fixed memory", format_bytes(summary["fixed_mem"]), help="Parameters, gradients, batch.")
c[3].metric("step compute time", f"{summary['total_cost'] * 1e3:.3f} ms", help="Sum of op costs (cost model).")
c[4].metric("lower bound / no-remat", f"{100 * summary['peak_lower_bound'] / reference:.0f}%")

with st.expander("Largest activations"):
    top = sorted(range(g.n), key=lambda v: -int(g.mem[v]))[:15]
    st.dataframe([{"op": g.names[v], "kind": g.ops[v], "phase": g.phases[v], "shape": g.shapes[v],
                   "bytes": format_bytes(int(g.mem[v])), "cost (µs)": round(float(g.cost[v]) * 1e6, 2)} for v in top],
                 hide_index=True, width="stretch")

st.subheader("Change the model")
# the torchtitan tab runs only while open (importing torchtitan takes seconds): a tab change reruns the page
zoo_tab, hf_tab, titan_tab, upload_tab = st.tabs(["Built-in models", "Hugging Face", "torchtitan",
                                                   "Upload a graph or a .pt2"], key="model_tab", on_change="rerun")

from bonsai_core.models import hf, pt2, zoo  # noqa: E402  (imports torch: after the summary is on screen)


def trace_with_progress(what: str, trace, hint: str, compiled: str | None = None) -> None:
    """Run ``trace()`` (-> compute.Model) inside a status box; on success make it the session's model.
    ``compiled`` (a compile mode): the step compiled too, without a plan, the Memory page's reference."""
    with st.status(f"Tracing {what}…", expanded=False) as status:
        try:
            status.write("Building the model under FakeTensorMode and capturing the joint graph (AOTAutograd)…")
            traced = trace()
            if compiled is not None:
                status.write(f"Compiling the step ({compute.COMPILE_MODES[compiled]}) through inductor…")
                traced = replace(traced, compiled=compiled)
                reference = compute.compiled_step(traced, None)
                if isinstance(reference, str):
                    raise BonsaiError(reference)
            status.update(label=f"Traced {traced.label}: {traced.graph.n} ops", state="complete")
            state.set_model(traced)
            st.toast(f"Traced {traced.label}: {traced.graph.n} ops in the graph.")
            st.rerun()  # redraw the summary above for the new model
        except Exception as e:  # ModelError, or torch refusing these sizes (st.rerun is no Exception)
            status.update(label="Tracing failed", state="error")
            message = str(e) if isinstance(e, BonsaiError) else f"Tracing {what} failed ({type(e).__name__}: {e})."
            state.show_error(message, hint)


COMPILED_HELP = ("Also trace the step as torch.compile runs it ({how}), through inductor's own programs on fake "
                 "tensors (its fused kernels, its buffers, the partitioner's saved tensors). Plans stay on the eager "
                 "graph, which the checkpoints apply to; the Memory page draws the compiled step's memory under the "
                 "same plan's checkpoint regions beside the eager curve. Compiling takes time: on this project's "
                 "shared 2-core machine {seconds}; each new plan compiles again (once: it is cached).")


def compiled_switch(key: str, mode: str, how: str, seconds: str, refusal: str | None = None) -> str | None:
    """The "Compiled (torch.compile)" toggle of one tab (its state the session's, shared by the tabs): the
    compile mode to trace with, or None when off or refused (``refusal``, said under it)."""
    ss = st.session_state
    ss[key] = state.compiled_on()
    on = st.toggle("Compiled (torch.compile)", key=key, on_change=lambda: ss.update({state.COMPILED_ON: ss[key]}),
                   help=COMPILED_HELP.format(how=how, seconds=seconds))
    if on and refusal:
        st.info(refusal, icon=":material/info:")
        return None
    return mode if on else None


def compiled_summary(m: compute.Model, eager_peak: int) -> None:
    """The compiled step without a plan against the eager one, for a model traced with the switch on."""
    reference = compute.compiled_step(m, None)
    if isinstance(reference, str):
        state.show_error(reference, "Trace it again with the Compiled switch off, or change its sizes.")
        return
    freed = eager_peak - reference.peak
    st.info(f"Compiled ({compute.COMPILE_MODES[m.compiled]}): without a plan the compiled step peaks at "
            f"**{format_bytes(reference.peak)}** over {reference.kernels} kernels and buffers, "
            f"{format_bytes(abs(freed))} ({abs(freed) / eager_peak:.1%}) {'below' if freed >= 0 else 'above'} the eager "
            "step. Plans are still made on the eager graph; the Memory page draws each plan's compiled curve beside "
            "its eager one.", icon=":material/bolt:")


def size_inputs(prefix: str, defaults: dict[str, int]) -> dict[str, int]:
    """One number input per size option, keyed ``{prefix}_{option}``; the values chosen."""
    cols = st.columns(min(len(defaults), 6) or 1)
    chosen = {}
    for i, (opt, default) in enumerate(defaults.items()):
        key = f"{prefix}_{opt}"
        st.session_state.setdefault(key, int(default))  # state, not value=: a preset button may set it too
        chosen[opt] = int(cols[i % len(cols)].number_input(opt, min_value=1, step=1, key=key))
    return chosen


def changed(chosen: dict[str, int], defaults: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((k, v) for k, v in chosen.items() if v != defaults[k]))


def torchtitan_models() -> None:
    """torchtitan's Llama 3 flavours, their sizes and a Trace button (or how to install torchtitan)."""
    st.markdown(
        "torchtitan's own **Llama 3** (`torchtitan.models.llama3`) with its training loss, its module paths "
        "(`layers.0.attention.wq`), SDPA attention recorded as the flash kernel: the same models as "
        "`bonsai trace torchtitan:llama3:FLAVOUR`, and a plan made here applies to the model a torchtitan run builds.")
    try:
        titan = compute.titan_flavours()
    except BonsaiError as e:
        titan = {}
        st.info(str(e), icon=":material/info:")
    if titan:
        flavours = list(titan)
        flavour = st.selectbox("Flavour", flavours, key="titan_flavour",
                               index=flavours.index("debugmodel") if "debugmodel" in flavours else 0)
        titan_defaults = titan[flavour]
        titan_chosen = size_inputs(f"titan_{flavour}", titan_defaults)
        cols = st.columns(5)
        ranks = int(cols[0].number_input(
            "FSDP ranks", min_value=1, value=1, step=1, key="titan_fsdp",
            help="Plan one GPU of a run sharded over this many: as torchtitan 0.2.2's apply_fsdp shards the model "
                 "(embedding, each block, and norm with output as FSDP2 units) under its bf16 mixed precision; "
                 "each rank holds its share of fp32 parameters and gradients. 1: one GPU, no sharding."))
        layout = {name: int(col.number_input(name.upper(), min_value=1, value=1, step=1, key=f"titan_{name}",
                                             help=why))
                  for col, (name, why) in zip(cols[1:4], (
                      ("tp", "tensor parallel degree: torchtitan's apply_tp (DTensor), on a fake process group"),
                      ("cp", "context parallel degree: the sequence sharded, ring attention"),
                      ("pp", "pipeline parallel degree: one pipeline rank's stage(s), its microbatches in flight")))}
        if layout["pp"] > 1:
            layout["pp_schedule"] = cols[4].selectbox("schedule", ("1f1b", "interleaved-1f1b"), key="titan_schedule")
            layout["rank"] = int(cols[4].number_input("pipeline rank", min_value=0, max_value=layout["pp"] - 1,
                                                      value=0, step=1, key="titan_rank"))
        parallel_on = [k.upper() for k in compute.PARALLEL_DEGREES if layout[k] > 1]
        compiled = compiled_switch(
            "titan_compiled", "blocks", "each TransformerBlock compiled with fullgraph=True, as torchtitan's "
            "apply_compile does", TITAN_COMPILE_SECONDS,
            refusal=f"{', '.join(parallel_on)} > 1: a compiled tensor, context or pipeline parallel rank is not traced "
                    "(the library refuses torch.compile there; FSDP ranks alone are), so this trace is eager only, "
                    "with no compiled curve." if parallel_on else None)
        left, right = st.columns([1, 4])
        if left.button("Trace", type="primary", key="titan_trace"):
            parallel = tuple((k, v) for k, v in layout.items() if v not in (1, 0) or k == "rank" and layout["pp"] > 1)
            titan_options = tuple(sorted(changed(titan_chosen, titan_defaults) + ((("fsdp", ranks),) if ranks > 1 else ())
                                         + parallel))
            trace_with_progress(f"torchtitan:llama3:{flavour}",
                                lambda: compute.trace_model(compute.TITAN_FAMILY + flavour, titan_options),
                                "Change the size options and trace again.", compiled)
        right.caption("Slow to trace, the more so the more layers: on this project's shared 2-core machine "
                      "debugmodel at its defaults (6 layers, batch 1, seq 2048; 1,087 ops) took 7 to 21 s and 8B "
                      "(32 layers; 5,611 ops) 95 s, while both traced in 6 s with 2 layers. Lower `layers` for a "
                      "quick look. A traced size is kept for every session: tracing it again is instant.")


with zoo_tab:
    names = list(zoo.ZOO)
    name = st.selectbox("Model", names, index=names.index("gpt"), key="zoo_name",
                        format_func=lambda n: f"{n} — {zoo.ZOO[n].description}")
    defaults = zoo.ZOO[name].options
    if name == "gpt" and st.button("GPT-2 small sizes", key="gpt2_preset",
                                   help=", ".join(f"{k}={v}" for k, v in zoo.GPT2_SMALL.items())):
        for k, v in zoo.GPT2_SMALL.items():  # before the inputs below exist, so they take these values
            st.session_state[f"zoo_gpt_{k}"] = v
    chosen = size_inputs(f"zoo_{name}", defaults)
    left, right = st.columns([1, 4])
    if left.button("Trace", type="primary", key="trace"):
        options = changed(chosen, defaults)
        trace_with_progress(name, lambda: compute.trace_model(name, options), "Change the size options and trace again.")
    right.caption("GPT-2 small traces in a few seconds into ~1.5k ops; its graph opens collapsed to segments.")
    if st.button("Back to the built-in default", key="reset"):
        state.set_model(compute.default_model(str(state.DEFAULT_GRAPH)))
        st.rerun()

with hf_tab:
    st.markdown(
        "Models of Hugging Face `transformers`, built from their config class (no download, no weights) and "
        "traced with their own training loss (the `labels` path: causal LM, masked LM, image classification or seq2seq LM), "
        "dropout at the config's default, SDPA attention (eager where the model has none). The same models as "
        "`bonsai trace hf:ARCH`; `--attention eager` and `--dtype bf16` there choose the model's own attention "
        "ops and bf16 parameters.")
    archs = list(hf.ARCHS)
    arch = st.selectbox("Architecture", archs, key="hf_arch",
                        format_func=lambda a: f"hf:{a} — {hf.ARCHS[a].description}")
    hf_defaults = hf.ARCHS[arch].options
    hf_chosen = size_inputs(f"hf_{arch}", hf_defaults)
    hf_compiled = compiled_switch("hf_compiled", "model", "torch.compile(model)", HF_COMPILE_SECONDS)
    if st.button("Trace", type="primary", key="hf_trace"):
        hf_options = changed(hf_chosen, hf_defaults)
        trace_with_progress(f"hf:{arch}", lambda: compute.trace_model(f"hf:{arch}", hf_options),
                            "Change the size options and trace again.", hf_compiled)

    st.markdown("**Or your own `config.json`** (as `config.save_pretrained(folder)` writes it; "
                f"up to {MAX_CONFIG_BYTES // 1024} KiB). It is read as JSON data: no code from it or from the Hub "
                "is run (`auto_map` and `trust_remote_code` are never used). Its `architectures` (or else its "
                "`model_type`) must give a causal LM, masked LM, image classification or seq2seq LM (T5, BART) class of `transformers`.")
    config_upload = st.file_uploader("Hugging Face config.json", type=["json"], key="hf_config")
    if config_upload is not None:
        config_bytes = config_upload.getvalue()
        try:
            if len(config_bytes) > MAX_CONFIG_BYTES:
                raise BonsaiError(f"{config_upload.name} is {len(config_bytes):,} bytes; a config.json is at most "
                                  f"{MAX_CONFIG_BYTES // 1024} KiB.")
            described = hf.read_config(hf.parse_config(config_bytes, config_upload.name), source=config_upload.name)
        except BonsaiError as e:
            described = None
            state.show_error(str(e), "Upload a Hugging Face config.json.")
        if described is not None:
            st.caption(f"{described.model_class.__name__}: {described.task}.")
            config_chosen = size_inputs("hf_config", described.options)
            if st.button("Trace this config", type="primary", key="hf_config_trace"):
                config_options = tuple(sorted(config_chosen.items()))
                trace_with_progress(config_upload.name, lambda: compute.trace_hf_config(
                    config_bytes, config_upload.name, config_options), "Change the size options or the config.",
                    hf_compiled)

with titan_tab:
    if titan_tab.open:
        torchtitan_models()

with upload_tab:
    st.markdown(
        "A **bonsai-graph JSON** (from `bonsai trace MODEL -o graph.json`) is read as data. "
        "A **.pt2** from `torch.export.save(torch.export.export(model, example_inputs), 'model.pt2')` is loaded "
        "with `torch.export.load` — only when it holds plain tensors and no pickled objects or compiled code — "
        f"and its training step is traced with the loss **{pt2.LOSS_DESCRIPTION}**. "
        f"Limit: {pt2.MAX_PT2_BYTES // 2**20} MiB.")
    if state.compiled_on():
        st.info("The Compiled switch (Hugging Face and torchtitan tabs) does not apply here: a graph JSON holds no model "
                "to compile, and a .pt2's step is traced from its exported program, not from a module torch.compile "
                "runs. An upload is traced eager only.", icon=":material/info:")
    upload = st.file_uploader("Graph JSON or .pt2", type=["json", "pt2"], key="upload")
    if upload is not None:
        data = upload.getvalue()
        seen = st.session_state.get("loaded_upload")
        if seen is None or seen[:2] != (upload.name, len(data)):
            with st.spinner(f"Loading {upload.name}…"):
                try:
                    loaded, error = compute.load_upload(data, upload.name), None
                except BonsaiError as e:
                    loaded, error = None, str(e)
                except Exception as e:  # e.g. torch failing to trace an exported program
                    loaded, error = None, f"Could not load {upload.name} ({type(e).__name__}: {e})."
            st.session_state["loaded_upload"] = seen = (upload.name, len(data), error)  # tried once: no retry loop
            if loaded is not None:
                state.set_model(loaded)
                st.rerun()
        if seen[2]:
            state.show_error(seen[2], "Upload another file: a bonsai-graph JSON or a .pt2 from torch.export.save.")

parameters = m.parameters
if parameters is None and m.zoo is not None:
    parameters = compute.zoo_parameters(m.zoo, tuple(sorted(m.options.items())))
params_slot.metric("parameters", f"{parameters:,}" if parameters is not None else "—",
                   help="Unknown for an uploaded graph JSON (its fixed memory holds them).")
if m.compiled:
    with compiled_slot.container(), st.spinner("Compiling the step through inductor…", show_time=True):
        compiled_summary(m, reference)
