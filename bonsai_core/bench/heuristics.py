"""Coop vs DTR in one pool, as Coop's paper compares them (Zhang et al., NeurIPS 2023): the smallest pool each
trains in, the overhead at equal pools and the fragmentation (``bonsai bench heuristics``).

    bonsai bench heuristics --out docs/heuristics --example   # about a minute here
    bonsai bench heuristics --page docs/results/heuristics.md [--report-only]  # and the page's studies: minutes

Every variant runs in one pool that also holds the parameters, gradients and Adam state (OneFlow's DTR
allocator); a run counts when its schedule, replayed in the pool, fits (``pool_replay``). Writes
``results.json``, ``table.md`` and ``coop_vs_dtr.html``/``.png`` to ``--out``; ``--example`` adds
``example.md`` (coop and dtr-pool on the zoo GPT at 60%, request by request); ``--page`` also runs the page's
other studies (DTR's heuristics, recomputable in-place, reserved budgets, Coop's two claims) and writes
docs/results/heuristics.md (templates/heuristics.md), every number and ranking computed from the results.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from bonsai_core.allocator import MIN_BLOCK, bounded_replay, fixed_tensors, optimizer_bytes, replay
from bonsai_core.bench import common
from bonsai_core.bench.common import median, pct
from bonsai_core.errors import BonsaiError, BudgetError
from bonsai_core.graph import Graph, load_graph
from bonsai_core.schedule import Schedule, no_remat_peak, simulate
from bonsai_core.solvers import solve, solve_reserved
from bonsai_core.solvers.pool import pool_replay

# (name, options): each network at its zoo default and a larger batch or sequence (hf models built from
# configs, no weights), and GPT-2 small's shape, the largest graph (read from the zoo when a run needs it)
GPT2_SMALL, GPT2_SMALL_LABEL = "GPT2_SMALL", "gpt GPT-2 small"
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
POOL_ARGS = {"allocator": True, "full_arena": True}
# label -> (method, options): coop with its defaults; DTR in the same full-arena pool with h_DTR, with
# union-find e* (what OneFlow's DTR baseline computes) and with the DTE score (the free range an eviction
# leaves, the paper's other baseline); and DTR counting live bytes, its schedule placed in the pool best fit
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "coop": ("coop", {}),
    "dtr-pool": ("dtr", POOL_ARGS),
    "dtr_eq-pool": ("dtr", {**POOL_ARGS, "heuristic": "dtr_eq"}),
    "dte-pool": ("dtr", {**POOL_ARGS, "heuristic": "dte"}),
    "dtr": ("dtr", {}),
}
POOL_VARIANTS = ("dtr-pool", "dtr_eq-pool", "dte-pool")  # DTR evicting inside the same pool as coop
FACTORS = (1.0, 1.2, 1.5)  # equal pools: multiples of coop's smallest pool
STEPS = 10
DEFAULT_OUT, RECORD_PAGE = "docs/heuristics", "docs/results/heuristics.md"
# the files that decide what the page says (tests/test_docs.py checks their hash against the page's)
SOURCES = ["bonsai_core/bench/heuristics.py", "tests/real_models.py", common.template_source("heuristics")]
FAIL_BAR = 20  # the figure draws "does not train in this pool" as a hatched bar this far below zero


def adam_bytes(graph: Graph) -> int:
    return optimizer_bytes(fixed_tensors(graph)) if graph.optimizer is None else 0


def run(graph: Graph, budget: int, label: str, time_limit: float, measure: bool = False,
        variants: dict[str, tuple[str, dict[str, Any]]] = VARIANTS) -> dict[str, Any]:
    """One solve of ``label`` (a key of ``variants``) under ``budget``: ok when its schedule fits the pool
    replayed (``dtr``'s placed best fit), its overhead and evictions; with ``measure`` its fragmentation in its
    own pool and under the caching allocator."""
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
        row.update(own_fragmentation=own.fragmentation, caching_fragmentation=replay(graph, s).fragmentation,
                   reserved_peak=own.reserved_peak, live_peak=own.peak,
                   free_at_failure=s.stats.get("free_at_failure", 0.0),
                   free_after_eviction=s.stats.get("free_after_eviction", 0.0))
    return row


def smallest_budget(graph: Graph, label: str, time_limit: float,
                    variants: dict[str, tuple[str, dict[str, Any]]] = VARIANTS) -> int | None:
    """The smallest budget ``label`` trains in, bisected between the lower bound and 1.5x the no-remat peak."""
    return common.bisect_budget(lambda budget: run(graph, budget, label, time_limit, variants=variants)["ok"],
                                graph.peak_lower_bound, int(1.5 * no_remat_peak(graph)), STEPS)


def label_of(name: str, options: dict[str, int]) -> str:
    from bonsai_core.models.zoo import GPT2_SMALL as shape

    if name == "gpt" and options == shape:
        return GPT2_SMALL_LABEL
    return name + "".join(f" --{k} {v}" for k, v in options.items())


def display(model: str) -> str:
    """A model's label as the page names it (ResNet-18 for tests.real_models:resnet18_bn)."""
    return model.replace("tests.real_models:resnet18_bn", "ResNet-18")


def bench_model(name: str, options: dict[str, int], time_limit: float) -> dict[str, Any]:
    """One graph: every variant's smallest pool, then each at FACTORS x coop's (measured)."""
    start = time.perf_counter()
    g = common.graph_of(name, **options)
    ref, adam = no_remat_peak(g), adam_bytes(g)
    entry: dict[str, Any] = {"model": name, "options": options, "nodes": g.n, "no_remat_peak": ref,
                             "fixed_mem": g.fixed_mem, "adam_bytes": adam, "trace_seconds": time.perf_counter() - start,
                             "smallest_budget": {label: smallest_budget(g, label, time_limit) for label in VARIANTS},
                             "equal_pools": {}, "bisection_step": (int(1.5 * ref) - g.peak_lower_bound) / 2**STEPS}
    coop = entry["smallest_budget"]["coop"]
    for f in FACTORS if coop is not None else ():
        budget = int(f * (coop + adam)) - adam
        entry["equal_pools"][str(f)] = {"budget": budget, **{label: run(g, budget, label, time_limit, measure=True)
                                                             for label in VARIANTS}}
    entry["seconds"] = time.perf_counter() - start
    pools = ", ".join(f"{k} {pool_cell(entry, k)}" for k in VARIANTS)
    print(f"{label_of(name, options)}: smallest pools (MiB) {pools}; {entry['seconds']:.0f} s", flush=True)
    return entry


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
    """What a run's event log (op, node, evicted per request that found no room) says: requests, those made
    while rebuilding an evicted tensor, bytes evicted per request's bytes, recomputations."""
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


def request_rows(graph: Graph, logs: dict[str, list], first: int, count: int = 4) -> list[dict[str, Any]]:
    """Requests ``first`` to ``first + count`` of each run: op, the node needing room and what was evicted."""
    names, mem = graph.names, graph.mem.tolist()
    return [{"request": i + 1, "method": k, "op": op, "node": names[v], "bytes": mem[v],
             "evicted": [[names[t], mem[t]] for t in evicted if mem[t] > 0]}
            for i in range(first, min(first + count, *(len(logs[k]) for k in EXAMPLE_METHODS)))
            for k in EXAMPLE_METHODS for op, v, evicted in [logs[k][i]]]


def most_recomputed(graph: Graph, schedule: Schedule, count: int = 6) -> list[dict[str, Any]]:
    """The ``count`` nodes the run spends most recomputing (recomputations x cost)."""
    rec, cost = recomputed(graph, schedule), graph.cost.tolist()
    return [{"node": graph.names[v], "op": graph.ops[v], "recomputations": rec[v], "cost": cost[v],
             "bytes": int(graph.mem[v])} for v in sorted(rec, key=lambda v: -rec[v] * cost[v])[:count]]


def example(time_limit: float, frac: float = EXAMPLE_FRAC) -> dict[str, Any]:
    """Coop and dtr-pool on the zoo GPT at ``frac`` of its no-remat peak, from their event logs: each run's
    requests, where they first differ, what each recomputes most, and SWEEP's overheads around that pool."""
    g = common.graph_of("gpt")
    budget = int(frac * no_remat_peak(g))
    runs = {k: solve(g, budget, VARIANTS[k][0], time_limit=time_limit, budget_hint=False, **VARIANTS[k][1])
            for k in EXAMPLE_METHODS}
    logs = {k: s.extra["evictions"] for k, s in runs.items()}
    a, b = (logs[k] for k in EXAMPLE_METHODS)  # the first request at which the logs differ (node or evictions)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x[1] != y[1] or x[2] != y[2]), None)
    sweep = {k: [common.overhead_or_none(g, int(f * no_remat_peak(g)), method, time_limit=time_limit, **options)
                 for f in SWEEP_FRACS] for k, (method, options) in SWEEP.items()}
    return {"model": "gpt", "nodes": g.n, "frac": frac, "budget": budget, "adam_bytes": adam_bytes(g),
            "runs": {k: run_summary(g, s) for k, s in runs.items()}, "first_divergence": first,
            "requests": [] if first is None else request_rows(g, logs, first),
            "most_recomputed": {k: most_recomputed(g, s) for k, s in runs.items()},
            "sweep_fracs": list(SWEEP_FRACS), "sweep": sweep}


# -- the page's other studies ---------------------------------------------------------------------

# DTR's heuristics, label -> (heuristic, deallocation), on the 2-layer zoo GPT and at the budgets where DTR
# thrashes on a 4-layer one
HEURISTICS: dict[str, tuple[str, str]] = {
    "dtr": ("dtr", "free"), "dtr_eq": ("dtr_eq", "free"), "local": ("local", "free"), "lru": ("lru", "free"),
    "size": ("size", "free"), "dtr + evict": ("dtr", "evict"), "dtr + banish": ("dtr", "banish")}
FREE_MODE = ("dtr", "dtr_eq", "local", "lru", "size")  # the heuristics, each with deallocation `free`
SMALL = {"graph": "assets/gpt-default.json", "fracs": (0.8, 0.6)}
LARGER = {"model": "gpt", "options": {"layers": 4, "width": 256, "seq": 256, "heads": 4, "vocab": 1024, "batch": 8},
          "fracs": (0.5, 0.4, 0.37)}
REGNET_SIZES = ({"batch": 32, "image": 224}, {"batch": 64, "image": 128})
RESERVED_MODEL = ("hf:llama", {"layers": 4, "width": 512, "seq": 512, "batch": 4, "vocab": 8192})
RESERVED_FRACS = (0.5, 0.7)
POLICIES = ("caching", "expandable")
UPDATES_MODELS = ("gpt", "resnet", "unet", "mlp", "vgg")


def copy_variants(option: str, in_place: str, copy: str) -> tuple[dict[str, tuple[str, dict]], dict[str, tuple]]:
    """Coop and dtr-pool each in place and with ``option`` off (copy on write): label -> (method, options), and
    method -> (its in-place label, its copy label)."""
    pairs = {k: (f"{k} {in_place}", f"{k} {copy}") for k in EXAMPLE_METHODS}
    variants = {label: (VARIANTS[k][0], {**VARIANTS[k][1], **({option: False} if label == b else {})})
                for k, (a, b) in pairs.items() for label in (a, b)}
    return variants, pairs


UPDATES, UPDATE_PAIRS = copy_variants("inplace_updates", "in place", "copy")  # the optimizer's updates between steps
WRITES, WRITE_PAIRS = copy_variants("inplace_writes", "writes in place", "copy-on-write")  # in-place ops' writes
# the models with in-place writes (the zoo and the other hf: models have none), two sizes each
WRITES_MODELS: list[tuple[str, dict[str, int]]] = [
    ("tests.real_models:resnet18_bn", {"batch": 64}), ("tests.real_models:resnet18_bn", {"batch": 128}),
    ("hf:resnet", {"batch": 64}), ("hf:resnet", {"batch": 128, "image": 64}),
]
CLAIM_MODELS = (("gpt", {"layers": 2}), ("hf:gpt2", {}))
CLAIM_FRACS = (0.6, 0.7, 0.8)


def studies(time_limit: float) -> dict[str, Any]:
    """Every measurement the page reports besides the Coop-vs-DTR study and its worked example."""
    return common.run_studies({
        "dtr_variants": dtr_variants,
        "updates": lambda: list(inplace_rows([(m, {}) for m in UPDATES_MODELS], UPDATES, time_limit)),
        "writes": lambda: list(inplace_rows(WRITES_MODELS, WRITES, time_limit)),
        "regnet": lambda: regnet_writes(time_limit),
        "reserved": lambda: reserved_budgets(time_limit),
        "claims": lambda: claims(time_limit)})


def dtr_overheads(graph: Graph, fracs: Sequence[float]) -> dict[str, list[float | None]]:
    """label of HEURISTICS -> DTR's overhead (live-byte budget) at each share of the no-remat peak."""
    return {label: [common.overhead_or_none(graph, int(frac * no_remat_peak(graph)), "dtr", heuristic=heuristic,
                                            deallocation=deallocation) for frac in fracs]
            for label, (heuristic, deallocation) in HEURISTICS.items()}


def dtr_variants() -> dict[str, Any]:
    """DTR's heuristics and deallocation modes on the SMALL and the LARGER graph."""
    small = load_graph(SMALL["graph"])
    larger = common.graph_of(LARGER["model"], **LARGER["options"])
    return {"small": {"nodes": small.n, "fracs": list(SMALL["fracs"]),
                      "overheads": dtr_overheads(small, SMALL["fracs"])},
            "larger": {"nodes": larger.n, "options": LARGER["options"], "fracs": list(LARGER["fracs"]),
                       "overheads": dtr_overheads(larger, LARGER["fracs"])}}


def dtr_table(part: dict[str, Any]) -> str:
    """A row per budget, a cell per heuristic and deallocation mode ("does not fit": no schedule)."""
    return common.table(["budget", *HEURISTICS], [[f"{frac:.0%}", *("does not fit" if o[i] is None else f"{o[i]:+.1%}"
                                                                for o in part["overheads"].values())]
                                              for i, frac in enumerate(part["fracs"])])


def inplace_rows(models: list[tuple[str, dict[str, int]]], variants: dict[str, tuple[str, dict]],
                 time_limit: float) -> Iterator[dict]:
    """A row per model and variant: the model's in-place ops, the smallest budget met (a share of the no-remat
    peak, None up to 1.5x) and the measured :func:`run` at 80%."""
    for name, options in models:
        g = common.graph_of(name, **options)
        ref = no_remat_peak(g)
        for variant in variants:
            smallest = smallest_budget(g, variant, time_limit, variants=variants)
            yield {"model": label_of(name, options), "inplace_ops": int((g.inplace_of >= 0).sum()),
                   "variant": variant, "smallest": smallest / ref if smallest else None,
                   "at80": run(g, int(0.8 * ref), variant, time_limit, measure=True, variants=variants)}


def claims(time_limit: float) -> list[dict[str, Any]]:
    """Coop's two claims at once: per model of CLAIM_MODELS and share of CLAIM_FRACS, coop and dtr-pool
    measured (:func:`run`) with their fullest moments; ``pool``: the arena's bytes (Adam state included)."""
    rows = []
    for name, options in CLAIM_MODELS:
        graph = common.graph_of(name, **options)
        for frac in CLAIM_FRACS:
            budget = int(frac * no_remat_peak(graph))
            pool = (budget + adam_bytes(graph)) // MIN_BLOCK * MIN_BLOCK
            row = {"model": display(label_of(name, options)), "frac": frac, "pool": pool}
            for label in EXAMPLE_METHODS:
                row[label] = run(graph, budget, label, time_limit, measure=True)
                if row[label]["ok"]:
                    row[label]["fullest"] = fullest_moment(graph, budget, label, time_limit, pool)
            if row["coop"]["ok"] and row["dtr-pool"]["ok"]:
                row["same_until"] = same_until(row["coop"]["fullest"], row["dtr-pool"]["fullest"])
            for label in EXAMPLE_METHODS:
                row[label].get("fullest", {}).pop("prefix", None)  # compared above; not worth storing
            rows.append(row)
    return rows


def fullest_moment(graph: Graph, budget: int, label: str, time_limit: float, pool: int) -> dict[str, Any]:
    """A run's fullest moment on the reserved plateau in its own pool (op index, of how many), the op that first
    reached the high-water mark, the pool's bytes not live then, its first request that found no room (op, node,
    bytes) and ``prefix``, the schedule up to that request (for :func:`same_until`)."""
    method, options = VARIANTS[label]
    s = solve(graph, budget, method, time_limit=time_limit, budget_hint=False, **options)
    r = pool_replay(graph, s, capacity=budget)
    top = int(np.argmax(r.reserved))
    i = top + int(np.argmax(np.where(r.reserved[top:] == r.reserved[top], r.live[top:], -1)))
    log = s.extra.get("evictions", [])
    first = {"op": log[0][0], "name": graph.names[log[0][1]], "bytes": int(graph.mem[log[0][1]])} if log else None
    return {"op": i, "ops": len(s.ops), "top_op": top, "top_name": graph.names[s.ops[top][1]],
            "free": pool - int(r.live[i]), "first_request": first,
            "prefix": [list(o) for o in s.ops[:first["op"]]] if first else None}


def same_until(coop: dict[str, Any], dtr: dict[str, Any]) -> int | None:
    """The op of both runs' first request that found no room, when it is the same node after the same
    schedule; else None."""
    a, b = coop["first_request"], dtr["first_request"]
    if a is None or b is None or a != b or coop["prefix"] != dtr["prefix"]:
        return None
    return a["op"]


def regnet_writes(time_limit: float) -> list[dict[str, Any]]:
    """The in-place writes study on transformers' RegNet-Y (``RegNetConfig(num_labels=10)``, written to a
    temporary folder) at REGNET_SIZES."""
    from transformers import RegNetConfig

    with tempfile.TemporaryDirectory() as folder:
        RegNetConfig(num_labels=10).save_pretrained(folder)
        rows = list(inplace_rows([(f"hf:{folder}", dict(size)) for size in REGNET_SIZES], WRITES, time_limit))
    return [{**row, "model": row["model"].replace(f"hf:{folder}", "RegNet-Y")} for row in rows]


def reserved_budgets(time_limit: float) -> dict[str, Any]:
    """bonsai on RESERVED_MODEL at RESERVED_FRACS: the live-budget schedule replayed through both allocator
    models, and ``solve_reserved`` with each (``bonsai solve --reserved``)."""
    g = common.graph_of(RESERVED_MODEL[0], **RESERVED_MODEL[1])
    ref = no_remat_peak(g)
    budgets = []
    for frac in RESERVED_FRACS:
        budget = int(frac * ref)
        plain = solve(g, budget, "bonsai", time_limit=time_limit)
        entry: dict[str, Any] = {
            "frac": frac, "budget": budget,
            "plain": {"overhead": plain.stats["overhead"], "live_peak": plain.stats["peak"],
                      "status": plain.stats["status"], "gap": plain.stats.get("gap"),
                      "reserved": {p: bounded_replay(g, plain, p).reserved_peak for p in POLICIES}},
            "reserved": {}}
        for policy in POLICIES:
            try:
                s = solve_reserved(g, budget, "bonsai", policy=policy, time_limit=time_limit)
                entry["reserved"][policy] = {"ok": True, "live_budget": s.stats["live_budget"],
                                             "live_peak": s.stats["peak"], "reserved_peak": s.stats["reserved_peak"],
                                             "overhead": s.stats["overhead"],
                                             "status": s.stats["status"], "gap": s.stats.get("gap")}
            except BudgetError as e:  # the lowest reserved peak it reached, from its words
                found = re.search(r"lowest reserved peak was [^(]*\((\d+) bytes\)", str(e))
                entry["reserved"][policy] = {"ok": False, "lowest_reserved": int(found[1]) if found else None}
        budgets.append(entry)
    return {"model": RESERVED_MODEL[0], "options": RESERVED_MODEL[1], "nodes": g.n, "no_remat_peak": ref,
            "budgets": budgets}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen model (results.json in ``--out`` after each), the worked example with ``--example`` or
    ``--page``, and with ``--page`` the page's other :func:`studies`."""
    from bonsai_core.models.zoo import GPT2_SMALL as shape

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: dict[str, Any] = {"meta": common.run_meta(seconds=0.0),
                               "variants": {k: [m, o] for k, (m, o) in VARIANTS.items()},
                               "factors": list(FACTORS), "models": {}}
    for name, options in MODEL_SIZES:
        options = dict(shape) if options == GPT2_SMALL else options
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


# -- the study's table, figure and example ----------------------------------------------------------

def pool_cell(e: dict[str, Any], label: str) -> str:
    """``label``'s smallest pool in MiB, one decimal, without the unit (the tables' headers name it)."""
    b = e["smallest_budget"][label]
    return common.mib(b + e["adam_bytes"], 1, "") if b else "-"


def ratio(e: dict[str, Any], label: str) -> float | None:
    b, c = e["smallest_budget"][label], e["smallest_budget"]["coop"]
    return (b + e["adam_bytes"]) / (c + e["adam_bytes"]) if b and c else None


def best_pool_ratio(e: dict[str, Any]) -> float | None:
    """The smallest pool of the best DTR-in-the-pool variant, over coop's (None when either trains in none)."""
    rs = [r for r in (ratio(e, k) for k in POOL_VARIANTS) if r is not None]
    return min(rs) if rs else None


def pool_order(e: dict[str, Any]) -> str | None:
    """Coop's smallest pool against the best DTR-in-the-pool variant's: "coop smaller", "same" (within one
    bisection step) or "coop larger"; None when either trains in none."""
    coop, others = e["smallest_budget"]["coop"], [e["smallest_budget"][k] for k in POOL_VARIANTS]
    others = [b for b in others if b]
    if not coop or not others:
        return None
    gap = min(others) - coop
    return "same" if abs(gap) <= e["bisection_step"] else "coop smaller" if gap > 0 else "coop larger"


def both_trained(results: dict[str, Any], factor: float) -> list[tuple[str, dict, dict]]:
    """(graph, coop's run, dtr-pool's run) at ``factor`` x coop's smallest pool, where both train."""
    pools = [(label, e["equal_pools"].get(str(factor))) for label, e in results["models"].items()]
    return [(label, p["coop"], p["dtr-pool"]) for label, p in pools if p and p["coop"]["ok"] and p["dtr-pool"]["ok"]]


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """How often and by how much coop's smallest pool is below the best DTR-in-the-pool variant's, and the
    overheads at equal pools where coop and dtr-pool both train."""
    entries = list(results["models"].values())
    best = [r for r in map(best_pool_ratio, entries) if r is not None]
    orders = [pool_order(e) for e in entries]
    out: dict[str, Any] = {"models": len(entries), "coop_smaller": orders.count("coop smaller"),
                           "coop_larger": orders.count("coop larger"),
                           "best_dtr_over_coop": [min(best), max(best)] if best else None,
                           "dtr_pool_over_coop": [r for r in (ratio(e, "dtr-pool") for e in entries) if r]}
    for f in FACTORS:
        rows = [e["equal_pools"][str(f)] for e in entries if str(f) in e["equal_pools"]]
        both = [(a, b) for _, a, b in both_trained(results, f)]
        compared = common.compare((None, a["overhead"], b["overhead"]) for a, b in both)
        out[str(f)] = {"both_run": len(both), "coop_lower": len(compared["lower"]),
                       "coop_higher": len(compared["higher"]),
                       "median_coop": median(a["overhead"] for a, _ in both),
                       "median_dtr_pool": median(b["overhead"] for _, b in both),
                       "dtr_pool_fails": sum(not p["dtr-pool"]["ok"] for p in rows if p["coop"]["ok"]),
                       "coop_fails": sum(not p["coop"]["ok"] for p in rows)}
    return out


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
            runs = [e["equal_pools"].get(str(f), {}).get(label) for e in entries]
            ys = [None if r is None else 100 * r["overhead"] if r["ok"] else -FAIL_BAR for r in runs]
            hatch = ["" if r is None or r["ok"] else "x" for r in runs]
            fig.add_trace(go.Bar(x=xs, y=ys, name=label, marker=dict(color=colours[label], pattern_shape=hatch),
                                 legendgroup=label, showlegend=False), row=2 + i, col=1)
    fig.update_layout(barmode="group", width=1400, height=1300, template="plotly_white",
                      title=f"Coop vs DTR in one pool ({results['meta']['date']}; {results['meta']['command']})",
                      legend=dict(orientation="h", y=1.04, x=0))
    fig.update_yaxes(title_text="pool / coop's", row=1, col=1)
    return fig


def write_png(fig, path: Path) -> None:
    """The figure as PNG, shot in headless Chromium, the browser the explorer's tests use (plotly's own PNG
    export needs kaleido, which the project does not install)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("no chromium: cannot write the PNG (the HTML is written)")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "figure.html"
        fig.write_html(page, include_plotlyjs=True, config={"staticPlot": True})
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--window-size={fig.layout.width},{fig.layout.height}", f"--screenshot={path}",
                        page.as_uri()], check=True, capture_output=True, timeout=120)


def write_beside(results: dict[str, Any], out: Path) -> None:
    """The headline into results.json, table.md, the figure; example.md when the results hold the example."""
    results["headline"] = headline(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(common.fill(
        "heuristics_table", meta=results["meta"], steps=STEPS, headline=results["headline"], factors=FACTORS,
        models=results["models"].values(), labels=list(VARIANTS), label_of=label_of, pool_cell=pool_cell,
        ratio=ratio, best_pool_ratio=best_pool_ratio, overhead_columns=[f"overhead {k}" for k in VARIANTS]))
    fig = figure(results)
    fig.write_html(out / "coop_vs_dtr.html", include_plotlyjs="cdn")
    write_png(fig, out / "coop_vs_dtr.png")
    if "example" in results:
        (out / "example.md").write_text(common.fill("heuristics_example", ex=results["example"]))


# -- the page: Coop against DTR in one pool ----------------------------------------------------------

def fragmentation_counts(results: dict[str, Any], key: str) -> list[tuple[float, int, int, float, float]]:
    """Per factor where both train: (factor, graphs where coop's fragmentation ``key`` is lower than
    dtr-pool's, graphs, coop's median, dtr-pool's median)."""
    return [(f, len(common.compare((g, c[key], d[key]) for g, c, d in both)["lower"]), len(both),
             median(c[key] for _, c, _ in both), median(d[key] for _, _, d in both))
            for f in FACTORS for both in [both_trained(results, f)] if both]


def extremes(overheads: dict[str, list[float | None]], labels: Sequence[str], i: int) -> tuple[list[str], list[str]]:
    """The labels with the lowest and with the highest overhead at budget ``i`` (those that fit)."""
    values = {k: overheads[k][i] for k in labels if overheads[k][i] is not None}
    if not values:
        return [], []
    low, high = min(values.values()), max(values.values())
    return ([k for k, v in values.items() if abs(v - low) < 1e-9],
            [k for k, v in values.items() if abs(v - high) < 1e-9])


def ranking(part: dict[str, Any], labels: Sequence[str]) -> list[tuple[float, list[str], list[str], float, float]]:
    """At each budget where some fit: (budget, the ``labels`` of the lowest overhead, of the highest, both)."""
    o = part["overheads"]
    return [(f, low, high, o[low[0]][i], o[high[0]][i]) for i, f in enumerate(part["fracs"])
            for low, high in [extremes(o, labels, i)] if low]


def dtr_variants_said(part: dict[str, Any]) -> dict[str, Any]:
    """What the 2-layer GPT's table says about the heuristics, eager eviction and banishing."""
    o, fracs = part["overheads"], part["fracs"]
    evict, free, banish = o["dtr + evict"], o["dtr"], o["dtr + banish"]
    budgets = range(len(fracs))
    return {"o": o, "fracs": fracs, "same": all(o["dtr"][i] == o["dtr_eq"][i] for i in budgets),
            "ranking": ranking(part, FREE_MODE), "lru": all("lru" in extremes(o, FREE_MODE, i)[1] for i in budgets),
            "ratios": all(None not in (evict[i], free[i]) and evict[i] > free[i] > 0 for i in budgets)
            and [evict[i] / free[i] for i in budgets],
            "banish_lowest": [i for i in budgets if "dtr + banish" in extremes(o, list(o), i)[0]],
            "banish_fails": [f for f, x in zip(fracs, banish) if x is None]}


def pool_comparison(results: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Graphs by :func:`pool_order`, smallest ratio first: (graph, best DTR in the pool / coop)."""
    out: dict[str, list[tuple[str, float]]] = {"coop smaller": [], "same": [], "coop larger": []}
    for label, e in results["models"].items():
        if (order := pool_order(e)) is not None:
            out[order].append((label, best_pool_ratio(e)))
    return {k: sorted(v, key=lambda x: x[1]) for k, v in out.items()}


def live_comparison(results: dict[str, Any]) -> list[tuple[str, float]]:
    """(graph, dtr's smallest pool / coop's), smallest first, where coop's is smaller than DTR counting live
    bytes by more than one bisection step."""
    return sorted(((label, ratio(e, "dtr")) for label, e in results["models"].items()
                   if (pools := e["smallest_budget"])["coop"] and pools["dtr"]
                   and pools["dtr"] - pools["coop"] > e["bisection_step"]), key=lambda x: x[1])


def not_monotone(results: dict[str, Any]) -> tuple[str, str, int, int] | None:
    """A variant training in a pool and not in a larger one, when the results hold one: (variant, graph, the
    pool, the larger pool)."""
    for label, e in results["models"].items():
        for k in VARIANTS:
            runs = [(p["budget"] + e["adam_bytes"], p[k]) for f in FACTORS if (p := e["equal_pools"].get(str(f)))]
            for i, (small, a) in enumerate(runs):
                if failed := [b for b, r in runs[i + 1:] if a["ok"] and not r["ok"]]:
                    return k, label, small, failed[0]
    return None


def equal_pools(results: dict[str, Any]) -> dict[str, Any]:
    """At each factor of coop's smallest pool, the headline counts and medians, the graphs where coop is dearer
    and those where neither recomputes; the factors where coop's is lower more often."""
    h = results["headline"]
    pools = [{**h[str(f)], "factor": f, "dearer": [(g, c["overhead"], d["overhead"]) for g, c, d in both
                                                   if c["overhead"] > d["overhead"] + 1e-9],
              "zero": sum(c["overhead"] == 0 == d["overhead"] for _, c, d in both)}
             for f in FACTORS for both in [both_trained(results, f)]]
    return {"pools": pools, "lower": [f for f in FACTORS if h[str(f)]["coop_lower"] > h[str(f)]["coop_higher"]]}


def sweep_values(ex: dict[str, Any]) -> dict[str, Any]:
    """The window's cost term against plain compute cost around the example's pool, and how much single
    budgets swing."""
    fracs, sw = ex["sweep_fracs"], ex["sweep"]
    plain, default = sw["coop window_cost=recompute"], sw["coop"]
    near = [j for j, f in enumerate(fracs) if abs(f - ex["frac"]) <= 0.05 + 1e-9]
    swing = {k: [sw[k][j] for j in near if sw[k][j] is not None] for k in EXAMPLE_METHODS}
    return {"fracs": fracs, "sw": sw, "plain": plain, "i": fracs.index(ex["frac"]), "near": near,
            "cheaper": sum(p is not None and d is not None and p < d for p, d in zip(plain, default)),
            "plain_fails": [f"{f:.0%}" for f, x in zip(fracs, plain) if x is None],
            "ranges": [f"{k}'s from {pct(min(v))} to {pct(max(v))}" for k, v in swing.items() if v]}


# -- recomputable in-place -------------------------------------------------------------------------

COMPARED = {"smallest": lambda row: row["smallest"],  # a variant's smallest budget met and its overhead at 80%
            "overhead": lambda row: row["at80"]["overhead"] if row["at80"]["ok"] else None}


def pair_split(models: dict[str, dict[str, dict]], pair: tuple[str, str], key: str) -> dict[str, list[str]]:
    """The models where ``COMPARED[key]`` of the in-place variant is lower than the copy's, higher, or equal."""
    value = COMPARED[key]
    compared = common.compare((display(m), value(vs[pair[0]]), value(vs[pair[1]])) for m, vs in models.items())
    return {k: [m for m, _ in compared[k]] for k in ("lower", "higher", "equal")}


def inplace_values(rows: list[dict[str, Any]], pairs: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """One in-place study: model -> variant -> row; per method :func:`pair_split` of the budgets and overheads
    and (in place or the copy, the models where only it trains at 80%); whether in place wins the budget on some
    model and the copy on another; the largest budget gap; evictions at 80% where both train; ops run in place."""
    models = common.cells(rows, lambda r: r["model"], by="variant")
    split = {method: [pair_split(models, pair, key) for key in COMPARED] for method, pair in pairs.items()}
    alone = {method: [(who, found) for who, k, other in (("in place", *pair), ("the copy", *pair[::-1]))
                      for found in [[display(m) for m, vs in models.items()
                                     if vs[k]["at80"]["ok"] and not vs[other]["at80"]["ok"]]] if found]
             for method, pair in pairs.items()}
    both = {method: [vs for vs in models.values() if vs[a]["at80"]["ok"] and vs[b]["at80"]["ok"]]
            for method, (a, b) in pairs.items()}
    return {"models": models, "pairs": pairs, "said": [(m, *split[m], alone[m]) for m in pairs],
            "mixed": any(all(split[m][0][k] for k in ("lower", "higher")) for m in pairs),
            "gap": max(((abs(vs[a]["smallest"] - vs[b]["smallest"]), display(m), method) for m, vs in models.items()
                        for method, (a, b) in pairs.items() if vs[a]["smallest"] and vs[b]["smallest"]), default=None),
            "evictions": [(method, sum(vs[a]["at80"]["evictions"] for vs in both[method]),
                           sum(vs[b]["at80"]["evictions"] for vs in both[method]), len(both[method]))
                          for method, (a, b) in pairs.items()],
            "ops": {display(r["model"]).split(" --")[0]: r["inplace_ops"] for r in rows}}


def regnet_values(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """RegNet-Y: the points the smallest budgets and the overheads move between the variants (far: the budgets
    five times more), and coop's fragmentation."""
    study = inplace_values(rows, WRITE_PAIRS)
    spans = {key: {m: 100 * (max(xs) - min(xs)) if xs else 0.0 for m, vs in study["models"].items()
                   for xs in [[x for x in map(COMPARED[key], vs.values()) if x is not None]]} for key in COMPARED}
    a, b = WRITE_PAIRS["coop"]
    return {**study, "budgets": spans["smallest"], "costs": spans["overhead"],
            "far": max(spans["smallest"].values()) > 5 * max(spans["overhead"].values()),
            "frag": [(m, vs[a]["at80"]["own_fragmentation"], vs[b]["at80"]["own_fragmentation"])
                     for m, vs in study["models"].items() if vs[a]["at80"]["ok"] and vs[b]["at80"]["ok"]]}


# -- budgeting reserved bytes ----------------------------------------------------------------------

def reserved_said(study: dict[str, Any]) -> dict[str, Any]:
    """The plain schedules replayed (the allocators over the budget), what budgeting reserved bytes costs, how
    close expandable segments stay to the live peak, and how the solves ended."""
    budgets = study["budgets"]
    slack = [r["reserved_peak"] - r["live_peak"] for b in budgets for k, r in b["reserved"].items()
             if r["ok"] and k == "expandable"] + [b["plain"]["reserved"]["expandable"] - b["plain"]["live_peak"]
                                                  for b in budgets]
    solves = [b["plain"] for b in budgets] + [r for b in budgets for r in b["reserved"].values() if r["ok"]]
    over_budget = [[k for k, v in b["plain"]["reserved"].items() if v > b["budget"]] for b in budgets]
    return {"budgets": list(zip(budgets, over_budget)), "slack": max(slack),
            "statuses": sorted({r["status"] for r in solves}),
            "gaps": [r["gap"] for r in solves if r.get("gap") is not None]}


# -- Coop's two claims --------------------------------------------------------------------------------

CLAIMS = {"overhead": "overhead", "own_fragmentation": "fragmentation in its own pool",
          "free_after_eviction": "free share of the pool once each eviction search has made room (the paper's rate)",
          "caching_fragmentation": "fragmentation replayed in PyTorch's caching allocator"}


def claims_verdict(rows: list[dict[str, Any]], key: str) -> tuple[list[str], list[str]]:
    """(cells where coop's ``key`` is below dtr-pool's or dtr-pool does not train, the others)."""
    ahead, not_ahead = [], []
    for row in rows:
        coop, dtr = row["coop"], row["dtr-pool"]
        won = coop["ok"] and (not dtr["ok"] or coop[key] < dtr[key])
        (ahead if won else not_ahead).append(f"{row['model']} at {row['frac']:.0%}")
    return ahead, not_ahead


def explained_by_first_request(row: dict[str, Any]) -> bool:
    """Whether coop's fullest moment is right before its first request that found no room, that request larger
    than the pool's bytes not live then (no placement could serve it), both runs the same schedule up to it."""
    coop = row["coop"].get("fullest") or {}  # none kept where both runs tie
    first = coop.get("first_request")
    return not (first is None or row.get("same_until") != first["op"] or coop["op"] != first["op"] - 1
                or coop["free"] >= first["bytes"])


def claims_values(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Coop's two claims (less recomputation and less fragmentation than DTR in the same pool): the table, where
    each holds (``whole_pool``: fragmentation against the whole pool OneFlow reserves, not the high-water mark),
    and the fullest moments where coop's own pool is not the less fragmented."""
    rows = [{**row, **{k: {**row[k], "whole_pool": 1.0 - row[k]["live_peak"] / row["pool"]} if row[k]["ok"] else row[k]
                       for k in EXAMPLE_METHODS}} for row in rows]
    behind_in_own_pool = [r for r in rows if r["coop"]["ok"] and r["dtr-pool"]["ok"]
                          and r["coop"]["own_fragmentation"] >= r["dtr-pool"]["own_fragmentation"]]
    return {"rows": rows, "verdicts": [(what, *claims_verdict(rows, key)) for key, what in CLAIMS.items()],
            "failed": [f"{r['model']} at {r['frac']:.0%}" for r in rows if not r["dtr-pool"]["ok"]],
            "whole_pool": claims_verdict(rows, "whole_pool"),
            "fullest": [(r, explained_by_first_request(r)) for r in behind_in_own_pool]}


# -- the page and the suite ------------------------------------------------------------------------

def page(results: dict[str, Any], header: str) -> str:
    """The whole page from one run's results (the study's, its worked example and the page's studies)."""
    s, ex, es = results["studies"], results["example"], list(results["models"].items())
    small, larger = s["dtr_variants"]["small"], s["dtr_variants"]["larger"]
    return common.fill(
        "heuristics", header=header, meta=results["meta"], steps=STEPS, gpt2=results["models"].get(GPT2_SMALL_LABEL),
        graphs=len(es), entries=es, pool_columns=["coop", *POOL_VARIANTS, "dtr"],
        fragmentation={name: fragmentation_counts(results, key) for name, key in
                       (("own", "own_fragmentation"), ("caching", "caching_fragmentation"))},
        claims=claims_values(s["claims"]), small=small, small_table=dtr_table(small),
        small_said=dtr_variants_said(small), larger=larger, larger_table=dtr_table(larger),
        larger_ranking=ranking(larger, list(larger["overheads"])),
        equal=equal_pools(results), live=live_comparison(results), pool=pool_comparison(results),
        pool_variants=POOL_VARIANTS, not_monotone=not_monotone(results), example=ex, sweep=sweep_values(ex),
        updates=inplace_values(s["updates"], UPDATE_PAIRS), writes=inplace_values(s["writes"], WRITE_PAIRS),
        regnet=regnet_values(s["regnet"]), study=s["reserved"], reserved=reserved_said(s["reserved"]),
        allocators={"caching": "the caching allocator", "expandable": "expandable segments"}, label_of=label_of,
        display=display, pool_cell=pool_cell, ratio=ratio, best_pool_ratio=best_pool_ratio, pool_order=pool_order)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common.add_page_arguments(ap, DEFAULT_OUT, RECORD_PAGE)
    names = list(dict.fromkeys(n for n, _ in MODEL_SIZES))
    ap.add_argument("--models", nargs="+", default=names, help=f"from {', '.join(names)}")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    ap.add_argument("--example", action="store_true", help="also write example.md (the worked example)")


def main(args: argparse.Namespace) -> int:
    """``bonsai bench heuristics``: the study, with ``--page`` the page's studies and the page; a page from a
    subset of the models, or again from results without the page's studies, is refused."""
    refusal = common.page_refusal(args, narrowed=common.changed(args, ("models",)), whole="every model", studies=True)
    return common.run_page_suite("heuristics", args, refusal, lambda: measure(args),
                                 common.page_writer(page, SOURCES), write_beside)
