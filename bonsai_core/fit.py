"""What fits on a GPU: the largest micro-batch (or sequence length) each method can train within a
memory limit at an acceptable recompute overhead, and its plan.

For a model and a size option (``batch`` or ``seq``), :func:`fit` traces the step at a size, solves
it with every method under the GPU's bytes, and searches the sizes: doubling from the start until no
method fits, then bisecting each method's boundary. A method *fits* a size when it returns a schedule
within the limit whose overhead is at most ``max_overhead`` (``none``: the no-remat peak fits).
Larger sizes are taken never to fit where a smaller one does not (activations grow with the size), so
a method is not solved at a size its answers so far decide. Each size is traced once, whatever the
number of methods (a size the caller traced already is not traced again); the cost of a search is
O(log(largest size)) traces and solves per method. A method may be a variant, ``METHOD:NAME=VALUE,...``
(``bonsai:offload=true``): the method with those options, searched and reported as a method of its own.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from bonsai_core.errors import BonsaiError, BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, no_remat_peak

MAX_SIZE = 1 << 16  # no search goes past this many samples or tokens


@dataclass(frozen=True)
class Attempt:
    """One method at one size: whether it fits, and the numbers that say so."""

    method: str
    size: int
    fits: bool
    peak: int | None = None
    reserved_peak: int | None = None
    overhead: float | None = None
    status: str = ""
    seconds: float = 0.0
    reason: str = ""  # why it does not fit
    schedule: Schedule | None = field(default=None, compare=False, repr=False)

    def row(self) -> dict[str, Any]:
        return {"method": self.method, "size": self.size, "fits": self.fits, "peak": self.peak,
                "reserved_peak": self.reserved_peak, "overhead": self.overhead, "status": self.status,
                "solve_seconds": round(self.seconds, 3), "reason": self.reason}


@dataclass
class FitResult:
    """The search: every attempt, each method's largest fitting size, and the traces it took."""

    model: str
    vary: str
    limit: int
    max_overhead: float
    attempts: list[Attempt]
    traces: dict[int, float]  # size -> seconds to trace it
    no_remat_peaks: dict[int, int]
    reused: list[int] = field(default_factory=list)  # sizes whose step was given (``fit(traced=...)``), not traced

    def best(self, method: str) -> Attempt | None:
        """``method``'s attempt at its largest fitting size (None: it fits no size tried)."""
        fitting = [a for a in self.attempts if a.method == method and a.fits]
        return max(fitting, key=lambda a: a.size, default=None)

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(a.method for a in self.attempts))


def method_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``METHOD[:NAME=VALUE,...]`` as the method and its options, typed as ``--option`` types them
    (``bonsai:offload=true`` -> ("bonsai", {"offload": True})); SolverError naming what is wrong."""
    from bonsai_core.solvers import METHODS, parse_option

    method, _, listed = spec.partition(":")
    if method not in METHODS:
        raise SolverError(f"Unknown method {method!r} in {spec!r} (choose from {', '.join(METHODS)}); a variant is "
                          "METHOD:NAME=VALUE,... such as bonsai:offload=true.")
    return method, dict(parse_option(method, text) for text in listed.split(",") if text.strip())


def attempt(graph: Graph, size: int, method: str, limit: int, max_overhead: float, reserved: str | None,
            options: dict[str, Any], solved: Schedule | BonsaiError | None = None) -> Attempt:
    """``method`` on ``graph`` under ``limit`` bytes (its reserved bytes with allocator ``reserved``); ``solved``: with
    ``reserved``, the method's live solve at ``limit`` made already (:func:`bonsai_core.solvers.solve_reserved`)."""
    from bonsai_core.solvers import FIXED_PLAN_METHODS, accepted_options, solve, solve_reserved
    from bonsai_core.units import format_bytes

    if limit < graph.peak_lower_bound:  # no method can fit: say what does not
        what = (f"the fixed memory alone (parameters, gradients, optimizer state, batch) is {format_bytes(graph.fixed_mem)}"
                if limit < graph.fixed_mem else
                f"the optimizer step needs {format_bytes(graph.optimizer_peak)}"
                if graph.optimizer_peak == graph.peak_lower_bound else
                f"its largest op needs {format_bytes(graph.peak_lower_bound)}")
        return Attempt(method, size, False, reason=what)
    if method != "none" and "budget_hint" in (accepted_options(method) or ()):
        options = {"budget_hint": False, **options}  # whether it fits is the question, not what budget would do
    start = time.perf_counter()
    try:
        if reserved:
            schedule = solve_reserved(graph, limit, method, policy=reserved, solved=solved, **options)
        else:
            schedule = solve(graph, limit, method, **options)
    except (BudgetError, SolverError) as e:
        out_of_time = "its time limit ran out before it found a schedule" + (
            f" ({options['time_limit']:g} s)" if options.get("time_limit") else "")
        return Attempt(method, size, False, seconds=time.perf_counter() - start,
                       reason=out_of_time if e.timed_out else f"solver: {e}" if isinstance(e, SolverError) else
                       "no-remat peak over the limit" if method == "none" else "its fixed plan peaks over the limit"
                       if method in FIXED_PLAN_METHODS else "no schedule within the limit")
    stats = schedule.stats
    seconds = time.perf_counter() - start
    over = stats["overhead"] > max_overhead + 1e-12
    return Attempt(method, size, not over, stats["peak"], stats.get("reserved_peak"), stats["overhead"],
                   str(stats.get("status", "")), seconds,
                   f"overhead {stats['overhead']:+.1%} above {max_overhead:.0%}" if over else "", schedule)


def search_sizes(evaluate: Callable[[int, list[str]], dict[str, bool]], methods: list[str], start: int = 1,
                 largest: int = MAX_SIZE, upcoming: Callable[[list[int]], None] | None = None) -> None:
    """Call ``evaluate(size, asked)`` (method -> fits, for the methods ``asked``) on the sizes that decide
    each method's largest fitting size: from ``start`` each method doubles its size while it fits (up to
    ``largest``), then bisects between its last fitting and first failing size. A method is asked only what
    its answers so far leave open: it fits below a size it fits, and not above one it does not. The search
    goes in rounds, each method's next size in each; ``upcoming`` hears a round's sizes before they are
    asked (the caller may trace them ahead)."""
    seen: dict[int, dict[str, bool]] = {}

    def implied(m: str, size: int) -> bool | None:
        if any(r.get(m) is True and s >= size for s, r in seen.items()):
            return True
        if any(r.get(m) is False and s <= size for s, r in seen.items()):
            return False
        return None

    def next_size(m: str) -> int | None:
        """The size ``m`` is asked next; None once its largest fitting size is known."""
        lo = max((s for s, r in seen.items() if r.get(m) is True), default=0)
        hi = min((s for s, r in seen.items() if r.get(m) is False and s > lo), default=None)
        if hi is None:
            return None if lo >= largest else min(2 * lo, largest) if lo else start
        return (lo + hi) // 2 if hi - lo > 1 else None

    while True:
        wanted: dict[int, list[str]] = {}
        for m in methods:
            size = next_size(m)
            if size is not None:
                wanted.setdefault(size, []).append(m)
        if not wanted:
            return
        if upcoming:
            upcoming(sorted(wanted))
        for size in sorted(wanted):
            todo = [m for m in wanted[size] if implied(m, size) is None]
            if todo:
                seen.setdefault(size, {}).update(evaluate(size, todo))


def fit(model: str, limit: int, methods: list[str], *, vary: str = "batch", max_overhead: float = 0.1,
        options: dict[str, Any] | None = None, optimizer: str = "none", reserved: str | None = None,
        solver_options: dict[str, Any] | None = None, start: int = 1, largest: int = MAX_SIZE,
        progress: Callable[[str], None] | None = None, trace_kwargs: dict[str, Any] | None = None,
        traced: dict[int, Graph] | None = None, answered: Callable[[Attempt], None] | None = None) -> FitResult:
    """Search the sizes of ``model`` (a zoo name, ``hf:...`` or a factory) at which each of ``methods``
    fits ``limit`` bytes with overhead at most ``max_overhead``. ``vary`` is the model option searched
    (``batch`` or ``seq``); ``options`` fix the others; ``optimizer`` adds its state and step, in the model's
    own training loop (:func:`bonsai_core.optimizer.with_training_loop`: torchtitan's sets the gradients to
    None); ``reserved`` ("caching" or "expandable") makes ``limit`` bound the
    allocator model's reserved bytes; ``solver_options`` go to every method (``time_limit`` ...), a variant's
    own options (:func:`method_variant`) on top. ``traced``: the step at some sizes, traced already (without
    an optimizer), used instead of tracing them again; ``answered`` is called with each attempt as it ends."""
    from bonsai_core.optimizer import with_training_loop
    from bonsai_core.rank import trace as trace_model

    if vary not in ("batch", "seq"):
        raise BonsaiError(f"--vary {vary!r}: fit searches the micro-batch ('batch') or the sequence length ('seq').")
    options = {k: v for k, v in (options or {}).items() if k != vary}
    variants = {m: method_variant(m) for m in methods}  # refused before any trace
    attempts: list[Attempt] = []
    traces: dict[int, float] = {}
    peaks: dict[int, int] = {}

    graphs: dict[int, Graph] = {}

    def traced_at(size: int) -> Graph:
        kwargs = {**(trace_kwargs or {}), **options, vary: size}
        return three_block_step(model, kwargs) or trace_model(model, **kwargs).graph

    ahead = _Tracer(traced_at)

    def graph_at(size: int) -> Graph:
        if size not in graphs:
            base = (traced or {}).get(size)
            if base is None:
                base, traces[size] = ahead.get(size)
            graphs[size] = with_training_loop(base, model, optimizer)
            peaks[size] = no_remat_peak(graphs[size])
        return graphs[size]

    def trace_ahead(sizes: list[int]) -> None:
        for size in sizes:
            if size not in graphs and size not in (traced or {}):
                ahead.start(size)

    def evaluate(size: int, asked: list[str]) -> dict[str, bool]:
        graph = graph_at(size)
        result = {}
        for m in asked:
            method, own = variants[m]
            a = attempt(graph, size, method, limit, max_overhead, reserved,
                        {} if method == "none" else {**(solver_options or {}), **own})
            a = replace(a, method=m)  # a variant is reported under its own name
            attempts.append(a)
            result[m] = a.fits
            if answered:
                answered(a)
            if progress:
                progress(f"{vary} {size}: {m} " + (f"fits, overhead {a.overhead:+.2%}" if a.fits else
                                                  f"does not fit ({a.reason})"))
        return result

    try:
        search_sizes(evaluate, methods, start, largest, trace_ahead)
    finally:
        ahead.pool.shutdown(wait=False, cancel_futures=True)  # a size traced ahead that no method needed in the end
    return FitResult(model, vary, limit, max_overhead, attempts, traces, peaks, sorted(set(graphs) - set(traces)))


# what bonsai_core.rank.trace takes that a step made of three traced blocks (RankGraphs) honours
THREE_BLOCK_OPTIONS = ("batch", "seq", "layers", "width", "heads", "vocab", "fsdp", "reshard_after_forward",
                       "mixed_precision", "seed", "profile", "autocast", "kernels")


def three_block_step(model: str, kwargs: dict[str, Any]) -> Graph | None:
    """The step ``bonsai_core.rank.trace(model, **kwargs)`` traces, for a torchtitan model sharded by FSDP alone
    over two or more ranks, made from a trace of its first three blocks (:class:`RankGraphs`: the middle block
    repeated, then sharded): node for node the whole trace's graph (its ops, costs, sizes, edges, modules, FSDP
    units and fixed bytes; the repeated blocks' nodes and parameters named after the middle one), for the
    price of three blocks' trace instead of every block's. None where it does not apply (another model, another
    layout, an option it does not take) or the blocks are not alike: trace the whole step."""
    from bonsai_core.fsdp import Sharding
    from bonsai_core.models import torchtitan as titan
    from bonsai_core.parallel import layout_of

    world = kwargs.get("fsdp", 1)
    if not model.startswith(titan.PREFIX) or not isinstance(world, int) or world < 2 \
            or set(kwargs) - set(THREE_BLOCK_OPTIONS):
        return None
    sizes = {k: v for k, v in kwargs.items() if k in ("layers", "width", "heads", "vocab")}
    batch, seq = kwargs.get("batch", titan.DEFAULTS["batch"]), kwargs.get("seq", titan.DEFAULTS["seq"])
    sharding = Sharding.of(world, kwargs.get("reshard_after_forward"), kwargs.get("mixed_precision"), model=model)
    step = {k: kwargs[k] for k in ("seed", "profile", "autocast", "kernels") if k in kwargs}
    try:
        graph = RankGraphs(model, seq, sizes, sharding, step).graph(layout_of(fsdp=world), batch)
    except BonsaiError:
        return None  # blocks not alike: RankGraphs refuses, the whole trace does not
    named = {k: v for k, v in kwargs.items() if k in titan.SIZE_OPTIONS}  # the whole trace's name
    label = model + "(" + ", ".join(f"{k}={v}" for k, v in sorted(named.items())) + ")" if named else model
    label += f" autocast {kwargs['autocast']}" if kwargs.get("autocast") else ""
    label += f" fsdp mixed precision {sharding.mixed_precision}" if sharding.mixed_precision else ""
    return graph.with_fields(name=label, parallel=None)


class _Tracer:
    """The search's traces, one at a time on a thread of their own: a round's sizes are traced while the
    methods solve the sizes before them (the solvers' backends run without the GIL)."""

    def __init__(self, trace: Callable[[int], Graph]) -> None:
        self.trace = trace
        self.jobs: dict[int, concurrent.futures.Future] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bonsai-fit-trace")

    def start(self, size: int) -> None:
        if size not in self.jobs:
            self.jobs[size] = self.pool.submit(self._timed, size)

    def get(self, size: int) -> tuple[Graph, float]:
        """The step at ``size`` and the seconds its trace took (raises what the trace raised)."""
        self.start(size)
        return self.jobs[size].result()

    def _timed(self, size: int) -> tuple[Graph, float]:
        begin = time.perf_counter()
        graph = self.trace(size)
        return graph, time.perf_counter() - begin


def table(result: FitResult) -> list[dict[str, Any]]:
    """One row per method: its largest fitting size and that plan's numbers."""
    from bonsai_core.units import format_bytes

    rows = []
    for m in result.methods:
        best = result.best(m)
        tried = sorted(a.size for a in result.attempts if a.method == m)
        failed = [a for a in result.attempts if a.method == m and not a.fits]
        rows.append({"method": m, f"largest {result.vary}": best.size if best else None,
                     "peak": format_bytes(best.peak) if best else "",
                     "reserved": format_bytes(best.reserved_peak) if best and best.reserved_peak else "",
                     "overhead": f"{best.overhead:+.2%}" if best else "",
                     "status": best.status if best else "",
                     "next size fails because": (min(failed, key=lambda a: a.size).reason if failed else
                                                 f"not tried past {max(tried)}")})
    return rows


def markdown_table(result: FitResult) -> str:
    """:func:`table` as Markdown; "-" for a method that fits no size tried."""
    import pandas as pd

    return pd.DataFrame(table(result), dtype=object).fillna("-").to_markdown(index=False)


def write_report(result: FitResult, out_dir: str) -> list[str]:
    """fit.csv (every attempt), fit.md (the table and the command's cost) and fit.png (overhead
    against size per method, failures marked), plus each method's best plan as plan-METHOD.json;
    returns the files written."""
    import json
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from bonsai_core.units import format_bytes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    pd.DataFrame([a.row() for a in result.attempts]).to_csv(out / "fit.csv", index=False)
    lines = [f"# What fits: {result.model} within {format_bytes(result.limit)}, overhead at most "
             f"{result.max_overhead:.0%}", "", markdown_table(result), "",
             f"Traced {len(result.traces)} sizes of `{result.vary}` in {sum(result.traces.values()):.1f} s "
             f"({', '.join(f'{s}: {t:.1f} s' for s, t in sorted(result.traces.items()))}); "
             f"{len(result.attempts)} solves in {sum(a.seconds for a in result.attempts):.1f} s.", ""]
    (out / "fit.md").write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in result.methods:
        mine = sorted((a for a in result.attempts if a.method == m), key=lambda a: a.size)
        ok = [(a.size, 100 * a.overhead) for a in mine if a.overhead is not None]
        if ok:
            ax.plot(*zip(*ok), marker="o", label=m)
        bad = [a.size for a in mine if not a.fits]
        if bad:
            ax.scatter(bad, [100 * result.max_overhead] * len(bad), marker="x", color="grey")
    ax.axhline(100 * result.max_overhead, color="grey", linestyle="--", linewidth=0.8)
    ax.set_ylim(-1, max(5.0, 300 * result.max_overhead))  # the region around the limit; far-over points clipped
    ax.set_xscale("log", base=2)
    ax.set_xlabel(result.vary)
    ax.set_ylabel("recompute overhead (%)")
    ax.set_title(f"{result.model} within {format_bytes(result.limit)} (x: does not fit)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fit.png", dpi=110)
    plt.close(fig)
    written += ["fit.csv", "fit.md", "fit.png"]
    for m in result.methods:
        best = result.best(m)
        if best is not None and best.schedule is not None:
            name = "plan-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", m) + ".json"  # bonsai:offload=true -> plan-bonsai-offload-true
            (out / name).write_text(json.dumps(best.schedule.to_dict(), separators=(",", ":")) + "\n")
            written.append(name)
    return written


# -- a deep model's step from a trace of three blocks ------------------------------------------------------

def _middle_block(graph: Graph) -> dict[str, Any] | None:
    """Where a three-block step's blocks are: their forward spans, the backward ranges of the last two (a
    block's backward runs from the first backward op reading its forward tensors to the last one), which
    node of the first block the middle one reads corresponds to the one of the middle block the last reads
    (the first block of a pipeline stage reads the received activation, and may differ), and which gradient
    node the last block hands the middle one to the one the middle hands the first; None where the middle
    and last blocks' forward ops differ or the backward does not run block after block."""
    import numpy as np

    from bonsai_core.graph import block_stack

    blocks = block_stack(graph)
    if len(blocks) != 3:
        return None
    spans = [(a, b) for _, a, b in blocks]
    ops = [[graph.ops[v] for v in range(a, b + 1)] for a, b in spans]
    if ops[1] != ops[2]:
        return None
    backward = np.flatnonzero(~graph.is_forward).tolist()
    readers = []
    for a, b in spans:
        mine = [v for v in backward if any(a <= d <= b for d in graph.deps(v).tolist())]
        if not mine:
            return None
        readers.append((mine[0], mine[-1]))
    s2, s1, s0 = readers[2][0], readers[2][1] + 1, readers[1][1] + 1
    if not (s2 < s1 < s0 <= graph.n) or graph.is_forward[s2:].any():
        return None
    f0, f1, f2 = [range(a, b + 1) for a, b in spans]
    b2, b1 = range(s2, s1), range(s1, s0)

    def read(by: Sequence[int], of: range) -> list[int]:
        return sorted({d for v in by for d in graph.deps(v).tolist() if d in of})

    fed0, fed1 = read([*f1, *b1], f0), read([*f2, *b2], f1)  # what the next block reads of the block before
    into1, into0 = read(b1, b2), read(range(s0, graph.n), b1)  # the gradient each block hands the one before
    if len(fed0) != len(fed1) or len(into1) != len(into0):
        return None
    return {"blocks": blocks, "spans": spans, "f": [f0, f1, f2], "b2": b2, "b1": b1, "s1": s1,
            "fed": dict(zip(fed0, fed1)), "handed": dict(zip(into1, into0))}


def deepen(graph: Graph, layers: int, block_bytes: int) -> Graph | None:
    """``graph``, the step of a model whose block stack has three identical blocks, as the same step with
    ``layers`` blocks: the middle block's forward and backward repeated in the chain (the copies read the
    block before's output and the block after's gradient, as the middle block does), their parameters and
    gradients (``block_bytes`` each, in the traced dtype) added to the fixed tensors. The graph a trace of the
    deep model gives, node for node, where the blocks are alike (a transformer's); None where they are not
    (:func:`_middle_block`). Apply it before sharding (FSDP's units name node spans)."""
    found = _middle_block(graph) if layers >= 3 and graph.fsdp is None else None
    if found is None:
        return None
    blocks, spans, (f0, f1, f2), b2, b1, s1, fed, handed = (found[k] for k in ("blocks", "spans", "f", "b2", "b1",
                                                                                "s1", "fed", "handed"))
    copies = layers - 3
    order = [(v, 0) for v in range(spans[1][1] + 1)]
    order += [(v, j) for j in range(1, copies + 1) for v in f1]
    order += [(v, 0) for v in range(spans[1][1] + 1, s1)]
    order += [(v, j) for j in range(copies, 0, -1) for v in b1]
    order += [(v, 0) for v in range(s1, graph.n)]
    new_id = {key: i for i, key in enumerate(order)}

    def mapped(v: int, j: int, d: int) -> int:
        """The new id of dep ``d`` of node ``v`` of copy ``j`` (0: the traced node itself)."""
        if j:  # a copy of the middle block: its chain neighbours are copies too
            if d in f0:  # what the block before hands on
                return new_id[(fed[d], j - 1)]
            if d in f1 or d in b1:
                return new_id[(d, j)]
            if d in b2:
                return new_id[(handed[d], j + 1)] if j < copies else new_id[(d, 0)]
            return new_id[(d, 0)]
        if copies and d in f1 and spans[2][0] <= v < s1:
            return new_id[(d, copies)]  # block 2 and after read the last copy's output
        if copies and d in b2 and v in b1:
            return new_id[(handed[d], 1)]  # block 1 takes the gradient the first copy hands it
        return new_id[(d, 0)]

    data = graph.to_dict()
    nodes = []
    for i, (v, j) in enumerate(order):
        nd = dict(data["nodes"][v], id=i)
        if j:
            nd["name"] = f"{nd['name']}@{j}"
        nd["deps"] = sorted(mapped(v, j, d) for d in nd["deps"])
        for key in ("alias_of", "inplace_of"):
            if nd.get(key) is not None:
                nd[key] = mapped(v, j, nd[key])
        if nd.get("held"):
            nd["held"] = sorted(mapped(v, j, d) for d in nd["held"])
        nodes.append(nd)
    parent, _, middle = blocks[1][0].rpartition(".")
    extra = [[f"{parent}.{int(middle) + j} (a copy of {blocks[1][0]})", block_bytes, kind]
             for kind in ("param", "grad") for j in range(1, copies + 1)]
    data.update(nodes=nodes, modules=_deepened_modules(graph, blocks, layers, new_id),
                fixed_tensors=data.get("fixed_tensors", []) + extra,
                fixed_mem=graph.fixed_mem + sum(t[1] for t in extra))
    return Graph.rebuilt(data)


def _deepened_modules(graph: Graph, blocks: list, layers: int, new_id: dict) -> list[list[Any]]:
    """The ``modules`` of :func:`deepen`'s graph: the traced calls at their new ids, the last block renamed
    the model's last, the middle block's calls repeated for each copy under the next blocks' paths."""
    parent = blocks[0][0].rpartition(".")[0]
    first_index = int(blocks[0][0].rpartition(".")[2])
    copies = layers - 3
    out = []
    for path, a, b in graph.modules:
        which = next((k for k, (p, _, _) in enumerate(blocks) if path == p or path.startswith(p + ".")), None)
        if which is None:
            out.append([path, new_id[(a, 0)], new_id[(b, 0)]])
            continue
        index = first_index + (which if which < 2 else layers - 1)
        out.append([f"{parent}.{index}" + path[len(blocks[which][0]):], new_id[(a, 0)], new_id[(b, 0)]])
        if which == 1:
            out += [[f"{parent}.{first_index + 1 + j}" + path[len(blocks[1][0]):], new_id[(a, j)], new_id[(b, j)]]
                    for j in range(1, copies + 1)]
    return sorted(out, key=lambda m: (m[1], -m[2]))


# -- what fits on N GPUs: the layouts ------------------------------------------------------------------------

@dataclass(frozen=True)
class LayoutFit:
    """One layout at one local batch: the least recompute that fits (its method), the largest peak over the
    pipeline ranks traced, and the tokens each GPU trains per step."""

    layout: Any  # bonsai_core.parallel.Layout
    batch: int  # sequences per data-parallel rank and step (a pipeline rank's microbatches, one sequence each)
    fits: bool
    method: str = ""
    peak: int | None = None
    reserved_peak: int | None = None
    overhead: float | None = None
    tokens_per_gpu: int = 0
    reason: str = ""
    ranks: tuple = ()  # (pipeline rank, its peak) per rank traced

    def row(self) -> dict[str, Any]:
        from bonsai_core.units import format_bytes

        return {"layout": self.layout.describe(rank=False), "local batch": self.batch, "fits": self.fits,
                "method": self.method, "peak": format_bytes(self.peak) if self.peak else "",
                "reserved": format_bytes(self.reserved_peak) if self.reserved_peak else "",
                "overhead": f"{self.overhead:+.2%}" if self.overhead is not None else "",
                "tokens per GPU per step": self.tokens_per_gpu, "why not": self.reason}


def candidate_layouts(gpus: int, n_layers: int, n_heads: int, n_kv_heads: int, seq: int) -> list[Any]:
    """The layouts of ``gpus`` GPUs searched, as torchtitan accepts them: tensor parallel within a node (a
    divisor of the key/value heads, at most 8), pipeline parallel of 1, 2, 4 or 8 stages with both schedules
    (at least 3 layers a stage), context parallel for sequences of 32k and more (2, 4, 8; the sequence
    divisible by ``2 cp tp``), the rest data parallel: FSDP over all of it, and HSDP with FSDP within a node of
    8 where more than 8 remain."""
    from bonsai_core.parallel import layout_of

    out = []
    for pp in (1, 2, 4, 8):
        for tp in (t for t in (1, 2, 4, 8) if n_heads % t == 0 and n_kv_heads % t == 0):
            for cp in (1, 2, 4, 8) if seq >= 32768 else (1,):
                if gpus % (pp * tp * cp) or seq % (tp * (2 * cp if cp > 1 else 1)):
                    continue
                data = gpus // (pp * tp * cp)
                shards = [(1, data)] + ([(data // 8, 8)] if data > 8 and data % 8 == 0 else [])
                for replicate, shard in shards:
                    for schedule in ("1f1b", "interleaved-1f1b") if pp > 1 else ("1f1b",):
                        stages = pp * (2 if schedule == "interleaved-1f1b" else 1)
                        if pp > 1 and (n_layers + 2) // stages < 3:
                            continue
                        out.append(layout_of(fsdp=shard, dp_replicate=replicate, tp=tp, cp=cp, pp=pp,
                                             pp_schedule=schedule))
    return out


DEEPENED_KEPT = 16  # stage steps of many blocks kept for the next layouts (a 70B stage's is some 10 MB)


class RankGraphs:
    """The traced graphs of the ranks of a model's layouts, shared: a rank's step depends on its tensor,
    context and pipeline degrees (and stage) and its batch, not on how many ranks FSDP shards it over, so
    each is traced once, unsharded and computing in the mixed precision, and sharded for every FSDP and HSDP
    degree (:func:`bonsai_core.fsdp.shard_by_sizes`); a pipeline stage's step depends on whether it is the
    first or the last and on its layers, so three blocks of each kind of stage are traced once and repeated
    for every stage and layout (:func:`deepen`)."""

    def __init__(self, model: str, seq: int, options: dict[str, Any], sharding: Any, trace_kwargs: dict[str, Any]):
        self.model, self.seq, self.options, self.sharding = model, seq, options, sharding
        self.trace_kwargs = trace_kwargs
        self.stages: dict[tuple, tuple] = {}  # (tp, cp, first, last, batch, precision, blocks) -> (graph, sizes, root)
        # a pipeline rank's stages, whole and sharded, by its layout less the microbatches and its microbatch size:
        # a local batch that changes only the microbatch count changes only what with_pipeline adds
        self.sharded: dict[tuple, Any] = {}
        self.deep: OrderedDict[tuple, Graph] = OrderedDict()  # (stage kind, blocks, output held) -> its step
        self.seconds = 0.0

    def ranks(self, layout: Any, batch: int, optimizer: str) -> list[tuple[int, Graph]]:
        """(pipeline rank, its graph) of each rank of ``layout`` at local ``batch`` the peak is the largest of:
        the one rank, or the first, second and last pipeline ranks (the middle ones hold no more than the
        second); ``layout.microbatches`` of a pipeline layout (default: one sequence each, torchtitan's)."""
        import dataclasses

        from bonsai_core.optimizer import with_training_loop

        out = []
        ranks = [0] if layout.pp == 1 else sorted({0, 1, layout.pp - 1})
        microbatches = (layout.microbatches or batch) if layout.pp > 1 else None  # default: one sequence each
        for rank in ranks:
            spec = dataclasses.replace(layout, rank=rank, microbatches=microbatches)
            out.append((rank, with_training_loop(self.graph(spec, batch), self.model, optimizer)))
        return out

    def graph(self, layout: Any, batch: int) -> Graph:
        import dataclasses

        from bonsai_core.parallel import with_layout
        from bonsai_core.pipeline import rank_stages, with_pipeline

        name = f"{self.model}(batch={batch}, seq={self.seq}) {layout.describe()}"
        if layout.pp == 1:
            return with_layout(self._sharded(layout, batch, name), layout)
        indices = rank_stages(layout)
        micro = batch // layout.microbatches
        key = (dataclasses.replace(layout, microbatches=None), micro)
        if key not in self.sharded:
            self.sharded[key] = self._sharded(layout, batch, name)
        total = layout.pp * len(indices)
        return with_pipeline(self.sharded[key], layout, indices, [i > 0 for i in indices], [i < total - 1 for i in indices],
                             micro, name=name)

    def _sharded(self, layout: Any, batch: int, name: str) -> Graph:
        """The rank's stages at local ``batch``, concatenated and sharded for its FSDP degree, named ``name``."""
        from bonsai_core.fsdp import Sharding, fsdp_units, shard_by_sizes
        from bonsai_core.pipeline import concatenate, rank_stages, stage_modules

        precision = self.sharding.mixed_precision if layout.shard_world > 1 else None
        n_layers = self._n_layers()
        if layout.pp == 1:
            kinds, counts, indices = [(True, True)], [n_layers], [0]
        else:
            names = stage_modules(layout, n_layers)
            indices = rank_stages(layout)
            kinds = [(i == 0, i == len(names) - 1) for i in indices]
            counts = [sum(n.startswith("layers.") for n in names[i]) for i in indices]
        micro = batch if layout.pp == 1 else batch // layout.microbatches
        keys = [(layout.tp, layout.cp, first, last, micro, precision, min(count, 3))
                for (first, last), count in zip(kinds, counts)]
        missing = [k for k in keys if k not in self.stages]
        if missing:
            start = time.perf_counter()
            self.stages.update(_trace_stage_kinds(self.model, layout, batch, self.seq, self.options, precision,
                                                  self.trace_kwargs, missing))
            self.seconds += time.perf_counter() - start
        graphs, sizes, total = [], {}, 0
        for key, count in zip(keys, counts):
            three, part_sizes, part_root = self.stages[key]
            sizes.update(part_sizes)
            # the stage's parameters: its modules other than blocks, ``count`` blocks, and the rest
            total += part_root + count * part_sizes.get("layers.*", 0) + sum(
                b for p, b in part_sizes.items() if not p.startswith("layers."))
            graphs.append(self._deepened(key, count, layout.pp > 1))
        if layout.pp > 1:  # a rank's stages of one kind share a trace: each takes its own blocks' paths
            graphs = [named_blocks(g, [n for n in names[i] if n.startswith("layers.")]) for g, i in zip(graphs, indices)]
        raw = concatenate(graphs, indices, name)
        # under pipeline parallel torchtitan's units (apply_fsdp's), none resharded (pipeline.with_pipeline)
        sharding = Sharding(layout.shard_world, self.sharding.reshard_after_forward if layout.pp == 1 else "torchtitan",
                            precision)
        graph = raw
        if sharding.world > 1:
            units = fsdp_units(raw, sharding.reshard_after_forward)
            unit_sizes = [sum(sizes.get(p, sizes.get("layers.*", 0)) for p in paths) for paths, _ in units]
            root = total - sum(unit_sizes)  # the root unit owns what no unit does (all-but-last: embedding, head)
            graph = shard_by_sizes(raw, units, unit_sizes, root, sharding.world, sharding.reshard_after_forward,
                                   precision)
        return graph

    def _deepened(self, key: tuple, count: int, held: bool) -> Graph:
        """Stage kind ``key``'s step with ``count`` blocks (:func:`deepen`), its output held to its backward where
        it is a pipeline stage (:func:`bonsai_core.pipeline.output_held`): the same for every layout that has such a
        stage, whatever its FSDP and HSDP degrees or schedule, so made once (the few most recent kept)."""
        from bonsai_core.pipeline import output_held

        if (key, count, held) in self.deep:
            self.deep.move_to_end((key, count, held))
            return self.deep[key, count, held]
        three, part_sizes, _ = self.stages[key]
        graph = three if count <= 3 else deepen(three, count, part_sizes.get("layers.*", 0))
        if graph is None:
            raise BonsaiError(f"{self.model}'s blocks are not alike: its layers cannot be traced as three repeated; "
                              "trace it whole (bonsai trace --tp/--pp ...).")
        self.deep[key, count, held] = output_held(graph) if held else graph
        while len(self.deep) > DEEPENED_KEPT:
            self.deep.popitem(last=False)
        return self.deep[key, count, held]

    def _n_layers(self) -> int:
        from bonsai_core.models import torchtitan as titan

        sizes = {k: self.options.get(k) for k in ("layers", "width", "heads", "vocab")}
        return titan.model_args(self.model[len(titan.PREFIX):], seq=self.seq, **sizes).n_layers


def named_blocks(graph: Graph, blocks: list[str]) -> Graph:
    """``graph`` (a stage's step) with its block stack's module paths renamed, in forward order, to ``blocks``
    (the stage's own, as torchtitan's split names them: ``layers.12``), so that the FSDP units of a rank's
    stages, found by path, are each stage's own even where two stages share one trace."""
    traced = list(dict.fromkeys(path.split(".")[1] for path, _, _ in graph.modules if path.startswith("layers.")))
    if len(traced) != len(blocks):
        raise BonsaiError(f"{graph.name!r} has {len(traced)} blocks where its stage has {len(blocks)}.")
    new = dict(zip(traced, (b.split(".")[1] for b in blocks)))

    def renamed(path: str) -> str:
        head, _, rest = path.partition(".")
        if head != "layers":
            return path
        index, dot, tail = rest.partition(".")
        return f"layers.{new[index]}{dot}{tail}"

    return graph.with_fields(modules=[[renamed(path), first, last] for path, first, last in graph.modules])


def _trace_stage_kinds(model: str, layout: Any, batch: int, seq: int, options: dict[str, Any], precision: str | None,
                       trace_kwargs: dict[str, Any], keys: list[tuple]) -> dict[tuple, tuple]:
    """For each stage kind in ``keys`` ((tp, cp, first, last, batch, precision, blocks)) of ``layout``'s rank: its
    first blocks (three at most) of such a stage traced, computing in ``precision``, not sharded, with each FSDP unit's unsharded bytes by
    module path (``"layers.*"``: a block's, in the traced dtype) and the root's."""
    import dataclasses

    from bonsai_core.fsdp import computing_in, unit_bytes
    from bonsai_core.parallel import check_supported, cp_inputs, meshes, parallelize, step_context, with_batch, world
    from bonsai_core.trace import built_for_tracing, trace_step

    step = {k: v for k, v in trace_kwargs.items() if k in ("profile", "autocast", "kernels")}
    out: dict[tuple, tuple] = {}
    spec = layout
    with world(spec) as spec:
        with built_for_tracing(model, trace_kwargs.get("seed", 0), **dict(options, seq=seq, batch=batch)) \
                as (net, inputs, loss_fn):
            check_supported(net, spec)
            spec = with_batch(spec, *inputs[0].shape[:2])
            dims = meshes(net, spec)
            if spec.pp == 1:
                _keep_layers(net, 3)
                parallelize(net, spec, dims)
                stages = [(net, cp_inputs(net, inputs, loss_fn, dims) if spec.cp > 1 else inputs, loss_fn, True, True)]
            else:
                from bonsai_core.pipeline import split_rank

                rank = split_rank(net, inputs, loss_fn, spec, dims, precision)
                stages = [(part, (x,), loss, first, last) for part, x, loss, first, last
                          in zip(rank.parts, rank.inputs, rank.losses, rank.first, rank.last)]
            for part, x, loss, first, last in stages:
                micro = batch if spec.pp == 1 else batch // spec.microbatches
                key = (spec.tp, spec.cp, first, last, micro, precision, min(len(part.layers), 3))
                if key not in keys or key in out:
                    continue
                _keep_layers(part, 3)
                with step_context(part, spec), computing_in(part, precision):
                    traced = trace_step(part, x, loss, name=f"{model} {spec.describe()}", **step)
                paths = [name for name, child in part.named_children() if child is not None and name != "layers"] \
                    + [f"layers.{k}" for k in part.layers]
                per, root = unit_bytes(part, [[p] for p in paths], precision)
                sizes = dict(zip(paths, per))
                if len(part.layers):
                    sizes["layers.*"] = unit_bytes(part.layers[next(iter(part.layers))], [], precision)[1]
                out[key] = (traced.graph, sizes, root)
    return out


def _keep_layers(model: Any, count: int) -> None:
    """``model``'s block stack cut to its first ``count`` blocks (torchtitan's ``layers`` ModuleDict)."""
    for key in list(model.layers)[count:]:
        del model.layers[key]


LAYOUT_METHODS = ["none", "torchtitan-selective", "torchtitan-full"]  # `bonsai fit --gpus`'s default: fixed plans
LARGEST_BATCH = 256


@dataclass
class LayoutsResult:
    """Every layout and local batch tried, and the seconds the traces took."""

    model: str
    gpus: int
    limit: int
    seq: int
    fits: list[LayoutFit]
    trace_seconds: float
    traces: int  # stage kinds traced (three blocks each)

    def best(self) -> list[LayoutFit]:
        """Each layout's largest local batch that fits (the least recompute there), most tokens per GPU first."""
        out: dict[str, LayoutFit] = {}
        for f in self.fits:
            key = f.layout.describe(rank=False)
            if f.fits and (key not in out or f.batch > out[key].batch):
                out[key] = f
        return sorted(out.values(), key=lambda f: (-f.tokens_per_gpu, f.overhead or 0.0))


def fit_layouts(model: str, gpus: int, limit: int, methods: list[str] | None = None, *, seq: int,
                options: dict[str, Any] | None = None, optimizer: str = "adamw", reserved: str | None = None,
                max_overhead: float = 1.0, solver_options: dict[str, Any] | None = None,
                progress: Callable[[str], None] | None = None, trace_kwargs: dict[str, Any] | None = None,
                largest_batch: int = LARGEST_BATCH) -> LayoutsResult:
    """What fits of torchtitan ``model`` on ``gpus`` GPUs of ``limit`` bytes each: for every layout of
    :func:`candidate_layouts` and local batch (doubled from the smallest the layout takes while any method fits,
    up to ``largest_batch``), the method with the least recompute whose plan fits every pipeline rank
    traced (each rank planned within ``limit`` on its own), and the tokens each GPU trains per step (local
    batch x seq / (TP x CP x PP)). Ranks are traced once per tensor, context and pipeline structure and batch,
    three blocks each (:class:`RankGraphs`). ``reserved`` bounds the allocator model's reserved bytes (a
    pipeline rank's replayed over its whole schedule: :mod:`bonsai_core.allocator.pipelined`)."""
    from bonsai_core.fsdp import Sharding
    from bonsai_core.models import torchtitan as titan

    if not model.startswith(titan.PREFIX):
        raise BonsaiError("--gpus searches the layouts torchtitan runs (TP, PP, CP, FSDP, HSDP): give a torchtitan: "
                          "model, or leave --gpus out to fit one rank of --fsdp N.")
    options = dict(options or {})
    options.pop("batch", None)
    sizes = {k: options.get(k) for k in ("layers", "width", "heads", "vocab")}
    args = titan.model_args(model[len(titan.PREFIX):], seq=seq, **sizes)
    methods = methods or LAYOUT_METHODS
    variants = {m: method_variant(m) for m in methods}
    sharding = Sharding.of(2, (trace_kwargs or {}).get("reshard_after_forward"),
                           (trace_kwargs or {}).get("mixed_precision"), model=model)
    graphs = RankGraphs(model, seq, options, sharding, trace_kwargs or {})
    fits: list[LayoutFit] = []
    for layout in candidate_layouts(gpus, args.n_layers, args.n_heads, args.n_kv_heads or args.n_heads, seq):
        batch = layout.pp if layout.pp > 1 else 1  # 1F1B runs at least one microbatch per stage
        while batch <= largest_batch:
            found = _fit_layout(graphs, layout, batch, seq, methods, variants, limit, reserved, max_overhead,
                                solver_options or {}, optimizer)
            fits.append(found)
            if progress:
                progress(f"{layout.describe(rank=False)}, local batch {batch}: " + (
                    f"{found.method} fits, peak {found.peak / 2**30:.2f} GiB, overhead {found.overhead:+.1%}"
                    if found.fits else f"does not fit ({found.reason})"))
            if not found.fits:
                break
            batch *= 2
    return LayoutsResult(model, gpus, limit, seq, fits, graphs.seconds, len(graphs.stages))


def _fit_layout(graphs: RankGraphs, layout: Any, batch: int, seq: int, methods: list[str], variants: dict,
                limit: int, reserved: str | None, max_overhead: float, solver_options: dict, optimizer: str) -> LayoutFit:
    tokens = batch * seq // (layout.tp * layout.cp * layout.pp)
    try:
        ranks = graphs.ranks(layout, batch, optimizer)
    except BonsaiError as e:
        return LayoutFit(layout, batch, False, tokens_per_gpu=tokens, reason=str(e).split(". ")[0])
    best: LayoutFit | None = None
    reasons = []
    for m in methods:
        method, own = variants[m]
        options = {} if method == "none" else {**solver_options, **own}
        live = _live_solve(ranks[0][1], method, options, limit) if reserved and best is not None else None
        if live is not None and not isinstance(live, BonsaiError) and live.stats["overhead"] >= best.overhead:
            continue  # no less recompute: its replays could not make it the layout's choice
        tries = []
        for rank, g in ranks:  # the method fits the layout only if it fits every rank: stop at the first that fails
            tries.append((rank, attempt(g, batch, method, limit, max_overhead, reserved, options,
                                        solved=live if rank == ranks[0][0] else None)))
            if not tries[-1][1].fits:
                break
        if not tries[-1][1].fits:
            reasons.append(f"{m}: rank {tries[-1][0]} {tries[-1][1].reason}")
            continue
        overhead = max(a.overhead for _, a in tries)
        peak = max(a.peak for _, a in tries)
        reserved_peak = max((a.reserved_peak or 0 for _, a in tries), default=0) or None
        if best is None or overhead < best.overhead:
            best = LayoutFit(layout, batch, True, m, peak, reserved_peak, overhead, tokens,
                             ranks=tuple((r, a.peak) for r, a in tries))
            if overhead <= 0:  # no recompute: no later method can have less
                break
    return best or LayoutFit(layout, batch, False, tokens_per_gpu=tokens, reason="; ".join(reasons))


def _live_solve(graph: Graph, method: str, options: dict, limit: int) -> Schedule | BonsaiError | None:
    """Fixed-plan ``method``'s live solve on ``graph`` within ``limit`` (its schedule, or the error it raised; None
    for a method that plans for a budget): its plan is the same at every budget, so its recompute is known before
    the allocator replays of ``--reserved``, and a layout's recompute is the most over its ranks, so no less on one
    rank is no less for the layout. The reserved solve starts from this answer instead of solving again."""
    from bonsai_core.solvers import FIXED_PLAN_METHODS, solve

    if method not in FIXED_PLAN_METHODS:
        return None
    try:
        return solve(graph, limit, method, **options)
    except BonsaiError as e:  # over the limit on live bytes: attempt says so
        return e


def layouts_markdown(result: LayoutsResult) -> str:
    """The table of what fits: each layout's largest local batch and its plan, most tokens per GPU first; then
    the layouts where nothing fits at the smallest batch."""
    import pandas as pd

    from bonsai_core.units import format_bytes

    rows = [f.row() for f in result.best()]
    fitted = {f.layout.describe(rank=False) for f in result.best()}
    never = {f.layout.describe(rank=False): f for f in result.fits if f.layout.describe(rank=False) not in fitted}
    out = [f"What fits of {result.model} (seq {result.seq}) on {result.gpus} GPUs of {format_bytes(result.limit)}: "
           f"{len(fitted)} of {len(fitted) + len(never)} layouts.", ""]
    if rows:
        out.append(pd.DataFrame(rows).drop(columns=["fits", "why not"]).to_markdown(index=False))
    if never:
        out += ["", "Layouts where nothing fits at the smallest local batch:", "",
                pd.DataFrame([{"layout": k, "local batch": f.batch, "why not": f.reason} for k, f in never.items()])
                .to_markdown(index=False)]
    return "\n".join(out)
