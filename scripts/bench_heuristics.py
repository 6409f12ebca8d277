"""Coop vs DTR under the full arena: Coop's comparison (Zhang et al., NeurIPS 2023), reproduced.

For each traced model this runs the dynamic methods inside one pool that also holds the step's
parameters, gradients, batch and Adam state (``full_arena``: :func:`bonsai_core.allocator.full_arena`),
and, for reference, DTR counting live bytes only and Chen's static checkpointing. Per method:

* the smallest budget it meets (bisection; a heuristic's success is not monotone in the budget, so
  it is the threshold bisection lands on),
* recompute overhead across a sweep of budgets,
* fragmentation: reserved - live at the peak. For the pool methods, in their own pool (the
  high-water mark of the addresses placement touched vs the bytes held in blocks there); for every
  schedule, also under PyTorch's caching allocator replaying it (full arena, as PyTorch would run it),
* eviction search latency: the median wall time of one eviction search (a policy call), and how
  many searches a run made. The machine is shared, so these are medians under load.

Budgets are shares of the model's no-remat peak and, like the simulator's, do not include the
optimizer state: a pool of budget B holds B + the Adam state.

    python scripts/bench_heuristics.py --out docs/heuristics                        # zoo default sizes
    python scripts/bench_heuristics.py --size large --out docs/heuristics-large     # bigger batches
    python scripts/bench_heuristics.py --size gpt2 --models gpt --out docs/heuristics-gpt2   # GPT-2 small

writes ``results.json``, ``table.md`` and ``heuristics.png`` there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bonsai_core.allocator import fixed_tensors, optimizer_bytes, replay
from bonsai_core.budget import format_bytes
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import solve
from bonsai_core.trace import trace_zoo
from bonsai_core.zoo import GPT2_SMALL

MODELS = ("gpt", "resnet", "unet", "mlp", "vgg")
SIZES = {"default": {}, "large": {"gpt": {"batch": 32}, "resnet": {"batch": 64}, "unet": {"batch": 16},
                                  "mlp": {"batch": 4096}, "vgg": {"batch": 64}},
         "gpt2": {"gpt": GPT2_SMALL}}
# label -> (method, options); the first four run in the full arena
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dtr-pool": ("dtr", {"allocator": True, "full_arena": True, "budget_hint": False}),
    "coop": ("coop", {"budget_hint": False}),
    "coop-density": ("coop", {"partition": "cost_density", "budget_hint": False}),
    "coop-nopart": ("coop", {"partition": "none", "budget_hint": False}),
    "dtr": ("dtr", {"budget_hint": False}),
    "chen": ("chen", {}),
}
POOL = ("dtr-pool", "coop", "coop-density", "coop-nopart")
SWEEP = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def run(graph: Graph, budget: int, label: str, time_limit: float) -> dict[str, Any]:
    method, options = VARIANTS[label]
    start = time.perf_counter()
    try:
        s = solve(graph, budget, method, time_limit=time_limit, **options)
    except BonsaiError as e:
        return {"ok": False, "error": str(e).split(":")[0], "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    caching = replay(graph, s)  # full arena, PyTorch's caching allocator
    keys = ("overhead", "evictions", "eviction_searches", "search_seconds_median", "pool_high_water",
            "pool_fragmentation", "pool_waste", "alloc_failures", "free_at_failure")
    row = {"ok": True, **{k: s.stats[k] for k in keys if k in s.stats}, "seconds": seconds,
           "caching_reserved": caching.reserved_peak, "caching_fragmentation": caching.fragmentation,
           "caching_waste": caching.reserved_peak - int(caching.live[int(np.argmax(caching.reserved)):].max())}
    if label not in POOL:  # the pool a best-fit single arena needs for this schedule (placement by replay)
        arena = replay(graph, s, capacity=graph.fixed_mem + 8 * max(1, s.stats["peak"]), policy="arena")
        row["arena_reserved"] = arena.reserved_peak
        row["arena_fragmentation"] = arena.fragmentation
    return row


def smallest_budget(graph: Graph, label: str, hi: int, time_limit: float, steps: int = 10) -> int | None:
    lo = graph.peak_lower_bound
    if not run(graph, hi, label, time_limit)["ok"]:
        return None
    for _ in range(steps):
        mid = (lo + hi) // 2
        if run(graph, mid, label, time_limit)["ok"]:
            hi = mid
        else:
            lo = mid
    return hi


def bench_model(name: str, time_limit: float, options: dict[str, Any]) -> dict[str, Any]:
    g = trace_zoo(name, **options).graph
    ref = no_remat_peak(g)
    adam = optimizer_bytes(fixed_tensors(g))
    entry: dict[str, Any] = {"options": options, "nodes": g.n, "no_remat_peak": ref, "fixed_mem": g.fixed_mem,
                             "adam_bytes": adam,
                             "smallest_budget": {}, "sweep": {}}
    print(f"{name} {options}: {g.n} nodes, no-remat peak {format_bytes(ref)}, fixed {format_bytes(g.fixed_mem)}, "
          f"Adam state {format_bytes(adam)}", flush=True)
    for label in VARIANTS:
        entry["sweep"][label] = [{"frac": f, **run(g, int(f * ref), label, time_limit)} for f in SWEEP]
        entry["smallest_budget"][label] = smallest_budget(g, label, int(1.5 * ref), time_limit)
        b = entry["smallest_budget"][label]
        print(f"  {label}: smallest budget {b / ref:.1%}" if b else f"  {label}: none", flush=True)
    return entry


def at(entry: dict[str, Any], label: str, frac: float) -> dict[str, Any]:
    return next(p for p in entry["sweep"][label] if abs(p["frac"] - frac) < 1e-9)


def summary(results: dict[str, Any]) -> list[str]:
    """Coop vs DTR in the same full-arena pool, per model: smallest budgets, and medians over the sweep
    budgets where both run."""
    lines = ["Coop (op-type partitioning, the default) vs DTR in the same full-arena pool; medians over the "
             "sweep budgets where both run:", "",
             "| model | smallest budget dtr-pool / coop | budgets both run | free share at a failed request "
             "dtr-pool / coop | pool frag. at high water dtr-pool / coop "
             "| overhead dtr-pool / coop | searches dtr-pool / coop | median search dtr-pool / coop |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in results["models"].items():
        ref = e["no_remat_peak"]
        sb = [e["smallest_budget"][k] for k in ("dtr-pool", "coop")]
        both = [(a, b) for a, b in zip(e["sweep"]["dtr-pool"], e["sweep"]["coop"]) if a["ok"] and b["ok"]]
        cells = [" / ".join(f"{x / ref:.1%}" if x else "-" for x in sb), str(len(both))]
        if both:
            med = lambda key, i: statistics.median(p[i][key] for p in both)  # noqa: E731
            searched = [p for p in both if p[0].get("eviction_searches") and p[1].get("eviction_searches")]
            lat = " / ".join(f"{1e3 * statistics.median(p[i]['search_seconds_median'] for p in searched):.2f} ms"
                             for i in (0, 1)) if searched else "-"
            failed = [p for p in both if p[0].get("alloc_failures") and p[1].get("alloc_failures")]
            rate = " / ".join(f"{statistics.median(p[i]['free_at_failure'] for p in failed):.1%}"
                              for i in (0, 1)) if failed else "-"
            cells += [rate, f"{med('pool_fragmentation', 0):.1%} / {med('pool_fragmentation', 1):.1%}",
                      f"{med('overhead', 0):+.1%} / {med('overhead', 1):+.1%}",
                      f"{med('eviction_searches', 0):.0f} / {med('eviction_searches', 1):.0f}", lat]
        else:
            cells += ["-"] * 5
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def table(results: dict[str, Any]) -> str:
    labels = list(VARIANTS)
    lines = summary(results) + ["Smallest budget each method meets (share of the no-remat peak; optimizer state "
                                "not counted). "
                                "dtr and chen do not run in a pool: in brackets, the least pool a best-fit arena needs "
                                "for their schedules over the sweep (optimizer state not counted):", "",
             "| model | nodes | " + " | ".join(labels) + " |", "| --- | --- |" + " --- |" * len(labels)]
    for name, e in results["models"].items():
        ref = e["no_remat_peak"]
        cells = []
        for k in labels:
            cell = f"{e['smallest_budget'][k] / ref:.1%}" if e["smallest_budget"][k] else "-"
            arena = [p["arena_reserved"] - e["adam_bytes"] for p in e["sweep"][k] if p["ok"] and "arena_reserved" in p]
            cells.append(cell + (f" ({min(arena) / ref:.1%})" if arena else ""))
        lines.append(f"| {name} | {e['nodes']} | " + " | ".join(cells) + " |")
    lines += ["", "At 80% and 60% of the no-remat peak: overhead; for pool methods the free share of the pool when "
              "a request found no block (Coop's and OneFlow's fragmentation rate; mean over the failures) and the pool "
              "fragmentation at its high-water mark (touched - held there, share of it); caching-allocator "
              "fragmentation of the same schedule (full arena); eviction "
              "searches and their median latency (shared machine, under load):", "",
              "| model | budget | method | overhead | free share at failed requests (count) | pool frag. "
              "| caching frag. | searches | median search |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in results["models"].items():
        for frac in (0.8, 0.6):
            for label in labels:
                r = at(e, label, frac)
                if not r["ok"]:
                    lines.append(f"| {name} | {frac:.0%} | {label} | does not fit | | | | | |")
                    continue
                pool = f"{r['pool_fragmentation']:.1%}" if "pool_fragmentation" in r else \
                    f"({r['arena_fragmentation']:.1%} best-fit replay)"
                search = f"{1e3 * r['search_seconds_median']:.2f} ms" if r.get("eviction_searches") else ""
                rate = f"{r['free_at_failure']:.1%} ({r['alloc_failures']})" if "alloc_failures" in r else ""
                lines.append(f"| {name} | {frac:.0%} | {label} | {r['overhead']:+.1%} | {rate} | {pool} | "
                             f"{r['caching_fragmentation']:.1%} | {r.get('eviction_searches', '')} | {search} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(3, len(models), figsize=(4.2 * len(models), 11), squeeze=False)
    for j, name in enumerate(models):
        e = results["models"][name]
        for label, pts in e["sweep"].items():
            ok = [p for p in pts if p["ok"]]
            fr = [p["frac"] for p in ok]
            axes[0][j].plot(fr, [100 * p["overhead"] for p in ok], marker="o", ms=3, label=label)
            if label in POOL:
                axes[1][j].plot(fr, [100 * p["pool_fragmentation"] for p in ok], marker="o", ms=3, label=label)
                searched = [p for p in ok if p.get("eviction_searches")]
                axes[2][j].plot([p["frac"] for p in searched], [1e3 * p["search_seconds_median"] for p in searched],
                                marker="o", ms=3, label=label)
        axes[0][j].set_title(f"{name} ({e['nodes']} nodes, peak {format_bytes(e['no_remat_peak'])})")
        axes[0][j].set_ylabel("recompute overhead (%)")
        axes[1][j].set_ylabel("pool fragmentation at its peak (%)")
        axes[2][j].set_ylabel("median eviction search (ms, shared machine)")
        for ax in axes[:, j]:
            ax.set_xlabel("budget / no-remat peak")
            ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/heuristics")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="zoo names (at their default sizes)")
    ap.add_argument("--size", choices=list(SIZES), default="default", help="zoo sizes (large: bigger batches)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    ap.add_argument("--report-only", action="store_true", help="rewrite table.md and the plot from results.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = json.loads((out / "results.json").read_text())
        (out / "table.md").write_text(table(results))
        plot(results, out / "heuristics.png")
        return
    results: dict[str, Any] = {"size": args.size, "sweep": list(SWEEP),
                               "variants": {k: [m, o] for k, (m, o) in VARIANTS.items()},
                               "models": {}}
    for name in args.models:
        results["models"][name] = bench_model(name, args.time_limit, SIZES[args.size].get(name, {}))
        (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table(results))
    plot(results, out / "heuristics.png")
    searches = [p["search_seconds_median"] for e in results["models"].values() for k in POOL
                for p in e["sweep"][k] if p["ok"] and p.get("eviction_searches")]
    print(f"wrote {out}/results.json, table.md, heuristics.png; median search {statistics.median(searches):.2e} s"
          if searches else f"wrote {out}")


if __name__ == "__main__":
    main()
