"""One time limit for a method's whole ``solve`` call, however many inner solves it makes.

Seconds are wall-clock seconds, except within :func:`cpu_seconds`: there every deadline counts the
calling thread's CPU seconds, so that what a solve finds within its limit does not depend on how
many other processes share the machine (the explorer's solves: on a loaded machine a 20 s wall-clock
limit ran out before bonsai's first plan of a large step was built). A backend whose own limit is
wall-clock (HiGHS, SCIP) is then given the wall seconds the CPU seconds left take at the pace the
thread has had so far, or early in a block the pace the last block had (:func:`backend_seconds`).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Iterator

from bonsai_core.errors import SolverError

# (wall, thread CPU) seconds when :func:`cpu_seconds` was entered; None: deadlines count wall-clock seconds
_cpu_since: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("deadline_cpu", default=None)
_PACE_AFTER = 0.5  # CPU seconds before a block's own pace is trusted (until then: the last block's, see below)
# wall seconds per CPU second over the last :func:`cpu_seconds` block long enough to measure it (1.0: none yet).
# A block's first backend call comes before it has a pace of its own: on torchtitan's 8B step at 22% of the
# no-remat peak the LP's rounding takes 0.1 s, then HiGHS, handed 20 wall seconds for 20 CPU seconds on a
# machine at 3.5 wall seconds per CPU second, stopped without a plan after 7 CPU seconds (alone it needs 12).
_last_pace = 1.0


@contextlib.contextmanager
def cpu_seconds() -> Iterator[None]:
    """Within this block (in this thread), time limits count the thread's CPU seconds."""
    global _last_pace
    since = (time.perf_counter(), time.thread_time())
    token = _cpu_since.set(since)
    try:
        yield
    finally:
        _cpu_since.reset(token)
        pace = _pace(since)
        if pace is not None:
            _last_pace = pace


def counts_cpu() -> bool:
    return _cpu_since.get() is not None


def now() -> float:
    """The clock deadlines read: the thread's CPU seconds within :func:`cpu_seconds`, else wall-clock seconds."""
    return time.thread_time() if counts_cpu() else time.perf_counter()


def backend_seconds(seconds: float | None) -> float | None:
    """``seconds`` of :func:`now`'s clock as a wall-clock limit for a backend: unchanged outside
    :func:`cpu_seconds`; within it, scaled by the wall seconds each CPU second has taken since (at least 1),
    or before the block has spent :data:`_PACE_AFTER` CPU seconds, by the last block's pace."""
    since = _cpu_since.get()
    if seconds is None or since is None:
        return seconds
    pace = _pace(since)
    return seconds * max(1.0, _last_pace if pace is None else pace)


def _pace(since: tuple[float, float]) -> float | None:
    """Wall seconds per CPU second of this thread since ``since`` (wall, thread CPU); None before
    :data:`_PACE_AFTER` CPU seconds."""
    cpu = time.thread_time() - since[1]
    return (time.perf_counter() - since[0]) / cpu if cpu >= _PACE_AFTER else None


class Deadline:
    """``time_limit`` seconds from now (None: no limit), shared by every inner solve and search of
    one method call: :meth:`remaining` and :meth:`passed` to decide, :meth:`left` to give an inner
    solve its share (or fail saying what used the time up). Seconds of :func:`now`'s clock."""

    def __init__(self, time_limit: float | None) -> None:
        if time_limit is not None and not time_limit > 0:
            raise SolverError(f"time_limit is {time_limit}; give a positive number of seconds (or none).")
        self.time_limit = time_limit
        self.start = now()

    def remaining(self) -> float | None:
        """Seconds left, possibly negative (None: no limit)."""
        return None if self.time_limit is None else self.time_limit - (now() - self.start)

    def passed(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

    def left(self, method: str, spent_on: str) -> float | None:
        """Seconds left for the next inner solve (None: no limit); SolverError if none are, saying
        what used them up (``spent_on``) and what to do."""
        if self.time_limit is None:
            return None
        left = self.time_limit - (now() - self.start)
        if left <= 0:
            raise SolverError(
                f"Method {method!r} found no schedule within the time limit of {self.time_limit:g} s: "
                f"{spent_on} took {now() - self.start:.1f} s. Raise --time-limit, or use "
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
