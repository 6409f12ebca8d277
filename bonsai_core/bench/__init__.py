"""``bonsai bench SUITE [options]``: the benchmark suites, one study each (``--list`` names them; no suite runs
``methods``). A suite is a module with ``add_arguments(parser)`` and ``main(args) -> int`` that imports what it
measures with inside its functions, so building the command line stays cheap."""

from __future__ import annotations

import argparse
from importlib import import_module
from types import ModuleType

DEFAULT_SUITE = "methods"
# suite name -> (module under bonsai_core.bench, what it measures); the order `bonsai bench --list` prints
SUITES: dict[str, tuple[str, str]] = {
    "methods": ("methods", "every method and peer on the same models and budgets: tables and plots (the default)"),
    "heuristics": ("heuristics", "coop vs DTR in one pool: smallest pool, overhead at equal pools, fragmentation"),
    "inplace": ("inplace", "coop's recomputable in-place (optimizer updates, in-place ops) vs copy-on-write"),
    "dtr-variants": ("dtr_variants", "DTR's heuristics and deallocation modes on the 2-layer zoo GPT"),
    "bonsai": ("bonsai", "the bonsai segment ILP: solve time, size, gap, granularity, live re-solve, region bound"),
    "solvers-opt": ("solvers_opt", "the op-level solvers (checkmate on HiGHS and SCIP, moccasin on CP-SAT); "
                                   "--page writes docs/results/checkmate_moccasin.md"),
    "offload": ("offload", "keep, recompute or offload: every method with and without offload, an offload plan run"),
    "explorer": ("explorer_page", "the explorer's latencies in headless Chromium: slider, first paint, ten sessions, "
                                  "module graph, lifetimes; --page writes docs/results/explorer.md"),
    "export": ("export", "exported steps against their predictions: the zoo, every solver, real models, "
                         "both back-ends"),
    "one-call": ("one_call", "bonsai.checkpoint on library models: predicted vs measured peak, call times"),
    "fsdp": ("fsdp", "FSDP2 per rank: the simulator's peak against gloo processes on CPU"),
    "parallel": ("parallel", "tensor, pipeline and tensor x FSDP ranks: the simulator's peak against gloo processes"),
    "published": ("published", "torchtitan's published Llama 3.1 memory table predicted per rank (eager); --page "
                               "writes docs/results/published_rows.md"),
    "predicted-vs-measured": ("predicted_vs_measured", "no-remat peak: the simulator against a real eager CPU step"),
    "compiled": ("compiled", "compiled steps: the compiled trace against real compiled CPU steps, bonsai against "
                             "torch's memory budget under compile, torchtitan's 8B rows eager and compiled"),
}

__all__ = ["DEFAULT_SUITE", "SUITES", "add_suite_parsers", "suite", "suite_list"]


def suite(name: str) -> ModuleType:
    """The module of suite ``name``."""
    return import_module(f"bonsai_core.bench.{SUITES[name][0]}")


def suite_list() -> str:
    """One line per suite, its name and what it measures (``bonsai bench --list``)."""
    width = max(map(len, SUITES))
    return "\n".join(f"{name:{width}s}  {about}" for name, (_, about) in SUITES.items())


def add_suite_parsers(parser: argparse.ArgumentParser) -> None:
    """``SUITE`` under ``bonsai bench``: one sub-parser per suite with its own options (none given, the bench
    parser runs the default suite with the default's options)."""
    suites = parser.add_subparsers(dest="suite", metavar="SUITE", required=False,
                                   help="one of: " + ", ".join(SUITES) + f" (default {DEFAULT_SUITE}; --list)")
    for name, (_, about) in SUITES.items():
        module = suite(name)
        p = suites.add_parser(name, help=about, description=module.__doc__.split("\n\n")[0].strip(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(suite_main=module.main, parser=p)
