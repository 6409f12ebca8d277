"""Coop vs DTR in one pool, as Coop's paper compares them (Zhang et al., NeurIPS 2023), and the other studies
docs/results/heuristics.md reports: what they measure (:mod:`~bonsai_core.bench.heuristics_page` writes the
pages). Every variant runs inside one pool that also holds the parameters, gradients and Adam state (OneFlow's
DTR allocator); a run counts when its schedule, replayed in the pool, fits (``pool_replay``).

* :func:`bench_model`, per graph (the zoo's and Hugging Face's networks at two sizes each, and GPT-2 small):
  the **smallest pool** each variant of :data:`VARIANTS` trains in (bisection, :data:`STEPS` steps up to 1.5x
  the no-remat peak: a threshold, not a proven minimum, a heuristic's success not being monotone in the
  budget), then each at :data:`FACTORS` x coop's smallest pool: overhead and the allocator model's
  fragmentation in its own pool and in PyTorch's caching allocator (``replay``);
* :func:`example`: coop and dtr-pool on the zoo GPT at 60%, request by request, from the runs' event logs;
* :func:`studies`: DTR's heuristics (:mod:`~bonsai_core.bench.dtr_variants`), recomputable in-place against
  copy-on-write (:func:`inplace_rows`), a budget on reserved bytes and Coop's two claims together.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from bonsai_core.allocator import MIN_BLOCK, bounded_replay, fixed_tensors, optimizer_bytes, replay
from bonsai_core.bench import common, dtr_variants
from bonsai_core.errors import BonsaiError, BudgetError
from bonsai_core.graph import Graph
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


def adam_bytes(graph: Graph) -> int:
    return optimizer_bytes(fixed_tensors(graph)) if graph.optimizer is None else 0


def run(graph: Graph, budget: int, label: str, time_limit: float, measure: bool = False,
        variants: dict[str, tuple[str, dict[str, Any]]] = VARIANTS) -> dict[str, Any]:
    """One solve of ``label`` (a key of ``variants``) under ``budget``: ok, overhead, eviction counts;
    with ``measure`` the allocator model's fragmentation of its schedule in its own pool and under the
    caching allocator. It is ok when the method returns a schedule that fits the pool when replayed
    (``pool_replay``): for ``dtr`` (live bytes) placed best fit; for a pool method its own run's
    placement, which differs only when the run held separated outputs (``outputs_held``)."""
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
    """The smallest budget ``label`` trains in, bisected between the graph's lower bound and 1.5x its
    no-remat peak."""
    return common.bisect_budget(lambda budget: run(graph, budget, label, time_limit, variants=variants)["ok"],
                                graph.peak_lower_bound, int(1.5 * no_remat_peak(graph)), STEPS)


def label_of(name: str, options: dict[str, int]) -> str:
    from bonsai_core.models.zoo import GPT2_SMALL as shape

    if name == "gpt" and options == shape:
        return GPT2_SMALL_LABEL
    return name + "".join(f" --{k} {v}" for k, v in options.items())


def bench_model(name: str, options: dict[str, int], time_limit: float) -> dict[str, Any]:
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
    pools = ", ".join(f"{k} {common.mib(b + adam, 1, '') if b else '-'}" for k, b in entry["smallest_budget"].items())
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
    return {k: [common.overhead_or_none(graph, int(f * no_remat_peak(graph)), method, time_limit=time_limit, **options)
                for f in SWEEP_FRACS] for k, (method, options) in SWEEP.items()}


def example(time_limit: float, frac: float = EXAMPLE_FRAC) -> dict[str, Any]:
    """Coop and dtr-pool on the zoo GPT at ``frac`` of its no-remat peak, from their event logs: what
    each run's requests did, the requests where they first differ, what each recomputes most, and both
    around that pool."""
    g = common.graph_of("gpt")
    budget = int(frac * no_remat_peak(g))
    runs = {k: solve(g, budget, VARIANTS[k][0], time_limit=time_limit, budget_hint=False, **VARIANTS[k][1])
            for k in EXAMPLE_METHODS}
    logs = {k: s.extra["evictions"] for k, s in runs.items()}
    a, b = (logs[k] for k in EXAMPLE_METHODS)  # the first request at which the logs differ (node or evictions)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x[1] != y[1] or x[2] != y[2]), None)
    return {"model": "gpt", "nodes": g.n, "frac": frac, "budget": budget, "adam_bytes": adam_bytes(g),
            "runs": {k: run_summary(g, s) for k, s in runs.items()}, "first_divergence": first,
            "requests": [] if first is None else request_rows(g, logs, first),
            "most_recomputed": {k: most_recomputed(g, s) for k, s in runs.items()},
            "sweep_fracs": list(SWEEP_FRACS), "sweep": sweep(g, time_limit)}


# -- the page's other studies ---------------------------------------------------------------------

REGNET_SIZES = ({"batch": 32, "image": 224}, {"batch": 64, "image": 128})
RESERVED_MODEL = ("hf:llama", {"layers": 4, "width": 512, "seq": 512, "batch": 4, "vocab": 8192})
RESERVED_FRACS = (0.5, 0.7)
POLICIES = ("caching", "expandable")
UPDATES = {  # the optimizer's updates between steps, in place or copied on write
    "coop in place": ("coop", {}),
    "coop copy": ("coop", {"inplace_updates": False}),
    "dtr-pool in place": ("dtr", {"allocator": True, "full_arena": True}),
    "dtr-pool copy": ("dtr", {"allocator": True, "full_arena": True, "inplace_updates": False}),
}
UPDATES_MODELS = ("gpt", "resnet", "unet", "mlp", "vgg")
WRITES = {
    "coop writes in place": ("coop", {}),
    "coop copy-on-write": ("coop", {"inplace_writes": False}),
    "dtr-pool writes in place": ("dtr", {"allocator": True, "full_arena": True}),
    "dtr-pool copy-on-write": ("dtr", {"allocator": True, "full_arena": True, "inplace_writes": False}),
}
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
        "dtr_variants": dtr_variants.measure,
        "updates": lambda: list(inplace_rows([(m, {}) for m in UPDATES_MODELS], UPDATES, time_limit)),
        "writes": lambda: list(inplace_rows(WRITES_MODELS, WRITES, time_limit)),
        "regnet": lambda: regnet_writes(time_limit),
        "reserved": lambda: reserved_budgets(time_limit),
        "claims": lambda: claims(time_limit)})


def inplace_rows(models: list[tuple[str, dict[str, int]]], variants: dict[str, tuple[str, dict]],
            time_limit: float) -> Iterator[dict]:
    """One row per model and variant, as measured: the model's label and in-place ops, the smallest budget
    met (a share of the no-remat peak, None when none up to 1.5x), and the run at 80%
    (:func:`run`, measured)."""
    for name, options in models:
        g = common.graph_of(name, **options)
        ref = no_remat_peak(g)
        for variant in variants:
            smallest = smallest_budget(g, variant, time_limit, variants=variants)
            yield {"model": label_of(name, options), "inplace_ops": int((g.inplace_of >= 0).sum()),
                   "variant": variant, "smallest": smallest / ref if smallest else None,
                   "at80": run(g, int(0.8 * ref), variant, time_limit, measure=True, variants=variants)}


def display(model: str) -> str:
    """A model's label as the page names it (ResNet-18 for tests.real_models:resnet18_bn)."""
    return model.replace("tests.real_models:resnet18_bn", "ResNet-18")


def claims(time_limit: float) -> list[dict[str, Any]]:
    """Coop's two claims at once, as ``bonsai solve --budget P%`` meets them: per model of
    :data:`CLAIM_MODELS` and share of its no-remat peak, coop and dtr-pool (DTR evicting in the same full
    arena), each with its overhead, its fragmentation in its own pool and under the caching allocator, the
    paper's rate (``free_after_eviction``, as OneFlow records it) and its fullest moment's live bytes;
    ``pool``: the arena's bytes (Adam state included)."""
    rows = []
    for name, options in CLAIM_MODELS:
        graph = common.graph_of(name, **options)
        for frac in CLAIM_FRACS:
            budget = int(frac * no_remat_peak(graph))
            pool = (budget + adam_bytes(graph)) // MIN_BLOCK * MIN_BLOCK
            row = {"model": display(label_of(name, options)), "frac": frac, "pool": pool}
            for label in ("coop", "dtr-pool"):
                row[label] = run(graph, budget, label, time_limit, measure=True)
                if row[label]["ok"]:
                    row[label]["fullest"] = fullest_moment(graph, budget, label, time_limit, pool)
            if row["coop"]["ok"] and row["dtr-pool"]["ok"]:
                row["same_until"] = same_until(row["coop"]["fullest"], row["dtr-pool"]["fullest"])
            for label in ("coop", "dtr-pool"):
                row[label].get("fullest", {}).pop("prefix", None)  # compared above; not worth storing
            rows.append(row)
    return rows


def fullest_moment(graph: Graph, budget: int, label: str, time_limit: float, pool: int) -> dict[str, Any]:
    """Where a run's fragmentation in its own pool is taken: its fullest moment on the reserved plateau
    (op index, of how many ops), the op that first reached its high-water mark, the pool's bytes not live
    then, and its first request that found no room (the op before which it came, the node, its bytes).
    ``prefix`` is the schedule up to that request (for :func:`same_until`)."""
    method, options = VARIANTS[label]
    s = solve(graph, budget, method, time_limit=time_limit, budget_hint=False, **options)
    r = pool_replay(graph, s, capacity=budget)
    top = int(np.argmax(r.reserved))
    i = top + int(np.argmax(np.where(r.reserved[top:] == r.reserved[top], r.live[top:], -1)))
    log = s.extra.get("evictions", [])
    first = None
    if log:
        before, v = log[0][0], log[0][1]
        first = {"op": before, "name": graph.names[v], "bytes": int(graph.mem[v])}
    return {"op": i, "ops": len(s.ops), "top_op": top, "top_name": graph.names[s.ops[top][1]],
            "free": pool - int(r.live[i]), "first_request": first,
            "prefix": [list(o) for o in s.ops[:first["op"]]] if first else None}


def same_until(coop: dict[str, Any], dtr: dict[str, Any]) -> int | None:
    """The op before which both runs' first requests that found no room came, when the two runs are
    the same schedule up to it and the request is the same node; else None."""
    a, b = coop["first_request"], dtr["first_request"]
    if a is None or b is None or a != b or coop["prefix"] != dtr["prefix"]:
        return None
    return a["op"]


def regnet_writes(time_limit: float) -> list[dict[str, Any]]:
    """The in-place writes study on transformers' RegNet-Y (``RegNetConfig(num_labels=10)``), from a
    config written to a temporary folder with ``save_pretrained``, at REGNET_SIZES."""
    from transformers import RegNetConfig

    with tempfile.TemporaryDirectory() as folder:
        RegNetConfig(num_labels=10).save_pretrained(folder)
        models = [(f"hf:{folder}", dict(size)) for size in REGNET_SIZES]
        rows = list(inplace_rows(models, WRITES, time_limit))
    return [{**row, "model": row["model"].replace(f"hf:{folder}", "RegNet-Y")} for row in rows]


def lowest_reserved(message: str) -> int | None:
    """The lowest reserved peak a refused ``solve_reserved`` reached, in bytes, from its error."""
    found = re.search(r"lowest reserved peak was [^(]*\((\d+) bytes\)", message)
    return int(found[1]) if found else None


def reserved_budgets(time_limit: float) -> dict[str, Any]:
    """bonsai on RESERVED_MODEL at RESERVED_FRACS of its no-remat peak: the live-budget schedule replayed
    through both allocator models, and ``solve_reserved`` with each (``bonsai solve --reserved``)."""
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
            except BudgetError as e:
                entry["reserved"][policy] = {"ok": False, "lowest_reserved": lowest_reserved(str(e))}
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
