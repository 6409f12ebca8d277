"""Coop vs DTR in one pool, as Coop's paper compares them (Zhang et al., NeurIPS 2023).

The paper runs every method inside one pre-reserved memory pool that also holds the parameters,
gradients and optimizer state (OneFlow's DTR allocator), and reports the smallest pool each method
trains in ("up to 2x memory saving") and the compute overhead at equal pools. This script measures
that for the zoo's and Hugging Face's networks at two sizes each (the zoo default and a larger batch
or sequence), and GPT-2 small (the zoo GPT at ``models.zoo.GPT2_SMALL``: batch 8, sequence 512, width 768,
12 layers and heads, vocabulary 50257), every model traced once (``bonsai bench heuristics``):

* **smallest pool** each variant trains in (its schedule, replayed in the pool, fits), by bisection
  on the budget (10 steps, between the graph's lower bound and 1.5x its no-remat peak; a heuristic's
  success is not monotone in the budget, so this is the threshold the bisection lands on, not a
  proven minimum). A pool is the budget plus the Adam state (``allocator.full_arena``): the whole
  arena, in MiB.
* **overhead at equal pools**: each variant at 1.0x, 1.2x and 1.5x coop's smallest pool.
* **fragmentation**: the allocator model's, and only it (:func:`bonsai_core.allocator.fragmentation_at_peak`,
  1 - live / reserved at the reserved peak), for the same schedule in two allocators: its own pool
  (:func:`bonsai_core.solvers.pool.pool_replay`: block for block the pool the run used;
  ``bonsai simulate G S --allocator --arena``) and PyTorch's caching allocator (``replay``;
  ``bonsai simulate G S --allocator``, the default).

Variants: ``coop`` (its defaults: op-type partitioning, full arena); DTR in the same full-arena pool
with h_DTR (``dtr-pool``: ``dtr --option allocator=true --option full_arena=true``), with DTR's
union-find e* (``dtr_eq-pool``, what OneFlow's DTR baseline computes) and with the DTE score
(``dte-pool``: the free range an eviction leaves instead of the tensor's bytes, the paper's other
baseline); and DTR counting live bytes only (``dtr``), whose schedule is then placed in the pool best
fit (``pool_replay``): it trains in a pool when that placement fits.

    bonsai bench heuristics --out docs/heuristics --example   # about a minute here
    bonsai bench heuristics --page docs/results/heuristics.md  # and the page's other studies: a few minutes
    bonsai bench heuristics --page docs/results/heuristics.md --report-only  # the page again from results.json

writes ``results.json``, ``table.md``, ``coop_vs_dtr.html`` (plotly) and ``coop_vs_dtr.png`` (the
same figure; kaleido if installed, else headless Chromium) there. ``--example`` adds ``example.md``:
coop and dtr-pool on the zoo GPT at 60% of its no-remat peak, request by request, from the runs'
own event logs (``schedule.extra["evictions"]``). ``--page`` adds the example, runs the other studies
docs/results/heuristics.md reports (``heuristics_page.studies``), keeps them in
``results.json`` and writes the page (``heuristics_page.page``; the suite's entry is ``heuristics_page.main``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bonsai_core.allocator import fixed_tensors, optimizer_bytes, replay
from bonsai_core.bench import common
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, no_remat_peak, simulate
from bonsai_core.solvers import solve
from bonsai_core.solvers.pool import pool_replay

# GPT-2 small's shape, ``models.zoo.GPT2_SMALL`` (bonsai_core.zoo imports torch: read only when a run needs it)
GPT2_SMALL = "GPT2_SMALL"
GPT2_SMALL_LABEL = "gpt GPT-2 small"
# (name, options): each network at its zoo default and a larger batch or sequence; hf models are built
# from configs (no weights); GPT-2 small's shape besides, the largest graph (1,517 nodes)
MODEL_SIZES: list[tuple[str, dict[str, int] | str]] = [
    ("gpt", {}), ("gpt", {"batch": 16, "seq": 512}), ("gpt", GPT2_SMALL),
    ("resnet", {}), ("resnet", {"batch": 64}),
    ("unet", {}), ("unet", {"batch": 16}),
    ("vgg", {}), ("vgg", {"batch": 64}),
    ("mlp", {}), ("mlp", {"batch": 4096}),
    ("hf:gpt2", {}), ("hf:gpt2", {"seq": 512}),
    ("hf:bert", {}), ("hf:bert", {"seq": 512}),
    ("hf:vit", {}), ("hf:vit", {"batch": 64}),
]


def models() -> list[tuple[str, dict[str, int]]]:
    """MODEL_SIZES with GPT-2 small's shape filled in."""
    from bonsai_core.models.zoo import GPT2_SMALL as shape

    return [(name, dict(shape) if options == GPT2_SMALL else options) for name, options in MODEL_SIZES]
POOL_ARGS = {"allocator": True, "full_arena": True}
# label -> (method, options); every one but "dtr" runs inside the pool
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "coop": ("coop", {}),
    "dtr-pool": ("dtr", POOL_ARGS),
    "dtr_eq-pool": ("dtr", {**POOL_ARGS, "heuristic": "dtr_eq"}),
    "dte-pool": ("dtr", {**POOL_ARGS, "heuristic": "dte"}),
    "dtr": ("dtr", {}),
}
POOL_VARIANTS = ("dtr-pool", "dtr_eq-pool", "dte-pool")  # DTR evicting inside the same pool as coop
FACTORS = (1.0, 1.2, 1.5)  # equal pools: multiples of coop's smallest pool
FAIL_BAR = 20  # the figure draws "does not train in this pool" as a hatched bar this far below zero
STEPS = 10
DEFAULT_OUT, RECORD_PAGE = "docs/heuristics", "docs/results/heuristics.md"


def adam_bytes(graph: Graph) -> int:
    return optimizer_bytes(fixed_tensors(graph)) if graph.optimizer is None else 0


def run(graph: Graph, budget: int, label: str, time_limit: float, measure: bool = False,
        variants: dict[str, tuple[str, dict[str, Any]]] = VARIANTS) -> dict[str, Any]:
    """One solve of ``label`` (a key of ``variants``) under ``budget``: ok, overhead, eviction counts;
    with ``measure`` the fragmentation of its schedule in its own pool and under the caching allocator
    (the allocator model's one definition). It is ok when the method returns a schedule and that
    schedule fits the pool when replayed (``pool_replay``): for ``dtr`` (live bytes) placed best fit;
    for a pool method its own run's placement, which differs only when the run held separated outputs
    (``outputs_held``)."""
    method, options = variants[label]
    start = time.perf_counter()
    try:
        s = solve(graph, budget, method, time_limit=time_limit, budget_hint=False, **options)
        own = pool_replay(graph, s, capacity=budget)
    except BonsaiError as e:
        return {"ok": False, "error": str(e).split(":")[0][:120], "seconds": time.perf_counter() - start}
    row: dict[str, Any] = {"ok": True, "overhead": s.stats["overhead"], "evictions": s.stats.get("evictions", 0),
                           "requests": len(s.extra.get("evictions", [])), "seconds": time.perf_counter() - start}
    if measure:
        row.update(own_fragmentation=fragmentation(graph, s, "arena", budget),
                   caching_fragmentation=fragmentation(graph, s, "caching"), reserved_peak=own.reserved_peak,
                   live_peak=own.peak, free_at_failure=s.stats.get("free_at_failure", 0.0),
                   free_after_eviction=s.stats.get("free_after_eviction", 0.0))
    return row


def fragmentation(graph: Graph, schedule: Schedule, allocator: str, capacity: int | None = None) -> float:
    """The allocator model's fragmentation of ``schedule``: in its own pool (``"arena"``, what
    ``bonsai simulate --allocator --arena`` prints) or under PyTorch's caching allocator
    (``"caching"``, what ``bonsai simulate --allocator`` prints)."""
    result = pool_replay(graph, schedule, capacity) if allocator == "arena" else replay(graph, schedule)
    return result.fragmentation


def smallest_budget(graph: Graph, label: str, time_limit: float, steps: int = STEPS,
                    variants: dict[str, tuple[str, dict[str, Any]]] = VARIANTS) -> int | None:
    """The smallest budget ``label`` trains in, bisected between the graph's lower bound and 1.5x its
    no-remat peak."""
    return common.bisect_budget(lambda budget: run(graph, budget, label, time_limit, variants=variants)["ok"],
                                graph.peak_lower_bound, int(1.5 * no_remat_peak(graph)), steps)


def label_of(name: str, options: dict[str, int]) -> str:
    from bonsai_core.models.zoo import GPT2_SMALL as shape

    if name == "gpt" and options == shape:
        return GPT2_SMALL_LABEL
    return name + "".join(f" --{k} {v}" for k, v in options.items())


def bench_model(name: str, options: dict[str, int], time_limit: float) -> dict[str, Any]:
    from bonsai_core.trace import trace_model

    start = time.perf_counter()
    g = trace_model(name, **options).graph
    traced = time.perf_counter() - start
    ref, adam = no_remat_peak(g), adam_bytes(g)
    entry: dict[str, Any] = {"model": name, "options": options, "nodes": g.n, "no_remat_peak": ref,
                             "fixed_mem": g.fixed_mem, "adam_bytes": adam, "trace_seconds": traced,
                             "smallest_budget": {}, "equal_pools": {},
                             "bisection_step": (int(1.5 * ref) - g.peak_lower_bound) / 2**STEPS}
    for label in VARIANTS:
        entry["smallest_budget"][label] = smallest_budget(g, label, time_limit)
    coop = entry["smallest_budget"]["coop"]
    if coop is not None:
        for f in FACTORS:
            budget = int(f * (coop + adam)) - adam
            entry["equal_pools"][str(f)] = {"budget": budget,
                                            **{label: run(g, budget, label, time_limit, measure=True)
                                               for label in VARIANTS}}
    entry["seconds"] = time.perf_counter() - start
    pools = ", ".join(f"{k} {mib(b + adam) if b else '-'}" for k, b in entry["smallest_budget"].items())
    print(f"{label_of(name, options)}: {g.n} nodes, traced in {traced:.1f} s; smallest pools (MiB): {pools}; "
          f"{entry['seconds']:.0f} s", flush=True)
    return entry


def mib(nbytes: float) -> str:
    """MiB with one decimal, without the unit: the tables' headers name it."""
    return common.mib(nbytes, 1, "")


# -- the report ------------------------------------------------------------------------------------

def pool_cell(e: dict[str, Any], label: str) -> str:
    b = e["smallest_budget"][label]
    return mib(b + e["adam_bytes"]) if b else "-"


def ratio(e: dict[str, Any], label: str) -> float | None:
    b, c = e["smallest_budget"][label], e["smallest_budget"]["coop"]
    return (b + e["adam_bytes"]) / (c + e["adam_bytes"]) if b and c else None


def best_pool_ratio(e: dict[str, Any]) -> float | None:
    """The smallest pool of the best DTR-in-the-pool variant, over coop's (None when either trains in none)."""
    rs = [r for r in (ratio(e, k) for k in POOL_VARIANTS) if r is not None]
    return min(rs) if rs else None


def pool_order(e: dict[str, Any]) -> str | None:
    """How coop's smallest pool compares with the best DTR-in-the-pool variant's: "coop smaller", "same"
    (within one step of the bisection, which cannot tell them apart) or "coop larger"; None when either
    trains in none."""
    coop, others = e["smallest_budget"]["coop"], [e["smallest_budget"][k] for k in POOL_VARIANTS]
    others = [b for b in others if b]
    if not coop or not others:
        return None
    gap = min(others) - coop
    return "same" if abs(gap) <= e["bisection_step"] else "coop smaller" if gap > 0 else "coop larger"


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """How often and by how much coop's smallest pool is below the best DTR-in-the-pool variant's, and the
    median overheads at equal pools."""
    entries = list(results["models"].values())
    best = []
    for e in entries:
        rs = [r for r in (ratio(e, k) for k in POOL_VARIANTS) if r is not None]
        if rs and e["smallest_budget"]["coop"]:
            best.append(min(rs))
    orders = [pool_order(e) for e in entries]
    out: dict[str, Any] = {"models": len(entries), "coop_smaller": orders.count("coop smaller"),
                           "coop_larger": orders.count("coop larger"),
                           "best_dtr_over_coop": [min(best), max(best)] if best else None,
                           "dtr_pool_over_coop": [r for r in (ratio(e, "dtr-pool") for e in entries) if r]}
    for f in FACTORS:
        rows = [e["equal_pools"][str(f)] for e in entries if str(f) in e["equal_pools"]]
        both = [(p["coop"], p["dtr-pool"]) for p in rows if p["coop"]["ok"] and p["dtr-pool"]["ok"]]
        out[str(f)] = {"both_run": len(both),
                       "coop_lower": sum(a["overhead"] < b["overhead"] - 1e-9 for a, b in both),
                       "coop_higher": sum(a["overhead"] > b["overhead"] + 1e-9 for a, b in both),
                       "median_coop": statistics.median(a["overhead"] for a, _ in both) if both else None,
                       "median_dtr_pool": statistics.median(b["overhead"] for _, b in both) if both else None,
                       "dtr_pool_fails": sum(not p["dtr-pool"]["ok"] for p in rows if p["coop"]["ok"]),
                       "coop_fails": sum(not p["coop"]["ok"] for p in rows)}
    return out


def table(results: dict[str, Any]) -> str:
    """table.md: every graph's smallest pools, the equal pools and the headline."""
    return common.fill("heuristics_table", meta=results["meta"], steps=STEPS, headline=results["headline"],
                       factors=FACTORS, models=results["models"].values(), labels=list(VARIANTS), label_of=label_of,
                       pool_cell=pool_cell, ratio=ratio, best_pool_ratio=best_pool_ratio,
                       overhead_columns=[f"overhead {k}" for k in VARIANTS])


def figure(results: dict[str, Any]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    entries = list(results["models"].values())
    xs = [label_of(e["model"], e["options"]).replace(" --", "<br>--") for e in entries]
    titles = ["smallest pool, relative to coop's (lower is better; missing: none up to 1.5x the no-remat peak)"] + [
        f"overhead at {f:.1f}x coop's smallest pool (%; hatched bar below zero: does not train in it)" for f in FACTORS]
    fig = make_subplots(rows=1 + len(FACTORS), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=titles)
    colours = dict(zip(VARIANTS, ["#1f77b4", "#d62728", "#ff7f0e", "#9467bd", "#7f7f7f"]))
    for label in VARIANTS:
        fig.add_trace(go.Bar(x=xs, y=[ratio(e, label) for e in entries], name=label, marker_color=colours[label],
                             legendgroup=label), row=1, col=1)
        for i, f in enumerate(FACTORS):
            ys, hatch = [], []
            for e in entries:
                r = e["equal_pools"].get(str(f), {}).get(label)
                ys.append(None if r is None else 100 * r["overhead"] if r["ok"] else -FAIL_BAR)
                hatch.append("" if r is None or r["ok"] else "x")
            fig.add_trace(go.Bar(x=xs, y=ys, name=label, marker=dict(color=colours[label], pattern_shape=hatch),
                                 legendgroup=label, showlegend=False), row=2 + i, col=1)
    fig.update_layout(barmode="group", width=1400, height=1300, template="plotly_white",
                      title=f"Coop vs DTR in one pool ({results['meta']['date']}; {results['meta']['command']})",
                      legend=dict(orientation="h", y=1.04, x=0))
    fig.update_yaxes(title_text="pool / coop's", row=1, col=1)
    return fig


def write_png(fig, path: Path) -> str:
    """The figure as PNG: plotly's kaleido if installed, else headless Chromium on a self-contained copy."""
    try:
        fig.write_image(path, width=fig.layout.width, height=fig.layout.height)
        return "kaleido"
    except Exception:  # no kaleido (or its browser): the browser the explorer's tests use
        chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if chromium is None:
            raise SystemExit("no kaleido and no chromium: cannot write the PNG (the HTML is written)")
        with tempfile.TemporaryDirectory() as tmp:
            page = Path(tmp) / "figure.html"
            fig.write_html(page, include_plotlyjs=True, config={"staticPlot": True})
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--window-size={fig.layout.width},{fig.layout.height}", f"--screenshot={path}",
                            page.as_uri()], check=True, capture_output=True, timeout=120)
        return "chromium"


def report(results: dict[str, Any], out: Path) -> None:
    results["headline"] = headline(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table(results))
    fig = figure(results)
    fig.write_html(out / "coop_vs_dtr.html", include_plotlyjs="cdn")
    write_png(fig, out / "coop_vs_dtr.png")


# -- the worked example ----------------------------------------------------------------------------

EXAMPLE_FRAC = 0.6
# the budgets of the sweep around the example's pool (shares of the no-remat peak); 0.7 and 0.8 show where it eases
SWEEP_FRACS = (0.58, 0.6, 0.62, 0.65, 0.7, 0.8)
SWEEP: dict[str, tuple[str, dict[str, Any]]] = {
    "coop": ("coop", {}), "coop window_cost=recompute": ("coop", {"window_cost": "recompute"}),
    "dtr-pool": VARIANTS["dtr-pool"], "dtr (live bytes, no pool)": VARIANTS["dtr"]}
EXAMPLE_METHODS = ("coop", "dtr-pool")


def recomputed(graph: Graph, schedule: Schedule) -> dict[int, int]:
    """node -> its recomputations (the simulator's count of its computes, less one)."""
    times = simulate(graph, schedule).times_computed
    return {int(v): int(times[v]) - 1 for v in times.nonzero()[0] if times[v] > 1}


def run_summary(graph: Graph, schedule: Schedule) -> dict[str, Any]:
    """What one run's event log (``schedule.extra["evictions"]``: op, node, evicted per request that found
    no room) says: requests, those made while rebuilding an evicted tensor, bytes evicted per request's
    bytes, recomputations."""
    log = schedule.extra["evictions"]
    mem, cost = graph.mem.tolist(), graph.cost.tolist()
    first_at: dict[int, int] = {}
    for i, (kind, v) in enumerate(schedule.ops):
        if kind == "compute":
            first_at.setdefault(v, i)
    freed = [sum(mem[t] for t in evicted) / max(mem[v], 1) for _, v, evicted in log]
    rec = recomputed(graph, schedule)
    return {"overhead": schedule.stats["overhead"], "requests": len(log),
            "rebuilding": sum(first_at[v] < op for op, v, _ in log), "evictions": schedule.stats["evictions"],
            "freed_median": statistics.median(freed) if freed else None,
            "freed_mean": statistics.mean(freed) if freed else None,
            "recomputations": sum(rec.values()), "recomputed_nodes": len(rec),
            "recompute_seconds": sum(cost[v] * c for v, c in rec.items())}


def first_divergence(logs: dict[str, list]) -> int | None:
    """The index of the first request at which the two runs' logs differ (node or evictions)."""
    a, b = (logs[k] for k in EXAMPLE_METHODS)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x[1] != y[1] or x[2] != y[2]), None)


def request_rows(graph: Graph, logs: dict[str, list], first: int, count: int = 4) -> list[dict[str, Any]]:
    """Requests ``first`` to ``first + count`` of each run: op, the node needing room and what was evicted."""
    names, mem = graph.names, graph.mem.tolist()
    rows = []
    for i in range(first, min(first + count, *(len(logs[k]) for k in EXAMPLE_METHODS))):
        for k in EXAMPLE_METHODS:
            op, v, evicted = logs[k][i]
            rows.append({"request": i + 1, "method": k, "op": op, "node": names[v], "bytes": mem[v],
                         "evicted": [[names[t], mem[t]] for t in evicted if mem[t] > 0]})
    return rows


def most_recomputed(graph: Graph, schedule: Schedule, count: int = 6) -> list[dict[str, Any]]:
    """The ``count`` nodes the run spends most recomputing (recomputations x cost)."""
    rec, cost = recomputed(graph, schedule), graph.cost.tolist()
    return [{"node": graph.names[v], "op": graph.ops[v], "recomputations": rec[v], "cost": cost[v],
             "bytes": int(graph.mem[v])} for v in sorted(rec, key=lambda v: -rec[v] * cost[v])[:count]]


def sweep(graph: Graph, time_limit: float) -> dict[str, list[float | None]]:
    """variant -> its overhead at each of SWEEP_FRACS (None: does not train in it)."""
    out: dict[str, list[float | None]] = {}
    for k, (method, options) in SWEEP.items():
        out[k] = []
        for f in SWEEP_FRACS:
            try:
                s = solve(graph, int(f * no_remat_peak(graph)), method, time_limit=time_limit, budget_hint=False,
                          **options)
                out[k].append(s.stats["overhead"])
            except BonsaiError:
                out[k].append(None)
    return out


def example(time_limit: float, frac: float = EXAMPLE_FRAC) -> dict[str, Any]:
    """Coop and dtr-pool on the zoo GPT at ``frac`` of its no-remat peak, from their event logs: what
    each run's requests did, the requests where they first differ, what each recomputes most, and both
    around that pool."""
    from bonsai_core.trace import trace_model

    g = trace_model("gpt").graph
    budget = int(frac * no_remat_peak(g))
    runs = {k: solve(g, budget, VARIANTS[k][0], time_limit=time_limit, budget_hint=False, **VARIANTS[k][1])
            for k in EXAMPLE_METHODS}
    logs = {k: s.extra["evictions"] for k, s in runs.items()}
    first = first_divergence(logs)
    return {"model": "gpt", "nodes": g.n, "frac": frac, "budget": budget, "adam_bytes": adam_bytes(g),
            "runs": {k: run_summary(g, s) for k, s in runs.items()}, "first_divergence": first,
            "requests": [] if first is None else request_rows(g, logs, first),
            "most_recomputed": {k: most_recomputed(g, s) for k, s in runs.items()},
            "sweep_fracs": list(SWEEP_FRACS), "sweep": sweep(g, time_limit)}


def example_markdown(ex: dict[str, Any]) -> str:
    """example.md: the worked example's runs, their first differing requests, what each recomputes most
    and the sweep around the pool."""
    return common.fill("heuristics_example", ex=ex)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite's options."""
    common.add_page_arguments(ap, DEFAULT_OUT, RECORD_PAGE)
    names = list(dict.fromkeys(n for n, _ in MODEL_SIZES))
    ap.add_argument("--models", nargs="+", default=names, help=f"from {', '.join(names)}")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    ap.add_argument("--example", action="store_true", help="also write example.md (the worked example)")


def refusal(args: argparse.Namespace) -> str | None:
    """Why the options cannot run, before any measurement: a page from a subset of the models, a page
    again from results without the page's studies, or what :func:`common.page_refusal` refuses."""
    saved = Path(args.out) / "results.json"
    why = common.page_refusal(args, narrowed=common.changed(args, ("models",)), whole="every model")
    if not why and args.report_only and "studies" not in json.loads(saved.read_text()):
        return f"{saved} holds no page studies; run with --page, without --report-only"
    return why


def write_beside(results: dict[str, Any], out: Path) -> None:
    """table.md and the figure; example.md when the results hold the example."""
    report(results, out)
    if "example" in results:
        (out / "example.md").write_text(example_markdown(results["example"]))


def measure(args: argparse.Namespace, studies: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
    """Every chosen model (results.json in ``--out`` after each), the worked example with ``--example`` or
    ``--page``, and with ``--page`` the page's other ``studies``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: dict[str, Any] = {"meta": common.run_meta(seconds=0.0),
                               "variants": {k: [m, o] for k, (m, o) in VARIANTS.items()},
                               "factors": list(FACTORS), "models": {}}
    for name, options in models():
        if name in args.models:
            results["models"][label_of(name, options)] = bench_model(name, options, args.time_limit)
            results["meta"]["seconds"] = time.perf_counter() - start
            (out / "results.json").write_text(json.dumps(results, indent=1))
    if args.example or args.page:
        results["example"] = example(args.time_limit)
    if args.page:
        results["studies"] = studies(args.time_limit)
    results["meta"]["seconds"] = time.perf_counter() - start
    return results
