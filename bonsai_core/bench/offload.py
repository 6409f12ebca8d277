"""Keep, recompute or offload (simulator rule 9) on the zoo GPT: each method with and without offload at
shares of the no-remat peak, then bonsai's offloading plan at one budget exported (replay back-end) and run
on the CPU against its prediction; ``--out``/results.json and, with ``--page``, docs/results/offload.md."""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from typing import Any

from bonsai_core.bench import common
from bonsai_core.errors import BonsaiError
from bonsai_core.schedule import no_remat_peak, simulated
from bonsai_core.solvers import solve

MODEL = "gpt"  # the zoo GPT at its default size (the explorer's model)
SHARES = (0.8, 0.6, 0.5, 0.45, 0.4)
METHODS = ("bonsai", "dtr", "coop")
EXPORT_SHARE = 0.6
SOURCES = ["bonsai_core/bench/offload.py", common.template_source("offload")]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common.add_page_arguments(ap, "docs/bench/offload", "docs/results/offload.md")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per bonsai solve")


# -- measuring ------------------------------------------------------------------------------------

def method_rows(graph: Any, time_limit: float) -> list[dict[str, Any]]:
    """Every method of METHODS with and without offload at every share of SHARES, through
    ``solvers.solve`` (so the simulator validated each schedule); a refusal is recorded as its error."""
    peak, rows = no_remat_peak(graph), []
    for share, method, offload in itertools.product(SHARES, METHODS, (False, True)):
        options = {"time_limit": time_limit} if method == "bonsai" else {"budget_hint": False}
        row: dict[str, Any] = {"share": share, "method": method, "offload": offload}
        start = time.perf_counter()
        try:
            sim = simulated(graph, solve(graph, int(share * peak), method, offload=offload, **options))
            row.update(overhead=sim.overhead, peak=sim.peak, offloaded_bytes=sim.offloaded_bytes, stall=sim.stall)
        except BonsaiError as e:
            row["error"] = type(e).__name__
        row["seconds"] = time.perf_counter() - start
        rows.append(common.progress(row))
    return rows


def exported_plan(graph: Any, time_limit: float) -> dict[str, Any]:
    """bonsai's offloading plan at EXPORT_SHARE, exported with the replay back-end and verified on the CPU
    (``bonsai solve --option offload=true``, ``bonsai export``, ``bonsai verify``)."""
    from bonsai_core.export import export_model, verify_export

    schedule = solve(graph, int(EXPORT_SHARE * no_remat_peak(graph)), "bonsai", offload=True, time_limit=time_limit)
    sim = simulated(graph, schedule)
    with tempfile.TemporaryDirectory() as folder:
        export_model(MODEL, {}, schedule, folder)
        v = verify_export(MODEL, {}, folder).to_dict()
    return {"offloaded_tensors": len({node for kind, node in schedule.ops if kind == "offload"}),
            "offloaded_bytes": sim.offloaded_bytes, "overhead": sim.overhead, "stall": sim.stall,
            "host_peak": sim.host_peak, **{k: v[k] for k in ("loss_diff", "max_grad_diff", "predicted_peak",
                                                                 "measured_peak", "measured_host_peak")}}


def measure(time_limit: float) -> dict[str, Any]:
    start = time.perf_counter()
    graph = common.graph_of(MODEL)
    results = {"meta": common.run_meta(time_limit=time_limit),
               "graph": {"name": MODEL, "nodes": graph.n, "no_remat_peak": no_remat_peak(graph)},
               "rows": method_rows(graph, time_limit), "export": exported_plan(graph, time_limit)}
    results["meta"]["seconds"] = time.perf_counter() - start
    return results


# -- the page -------------------------------------------------------------------------------------

def method_values(results: dict[str, Any], method: str) -> dict[str, Any]:
    """``method``'s overheads with offload against without, budget by budget (:func:`common.compare`), and
    the stalls of its plans that offload."""
    by = {(r["share"], r["offload"]): r for r in results["rows"] if r["method"] == method}
    ps = [(share, by[share, False], by[share, True]) for share, offload in by if offload]  # in the order of the run
    overhead = {key: None if "error" in r else r["overhead"] for key, r in by.items()}
    return {"name": method, "c": common.compare((s, overhead[s, True], overhead[s, False]) for s, _, _ in ps),
            "stalls": [on["stall"] for _, _, on in ps if "error" not in on and on["offloaded_bytes"]]}


def page(results: dict[str, Any], header: str) -> str:
    return common.fill("offload", header=header, meta=results["meta"], g=results["graph"], rows=results["rows"],
                       methods=[method_values(results, m) for m in METHODS], export_share=EXPORT_SHARE,
                       e=results["export"])


def main(args: argparse.Namespace) -> int:
    return common.run_page_suite("offload", args, common.page_refusal(args), lambda: measure(args.time_limit),
                                 common.page_writer(page, SOURCES))
