"""Solving the budget slider's other positions in the background, outward from a session's.

After a session solves its model at one slider position, one background thread (shared by every
session of the server) solves the positions around it, outward, with the same method and options through
:func:`explorer.compute.solve`, whose cache every session reads: a drag then finds its plan solved.
On a small machine serving a classroom this is what keeps a drag fast while ten sessions drag at once
(docs/results/explorer.md has the measurements); bonsai's reuse of a plan across budgets makes most positions
free. Jobs stay small: each background solve runs with its time limit capped at
:data:`SLOW_SOLVE_SECONDS` (one that reaches the cap is thrown away, see ``compute.solve``'s ``_cap``),
so a session's own solve never waits longer than that for the graph's problem; the side below stops
at the first budget the method cannot meet (a lower one will not fit either) or the first capped
solve, the side above goes on past a capped solve (larger budgets are usually easier), and a job
stops after :data:`JOB_SECONDS`. ``BONSAI_SOLVE_AHEAD=0`` turns it off.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict

from bonsai_core.graph import Graph
from explorer import compute

SLIDER = range(5, 101)  # the sidebar's budget slider, % of the no-remat peak
SLOW_SOLVE_SECONDS = 3.0
JOB_SECONDS = 30.0
PENDING_KEPT = 8  # jobs waiting; the oldest is dropped past this (its sessions moved on)

_lock = threading.Lock()
_pending: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (graph, method, options, reference, pct, reserved)
_started: set[tuple] = set()  # keys whose job ran or runs: each (graph, method, options) once
_worker: threading.Thread | None = None  # the thread while it runs


def enabled() -> bool:
    return os.environ.get("BONSAI_SOLVE_AHEAD", "1").strip().lower() not in ("0", "false", "no", "off")


def budget_at(pct: float, reference: int) -> int:
    """The budget in bytes at slider position ``pct`` (% of the no-remat peak ``reference``)."""
    return int(math.floor(pct / 100 * reference))


def solver_seconds(out: compute.Outcome) -> float:
    """The solver's own time (without building its problem): about what a neighbour's solve takes."""
    return float(out.schedule.stats.get("solve_seconds", out.wall_seconds)) if out.ok else out.wall_seconds


def solve_ahead(graph: Graph, out: compute.Outcome, reference: int, pct: int) -> None:
    """Queue the slider positions around ``pct`` for ``graph`` solved with the method and options of
    ``out``, a session's solve at ``pct`` (once per graph, method and options; the newest request runs
    first). After a solve slower than the cap nothing is queued: its neighbours would reach the cap too."""
    global _worker
    method, options, reserved = out.method, out.options, out.reserved
    if method == "none" or solver_seconds(out) > SLOW_SOLVE_SECONDS or not enabled():
        return
    key = (graph.hash, method, options, reserved)
    with _lock:
        if key in _started or key in _pending:
            return
        _pending[key] = (graph, method, options, reference, pct, reserved)
        while len(_pending) > PENDING_KEPT:
            _pending.popitem(last=False)
        if _worker is None:
            _worker = threading.Thread(target=_work, name="bonsai-solve-ahead", daemon=True)
            _worker.start()


def _work() -> None:
    global _worker
    while True:
        with _lock:
            if not _pending:
                _worker = None  # under the lock: a job queued from now on starts a new thread
                return
            key, job = _pending.popitem(last=True)
            _started.add(key)
        try:
            _run(*job)
        except Exception:  # a bug here must not end the thread for the jobs behind it
            logging.getLogger(__name__).exception("solving ahead stopped")


def _run(graph: Graph, method: str, options: compute.Options, reference: int, pct: int,
         reserved: str | None = None) -> None:
    """Solve the positions outward from ``pct``, below and above in turn, the side that has taken less
    solver time first: cheap positions (usually the larger budgets) are not held up behind costly ones."""
    start = time.perf_counter()
    sides = {-1: iter(range(pct - 1, SLIDER.start - 1, -1)), 1: iter(range(pct + 1, SLIDER.stop))}
    spent = dict.fromkeys(sides, 0.0)
    while sides and time.perf_counter() - start < JOB_SECONDS:
        side = min(sides, key=lambda d: (spent[d], d))  # a tie: below first
        p = next(sides[side], None)
        if p is None:
            del sides[side]
            continue
        began = time.perf_counter()
        try:  # capped: a user's solve waiting for the graph's problem waits no longer than the cap
            out = compute.solve(graph, budget_at(p, reference), method, options, reserved, _cap=SLOW_SOLVE_SECONDS)
        except compute.Unfinished:
            if side < 0:
                del sides[side]  # smaller budgets are harder: solved on demand only
            continue  # above, one hard budget (e.g. the first that fits at all) need not hold up easier ones
        finally:
            spent[side] += time.perf_counter() - began
        if side < 0 and not out.ok:
            del sides[side]  # below a budget the method cannot meet, nothing fits either
