"""The one family of errors a user can cause.

Every message says what was wrong and what to do; the CLI prints it without a traceback and exits 1,
the app shows it with ``st.error``.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


class BonsaiError(Exception):
    """Base class of every error a user can cause (bad file, bad budget, unknown model, ...). ``stats``: what
    a solver had measured when it failed (the size of the model it built), for a report; empty otherwise."""

    stats: Mapping[str, Any] = MappingProxyType({})


class GraphError(BonsaiError):
    """A bonsai-graph file or object is malformed."""


class ScheduleError(BonsaiError):
    """A schedule breaks the simulator's rules or does not belong to the graph."""


class BudgetError(BonsaiError):
    """A budget could not be parsed, or no schedule of the method fits under it. ``smallest``: the
    smallest budget the method meets, where it knows one (solving again at it returns a schedule).
    ``timed_out``: the method's time limit ran out before it found one, which says nothing of the budget."""

    def __init__(self, message: str = "", smallest: int | None = None, timed_out: bool = False,
                 stats: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.smallest = smallest
        self.timed_out = timed_out
        self.stats = stats or self.stats


class ModelError(BonsaiError):
    """A model could not be found, built or traced."""


class ValueReadError(ModelError):
    """Building or tracing a model read a tensor's value, which fake tensors (shapes only) do not have."""


class SolverError(BonsaiError):
    """A solver failed, timed out without a solution, or is not installed. ``timed_out``: its time limit ran out
    before it found a schedule."""

    def __init__(self, message: str = "", timed_out: bool = False, stats: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.stats = stats or self.stats
