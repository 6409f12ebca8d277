"""DTR's heuristics and deallocation modes (live-byte budget): on the 2-layer zoo GPT at 80% and 60% of
its no-remat peak, and on a 4-layer zoo GPT (``gpt --layers 4 --width 256 --seq 256 --heads 4 --vocab
1024 --batch 8``) at the tight budgets where DTR thrashes, 50%, 40% and 37%.

    bonsai bench dtr-variants     # prints the markdown tables of docs/results/heuristics.md
"""

from __future__ import annotations

import argparse
from typing import Any

from bonsai_core.bench import common
from bonsai_core.graph import load_graph
from bonsai_core.schedule import no_remat_peak

# label -> (heuristic, deallocation)
HEURISTICS: dict[str, tuple[str, str]] = {
    "dtr": ("dtr", "free"), "dtr_eq": ("dtr_eq", "free"), "local": ("local", "free"), "lru": ("lru", "free"),
    "size": ("size", "free"), "dtr + evict": ("dtr", "evict"), "dtr + banish": ("dtr", "banish")}
SMALL = {"graph": "assets/gpt-default.json", "fracs": (0.8, 0.6)}
LARGER_OPTIONS = {"layers": 4, "width": 256, "seq": 256, "heads": 4, "vocab": 1024, "batch": 8}
LARGER = {"model": "gpt", "options": LARGER_OPTIONS, "fracs": (0.5, 0.4, 0.37)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite has no options: two graphs, their budgets."""


def overheads(graph, fracs: tuple[float, ...]) -> dict[str, list[float | None]]:
    """label -> DTR's overhead with that heuristic and deallocation mode at each share of the graph's
    no-remat peak (None: no schedule fits)."""
    return {label: [common.overhead_or_none(graph, int(frac * no_remat_peak(graph)), "dtr", heuristic=heuristic,
                                            deallocation=deallocation) for frac in fracs]
            for label, (heuristic, deallocation) in HEURISTICS.items()}


def measure() -> dict[str, Any]:
    """Both graphs: their node counts, budgets and every variant's overheads."""
    small = load_graph(SMALL["graph"])
    larger = common.graph_of(LARGER["model"], **LARGER["options"])
    return {"small": {"nodes": small.n, "fracs": list(SMALL["fracs"]), "overheads": overheads(small, SMALL["fracs"])},
            "larger": {"nodes": larger.n, "options": LARGER["options"], "fracs": list(LARGER["fracs"]),
                       "overheads": overheads(larger, LARGER["fracs"])}}


def table(part: dict[str, Any]) -> str:
    """One row per budget, one cell per heuristic and deallocation mode ("does not fit": no schedule)."""
    return common.table(["budget", *HEURISTICS], [[f"{frac:.0%}", *("does not fit" if o[i] is None else f"{o[i]:+.1%}"
                                                                for o in part["overheads"].values())]
                                              for i, frac in enumerate(part["fracs"])])


def main(args: argparse.Namespace) -> int:
    """Both tables, the 2-layer GPT's first."""
    result = measure()
    print(f"2-layer zoo GPT ({result['small']['nodes']} nodes):\n\n{table(result['small'])}\n")
    print(f"4-layer zoo GPT ({result['larger']['nodes']} nodes):\n\n{table(result['larger'])}")
    return 0
