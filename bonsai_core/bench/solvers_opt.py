"""Measure the op-level solvers (checkmate on HiGHS and SCIP, moccasin on CP-SAT) on traced zoo graphs: each
(graph, method) in its own process under a hard wall-clock limit, solving the budgets in turn as the explorer's
slider re-solves; a row per budget (status, overhead, gap, model size, times) in ``--out``/results.json. With
``--page``, the page's three studies (:func:`planned_runs`) and docs/results/checkmate_moccasin.md. The ``-warm``
methods are checkmate as a user gets it, started from the cheapest schedule another method finds."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from importlib.metadata import distributions
from pathlib import Path
from typing import Any, Sequence

from bonsai_core.arguments import fraction_arg
from bonsai_core.bench import common
from bonsai_core.bench.common import budget, listing
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import load_graph, save_graph
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import solve

GRAPHS = {"gpt-l1": ("gpt", {"layers": 1}), "gpt-l2": ("gpt", {"layers": 2}),
          "resnet": ("resnet", {}), "unet": ("unet", {})}
METHODS = {"checkmate-highs": ("checkmate", {"backend": "highs", "warm_start": False}),
           "checkmate-scip": ("checkmate", {"backend": "scip", "warm_start": False}),
           "moccasin": ("moccasin", {}),
           "moccasin-c3": ("moccasin", {"copies": 3}),
           "checkmate-highs-warm": ("checkmate", {"backend": "highs", "warm_start": True}),
           "checkmate-scip-warm": ("checkmate", {"backend": "scip", "warm_start": True})}
DEFAULT_METHODS = ["checkmate-highs", "checkmate-scip", "moccasin"]
DEFAULT_BUDGETS = [0.9, 0.7, 0.5]
# The page's other two studies: moccasin with 3 copies at the smallest budget, and checkmate's warm start
# on one graph at one budget: (method, share of --time-limit) per run.
COPIES_METHOD, COPIES_BUDGET = "moccasin-c3", 0.5
WARM_GRAPH, WARM_BUDGET = "gpt-l1", 0.6
WARM_RUNS = [("checkmate-highs", 1.0), ("checkmate-scip", 1.0), ("checkmate-highs-warm", 1.0),
             ("checkmate-scip-warm", 1.0), ("checkmate-highs-warm", 1 / 2), ("checkmate-highs-warm", 1 / 6)]
STAT_KEYS = ("status", "gap", "variables", "constraints", "build_seconds", "solve_seconds", "objective", "compute_cost",
             "overhead", "peak", "recomputes", "model_nodes", "warm_start", "warm_start_cost", "warm_start_seconds",
             "warm_start_tried")
# the files that decide what the page says (tests/test_docs.py checks their hash against the page's)
SOURCES = ["bonsai_core/bench/solvers_opt.py", common.template_source("checkmate_moccasin")]
OUT, PAGE = "docs/bench/solvers_opt", "docs/results/checkmate_moccasin.md"


def run_one(graph_file: str, label: str, method: str, fractions: list[float], time_limit: float) -> None:
    """Solve one graph with one method at each budget; print one JSON line per budget."""
    from bonsai_core.solvers.views import contract_views

    warnings.filterwarnings("ignore")
    name, options = METHODS[method]
    graph = load_graph(graph_file)
    peak = no_remat_peak(graph)
    for fraction in fractions:
        budget = int(fraction * peak)
        row = {"graph": label, "nodes": graph.n, "model_nodes": contract_views(graph)[0].n, "edges": graph.num_edges,
               "method": method, "budget_share": fraction, "budget": budget, "no_remat_peak": peak,
               "peak_lower_bound": graph.peak_lower_bound, "time_limit": time_limit}
        start = time.perf_counter()
        try:
            stats = solve(graph, budget, name, time_limit=time_limit, **options).stats
            row.update({k: stats.get(k) for k in STAT_KEYS})
        except BonsaiError as e:  # a solver that built its model says its size
            row.update({"status": "error", "error": f"{type(e).__name__}: {e}", **e.stats})
        row["wall_seconds"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's options (``--one``: the child process's own, one graph and one method)."""
    p.add_argument("--graphs", nargs="+", choices=list(GRAPHS), help=f"default: {' '.join(GRAPHS)}")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), help=f"default: {' '.join(DEFAULT_METHODS)}")
    p.add_argument("--budgets", nargs="+", type=fraction_arg, metavar="PCT",
                   help="shares of the no-remat peak, 70 or 70%% (default: "
                        + " ".join(f"{b * 100:g}" for b in DEFAULT_BUDGETS) + ")")
    p.add_argument("--time-limit", type=float, default=60.0)
    common.add_page_arguments(p, OUT, PAGE)
    p.add_argument("--one", nargs=3, metavar=("GRAPH_FILE", "LABEL", "METHOD"), help=argparse.SUPPRESS)


def refusal(args: argparse.Namespace) -> str | None:
    """Why the options cannot run, before anything is measured; None when they can."""
    if not (args.page or args.report_only) and common.same_path(args.out, OUT):
        return f"a run without --page measures less than {OUT}/results.json holds: give another --out"
    return common.page_refusal(args, OUT, PAGE, narrowed=common.changed(args, ("graphs", "methods", "budgets")),
                               whole="every graph, method and budget")


def planned_runs(args: argparse.Namespace) -> list[tuple[str, str, str, list[float], float]]:
    """(study, graph, method, budgets, time limit) of every child process: the options' grid, or with
    ``--page`` the page's three studies."""
    limit = args.time_limit
    if not args.page:
        return [("main", graph, method, args.budgets or DEFAULT_BUDGETS, limit)
                for graph in args.graphs or GRAPHS for method in args.methods or DEFAULT_METHODS]
    return ([("main", graph, method, DEFAULT_BUDGETS, limit) for graph in GRAPHS for method in DEFAULT_METHODS]
            + [("copies", graph, COPIES_METHOD, [COPIES_BUDGET], limit) for graph in GRAPHS]
            + [("warm-start", WARM_GRAPH, method, [WARM_BUDGET], round(limit * share, 1))
               for method, share in WARM_RUNS])


def run_child(graph_file: str, label: str, method: str, budgets: list[float], time_limit: float) -> list[dict]:
    """One (graph, method) in a child process; a row per budget, a "killed" row for each budget it did
    not report before its hard limit."""
    hard = len(budgets) * (time_limit * 1.5 + 60)  # each budget: the limit, building, a backend's overrun
    cmd = [sys.executable, "-m", "bonsai_core.cli", "bench", "solvers-opt", "--one", graph_file, label, method,
           "--time-limit", str(time_limit), "--budgets", *(f"{b * 100:g}" for b in budgets)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=hard)
        stdout = done.stdout
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(f"{label} {method}: killed after {hard:.0f} s", file=sys.stderr)
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    reported = {r["budget_share"] for r in rows}
    rows += [{"graph": label, "method": method, "budget_share": b, "time_limit": time_limit, "status": "error",
              "error": f"killed: no answer within the hard limit of {hard:.0f} s"}
             for b in budgets if b not in reported]
    return rows


def versions() -> dict[str, str]:
    """The solver packages' versions, as the page quotes them."""
    installed = {d.metadata["Name"].lower(): d.version for d in distributions()}
    return {p: installed.get(p, "not installed") for p in ("highspy", "pyscipopt", "ortools", "cvxpy", "torch")}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Each (graph, method) in a child process under a hard limit: the rows and the run's command, dates and
    machine, in ``--out``/results.json after each child (a long run leaves results behind)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": common.run_meta("started", versions=versions(), time_limit=args.time_limit),
                               "rows": []}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for study, label, method, budgets, limit in planned_runs(args):
            graph_file = f"{tmp}/{label}.json"
            if not os.path.exists(graph_file):
                save_graph(common.graph_of(GRAPHS[label][0], **GRAPHS[label][1]), graph_file)
            for row in run_child(graph_file, label, method, budgets, limit):
                row.update(study=study, load=round(os.getloadavg()[0], 1))  # the machine's load as the child ended
                results["rows"].append(common.progress(row, ("study", "graph", "method", "budget_share", "status",
                                                             "overhead", "gap", "wall_seconds")))
            (out / "results.json").write_text(json.dumps(results, indent=1))
    results["meta"].update(ended=common.utc_now(), seconds=round(time.perf_counter() - start, 1),
                           load_end=round(os.getloadavg()[0], 1))
    return results


def main(args: argparse.Namespace) -> int:
    if args.one:
        run_one(*args.one, args.budgets or DEFAULT_BUDGETS, args.time_limit)
        return 0
    return common.run_page_suite("solvers-opt", args, refusal(args), lambda: measure(args),
                                 common.page_writer(page, SOURCES, common.results_file(args)))


# -- docs/results/checkmate_moccasin.md: every number and comparison computed from the rows and the run file --

CHECKMATE = {"checkmate-highs": "HiGHS", "checkmate-scip": "SCIP"}  # the main table's checkmate rows: backend
WARM = {"checkmate-highs-warm": "HiGHS", "checkmate-scip-warm": "SCIP"}
TIE = 1e-6  # overheads this close are the same cost
NO_BOUND = 0.9999  # a gap this large: the backend proved no bound above 0
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}

Row = dict[str, Any]


def outcome(row: Row) -> str:
    """What a row ended with, as the tables say it: optimal, feasible, infeasible (a BudgetError: the
    model proved no schedule fits), no solution in limit (a SolverError), killed, or the error's type."""
    error = row.get("error", "")
    if row["status"] != "error":
        return row["status"]
    if error.startswith("BudgetError"):
        return "infeasible"
    if error.startswith("SolverError") and ("no solution" in error or "found no" in error):
        return "no solution in limit"
    return "killed" if error.startswith("killed") else error.split(":")[0] or "error"


def has_schedule(row: Row | None) -> bool:
    return row is not None and row["status"] in ("optimal", "feasible")


def seconds(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def gaps_said(rows: Sequence[Row]) -> str:
    gaps = [r["gap"] for r in rows if r.get("gap") is not None]
    return common.span(gaps, "{:.0%}".format) if gaps else "not reported"


def graphs_said(graphs: Sequence[str], every: Sequence[str]) -> str:
    """``all four graphs`` when ``graphs`` are all of ``every`` (more than one), else their list."""
    if len(every) > 1 and set(graphs) == set(every):
        return f"all {NUMBER_WORDS.get(len(every), len(every))} graphs"
    return listing(list(graphs))


def cells_said(rows: Sequence[Row]) -> str:
    """``gpt-l2 at 70% and 50%, unet at 70%``: the rows' cells, grouped by graph."""
    by_graph = common.grouped(rows, lambda r: r["graph"], lambda r: budget(r["budget_share"]))
    return listing([f"{g} at {listing(shares)}" for g, shares in by_graph.items()])


def warm_start(row: Row) -> tuple[str | None, str, float | None]:
    """A row's warm start: the method it came from (None without one), ``optimal`` or ``feasible`` where
    that method's own search said so (else ''), and its overhead (None where the row has no cost)."""
    if row.get("warm_start_cost") is None:
        return None, "", None
    method = row["warm_start"].split(",")[0]
    note = (row.get("warm_start_tried") or {}).get(method, "")
    plain_cost = None if row.get("compute_cost") is None else row["compute_cost"] / (1 + row["overhead"])
    return (method, next((s for s in ("optimal", "feasible") if note.startswith(s)), ""),
            None if plain_cost is None else row["warm_start_cost"] / plain_cost - 1)


def by_cell(rows: Sequence[Row]) -> dict[tuple[str, float], dict[str, Row]]:
    """(graph, budget share) -> method -> row."""
    return common.cells(rows, lambda r: (r["graph"], r["budget_share"]))


def distinct(rows: Sequence[Row], key: str) -> list[Any]:
    """The rows' values of ``key``, each once, in the order they first come."""
    return list(dict.fromkeys(r[key] for r in rows))


def in_cell_order(rows: Sequence[Row]) -> list[Row]:
    """The rows graph by graph, each graph's budgets largest first, the methods in the run's order."""
    graphs, methods = distinct(rows, "graph"), distinct(rows, "method")
    return sorted(rows, key=lambda r: (graphs.index(r["graph"]), -r["budget_share"], methods.index(r["method"])))


def moccasin_values(rows: Sequence[Row]) -> dict[str, Any]:
    """How many cells each method proves optimal; where and how fast moccasin proves, fails or gives up."""
    moc = [r for r in rows if r["method"] == "moccasin"]
    counts = {m: sum(r["status"] == "optimal" for r in of)
              for m, of in common.grouped(rows, lambda r: r["method"]).items()}
    ended = common.grouped(moc, lambda r: outcome(r) if outcome(r) in ("optimal", "feasible", "infeasible") else "")
    optimal, feasible, infeasible, nothing = (ended.get(k, []) for k in ("optimal", "feasible", "infeasible", ""))
    optimal_at = common.grouped(optimal, lambda r: r["budget_share"], lambda r: r["graph"])
    sized = [r["variables"] for r in moc if r.get("variables") is not None]
    return {"sized": sized and common.span(sized, "{:,}".format), "mine": counts.get("moccasin", 0),
            "practical": counts.get("moccasin", 0) > max((counts.get(m, 0) for m in CHECKMATE), default=0),
            "cells": len(by_cell(rows)),
            "theirs": [f"{counts.get(m, 0)} on {backend}" for m, backend in CHECKMATE.items() if m in counts],
            "optimal_seconds": optimal and common.span((r["solve_seconds"] for r in optimal), seconds, unit=" s"),
            "optimal_at": [f"at {budget(s)} on {graphs_said(optimal_at[s], distinct(moc, 'graph'))}"
                           for s in distinct(moc, "budget_share") if s in optimal_at],
            "feasible": feasible and cells_said(feasible), "feasible_gap": gaps_said(feasible),
            "infeasible": infeasible and cells_said(infeasible),
            "infeasible_seconds": infeasible and seconds(max(r["wall_seconds"] for r in infeasible)),
            "nothing": nothing and cells_said(nothing)}


def checkmate_values(rows: Sequence[Row]) -> dict[str, Any]:
    """Checkmate's model size, optimal cells, unproven schedules (with moccasin's) and schedules per backend."""
    cm = [r for r in rows if r["method"] in CHECKMATE and r.get("variables") is not None]
    cells = by_cell(rows)
    optimal = {key: backends for key, c in cells.items()
               if (backends := [CHECKMATE[m] for m, r in c.items() if m in CHECKMATE and r["status"] == "optimal"])}
    both = [(key, r, cells[key]["moccasin"]) for key in optimal for m, r in cells[key].items()
            if m in CHECKMATE and r["status"] == "optimal"
            and cells[key].get("moccasin", {}).get("status") == "optimal"]
    unproven = [(r, cells[(r["graph"], r["budget_share"])].get("moccasin")) for r in rows
                if r["method"] in CHECKMATE and r["status"] == "feasible"]
    counts = {backend: sum(r["method"] == m and has_schedule(r) for r in rows) for m, backend in CHECKMATE.items()}
    return {"variables": cm and common.span((r["variables"] for r in cm), "{:,}".format),
            "constraints": cm and common.span((r["constraints"] for r in cm), "{:,}".format),
            "optimal": [f"{g} at {budget(s)} ({listing(b)})" for (g, s), b in optimal.items()],
            "both_optimal": both, "overheads": sorted({f"{moc['overhead']:+.2%}" for _, _, moc in both}),
            "differ": [f"{g} at {budget(s)} ({CHECKMATE[r['method']]} {r['overhead']:+.2%} against "
                       f"{moc['overhead']:+.2%})"
                       for (g, s), r, moc in both if abs(r["overhead"] - moc["overhead"]) > TIE],
            "unproven": unproven,
            "none": sum(r["method"] in CHECKMATE and not has_schedule(r) for r in rows),
            "counts": sorted(counts.items(), key=lambda kv: -kv[1]),
            "runs": {backend: sum(r["method"] == m for r in rows) for m, backend in CHECKMATE.items()}}


def smallest_values(main: Sequence[Row]) -> dict[str, Any]:
    """What checkmate returns at the smallest budget, against moccasin, and the gaps."""
    smallest = min(distinct(main, "budget_share"))
    cells = by_cell([r for r in main if r["budget_share"] == smallest])
    found = [(r, c.get("moccasin")) for c in cells.values() for m, r in c.items()
             if m in CHECKMATE and has_schedule(r)]
    moccasin = {r["graph"]: m for r, m in found}
    return {"share": smallest, "only": len(moccasin) < len(cells),
            "found": [(g, [r for r, _ in found if r["graph"] == g], m) for g, m in moccasin.items()],
            "no_optimum": not any(r["status"] == "optimal" for r, _ in found),
            "gaps": [r["gap"] for r, _ in found if r.get("gap") is not None],
            "gap_range": gaps_said([r for r, _ in found])}


def warm_values(rows: Sequence[Row]) -> dict[str, Any]:
    """The warm-start study: runs with and without a start, the starts, the bounds proved, a shorter limit's cost."""
    off, on = [r for r in rows if r["method"] in CHECKMATE], [r for r in rows if r["method"] in WARM]
    started_on = [r for r in on if warm_start(r)[0] is not None]
    started = [r for r in rows if warm_start(r)[0] is not None and has_schedule(r)]
    longest = max((r["time_limit"] for r in started), default=None)
    timed = [r for r in rows if "wall_seconds" in r]
    return {"off": off, "off_found": any(has_schedule(r) for r in off),
            "off_limits": sorted({seconds(r["time_limit"]) for r in off}),
            "on": len(on), "returned": sum(map(has_schedule, on)),
            "ready": started_on and common.span((r["warm_start_seconds"] for r in started_on), seconds, unit=" s"),
            "from": sorted({warm_start(r)[0] for r in started_on}),
            "missing": [r for r in on if warm_start(r)[0] is None],
            "started": started, "longest": longest and seconds(longest),
            "bounds": [r for r in started if r["time_limit"] == longest and r.get("gap") is not None],
            "better": [r for r in started if r["compute_cost"] < r["warm_start_cost"] * (1 - TIE)],
            "tried": max((r for r in on if r.get("warm_start_tried")), key=lambda r: r["time_limit"], default=None),
            "overran": max((r["wall_seconds"] - r["time_limit"] for r in timed), default=None),
            "shorter": shorter_limits(rows) if timed else []}


def shorter_limits(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """(a run at a shorter limit, the same backend's run at the full one) where the full one has a schedule."""
    longest = max(r["time_limit"] for r in rows)
    full = {r["method"]: r for r in rows if r["time_limit"] == longest and has_schedule(r)}
    return [(r, full[r["method"]]) for r in rows if r["time_limit"] < longest and r["method"] in full]


def page(results: dict[str, Any], header: str, results_link: str) -> str:
    """The whole page from one run's rows and meta, linking their file as ``results_link``."""
    rows, run = results["rows"], results["meta"]
    studies = common.grouped(rows, lambda r: r.get("study"))
    main, copies, warm = (studies.get(study, []) for study in ("main", "copies", "warm-start"))
    if not main:
        raise BonsaiError("The run has no rows of the main study to write a page from: run the suite with --page.")
    return common.fill(
        "checkmate_moccasin", header=header, run=run, dates=common.run_dates(run), results_link=results_link,
        loads=[r["load"] for r in rows if r.get("load") is not None], graphs=listing(distinct(main, "graph")),
        budgets=listing([budget(s) for s in distinct(main, "budget_share")]), limit=seconds(run["time_limit"]),
        first_per_graph=[of[0] for of in common.grouped((r for r in rows if "nodes" in r), lambda r: r["graph"])
                         .values()],
        in_cell_order=in_cell_order(main), copies=copies, warm=warm, moccasin=moccasin_values(main),
        main=main, checkmate=checkmate_values(main), smallest=smallest_values(main),
        no_bound=NO_BOUND, tie=TIE, warm_graph=next((r for r in warm if "nodes" in r), None), warm_start=warm_start,
        warm_methods=WARM,
        warm_sized=next((r for r in warm if r["method"] in WARM and r.get("variables") is not None), None),
        warm_said=warm_values(warm), backend={**CHECKMATE, **WARM}, outcome=outcome, has_schedule=has_schedule,
        seconds=seconds)
