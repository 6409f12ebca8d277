"""One time limit for a method's whole ``solve`` call, however many inner solves it makes."""

from __future__ import annotations

import time

from bonsai_core.errors import SolverError


class Deadline:
    """``time_limit`` seconds from now (None: no limit), shared by every inner solve and search of
    one method call: :meth:`remaining` and :meth:`passed` to decide, :meth:`left` to give an inner
    solve its share (or fail saying what used the time up)."""

    def __init__(self, time_limit: float | None) -> None:
        if time_limit is not None and not time_limit > 0:
            raise SolverError(f"time_limit is {time_limit}; give a positive number of seconds (or none).")
        self.time_limit = time_limit
        self.start = time.perf_counter()

    def remaining(self) -> float | None:
        """Seconds left, possibly negative (None: no limit)."""
        return None if self.time_limit is None else self.time_limit - (time.perf_counter() - self.start)

    def passed(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

    def left(self, method: str, spent_on: str) -> float | None:
        """Seconds left for the next inner solve (None: no limit); SolverError if none are, saying
        what used them up (``spent_on``) and what to do."""
        if self.time_limit is None:
            return None
        left = self.time_limit - (time.perf_counter() - self.start)
        if left <= 0:
            raise SolverError(
                f"Method {method!r} found no schedule within the time limit of {self.time_limit:g} s: "
                f"{spent_on} took {time.perf_counter() - self.start:.1f} s. Raise --time-limit, or use "
                "method 'bonsai' on a graph this large.", timed_out=True)
        return left


class OutOfTime(SolverError):
    """A step that cannot return part of its work (building a model) stopped at the deadline."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message, timed_out=True)


def check(clock: Deadline | None, what: str) -> None:
    """Raise :class:`OutOfTime` when ``clock`` has passed (None: no limit)."""
    if clock is not None and clock.passed():
        raise OutOfTime(f"{what} stopped at the time limit of {clock.time_limit:g} s.")
