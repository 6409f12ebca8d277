"""Bonsai explorer: `streamlit run explorer/app.py`.

Opens on the built-in default model (a small GPT whose graph ships in assets/)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run` puts explorer/ on the path, not the project root
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from bonsai_core.budget import format_bytes  # noqa: E402
from bonsai_core.graph import load_graph  # noqa: E402
from bonsai_core.schedule import no_remat_peak  # noqa: E402

DEFAULT_GRAPH = ROOT / "assets" / "gpt-default.json"


@st.cache_resource
def default_graph():
    return load_graph(DEFAULT_GRAPH)


st.set_page_config(page_title="Bonsai explorer", layout="wide")
st.title("Bonsai explorer")
st.caption("Optimal tensor rematerialization for PyTorch training: trace, segment, solve, simulate, export.")
g = default_graph()
summary = g.summary()
st.subheader(f"Model: {g.name}")
cols = st.columns(5)
cols[0].metric("operators", summary["nodes"])
cols[1].metric("forward ops", summary["forward_nodes"])
cols[2].metric("no-remat peak", format_bytes(no_remat_peak(g)))
cols[3].metric("fixed memory", format_bytes(g.fixed_mem))
cols[4].metric("lower bound on any peak", format_bytes(g.peak_lower_bound))
