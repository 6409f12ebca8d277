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
from dataclasses import dataclass, field, replace
from typing import Any, Callable

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
            options: dict[str, Any]) -> Attempt:
    """``method`` on ``graph`` under ``limit`` bytes (its reserved bytes with allocator ``reserved``)."""
    from bonsai_core.solvers import FIXED_PLAN_METHODS, solve, solve_reserved
    from bonsai_core.units import format_bytes

    if limit < graph.peak_lower_bound:  # no method can fit: say what does not
        what = (f"the fixed memory alone (parameters, gradients, optimizer state, batch) is {format_bytes(graph.fixed_mem)}"
                if limit < graph.fixed_mem else
                f"the optimizer step needs {format_bytes(graph.optimizer_peak)}"
                if graph.optimizer_peak == graph.peak_lower_bound else
                f"its largest op needs {format_bytes(graph.peak_lower_bound)}")
        return Attempt(method, size, False, reason=what)
    start = time.perf_counter()
    try:
        if reserved:
            schedule = solve_reserved(graph, limit, method, policy=reserved, **options)
        else:
            schedule = solve(graph, limit, method, **options)
    except BudgetError:
        return Attempt(method, size, False, seconds=time.perf_counter() - start,
                       reason="no-remat peak over the limit" if method == "none" else "its fixed plan peaks over the limit"
                       if method in FIXED_PLAN_METHODS else "no schedule within the limit")
    except SolverError as e:
        return Attempt(method, size, False, seconds=time.perf_counter() - start, reason=f"solver: {e}")
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
    (``batch`` or ``seq``); ``options`` fix the others; ``optimizer`` adds its state and step
    (``bonsai_core.optimizer``); ``reserved`` ("caching" or "expandable") makes ``limit`` bound the
    allocator model's reserved bytes; ``solver_options`` go to every method (``time_limit`` ...), a variant's
    own options (:func:`method_variant`) on top. ``traced``: the step at some sizes, traced already (without
    an optimizer), used instead of tracing them again; ``answered`` is called with each attempt as it ends."""
    from bonsai_core.optimizer import with_optimizer
    from bonsai_core.trace import trace_model

    if vary not in ("batch", "seq"):
        raise BonsaiError(f"--vary {vary!r}: fit searches the micro-batch ('batch') or the sequence length ('seq').")
    options = {k: v for k, v in (options or {}).items() if k != vary}
    variants = {m: method_variant(m) for m in methods}  # refused before any trace
    attempts: list[Attempt] = []
    traces: dict[int, float] = {}
    peaks: dict[int, int] = {}

    graphs: dict[int, Graph] = {}
    ahead = _Tracer(lambda size: trace_model(model, **(trace_kwargs or {}), **options, **{vary: size}).graph)

    def graph_at(size: int) -> Graph:
        if size not in graphs:
            base = (traced or {}).get(size)
            if base is None:
                base, traces[size] = ahead.get(size)
            graphs[size] = with_optimizer(base, optimizer)
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
