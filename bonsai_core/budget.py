"""Memory budgets as people write them: bytes, bytes with a unit, or a share of the no-remat peak.

    >>> parse_budget("800MiB").resolve(reference=10**10)
    838860800
    >>> parse_budget("60%").resolve(reference=1000)
    600
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Callable

from bonsai_core.errors import BudgetError
from bonsai_core.units import UNITS

ACCEPTED = ("a budget is bytes (123456789), bytes with a unit (800MiB, 2.5GB; units B, KB, MB, GB, TB, "
            "KiB, MiB, GiB, TiB), or a share of the no-rematerialization peak (60%)")
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*|%)\s*$")
MAX_BYTES = 2**62


@dataclass(frozen=True)
class Budget:
    """Either an absolute byte count or a fraction of a reference peak (exactly one is set)."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, reference: int) -> int:
        """Bytes of this budget, ``reference`` being the no-remat peak that a share refers to."""
        if self.bytes is not None:
            return self.bytes
        return int(math.floor(self.fraction * reference))

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%" if self.fraction is not None else f"{self.bytes} bytes"


def parse_budget(text: str) -> Budget:
    """Parse ``123456789``, ``800MiB``, ``2.5GB`` or ``60%``; anything else raises BudgetError."""
    m = _PATTERN.match(str(text))
    if not m:
        raise BudgetError(f"Cannot read the budget {text!r}: {ACCEPTED}.")
    number, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(number) or number <= 0:
        raise BudgetError(f"The budget {text!r} is not a positive finite amount: {ACCEPTED}.")
    if unit == "%":
        if number > 1000:
            raise BudgetError(f"The budget {text!r} is more than ten times the no-remat peak; use at most 1000%.")
        return Budget(fraction=number / 100)
    if unit not in UNITS:
        raise BudgetError(f"Unknown unit {m.group(2)!r} in the budget {text!r}: {ACCEPTED}.")
    value = number * UNITS[unit]
    if value > MAX_BYTES:
        raise BudgetError(f"The budget {text!r} is beyond any real memory (over 4 EiB): {ACCEPTED}.")
    if value < 1:
        raise BudgetError(f"The budget {text!r} is less than one byte: {ACCEPTED}.")
    return Budget(bytes=int(value))


def smallest_meeting(meets: Callable[[int], bool], lo: int, hi: int, steps: int | None = None,
                     stop: type[Exception] | tuple[type[Exception], ...] = ()) -> int:
    """The smallest value in ``(lo, hi]`` that ``meets`` accepts, by bisection between ``lo`` (taken as
    refused) and ``hi`` (taken as met): at most ``steps`` calls (None: until the two are adjacent). A
    heuristic's success need not be monotone in its budget, so this is the value the bisection lands on, not
    a proven minimum. ``meets`` raising ``stop`` (a time limit) ends it with the smallest value met so far."""
    try:
        for _ in range(steps) if steps is not None else itertools.count():
            mid = (lo + hi) // 2
            if mid == lo:
                break
            lo, hi = (lo, mid) if meets(mid) else (mid, hi)
    except stop:
        pass
    return hi
