"""A guided first visit: three short steps on the default model, in a box above the page, closed
for good (this session) by its button. It is shown only to a session that opened the app with no
link parameters on the built-in default model, so a shared link or a returning user's bookmark of a
view never shows it."""

from __future__ import annotations

import streamlit as st

from explorer import state

STEPS = (
    ("A training step's memory",
     "Training keeps every activation of the forward pass until the backward pass reads it, so memory "
     "climbs through the forward pass and falls through the backward. Open **Memory** to see it for "
     "this small GPT.", "memory"),
    ("Drag the budget",
     "Drag **Memory budget** in the sidebar below 100%: the method must keep the curve under the red "
     "budget line, so it frees some activations early and recomputes them when the backward pass needs "
     "them (at a little more compute).", None),
    ("See what gets recomputed",
     "Under the curve, one bar per tensor, coloured by the module that made it; red outlines are "
     "recomputed tensors. Press **Play** or drag the step slider to walk through the step, and open "
     "**Why this plan** for what each recomputed module buys.", None),
)


def wanted() -> bool:
    """On the default model, in a session that opened with no link parameters, until closed."""
    ss = st.session_state
    if "tour_step" not in ss:
        ss["tour_step"] = 0 if not st.query_params.to_dict() else None
    m = state.model()
    return ss["tour_step"] is not None and m.zoo == "gpt" and not m.options and m.source == "zoo"


def done_so_far(i: int, page: str) -> int:
    """The step to show: past each step the user has already done (opened Memory; moved the budget)."""
    ss = st.session_state
    ss.setdefault("tour_budget", ss.get("budget_pct"))
    if i == 0 and page == "memory":
        i = 1
    if i == 1 and ss.get("budget_pct") != ss["tour_budget"]:
        i = 2
    return i


def show(page: str = "") -> None:
    """Draw the tour's current step above the page (nothing once closed); ``page``: the page's URL path."""
    if not wanted():
        return
    ss = st.session_state
    i = ss["tour_step"] = done_so_far(ss["tour_step"], page)
    title, text, page = STEPS[i]
    box = st.container(border=True, key="tour")
    box.markdown(f"**Tour {i + 1}/{len(STEPS)}: {title}.** {text}")
    cols = box.columns([1, 1, 1, 5])
    if page is not None:
        cols[0].page_link(str(state.ROOT / "pages" / f"{page}.py"), label=page.capitalize(), icon=":material/show_chart:")
    if i + 1 < len(STEPS) and cols[1].button("Next", key="tour_next", icon=":material/arrow_forward:"):
        ss["tour_step"] = i + 1
        st.rerun()
    if cols[2].button("Close tour" if i + 1 < len(STEPS) else "Done", key="tour_close"):
        ss["tour_step"] = None
        st.rerun()
