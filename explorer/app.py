"""Bonsai explorer: ``streamlit run explorer/app.py`` (or ``bonsai app``).

The entry script: page setup, the shared sidebar (model + schedule settings) and the navigation.
It opens on the built-in default model, a small GPT whose graph ships in ``assets/``. Each page in
``pages/`` reads like a description of what the user sees; state, cached calls and plots live in
``explorer/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run` puts explorer/ on the path, not the project root
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from explorer import state, tour  # noqa: E402

st.set_page_config(page_title="Bonsai explorer", page_icon=str(ROOT / "assets" / "icon.svg"), layout="wide")

PAGES = [
    st.Page(ROOT / "pages" / "model.py", title="Model", icon=":material/account_tree:", default=True),
    st.Page(ROOT / "pages" / "graph.py", title="Graph", icon=":material/hub:", url_path="graph"),
    st.Page(ROOT / "pages" / "solve.py", title="Solve", icon=":material/calculate:", url_path="solve"),
    st.Page(ROOT / "pages" / "memory.py", title="Memory", icon=":material/show_chart:", url_path="memory"),
    st.Page(ROOT / "pages" / "compare.py", title="Compare", icon=":material/balance:", url_path="compare"),
    st.Page(ROOT / "pages" / "fit.py", title="What fits", icon=":material/memory:", url_path="fit"),
    st.Page(ROOT / "pages" / "export.py", title="Export", icon=":material/download:", url_path="export"),
]

st.logo(str(ROOT / "assets" / "logo.svg"), icon_image=str(ROOT / "assets" / "icon.svg"), size="large")
page = st.navigation(PAGES)
budget_slot, sweep_slot = state.sidebar()
tour.show(page.url_path)  # a first visit's three steps, above the page; each advances once done
page.run()
state.budget_fragment(budget_slot)  # the budget slider, and what the page hands to state.follow_budget
state.sweep_watch(sweep_slot)  # how far the background sweep is
