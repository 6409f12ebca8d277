"""The ``none`` method: no rematerialization, the reference every other method is measured against."""

from __future__ import annotations

from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, none_schedule, simulated
from bonsai_core.units import format_bytes


def solve_none(graph: Graph, budget: int | None, *, time_limit: float | None = None) -> Schedule:
    """Compute every node once in listed order and free it after its last use. O(n + edges).
    BudgetError when that plain schedule peaks above ``budget``.

    Options:
        time_limit: seconds (accepted for a uniform interface; this method takes microseconds)
    """
    schedule = none_schedule(graph)
    peak = simulated(graph, schedule).peak  # kept on the schedule: solve's own check reuses it
    if budget is not None and peak > budget:
        raise BudgetError(f"Method 'none' does not rematerialize: {graph.name!r} peaks at {format_bytes(peak)} "
                          f"({peak} bytes) without it, over the budget of {format_bytes(budget)}. Raise the "
                          "budget to at least that, or choose a method that rematerializes (bonsai).")
    schedule.stats = {"status": "optimal", "gap": 0.0, "variables": 0, "constraints": 0,
                      "build_seconds": 0.0, "solve_seconds": 0.0}
    return schedule
