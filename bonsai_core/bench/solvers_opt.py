"""Measure the op-level solvers (checkmate on HiGHS and SCIP, moccasin on CP-SAT) on traced zoo graphs.

For each graph and each budget (a share of the no-remat peak), each method solves under a time limit;
the table reports status, overhead (the simulated schedule's extra compute), gap, model size and
times. Each (graph, method) runs in its own process with a hard wall-clock limit, so a backend that
ignores its time limit cannot stall the run; inside it the budgets are solved in turn, which is how
the explorer's slider re-solves (checkmate's model is built once and re-solved with a new budget).

    bonsai bench solvers-opt --time-limit 60 -o bench-opt.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRAPHS = {"gpt-l1": ("gpt", {"layers": 1}), "gpt-l2": ("gpt", {"layers": 2}),
          "resnet": ("resnet", {}), "unet": ("unet", {})}
METHODS = {"checkmate-highs": ("checkmate", {"backend": "highs"}),
           "checkmate-scip": ("checkmate", {"backend": "scip"}),
           "moccasin": ("moccasin", {}),
           "moccasin-c3": ("moccasin", {"copies": 3})}


def run_one(graph_file: str, label: str, method: str, fractions: list[float], time_limit: float) -> None:
    """Solve one graph with one method at each budget; print one JSON line per budget."""
    import warnings

    from bonsai_core.errors import BonsaiError
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve

    warnings.filterwarnings("ignore")
    name, options = METHODS[method]
    graph = load_graph(graph_file)
    peak = no_remat_peak(graph)
    for fraction in fractions:
        budget = int(fraction * peak)
        row = {"graph": label, "nodes": graph.n, "edges": graph.num_edges, "method": method,
               "budget_share": fraction, "budget": budget, "no_remat_peak": peak,
               "peak_lower_bound": graph.peak_lower_bound, "time_limit": time_limit}
        start = time.perf_counter()
        try:
            stats = solve(graph, budget, name, time_limit=time_limit, **options).stats
            row.update({k: stats.get(k) for k in ("status", "gap", "variables", "constraints", "build_seconds",
                                                  "solve_seconds", "objective", "compute_cost", "overhead",
                                                  "peak", "recomputes")})
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


def table(rows: list[dict]) -> str:
    lines = ["| graph | nodes | budget | method | status | overhead | gap | variables | constraints | build s | solve s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(key, fmt):
            v = r.get(key)
            return "" if v is None else fmt.format(v)
        status = r["status"] if r["status"] != "error" else r.get("error", "error").split(":")[0]
        if r["status"] == "error" and "time limit" in r.get("error", ""):
            status = "no solution in limit"
        elif r["status"] == "error" and "BudgetError" in r.get("error", ""):
            status = "infeasible"
        lines.append(f"| {r['graph']} | {r['nodes']} | {r['budget_share']:.0%} | {r['method']} | {status} | "
                     f"{f('overhead', '{:.2%}')} | {f('gap', '{:.2%}')} | {f('variables', '{}')} | "
                     f"{f('constraints', '{}')} | {f('build_seconds', '{:.2f}')} | {f('solve_seconds', '{:.1f}')} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's options (``--one``: the child process's own, one graph and one method)."""
    p.add_argument("--graphs", nargs="+", default=list(GRAPHS), choices=list(GRAPHS))
    p.add_argument("--methods", nargs="+", default=list(METHODS)[:3], choices=list(METHODS))
    p.add_argument("--budgets", nargs="+", type=float, default=[0.9, 0.7, 0.5], help="shares of the no-remat peak")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("-o", "--output", default="bench-opt.jsonl")
    p.add_argument("--one", nargs=3, metavar=("GRAPH_FILE", "LABEL", "METHOD"), help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Each (graph, method) in a child process under a hard limit; the rows as JSON lines, then a table."""
    if args.one:
        run_one(*args.one, args.budgets, args.time_limit)
        return 0

    from bonsai_core.graph import save_graph
    from bonsai_core.trace import trace_model

    out = Path(args.output)
    out.write_text("")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.graphs:
            model, options = GRAPHS[label]
            graph_file = f"{tmp}/{label}.json"
            save_graph(trace_model(model, **options).graph, graph_file)
            for method in args.methods:
                # Each budget may take the time limit plus building and a backend's overrun.
                hard = len(args.budgets) * (args.time_limit * 1.5 + 60)
                cmd = [sys.executable, "-m", "bonsai_core.cli", "bench", "solvers-opt", "--one", graph_file, label,
                       method, "--time-limit", str(args.time_limit), "--budgets", *map(str, args.budgets)]
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=hard)
                    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                    if done.returncode:
                        print(done.stderr[-2000:], file=sys.stderr)
                except subprocess.TimeoutExpired as e:
                    stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
                    print(f"{label} {method}: killed after {hard:.0f} s", file=sys.stderr)
                for ln in lines:
                    rows.append(json.loads(ln))
                    with out.open("a") as f:
                        f.write(ln + "\n")
                    print(ln, flush=True)
    print(table(rows))
    return 0
