"""Keep / recompute / offload on one traced step: each method with and without offload (simulator rule 9)
at shares of the no-remat peak. The numbers in docs/results/offload.md (zoo GPT) come from

    PYTHONPATH=. python scripts/offload_study.py gpt --budgets 80 60 50 45 40

Every schedule is validated by the simulator (``solvers.solve``); a method that fails says why.
"""

from __future__ import annotations

import argparse
import time

from bonsai_core.errors import BonsaiError
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import solve
from bonsai_core.trace import trace_model
from bonsai_core.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a zoo name, hf:..., or package.module:factory")
    parser.add_argument("--budgets", type=float, nargs="+", default=[80, 60, 50, 45, 40], help="% of the no-remat peak")
    parser.add_argument("--methods", nargs="+", default=["bonsai", "dtr", "coop"])
    parser.add_argument("--time-limit", type=float, default=120)
    args = parser.parse_args()
    graph = trace_model(args.model).graph
    peak = no_remat_peak(graph)
    print(f"{graph.name}: {graph.n} nodes, no-remat peak {format_bytes(peak)}")
    print("| budget | method | offload | overhead | peak | offloaded | stall | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for share in args.budgets:
        budget = int(share / 100 * peak)
        for method in args.methods:
            for offload in (False, True):
                options = {"time_limit": args.time_limit} if method == "bonsai" else {"budget_hint": False}
                start = time.perf_counter()
                try:
                    sim = simulate(graph, solve(graph, budget, method=method, offload=offload, **options))
                    row = (f"{sim.overhead:+.2%} | {sim.peak / peak:.1%} | {format_bytes(sim.offloaded_bytes)} | "
                           f"{sim.stall * 1e3:.3f} ms")
                except BonsaiError as e:
                    row = f"{type(e).__name__} | | | "
                print(f"| {share:g}% | {method} | {offload} | {row} | {time.perf_counter() - start:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
