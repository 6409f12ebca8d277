"""The Streamlit explorer: entry script, shared state, cached calls and plot helpers."""
