"""A MIP start for Checkmate's MILP: another method's schedule as R, S, FREE and U.

On the 1-layer zoo GPT at 60% of its peak, neither HiGHS nor SCIP finds an incumbent of the MILP in
60 s where ``moccasin`` proves its optimum in seconds (docs/results/checkmate_moccasin.md). So ``checkmate``
first asks cheaper methods for a schedule within the budget (:func:`find_start`), converts the
cheapest into the MILP's variables, and hands that to the backend as its first incumbent.

Converting a schedule (:func:`convert_schedule`):

1. its compute sequence in the contracted graph's ids (the views dropped: the MILP has none);
2. cut into stages (:func:`stage_recomputes`): stage t is what the schedule recomputes before
   node t's first computation; the first computations must come in listed order, and a stage may
   recompute a node once (R is binary); each stage's recomputations are put in listed order;
3. replayed by :func:`~bonsai_core.schedule.schedule_ops` (every copy freed right after its last
   use) and read off (:func:`start_vector`): R from the computations, S from what is resident when
   each stage begins, FREE from each free that follows a computation other than the stage's last;
4. U from the model's own memory rows (:func:`start_memory`), and every row of the model checked
   (:func:`broken_rows`): a start that breaks one is refused, saying which.

The vector so made reads back (R alone, as ``checkmate`` reads any solution) into the schedule it
came from: the same compute cost and a peak no higher (tested).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from bonsai_core.errors import BonsaiError, BudgetError, ScheduleError
from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, Schedule, schedule_ops, simulate
from bonsai_core.solvers.checkmate_model import CheckmateMatrices
from bonsai_core.solvers.stages import stage_sequence
from bonsai_core.units import format_bytes

# Methods asked for a start, in turn: the plain schedule (optimal when it fits), the heuristics (a
# fraction of a second), Moccasin's CP model (the stage model with at most two computations per node),
# then bonsai (whose op-level plans may compute a node more than twice, so even a proven moccasin
# optimum does not make it redundant).
START_METHODS = ("none", "chen", "dtr", "moccasin", "bonsai")
# Share of the search's seconds moccasin may use (the others are fast; they get what is left).
MOCCASIN_SHARE = 2 / 3
# Slack when checking a start against the model's rows (memory units are near 1).
_TOLERANCE = 1e-6


class NotConvertible(Exception):
    """A schedule that is not a solution of the MILP; the message says why, in a few words."""


@dataclass(frozen=True)
class WarmStart:
    """A feasible point of the MILP made from ``method``'s schedule."""

    method: str
    x: np.ndarray  # R, S, FREE: the binaries, in the model's column order
    u: np.ndarray  # U: memory at each (stage, node), in memory units
    objective: float  # the model's objective at x: the recomputation cost in cost units
    compute_cost: float  # the schedule's compute cost, seconds (simulated)
    overhead: float  # the schedule's overhead (simulated)
    peak: int  # the schedule's peak, bytes (simulated)

    def values(self) -> np.ndarray:
        """Every column of the MILP: x then u."""
        return np.concatenate((self.x, self.u))


@dataclass
class StartSearch:
    """What :func:`find_start` found: the cheapest start, or None, and a note per method tried."""

    start: WarmStart | None
    notes: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def describe(self) -> str:
        """One line for ``stats["warm_start"]``: the start, or why there is none."""
        if self.start is not None:
            s = self.start
            return f"{s.method}, cost {s.compute_cost:.6g} s (overhead {s.overhead:+.2%}), found in {self.seconds:.1f} s"
        tried = "; ".join(f"{m}: {why}" for m, why in self.notes.items())
        return f"none ({tried})" if tried else "none"


def contracted_sequence(graph: Graph, kept: np.ndarray, schedule: Schedule) -> list[int]:
    """The schedule's compute sequence in the contracted graph's ids (``kept`` maps them to the
    graph's); the contracted views, which the MILP does not have, are dropped."""
    new_id = np.full(graph.n, -1, dtype=np.int64)
    new_id[kept] = np.arange(len(kept))
    ids = new_id[[v for kind, v in schedule.ops if kind == COMPUTE]]
    return ids[ids >= 0].tolist()


def stage_recomputes(sequence: list[int], n: int) -> list[list[int]]:
    """A compute sequence of an n-node graph cut into the stage model's stages: for each stage t, the
    nodes recomputed before node t's first computation, in listed order. NotConvertible when the
    first computations are not in listed order, a node is recomputed twice within one stage, or
    something is recomputed after the last node."""
    stages: list[list[int]] = []
    pending: list[int] = []
    for v in sequence:
        t = len(stages)
        if v == t:
            if len(set(pending)) < len(pending):
                twice = next(u for u in pending if pending.count(u) > 1)
                raise NotConvertible(f"recomputes node {twice} twice before node {t}'s first computation")
            stages.append(sorted(pending))
            pending = []
        elif v > t:
            raise NotConvertible(f"computes node {v} before node {t}: not in the listed order")
        else:
            pending.append(v)
    if len(stages) < n:
        raise NotConvertible(f"never computes node {len(stages)}")
    if pending:
        raise NotConvertible("recomputes nodes after the last one")
    return stages


def _free_columns(m: CheckmateMatrices, stage: np.ndarray, node: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Columns of FREE[stage, node, after] (-1 where the model has no such variable)."""
    if not len(m.free_stage):
        return np.full(len(stage), -1, dtype=np.int64)
    n = m.n
    keys = (m.free_stage * n + m.free_node) * n + m.free_after
    order = np.argsort(keys, kind="stable")
    wanted = (stage * n + node) * n + after
    pos = np.minimum(np.searchsorted(keys[order], wanted), len(keys) - 1)
    return np.where(keys[order][pos] == wanted, 2 * m.q + order[pos], -1)


def start_vector(small: Graph, m: CheckmateMatrices, recomputes: list[list[int]]) -> np.ndarray:
    """R, S and FREE of the stage schedule ``recomputes`` (of the contracted graph), replayed with every
    copy freed right after its last use: R[t, i] for each recomputation, S[t, i] for each node
    resident when stage t begins, FREE[t, i, k] for each free of i right after k in stage t (k not the
    stage's own node: a free after it shows in the next stage's S)."""
    ops = schedule_ops(small, stage_sequence(recomputes))
    resident = np.zeros(small.n, dtype=bool)
    r_t, r_i, s_t, s_i, f_t, f_i, f_k = [], [], [], [], [], [], []
    stage, begins, last = 0, True, -1  # the stage of the next computation; whether it opens the stage
    for kind, v in ops:
        if kind == COMPUTE:
            if begins:
                held = np.flatnonzero(resident).tolist()
                s_t += [stage] * len(held)
                s_i += held
                begins = False
            if v == stage:  # the stage's own node, computed for the first time: its stage ends here
                stage, begins = stage + 1, True
            else:
                r_t.append(stage)
                r_i.append(v)
            resident[v] = True
            last = v
        else:
            resident[v] = False
            last_stage = stage - 1 if begins else stage
            if last != last_stage:
                f_t.append(last_stage)
                f_i.append(v)
                f_k.append(last)
    x = np.zeros(m.nx)
    x[m.r_col(np.array(r_t, dtype=np.int64), np.array(r_i, dtype=np.int64))] = 1.0
    x[m.s_col(np.array(s_t, dtype=np.int64), np.array(s_i, dtype=np.int64))] = 1.0
    cols = _free_columns(m, np.array(f_t, dtype=np.int64), np.array(f_i, dtype=np.int64),
                         np.array(f_k, dtype=np.int64))
    x[cols[cols >= 0]] = 1.0  # a free the model has no variable for leaves U an upper bound: checked later
    return x


def start_memory(m: CheckmateMatrices, x: np.ndarray) -> np.ndarray:
    """U from the model's memory rows ``eq_x @ x + eq_u @ u == eq_rhs`` (eq_u is unit lower
    bidiagonal within each stage: a triangular solve)."""
    from scipy.sparse.linalg import spsolve_triangular

    return spsolve_triangular(m.eq_u.tocsr(), m.eq_rhs - m.eq_x @ x, lower=True)


def broken_rows(m: CheckmateMatrices, x: np.ndarray, u: np.ndarray, budget_units: float) -> str | None:
    """None when (x, u) satisfies every row of the model under ``budget_units``; else which rows
    it breaks, in words."""
    if len(m.eq_rhs) and np.abs(m.eq_x @ x + m.eq_u @ u - m.eq_rhs).max() > _TOLERANCE * max(1.0, budget_units):
        return "the memory rows do not hold"
    if m.ineq_x.shape[0]:
        excess = m.ineq_x @ x - m.ineq_rhs
        bad = np.flatnonzero(excess > _TOLERANCE)
        if len(bad):
            starts = [first for _, first in m.ineq_families]
            family = m.ineq_families[int(np.searchsorted(starts, bad[0], side="right")) - 1][0]
            return f"breaks {len(bad)} of the model's rows, first of family {family!r}"
    if len(u) and u.max() > budget_units + _TOLERANCE:
        return "its memory in the model is over the budget"
    return None


def convert_schedule(graph: Graph, small: Graph, kept: np.ndarray, m: CheckmateMatrices, schedule: Schedule,
                     budget_units: float) -> tuple[np.ndarray, np.ndarray]:
    """(x, u): ``schedule`` (of ``graph``) as a feasible point of the MILP of ``small`` (the graph
    without its views; ``kept`` maps its ids to ``graph``'s) under ``budget_units``. NotConvertible
    with the reason when it is not one."""
    recomputes = stage_recomputes(contracted_sequence(graph, kept, schedule), small.n)
    try:
        x = start_vector(small, m, recomputes)
    except ScheduleError as e:
        raise NotConvertible(f"its stages in listed order are not a valid schedule ({e})") from None
    u = start_memory(m, x)
    broken = broken_rows(m, x, u, budget_units)
    if broken:
        raise NotConvertible(broken)
    return x, u


def _short(error: BonsaiError) -> str:
    """A method's error in a few words, for a note."""
    if isinstance(error, BudgetError):
        return "no schedule within the budget"
    first = str(error).split(". ")[0]
    return first if len(first) <= 160 else first[:157] + "..."


def find_start(graph: Graph, budget: int | None, small: Graph, kept: np.ndarray, m: CheckmateMatrices,
               budget_units: float, seconds: float) -> StartSearch:
    """The cheapest schedule among :data:`START_METHODS`' that is a feasible point of the MILP,
    within about ``seconds`` for all of them; a note per method (its cost, or why it is no start).
    Stops at a schedule with no recomputation (optimal)."""
    from bonsai_core.solvers import solve

    clock = time.perf_counter()
    search = StartSearch(None)
    for method in START_METHODS:
        left = seconds - (time.perf_counter() - clock)
        if method == "moccasin":
            left = min(left, seconds * MOCCASIN_SHARE)
        if left <= 0:
            search.notes[method] = "skipped: no time left"
            continue
        try:
            schedule = solve(graph, budget, method, time_limit=left)
            x, u = convert_schedule(graph, small, kept, m, schedule, budget_units)
        except BonsaiError as e:
            search.notes[method] = _short(e)
            continue
        except NotConvertible as e:
            search.notes[method] = f"not a start: {e}"
            continue
        sim = simulate(graph, schedule)
        start = WarmStart(method, x, u, float(m.objective @ x), sim.compute_cost, sim.overhead, sim.peak)
        status = schedule.stats.get("status", "")
        search.notes[method] = f"{status + ', ' if status else ''}overhead {sim.overhead:+.2%}, peak {format_bytes(sim.peak)}"
        if search.start is None or start.objective < search.start.objective:
            search.start = start
        if start.objective <= 0:
            break  # nothing recomputed: optimal
    search.seconds = time.perf_counter() - clock
    return search
