"""DTR's heuristics and deallocation modes on the 2-layer zoo GPT (live-byte budget), at 80% and 60%.

    bonsai bench dtr-variants     # prints the markdown table in docs/results/heuristics.md
"""

from __future__ import annotations

import argparse

HEURISTICS = [("dtr", "free"), ("dtr_eq", "free"), ("local", "free"), ("lru", "free"), ("size", "free"),
              ("dtr", "evict"), ("dtr", "banish")]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite has no options: one graph, two budgets."""


def main(args: argparse.Namespace) -> int:
    """One row per budget, one cell per heuristic and deallocation mode."""
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve

    g = load_graph("assets/gpt-default.json")
    ref = no_remat_peak(g)
    print("| budget | " + " | ".join(["dtr", "dtr_eq", "local", "lru", "size", "dtr + evict", "dtr + banish"]) + " |")
    print("| --- |" + " --- |" * 7)
    for frac in (0.8, 0.6):
        cells = []
        for h, d in HEURISTICS:
            try:
                s = solve(g, int(frac * ref), "dtr", heuristic=h, deallocation=d, budget_hint=False)
                cells.append(f"{s.stats['overhead']:+.1%}")
            except Exception:
                cells.append("does not fit")
        print(f"| {frac:.0%} | " + " | ".join(cells) + " |")
    return 0
