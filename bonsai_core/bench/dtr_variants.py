"""DTR's heuristics and deallocation modes (live-byte budget): on the 2-layer zoo GPT at 80% and 60% of its
no-remat peak, and on a 4-layer zoo GPT at 50%, 40% and 37%, where DTR thrashes (``bonsai bench dtr-variants``
prints the tables of docs/results/heuristics.md; :func:`bonsai_core.bench.heuristics.dtr_variants` measures)."""

from __future__ import annotations

import argparse

from bonsai_core.bench import heuristics


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite has no options: two graphs, their budgets."""


def main(args: argparse.Namespace) -> int:
    result = heuristics.dtr_variants()
    print(f"2-layer zoo GPT ({result['small']['nodes']} nodes):\n\n{heuristics.dtr_table(result['small'])}\n")
    print(f"4-layer zoo GPT ({result['larger']['nodes']} nodes):\n\n{heuristics.dtr_table(result['larger'])}")
    return 0
