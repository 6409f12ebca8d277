"""``bonsai bench [methods]``: every method and every peer on the same models and budgets, in one run
(the default suite).

Keeps the run in ``results.json`` (rows, each method's smallest budget per model, command, dates, machine)
and writes from it results.csv (a row per model x budget x method), reach.csv, results.md
(templates/bench_results.md) and PNG plots; ``--page`` writes docs/results/benchmarks.md from results.json
alone (templates/benchmarks.md), ``--report-only`` the page and the files again, measuring nothing. Schedule
rows come from :func:`bonsai_core.solvers.solve` (checked by the simulator), peer rows from a real CPU step.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from bonsai_core.allocator import replay
from bonsai_core.arguments import SOLVE_TIME_LIMIT, fraction_arg, positive_seconds
from bonsai_core.bench import common
from bonsai_core.bench.common import TIE, median, pct
from bonsai_core.bound import lower_bound
from bonsai_core.errors import BonsaiError, ModelError
from bonsai_core.regions import plan_schedule
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import METHODS, accepted_options, available_methods, solve
from bonsai_core.solvers.deadline import Deadline

# Each column of results.csv and its pandas type (nullable: a row that did not run has no peak).
COLUMN_TYPES = {"model": "string", "nodes": "Int64", "method": "string", "budget_bytes": "Int64",
                "budget_fraction": "Float64", "feasible": "boolean", "peak": "Int64", "overhead": "Float64",
                "solve_seconds": "Float64", "build_seconds": "Float64", "variables": "Int64", "constraints": "Int64",
                "status": "string", "gap": "Float64", "reserved_peak": "Int64", "fragmentation": "Float64",
                "note": "string", "bound": "Float64"}
COLUMNS = list(COLUMN_TYPES)
OPTIMISERS = ("checkmate", "bonsai", "moccasin")
# reach.csv: per model, the smallest budget each method reaches (bytes) and how it was found.
REACH_TYPES = {"model": "string", "nodes": "Int64", "no_remat_peak": "Int64", "lower_bound": "Int64",
               "bonsai": "Int64", "bonsai_status": "string", "chen": "Int64", "dtr": "Int64", "coop": "Int64",
               "seconds": "Float64"}
REACH_METHODS = ("bonsai", "chen", "dtr", "coop")
RECORD_PAGE = "docs/results/benchmarks.md"
# the files that decide what the page says (tests/test_docs.py checks their hash against the page's)
SOURCES = ["bonsai_core/bench/methods.py", common.template_source("benchmarks")]
BISECTION_STEPS = 10  # dtr/coop: budget resolution (no-remat peak - lower bound) / 2**10, about 0.1%


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model at one size: ``gpt``, ``gpt:layers=2,width=256`` or ``hf:gpt2:layers=2``, with
    budgets of its own after ``@`` (shares of its no-remat peak, run besides the bench's):
    ``gpt:layers=4@40,37``."""

    name: str
    options: tuple[tuple[str, int], ...] = ()
    budgets: tuple[float, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        from bonsai_core.models.zoo import ZOO

        text, at, pcts = text.partition("@")
        budgets = []
        for item in filter(None, pcts.split(",")):
            try:
                budgets.append(fraction_arg(item))  # as --budgets reads them
            except argparse.ArgumentTypeError:
                raise ModelError(f"Cannot read the budget {item!r} in {text + at + pcts!r}; write model@PCT,PCT, "
                                 "for example gpt@45,40 (shares of the no-remat peak).") from None
        if at and not budgets:
            raise ModelError(f"No budgets after '@' in {text + at!r}; write model@PCT,PCT, for example gpt@45,40.")
        # options follow the last colon; names may hold colons too (hf:gpt2, package.module:factory)
        name, colon, opts = text.rpartition(":")
        if not colon or ("=" not in opts and name.strip() not in ZOO):
            name, opts = text, ""
        options = []
        for item in filter(None, opts.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not value.strip().isdigit():
                raise ModelError(f"Cannot read the model option {item!r} in {text!r}; write name:key=N,key=N, "
                                 "for example gpt:layers=2,width=256.")
            options.append((key.strip(), int(value)))
        return cls(name.strip(), tuple(sorted(options)), tuple(budgets))

    @property
    def label(self) -> str:
        return self.name if not self.options else self.name + ":" + ",".join(f"{k}={v}" for k, v in self.options)

    def budgets_with(self, shared: list[float]) -> list[float]:
        """The bench's budgets and this model's own, largest first."""
        return sorted(set(shared) | set(self.budgets), reverse=True)


QUICK_MODELS = ("mlp:layers=3,batch=512", "gpt:layers=1,seq=64")
QUICK_BUDGETS = (0.7, 0.5)
# The 4-layer GPT (525 nodes) first, with the budgets where methods part ways; then the
# Hugging Face models at their default sizes, the zoo at its default sizes (plus the 1-layer gpt,
# the one transformer checkmate's op-level MILP is run on) and GPT-2 small last. No larger zoo sizes:
# they add minutes of time-limited MILPs, and the full run is meant to fit ~25 minutes on 2 cores.
FULL_MODELS = (
    "gpt:layers=4,width=256,seq=256,heads=4,vocab=1024,batch=8@50,45,40,37",
    "hf:gpt2", "hf:bert", "hf:llama", "hf:vit", "hf:resnet",
    "mlp", "vgg", "resnet", "unet", "gpt:layers=1,seq=64", "gpt",
    "gpt:batch=8,seq=512,width=768,layers=12,heads=12,vocab=50257",
)
FULL_BUDGETS = (0.9, 0.7, 0.5, 0.3)
# Graph sizes past which the full bench does not run a method (each still has its own hard limits):
# the op-level MILP's O(n^2) binaries would only time out there, at the time limit per cell.
# Peers run a real CPU step per knob setting, which GPT-2 small makes minutes long.
BENCH_NODE_LIMITS = {"checkmate": 160, "moccasin": 700, "torch-budget": 600, "per-block": 600}


@dataclass
class BenchConfig:
    models: list[str]
    budgets: list[float]
    methods: list[str]
    peers: list[str]
    time_limit: float = 60.0
    backend: str = "highs"
    profile: str = "h100"
    max_nodes: dict[str, int] = field(default_factory=dict)  # method -> largest graph it is run on


def run_bench(config: BenchConfig, out_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (model, budget, method) and peer, and each method's smallest budget per model: their rows, the
    tables written after each model, so a long run leaves results behind; a line printed per measurement."""
    from bonsai_core.trace import trace_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    reach: list[dict[str, Any]] = []
    for spec in map(ModelSpec.parse, config.models):
        traced = trace_model(spec.name, profile=config.profile, **dict(spec.options))
        g = traced.graph
        reference = no_remat_peak(g)
        say(f"{spec.label}: {g.n} nodes, no-remat peak {reference} bytes (traced in {traced.seconds:.1f} s)")
        budgets = spec.budgets_with(config.budgets)
        for fraction in budgets:
            budget = int(fraction * reference)
            bound = lower_bound(g, budget)  # no schedule within the budget computes less (as an overhead)
            for method in config.methods:
                row = _row(spec.label, g.n, method, budget, fraction)
                row["bound"] = bound.cost / g.total_cost - 1 if math.isfinite(bound.cost) else None
                if why := too_large(config, method, g.n):
                    rows.append({**row, "note": why})
                    continue
                start = time.perf_counter()
                try:
                    s = solve(g, budget, method=method, **_options(method, config))
                    row.update(_schedule_fields(g, s))
                except BonsaiError as e:
                    row["note"] = str(e)[:300]
                    row["solve_seconds"] = time.perf_counter() - start
                rows.append(row)
                say(f"  {fraction:.0%} {method:10s} feasible={row['feasible']} overhead={row['overhead']} "
                    f"t={row['solve_seconds']:.2f}s {row['note']}")
        for peer in config.peers:
            if why := too_large(config, peer, g.n):
                rows.extend({**_row(spec.label, g.n, peer, int(f * reference), f), "note": why} for f in budgets)
            else:
                rows.extend(_peer_rows(peer, spec, g.n, reference, budgets, config))
        if any(m in REACH_METHODS for m in config.methods):
            reach.append(smallest_budgets(spec.label, g, config))
            say("  smallest budgets: " + ", ".join(f"{m} {share(reach[-1], m)}"
                                                   for m in ("lower_bound",) + REACH_METHODS if m in reach[-1]))
        _write(rows, reach, out)
    return rows, reach


def say(line: str) -> None:
    """A line of the run's progress, printed at once (a long run is followed as it goes)."""
    print(line, flush=True)


def too_large(config: BenchConfig, method: str, nodes: int) -> str | None:
    """Why the bench does not run ``method`` on a graph of ``nodes`` (its size limit); None when it does."""
    limit = config.max_nodes.get(method)
    if limit is not None and nodes > limit:
        return f"not run: {nodes} nodes > {limit} (bench size limit for {method})"
    return None


def add_arguments(p: argparse.ArgumentParser, output_required: bool = True) -> None:
    """The suite's options (``bonsai bench`` takes them too, without a required output: ``--list`` needs none)."""
    p.add_argument("--models", nargs="+", metavar="MODEL",
                   help="zoo or hf: models, e.g. gpt or gpt:layers=2,width=256; MODEL@PCT,PCT adds budgets for that "
                        "model")
    p.add_argument("--budgets", nargs="+", type=fraction_arg, metavar="PCT", help="shares of the no-remat peak")
    p.add_argument("--methods", nargs="+", metavar="METHOD", help="default: every method")
    p.add_argument("--peers", nargs="*", metavar="PEER", help="torch-budget, per-block (default: both)")
    p.add_argument("--quick", action="store_true", help="two small models, two budgets (a minute or two)")
    p.add_argument("--time-limit", type=positive_seconds, default=None, metavar="S",
                   help="per solve (default 60, quick 10)")
    p.add_argument("--backend", choices=("highs", "scip"), default="highs", help="MILP backend")
    p.add_argument("-o", "--output", "--out", dest="out", required=output_required, metavar="DIR",
                   help="folder of results.json and the tables and plots written from it")
    common.add_page_arguments(p, None, RECORD_PAGE)


def measure(config: BenchConfig, out: Path) -> dict[str, Any]:
    """The bench's rows and smallest budgets (as results.csv and reach.csv hold them) and the run's meta."""
    meta = common.run_meta("started", time_limit=config.time_limit, node_limits=config.max_nodes)
    start = time.perf_counter()
    run_bench(config, out)
    meta.update(seconds=round(time.perf_counter() - start, 1), ended=common.utc_now())
    return {"meta": meta, "rows": load_rows(out / "results.csv"), "reach": load_rows(out / "reach.csv", REACH_TYPES)}


def main(args: argparse.Namespace) -> int:
    """``bonsai bench [methods]``: the bench into ``-o`` (results.json, the tables and plots) and the page;
    the page reports the default models and budgets only."""
    if args.out is None:
        args.parser.error("the following arguments are required: -o/--output")
    config = None if args.report_only else config_from(args)
    refusal = common.page_refusal(args, record_page=RECORD_PAGE, narrowed=common.changed(args, ("models", "budgets")),
                                  whole="the default models and budgets")
    return common.run_page_suite("methods", args, refusal, lambda: measure(config, Path(args.out)),
                                 common.page_writer(page, SOURCES, args.out), write_beside)


def write_beside(results: dict[str, Any], out: Path) -> None:
    """The tables and the plots, from the run's results."""
    _write(results["rows"], results["reach"], out)
    write_plots(results["rows"], out)


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The bench the options ask for, every method and peer named checked."""
    from bonsai_core.peers import PEERS

    methods = args.methods or available_methods(any_graph=True)  # the zoo's MLPs have no block stack
    peers = args.peers if args.peers is not None else list(PEERS)
    for option, kind, names, known in (("methods", "method", methods, METHODS), ("peers", "peer", peers, PEERS)):
        for name in (n for n in names if n not in known):
            args.parser.error(f"argument --{option}: unknown {kind} {name!r} (choose from {', '.join(known)})")
    return BenchConfig(
        models=args.models or list(QUICK_MODELS if args.quick else FULL_MODELS),
        budgets=args.budgets or list(QUICK_BUDGETS if args.quick else FULL_BUDGETS),
        methods=methods, peers=peers,
        time_limit=args.time_limit or (10.0 if args.quick else SOLVE_TIME_LIMIT), backend=args.backend,
        max_nodes=dict(BENCH_NODE_LIMITS))


def smallest_budgets(model: str, graph: Any, config: BenchConfig) -> dict[str, Any]:
    """The smallest budget (bytes) each of bonsai, chen, dtr and coop in the bench reaches on ``graph``: bonsai's
    min-peak MILP (:func:`~bonsai_core.solvers.bonsai.smallest_budget`; ``bonsai_status``: proven or not), chen's
    lowest simulated plan peak, and for dtr and coop what a bisection from the per-op bound meets within one time
    limit (a budget met, not a proven minimum: a heuristic is not monotone in the budget)."""
    start = time.perf_counter()
    row: dict[str, Any] = {"model": model, "nodes": graph.n, "no_remat_peak": no_remat_peak(graph),
                           "lower_bound": graph.peak_lower_bound}
    if "bonsai" in config.methods:
        from bonsai_core.solvers.bonsai import smallest_budget

        try:
            row["bonsai"], row["bonsai_status"] = smallest_budget(graph, backend=config.backend,
                                                                  time_limit=config.time_limit)
        except BonsaiError as e:
            row["bonsai"], row["bonsai_status"] = None, f"failed: {e}"[:120]
    if "chen" in config.methods:
        from bonsai_core.solvers.chen import candidate_plans

        row["chen"] = min(simulate(graph, plan_schedule(graph, plan, "chen")).peak
                          for _, plan in candidate_plans(graph, "auto"))
    for method in ("dtr", "coop"):
        if method in config.methods:
            row[method] = bisect_budget(graph, method, row["no_remat_peak"], config.time_limit)
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row


def bisect_budget(graph: Any, method: str, reference: int, time_limit: float) -> int | None:
    """The smallest budget from the per-op lower bound to ``reference`` that ``method`` (no budget hint) meets in
    a bisection within ``time_limit``; None if it met neither end."""
    deadline = Deadline(time_limit)

    def meets(budget: int) -> bool:
        if deadline.passed():
            raise TimeoutError
        return common.overhead_or_none(graph, budget, method, time_limit=deadline.remaining()) is not None

    return common.bisect_budget(meets, graph.peak_lower_bound, reference, BISECTION_STEPS, try_lo=True)


def _options(method: str, config: BenchConfig) -> dict[str, Any]:
    """The bench's time limit and MILP backend, for the methods that take them; every solve from scratch (bonsai
    would otherwise answer a budget with a larger one's plan that fits it, in no time)."""
    accepted = accepted_options(method)
    return {k: v for k, v in (("time_limit", config.time_limit), ("backend", config.backend), ("reuse", False))
            if accepted is None or k in accepted}


def _row(model: str, nodes: int, method: str, budget: int, fraction: float) -> dict[str, Any]:
    """A row of results.csv that found no schedule (yet)."""
    return {**dict.fromkeys(COLUMNS), "model": model, "nodes": nodes, "method": method, "budget_bytes": budget,
            "budget_fraction": fraction, "feasible": False, "note": ""}


def _schedule_fields(graph: Any, schedule: Any) -> dict[str, Any]:
    st, alloc = schedule.stats, replay(graph, schedule)
    return {**{k: st.get(k) for k in ("solve_seconds", "build_seconds", "variables", "constraints", "status", "gap")},
            "feasible": True, "peak": st["peak"], "overhead": round(st["overhead"], 6),
            "reserved_peak": alloc.reserved_peak, "fragmentation": round(alloc.fragmentation, 4)}


def _peer_rows(peer: str, spec: ModelSpec, nodes: int, reference: int, budgets: list[float],
               config: BenchConfig) -> list[dict[str, Any]]:
    from bonsai_core import peers

    options = dict(spec.options)
    start = time.perf_counter()
    try:
        plain_peak, plain_cost, _ = peers.measure_eager(spec.name, options, config.profile)
        runs = peers.peer_runs(peer, spec.name, options, config.profile)
    except Exception as e:  # a peer that cannot run on this model is a result, not a crash
        say(f"  {peer}: could not run ({type(e).__name__}: {e})")
        return [{**_row(spec.label, nodes, peer, int(f * reference), f), "note": f"could not run: {e}"[:160]}
                for f in budgets]
    seconds = (time.perf_counter() - start) / max(len(runs), 1)
    rows = []
    for fraction in budgets:
        budget = int(fraction * reference)
        row = _row(spec.label, nodes, peer, budget, fraction)
        best = peers.best_within(runs, budget)
        if best is None:
            lowest = min(runs, key=lambda r: r.peak)
            row["note"] = f"no setting fits; lowest measured peak {lowest.peak} ({lowest.setting})"
        else:
            overhead = best.overhead if best.overhead is not None else best.compute_cost / plain_cost - 1
            row.update(feasible=True, peak=best.peak, overhead=round(overhead, 6),
                       solve_seconds=seconds, status="measured", note=best.setting)
        rows.append(row)
        say(f"  {fraction:.0%} {peer:10s} feasible={row['feasible']} overhead={row['overhead']} {row['note']}")
    return rows


def _write(rows: list[dict[str, Any]], reach: list[dict[str, Any]], out: Path) -> None:
    """results.csv, reach.csv and results.md."""
    import pandas as pd

    for data, types, name in ((rows, COLUMN_TYPES, "results.csv"), (reach, REACH_TYPES, "reach.csv")):
        pd.DataFrame(data, columns=list(types)).astype(types).to_csv(out / name, index=False)
    (out / "results.md").write_text(markdown_report(rows, reach))


def markdown_report(rows: list[dict[str, Any]], reach: Sequence[dict[str, Any]] = ()) -> str:
    """results.md: a table per model (best feasible in bold), the smallest budgets, where bonsai is not the best
    or a plan of its space beats it, and the solver cost."""
    models = cells_by_model(rows)
    best = {(m, f): min(feasible(c).values(), default=None) for m, f, c in every_cell(models)}
    return common.fill("bench_results", models=models, nodes=nodes, best=best, reach=reach, share=share, tie=TIE,
                       methods=list(dict.fromkeys(r["method"] for r in rows)), **plan_space_values(models),
                       reach_methods=[m for m in REACH_METHODS if any(r.get(m) is not None or r.get(f"{m}_status")
                                                                      for r in reach)],
                       not_best=[(m, f, min(feasible(c), key=feasible(c).get), best[m, f], c["bonsai"])
                                 for m, by_budget in models.items() for f, c in by_budget.items()
                                 if best[m, f] is not None and "bonsai" in c and not bonsai_cheapest(c)],
                       # where checkmate ran: (model, budget, checkmate's row, bonsai's, moccasin's or None)
                       solver_rows=[(m, f, *(c.get(k) for k in OPTIMISERS)) for m, f, c in every_cell(models)
                                    if c.get("checkmate", {}).get("status")])


def load_rows(csv_path: str | Path, types: dict[str, str] = COLUMN_TYPES) -> list[dict[str, Any]]:
    """Rows of a results.csv (or, with REACH_TYPES, a reach.csv), typed again."""
    import pandas as pd

    frame = pd.read_csv(csv_path, dtype=types, keep_default_na=False, na_values=[""])
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def write_plots(rows: list[dict[str, Any]], out: Path) -> None:
    """overhead_vs_budget, peak_vs_budget and solve_time_vs_size, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for key, ylabel, name in (("overhead", "recompute overhead", "overhead_vs_budget"),
                              ("peak", "peak (MiB)", "peak_vs_budget")):
        cols = min(4, len(models))
        nrows = math.ceil(len(models) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
        for ax, model in zip(axes.flat, models):
            for method in methods:
                pts = sorted((r["budget_fraction"], r[key]) for r in rows
                             if r["model"] == model and r["method"] == method and r["feasible"])
                if pts:
                    ax.plot([p[0] * 100 for p in pts], [p[1] / 2**20 if key == "peak" else p[1] for p in pts],
                            marker="o", label=method)
            ax.set_title(model, fontsize=9)
            ax.set(xlabel="budget (% of no-remat peak)", ylabel=ylabel)
            ax.invert_xaxis()
        legend = {label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())}
        if legend:
            fig.legend(list(legend.values()), list(legend.keys()), loc="upper center", ncol=len(legend))
        fig.tight_layout(rect=(0, 0, 1, 0.94))
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in [m for m in methods if m in OPTIMISERS]:
        pts = sorted((r["nodes"], r["solve_seconds"]) for r in rows
                     if r["method"] == method and r["solve_seconds"] and r["feasible"])
        if pts:
            ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o", label=method, alpha=0.7)
    ax.set(xlabel="graph nodes", ylabel="solve time (s)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "solve_time_vs_size.png", dpi=90)
    plt.close(fig)


# -- docs/results/benchmarks.md: every number and ranking computed from results.json ----------------------

OP_LEVEL = ("moccasin", "checkmate", "dtr", "coop")  # schedules of single ops, outside bonsai's plan space
SOLVER_OF = {"moccasin": "CP-SAT", "checkmate": "MILP"}
METHOD_NAMES = {"per-block": "per-block checkpointing", "torch-budget": "PyTorch's budget partitioner"}
# the suite's models (methods.FULL_MODELS, by their labels) that the prose names; tests/test_bench_page.py checks them
MODEL_NAMES = {"gpt:batch=8,heads=4,layers=4,seq=256,vocab=1024,width=256": "the 4-layer GPT",
               "gpt:layers=1,seq=64": "the 1-layer gpt", "gpt": "the default gpt",
               "gpt:batch=8,heads=12,layers=12,seq=512,vocab=50257,width=768": "GPT-2 small"}

Row = dict[str, Any]
Cell = dict[str, Row]  # one model at one budget: method -> its row


# -- words and numbers -----------------------------------------------------------------------------

def model_name(label: str) -> str:
    return MODEL_NAMES.get(label, label)


def method_name(method: str) -> str:
    return METHOD_NAMES.get(method, method)


def share(row: Row, key: str) -> str:
    """``row[key]`` bytes as a share of the model's no-remat peak; ``-`` when not found."""
    return "-" if row.get(key) is None else f"{row[key] / row['no_remat_peak']:.1%}"


def digits_apart(a: float, b: float) -> int:
    """Decimals (2 to 4) that tell two overheads apart in percent."""
    return next((d for d in (2, 3, 4) if f"{a:+.{d}%}" != f"{b:+.{d}%}"), 4)


# -- the cells -------------------------------------------------------------------------------------

def cells_by_model(rows: Iterable[Row]) -> dict[str, dict[float, Cell]]:
    """model -> budget -> method -> row, in the order of the results (budgets largest first)."""
    by_model = common.grouped(rows, lambda r: r["model"])
    return {m: common.cells(of, lambda r: r["budget_fraction"]) for m, of in by_model.items()}


def every_cell(models: dict[str, dict[float, Cell]]) -> list[tuple[str, float, Cell]]:
    """(model, budget, cell) of every cell, in the order of the results."""
    return [(m, f, c) for m, by_budget in models.items() for f, c in by_budget.items()]


def method_rows(by_budget: dict[float, Cell], method: str) -> list[Row]:
    """``method``'s rows on one model, one per budget where the bench has it."""
    return [c[method] for c in by_budget.values() if method in c]


def feasible(cell: Cell) -> dict[str, float]:
    """The overhead of every method and peer that fits, ``none`` aside (it fits only without a budget)."""
    return {m: r["overhead"] for m, r in cell.items() if r["feasible"] and m != "none"}


def bonsai_cheapest(cell: Cell) -> bool:
    costs = feasible(cell)
    return "bonsai" in costs and costs["bonsai"] <= min(costs.values()) + TIE


def others(cell: Cell) -> list[tuple[str, float]]:
    """The methods besides bonsai that fit, cheapest first."""
    return sorted(((m, o) for m, o in feasible(cell).items() if m != "bonsai"), key=lambda mo: mo[1])


def below_bonsai(cell: Cell) -> list[tuple[str, float]]:
    """The methods cheaper than bonsai where it fits, cheapest first."""
    mine = feasible(cell).get("bonsai")
    return [] if mine is None else [(m, o) for m, o in others(cell) if o < mine - TIE]


def not_run(row: Row) -> bool:
    return (row.get("note") or "").startswith("not run")


def nodes(by_budget: dict[float, Cell]) -> int:
    return next(iter(next(iter(by_budget.values())).values()))["nodes"]


# -- the headline model -------------------------------------------------------------------------------

def never_scheduled(method: str, by_budget: dict[float, Cell]) -> list[str] | None:
    """The statuses ``method``'s notes report (``(status UNKNOWN)``) when it ran at every budget, fitting none."""
    rows = method_rows(by_budget, method)
    if not rows or any(r["feasible"] or not_run(r) for r in rows):
        return None
    return sorted({found[1] for r in rows if (found := re.search(r"\(status (\w+)\)", r.get("note") or ""))})


def headline_values(label: str, by_budget: dict[float, Cell], reach: Row | None) -> dict[str, Any]:
    """The first model: where bonsai is the cheapest, the others at its two smallest budgets and below them."""
    cheap = [f for f, c in by_budget.items() if bonsai_cheapest(c)]
    fitting = [f for f, c in by_budget.items() if "bonsai" in feasible(c)]
    below = [f for f, c in by_budget.items() if "bonsai" not in feasible(c) and (not fitting or f < fitting[-1])]
    gaps = [by_budget[f]["bonsai"]["gap"] or 0.0 for f in cheap]
    return {"model": model_name(label), "nodes": nodes(by_budget), "cheap": cheap, "fitting": fitting,
            "overheads": [pct(by_budget[f]["bonsai"]["overhead"]) for f in cheap],
            "gaps": "each proven optimal" if max(gaps, default=0.0) <= TIE else f"gap ≤ {max(gaps):.1%}",
            "tight": [(f, f in fitting, others(by_budget[f])) for f in fitting[-2:] + below],
            "reach": share(reach, "bonsai") if reach and reach.get("bonsai") else None,
            "no_schedule": [(method_name(m), SOLVER_OF.get(m, "solver"), statuses) for m in SOLVER_OF
                            for statuses in [never_scheduled(m, by_budget)] if statuses is not None]}


# -- smallest reachable budgets ----------------------------------------------------------------------

def reach_values(reach: Sequence[Row]) -> dict[str, Any]:
    """Where bonsai's min-peak MILP is not proven, and where dtr or coop meet a smaller budget than bonsai's and
    chen's (bonsai's fallback plans): (row, [(dtr or coop, whether it is the per-op bound)], the smaller of those)."""
    below = []
    for r in reach:
        plans = min((r[k] for k in ("bonsai", "chen") if r.get(k)), default=None)
        said = [(m, r[m] <= r["lower_bound"]) for m in ("dtr", "coop") if r.get(m) and (plans is None or r[m] < plans)]
        if said:
            below.append((r, said, "none" if plans is None else f"{plans / r['no_remat_peak']:.1%}"))
    return {"rows": reach, "unproven": [r for r in reach if r.get("bonsai_status") != "optimal"], "below": below}


# -- bonsai against the rest ---------------------------------------------------------------------------

def contested(models: dict[str, dict[float, Cell]]) -> list[tuple[str, float, Cell]]:
    """Every cell where bonsai ran and some method or peer fits."""
    return [(m, f, c) for m, f, c in every_cell(models) if "bonsai" in c and feasible(c)]


def plan_space_values(models: dict[str, dict[float, Cell]]) -> dict[str, Any]:
    """In how many of the contested cells bonsai is the cheapest, and the misses: (model, budget, rival, its
    overhead, bonsai's or None) where chen or per-block (plans in bonsai's space) fits and bonsai does not, or
    costs less."""
    cells = contested(models)
    return {"cheapest": sum(bonsai_cheapest(c) for _, _, c in cells), "count": len(cells),
            "misses": [(m, f, rival, costs[rival], costs.get("bonsai")) for m, f, c in cells for costs in [feasible(c)]
                       for rival in ("chen", "per-block")
                       if rival in costs and costs.get("bonsai", float("inf")) > costs[rival] + TIE]}


def could_not_run(models: dict[str, dict[float, Cell]]) -> dict[str, list[str]]:
    """Method or peer -> the models it failed on before any budget (a crash, not a budget it misses)."""
    failed = [(method, model) for model, by_budget in models.items()
              for method in dict.fromkeys(m for c in by_budget.values() for m in c)
              if all((r.get("note") or "").startswith("could not run") for r in method_rows(by_budget, method))]
    return common.grouped(failed, lambda mm: method_name(mm[0]), lambda mm: model_name(mm[1]))


def cells_values(models: dict[str, dict[float, Cell]], first: str) -> dict[str, Any]:
    """:func:`plan_space_values`, and per other model where bonsai is the cheapest: (budget, its overhead, the
    others that fit, those level with it)."""
    wins = {m: [(f, c["bonsai"]["overhead"], others(c), [o for o, x in others(c) if x <= c["bonsai"]["overhead"] + TIE])
                for f, c in by_budget.items() if bonsai_cheapest(c)] for m, by_budget in models.items() if m != first}
    return {**plan_space_values(models), "wins": wins, "could_not_run": could_not_run(models)}


def beaten_by(winner: str, cells: Sequence[tuple[str, float, Cell]]) -> dict[str, Any]:
    """Where ``winner`` is the cheapest below bonsai (overheads, the digits that tell them apart, the others below
    bonsai) and by how many points at most."""
    mine = [(m, f, c) for m, f, c in cells if below_bonsai(c)[0][0] == winner]
    return {"winner": winner, "points": max(c["bonsai"]["overhead"] - feasible(c)[winner] for _, _, c in mine) * 100,
            "cells": [(m, f, feasible(c)[winner], c["bonsai"]["overhead"],
                       digits_apart(feasible(c)[winner], c["bonsai"]["overhead"]),
                       [(o, x, digits_apart(x, c["bonsai"]["overhead"])) for o, x in below_bonsai(c)[1:]])
                      for m, f, c in mine]}


def not_best_values(models: dict[str, dict[float, Cell]]) -> dict[str, Any]:
    """Who is cheaper than bonsai where it fits, who fits where it does not, and where PyTorch's budget
    partitioner costs less than the plain step."""
    beaten = [(m, f, c) for m, f, c in contested(models) if below_bonsai(c)]
    winners = list(dict.fromkeys(below_bonsai(c)[0][0] for _, _, c in beaten))
    return {"beaten": [beaten_by(w, beaten) for w in winners], "op_level": any(w in OP_LEVEL for w in winners),
            "unreached": [(m, f, [(o, x, c[o]["gap"] if (c[o].get("gap") or 0) > TIE else None) for o, x in others(c)])
                          for m, f, c in contested(models) if "bonsai" not in feasible(c)],
            "eager": [(m, f, c["torch-budget"]["overhead"]) for m, f, c in every_cell(models)
                      if "torch-budget" in feasible(c) and c["torch-budget"]["overhead"] < 0]}


# -- solver cost -----------------------------------------------------------------------------------

def ratio_range(values: Sequence[float]) -> str:
    """``67×–130×``; ``?×`` when there is nothing to compare."""
    return common.span(values, "{:.0f}×".format) if values else "?×"


def found_values(method: str, models: dict[str, dict[float, Cell]], meta: dict[str, Any]) -> tuple | None:
    """(method, cells with a schedule, cells run, models with none, models not run on, its node limit)."""
    rows_of = {model_name(m): method_rows(by_budget, method) for m, by_budget in models.items()}
    ran = [r for rows in rows_of.values() for r in rows if not not_run(r)]
    if not ran:
        return None
    skipped = [m for m, rows in rows_of.items() if rows and all(map(not_run, rows))]
    return (method, sum(bool(r["feasible"]) for r in ran), len(ran),
            [m for m, rows in rows_of.items() if rows and m not in skipped and not any(r["feasible"] for r in rows)],
            skipped, meta.get("node_limits", {}).get(method))


def solver_values(models: dict[str, dict[float, Cell]], meta: dict[str, Any]) -> dict[str, Any]:
    """Bonsai against checkmate where it proved optimality, what checkmate and moccasin found, bonsai's times."""
    proven = [(m, f, c["checkmate"], c["bonsai"]) for m, f, c in every_cell(models) if "checkmate" in c
              and c["checkmate"]["feasible"] and c["checkmate"]["status"] == "optimal" and "bonsai" in feasible(c)]
    timed = [(m, f, c["bonsai"]["solve_seconds"]) for m, f, c in every_cell(models)
             if "bonsai" in feasible(c) and c["bonsai"]["solve_seconds"] is not None]
    return {"proven": proven,
            "where": {m: [f for mm, f, _, _ in proven if mm == m] for m, *_ in proven},
            "dearer": [(m, f, (b["overhead"] - c["overhead"]) * 100) for m, f, c, b in proven
                       if b["overhead"] > c["overhead"] + 1e-6],
            "speed": ratio_range([c["solve_seconds"] / b["solve_seconds"] for _, _, c, b in proven]),
            "size": ratio_range([c["variables"] / b["variables"] for _, _, c, b in proven
                                 if c["variables"] and b["variables"]]),
            "found": [v for v in (found_values(m, models, meta) for m in ("checkmate", "moccasin")) if v],
            "median": median(t for _, _, t in timed), "longest": max(timed, key=lambda t: t[2], default=None)}


# -- the page --------------------------------------------------------------------------------------

def bound_values(models: dict[str, dict[float, Cell]]) -> list[tuple[str, list[tuple]]]:
    """Per model, per budget with a lower bound: (budget, bound, the cheapest method and its overhead, or None);
    peers aside (measured on an eager step, which the bound does not speak of)."""
    out = []
    for label, by_budget in models.items():
        parts = []
        for fraction, cell in by_budget.items():
            bound = next((r.get("bound") for r in cell.values() if r.get("bound") is not None), None)
            costs = {m: o for m, o in feasible(cell).items() if cell[m]["status"] != "measured"}
            if bound is not None:
                parts.append((fraction, bound, *min(costs.items(), key=lambda mo: mo[1], default=(None, None))))
        if parts:
            out.append((label, parts))
    return out


def page(results: dict[str, Any], header: str, bench: str) -> str:
    """The whole page from one run's rows, reach and meta; ``bench``: the output folder from the page."""
    models, reach, meta = cells_by_model(results["rows"]), results["reach"], results["meta"]
    if not models:
        raise BonsaiError("The run has no results to write a page from: run the bench with --page first.")
    first = next(iter(models))
    reach_of = {r["model"]: r for r in reach}
    return common.fill(
        "benchmarks", header=header, meta=meta, dates=common.run_dates(meta), models=len(models),
        cell_count=sum(len(b) for b in models.values()), bench=bench,
        headline=headline_values(first, models[first], reach_of.get(first)),
        reach=reach and reach_values(reach), cells=cells_values(models, first), not_best=not_best_values(models),
        bound=bound_values(models), solver=solver_values(models, meta), model_name=model_name,
        method_name=method_name, share=share)
