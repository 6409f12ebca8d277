"""Session state in one place: the current model, the schedule settings (sidebar) and the solve.

The sidebar is drawn by the entry script on every run, before the page, so its widgets keep their
values while the user moves between pages. Pages call :func:`model`, :func:`settings` and
:func:`outcome` and never touch ``st.session_state`` keys themselves.

The budget slider is the one control users drag, so a drag reruns as little as it can: the slider is
drawn in a fragment (:func:`budget_fragment`, after the page) with the part of the page that depends
on the budget, which a page that shows a schedule hands over with :func:`follow_budget`. A drag then
reruns the slider and that part, not the sidebar and the rest of the page: fewer messages to the
browser and less for it to redraw (docs/EXPLORER.md, "Many sessions at once").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from bonsai_core.budget import parse_budget
from bonsai_core.errors import BonsaiError, ModelError
from bonsai_core.units import format_bytes
from explorer import ahead, compute

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GRAPH = ROOT / "assets" / "gpt-default.json"
BACKENDS = ("default", "highs", "scip")
DEFAULT_TIME_LIMIT = 20.0  # seconds per solve; 0 in the sidebar removes it
PREFERRED_METHODS = ("bonsai", "chen", "checkmate", "none")
BOUNDS = {"live": "live bytes", **{policy: f"reserved bytes: {name}" for policy, name in compute.ALLOCATORS.items()}}


@dataclass(frozen=True)
class Settings:
    """What the sidebar asks for: the budget in bytes and the solve options the user set."""

    budget: int
    percent: float  # the budget as a share of the no-remat peak
    slider: bool  # the budget is the slider's (not typed in "Exact budget")
    method: str
    options: compute.Options  # only options the user set, and only those the method takes
    ignored: tuple[str, ...] = ()  # options set but not taken by the method
    reserved: str | None = None  # the budget bounds this allocator's reserved bytes (compute.ALLOCATORS), not live


COMPILED_ON = "compiled_on"  # the Model page's Compiled switch, kept for the session whichever tab shows it


def compiled_on() -> bool:
    """Whether the Model page's Compiled switch is on (a model traced so has ``Model.compiled``)."""
    return bool(st.session_state.get(COMPILED_ON))


def model() -> compute.Model:
    if "model" not in st.session_state:
        st.session_state["model"] = compute.default_model(str(DEFAULT_GRAPH))
    return st.session_state["model"]


def set_model(m: compute.Model) -> None:
    st.session_state["model"] = m
    st.session_state.pop("sweep", None)
    st.session_state.pop("granularity_sweep", None)


def default_method() -> str:
    methods = compute.methods()
    return next((m for m in PREFERRED_METHODS if m in methods), methods[0])


def sidebar() -> tuple[DeltaGenerator, DeltaGenerator]:
    """Draw the schedule settings in the sidebar; the URL's query parameters set them on a session's
    first run and mirror them after every run (a shareable link). Returns the budget slider's place,
    left for :func:`budget_fragment`, and the place under it for :func:`sweep_watch`."""
    restore_view()
    g = model().graph
    reference = compute.no_remat(g).peak
    methods = compute.methods()
    ss = st.session_state
    ss.pop("budget_view", None)  # one a run stopped before budget_fragment left behind
    if ss.get("method") not in methods:
        ss["method"] = default_method()
    if "budget_pct" not in ss:
        ss["budget_pct"] = 100 if ss["method"] == "none" else 70
    sb = st.sidebar
    if ss.get("view_problem"):
        sb.warning(ss.pop("view_problem"), icon=":material/link_off:")
    sb.markdown(f"**{model().label}**  \n{g.n} ops · no-remat peak {format_bytes(reference)}")
    method = sb.selectbox("Method", methods, key="method", format_func=lambda m: m,
                          help="\n".join(f"- **{m}**: {compute.describe(m)}" for m in methods))
    sb.caption(compute.describe(method))
    budget_slot = sb.container()
    sweep_slot = sb.container()
    exact = sb.text_input("Exact budget (optional)", key="budget_text", placeholder="e.g. 24MiB, 25000000 or 62.5%",
                          help="Overrides the slider: bytes, bytes with a unit (MiB, GB, ...) or a % of the no-remat peak.")
    if exact.strip():
        try:
            parse_budget(exact)
        except BonsaiError as e:
            sb.error(str(e))

    accepted = compute.accepted_options(method)
    chosen: dict[str, object] = {}
    with sb.expander("Solver options", expanded=False):
        bound = st.selectbox("The budget bounds", BOUNDS, key="budget_bound", format_func=BOUNDS.get,
                             help="Live bytes: the tensors alive, what every method plans. Reserved bytes: what the "
                                  "allocator model reserves for them (rounding and cached free blocks included), "
                                  "which a GPU must hold: the method is asked for lower live budgets until its "
                                  "plan's reserved peak fits (`bonsai solve --reserved`).")
        if st.toggle("Set granularity", key="granularity_on", on_change=start_at_plans_granularity,
                     help="Largest segment, in forward ops (segment methods). Off: the method's default "
                          "(bonsai's \"auto\"). Switched on, it starts at the granularity the current plan used."):
            positions = granularity_positions(g, ss.get("granularity_extra"))
            if ss.get("granularity") not in positions:  # a new model: its own positions
                ss["granularity"] = default_granularity(g)
            chosen["granularity"] = st.select_slider(
                "Granularity (max non-view ops per segment)", positions, key="granularity",
                help="Segments hold at most this many ops that are not views; the views ride with their base "
                     "uncounted (they cost nothing to rebuild), so a segment's op count in the Solve table is "
                     "larger. The positions: a log scale from 1 up to the largest granularity bonsai's \"auto\" "
                     "tries, with all it tries among them (d, 2d, 4d, 8d; d = 2·√ops).")
        backend = st.selectbox("MILP backend", BACKENDS, key="backend")
        if backend != "default":
            chosen["backend"] = backend
        # A visible default: an exact solver on a large graph (bonsai on GPT-2 small) can otherwise
        # hold the page for minutes; at the limit it returns its best schedule (status "feasible").
        ss.setdefault("time_limit", DEFAULT_TIME_LIMIT)
        limit = st.number_input("Time limit (s, 0 = none)", min_value=0.0, max_value=3600.0, step=5.0,
                                key="time_limit",
                                help="Seconds of the solve's own CPU time, so that a busy machine finds the same "
                                     "plans (only slower); past it the method returns its best plan so far.")
        if limit > 0:
            chosen["time_limit"] = float(limit)
        for spec in compute.method_options(method):  # chen's variant, dtr's heuristic, moccasin's copies...
            value = option_widget(method, spec)
            if value is not None and value != spec.default:
                chosen[spec.name] = value
    options = tuple(sorted((k, v) for k, v in chosen.items() if accepted is None or k in accepted))
    ignored = tuple(sorted(k for k in chosen if accepted is not None and k not in accepted))
    if ignored:
        sb.caption(f"{method} takes no {', '.join(ignored)}: not passed.")
    unnamed = [k for k, _ in options if not compute.names_option(method, k)]
    if unnamed:
        sb.caption(f"{method} does not name {', '.join(unnamed)}: passed, but it may ignore it.")
    budget, percent, slider = current_budget()
    ss["settings"] = Settings(budget, percent, slider, method, options, ignored, None if bound == "live" else bound)
    return budget_slot, sweep_slot


def default_granularity(g) -> int:
    """The paper's default granularity of ``g`` (bonsai's first "auto" rung: 2·√(non-view forward ops))."""
    from bonsai_core.segment import default_granularity as paper_default

    return paper_default(g)


def granularity_positions(g, also: int | None = None) -> list[int]:
    """The granularities the sidebar offers on ``g``: about 1.5 apart from 1 (1, 2, 3, 4, 6, 8, 12, 16, 24,
    ...) up to the top of bonsai's "auto" ladder (d, 2d, 4d, 8d, all offered; d = 2·√ops: past 8d a model
    grows past what auto ever builds, millions of candidates on an 8B step), and ``also`` (a link's value,
    the current plan's)."""
    from bonsai_core.segment import op_count
    from bonsai_core.solvers.bonsai import auto_ladder

    ladder = auto_ladder(g)
    top = max(2, ladder[-1])
    scale = {v * k for k in (1, 1.5) for v in (2 ** np.arange(int(math.log2(top)) + 1)).tolist()}
    wanted = {int(v) for v in scale if v <= top} | {top} | set(ladder)
    if also is not None and 1 <= int(also) <= max(2, op_count(g)):
        wanted.add(int(also))
    return sorted(wanted)


def start_at_plans_granularity() -> None:
    """The granularity toggle switched on: the slider starts at the granularity the current plan used
    (bonsai's "auto" choice), so that switching it on does not change the plan."""
    ss = st.session_state
    if not ss.get("granularity_on") or "settings" not in ss:
        return
    s = ss["settings"]
    out = compute.solve(model().graph, s.budget, s.method, s.options, s.reserved)  # the plan on screen: cached
    used = out.schedule.stats.get("granularity") if out.ok else None
    if isinstance(used, int) and used >= 1:
        ss["granularity"] = ss["granularity_extra"] = used  # kept among the positions: they stay the same


def current_budget() -> tuple[int, float, bool]:
    """(budget in bytes, as a % of the no-remat peak, whether it is the slider's) as the slider and
    the exact field now say; an exact budget that cannot be read leaves the slider's (the sidebar
    says why)."""
    ss = st.session_state
    reference = compute.no_remat(model().graph).peak
    exact = ss.get("budget_text", "").strip()
    if exact:
        try:
            budget = parse_budget(exact).resolve(reference)
            return budget, 100 * budget / reference, False
        except BonsaiError:
            pass
    pct = ss["budget_pct"]
    return ahead.budget_at(pct, reference), float(pct), True


def follow_budget(view: Callable[[], None]) -> None:
    """Have ``view``, the part of this page that depends on the budget (drawn last on the page), run
    in :func:`budget_fragment`: each drag of the slider reruns it. It reads :func:`settings` and
    :func:`outcome` as usual; its own widgets rerun it alone too."""
    st.session_state["budget_view"] = view


def budget_fragment(slot: DeltaGenerator) -> None:
    """Run by the entry script after the page: the budget slider and the budget it gives, in their
    place in the sidebar (``slot``), then the page's :func:`follow_budget` view, as one fragment."""
    view = st.session_state.pop("budget_view", None)

    def budget_and_view() -> None:
        budget_controls(slot)
        if view is not None:
            view()

    st.fragment(budget_and_view)()


def budget_controls(slot: DeltaGenerator) -> None:
    """The slider and its budget in ``slot``; brings the settings up to date with them (a drag reruns
    this, not :func:`sidebar`) and mirrors the view in the URL."""
    ss = st.session_state
    slot.slider("Memory budget (% of the no-remat peak)", min_value=ahead.SLIDER.start,
                max_value=ahead.SLIDER.stop - 1, step=1, key="budget_pct")
    budget, percent, slider = current_budget()
    s = ss["settings"] = replace(ss["settings"], budget=budget, percent=percent, slider=slider)
    g = model().graph
    reference, lb = compute.no_remat(g).peak, g.peak_lower_bound
    slot.caption(f"Budget **{format_bytes(s.budget)}** ({s.budget:,} bytes, {s.percent:.1f}%) · no schedule fits "
                 f"below {format_bytes(lb)} ({100 * lb / reference:.0f}%)")
    if ss.get("tour_step") == 1 and ss.get("tour_budget") not in (None, ss["budget_pct"]):
        st.rerun()  # the tour's "drag the budget" is done: the whole app, to show its next step
    params = view_params(s.method)
    if params != st.query_params.to_dict():  # each change is a message to the browser
        st.query_params.from_dict(params)


WATCH_SECONDS = 1.0  # how often a session looks at a running sweep


def sweep_watch(slot: DeltaGenerator) -> None:
    """Under the budget slider: how far the background sweep of the sidebar's settings is, looked at every
    WATCH_SECONDS while it runs (a fragment of its own); once it has solved the position the page showed
    a stand-in for, or it is done (what a drag draws beside each plan prepared too), the page is drawn again."""
    s = st.session_state.get("settings")
    if s is None or not s.slider or not ahead.enabled():
        return
    g = model().graph
    first = ahead.progress(g, s.method, s.options, s.reserved, int(s.percent))
    watching = first is not None and not first.done

    def watch() -> None:
        ss = st.session_state
        now = ss["settings"]  # a drag since may have moved it
        sweep, p = ahead.find(g, now.method, now.options, now.reserved, int(now.percent))
        if sweep is None:
            return
        done = p in sweep.solved or p in sweep.derived
        if (ss.get("stand_in") and done) or (watching and sweep.done):
            ss["stand_in"] = False
            st.rerun()  # the whole page: its plan is solved now (or the sweep ended: stop looking)
        what = "granularities" if sweep.axis == ahead.GRANULARITY else "budgets"
        total = len(sweep.positions)
        line = (f"Swept {sweep.known} of {total} {what} in {sweep.seconds:.0f} s"
                + ("" if sweep.ended is None else " (done: each answers at once)" if sweep.done else
                   " (each answers at once; the charts beside the plans are prepared in the background)")
                + ("" if done or sweep.ended is not None else
                   "; this one is next, shown meanwhile: the nearest solved plan"))
        slot.progress(sweep.known / total, text=line)

    st.fragment(watch, run_every=WATCH_SECONDS if watching else None)()


def option_widget(method: str, spec: compute.OptionSpec, key: str | None = None, label: str | None = None,
                  where=st) -> object:
    """The widget of one method-specific option, at the method's default until set, drawn in ``where``
    (the sidebar's expander by default; the Compare page's sides give their own ``key`` and ``label``);
    returns its value (None for an empty text)."""
    key = key or f"opt_{method}_{spec.name}"
    st.session_state.setdefault(key, spec.default)  # state, not value=: a link may have set it
    label, helptext = label or f"{spec.name} ({method})", spec.help or None
    if spec.choices:
        return where.selectbox(label, spec.choices, key=key, help=helptext)
    if spec.kind is bool:
        return where.toggle(label, key=key, help=helptext)
    if spec.kind in (int, float):
        return where.number_input(label, key=key, help=helptext, step=1 if spec.kind is int else None,
                                  placeholder="method default")
    return where.text_input(label, key=key, help=helptext) or None


# -- the view as a link ------------------------------------------------------------------------------
# ?model=NAME&size=k:v,...&method=M&budget=PCT&exact=TEXT&granularity=K&backend=B&time_limit=S&bound=POLICY&o.NAME=V
# (the page is the URL's path). Only what differs from the defaults is written.

# a zoo, hf or torchtitan name, or an uploaded config's key; never a module path to import nor a file's path
SAFE_MODEL = re.compile(r"^(hf:|torchtitan:llama3:|hf-config:)?[A-Za-z0-9_-]+$")


def view_params(method: str) -> dict[str, str]:
    """The current view as query parameters."""
    ss = st.session_state
    m = model()
    params: dict[str, str] = {}
    if m.link_name is not None and (m.link_name != "gpt" or m.options):
        params["model"] = m.link_name
        if m.options:
            params["size"] = ",".join(f"{k}:{v}" for k, v in sorted(m.options.items()))
    params["method"] = method
    params["budget"] = str(ss["budget_pct"])
    if ss.get("budget_text", "").strip():
        params["exact"] = ss["budget_text"].strip()
    if ss.get("granularity_on"):
        params["granularity"] = str(ss["granularity"])
    if ss.get("backend", "default") != "default":
        params["backend"] = ss["backend"]
    if ss.get("time_limit", DEFAULT_TIME_LIMIT) != DEFAULT_TIME_LIMIT:
        params["time_limit"] = f"{ss['time_limit']:g}"
    if ss.get("budget_bound", "live") != "live":
        params["bound"] = ss["budget_bound"]
    for spec in compute.method_options(method):
        value = ss.get(f"opt_{method}_{spec.name}")
        if value is not None and value != spec.default:
            params[f"o.{spec.name}"] = str(value)
    return params


def restore_view() -> None:
    """On a session's first run, set the model and the sidebar's widgets from the query parameters;
    a value that cannot be used is named in the sidebar and left at its default."""
    ss = st.session_state
    if ss.get("view_restored"):
        return
    ss["view_restored"] = True
    q = st.query_params
    method = q.get("method", "")
    methods = compute.methods()
    # query parameter -> the session-state items it sets (raising ValueError when unusable)
    parsers = {
        "model": lambda v: restore_model(v, q.get("size", "")),
        "method": lambda v: {"method": _one_of("method", v, methods)},
        "budget": lambda v: {"budget_pct": min(ahead.SLIDER.stop - 1, max(ahead.SLIDER.start, int(v)))},
        "exact": lambda v: {"budget_text": v},
        "granularity": lambda v: {"granularity": max(1, int(v)), "granularity_extra": max(1, int(v)),
                                  "granularity_on": True},
        "backend": lambda v: {"backend": _one_of("backend", v, BACKENDS)},
        "time_limit": lambda v: {"time_limit": max(0.0, min(3600.0, float(v)))},
        "bound": lambda v: {"budget_bound": _one_of("bound", v, BOUNDS)},
    }
    for spec in compute.method_options(method) if method in methods else ():
        parsers[f"o.{spec.name}"] = lambda v, spec=spec: {f"opt_{method}_{spec.name}": spec.parse(v)}
    problems = []
    for name, parse in parsers.items():
        if name in q:
            try:
                ss.update(parse(q[name]))
            except (ValueError, BonsaiError) as e:
                problems.append(f"{name}={q[name]} ({e})")
    if problems:
        ss["view_problem"] = "The link's view was not fully restored: " + "; ".join(problems) + "."


def _one_of(what: str, value: str, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"no {what} is called {value!r}")
    return value


def restore_model(name: str, size: str) -> dict:
    """Trace the zoo model a link names (the default's graph is already loaded); sets no widget."""
    if not SAFE_MODEL.match(name):
        raise ModelError("not a built-in model name")
    # sizes and degrees are whole numbers; a pipeline schedule is a name
    options = tuple(sorted((k, int(v) if v.isdigit() else v) for k, v in (item.split(":", 1) for item in size.split(",")
                                                                           if item)))
    if name != "gpt" or options:
        with st.spinner(f"Tracing {name} for the link's view…", show_time=True):
            try:
                set_model(compute.trace_stored_config(name.removeprefix(compute.CONFIG_LINK), options)
                          if name.startswith(compute.CONFIG_LINK) else compute.trace_model(name, options))
            except BonsaiError:
                raise
            except Exception as e:  # torch refusing these sizes
                raise ModelError(f"tracing failed ({type(e).__name__}: {e})") from e
    return {}


def settings() -> Settings:
    return st.session_state["settings"]


def options_for(method: str) -> compute.Options:
    """The sidebar's options that ``method`` takes (all of them for the sidebar's own method)."""
    s = settings()
    if method == s.method:
        return s.options
    accepted = compute.accepted_options(method)
    return tuple((k, v) for k, v in s.options if accepted is None or k in accepted)


def outcome(method: str | None = None, stand_in: bool = True) -> compute.Outcome:
    """The current model solved with the sidebar's budget and options (``method`` overrides the
    method, and then only the options that method takes are passed). At a slider position the
    background sweep has not solved yet, the nearest plan it has (``Outcome.stand_in_for``; not with
    ``stand_in=False``, which solves it)."""
    s = settings()
    method = method or s.method
    options = options_for(method)
    g = model().graph
    swept = method == s.method and s.slider  # the slider's positions are swept in the background
    if swept and stand_in:
        known = ahead.answer(g, method, options, s.reserved, int(s.percent))
        if known is not None:
            if known.stand_in_for is not None:
                st.session_state["stand_in"] = True  # sweep_watch draws the page again once it is solved
            return known
    limit = dict(options).get("time_limit")
    # shown only when the solve is not cached (after st.spinner's half-second delay)
    bounded = f"reserved bytes ({compute.ALLOCATORS[s.reserved]}) under" if s.reserved else "under"
    with st.spinner(f"Solving: **{method}**, {bounded} {format_bytes(s.budget)} ({s.percent:.1f}% of the no-remat "
                    "peak), " + (f"time limit {limit:g} s" if limit else "no time limit") + "…", show_time=True):
        out = compute.solve(g, s.budget, method, options, s.reserved)
    if swept:  # solve the slider's other positions (and the granularities, when set) while the user looks
        ss = st.session_state
        offered = granularity_positions(g, ss.get("granularity_extra")) if ss.get("granularity_on") else None
        ahead.start(g, out, compute.no_remat(g).peak, int(s.percent), offered)
    return out


def stand_in_note(out: compute.Outcome) -> None:
    """Say that the plan shown is the sweep's nearest, not this position's own (yet)."""
    if out.stand_in_for is None:
        return
    s = settings()
    own = (f"{100 * out.budget / compute.no_remat(model().graph).peak:.0f}% of the no-remat peak"
           if dict(out.options).get("granularity") == dict(s.options).get("granularity")
           else f"granularity {dict(out.options).get('granularity')}")
    fits = out.ok and out.sim.peak <= s.budget
    st.info(f"Not solved yet: shown meanwhile is the plan the background sweep solved at {own} (the nearest "
            + ("solved; it fits this budget" if fits else "solved; it does not fit this budget") + "). This position "
            "is solved next, and the page updates when it is.", icon=":material/hourglass_top:")


def theme() -> str | None:
    """"light" or "dark" as the browser reports it (None when it has not yet, e.g. in tests)."""
    kind = getattr(getattr(st.context, "theme", None), "type", None)
    return kind if kind in ("light", "dark") else None


def show_error(message: str, hint: str = "") -> None:
    st.error(message + (f"\n\n{hint}" if hint else ""), icon=":material/error:")


# -- the step cursor and the recompute events, shared by the Graph and Memory pages ------------------

def step(out: compute.Outcome) -> int:
    """The shared step cursor on ``out``'s schedule: a new schedule starts at its peak."""
    ss = st.session_state
    if ss.get("cursor_of") is not out.schedule:
        ss["cursor_of"] = out.schedule
        ss["cursor_step"] = max(0, min(out.sim.peak_op, len(out.schedule.ops) - 1))
    return ss["cursor_step"]


def set_step(out: compute.Outcome, at: int) -> None:
    ss = st.session_state
    ss["cursor_of"], ss["cursor_step"] = out.schedule, max(0, min(int(at), len(out.schedule.ops) - 1))


def node_modules(g):
    """Each node's module (``explorer.timeline.node_modules``), once per graph for every session."""
    return compute.node_modules(g)


def events_table(out: compute.Outcome, key: str) -> int | None:
    """The schedule's recompute events (the simulator's, in order) as a table: one row per pattern when
    rebuilds repeat in the blocks of the model (``events.patterns``; *every rebuild* lists them one by
    one); a click on a row moves the step cursor to the end of that rebuild (a pattern's first). Returns
    the event under the cursor (its index) or None."""
    from explorer import events

    g = model().graph
    found = out.sim.events
    if not found:
        st.caption(f"**{out.method}** recomputes nothing at this budget: every activation is kept until the "
                   "backward pass reads it.")
        return None
    modules = node_modules(g)
    grouped = compute.rebuilds(g, out).patterns
    repeats = len(grouped) < len(found)
    every = not repeats or st.toggle("every rebuild", key=f"{key}_every",
                                     help="One row per rebuild, in the order they run, instead of one per pattern.")
    table = key if every else f"{key}_patterns"

    def picked() -> None:
        rows = st.session_state[table].selection.rows
        if rows:
            set_step(out, found[rows[0] if every else grouped[rows[0]].events[0]].end)

    if every:
        st.markdown(f"**{len(found)} recompute events** of {out.method}, in the order they run "
                    "(↻ marks them on the memory curve); click one to move the step cursor there.")
        rows = events.event_rows(g, found, modules)
    else:
        st.markdown(f"**{len(found)} recompute events** of {out.method} in **{len(grouped)} patterns**: a rebuild "
                    "repeated in several blocks of the model is one row, with the blocks it runs in (`layers.*` "
                    "stands for each of them). Click one to move the step cursor to its first rebuild. On the memory curve "
                    "↻ marks each block's run of rebuilds, numbered by rebuild in the order they run; hover one for "
                    "its patterns.")
        rows = compute.rebuilds(g, out).pattern_rows
    st.dataframe(rows, hide_index=True, width="stretch", key=table, on_select=picked, selection_mode="single-row",
                 height=min(36 * len(rows) + 40, 260))
    now = events.current(found, step(out))
    if now is not None:
        st.markdown(f"**↻{now + 1}** " + events.event_line(g, found[now], modules))
    return now


def rank_breakdown(out: compute.Outcome) -> dict:
    """One FSDP rank's memory of a solved schedule by part (``explorer.rank``), with the allocator's
    extra when its model replays the schedule."""
    return compute.rank_parts(model().graph, out)
