"""Shared fixtures: small hand-made graphs and traced zoo graphs (traced once per session)."""

from __future__ import annotations

import os

import pytest

from bonsai_core.graph import Graph
from tests.graphs import chain

# The explorer solves the budget slider's other positions in a background thread (explorer/ahead.py):
# off for the whole run (it would compete with every other test for the two cores, and the app tests
# measure what a session solves). The tests of that thread and the ten-session test turn it on.
os.environ.setdefault("BONSAI_SOLVE_AHEAD", "0")


@pytest.fixture
def chain4() -> Graph:
    return chain(4)


@pytest.fixture(scope="session")
def traced_zoo():
    """Every zoo model at its default size, traced once: name -> Traced."""
    from bonsai_core.models.zoo import ZOO
    from bonsai_core.trace import trace_model

    return {name: trace_model(name) for name in ZOO}
