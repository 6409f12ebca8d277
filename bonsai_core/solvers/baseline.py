"""The ``none`` method: no rematerialization, the reference every other method is measured against."""

from __future__ import annotations

from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, none_schedule


def solve_none(graph: Graph, budget: int | None, *, time_limit: float | None = None) -> Schedule:
    """Compute every node once in listed order and free it after its last use. O(n + edges).

    Options:
        time_limit: seconds (accepted for a uniform interface; this method takes microseconds)
    """
    schedule = none_schedule(graph)
    schedule.stats = {"status": "optimal", "gap": 0.0, "variables": 0, "constraints": 0,
                      "build_seconds": 0.0, "solve_seconds": 0.0}
    return schedule
