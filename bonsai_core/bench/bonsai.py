"""Measure the bonsai segment ILP: solve time, size, overhead and gap on traced zoo graphs next to
chen and dtr, the smallest budget each reaches, the effect of the granularity, and the live re-solve
time after a budget change.

    bonsai bench bonsai -o bench-bonsai.json     # everything (many minutes)
    bonsai bench bonsai --models gpt:layers=4,width=256,seq=256,heads=4,vocab=1024,batch=8 \
        --budgets 45 40 --skip-granularity --skip-resolve --skip-smallest
    bonsai bench bonsai --models graph.json ...   # a traced graph file (no re-tracing)
    bonsai bench bonsai --models g8b.json --budgets 50 30 82.4GiB \
        --variants default save_ops=false regions=modules --compare chen dtr \
        --skip-granularity --skip-resolve --skip-smallest   # a real step (docs/results/real_runs.md)
    bonsai bench bonsai -o docs/bench/bonsai.json --page docs/results/bonsai.md   # and the page's studies
    bonsai bench bonsai -o docs/bench/bonsai.json --page docs/results/bonsai.md --report-only

``--variants``: bonsai's option sets, each ``default`` or ``name=value,...`` (``bonsai methods
bonsai`` lists the options); ``--budgets``: shares of the no-remat peak (``70``), as every suite takes
them, or bytes with a unit (``82.4GiB``). The tables give the wall time of each call and where it went (``time_split``), and
the tool's own peak memory (the process's maximum resident set) after each row.

Every schedule goes through ``bonsai_core.solvers.solve`` (so the simulator validates it); budgets are
shares of the no-remat peak. Default options for every method (bonsai: granularity "auto", gap 1%),
except the time limit. Prints Markdown tables, the load average (the machine may be shared), and
writes the raw rows as JSON.

``--page PAGE`` (the default models and budgets only) also runs the studies docs/results/bonsai.md
reports (``bonsai_page.studies``: the options ``save_self_contained`` and ``drop_outputs``, the
explorer's graph dragged from 95% to 45%, the region bound, moccasin at 40%), keeps everything in ``-o``
and writes the page (``bonsai_page.page``; the suite's entry is ``bonsai_page.main``); ``--report-only``
writes it again from ``-o``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Any

from bonsai_core.arguments import bench_budget_arg
from bonsai_core.bench.common import pipe_table
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import load_graph
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import bonsai as B, parse_option
from bonsai_core.solvers import solve

GPT4 = "gpt:layers=4,width=256,seq=256,heads=4,vocab=1024,batch=8"
DEFAULT_MODELS = [GPT4, "resnet", "unet", "gpt2-small"]


DEFAULT_BUDGETS = ("70", "50", "45", "40")  # shares of the no-remat peak, in percent

def load(spec: str):
    """``name[:k=v,...]``, ``gpt2-small`` or a graph JSON file -> (label, Graph)."""
    from bonsai_core.trace import trace_model
    from bonsai_core.models.zoo import GPT2_SMALL

    if spec.endswith(".json"):
        g = load_graph(spec)
        return os.path.basename(spec), g
    if spec == "gpt2-small":
        return spec, trace_model("gpt", **GPT2_SMALL).graph
    name, options = spec_options(spec)
    return spec, trace_model(name, **options).graph


def spec_options(spec: str) -> tuple[str, dict[str, int]]:
    """``name[:k=v,...]`` (a zoo name) -> (name, options)."""
    name, _, opts = spec.partition(":")
    return name, {k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)}


def run(graph, budget: int | None, method: str = "bonsai", **options: Any) -> dict[str, Any]:
    if method == "bonsai":
        options.setdefault("reuse", False)  # measure every solve, never a plan reused from a larger budget
    start = time.perf_counter()
    try:
        s = solve(graph, budget, method, **options)
    except BonsaiError as e:
        return {"error": str(e).split(":")[0], "wall_seconds": time.perf_counter() - start}
    st = s.stats
    return {k: st.get(k) for k in ("status", "gap", "variables", "constraints", "build_seconds", "solve_seconds",
                                   "candidates", "ilp_candidates", "segments", "recomputed_segments", "peak",
                                   "overhead", "cached", "granularity", "granularities_tried", "plan_source",
                                   "model_slack", "tightened_by", "time_split", "saved_nodes", "outputs_dropped",
                                   "self_contained_saved", "space", "spaces", "bound", "bound_gap", "warm_start")} | \
        {"wall_seconds": time.perf_counter() - start, "tool_rss_bytes": max_rss()}


def max_rss() -> int:
    """The process's peak resident memory so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def variant_options(text: str) -> dict[str, Any]:
    """``default`` or ``name=value,...``: bonsai's options, parsed as ``--option`` parses them."""
    return {} if text == "default" else dict(parse_option("bonsai", part) for part in text.split(","))


def fmt(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite's options."""
    ap.add_argument("--models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--budgets", nargs="+", type=bench_budget_arg, default=[bench_budget_arg(p) for p in DEFAULT_BUDGETS],
                    metavar="PCT", help="shares of the no-remat peak (70 or 70%%), or bytes with a unit (82.4GiB) "
                                        f"(default {' '.join(DEFAULT_BUDGETS)})")
    ap.add_argument("--variants", nargs="*", default=["default"],
                    help="bonsai option sets: 'default' or name=value,... (e.g. save_ops=false regions=modules)")
    ap.add_argument("--backends", nargs="*", default=["highs"])
    ap.add_argument("--compare", nargs="*", default=["chen", "dtr"])
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--granularity-model", default=GPT4)
    ap.add_argument("--granularities", nargs="*", type=int, default=[5, 10, 19, 38, 76])
    ap.add_argument("--resolve-model", default=GPT4)
    ap.add_argument("--skip-granularity", action="store_true")
    ap.add_argument("--skip-resolve", action="store_true")
    ap.add_argument("--skip-smallest", action="store_true")
    ap.add_argument("-o", "--output", default=None)


def main(args: argparse.Namespace) -> int:
    """The suite's tables (:func:`measure`), their rows written to ``--output`` as JSON."""
    rows = measure(args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The solve table, then the smallest budgets, the granularity sweep and the live re-solve: their rows."""
    print(f"load average at start: {load_average()}\n")
    rows, graphs = solve_table(args)
    if not args.skip_smallest:
        rows += smallest_budgets(args, graphs)
    if not args.skip_granularity:
        rows += granularity_sweep(args)
    if not args.skip_resolve:
        rows += resolve_sweep(args)
    return rows


def solve_table(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, tuple[str, Any]]]:
    """Bonsai (and the methods compared) on every model, backend and budget; the rows and the graphs."""
    rows: list[dict[str, Any]] = []
    print(pipe_table(["model", "nodes", "budget", "method", "granularity", "ILP cand.", "vars", "wall s (split)",
                      "status", "gap", "source", "peak/plain", "overhead", "tool RSS"], []))
    graphs = {}
    for spec in args.models:
        label, g = graphs[spec] = load(spec)
        plain = no_remat_peak(g)
        for backend in args.backends:
            B._cache.clear()  # the first row pays the build (and the import of CVXPY, once per process)
            budgets = [b.resolve(plain) for b in args.budgets]
            for budget in budgets:
                frac = budget / plain
                methods = [("bonsai", v) for v in args.variants] + [(m, "") for m in args.compare]
                for method, variant in methods:
                    opts = {"backend": backend, **variant_options(variant)} if method == "bonsai" else {}
                    opts["time_limit"] = args.time_limit
                    name = method if variant in ("", "default") else f"{method} {variant}"
                    r = run(g, budget, method, **opts)
                    r |= {"model": label, "nodes": g.n, "fraction": frac, "budget": budget, "method": name,
                          "backend": backend, "plain_peak": plain, "load": load_average()}
                    rows.append(r)
                    if "error" in r:
                        print(f"| {label} | {g.n} | {frac:.1%} | {name} | {r['error']} ({r['wall_seconds']:.2f} s) |")
                        continue
                    split = ", ".join(f"{k} {v:.1f}" for k, v in (r.get("time_split") or {}).items())
                    print(f"| {label} | {g.n} | {frac:.1%} | {name} | {fmt(r['granularity'])} | "
                          f"{fmt(r['ilp_candidates'])} | {fmt(r['variables'])} | {r['wall_seconds']:.2f}"
                          f"{f' ({split})' if split else ''} | "
                          f"{r['status']} | {fmt(r['gap'], '.2g')} | {fmt(r['plan_source'])} | "
                          f"{r['peak'] / plain:.3f} | {r['overhead']:+.2%} | {r['tool_rss_bytes'] / 2**30:.2f} GiB |",
                          flush=True)
    print(f"\nload average: {load_average()}")
    return rows, graphs


def smallest_budgets(args: argparse.Namespace, graphs: dict[str, tuple[str, Any]]) -> list[dict[str, Any]]:
    """The smallest budget bonsai's model reaches, chen's lowest plan and the per-op bound, per model."""
    from bonsai_core.bench.methods import chen_lowest_peak

    print("\nSmallest budget reached (share of the no-remat peak): bonsai's model at the top of its auto "
          "ladder (min-peak MILP), chen's lowest plan, and the per-op lower bound:\n")
    print(pipe_table(["model", "bonsai model (status)", "chen", "per-op lower bound"], []))
    rows = []
    for spec in args.models:
        label, g = graphs[spec]
        plain = no_remat_peak(g)
        smallest, status = B.smallest_budget(g, time_limit=args.time_limit)
        chen = chen_lowest_peak(g)
        rows.append({"model": label, "sweep": "smallest", "bonsai": smallest, "bonsai_status": status,
                     "chen": chen, "lower_bound": g.peak_lower_bound, "plain_peak": plain})
        print(f"| {label} | {'-' if smallest is None else f'{smallest / plain:.1%}'} ({status}) | {chen / plain:.1%} | "
              f"{g.peak_lower_bound / plain:.1%} |", flush=True)
    return rows


def granularity_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Bonsai at 45% of the no-remat peak at each granularity asked."""
    label, g = load(args.granularity_model)
    plain = no_remat_peak(g)
    print(f"\nGranularity on {label} ({g.n} nodes), budget 45% of the no-remat peak, HiGHS:\n")
    print(pipe_table(["granularity", "candidates", "ILP cand.", "vars", "cons", "wall s", "status", "gap", "peak/plain",
                      "overhead"], []))
    rows = []
    for gran in args.granularities:
        B._cache.clear()
        r = run(g, int(plain * 0.45), granularity=gran, time_limit=args.time_limit)
        r |= {"model": label, "sweep": "granularity", "granularity_asked": gran, "fraction": 0.45}
        rows.append(r)
        if "error" in r:
            print(f"| {gran} | {r['error']} |")
            continue
        print(f"| {r['granularity']} | {r['candidates']} | {r['ilp_candidates']} | {r['variables']} | "
              f"{r['constraints']} | {r['wall_seconds']:.2f} | {r['status']} | {fmt(r['gap'], '.2g')} | "
              f"{r['peak'] / plain:.3f} | {r['overhead']:+.2%} |", flush=True)
    return rows


def resolve_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The live re-solve: one build, then the budget changed as a slider changes it."""
    label, g = load(args.resolve_model)
    plain = no_remat_peak(g)
    print(f"\nLive re-solve on {label} ({g.n} nodes): one build, then budget changes:\n")
    print(pipe_table(["backend", "budget", "cached", "wall s (solve + schedule + simulate)", "status", "overhead"], []))
    rows = []
    for backend in args.backends:
        B._cache.clear()
        walls = []
        for frac in (0.9, 0.8, 0.7, 0.75, 0.85, 0.65, 0.6, 0.55, 0.5):
            r = run(g, int(plain * frac), backend=backend, time_limit=args.time_limit)
            r |= {"model": label, "sweep": "resolve", "fraction": frac, "backend": backend}
            rows.append(r)
            if "error" in r:
                print(f"| {backend} | {frac:.0%} | {r['error']} |")
                continue
            if r["cached"]:
                walls.append(r["wall_seconds"])
            print(f"| {backend} | {frac:.0%} | {r['cached']} | {r['wall_seconds']:.2f} | {r['status']} | "
                  f"{r['overhead']:+.2%} |", flush=True)
        if walls:
            print(f"\nmedian re-solve ({backend}, cached rows): {statistics.median(walls):.2f} s; "
                  f"load average {load_average()}")
    return rows
