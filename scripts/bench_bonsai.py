"""Measure the bonsai segment ILP: build and solve time, size, overhead and gap on traced zoo graphs,
the effect of the granularity, and the live re-solve time after a budget change.

    PYTHONPATH=. python scripts/bench_bonsai.py -o bench-bonsai.json     # everything (many minutes)
    PYTHONPATH=. python scripts/bench_bonsai.py --models gpt:layers=1 --skip-granularity --skip-resolve

(``PYTHONPATH=.`` makes a worktree's ``bonsai_core`` win over an installed one.)

Every schedule goes through ``bonsai_core.solvers.solve`` (so the simulator validates it); budgets are
shares of the no-remat peak. Prints Markdown tables and writes the raw rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bonsai_core.errors import BonsaiError
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import bonsai as B
from bonsai_core.solvers import solve
from bonsai_core.trace import trace_zoo
from bonsai_core.zoo import GPT2_SMALL

DEFAULT_MODELS = ["gpt:layers=1", "gpt:layers=2", "resnet", "unet", "gpt2-small"]


def load(spec: str):
    """``name[:k=v,...]`` or ``gpt2-small`` -> (label, Graph)."""
    if spec == "gpt2-small":
        return spec, trace_zoo("gpt", **GPT2_SMALL).graph
    name, _, opts = spec.partition(":")
    options = {k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)}
    return spec, trace_zoo(name, **options).graph


def run(graph, budget: int | None, **options: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        s = solve(graph, budget, "bonsai", **options)
    except BonsaiError as e:
        return {"error": str(e), "wall_seconds": time.perf_counter() - start}
    st = s.stats
    return {k: st.get(k) for k in ("status", "gap", "variables", "constraints", "build_seconds", "solve_seconds",
                                   "candidates", "ilp_candidates", "segments", "recomputed_segments", "peak",
                                   "overhead", "cached", "granularity", "tightened_by")} | {
        "wall_seconds": time.perf_counter() - start}


def fmt(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--fractions", nargs="*", type=float, default=[0.9, 0.7, 0.5])
    ap.add_argument("--backends", nargs="*", default=["highs", "scip"])
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--granularity-model", default="gpt:layers=2")
    ap.add_argument("--granularities", nargs="*", type=int, default=[1, 5, 10, 21, 40, 80, 109])
    ap.add_argument("--resolve-model", default="gpt:layers=4")
    ap.add_argument("--skip-granularity", action="store_true")
    ap.add_argument("--skip-resolve", action="store_true")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []

    print("| model | nodes | fwd | budget | backend | cand. | ILP cand. | vars | cons | build s | solve s | status "
          "| gap | peak/plain | overhead |")
    print("|" + "---|" * 15)
    for spec in args.models:
        label, g = load(spec)
        plain = no_remat_peak(g)
        for backend in args.backends:
            B._cache.clear()  # each backend's first row pays the build
            for frac in args.fractions:
                r = run(g, int(plain * frac), backend=backend, time_limit=args.time_limit)
                r |= {"model": label, "nodes": g.n, "forward": int(g.is_forward.sum()), "fraction": frac,
                      "backend": backend, "plain_peak": plain}
                rows.append(r)
                if "error" in r:
                    print(f"| {label} | {g.n} | {r['forward']} | {frac:.0%} | {backend} | {r['error']} |")
                    continue
                print(f"| {label} | {g.n} | {r['forward']} | {frac:.0%} | {backend} | {r['candidates']} | "
                      f"{r['ilp_candidates']} | {r['variables']} | {r['constraints']} | "
                      f"{fmt(r['build_seconds'], '.2f')}{'' if not r['cached'] else ' (cached)'} | "
                      f"{fmt(r['solve_seconds'], '.2f')} | {r['status']} | {fmt(r['gap'], '.2g')} | "
                      f"{r['peak'] / plain:.3f} | {r['overhead']:.4f} |", flush=True)

    if not args.skip_granularity:
        label, g = load(args.granularity_model)
        plain = no_remat_peak(g)
        print(f"\nGranularity on {label} ({g.n} nodes), budget 70% of the no-remat peak, HiGHS:\n")
        print("| granularity | candidates | ILP cand. | vars | cons | build s | solve s | status | gap | "
              "peak/plain | overhead |")
        print("|" + "---|" * 11)
        for gran in args.granularities:
            B._cache.clear()
            r = run(g, int(plain * 0.7), granularity=gran, time_limit=args.time_limit)
            r |= {"model": label, "sweep": "granularity", "granularity_asked": gran, "fraction": 0.7}
            rows.append(r)
            if "error" in r:
                print(f"| {gran} | {r['error']} |")
                continue
            print(f"| {r['granularity']} | {r['candidates']} | {r['ilp_candidates']} | {r['variables']} | "
                  f"{r['constraints']} | {r['build_seconds']:.2f} | {r['solve_seconds']:.2f} | {r['status']} | "
                  f"{fmt(r['gap'], '.2g')} | {r['peak'] / plain:.3f} | {r['overhead']:.4f} |", flush=True)

    if not args.skip_resolve:
        label, g = load(args.resolve_model)
        plain = no_remat_peak(g)
        print(f"\nLive re-solve on {label} ({g.n} nodes): one build, then budget changes:\n")
        print("| backend | budget | cached | build s | solve s | wall s (solve + schedule + simulate) | "
              "overhead |")
        print("|" + "---|" * 7)
        for backend in args.backends:
            B._cache.clear()
            for frac in (0.9, 0.8, 0.7, 0.75, 0.85, 0.65):
                r = run(g, int(plain * frac), backend=backend, time_limit=args.time_limit)
                r |= {"model": label, "sweep": "resolve", "fraction": frac, "backend": backend}
                rows.append(r)
                if "error" in r:
                    print(f"| {backend} | {frac:.0%} | {r['error']} |")
                    continue
                print(f"| {backend} | {frac:.0%} | {r['cached']} | {r['build_seconds']:.2f} | "
                      f"{r['solve_seconds']:.2f} | {r['wall_seconds']:.2f} | {r['overhead']:.4f} |", flush=True)

    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
