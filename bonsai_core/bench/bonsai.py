"""Measure the bonsai segment ILP on traced zoo graphs next to chen and dtr: solve time, size, overhead and
gap, the smallest budget each reaches, the granularity, the live re-solve after a budget change; rows in
``-o FILE``. ``--page PAGE`` (the default models and budgets) also runs :func:`studies` and writes
docs/results/bonsai.md from ``-o`` alone (``--report-only``: from a finished run). A traced graph file:

    bonsai bench bonsai --models g8b.json --budgets 50 30 82.4GiB --variants default save_ops=false \
        regions=modules --compare chen dtr --skip-granularity --skip-resolve --skip-smallest
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from bonsai_core.arguments import bench_budget_arg
from bonsai_core.bench import common
from bonsai_core.bench.common import TIE, budget, compare, median
from bonsai_core.bound import lower_bound
from bonsai_core.budget import parse_budget
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import load_graph
from bonsai_core.optimizer import with_optimizer
from bonsai_core.regions import region_peak_bound
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import bonsai as B, parse_option, solve
from bonsai_core.solvers.bonsai_coef import self_contained
from bonsai_core.units import format_bytes

GPT4_OPTIONS = {"layers": 4, "width": 256, "seq": 256, "heads": 4, "vocab": 1024, "batch": 8}
GPT4 = "gpt:" + ",".join(f"{k}={v}" for k, v in GPT4_OPTIONS.items())
DEFAULT_MODELS = [GPT4, "resnet", "unet", "gpt2-small"]
DEFAULT_BUDGETS = ("70", "50", "45", "40")  # shares of the no-remat peak, in percent
RESOLVE = (0.9, 0.8, 0.7, 0.75, 0.85, 0.65, 0.6, 0.55, 0.5)  # the live re-solve's budgets, a slider's moves
RUN_STATS = ("status", "gap", "variables", "constraints", "build_seconds", "solve_seconds", "candidates",
             "ilp_candidates", "segments", "recomputed_segments", "peak", "overhead", "cached", "granularity",
             "granularities_tried", "plan_source", "model_slack", "tightened_by", "time_split", "saved_nodes",
             "outputs_dropped", "self_contained_saved", "space", "spaces", "bound", "bound_gap", "warm_start")
# what the line printed after each solve of the suite's tables says (the rows keep every field)
SHOWN = ("model", "sweep", "fraction", "method", "backend", "granularity", "ilp_candidates", "variables",
         "wall_seconds", "time_split", "status", "gap", "overhead", "cached", "bonsai", "bonsai_status", "chen",
         "lower_bound", "tool_rss_bytes", "error")
shown = partial(common.progress, keys=SHOWN)


def load(spec: str):
    """A model as ``bonsai bench --models`` reads it (``gpt:layers=2``), ``gpt2-small`` or a graph JSON file ->
    (label, Graph)."""
    from bonsai_core.bench.methods import ModelSpec
    from bonsai_core.models.zoo import GPT2_SMALL

    if spec.endswith(".json"):
        return os.path.basename(spec), load_graph(spec)
    model = ModelSpec("gpt", tuple(GPT2_SMALL.items())) if spec == "gpt2-small" else ModelSpec.parse(spec)
    return spec, common.graph_of(model.name, **dict(model.options))


def run(graph, budget: int | None, method: str = "bonsai", **options: Any) -> dict[str, Any]:
    """One solve: its stats (RUN_STATS), wall seconds and the tool's peak memory, or its error."""
    if method == "bonsai":
        options.setdefault("reuse", False)  # measure every solve, never a plan reused from a larger budget
    start = time.perf_counter()
    try:
        stats = solve(graph, budget, method, **options).stats
    except BonsaiError as e:
        return {"error": str(e).split(":")[0], "wall_seconds": time.perf_counter() - start}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the tool's peak memory so far (Linux: KiB)
    return {k: stats.get(k) for k in RUN_STATS} | {"wall_seconds": time.perf_counter() - start, "tool_rss_bytes": rss}


def variant_options(text: str) -> dict[str, Any]:
    """``default`` or ``name=value,...``: bonsai's options, parsed as ``--option`` parses them."""
    return {} if text == "default" else dict(parse_option("bonsai", part) for part in text.split(","))


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite's options (its ``-o`` file keeps the page's results), and the page's."""
    ap.add_argument("--models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--budgets", nargs="+", type=bench_budget_arg, metavar="PCT",
                    default=[bench_budget_arg(p) for p in DEFAULT_BUDGETS],
                    help=f"shares of the no-remat peak (70 or 70%%), or bytes with a unit (82.4GiB) (default "
                         f"{' '.join(DEFAULT_BUDGETS)})")
    ap.add_argument("--variants", nargs="*", default=["default"],
                    help="bonsai option sets: 'default' or name=value,... (e.g. save_ops=false regions=modules)")
    ap.add_argument("--backends", nargs="*", default=["highs"])
    ap.add_argument("--compare", nargs="*", default=["chen", "dtr"])
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--granularities", nargs="*", type=int, default=[5, 10, 19, 38, 76])
    ap.add_argument("--skip-granularity", action="store_true")
    ap.add_argument("--skip-resolve", action="store_true")
    ap.add_argument("--skip-smallest", action="store_true")
    ap.add_argument("-o", "--output", default=None)
    common.add_page_arguments(ap, None, "docs/results/bonsai.md")


def tables(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The solve table, then the smallest budgets, the granularity sweep and the live re-solve: their rows."""
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
    graphs = {}
    methods = [("bonsai", v) for v in args.variants] + [(m, "") for m in args.compare]
    for spec in args.models:
        label, g = graphs[spec] = load(spec)
        plain = no_remat_peak(g)
        for backend in args.backends:
            B._cache.clear()  # the first row pays the build (and the import of CVXPY, once per process)
            for nbytes in [b.resolve(plain) for b in args.budgets]:
                for method, variant in methods:
                    opts = {"backend": backend, **variant_options(variant)} if method == "bonsai" else {}
                    name = method if variant in ("", "default") else f"{method} {variant}"
                    rows.append(shown(run(g, nbytes, method, time_limit=args.time_limit, **opts) | {
                        "model": label, "nodes": g.n, "fraction": nbytes / plain, "budget": nbytes, "method": name,
                        "backend": backend, "plain_peak": plain, "load": load_average()}))
    return rows, graphs


def smallest_budgets(args: argparse.Namespace, graphs: dict[str, tuple[str, Any]]) -> list[dict[str, Any]]:
    """Per model, as the methods suite finds them: bonsai's smallest budget, chen's, the per-op bound."""
    from bonsai_core.bench import methods

    config = methods.BenchConfig([], [], ["bonsai", "chen"], [], time_limit=args.time_limit)
    return [shown(r | {"sweep": "smallest", "plain_peak": r["no_remat_peak"]})
            for r in (methods.smallest_budgets(label, g, config) for label, g in (graphs[s] for s in args.models))]


def granularity_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Bonsai at 45% of the no-remat peak of the 4-layer GPT at each granularity asked, HiGHS."""
    label, g = load(GPT4)
    return [shown(budget_sweep(g, [0.45], granularity=gran, time_limit=args.time_limit)[0]
                  | {"model": label, "sweep": "granularity", "granularity_asked": gran}) for gran in args.granularities]


def resolve_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The live re-solve on the 4-layer GPT: one build, then the budget changed as a slider changes it."""
    label, g = load(GPT4)
    return [shown(r | {"model": label, "sweep": "resolve", "backend": backend}) for backend in args.backends
            for r in budget_sweep(g, RESOLVE, backend=backend, time_limit=args.time_limit)]


# -- docs/results/bonsai.md: the page's studies ------------------------------------------------------

SOURCES = ["bonsai_core/bench/bonsai.py", common.template_source("bonsai")]
EXPLORER_GRAPH = "assets/gpt-default.json"
GPT2_OPTIONS = {"layers": 4, "width": 256, "seq": 256}
# key -> (how the page names the graph, zoo model or None for the explorer's file, trace options)
GRAPHS: dict[str, tuple[str, str | None, dict[str, int]]] = {
    "gpt4": ("the 4-layer GPT", "gpt", GPT4_OPTIONS),
    "explorer": ("the explorer's default GPT", None, {}),
    "hf_gpt2": ("`hf:gpt2` at 4 layers", "hf:gpt2", GPT2_OPTIONS)}
BUDGETS = {"gpt4": (0.9, 0.7, 0.5, 0.45, 0.4, 0.37), "explorer": (0.7, 0.6, 0.5, 0.45),
           "hf_gpt2": (0.7, 0.6, 0.5, 0.45)}
# the segment options compared, in the only space they shape: self-contained nodes saved, rebuilt, outputs dropped
SEGMENTS = {"space": "regions"}
VARIANTS = {"saved": SEGMENTS, "rebuilt": {**SEGMENTS, "save_self_contained": False},
            "dropped": {**SEGMENTS, "drop_outputs": True}}
EXPORT_AT = 0.6  # the hf:gpt2 plan with dropped outputs exported (replay back-end) and verified on CPU
DRAG = tuple(round(0.95 - 0.05 * i, 2) for i in range(11))  # the explorer's slider, 95% down to 45%
MOCCASIN_AT = 0.4
UNETS = {"1-level U-Net": {"batch": 1, "image": 4, "layers": 1, "width": 16},
         "2-level U-Net": {"batch": 1, "image": 4, "layers": 2, "width": 16}}
LARGER_UNET = {"batch": 1, "image": 16, "layers": 1, "width": 4}
TINY_LM = {"layers": 1, "width": 32, "seq": 8, "batch": 1, "heads": 2, "vocab": 64}
OTHER_AUTHORS = [("hf:gpt2", TINY_LM), ("hf:llama", TINY_LM), ("hf:bert", TINY_LM),
                 ("hf:vit", {"layers": 1, "width": 32, "batch": 1, "heads": 2, "image": 16}),
                 ("hf:resnet", {"layers": 1, "width": 8, "batch": 2, "image": 16}), ("gpt", TINY_LM)]
HEADROOM_SIZES = [(w, s) for w in (8, 16, 32) for s in (4, 8, 16)]  # the 1-layer zoo GPT, heads 2, batch 1
HEADROOM_OPTIONS = {"layers": 1, "heads": 2, "batch": 1, "vocab": 64}
# Llama-3 steps (bf16 autocast, AdamW, one FSDP rank): config, size options, FSDP world, budgets; the 70B step
# traces in about 1.5 minutes and 4 GB.
REAL_STEPS = {"Llama-3-8B": ("assets/configs/llama-3-8b.json", {"batch": 2, "seq": 8192}, 8, ("82.4GiB",)),
              "Llama-3-70B": ("assets/configs/llama-3-70b.json", {"batch": 1, "seq": 8192}, 64, ("50%", "30%"))}
REAL_METHODS = (("dtr", {}), ("chen", {}), ("bonsai", {}), ("bonsai", {"offload": True}),
                ("bonsai", {"space": "regions"}))
REAL_METHODS_70B = REAL_METHODS[:3]  # the 70B step's solves take minutes each: bonsai's variants left out
CHECKMATE_GPTS = {"the 1-layer GPT": {"layers": 1}, "the 2-layer GPT": {"layers": 2}}
CHECKMATE_AT = (0.9, 0.7, 0.5)
# the options --page fixes (the page reports the suite's defaults); --time-limit may change
PAGE_FIXED = ("models", "budgets", "variants", "backends", "compare", "granularities", "skip_granularity",
              "skip_resolve", "skip_smallest")

Row = dict[str, Any]


# -- the studies -----------------------------------------------------------------------------------

def graph_facts(g) -> dict[str, Any]:
    """Size, no-remat peak and the self-contained forward nodes (name, bytes) of one graph."""
    forward = np.flatnonzero(g.is_forward)
    return {"nodes": g.n, "plain_peak": no_remat_peak(g),
            "self_contained": [[g.names[v], int(g.mem[v])] for v in forward[self_contained(g)].tolist()]}


def budget_sweep(g, fractions: Sequence[float], method: str = "bonsai", **options: Any) -> list[Row]:
    """:func:`run` at each budget (shares of the no-remat peak) in turn, the model cache cleared first: the first
    budget builds bonsai's model, the others re-solve it as the explorer's slider does."""
    B._cache.clear()
    return [run(g, int(no_remat_peak(g) * f), method, **options) | {"fraction": f} for f in fractions]


def export_study(g, time_limit: float) -> dict[str, Any]:
    """The ``hf:gpt2`` plan with dropped outputs at EXPORT_AT, exported with ``replay`` and run on CPU."""
    from bonsai_core.export import export_model, verify_export

    start = time.perf_counter()
    try:
        schedule = solve(g, int(EXPORT_AT * no_remat_peak(g)), "bonsai", time_limit=time_limit, drop_outputs=True,
                         **SEGMENTS)
        with tempfile.TemporaryDirectory() as folder:
            out = export_model(GRAPHS["hf_gpt2"][1], GPT2_OPTIONS, schedule, Path(folder) / "export")
            verified = verify_export(GRAPHS["hf_gpt2"][1], GPT2_OPTIONS, out)
    except (BonsaiError, RuntimeError) as e:  # the page says so; the other studies still count
        return {"fraction": EXPORT_AT, "error": str(e).split("\n")[0], "seconds": time.perf_counter() - start}
    report = verified.to_dict()
    return {"fraction": EXPORT_AT, "overhead": schedule.stats["overhead"],
            "recomputed_segments": schedule.stats["recomputed_segments"],
            "outputs_dropped": schedule.stats["outputs_dropped"], "problems": verified.problems(),
            **{k: report.get(k) for k in ("predicted_peak", "measured_peak", "peak_error", "loss_diff",
                                           "max_grad_diff")},
            "seconds": time.perf_counter() - start}


def outcome(g, budget: int, method: str, time_limit: float, **options: Any) -> Row:
    """One solve: its overhead and status, or that it found none (and why, in short)."""
    r = run(g, budget, method, time_limit=time_limit, **options)
    if "error" in r:
        return {"ok": False, "error": r["error"], "seconds": r["wall_seconds"]}
    return {"ok": True, "overhead": r["overhead"], "status": r["status"], "gap": r["gap"],
            "seconds": r["wall_seconds"]}


def bound_entry(label: str, g, time_limit: float) -> dict[str, Any]:
    """The per-op bound, the region bound (where it is) and the smallest budget bonsai meets."""
    bound = region_peak_bound(g)
    return {"label": label, "nodes": g.n, "plain_peak": no_remat_peak(g), "fixed": g.fixed_mem,
            "lower_bound": g.peak_lower_bound, "region_bound": bound.peak,
            "region_node": g.names[bound.node] if bound.node >= 0 else None, "backward_bytes": bound.backward_bytes,
            "reach": B.lowest_budget(g, time_limit=time_limit)}


def region_entry(label: str, g, time_limit: float,
                 at_half: Sequence[str] = ("moccasin", "checkmate")) -> dict[str, Any]:
    """:func:`bound_entry`, bonsai's reach with dropped outputs, and the methods halfway between the per-op
    bound and the no-remat peak and at the region bound."""
    e = bound_entry(label, g, time_limit)
    dropped, _ = B.smallest_budget(g, time_limit=time_limit, drop_outputs=True)
    e["reach_dropped"] = min((b for b in (dropped, e["reach"]) if b is not None), default=None)
    e["half"] = half = (e["lower_bound"] + e["plain_peak"]) // 2
    e["at_half"] = {m: outcome(g, half, m, time_limit) for m in ("bonsai", *at_half)}
    e["at_bound"] = {"bonsai": outcome(g, e["region_bound"], "bonsai", time_limit, drop_outputs=True),
                     "moccasin": outcome(g, e["region_bound"], "moccasin", time_limit)}
    return e


def bound_said(g, budget: int, offload: bool = False) -> dict[str, Any]:
    """The lower bound at ``budget`` as an overhead (None: no schedule fits), its seconds and how it was found."""
    bound = lower_bound(g, budget, offload=offload)
    return {"overhead": bound.cost / g.total_cost - 1 if bound.cost < float("inf") else None,
            "seconds": bound.seconds, "how": bound.how}


def real_step(label: str, time_limit: float) -> dict[str, Any]:
    """One of REAL_STEPS traced, and at each of its budgets the lower bound (without and with host copies)
    and every method of REAL_METHODS: overhead, wall seconds, and for bonsai the space its plan came from."""
    from bonsai_core.trace import trace_model

    config, options, world, budgets = REAL_STEPS[label]
    start = time.perf_counter()
    g = with_optimizer(trace_model(f"hf:{common.ROOT / config}", autocast="bf16", fsdp=world, **options).graph,
                       "adamw")
    entry: dict[str, Any] = {"label": label, "config": config, "options": options, "fsdp": world, "nodes": g.n,
                             "plain_peak": no_remat_peak(g), "trace_seconds": time.perf_counter() - start,
                             "budgets": []}
    for text in budgets:
        budget = parse_budget(text).resolve(entry["plain_peak"])
        row: dict[str, Any] = {"budget": text, "bytes": budget, "methods": []}
        row["bound"], row["bound_offload"] = (bound_said(g, budget, offload) for offload in (False, True))
        for method, opts in (REAL_METHODS_70B if "70B" in label else REAL_METHODS):
            r = run(g, budget, method, time_limit=time_limit, **opts)
            row["methods"].append({"method": method, "options": opts, **{k: r.get(k) for k in (
                "overhead", "wall_seconds", "space", "spaces", "bound_gap", "status", "error", "peak")}})
        entry["budgets"].append(row)
    return entry


def checkmate_study(time_limit: float) -> list[dict[str, Any]]:
    """Per CHECKMATE_GPTS graph and CHECKMATE_AT budget: the lower bound, bonsai's default and checkmate."""
    rows = []
    for label, options in CHECKMATE_GPTS.items():
        g = common.graph_of("gpt", **options)
        for fraction in CHECKMATE_AT:
            budget = int(fraction * no_remat_peak(g))
            row = {"label": label, "nodes": g.n, "fraction": fraction, "bound": bound_said(g, budget)["overhead"]}
            for method in ("bonsai", "checkmate"):
                r = run(g, budget, method, time_limit=time_limit)
                row[method] = {k: r.get(k) for k in ("overhead", "wall_seconds", "space", "status", "gap", "error")}
                if method == "checkmate" and "error" not in r:
                    row[method]["warm_start"] = r.get("warm_start")
            rows.append(row)
    return rows


def studies(time_limit: float, progress: Callable[[dict[str, Any]], None] = lambda done: None) -> dict[str, Any]:
    """Every measurement the page reports besides the suite's tables; ``progress(done so far)`` after each."""
    graphs = {key: load_graph(common.ROOT / EXPLORER_GRAPH) if model is None else common.graph_of(model, **options)
              for key, (_, model, options) in GRAPHS.items()}
    seconds: dict[str, float] = {}
    done = common.run_studies({
        "graphs": lambda: {k: graph_facts(g) for k, g in graphs.items()},
        "options": lambda: {k: {variant: budget_sweep(g, BUDGETS[k], time_limit=time_limit, **options)
                                for variant, options in VARIANTS.items()} for k, g in graphs.items()},
        "export": lambda: export_study(graphs["hf_gpt2"], time_limit),
        "drag": lambda: budget_sweep(graphs["explorer"], DRAG, time_limit=time_limit),
        "unets": lambda: [region_entry(label, common.graph_of("unet", **o), time_limit) for label, o in UNETS.items()],
        "larger_unet": lambda: region_entry("U-Net", common.graph_of("unet", **LARGER_UNET), time_limit,
                                            at_half=("moccasin",)),
        "explorer_bound": lambda: bound_entry("explorer", graphs["explorer"], time_limit),
        "headroom": lambda: [bound_entry(f"width {w}, seq {s}",
                                         common.graph_of("gpt", **HEADROOM_OPTIONS, width=w, seq=s), time_limit)
                             for w, s in HEADROOM_SIZES],
        "others": lambda: [bound_entry(name, common.graph_of(name, **o), time_limit) for name, o in OTHER_AUTHORS],
        "moccasin": lambda: budget_sweep(graphs["gpt4"], [MOCCASIN_AT], "moccasin", time_limit=time_limit)[0],
        "checkmate": lambda: checkmate_study(time_limit),
        "real_steps": lambda: [real_step(label, time_limit) for label in REAL_STEPS]},
        seconds, lambda so_far: progress({**so_far, "seconds": seconds}))
    return {**done, "seconds": seconds}


# -- the page --------------------------------------------------------------------------------------

def op_kinds(names: Iterable[str]) -> str:
    """``ones ×4, tril ×4, arange``: node names grouped by op (their ``_N`` suffix dropped)."""
    counts = Counter(name.rstrip("0123456789").rstrip("_") or name for name in names)
    return ", ".join(f"`{op}` ×{n}" if n > 1 else f"`{op}`" for op, n in counts.items())


def solve_values(cells: dict[tuple[str, float], dict[str, Row]]) -> dict[str, Any]:
    """Where bonsai is the cheapest of the methods compared, where another is, and the longest solve."""
    fitting = {k: {m: r["overhead"] for m, r in c.items() if "error" not in r} for k, c in cells.items()}
    contested = {k: c for k, c in fitting.items() if c}
    cheapest = [k for k, c in contested.items() if "bonsai" in c and c["bonsai"] <= min(c.values()) + TIE]
    unfit = common.grouped((k for k, c in fitting.items() if not c), lambda k: k[0], lambda k: k[1])
    timed = [(r["wall_seconds"], m, f) for (m, f), c in cells.items() for r in [c["bonsai"]] if "error" not in r]
    mine = {key: c.get("bonsai", float("inf")) for key, c in contested.items()}  # inf: bonsai found no plan
    return {"cheapest": len(cheapest), "contested": len(contested), "nowhere": unfit,
            "beaten": [(m, f, [(x, o) for x, o in c.items() if x != "bonsai" and o < mine[m, f] - TIE], c.get("bonsai"))
                       for (m, f), c in contested.items() if (m, f) not in cheapest],
            "median": median(t for t, _, _ in timed), "longest": max(timed, default=None)}


def suite_values(rows: Sequence[Row]) -> dict[str, Any]:
    """The suite's tables: cells ((model, budget) -> method -> row), the methods compared, each sweep's rows."""
    sweeps = common.grouped(rows, lambda r: r.get("sweep"))
    cells = common.cells(sweeps.pop(None, []), lambda r: (r["model"], r["fraction"]))
    methods = dict.fromkeys(m for c in cells.values() for m in c)
    return {"cells": cells, "compared": [m for m in methods if m != "bonsai"], "solved": solve_values(cells),
            "sweeps": sweeps}


def option_pairs(study: dict[str, Any], a: str, b: str) -> list[tuple[str, Row, Row]]:
    """(graph, its row with option ``a``, with ``b``) per graph and budget of the options study."""
    return [(GRAPHS[key][0], ra, rb) for key, rows in study["options"].items() for ra, rb in zip(rows[a], rows[b])]


def compared(rows: dict[str, list[Row]], a: str, b: str) -> dict[str, list[tuple[float, float]]]:
    """:func:`common.compare` of one graph's overheads with option ``a`` and with ``b``, budget by budget."""
    return compare((ra["fraction"], ra.get("overhead"), rb.get("overhead")) for ra, rb in zip(rows[a], rows[b]))


def options_values(study: dict[str, Any]) -> dict[str, Any]:
    """Per graph: its self-contained nodes, saving them against rebuilding them (and how many the plans save),
    dropping outputs against keeping them; dropping's largest gain, and where it costs more."""
    def self_contained_nodes(facts: dict[str, Any]) -> str:
        nodes = facts["self_contained"]
        return f"{op_kinds(n for n, _ in nodes)} ({format_bytes(sum(b for _, b in nodes))})" if nodes else "none"
    options = study["options"]
    dropped = [{"name": GRAPHS[key][0], "c": compared(rows, "dropped", "saved")} for key, rows in options.items()]
    return {"self_contained": [{"name": GRAPHS[key][0], "nodes": self_contained_nodes(study["graphs"][key]),
                                "c": compared(rows, "saved", "rebuilt"),
                                "saved": [r["self_contained_saved"] for r in rows["saved"] if "error" not in r]}
                               for key, rows in options.items()],
            "dropped": dropped,
            "dropped_gain": max(((d, o["name"], f) for o in dropped for f, d in o["c"]["lower"]), default=None),
            "dropped_dearer": [f"{o['name']} at {budget(f)}" for o in dropped for f, _ in o["c"]["higher"]]}


def unet_values(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The graphs where bonsai reaches the region bound with ``drop_outputs`` and without; halfway between the
    per-op bound and the no-remat peak, (who fits, who proved it, the graphs with that outcome)."""
    def outcome_at_half(e: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        fit = tuple(m for m, o in e["at_half"].items() if o["ok"])
        return fit, tuple(m for m in fit if e["at_half"][m]["status"] == "optimal")
    def reached(key: str) -> list[str]:
        return [e["label"] for e in entries if e[key] is not None and e[key] <= e["region_bound"]]
    halves = common.grouped(entries, outcome_at_half, lambda e: e["label"])
    return {"exact": reached("reach_dropped"), "plain": reached("reach"),
            "halves": [(fit, proven, labels) for (fit, proven), labels in halves.items()]}


def real_steps_values(steps: Sequence[dict[str, Any]]) -> list[Row]:
    """Every method on the Llama-3 steps at each budget, with the lower bound: a row per step and budget."""
    rows = []
    for e in steps:
        for row in e["budgets"]:
            cells = {(m["method"], tuple(sorted(m["options"].items()))): m for m in row["methods"]}
            rows.append({"label": e["label"], "share": f"{row['budget']} ({row['bytes'] / e['plain_peak']:.1%})",
                         "bound": row["bound"], "bound_offload": row["bound_offload"], "dtr": cells[("dtr", ())],
                         "chen": cells[("chen", ())], "plain": cells[("bonsai", ())],
                         "offload": cells.get(("bonsai", (("offload", True),))),
                         "regions": cells.get(("bonsai", (("space", "regions"),)))})
    return rows


def page(results: dict[str, Any], header: str, results_link: str) -> str:
    """The whole page from one run's results (the suite's rows, :func:`studies`' and the run's meta)."""
    meta, rows, s = results["meta"], results["rows"], results["studies"]
    return common.fill(
        "bonsai", header=header, meta=meta, dates=common.run_dates(meta), results_link=results_link,
        time_limit=f"{meta['time_limit']:g}", s=s, graphs=GRAPHS, explorer_graph=EXPLORER_GRAPH, gpt2=GPT2_OPTIONS,
        unets=UNETS, larger_unet=LARGER_UNET, sizes=HEADROOM_SIZES, headroom_options=HEADROOM_OPTIONS,
        gpt4=GPT4, option_pairs=lambda a, b: option_pairs(s, a, b), tie=TIE, **options_values(s),
        unet=unet_values(s["unets"]), others=list(zip(OTHER_AUTHORS, s["others"])), moccasin_at=MOCCASIN_AT,
        real_steps=real_steps_values(s["real_steps"]), **suite_values(rows))


# -- the command -----------------------------------------------------------------------------------

def refusal(args: argparse.Namespace) -> str | None:
    """Why the page's options cannot run, before anything is measured; None when they can."""
    if args.output is None:
        return "--page and --report-only keep the run's results in -o FILE.json: name it"
    if not Path(args.output).resolve().parent.is_dir():
        return f"-o {args.output}: the folder {Path(args.output).parent} does not exist"
    return common.page_refusal(args, results=Path(args.output), narrowed=common.changed(args, PAGE_FIXED),
                               whole="the suite's default models, budgets and studies", studies=True)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The suite's tables and the page's studies, their results kept in ``-o`` as they come."""
    started = time.perf_counter()
    results: dict[str, Any] = {"meta": common.run_meta("started", time_limit=args.time_limit)}

    def keep() -> None:
        Path(args.output).write_text(json.dumps(results, indent=1, default=str))

    results["rows"] = tables(args)
    keep()
    results["studies"] = studies(args.time_limit, progress=lambda done: (results.update(studies=done), keep()))
    results["meta"].update(ended=common.utc_now(),
                           seconds=round(time.perf_counter() - started, 1), load_end=load_average())
    return results


def main(args: argparse.Namespace) -> int:
    """The suite's tables into ``-o``; with ``--page`` also the page's studies and the page."""
    if args.page is None and not args.report_only:
        rows = tables(args)
        if args.output:
            Path(args.output).write_text(json.dumps(rows, indent=1, default=str))
        return 0
    kept = Path(args.output) if args.output else None  # refused without it
    return common.run_page_suite("bonsai", args, refusal(args), lambda: measure(args),
                                 common.page_writer(page, SOURCES, kept), results=kept)
