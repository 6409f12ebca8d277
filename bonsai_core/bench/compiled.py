"""Compiled steps predicted against real ones: ``bonsai bench compiled --page docs/results/compiled.md``.

Four studies (``--parts`` reruns some and keeps the others' results): ``cpu``, models compiled with inductor
on this CPU and measured at the allocator against the compiled trace, with no checkpointing, their users'
and the one call's plan; ``peers``, bonsai against torch's memory budget at the same measured memory;
``titan``, torchtitan's Llama 3.1 8B recipe eager and compiled against its published table (``--float8``:
also its Float8 rows); ``titan-peers``, that step compiled, its checkpointings against bonsai's plan.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from bonsai_core import rank_memory
from bonsai_core.allocator import bounded_replay
from bonsai_core.bench import common
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph
from bonsai_core.optimizer import with_training_loop
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import solve

PARTS = ("cpu", "peers", "titan", "titan-peers")
TITAN = "torchtitan:llama3:debugmodel"
CPU_MODELS = [("gpt", {}), ("hf:llama", {}), ("hf:gpt2", {}), ("resnet", {}), ("hf:resnet", {}),
              (TITAN, {"layers": 2, "seq": 512, "batch": 2})]
PLAN_SHARE = "80%"
PEER_MODELS = [("gpt", {}), ("hf:llama", {})]
PEER_BUDGETS = (0.8, 0.5, 0.2, 0.0)
# torchtitan's table (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3): 8B, batch 2, seq 8192,
# selective AC, FSDP; GiB per GPU by (ranks, compiled, float8)
PUBLISHED = {(8, False, False): 82.4, (8, True, False): 77.0, (8, True, True): 76.8,
             (128, False, False): 67.0, (128, True, False): 62.0, (128, True, True): 61.8}
TITAN_MODEL = "torchtitan:llama3:8B"
TITAN_8B = {"batch": 2, "seq": 8192}
TITAN_PEERS = ("torchtitan-selective-2024-12", "budget:0.5", "budget:0.2")  # the 8B step's checkpointings
SOURCES = ["bonsai_core/bench/compiled.py", common.template_source("compiled")]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common.add_page_arguments(ap, "docs/bench/compiled", "docs/results/compiled.md")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="the studies to run (default all)")
    ap.add_argument("--float8", action="store_true",
                    help="titan: also the Float8 rows (torchtitan's Float8 linears; under a minute each)")


# -- measuring ------------------------------------------------------------------------------------

def _mode(spec: str) -> str:
    return "blocks" if spec.startswith("torchtitan:") else "model"


def _compiled_graph(spec: str, options: dict[str, Any], checkpointing: str | None = None) -> Any:
    """The step compiled on this CPU, as measured here: the CPU's partitioner choices (``kernels="cpu"``)."""
    from bonsai_core.trace import trace_model

    return trace_model(spec, compile=_mode(spec), ac=checkpointing, kernels="cpu", **options).graph


def cpu_row(spec: str, options: dict[str, Any], variant: str) -> dict[str, Any]:
    """One model under one variant (``none``, a checkpointing, ``bonsai``): predicted and measured."""
    import bonsai_core as bonsai
    from bonsai_core import models
    from bonsai_core.measure import measure_compiled
    from bonsai_core.trace import trace_model

    row: dict[str, Any] = {"model": spec, "options": options, "variant": variant}
    start = time.perf_counter()
    if variant == "bonsai":
        model, inputs, loss_fn = models.build(spec, **options)
        try:
            made = bonsai.plan(model, inputs, loss_fn, budget=PLAN_SHARE, compile=_mode(spec), cache=False,
                               device="cpu")
        except BonsaiError as e:  # a budget the plans cannot meet under compile is a result
            return {**row, "error": str(e), "seconds": time.perf_counter() - start}
        measured = measure_compiled(spec, options, _mode(spec), save=made.save)
        row.update(predicted=made.report.predicted_peak - made.report.fixed_memory, budget=made.report.budget,
                   fixed=made.report.fixed_memory, regions=len(made.report.regions), overhead=made.report.overhead)
    else:
        checkpointing = None if variant == "none" else variant
        graph = _compiled_graph(spec, options, checkpointing)
        measured = measure_compiled(spec, options, _mode(spec), checkpointing=checkpointing)
        row.update(predicted=no_remat_peak(graph) - graph.fixed_mem, fixed=graph.fixed_mem, nodes=graph.n)
        if variant == "none":
            eager = trace_model(spec, kernels="cpu", **options).graph
            row["eager_predicted"] = no_remat_peak(eager) - eager.fixed_mem
    row.update(measured=measured.transient, seconds=time.perf_counter() - start)
    return row


def peer_rows(spec: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """torch's memory budget at PEER_BUDGETS and bonsai's plan at the peak each measured, under compile."""
    import bonsai_core as bonsai
    from bonsai_core import models
    from bonsai_core.measure import measure_compiled

    plain = _compiled_graph(spec, options)
    rows = []
    for share in PEER_BUDGETS:
        graph = _compiled_graph(spec, options, f"budget:{share}")
        measured = measure_compiled(spec, options, _mode(spec), checkpointing=f"budget:{share}")
        peak = measured.transient + graph.fixed_mem
        row: dict[str, Any] = {"model": spec, "budget": share, "torch_peak": peak,
                               "torch_predicted": no_remat_peak(graph),
                               "torch_overhead": graph.total_cost / plain.total_cost - 1}
        model, inputs, loss_fn = models.build(spec, **options)
        try:
            made = bonsai.plan(model, inputs, loss_fn, budget=peak, compile=_mode(spec), cache=False, device="cpu")
        except BonsaiError as e:
            row["bonsai_error"] = str(e).split(";")[0]
        else:
            row.update(bonsai_predicted=made.report.predicted_peak, bonsai_overhead=made.report.overhead,
                       bonsai_peak=measure_compiled(spec, options, _mode(spec), save=made.save).transient
                       + made.report.fixed_memory)
        rows.append(row)
    return rows


def _titan_step(world: int, **options: Any) -> Graph:
    """The 8B recipe's step on one of ``world`` ranks (AdamW), traced with ``options``."""
    from bonsai_core.trace import trace_model

    graph = trace_model(TITAN_MODEL, fsdp=world, reshard_after_forward="all-but-last", **TITAN_8B, **options).graph
    return with_training_loop(graph, TITAN_MODEL, "adamw")


def titan_rows(float8: bool) -> list[dict[str, Any]]:
    """The 8B recipe eager (the torchtitan-selective method, release 2024-12) and compiled (torchtitan's own
    apply_ac of December 2024's save list), at 8 and 128 ranks: peaks and where they come from."""
    rows = []
    for world in (8, 128):
        for compiled, f8 in ((False, False), (True, False), *(((True, True),) if float8 else ())):
            start = time.perf_counter()
            if compiled:
                graph = _titan_step(world, compile="blocks", ac="torchtitan-selective-2024-12", float8=f8)
                schedule = solve(graph, 2**60, "none")
            else:
                graph = _titan_step(world)
                schedule = solve(graph, 2**60, "torchtitan-selective", release="2024-12")
            parts = peak_parts(graph, schedule)
            rows.append({"world": world, "compiled": compiled, "float8": f8, "nodes": graph.n,
                         "published_gib": PUBLISHED[world, compiled, f8], "parts": parts,
                         "seconds": time.perf_counter() - start})
            print(rows[-1], flush=True)
    return rows


def titan_peer_rows(world: int = 8) -> list[dict[str, Any]]:
    """The 8B recipe compiled on one of ``world`` ranks (AdamW): each of TITAN_PEERS' checkpointings traced
    compiled, then bonsai's plan for the torchtitan model built on the meta device (``plan_for``, compiled
    blocks) with that checkpointing's predicted peak as its budget; overheads over the compiled step
    without checkpointing, both from the compiled graphs' compute."""
    import torch
    from torchtitan.models.llama3 import Transformer

    from bonsai_core.models.torchtitan import model_args
    from bonsai_core.torchtitan import plan_for

    plain = _titan_step(world, compile="blocks")
    rows = []
    for checkpointing in TITAN_PEERS:
        start = time.perf_counter()
        graph = _titan_step(world, compile="blocks", ac=checkpointing)
        row: dict[str, Any] = {"world": world, "checkpointing": checkpointing, "peak": no_remat_peak(graph),
                               "overhead": graph.total_cost / plain.total_cost - 1, "plain_peak": no_remat_peak(plain)}
        with torch.device("meta"):
            model = Transformer(model_args("llama3:8B", seq=TITAN_8B["seq"])).train()
        try:
            made = plan_for(model, TITAN_8B["batch"], TITAN_8B["seq"], row["peak"], compile="blocks", cache=False,
                            fsdp=world, reshard_after_forward="all-but-last")
        except BonsaiError as e:  # a peak the plans cannot meet under compile is a result
            row["bonsai_error"] = str(e).split(";")[0]
        else:
            row.update(bonsai_peak=made.report.predicted_peak, bonsai_overhead=made.report.overhead,
                       bonsai_regions=len(made.report.regions))
        rows.append({**row, "seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    return rows


def measure(parts: list[str], float8: bool, out: str) -> dict[str, Any]:
    """The studies ``parts`` names, run now; the others' results kept from ``out``/results.json, each
    part with the run that measured it (``runs``)."""
    start = time.perf_counter()
    meta = common.run_meta(parts=parts)
    stored = Path(out) / "results.json"
    kept = json.loads(stored.read_text()) if set(parts) != set(PARTS) and stored.is_file() else {}
    results: dict[str, Any] = {**kept, "meta": meta}
    if "cpu" in parts:
        results["cpu"] = []
        for spec, options in CPU_MODELS:
            checkpointing = "torchtitan-selective" if spec.startswith("torchtitan:") else "budget:0.5"
            for variant in ("none", checkpointing, "bonsai"):
                results["cpu"].append(cpu_row(spec, options, variant))
                print(results["cpu"][-1], flush=True)
    if "peers" in parts:
        results["peers"] = [row for spec, options in PEER_MODELS for row in peer_rows(spec, options)]
    if "titan" in parts:
        results["titan"] = titan_rows(float8)
    if "titan-peers" in parts:
        results["titan_peers"] = titan_peer_rows()
    meta["seconds"] = time.perf_counter() - start
    run = {k: meta[k] for k in ("command", "date", "seconds")}
    results["runs"] = {**kept.get("runs", {}), **{part: run for part in parts}}
    return results


# -- the page -------------------------------------------------------------------------------------

GIB = 2**30


def _smallest(error: str) -> str:
    """The smallest peak a BudgetError names, as it names it."""
    found = re.search(r"realise is ([0-9.]+ [KMG]iB)", error)
    return found.group(1) if found else "not named"


def _worst(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The CPU row whose prediction is furthest from its measurement."""
    return max(rows, key=lambda r: abs(r["predicted"] / r["measured"] - 1))


def _failure(error: str) -> str:
    """The plan call's error in a table cell: dynamo's recompile limit by its cause, else its first words."""
    if "FailOnRecompileLimitHit" in error:
        limit = re.search(r"recompile_limit \((\d+)\)", error)
        return ("no plan: a plan searched held more distinct block plans than dynamo's recompile_limit"
                f"{f' ({limit[1]})' if limit else ''} compiles under fullgraph=True (FailOnRecompileLimitHit)")
    return "no plan: " + error.split(". ")[0]


def page(results: dict[str, Any], header: str) -> str:
    studies = {"cpu": None, "peers": None, "titan": None, "titan_peers": None, "runs": {}, **results}
    return common.fill("compiled", header=header, **studies, share=PLAN_SHARE, worst=_worst, smallest=_smallest,
                       failure=_failure, gib=GIB)


def main(args: argparse.Namespace) -> int:
    refusal = common.page_refusal(args, "docs/bench/compiled", "docs/results/compiled.md")
    return common.run_page_suite("compiled", args, refusal, lambda: measure(args.parts, args.float8, args.out),
                                 common.page_writer(page, SOURCES))


def peak_parts(graph: Graph, schedule: Any, policy: str = "expandable") -> dict[str, Any]:
    """Where a schedule's peak on a rank comes from, in bytes: what holds its live peak
    (:func:`bonsai_core.rank_memory.at_peak`) as the page names it, ``fixed: KIND``, the saved forward tensors,
    the backward tensors (transients), FSDP2's buffers (rule 7; on a pipeline rank the other microbatches in
    flight), the optimizer step where it holds the peak; then the live peak, the allocator model's reserved peak
    under ``policy`` and its extra, and the peak op's name."""
    sim = simulate(graph, schedule)
    held = rank_memory.at_peak(graph, schedule.ops, sim)
    parts: dict[str, Any] = {f"fixed: {kind}": nbytes for kind, nbytes in held.fixed.items()}
    parts["saved forward tensors"] = held.forward
    parts["backward tensors (transients)"] = held.backward
    beyond = rank_memory.IN_FLIGHT if rank_memory.IN_FLIGHT in held.working else "FSDP buffers"
    parts[beyond] = sum(held.working.values())
    if held.optimizer_step:
        parts["optimizer step"] = held.optimizer_step
    parts["live peak"] = sim.peak
    reserved = bounded_replay(graph, schedule, policy).reserved_peak
    parts[f"reserved peak ({policy})"] = reserved
    parts["allocator's extra"] = reserved - sim.peak
    parts["peak op"] = f"{sim.peak_op}: {graph.names[schedule.ops[sim.peak_op][1]]}"
    return parts
