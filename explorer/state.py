"""Session state in one place: the current model, the schedule settings (sidebar) and the solve.

The sidebar is drawn by the entry script on every run, before the page, so its widgets keep their
values while the user moves between pages. Pages call :func:`model`, :func:`settings` and
:func:`outcome` and never touch ``st.session_state`` keys themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from bonsai_core import solvers
from bonsai_core.budget import format_bytes, parse_budget
from bonsai_core.errors import BonsaiError
from explorer import compute

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GRAPH = ROOT / "assets" / "gpt-default.json"
BACKENDS = ("default", "highs", "scip")
DEFAULT_TIME_LIMIT = 20.0  # seconds per solve; 0 in the sidebar removes it
PREFERRED_METHODS = ("bonsai", "chen", "checkmate", "none")


@dataclass(frozen=True)
class Settings:
    """What the sidebar asks for: the budget in bytes and the solve options the user set."""

    budget: int
    percent: float  # the budget as a share of the no-remat peak
    method: str
    options: compute.Options  # only options the user set, and only those the method takes
    ignored: tuple[str, ...] = ()  # options set but not taken by the method


def model() -> compute.Model:
    if "model" not in st.session_state:
        st.session_state["model"] = compute.default_model(str(DEFAULT_GRAPH))
    return st.session_state["model"]


def set_model(m: compute.Model) -> None:
    st.session_state["model"] = m
    st.session_state.pop("sweep", None)
    st.session_state.pop("granularity_sweep", None)


def default_method() -> str:
    methods = solvers.available_methods()
    return next((m for m in PREFERRED_METHODS if m in methods), methods[0])


def sidebar() -> Settings:
    """Draw the schedule settings in the sidebar and return them."""
    g = model().graph
    reference = compute.no_remat(g).peak
    methods = solvers.available_methods()
    ss = st.session_state
    if ss.get("method") not in methods:
        ss["method"] = default_method()
    if "budget_pct" not in ss:
        ss["budget_pct"] = 100 if ss["method"] == "none" else 70
    sb = st.sidebar
    sb.markdown(f"**{model().label}**  \n{g.n} ops · no-remat peak {format_bytes(reference)}")
    method = sb.selectbox("Method", methods, key="method", format_func=lambda m: m,
                          help="\n".join(f"- **{m}**: {solvers.describe(m)}" for m in methods))
    sb.caption(solvers.describe(method))
    pct = sb.slider("Memory budget (% of the no-remat peak)", min_value=5, max_value=100, step=1, key="budget_pct")
    budget = int(math.floor(pct / 100 * reference))
    exact = sb.text_input("Exact budget (optional)", key="budget_text", placeholder="e.g. 24MiB, 25000000 or 62.5%",
                          help="Overrides the slider: bytes, bytes with a unit (MiB, GB, ...) or a % of the no-remat peak.")
    if exact.strip():
        try:
            budget = parse_budget(exact).resolve(reference)
            pct = 100 * budget / reference
        except BonsaiError as e:
            sb.error(str(e))
    lb = g.peak_lower_bound
    sb.caption(f"Budget **{format_bytes(budget)}** ({budget:,} bytes, {pct:.1f}%) · no schedule fits below "
               f"{format_bytes(lb)} ({100 * lb / reference:.0f}%)")

    accepted = compute.accepted_options(method)
    chosen: dict[str, object] = {}
    with sb.expander("Solver options", expanded=False):
        n_fwd = int(g.is_forward.sum())
        top = max(2, n_fwd)
        if "granularity" not in ss or not 1 <= ss["granularity"] <= top:  # a new model may be smaller
            ss["granularity"] = max(1, min(top, round(2 * math.sqrt(max(n_fwd, 1)))))
        if st.toggle("Set granularity", key="granularity_on",
                     help="Largest segment, in forward ops (segment methods). Off: the method's default."):
            chosen["granularity"] = st.slider("Granularity (max ops per segment)", 1, top, key="granularity")
        backend = st.selectbox("MILP backend", BACKENDS, key="backend")
        if backend != "default":
            chosen["backend"] = backend
        # A visible default: an exact solver on a large graph (bonsai on GPT-2 small) can otherwise
        # hold the page for minutes; at the limit it returns its best schedule (status "feasible").
        ss.setdefault("time_limit", DEFAULT_TIME_LIMIT)
        limit = st.number_input("Time limit (s, 0 = none)", min_value=0.0, max_value=3600.0, step=5.0,
                                key="time_limit")
        if limit > 0:
            chosen["time_limit"] = float(limit)
    options = tuple(sorted((k, v) for k, v in chosen.items() if accepted is None or k in accepted))
    ignored = tuple(sorted(k for k in chosen if accepted is not None and k not in accepted))
    if ignored:
        sb.caption(f"{method} takes no {', '.join(ignored)}: not passed.")
    unnamed = [k for k, _ in options if not compute.names_option(method, k)]
    if unnamed:
        sb.caption(f"{method} does not name {', '.join(unnamed)}: passed, but it may ignore it.")
    s = Settings(budget, pct, method, options, ignored)
    ss["settings"] = s
    return s


def settings() -> Settings:
    return st.session_state["settings"]


def options_for(method: str) -> compute.Options:
    """The sidebar's options that ``method`` takes (all of them for the sidebar's own method)."""
    s = settings()
    if method == s.method:
        return s.options
    accepted = compute.accepted_options(method)
    return tuple((k, v) for k, v in s.options if accepted is None or k in accepted)


def outcome(method: str | None = None) -> compute.Outcome:
    """The current model solved with the sidebar's budget and options (``method`` overrides the
    method, and then only the options that method takes are passed)."""
    s = settings()
    method = method or s.method
    return compute.solve(model().graph, s.budget, method, options_for(method))


def show_error(message: str, hint: str = "") -> None:
    st.error(message + (f"\n\n{hint}" if hint else ""), icon=":material/error:")
