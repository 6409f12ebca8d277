"""Shared fixtures: small hand-made graphs and traced zoo graphs (traced once per session)."""

from __future__ import annotations

import pytest

from bonsai_core.graph import Graph
from tests.graphs import chain


@pytest.fixture
def chain4() -> Graph:
    return chain(4)


@pytest.fixture(scope="session")
def traced_zoo():
    """Every zoo model at its default size, traced once: name -> Traced."""
    from bonsai_core.trace import trace_zoo
    from bonsai_core.zoo import ZOO

    return {name: trace_zoo(name) for name in ZOO}
