"""The slider's positions solved in the background: a sweep per graph, method and options.

After a session's solve at a slider position, one background thread (shared by every session of the
server) solves every other position of the budget slider for the same graph, method and options
through :func:`explorer.compute.solve`, whose cache every session reads and which keeps each plan on
disk (:mod:`explorer.disk`: a model opened again finds its sweep solved). With the granularity set, the
granularities the sidebar offers are then solved at the session's budget the same way.

Order: coarse to fine around the session's position (every 16th position, then every 8th, 4th, 2nd, each
level nearest first), so that the nearest solved position is never far; a position a session asks for before
its turn goes next. On the budget axis, positions below every budget met so far wait until those above are
done and then go down one by one (:func:`_take`): near the lowest budget a method meets one solve can cost
as much as the rest of the sweep. Below a budget the method cannot meet (a solve that ended within its time
limit: one that ran out of it says nothing of lower budgets) nothing more is solved: nothing lower fits
(each lower position's answer says so, quoting the method). What the pages draw beside a plan is put off
until every position is answered: its recompute patterns and lifetime bars in this thread
(``Sweep.later``); an FSDP rank's allocator replays and bonsai's reach for the Solve page's note (on
torchtitan's 8B step the reach alone builds the largest rung's model for minutes) in a child process at the
lowest priority, which keeps them on disk (:mod:`explorer.background`): in this process they held the
interpreter's lock between a session's steps. The sweep is done (:attr:`Sweep.done`) once both are. Each
solve runs with the session's own options and time limit, so that a sweep's plan is the one the session
would get (bonsai's ILP keeps its LP relaxation between budgets: :mod:`bonsai_core.solvers.relaxation`);
the limit counts the solving thread's CPU seconds (:func:`bonsai_core.solvers.deadline.cpu_seconds`), so
that a sweep sharing the machine with sessions finds the plans a quiet machine finds.

While a sweep runs, a session that asks for a position not solved yet is answered at once with the
nearest solved plan that fits its budget (a lower position's; else the nearest above), marked as such
(``Outcome.stand_in_for``); the sidebar shows how far the sweep is (:func:`progress`) and the page
updates when the position is solved. ``BONSAI_SOLVE_AHEAD=0`` turns sweeps off: every position is then
solved when a session asks for it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from bonsai_core.graph import Graph
from bonsai_core.units import format_bytes
from explorer import background, compute

SLIDER = range(5, 101)  # the sidebar's budget slider, % of the no-remat peak
STRIDES = (16, 8, 4, 2, 1)  # the sweep's levels, coarse to fine
SWEEPS_KEPT = 16  # sweeps remembered (finished or not); the oldest is forgotten past this

BUDGET, GRANULARITY = "budget", "granularity"  # the axis a sweep moves along

_lock = threading.Lock()
_sweeps: dict[tuple, "Sweep"] = {}  # key -> sweep, oldest first
_worker: threading.Thread | None = None  # the thread while it runs


def enabled() -> bool:
    return os.environ.get("BONSAI_SOLVE_AHEAD", "1").strip().lower() not in ("0", "false", "no", "off")


def budget_at(pct: float, reference: int) -> int:
    """The budget in bytes at slider position ``pct`` (% of the no-remat peak ``reference``)."""
    return int(math.floor(pct / 100 * reference))


def order(positions: list[int], start: int) -> list[int]:
    """``positions`` (ascending) coarse to fine around ``start``: every 16th position counted from
    ``start``'s place, then every 8th, 4th, 2nd, 1st, each level nearest to ``start`` first (above before
    below at a tie: larger budgets are usually cheaper); ``start`` itself left out."""
    at = positions.index(start) if start in positions else min(range(len(positions)),
                                                               key=lambda i: abs(positions[i] - start))
    seen, out = {at}, []
    for stride in STRIDES:
        level = [i for i in range(len(positions)) if (i - at) % stride == 0 and i not in seen]
        level.sort(key=lambda i: (abs(i - at), i < at))
        out += level
        seen.update(level)
    return [positions[i] for i in out if positions[i] != start]


@dataclass
class Sweep:
    """One sweep: a graph, a method and its options, the positions along one axis (slider % of the
    budget, or granularities at one budget) and what is known of each."""

    graph: Graph
    method: str
    options: compute.Options  # the session's, without the granularity on the granularity axis
    reserved: str | None
    reference: int  # the no-remat peak: the slider's 100%
    axis: str  # BUDGET or GRANULARITY
    positions: list[int]  # every position of the axis, ascending
    todo: list[int]  # positions still to solve, in order
    at: int | None = None  # the budget slider position a granularity sweep solves at
    solved: dict[int, bool] = field(default_factory=dict)  # position -> solved with a schedule (False: an error)
    derived: dict[int, compute.Outcome] = field(default_factory=dict)  # positions below one the method cannot meet
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    solving: int | None = None  # the position being solved now
    later: list = field(default_factory=list)  # work for the pages once every position is answered (callables)
    reach_due: bool = False  # bonsai's reach goes to the child process
    child: subprocess.Popen | None = None  # the child process doing the rest (explorer.background), once started
    ready: float | None = None  # when this thread's put-off work ended
    asked: int | None = None  # the position a session asked for last (:func:`answer`): it goes next

    @property
    def key(self) -> tuple:
        return key_of(self.graph, self.method, self.options, self.reserved, self.axis, self.at)

    def settings(self, p: int) -> tuple[int, compute.Options]:
        """(budget in bytes, options) at position ``p``."""
        if self.axis == BUDGET:
            return budget_at(p, self.reference), self.options
        return budget_at(self.at, self.reference), tuple(sorted((*self.options, ("granularity", p))))

    def solve(self, p: int) -> compute.Outcome:
        budget, options = self.settings(p)
        return compute.solve(self.graph, budget, self.method, options, self.reserved)

    @property
    def known(self) -> int:
        """Positions answered so far (solved, or below one the method cannot meet)."""
        return len(self.solved) + len(self.derived)

    @property
    def seconds(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    @property
    def done(self) -> bool:
        """Every position answered and what a drag draws beside its plan prepared: this thread's put-off work
        ended and the child process's too."""
        return self.ready is not None and (self.child is None or self.child.poll() is not None)

    def put_off(self) -> None:
        """Start the child process on the work this sweep put off (:mod:`explorer.background`): the allocator
        replays of its plans on an FSDP rank (what the per-rank chart draws), and bonsai's reach when due."""
        plans = [(compute.with_defaults(self.method, options), budget)
                 for budget, options in map(self.settings, sorted(q for q, ok in self.solved.items() if ok))]
        self.child = background.start(self.graph, self.method, self.reserved,
                                      plans if self.graph.fsdp is not None else [], self.reach_due)

    def nearest(self, p: int) -> int | None:
        """The solved position with a schedule nearest to ``p`` whose plan fits ``p``'s budget (the nearest
        below, on the budget axis); else the nearest with a schedule at all."""
        ok = [q for q, fine in self.solved.items() if fine]
        below = [q for q in ok if q < p] if self.axis == BUDGET else []
        if below:
            return max(below)
        place = {q: i for i, q in enumerate(self.positions)}  # granularities: near on their log scale
        return min(ok, key=lambda q: (abs(place[q] - place[p]), q), default=None)


def key_of(graph: Graph, method: str, options: compute.Options, reserved: str | None, axis: str,
           at: int | None = None) -> tuple:
    return (graph.hash, method, tuple(options), reserved, axis, at)


def without_granularity(options: compute.Options) -> compute.Options:
    return tuple((k, v) for k, v in options if k != "granularity")


def start(graph: Graph, out: compute.Outcome, reference: int, pct: int,
          granularities: list[int] | None = None) -> None:
    """After a session's solve ``out`` at slider position ``pct``: sweep the budget slider for its graph,
    method and options (once), and with ``granularities`` (the sidebar's, when the session set one) those
    granularities at ``pct``."""
    if out.method == "none" or not enabled():
        return
    granularity = dict(out.options).get("granularity")
    jobs = [(BUDGET, out.options, list(SLIDER), pct, None)]
    if granularities and granularity is not None:
        jobs.append((GRANULARITY, without_granularity(out.options), sorted(granularities), granularity, pct))
    with _lock:
        for axis, options, positions, first, at in jobs:
            key = key_of(graph, out.method, options, out.reserved, axis, at)
            if key in _sweeps:
                continue
            if axis == GRANULARITY:  # the granularities at one budget: only at the session's latest
                for other in [k for k, sw in _sweeps.items() if sw.axis == GRANULARITY and k[:4] == key[:4]]:
                    _sweeps[other].todo.clear()
            sweep = Sweep(graph, out.method, options, out.reserved, reference, axis, positions,
                          order(positions, first), at)
            if first in positions:
                sweep.solved[first] = out.ok
            _sweeps[key] = sweep
            while len(_sweeps) > SWEEPS_KEPT:
                del _sweeps[next(iter(_sweeps))]
        _wake()


def _wake() -> None:
    """Start the worker thread if it is not running (callers hold ``_lock``)."""
    global _worker
    if _worker is None and any(s.todo for s in _sweeps.values()):
        _worker = threading.Thread(target=_work, name="bonsai-sweep", daemon=True)
        _worker.start()


def find(graph: Graph, method: str, options: compute.Options, reserved: str | None,
         pct: int) -> tuple[Sweep | None, int | None]:
    """(the sweep the sidebar's settings are on, the position in it) for a session at slider position
    ``pct``: the granularity sweep at ``pct`` when the options set a granularity and it exists, else the
    budget sweep; (None, None) when there is none."""
    granularity = dict(options).get("granularity")
    with _lock:
        if granularity is not None:
            sweep = _sweeps.get(key_of(graph, method, without_granularity(options), reserved, GRANULARITY, pct))
            if sweep is not None and granularity in sweep.positions:
                return sweep, granularity
        sweep = _sweeps.get(key_of(graph, method, options, reserved, BUDGET))
        return (sweep, pct) if sweep is not None else (None, None)


def answer(graph: Graph, method: str, options: compute.Options, reserved: str | None,
           pct: int) -> compute.Outcome | None:
    """What a session at slider position ``pct`` is shown without a solve of its own: a position below one
    the method cannot meet, or while the sweep has not reached this position, the nearest solved plan
    (marked ``stand_in_for``; the position then goes next). None: solve it (solved already, kept on disk,
    or no sweep runs)."""
    sweep, p = find(graph, method, options, reserved, pct)
    if sweep is None:
        return None
    with _lock:
        if p in sweep.derived:
            return sweep.derived[p]
        if p in sweep.solved or p not in sweep.positions or not sweep.todo:
            return None
        budget, settings = sweep.settings(p)
        if compute.kept(graph, budget, method, settings, reserved):
            return None  # on disk: read at once
        near = sweep.nearest(p)
        if p != sweep.solving and p in sweep.todo:  # this position next
            sweep.todo.remove(p)
            sweep.todo.insert(0, p)
            sweep.asked = p
    if near is None:
        return None
    return dataclasses.replace(sweep.solve(near), stand_in_for=float(p))


def progress(graph: Graph, method: str, options: compute.Options, reserved: str | None,
             pct: int) -> Sweep | None:
    """The sweep a session at ``pct`` with these settings is on (:func:`find`), None when there is none."""
    return find(graph, method, options, reserved, pct)[0]


def _next() -> tuple[Sweep, int | Callable[[], None]] | None:
    """The newest budget sweep with positions left (then granularity sweeps), and its next position
    (taken off its list); once no sweep has positions left, the pages' work a sweep put off
    (``Sweep.later``); None when none is left, and then the worker is marked gone under the same lock
    (a sweep started from then on starts a new thread)."""
    global _worker
    with _lock:
        sweeps = sorted(reversed(list(_sweeps.values())), key=lambda sw: sw.axis != BUDGET)
        for sweep in sweeps:
            sweep.todo = [q for q in sweep.todo if q not in sweep.solved and q not in sweep.derived]
            if sweep.todo:
                p = _take(sweep)
                sweep.solving = p
                return sweep, p
            if sweep.ended is None:
                sweep.ended = time.perf_counter()
                sweep.later.insert(0, sweep.put_off)  # first: the child works beside this thread
        for sweep in sweeps:
            if sweep.later:
                return sweep, sweep.later.pop(0)
            if sweep.ready is None and sweep.ended is not None:
                sweep.ready = time.perf_counter()
        _worker = None
    return None


def _take(sweep: Sweep) -> int:
    """Take ``sweep``'s next position off its list: the first, except on the budget axis below every budget
    the method has met, where a solve costs the most (near the lowest budget it meets: on torchtitan's 8B
    step 21% and 22% of the no-remat peak use their whole 20 s limit, most positions under 1 s). Such a
    position waits until no position above the lowest met one is left, and then the highest of them goes
    first: each is tried just below the lowest met budget, so a sweep reaches its unmet end last, once, the
    neighbouring budget's plan just found (the next rounding's neighbourhood). A position a session asked for
    (:func:`answer`) goes first all the same."""
    met = [q for q, fine in sweep.solved.items() if fine]
    if sweep.axis != BUDGET or not met or sweep.todo[0] == sweep.asked:
        return sweep.todo.pop(0)
    above = [q for q in sweep.todo if q > min(met)]
    p = above[0] if above else max(sweep.todo)
    sweep.todo.remove(p)
    return p


def _work() -> None:
    while True:
        found = _next()
        if found is None:
            return
        sweep, p = found
        try:
            if callable(p):
                p()
                continue
            _solve(sweep, p)
        except Exception:  # a bug here must not end the thread for the sweeps behind it
            logging.getLogger(__name__).exception("sweeping stopped at %s", p)
        finally:
            sweep.solving = None


def _solve(sweep: Sweep, p: int) -> None:
    """Solve position ``p`` of ``sweep``; below a budget the method cannot meet, nothing lower is solved."""
    out = sweep.solve(p)
    ran_out = compute.ran_out(out, dict(sweep.settings(p)[1]).get("time_limit"))  # says nothing of lower budgets
    with _lock:
        sweep.solved[p] = out.ok
        if sweep.axis == BUDGET and not out.ok and not ran_out:
            lower = [q for q in sweep.positions if q < p and q not in sweep.solved]
            for q in lower:
                budget, options = sweep.settings(q)
                sweep.derived[q] = compute.Outcome(
                    sweep.method, budget, options, reserved=sweep.reserved,
                    error=f"Not solved: {sweep.method} found no plan at {p}% of the no-remat peak "
                          f"({format_bytes(budget_at(p, sweep.reference))}), a larger budget, so none is expected "
                          f"at {q}%. What it said at {p}%: {out.error}")
            sweep.todo = [q for q in sweep.todo if q not in lower]
    # put off until every position is answered: a position's plan first, then what the pages draw beside it
    with _lock:
        if out.ok:  # what the Memory page draws of a plan, so that a drag after the sweep only reads it
            sweep.later.append(lambda: (compute.rebuilds(sweep.graph, out),
                                        compute.lifetime_rows(sweep.graph, out, "time")))  # the page's default axis
        elif sweep.method == "bonsai" and sweep.axis == BUDGET:
            sweep.reach_due = True  # the Solve page's note under bonsai's error
