"""Coop vs DTR vs Chen (and no remat, and the op-level ILPs when they exist) under one allocator model.

For each traced model and budget (a share of its no-remat peak) this runs every heuristic, validates
its schedule with the simulator, replays it through PyTorch's caching-allocator model, and records:
recompute overhead, live peak, reserved peak and fragmentation under the caching allocator, and for
the methods that run inside a pool of ``budget`` bytes (coop, dtr with ``allocator=True``) the pool's
high-water mark and the free share of the pool when a request found no block (OneFlow's
fragmentation rate). It also bisects the smallest budget each method runs at (the "memory saving"
claim), and sweeps budgets for the plot.

    python scripts/bench_heuristics.py --out docs/heuristics

writes ``results.json``, ``table.md`` and ``heuristics.png`` there. Numbers depend only on the
traced graphs and the cost model (the runs are deterministic).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bonsai_core.allocator import replay
from bonsai_core.budget import format_bytes
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import METHODS, solve
from bonsai_core.trace import trace_zoo
from bonsai_core.zoo import GPT2_SMALL

MODELS = {"default": {"gpt": {}, "resnet": {}, "unet": {}},
          "large": {"gpt": {"batch": 32}, "resnet": {"batch": 64}, "unet": {"batch": 16}},
          "gpt2": {"gpt": GPT2_SMALL}}
# label -> (method, options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chen": ("chen", {}),
    "dtr": ("dtr", {"budget_hint": False}),
    "dtr-pool": ("dtr", {"allocator": True, "budget_hint": False}),
    "coop": ("coop", {"budget_hint": False}),
    "coop-nopart": ("coop", {"partition": False, "budget_hint": False}),
}
ILP_METHODS = ("checkmate", "bonsai", "moccasin")


def run(graph: Graph, budget: int | None, method: str, options: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        s = solve(graph, budget, method, **options)
    except BonsaiError as e:
        return {"ok": False, "error": str(e).split(":")[0], "seconds": time.perf_counter() - start}
    r = replay(graph, s)
    # the pool a best-fit single-segment allocator needs for this schedule (no segment rounding)
    arena = replay(graph, s, capacity=graph.fixed_mem + 8 * max(1, s.stats["peak"]), policy="arena")
    keys = ("peak", "overhead", "recomputes", "evictions", "pool_high_water", "free_at_failure", "alloc_failures",
            "status", "plan")
    return {"ok": True, **{k: s.stats[k] for k in keys if k in s.stats}, "reserved_peak": r.reserved_peak,
            "fragmentation": r.fragmentation, "arena_reserved": arena.reserved_peak,
            "memory": s.budget if "pool_high_water" in s.stats else arena.reserved_peak,
            "seconds": time.perf_counter() - start}


def smallest_budget(graph: Graph, method: str, options: dict[str, Any], hi: int, steps: int = 12) -> int | None:
    """Bisection on the budget between the one-op lower bound and ``hi``. A heuristic's feasibility
    is not guaranteed monotone in the budget, so this is the threshold bisection lands on."""
    lo = graph.peak_lower_bound
    if not run(graph, hi, method, options)["ok"]:
        return None
    for _ in range(steps):
        mid = (lo + hi) // 2
        if run(graph, mid, method, options)["ok"]:
            hi = mid
        else:
            lo = mid
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/heuristics")
    ap.add_argument("--size", choices=list(MODELS), default="large")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.8, 0.65, 0.5])
    ap.add_argument("--sweep", type=int, default=21, help="budgets in the plot's sweep")
    ap.add_argument("--ilp-time-limit", type=float, default=60.0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ilps = [m for m in ILP_METHODS if m in METHODS]
    results: dict[str, Any] = {"size": args.size, "budgets": args.budgets, "ilp_methods": ilps, "models": {}}
    for name, opts in MODELS[args.size].items():
        g = trace_zoo(name, **opts).graph
        ref = no_remat_peak(g)
        none = run(g, None, "none", {})
        entry: dict[str, Any] = {"options": opts, "nodes": g.n, "no_remat_peak": ref, "fixed_mem": g.fixed_mem,
                                 "none": none, "budgets": {}, "smallest_budget": {}, "sweep": {}}
        print(f"{name} {opts}: {g.n} nodes, no-remat peak {format_bytes(ref)}, caching allocator reserves "
              f"{format_bytes(none['reserved_peak'])} (fragmentation {none['fragmentation']:.1%})", flush=True)
        for frac in args.budgets:
            budget = int(frac * ref)
            row = {label: run(g, budget, m, o) for label, (m, o) in VARIANTS.items()}
            for m in ilps:
                row[m] = run(g, budget, m, {"time_limit": args.ilp_time_limit})
            entry["budgets"][str(frac)] = row
            print(f"  {frac:.0%}: " + ", ".join(
                f"{k} {v['overhead']:+.1%}" if v["ok"] else f"{k} -" for k, v in row.items()), flush=True)
        for label, (m, o) in VARIANTS.items():
            entry["smallest_budget"][label] = smallest_budget(g, m, o, int(1.5 * ref))
        print("  smallest budget: " + ", ".join(
            f"{k} {v / ref:.1%}" if v else f"{k} -" for k, v in entry["smallest_budget"].items()), flush=True)
        fracs = np.linspace(0.3, 1.3, args.sweep)
        for label, (m, o) in VARIANTS.items():
            entry["sweep"][label] = [{"frac": float(f), **run(g, int(f * ref), m, o)} for f in fracs]
        results["models"][name] = entry
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table(results))
    plot(results, out / "heuristics.png")
    print(f"wrote {out}/results.json, table.md, heuristics.png")


POOL_METHODS = ("dtr-pool", "coop", "coop-nopart")


def least_memory(entry: dict[str, Any], label: str) -> tuple[float | None, float | None]:
    """The least memory a method needs, as a share of the no-remat peak: (pool / best-fit arena
    bytes, caching-allocator reserved bytes). For the pool methods the pool is the budget, so it is
    the bisected smallest budget (their caching replay is not what they run on: None)."""
    ref = entry["no_remat_peak"]
    if label in POOL_METHODS:
        b = entry["smallest_budget"][label]
        return (b / ref if b else None), None
    ok = [p for p in entry["sweep"][label] if p["ok"]]
    if not ok:
        return None, None
    return min(p["memory"] for p in ok) / ref, min(p["reserved_peak"] for p in ok) / ref


def table(results: dict[str, Any]) -> str:
    lines = ["| model | budget | method | overhead | live peak | memory needed | caching reserved peak "
             "| caching fragmentation | free share at alloc failure (failures) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in results["models"].items():
        ref = e["no_remat_peak"]
        n = e["none"]
        lines.append(f"| {name} | - | none | +0.0% | 100% | {n['memory'] / ref:.0%} | {n['reserved_peak'] / ref:.0%} | "
                     f"{n['fragmentation']:.1%} | |")
        for frac, row in e["budgets"].items():
            for label, r in row.items():
                if not r["ok"]:
                    lines.append(f"| {name} | {float(frac):.0%} | {label} | does not fit | | | | | |")
                    continue
                free = f"{r['free_at_failure']:.1%} ({r['alloc_failures']})" if "free_at_failure" in r else ""
                lines.append(f"| {name} | {float(frac):.0%} | {label} | {r['overhead']:+.1%} | {r['peak'] / ref:.0%} | "
                             f"{r['memory'] / ref:.0%} | {r['reserved_peak'] / ref:.0%} | {r['fragmentation']:.1%} "
                             f"| {free} |")
    labels = ["none", *VARIANTS]
    lines += ["", "Least memory each method needs (share of the no-remat peak; pool methods: smallest pool by "
              "bisection; others: least best-fit-arena bytes over the sweep, and in brackets least caching-allocator "
              "reserved bytes):", "", "| model | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(labels)]
    for name, e in results["models"].items():
        cells = []
        for label in labels:
            if label == "none":
                ref = e["no_remat_peak"]
                cells.append(f"{e['none']['memory'] / ref:.1%} ({e['none']['reserved_peak'] / ref:.0%})")
                continue
            mem, caching = least_memory(e, label)
            cells.append("-" if mem is None else f"{mem:.1%}" + (f" ({caching:.0%})" if caching else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 9), squeeze=False)
    for j, name in enumerate(models):
        e = results["models"][name]
        ref = e["no_remat_peak"]
        for label, pts in e["sweep"].items():
            ok = [p for p in pts if p["ok"]]
            mem = [p["memory"] / ref for p in ok]
            axes[0][j].plot(mem, [100 * p["overhead"] for p in ok], marker="o", ms=3, label=label)
            axes[1][j].plot([p["frac"] for p in ok], [p["reserved_peak"] / ref for p in ok], marker="o", ms=3,
                            label=label)
        axes[0][j].axvline(e["none"]["memory"] / ref, color="grey", ls=":", label="none")
        axes[1][j].axhline(e["none"]["reserved_peak"] / ref, color="grey", ls=":", label="none")
        axes[1][j].plot([0.3, 1.3], [0.3, 1.3], color="black", lw=0.5, label="reserved = budget")
        axes[0][j].set_title(f"{name} ({e['nodes']} nodes, no-remat peak {format_bytes(ref)})")
        axes[0][j].set_xlabel("memory needed / no-remat peak (pool; best-fit arena replay for chen, dtr)")
        axes[0][j].set_ylabel("recompute overhead (%)")
        axes[1][j].set_xlabel("budget / no-remat peak")
        axes[1][j].set_ylabel("PyTorch caching allocator: reserved peak / no-remat peak")
        for ax in (axes[0][j], axes[1][j]):
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
