"""Byte sizes as people write and read them: the unit table parsing uses, and the formatting every
report and page shows.

    >>> format_bytes(3 * 2**20)
    '3.00 MiB'
"""

from __future__ import annotations

# Bytes per unit, by lower-case name: decimal (kB = 1000) and binary (KiB = 1024) units.
UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def format_bytes(n: float, significant: int | None = None) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``; with ``significant``
    digits instead of two decimals, ``format_bytes(1.5 * 2**20, 3) == '1.5 MiB'`` (a chart's label)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{n:.0f} {unit}"
            return f"{n:.2f} {unit}" if significant is None else f"{n:.{significant}g} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
