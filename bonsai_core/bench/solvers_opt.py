"""Measure the op-level solvers (checkmate on HiGHS and SCIP, moccasin on CP-SAT) on traced zoo graphs.

For each graph and each budget (a share of the no-remat peak), each method solves under a time limit;
the table reports status, overhead (the simulated schedule's extra compute), gap, model size and
times. Each (graph, method) runs in its own process with a hard wall-clock limit, so a backend that
ignores its time limit cannot stall the run; inside it the budgets are solved in turn, which is how
the explorer's slider re-solves (checkmate's model is built once and re-solved with a new budget).
``checkmate-highs`` and ``checkmate-scip`` are the MILP alone (``warm_start=false``); the ``-warm``
labels are checkmate as a user gets it, started from the cheapest schedule another method finds.

    bonsai bench solvers-opt --time-limit 60 -o bench-opt.jsonl
    bonsai bench solvers-opt --page docs/results/checkmate_moccasin.md  # the page's three studies: about 40 min
    bonsai bench solvers-opt --page docs/results/checkmate_moccasin.md --report-only

``--page`` runs every graph, method and budget of the main table, moccasin with 3 copies at 50%, and
checkmate's warm start on and off on the 1-layer GPT at 60% (at the time limit, half of it and a sixth);
the rows go to ``-o`` (by default the page's path with ``.jsonl``), the run's command, dates and machine
next to them (``.run.json``), and :mod:`bonsai_core.bench.solvers_opt_page` writes the page from those
two files (``--report-only``: again, measuring nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bonsai_core.bench import common
from bonsai_core.errors import BonsaiError

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
# What the page reads of the run file: a run without "ended" did not finish.
RUN_KEYS = ("command", "started", "ended", "seconds", "machine", "load_end", "torch", "versions", "time_limit")


def run_one(graph_file: str, label: str, method: str, fractions: list[float], time_limit: float) -> None:
    """Solve one graph with one method at each budget; print one JSON line per budget."""
    import warnings

    from bonsai_core.errors import BonsaiError
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve
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
        except BonsaiError as e:
            row.update({"status": "error", "error": f"{type(e).__name__}: {e}"})
            row.update(model_size(graph, name, budget, options))
        row["wall_seconds"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)


def model_size(graph, method: str, budget: int, options: dict) -> dict:
    """Variables and constraints of the model a failed solve built (they are in the stats otherwise)."""
    if method == "checkmate":
        from bonsai_core.solvers import checkmate
        from bonsai_core.solvers.milp import problem_size
        from bonsai_core.solvers.views import contract_views

        model = checkmate._models.get(contract_views(graph)[0].hash)
        if model is None:
            return {}
        variables, constraints = problem_size(model.problem)
        return {"variables": variables, "constraints": constraints, "build_seconds": model.build_seconds}
    from bonsai_core.solvers.moccasin import build_model
    from bonsai_core.solvers.views import contract_views

    built = build_model(contract_views(graph)[0], budget, options.get("copies", 2))
    return {"variables": built.variables, "constraints": built.constraints, "build_seconds": built.build_seconds}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's options (``--one``: the child process's own, one graph and one method)."""
    from bonsai_core.arguments import fraction_arg

    p.add_argument("--graphs", nargs="+", choices=list(GRAPHS), help=f"default: {' '.join(GRAPHS)}")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), help=f"default: {' '.join(DEFAULT_METHODS)}")
    p.add_argument("--budgets", nargs="+", type=fraction_arg, metavar="PCT",
                   help="shares of the no-remat peak, 70 or 70%% (default: "
                        + " ".join(f"{b * 100:g}" for b in DEFAULT_BUDGETS) + ")")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("-o", "--output", help="the rows, one JSON line each (default bench-opt.jsonl; with --page, "
                                          "the page's path with .jsonl)")
    p.add_argument("--page", metavar="PAGE", help="run the page's three studies (every graph, method and budget; "
                                                  "moccasin-c3 at 50%%; the warm start) and write the page here")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: write PAGE again from the rows (-o) and the run file beside them")
    p.add_argument("--one", nargs=3, metavar=("GRAPH_FILE", "LABEL", "METHOD"), help=argparse.SUPPRESS)


def output_path(args: argparse.Namespace) -> Path:
    if args.output is not None:
        return Path(args.output)
    return Path(args.page).with_suffix(".jsonl") if args.page else Path("bench-opt.jsonl")


def run_file(output: Path) -> Path:
    """Where the run's command, dates and machine are kept: beside its rows."""
    return output.with_suffix(".run.json")


def check_page_args(args: argparse.Namespace) -> None:
    """Refuse, before any measurement, what would fail only at the end: a page in a missing folder, a page
    of a subset of the suite, --report-only without a page or without a finished run."""
    if args.page is not None:
        if not Path(args.page).parent.is_dir():
            raise BonsaiError(f"--page {args.page}: the folder {Path(args.page).parent} does not exist.")
        if args.graphs or args.methods or args.budgets:
            raise BonsaiError("--page reports every graph, method and budget: leave out --graphs, --methods and "
                              "--budgets.")
    if args.report_only:
        if args.page is None:
            raise BonsaiError("--report-only writes the page again: name it with --page PAGE.")
        output = output_path(args)
        missing = [str(p) for p in (output, run_file(output)) if not p.is_file()]
        if missing:
            raise BonsaiError(f"--report-only: {' and '.join(missing)} missing; run the suite with --page, without "
                              "--report-only, first.")


def read_run(path: Path) -> dict[str, Any]:
    """The run file of a finished run, refused with the reason when it is not one."""
    try:
        run = json.loads(path.read_text())
    except ValueError as e:
        raise BonsaiError(f"{path} is not JSON ({e}); run the suite with --page again.") from None
    missing = [k for k in RUN_KEYS if k not in run]
    if missing:
        raise BonsaiError(f"{path} lacks {', '.join(missing)}: its run did not finish; run the suite with --page "
                          "again.")
    return run


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_page(output: Path, page: str) -> None:
    """The page from the rows in ``output`` and the run file beside them; its header names the command
    that measured them."""
    from bonsai_core.bench import solvers_opt_page

    run = read_run(run_file(output))
    header = common.page_header(run["command"], solvers_opt_page.SOURCES)
    rows_link = os.path.relpath(output, Path(page).parent)
    Path(page).write_text(solvers_opt_page.page(read_rows(output), run, header, rows_link))


def planned_runs(args: argparse.Namespace) -> list[tuple[str, str, str, list[float], float]]:
    """(study, graph, method, budgets, time limit) of every child process: the options' grid, or with
    ``--page`` the page's three studies."""
    limit = args.time_limit
    if not args.page:
        return [("main", graph, method, args.budgets or DEFAULT_BUDGETS, limit)
                for graph in args.graphs or GRAPHS for method in args.methods or DEFAULT_METHODS]
    return ([("main", graph, method, DEFAULT_BUDGETS, limit) for graph in GRAPHS for method in DEFAULT_METHODS]
            + [("copies", graph, COPIES_METHOD, [COPIES_BUDGET], limit) for graph in GRAPHS]
            + [("warm-start", WARM_GRAPH, method, [WARM_BUDGET], round(limit * share, 1)) for method, share in WARM_RUNS])


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
              "error": f"killed: no answer within the hard limit of {hard:.0f} s"} for b in budgets if b not in reported]
    return rows


def versions() -> dict[str, str]:
    """The solver packages' versions, as the page quotes them."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("highspy", "pyscipopt", "ortools", "cvxpy", "torch"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out


def main(args: argparse.Namespace) -> int:
    """Each (graph, method) in a child process under a hard limit; the rows as JSON lines, then a table
    (with ``--page``, the page's studies and the page)."""
    if args.one:
        run_one(*args.one, args.budgets or DEFAULT_BUDGETS, args.time_limit)
        return 0
    check_page_args(args)
    output = output_path(args)
    if args.report_only:
        write_page(output, args.page)
        print(f"wrote {args.page} from {output}")
        return 0

    import torch

    from bonsai_core.bench.solvers_opt_page import table
    from bonsai_core.graph import save_graph
    from bonsai_core.trace import trace_model

    run = {"command": common.command(), "started": common.utc_now(), "machine": common.machine(), "torch": torch.__version__,
           "versions": versions(), "time_limit": args.time_limit}
    run_file(output).write_text(json.dumps(run, indent=1))
    output.write_text("")
    start = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        graph_files: dict[str, str] = {}
        for study, label, method, budgets, limit in planned_runs(args):
            if label not in graph_files:
                model, options = GRAPHS[label]
                graph_files[label] = f"{tmp}/{label}.json"
                save_graph(trace_model(model, **options).graph, graph_files[label])
            for row in run_child(graph_files[label], label, method, budgets, limit):
                row.update(study=study, load=round(os.getloadavg()[0], 1))  # the machine's load as the child ended
                rows.append(row)
                with output.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: row.get(k) for k in ("study", "graph", "method", "budget_share", "status",
                                                          "overhead", "gap", "wall_seconds")}), flush=True)
    run.update(ended=common.utc_now(), seconds=round(time.perf_counter() - start, 1), load_end=round(os.getloadavg()[0], 1))
    run_file(output).write_text(json.dumps(run, indent=1))
    print(table(rows))
    if args.page:
        write_page(output, args.page)
        print(f"wrote {args.page} and {output} in {run['seconds'] / 60:.0f} min")
    return 0
