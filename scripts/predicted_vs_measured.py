"""Predicted (simulator, no-remat schedule) vs measured (real eager step) peak memory of every zoo
model at its default size, as a markdown table: `python scripts/predicted_vs_measured.py`."""

from __future__ import annotations

from bonsai_core import zoo
from bonsai_core.budget import format_bytes
from bonsai_core.measure import measure_step
from bonsai_core.schedule import no_remat_peak
from bonsai_core.trace import trace_zoo


def main() -> None:
    print("| model | ops | predicted peak | measured peak (CPU live bytes) | predicted / measured |")
    print("|---|---:|---:|---:|---:|")
    for name in zoo.ZOO:
        g = trace_zoo(name).graph
        predicted = no_remat_peak(g)
        measured = measure_step(*zoo.build(name)).peak
        print(f"| {name} | {g.n} | {format_bytes(predicted)} | {format_bytes(measured)} | {predicted / measured:.4f} |")


if __name__ == "__main__":
    main()
