"""``bonsai bench [methods]``: every method and every peer on the same models and budgets, in one run
(the default suite).

Writes ``results.csv`` (one row per model x budget x method), ``reach.csv`` (one row per model: the
smallest budget each method reaches, next to the per-op lower bound), ``results.md`` (a table per
model, the reach table, and the honest list of budgets where bonsai is not the best feasible method)
and PNG plots (matplotlib):
overhead vs budget (Pareto fronts), solve time vs graph size (log-log) for the optimising methods,
and peak vs budget. Tables go through pandas (CSV, typed re-reading, markdown via tabulate). ``run.json``
keeps the command, date, machine and duration. ``--page docs/results/benchmarks.md`` also writes that
page from those files (:mod:`bonsai_core.bench.benchmarks_page`); ``--report-only`` writes it again from
the files of a finished run, measuring nothing.

Every schedule row comes from :func:`bonsai_core.solvers.solve`, so it was validated by the simulator;
peer rows are measured on a real CPU step (:mod:`bonsai_core.peers`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bonsai_core.bench import common
from bonsai_core.errors import BonsaiError, ModelError

# Each column of results.csv and its pandas type (nullable: a row that did not run has no peak).
COLUMN_TYPES = {"model": "string", "nodes": "Int64", "method": "string", "budget_bytes": "Int64",
                "budget_fraction": "Float64", "feasible": "boolean", "peak": "Int64", "overhead": "Float64",
                "solve_seconds": "Float64", "build_seconds": "Float64", "variables": "Int64", "constraints": "Int64",
                "status": "string", "gap": "Float64", "reserved_peak": "Int64", "fragmentation": "Float64",
                "note": "string"}
COLUMNS = list(COLUMN_TYPES)
OPTIMISERS = ("checkmate", "bonsai", "moccasin")
# reach.csv: per model, the smallest budget each method reaches (bytes) and how it was found.
REACH_TYPES = {"model": "string", "nodes": "Int64", "no_remat_peak": "Int64", "lower_bound": "Int64",
               "bonsai": "Int64", "bonsai_status": "string", "chen": "Int64", "dtr": "Int64", "coop": "Int64",
               "seconds": "Float64"}
REACH_METHODS = ("bonsai", "chen", "dtr", "coop")
RUN_META = "run.json"  # the run's command, dates, machine and time limit: what its page quotes
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
        for item in filter(None, pcts.split(",")) if at else ():
            try:
                budgets.append(float(item.strip().rstrip("%")) / 100)
            except ValueError:
                budgets.append(-1.0)
            if not 0 < budgets[-1]:
                raise ModelError(f"Cannot read the budget {item!r} in {text + at + pcts!r}; write model@PCT,PCT, "
                                 "for example gpt@45,40 (shares of the no-remat peak).")
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
# The issue-12 GPT (4 layers, 525 nodes) first, with the budgets where methods part ways; then the
# Hugging Face models at their default sizes, the zoo at its default sizes (plus the 1-layer gpt,
# the one transformer checkmate's op-level MILP is run on) and GPT-2 small last. Larger zoo sizes
# only added minutes of time-limited MILPs: the full run is meant to fit ~25 minutes on 2 cores.
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


def run_bench(config: BenchConfig, out_dir: str | Path, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every (model, budget, method) and peer, and each method's smallest reachable budget per
    model; write results.csv, reach.csv, results.md and the plots."""
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve
    from bonsai_core.trace import trace_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    reach: list[dict[str, Any]] = []
    for text in config.models:
        spec = ModelSpec.parse(text)
        traced = trace_model(spec.name, profile=config.profile, **dict(spec.options))
        g = traced.graph
        reference = no_remat_peak(g)
        progress(f"{spec.label}: {g.n} nodes, no-remat peak {reference} bytes (traced in {traced.seconds:.1f} s)")
        budgets = spec.budgets_with(config.budgets)
        for fraction in budgets:
            budget = int(fraction * reference)
            for method in config.methods:
                row = _row(spec.label, g.n, method, budget, fraction)
                limit = config.max_nodes.get(method)
                if limit is not None and g.n > limit:
                    row["note"] = f"not run: {g.n} nodes > {limit} (bench size limit for {method})"
                    rows.append(row)
                    continue
                start = time.perf_counter()
                try:
                    s = solve(g, budget, method=method, **_options(method, config))
                    row.update(_schedule_fields(g, s))
                except BonsaiError as e:
                    row["note"] = str(e)[:300]
                    row["solve_seconds"] = time.perf_counter() - start
                rows.append(row)
                progress(f"  {fraction:.0%} {method:10s} feasible={row['feasible']} overhead={row['overhead']} "
                         f"t={row['solve_seconds']:.2f}s {row['note']}")
        for peer in config.peers:
            limit = config.max_nodes.get(peer)
            if limit is not None and g.n > limit:
                rows.extend({**_row(spec.label, g.n, peer, int(f * reference), f),
                             "note": f"not run: {g.n} nodes > {limit} (bench size limit for {peer})"}
                            for f in budgets)
                continue
            rows.extend(_peer_rows(peer, spec, g.n, reference, budgets, config, progress))
        if any(m in REACH_METHODS for m in config.methods):
            reach.append(smallest_budgets(spec.label, g, config))
            progress("  smallest budgets: " + ", ".join(f"{m} {_share(reach[-1], m)}" for m in
                                                        ("lower_bound",) + REACH_METHODS if m in reach[-1]))
        _write(rows, reach, out)  # after each model, so a long run leaves results behind
    write_plots(rows, out)
    return rows


def add_arguments(p: argparse.ArgumentParser, output_required: bool = True) -> None:
    """The options of the methods suite (``bonsai bench`` without a suite takes them too, its output
    then checked by :func:`main`, since ``bonsai bench --list`` needs none)."""
    from bonsai_core.arguments import fraction_arg, positive_seconds

    p.add_argument("--models", nargs="+", metavar="MODEL",
                   help="zoo or hf: models, e.g. gpt or gpt:layers=2,width=256; MODEL@PCT,PCT adds budgets for that model")
    p.add_argument("--budgets", nargs="+", type=fraction_arg, metavar="PCT", help="shares of the no-remat peak")
    p.add_argument("--methods", nargs="+", metavar="METHOD", help="default: every method")
    p.add_argument("--peers", nargs="*", metavar="PEER", help="torch-budget, per-block (default: both)")
    p.add_argument("--quick", action="store_true", help="two small models, two budgets (a minute or two)")
    p.add_argument("--time-limit", type=positive_seconds, default=None, metavar="S", help="per solve (default 60, quick 10)")
    p.add_argument("--backend", choices=("highs", "scip"), default="highs", help="MILP backend")
    p.add_argument("-o", "--output", required=output_required, metavar="DIR")
    p.add_argument("--page", metavar="PAGE", help="also write the page of this run (docs/results/benchmarks.md) "
                   "from its results; the default models and budgets only")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: write PAGE again from the results.csv, reach.csv and run.json in DIR")


def main(args: argparse.Namespace) -> int:
    """``bonsai bench [methods]``: check the methods and peers named, run the bench, say where it wrote
    (and write the page); with ``--report-only``, only the page from a finished run."""
    if args.output is None:
        args.parser.error("the following arguments are required: -o/--output")
    check_page_args(args)
    if args.report_only:
        write_page(Path(args.output), args.page)
        print(f"wrote {args.page} from {args.output}")
        return 0
    config = config_from(args)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(config)
    (out / RUN_META).write_text(json.dumps(meta, indent=1))
    start = time.perf_counter()
    rows = run_bench(config, out, progress=lambda line: print(line, flush=True))
    meta.update(seconds=round(time.perf_counter() - start, 1),
                ended=common.utc_now())
    (out / RUN_META).write_text(json.dumps(meta, indent=1))
    print(f"wrote {len(rows)} rows to {args.output}/results.csv, results.md and plots")
    if args.page:
        write_page(out, args.page)
        print(f"wrote {args.page}")
    return 0


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The bench the options ask for, every method and peer named checked."""
    from bonsai_core.arguments import SOLVE_TIME_LIMIT
    from bonsai_core.peers import PEERS
    from bonsai_core.solvers import METHODS, available_methods

    methods = args.methods or available_methods(any_graph=True)  # the zoo's MLPs have no block stack
    peers = args.peers if args.peers is not None else list(PEERS)
    for m in methods:
        if m not in METHODS:
            args.parser.error(f"argument --methods: unknown method {m!r} (choose from {', '.join(METHODS)})")
    for p in peers:
        if p not in PEERS:
            args.parser.error(f"argument --peers: unknown peer {p!r} (choose from {', '.join(PEERS)})")
    return BenchConfig(
        models=args.models or list(QUICK_MODELS if args.quick else FULL_MODELS),
        budgets=args.budgets or list(QUICK_BUDGETS if args.quick else FULL_BUDGETS),
        methods=methods, peers=peers,
        time_limit=args.time_limit or (10.0 if args.quick else SOLVE_TIME_LIMIT), backend=args.backend,
        max_nodes=dict(BENCH_NODE_LIMITS))


def run_meta(config: BenchConfig) -> dict[str, Any]:
    """What a page says about the run before it starts: command, date, machine, torch, time limit."""
    import torch

    return {"command": common.command(), "started": common.utc_now(),
            "machine": common.machine(), "torch": torch.__version__, "time_limit": config.time_limit,
            "node_limits": config.max_nodes}


def check_page_args(args: argparse.Namespace) -> None:
    """Refuse, before any measurement, what would fail only at the end: a page in a missing folder, a page
    of a bench other than the default one, --report-only without a page or without a finished run."""
    if args.page is not None:
        if not Path(args.page).parent.is_dir():
            raise BonsaiError(f"--page {args.page}: the folder {Path(args.page).parent} does not exist.")
        if args.models or args.budgets or args.quick:
            raise BonsaiError("--page reports the default models and budgets: leave out --models, --budgets and "
                              "--quick.")
    if args.report_only:
        if args.page is None:
            raise BonsaiError("--report-only writes the page again: name it with --page PAGE.")
        missing = [name for name in ("results.csv", "reach.csv", RUN_META) if not (Path(args.output) / name).is_file()]
        if missing:
            raise BonsaiError(f"--report-only: {', '.join(missing)} missing in {args.output}; run the bench with "
                              "--page, without --report-only, first.")


def read_run_meta(path: Path) -> dict[str, Any]:
    """run.json of a finished run, refused with the reason when it is not one."""
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise BonsaiError(f"{path} is not JSON ({e}); run the bench with --page again.") from None
    missing = [k for k in ("command", "started", "ended", "seconds", "machine", "torch", "time_limit") if k not in meta]
    if missing:
        raise BonsaiError(f"{path} lacks {', '.join(missing)}: its run did not finish; run the bench with --page "
                          "again.")
    return meta


def write_page(out: Path, page: str) -> None:
    """The page from the run in ``out``: its header names the command that measured it."""
    from bonsai_core.bench import benchmarks_page

    meta = read_run_meta(out / RUN_META)
    rows, reach = load_rows(out / "results.csv"), load_rows(out / "reach.csv", REACH_TYPES)
    header = common.page_header(meta["command"], benchmarks_page.SOURCES)
    bench_link = os.path.relpath(out, Path(page).parent)
    Path(page).write_text(benchmarks_page.page(rows, reach, meta, header, bench_link))


def smallest_budgets(model: str, graph: Any, config: BenchConfig) -> dict[str, Any]:
    """The smallest budget (bytes) each of bonsai, chen, dtr and coop (those in the bench) reaches on
    ``graph``, computed once per model:

    * bonsai: the min-peak MILP of its segment model at the top of the auto ladder
      (:func:`~bonsai_core.solvers.bonsai.smallest_budget`, ``bonsai_status`` says whether it was
      proven within the time limit). Bonsai also falls back on Chen's plans, so in a solve it meets
      every budget chen meets as well.
    * chen: the lowest simulated peak over the plans it tries under a budget.
    * dtr, coop: the smallest budget a bisection between the per-op lower bound and the no-remat
      peak meets (a heuristic's success is not monotone in the budget: a budget it meets, not a
      proven minimum); the whole bisection within one time limit.
    """
    from bonsai_core.schedule import no_remat_peak

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
        row["chen"] = chen_lowest_peak(graph)
    for method in ("dtr", "coop"):
        if method in config.methods:
            row[method] = bisect_budget(graph, method, row["no_remat_peak"], config.time_limit)
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row


def chen_lowest_peak(graph: Any) -> int:
    """The lowest simulated peak over the checkpoint plans chen tries under a budget."""
    from bonsai_core.regions import plan_schedule
    from bonsai_core.schedule import simulate
    from bonsai_core.solvers.chen import candidate_plans

    return min(simulate(graph, plan_schedule(graph, plan, "chen")).peak for _, plan in candidate_plans(graph, "auto"))


def bisect_budget(graph: Any, method: str, reference: int, time_limit: float) -> int | None:
    """The smallest budget between the per-op lower bound and ``reference`` at which ``method``
    (dtr or coop, without its own budget hint) found a schedule in a bisection of at most
    BISECTION_STEPS runs after the two ends; None if it met neither end within ``time_limit``."""
    from bonsai_core.solvers import solve

    deadline = time.perf_counter() + time_limit

    def meets(budget: int) -> bool:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError
        try:
            solve(graph, budget, method=method, time_limit=left, budget_hint=False)
            return True
        except BonsaiError:
            return False

    return common.bisect_budget(meets, graph.peak_lower_bound, reference, BISECTION_STEPS, try_lo=True)


def _options(method: str, config: BenchConfig) -> dict[str, Any]:
    """The bench's time limit and MILP backend, for the methods that take them; every solve from scratch
    (bonsai would otherwise answer a budget with the plan of a larger one that fits it, in no time)."""
    from bonsai_core.solvers import accepted_options

    accepted = accepted_options(method)
    return {k: v for k, v in (("time_limit", config.time_limit), ("backend", config.backend), ("reuse", False))
            if accepted is None or k in accepted}


def _row(model: str, nodes: int, method: str, budget: int, fraction: float) -> dict[str, Any]:
    return {"model": model, "nodes": nodes, "method": method, "budget_bytes": budget, "budget_fraction": fraction,
            "feasible": False, "peak": None, "overhead": None, "solve_seconds": None, "build_seconds": None,
            "variables": None, "constraints": None, "status": None, "gap": None, "reserved_peak": None,
            "fragmentation": None, "note": ""}


def _schedule_fields(graph: Any, schedule: Any) -> dict[str, Any]:
    from bonsai_core.allocator import replay

    st = schedule.stats
    alloc = replay(graph, schedule)
    return {"feasible": True, "peak": st["peak"], "overhead": round(st["overhead"], 6),
            "solve_seconds": st.get("solve_seconds"), "build_seconds": st.get("build_seconds"),
            "variables": st.get("variables"), "constraints": st.get("constraints"), "status": st.get("status"),
            "gap": st.get("gap"), "reserved_peak": alloc.reserved_peak, "fragmentation": round(alloc.fragmentation, 4)}


def _peer_rows(peer: str, spec: ModelSpec, nodes: int, reference: int, budgets: list[float], config: BenchConfig,
               progress: Callable[[str], None]) -> list[dict[str, Any]]:
    from bonsai_core import peers

    options = dict(spec.options)
    start = time.perf_counter()
    try:
        plain_peak, plain_cost, _ = peers.measure_eager(spec.name, options, config.profile)
        runs = peers.peer_runs(peer, spec.name, options, config.profile)
    except Exception as e:  # a peer that cannot run on this model is a result, not a crash
        progress(f"  {peer}: could not run ({type(e).__name__}: {e})")
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
            row.update(feasible=True, peak=best.peak, overhead=round(best.compute_cost / plain_cost - 1, 6),
                       solve_seconds=seconds, status="measured", note=best.setting)
        rows.append(row)
        progress(f"  {fraction:.0%} {peer:10s} feasible={row['feasible']} overhead={row['overhead']} {row['note']}")
    return rows


def _frame(rows: list[dict[str, Any]], types: dict[str, str] = COLUMN_TYPES):
    import pandas as pd

    return pd.DataFrame(rows, columns=list(types)).astype(types)


def _write(rows: list[dict[str, Any]], reach: list[dict[str, Any]], out: Path) -> None:
    _frame(rows).to_csv(out / "results.csv", index=False)
    _frame(reach, REACH_TYPES).to_csv(out / "reach.csv", index=False)
    (out / "results.md").write_text(markdown_report(rows, reach))


def _share(row: dict[str, Any], key: str) -> str:
    """``row[key]`` bytes as a share of the model's no-remat peak ("-" when not found)."""
    value = row.get(key)
    return "-" if value is None else f"{value / row['no_remat_peak']:.1%}"


def reach_table(reach: list[dict[str, Any]]) -> list[str]:
    """The smallest budget each method reaches per model, as shares of its no-remat peak, next to
    the per-op lower bound that no schedule can go below."""
    if not reach:
        return []
    methods = [m for m in REACH_METHODS if any(r.get(m) is not None or r.get(f"{m}_status") for r in reach)]
    table = []
    for r in reach:
        cells = {m: _share(r, m) for m in methods}
        if "bonsai" in cells and r.get("bonsai_status") not in (None, "optimal"):
            cells["bonsai"] += f" ({r.get('bonsai_status')}, not proven)"
        table.append({"model": f"{r['model']} ({r['nodes']} nodes)", "no-remat peak": common.mib(r["no_remat_peak"]),
                      "per-op bound": _share(r, "lower_bound"), **cells})
    return ["### Smallest reachable budget", "",
            "Share of the no-remat peak. per-op bound: the largest single operator with its inputs and the "
            "fixed memory (`Graph.peak_lower_bound`; no schedule goes below it). bonsai: the min-peak MILP of "
            "its segment model at the top of its auto granularity ladder (not proven optimal where a status "
            "is shown); in a solve bonsai also meets every budget chen meets, since Chen's plans are its "
            "fallback plans. chen: the lowest simulated peak of the plans it tries. dtr, coop: the smallest budget a "
            "bisection between the bound and the no-remat peak met (heuristics are not monotone in the "
            "budget: a budget they meet, not a proven minimum). checkmate and moccasin are not computed "
            "(one more MILP per model, minutes on the larger graphs). `-`: not found within the time limit.",
            "", _markdown(table), ""]


def markdown_report(rows: list[dict[str, Any]], reach: list[dict[str, Any]] = ()) -> str:
    """One table per model (budget x method: overhead, or why it failed), best feasible in bold, the
    smallest budget each method reaches, and the budgets where bonsai is not the best, said plainly."""
    lines = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    not_best = []
    for model in models:
        mrows = [r for r in rows if r["model"] == model]
        table = []
        for fraction in dict.fromkeys(r["budget_fraction"] for r in mrows):
            cells = {r["method"]: r for r in mrows if r["budget_fraction"] == fraction}
            feasible = {m: r["overhead"] for m, r in cells.items() if r["feasible"] and m != "none"}
            best = min(feasible.values()) if feasible else None
            table.append({"budget": f"{fraction:.0%}", **{m: _cell(cells.get(m), best) for m in methods}})
            b = cells.get("bonsai")
            if best is not None and b is not None and (not b["feasible"] or b["overhead"] > best + 1e-9):
                winner = min(feasible, key=feasible.get)
                not_best.append(f"- {model} at {fraction:.0%}: best is {winner} ({best:+.2%}); bonsai "
                                + (f"{b['overhead']:+.2%}" if b["feasible"] else f"not feasible ({b['note'] or b['status']})"))
        lines += [f"### {model} ({mrows[0]['nodes']} nodes)", "", _markdown(table), ""]
    head = ["Cells: recompute overhead (extra compute / plain step), `-` = no schedule under the budget "
            "(reason in results.csv), **bold** = cheapest feasible method; `none` is feasible only when the "
            "budget is at least the no-remat peak. Peers (`torch-budget`, `per-block`) are measured on a real "
            "CPU step.", ""]
    tail = ["### Where bonsai is not the best", ""] + (not_best or ["- nowhere in this run"]) + [""]
    tail += ["### Bonsai against the checkpoint plans its space holds", ""] + bonsai_summary(rows) + [""]
    return "\n".join(head + lines + reach_table(list(reach)) + tail + solver_cost_table(rows))


def bonsai_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Counts over the cells: where bonsai is the cheapest feasible method, and every cell where chen
    or the per-block peer (plans in bonsai's space) fits and bonsai does not, or costs less than it."""
    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["model"], r["budget_fraction"]), {})[r["method"]] = r
    cheapest = contested = 0
    misses = []
    for (model, fraction), by_method in cells.items():
        b = by_method.get("bonsai")
        feasible = {m: r["overhead"] for m, r in by_method.items() if r["feasible"] and m != "none"}
        if b is None or not feasible:
            continue
        contested += 1
        cheapest += b["feasible"] and b["overhead"] <= min(feasible.values()) + 1e-9
        for rival in ("chen", "per-block"):
            if rival in feasible and (not b["feasible"] or b["overhead"] > feasible[rival] + 1e-9):
                mine = f"{b['overhead']:+.2%}" if b["feasible"] else "not feasible"
                misses.append(f"- {model} at {fraction:.0%}: {rival} {feasible[rival]:+.2%}, bonsai {mine}")
    return [f"- bonsai is the cheapest feasible method in {cheapest} of the {contested} cells where any method "
            "fits (ties included)",
            "- cells where chen or per-block checkpointing fits and bonsai does not, or costs less than bonsai:"
            + (" none" if not misses else "")] + misses


def solver_cost_table(rows: list[dict[str, Any]]) -> list[str]:
    """The optimising methods side by side where checkmate ran: solve time, model size, overhead,
    gap, and bonsai's speed-up and extra cost against checkmate."""
    cells = {(r["model"], r["budget_fraction"], r["method"]): r for r in rows}
    keys = [(r["model"], r["budget_fraction"]) for r in rows if r["method"] == "checkmate" and r.get("status")]
    if not keys:
        return []
    table = []
    for model, fraction in keys:
        c, b, m = (cells.get((model, fraction, k)) for k in OPTIMISERS)
        speed = extra = ""
        if c and b and c.get("solve_seconds") and b.get("solve_seconds") and b["feasible"]:
            speed = f"{c['solve_seconds'] / b['solve_seconds']:.0f}x"
            if c["feasible"] and c["status"] == "optimal":
                extra = f"{b['overhead'] - c['overhead']:+.2%}"
        table.append({"model": model, "budget": f"{fraction:.0%}", "checkmate": _solver_cell(c),
                      "bonsai": _solver_cell(b), "moccasin": _solver_cell(m), "speed-up": speed, "extra cost": extra})
    return ["### Solver cost: checkmate vs bonsai vs moccasin", "",
            "Seconds to solve (status, overhead, gap; variables); speed-up = checkmate seconds / bonsai "
            "seconds; extra cost = bonsai overhead - checkmate overhead where checkmate proved optimality.", "",
            _markdown(table), ""]


def _markdown(table: list[dict[str, str]]) -> str:
    """Rows of text by column name as a markdown table: the first column left-aligned, the rest right."""
    columns = list(table[0])
    return common.table(columns, [[row[c] for c in columns] for row in table], "l" + "r" * (len(columns) - 1))


def _solver_cell(r: dict[str, Any] | None) -> str:
    if r is None or r.get("solve_seconds") in (None, ""):
        return ""
    if not r["feasible"]:
        return f"{r['solve_seconds']:.2f} s, {r['status'] or 'no schedule'}"
    gap = f", gap {r['gap']:.1%}" if r.get("gap") not in (None, "") and r["gap"] > 0 else ""
    return f"{r['solve_seconds']:.2f} s, {r['status']}, {r['overhead']:+.1%}{gap}; {r['variables']} vars"


def load_rows(csv_path: str | Path, types: dict[str, str] = COLUMN_TYPES) -> list[dict[str, Any]]:
    """Rows of a results.csv (or, with REACH_TYPES, a reach.csv), typed again (to rewrite the report
    or plots of a finished run)."""
    import pandas as pd

    frame = pd.read_csv(csv_path, dtype=types, keep_default_na=False, na_values=[""])
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def _cell(r: dict[str, Any] | None, best: float | None) -> str:
    if r is None:
        return ""
    if not r["feasible"]:
        return "-"
    text = f"{r['overhead']:+.1%}"
    return f"**{text}**" if best is not None and r["method"] != "none" and abs(r["overhead"] - best) < 1e-9 else text


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
        for i, model in enumerate(models):
            ax = axes[i // cols][i % cols]
            for method in methods:
                pts = sorted((r["budget_fraction"], r[key]) for r in rows
                             if r["model"] == model and r["method"] == method and r["feasible"])
                if pts:
                    ax.plot([p[0] * 100 for p in pts], [p[1] / 2**20 if key == "peak" else p[1] for p in pts],
                            marker="o", label=method)
            ax.set_title(model, fontsize=9)
            ax.set_xlabel("budget (% of no-remat peak)")
            ax.set_ylabel(ylabel)
            ax.invert_xaxis()
        legend = {}
        for ax in axes.flat:
            legend.update(zip(*reversed(ax.get_legend_handles_labels())))
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
    ax.set_xlabel("graph nodes")
    ax.set_ylabel("solve time (s)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "solve_time_vs_size.png", dpi=90)
    plt.close(fig)
