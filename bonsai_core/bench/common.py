"""What several bench suites share: the budget bisection and the command line a report quotes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable


def bisect_budget(meets: Callable[[int], bool], lo: int, hi: int, steps: int, try_lo: bool = False) -> int | None:
    """The smallest budget in ``[lo, hi]`` that ``meets`` accepts, by a bisection of at most ``steps``
    calls after the ends: ``lo`` when ``try_lo`` and it meets it, None when ``hi`` does not meet.

    A heuristic's success is not monotone in the budget, so this is the threshold the bisection lands
    on, not a proven minimum. ``meets`` may raise TimeoutError to stop early: the answer is then the
    smallest budget met so far (None before ``hi`` was met)."""
    found = None
    try:
        if try_lo and meets(lo):
            return lo
        if not meets(hi):
            return None
        found = hi
        for _ in range(steps):
            mid = (lo + hi) // 2
            if mid == lo:
                break
            lo, hi = (lo, mid) if meets(mid) else (mid, hi)
            found = hi
    except TimeoutError:
        pass
    return found


def command() -> str:
    """The command line this run was started with, as a report quotes it."""
    return "bonsai " + " ".join(sys.argv[1:])


def import_test_models() -> None:
    """Put the checkout's root on ``sys.path``, so that the suites measuring the models in ``tests/``
    import them from any working directory (as the scripts they were did)."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
