"""torchtitan's published Llama 3.1 memory table (``benchmarks/llama3_h100_202412_torchtitan.md``, tables 2, 4,
5 and 6) predicted per rank: each row's rank traced on the fake process group, eager with torchtitan's full
activation checkpointing, bf16 FSDP mixed precision, AdamW and the gradients set to None between steps; its live
peak, what holds it and the allocator's reserved peak (expandable segments). A row without pipeline and context
parallel is predicted compiled too, with Float8 linears, as the published runs were.

    bonsai bench published [--rows 2 4 5 6] [--page docs/results/published_rows.md] [--out DIR] [--report-only]

``--rows`` reruns those tables and keeps the stored results of the others (``--out``'s results.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bonsai_core import rank_memory
from bonsai_core.allocator import bounded_replay
from bonsai_core.bench.common import (add_page_arguments, fill, page_header, page_refusal, results_file,
                                      run_page_suite, template_source)
from bonsai_core.parallel import layout_of
from bonsai_core.schedule import simulate
from bonsai_core.solvers import solve

OUT = "docs/bench/published"
SOURCES = ["bonsai_core/bench/published.py", template_source("published_rows")]
PAGE = "docs/results/published_rows.md"
GIB = 2**30
# (table, label, model flavour, layout degrees, local batch, seq, published GiB, what the published run had on top)
ROWS = [
    ("2", "8B, FSDP 8 CP 1, seq 32k", "8B", dict(fsdp=8), 1, 32768, 83.9, "compile, Float8"),
    ("2", "8B, FSDP 4 CP 2, seq 64k", "8B", dict(fsdp=4, cp=2), 1, 65536, 84.2, "compile, Float8"),
    ("2", "8B, FSDP 2 CP 4, seq 128k", "8B", dict(fsdp=2, cp=4), 1, 131072, 84.0, "compile, Float8"),
    ("2", "8B, FSDP 1 CP 8, seq 256k", "8B", dict(fsdp=1, cp=8), 1, 262144, 84.5, "compile, Float8"),
    ("4", "70B, FSDP 32 x TP 8 (2D)", "70B", dict(fsdp=32, tp=8), 16, 8192, 71.9, "compile, Float8"),
    ("4", "70B, FSDP 32 x TP 8 (2D + AsyncTP)", "70B", dict(fsdp=32, tp=8), 16, 8192, 67.6,
     "compile, Float8, AsyncTP (refused: an Inductor pass; predicted without it)"),
    ("5", "405B, FSDP 8 x TP 8 x PP 8, 1F1B", "405B", dict(fsdp=8, tp=8, pp=8, microbatches=8), 32, 8192, 82.5,
     "compile, Float8, AsyncTP"),
    ("5", "405B, FSDP 8 x TP 8 x PP 8, interleaved 1F1B", "405B",
     dict(fsdp=8, tp=8, pp=8, microbatches=8, pp_schedule="interleaved-1f1b"), 32, 8192, 72.7,
     "compile, Float8, AsyncTP"),
    ("6", "405B, TP 8 x PP 8 x FSDP 8 CP 1, seq 32k", "405B", dict(fsdp=8, tp=8, pp=8, microbatches=8), 8, 32768,
     75.3, "compile, Float8, AsyncTP"),
    ("6", "405B, TP 8 x PP 8 x FSDP 4 CP 2, seq 64k", "405B", dict(fsdp=4, cp=2, tp=8, pp=8, microbatches=8), 8,
     65536, 75.9, "compile, Float8, AsyncTP"),
    ("6", "405B, TP 8 x PP 8 x FSDP 2 CP 4, seq 128k", "405B", dict(fsdp=2, cp=4, tp=8, pp=8, microbatches=8), 8,
     131072, 77.1, "compile, Float8, AsyncTP"),
    ("6", "405B, TP 8 x PP 8 x FSDP 1 CP 8, seq 256k", "405B", dict(fsdp=1, cp=8, tp=8, pp=8, microbatches=8), 8,
     262144, 84.9, "compile, Float8, AsyncTP"),
]


def predict_rank(graphs: Any, degrees: dict, batch: int) -> list[dict[str, Any]]:
    """A row's ranks (``fit.RankGraphs``) under torchtitan's full checkpointing: each one's live peak, what holds
    it, the reserved peak with expandable segments (a pipeline rank's over its whole schedule); without pipeline
    parallel also the live peak under torchtitan's selective checkpointing."""
    layout = layout_of(**degrees)
    start = time.perf_counter()
    ranks = graphs.ranks(layout, batch, "adamw")
    seconds = time.perf_counter() - start
    out = []
    for rank, graph in ranks:  # its gradients set to None between steps, as torchtitan's loop leaves them
        schedule = solve(graph, None, "torchtitan-full")
        sim = simulate(graph, schedule)
        row: dict[str, Any] = {"rank": rank, "nodes": graph.n, "trace_seconds": round(seconds, 1),
                               "live_peak": sim.peak, "breakdown": breakdown(graph, schedule.ops, sim),
                               "reserved_peak": bounded_replay(graph, schedule, "expandable").reserved_peak,
                               "peak_at": rank_memory.peak_at(graph, schedule.ops, sim),
                               "held": rank_memory.held_at_peak(graph, sim),
                               "after_peak": rank_memory.after_peak(graph, sim)}
        if "pp" not in degrees:
            row["selective_live_peak"] = simulate(graph, solve(graph, None, "torchtitan-selective")).peak
        out.append(row)
    return out


def compiled_refusal(degrees: dict) -> str | None:
    """Why a row's rank is not predicted compiled here, or None where it is (FSDP, with or without tensor
    parallel; no pipeline or context parallel)."""
    if degrees.get("pp", 1) > 1 or degrees.get("cp", 1) > 1:
        return "a compiled pipeline or context parallel rank is not traced (bonsai_core.rank.check_compiled_rank)"
    return None


def predict_compiled(model: str, degrees: dict, batch: int, seq: int) -> dict[str, Any]:
    """The row's rank traced whole as the published run compiled it (``bonsai trace MODEL [--tp N] --fsdp M
    --compile blocks --ac torchtitan-full --float8 --reshard-after-forward all-but-last``), AdamW: the live and
    reserved peak (expandable segments) with the gradients set to None between steps, and kept
    (``*_grads_kept``); ``grads``: the bytes keeping them adds to the fixed memory."""
    from bonsai_core.optimizer import with_training_loop
    from bonsai_core.rank import trace

    start = time.perf_counter()
    traced = trace(model, layout_of(**degrees), compile="blocks", ac="torchtitan-full", float8=True,
                   reshard_after_forward="all-but-last", batch=batch, seq=seq)
    out: dict[str, Any] = {"nodes": traced.graph.n, "trace_seconds": round(time.perf_counter() - start, 1)}
    for grads, suffix in ((None, ""), ("zeroed", "_grads_kept")):
        graph = with_training_loop(traced.graph, model, "adamw", grads)
        schedule = solve(graph, None, "none")
        out.update({f"live_peak{suffix}": simulate(graph, schedule).peak, f"fixed{suffix}": graph.fixed_mem,
                    f"reserved_peak{suffix}": bounded_replay(graph, schedule, "expandable").reserved_peak})
    out["grads"] = out["fixed_grads_kept"] - out["fixed"]
    return out


def breakdown(graph: Any, ops: list, sim: Any) -> dict[str, int]:
    """What holds the rank's bytes at its live peak (:func:`bonsai_core.rank_memory.at_peak`) as the page names
    the parts: the fixed tensors by kind, FSDP's working memory by part or the other microbatches in flight, the
    graph's tensors as one part (this microbatch's on a pipeline rank), or the optimizer step where it holds it."""
    held = rank_memory.at_peak(graph, ops, sim)
    parts = {f"fixed: {kind}": nbytes for kind, nbytes in held.fixed.items()}
    if held.optimizer_step:
        return {**parts, "optimizer step": held.optimizer_step}
    pipeline = rank_memory.IN_FLIGHT in held.working
    parts.update({f"{'pipeline' if pipeline else 'FSDP'}: {name}": nbytes for name, nbytes in held.working.items()})
    parts["this microbatch's tensors" if pipeline else "the step's tensors"] = held.forward + held.backward
    return parts


def measure(rows: list[str], stored: Path | None = None) -> dict[str, Any]:
    """The rows of the tables ``rows``, measured; the other tables' rows as ``stored`` (a results.json) has them."""
    from bonsai_core.fit import RankGraphs
    from bonsai_core.fsdp import Sharding

    kept = {}
    if stored is not None and stored.exists():
        kept = {row["row"]: row for row in json.loads(stored.read_text())["rows"] if row["table"] not in rows}
    out, shared, compiled = [], {}, {}
    for table, label, flavour, degrees, batch, seq, published, extra in ROWS:
        if table not in rows:
            if label in kept:
                out.append(dict(kept[label], compiled_refused=compiled_refusal(kept[label]["degrees"])))
            continue
        model = f"torchtitan:llama3:{flavour}"
        # the published run is torchtitan's of 2024-12-26, whose apply_fsdp kept the last block unsharded after
        # forward (under pipeline parallel nothing is resharded: torchtitan's units, as RankGraphs shards them)
        if (model, seq) not in shared:
            shared[(model, seq)] = RankGraphs(model, seq, {}, Sharding.of(2, "all-but-last", None, model=model), {})
        ranks = predict_rank(shared[(model, seq)], degrees, batch)
        row = {"table": table, "row": label, "flavour": flavour, "degrees": degrees, "batch": batch, "seq": seq,
               "layers": shared[(model, seq)]._n_layers(), "published_gib": published, "published_with": extra,
               "ranks": ranks, "compiled_refused": compiled_refusal(degrees)}
        if row["compiled_refused"] is None:
            key = (model, json.dumps(degrees, sort_keys=True), batch, seq)  # the AsyncTP row: the same rank
            if key not in compiled:
                compiled[key] = predict_compiled(model, degrees, batch, seq)
            row["compiled"] = compiled[key]
        out.append(row)
        print(label, [(r["rank"], round(r["live_peak"] / GIB, 2), round(r.get("reserved_peak", 0) / GIB, 2))
                      for r in ranks], row.get("compiled", {}), flush=True)
    return {"rows": out}


def write_page(results: dict[str, Any], page: str) -> None:
    Path(page).write_text(fill(
        "published_rows", header=page_header(f"bonsai bench published --page {page}", SOURCES), GIB=GIB,
        rows=[dict(row, parts=list(dict.fromkeys(k for r in row["ranks"] for k in r["breakdown"])))
              for row in results["rows"]]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", nargs="+", choices=("2", "4", "5", "6"), default=["2", "4", "5", "6"],
                        help="the tables whose rows to predict (default all)")
    add_page_arguments(parser, OUT, PAGE)


def main(args: argparse.Namespace) -> int:
    return run_page_suite("published", args, page_refusal(args, OUT, PAGE),
                          lambda: measure(args.rows, results_file(args)), write_page)
