"""The ``moccasin`` method: Moccasin's retention-interval CP model (Bartan et al., ICML 2023), CP-SAT.

Time is Checkmate's stage grid laid out as one axis (Moccasin's ``use_stage`` model): event
``(t, o) -> t(t+1)/2 + o`` for ``o <= t`` is "node o may be computed in stage t", so stage t runs the
events of nodes 0..t in listed order and ends with node t's first computation. Each node v has up to
C copies (option ``copies``); copy c is an optional interval ``[start, end)`` over that axis: it is
computed at ``start`` (an event of node v) and stays resident until ``end``.

* copy 0 is present and starts at event (v, v), v's first computation; copy c > 0 is present only if
  copy c-1 is, and starts at or after copy c-1's end (at most one copy of a node is resident); a
  later copy of a separated output (``Graph.output_of``: its bytes come only with its op's kernel)
  starts in the stage of a later copy of its op, right after it;
* memory: ``AddCumulative`` of every copy's interval with demand ``mem_v`` under
  ``budget - fixed_mem`` (bytes divided by their gcd, which keeps it exact);
* precedence, one reservoir per (edge u -> v, copy j of v): some copy of u is resident at the event
  copy j of v is computed (``start_u < start_v < end_u``), Moccasin's ``reservoir_option=2``;
* a view: one reservoir per view keeps some single copy of its base resident over each whole
  interval of the view (a resident view keeps its base resident). :func:`solve_moccasin` first
  contracts the views away as ``checkmate`` does (:func:`~bonsai_core.solvers.views.contract_views`:
  a view's consumers read its base, and the views are put back into the sequence), which halves a
  traced transformer's model; :func:`build_model` still takes graphs with views;
* objective: the recomputation cost (costs scaled to integers), minimised; ``gap`` is relative to it.

Integer variables: start, size, end and presence per copy, O(C * n); reservoirs: O(C * edges).
The solution, read as (start, node) pairs in time order, is a compute sequence that
:func:`bonsai_core.schedule.schedule_ops` turns into ops freeing each copy right after its last use:
its simulated peak is never above the CP's memory, and its cost is the CP's objective (up to the
integer scaling of costs).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, no_remat_peak, schedule_ops
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.solvers.stages import check_size, effective_users, infeasible_message
from bonsai_core.solvers.views import contract_views, expand_views

# Moccasin has O(n) variables but O(n^2) time points and one reservoir per edge and copy; beyond this
# CP-SAT rarely finds a first solution in minutes on two cores. Use ``bonsai`` above it.
MAX_NODES = 1500
DEFAULT_COPIES = 2
# Costs become integers in units of total_cost / _COST_STEPS: a relative resolution of 1e-7.
_COST_STEPS = 10**7


def _event(t: int, o: int) -> int:
    """The time of "node o in stage t" (o <= t) on the CP's axis."""
    return t * (t + 1) // 2 + o


def _integer_costs(graph: Graph) -> tuple[list[int], float]:
    """Costs as integers (views stay 0, every other node at least 1) and the seconds per unit."""
    unit = graph.total_cost / _COST_STEPS if graph.total_cost > 0 else 1.0
    return [0 if c <= 0 else max(1, round(c / unit)) for c in graph.cost.tolist()], unit


def _no_remat_ends(graph: Graph, users: list[np.ndarray]) -> list[int]:
    """End of each node's single interval in the plain schedule (the hint): one past the event of
    its last effective user's first computation, or its own."""
    return [_event(int(us[-1]), int(us[-1])) + 1 if len(us) else _event(v, v) + 1 for v, us in enumerate(users)]


@dataclass
class CpRemat:
    """A built Moccasin model: the CP-SAT model and the variables a solution is read from."""

    model: Any
    start: list[list[Any]]  # start[v][c]: the event copy c of node v is computed at
    present: list[list[Any]]  # present[v][c]: copy c exists
    copies: int
    cost_unit: float  # seconds per unit of the integer objective
    variables: int
    constraints: int
    build_seconds: float


def build_model(graph: Graph, budget: int | None, copies: int = DEFAULT_COPIES) -> CpRemat:
    """Moccasin's CP model of ``graph`` under ``budget`` bytes (None: unconstrained), hinted with the
    plain schedule. O(copies^2 * edges) constraints; BudgetError if the budget is below fixed_mem."""
    from ortools.sat.python import cp_model

    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise SolverError(f"moccasin's option copies is {copies!r}; it is the number of computations allowed "
                          "per node, a whole number >= 1 (default 2).")
    start_clock = time.perf_counter()
    n, c_max = graph.n, copies
    horizon = _event(n - 1, n - 1) + 1
    users = effective_users(graph)
    cost, unit = _integer_costs(graph)
    mems = graph.mem.tolist()
    capacity_bytes = (budget if budget is not None else graph.fixed_mem + sum(mems)) - graph.fixed_mem
    if capacity_bytes < 0:
        raise BudgetError(infeasible_message(graph, capacity_bytes + graph.fixed_mem, "moccasin",
                                             no_remat_peak(graph)))
    scale = math.gcd(*[m for m in mems if m > 0]) or 1
    capacity = capacity_bytes // scale  # exact: memory is a multiple of scale

    model = cp_model.CpModel()
    start, end, present, intervals = _retention_intervals(model, graph, c_max, horizon)
    _add_separated_outputs(model, graph, start, present)
    heavy = [v for v in range(n) if mems[v] > 0]
    model.add_cumulative([iv for v in heavy for iv in intervals[v]],
                         [mems[v] // scale for v in heavy for _ in intervals[v]], capacity)
    _add_residency(model, graph, start, end, present)

    recomputes = [(p, cost[v]) for v in range(n) for p in present[v][1:]]
    # The recomputation cost; the first computations are a constant, left out so the gap is relative
    # to what recomputation costs (as checkmate reports it).
    model.minimize(cp_model.LinearExpr.weighted_sum([p for p, _ in recomputes], [c for _, c in recomputes]))
    for v, e in enumerate(_no_remat_ends(graph, users)):  # hint: the plain schedule
        model.add_hint(end[v][0], e)
        for p in present[v][1:]:
            model.add_hint(p, 0)
    proto = model.proto
    return CpRemat(model, start, present, c_max, unit, len(proto.variables), len(proto.constraints),
                   time.perf_counter() - start_clock)


Copies = list[list[Any]]  # per node, one CP variable per copy (copy 0: the first computation)


def _retention_intervals(model: Any, graph: Graph, copies: int,
                         horizon: int) -> tuple[Copies, Copies, Copies, Copies]:
    """Each node's copies as optional intervals (start, end, presence, interval): copy 0 starts at the
    node's own stage and is present; a later copy starts in a later stage, after the previous copy
    ends, and is present only if the previous one is."""
    from ortools.sat.python import cp_model

    start: Copies = []
    end: Copies = []
    present: Copies = []
    intervals: Copies = []
    for v in range(graph.n):
        first = _event(v, v)
        later = [_event(t, v) for t in range(v + 1, graph.n)]
        s_v, e_v, p_v, i_v = [], [], [], []
        for c in range(copies if later else 1):
            if c == 0:
                s = model.new_constant(first)
                p = model.new_constant(1)
            else:
                s = model.new_int_var_from_domain(cp_model.Domain.from_values(later), f"s{v}_{c}")
                p = model.new_bool_var(f"p{v}_{c}")
                model.add_implication(p, p_v[-1])
                model.add(s >= e_v[-1]).only_enforce_if(p)
            e = model.new_int_var(first + 1, horizon, f"e{v}_{c}")
            size = model.new_int_var(1, horizon, f"d{v}_{c}")
            i_v.append(model.new_optional_interval_var(s, size, e, p, f"i{v}_{c}"))
            s_v.append(s), e_v.append(e), p_v.append(p)
        start.append(s_v), end.append(e_v), present.append(p_v), intervals.append(i_v)
    return start, end, present, intervals


def _add_separated_outputs(model: Any, graph: Graph, start: Copies, present: Copies) -> None:
    """A separated output (Graph.output_of) is recomputed only right after a recomputation of its op,
    in the same stage: its bytes come with the op's kernel, which a getitem alone does not run."""
    for v in np.flatnonzero(graph.output_of >= 0).tolist():
        op = int(graph.output_of[v])
        for c in range(1, len(start[v])):
            runs = []
            for k in range(1, len(start[op])):
                same_run = model.new_bool_var(f"r{v}_{c}_{k}")
                model.add(start[v][c] == start[op][k] + (v - op)).only_enforce_if(same_run)
                model.add_implication(same_run, present[op][k])
                runs.append(same_run)
            model.add_bool_or(runs).only_enforce_if(present[v][c])


def _add_residency(model: Any, graph: Graph, start: Copies, end: Copies, present: Copies) -> None:
    """Some copy of each input is resident when a copy of its reader is computed, and one copy of a
    view's base over each whole interval of the view (reservoir constraints)."""
    alias = graph.alias_of.tolist()

    def held(u: int) -> tuple[list[Any], list[Any]]:  # u's copies as +1 from start + 1, -1 at end
        times = [x for i in range(len(start[u])) for x in (start[u][i] + 1, end[u][i])]
        return times, [x for i in range(len(start[u])) for x in (present[u][i], present[u][i])]

    for v in range(graph.n):
        for u in graph.deps(v).tolist():
            if u == alias[v]:
                continue  # the view's own reservoir below covers its base
            times, active = held(u)
            for j in range(len(start[v])):  # some copy of u is resident when copy j of v is computed
                model.add_reservoir_constraint_with_active(
                    times + [start[v][j], start[v][j] + 1], [1, -1] * len(start[u]) + [-1, 1],
                    active + [present[v][j], present[v][j]], 0, len(start[u]) + 1)
        a = alias[v]
        if a >= 0:  # one copy of the base is resident over each whole interval of the view
            times, active = held(a)
            mine = [x for j in range(len(start[v])) for x in (start[v][j], end[v][j])]
            mine_p = [x for j in range(len(start[v])) for x in (present[v][j], present[v][j])]
            model.add_reservoir_constraint_with_active(
                times + mine, [1, -1] * len(start[a]) + [-1, 1] * len(start[v]), active + mine_p, 0,
                len(start[a]))


def solve_moccasin(graph: Graph, budget: int | None, *, time_limit: float | None = None,
                   copies: int = DEFAULT_COPIES, num_workers: int = 2, max_nodes: int = MAX_NODES) -> Schedule:
    """Moccasin's schedule under ``budget`` bytes with at most ``copies`` computations per node.

    Raises SolverError for a graph above ``max_nodes`` nodes, a bad option, or no solution within
    ``time_limit`` seconds, and BudgetError when the model is proven infeasible at this budget.
    Stats: status (optimal / feasible), gap (relative to the recomputation cost, from CP-SAT's
    objective bound), variables, constraints, build_seconds, solve_seconds, objective (total compute
    cost, seconds).

    Options:
        time_limit: seconds for the whole call (building the CP model included); past it, the best schedule found and its gap
        copies: computations allowed per node (1 = no recomputation; more reach cheaper schedules, slower)
        num_workers: CP-SAT search threads
        max_nodes: refuse graphs with more nodes than this (views excepted)
    """
    from ortools.sat.python import cp_model

    deadline = Deadline(time_limit)
    small, kept = contract_views(graph)  # as checkmate: views cost nothing, their consumers read the base
    check_size(small, "moccasin", max_nodes, "nodes that are not views")
    built = build_model(small, budget, copies)
    model, start, present, c_max, unit = built.model, built.start, built.present, built.copies, built.cost_unit
    n = small.n
    solver = cp_model.CpSolver()
    left = deadline.left("moccasin", "building its CP model")
    if left is not None:
        solver.parameters.max_time_in_seconds = left
    solver.parameters.num_workers = max(1, int(num_workers))
    clock = time.perf_counter()
    status = solver.solve(model)
    solve_seconds = time.perf_counter() - clock
    size = {"variables": built.variables, "constraints": built.constraints, "build_seconds": built.build_seconds}
    if status == cp_model.INFEASIBLE:
        limit_bytes = budget if budget is not None else graph.fixed_mem + int(graph.mem.sum())
        raise BudgetError(infeasible_message(graph, limit_bytes, "moccasin", no_remat_peak(graph))
                          + f" (moccasin allows {c_max} computation(s) per node: option copies raises it.)", stats=size)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        limit = f" within the time limit of {time_limit:g} s" if time_limit is not None else ""
        raise SolverError(f"CP-SAT found no moccasin schedule for {graph.name!r}{limit} (status "
                          f"{solver.status_name(status)}). Raise --time-limit or the budget, or use method "
                          "'bonsai'.", stats=size)
    events = sorted((solver.value(start[v][c]), v) for v in range(n) for c in range(len(start[v]))
                    if solver.boolean_value(present[v][c]))
    sequence = expand_views(graph, [int(kept[v]) for _, v in events])
    objective, bound = solver.objective_value, solver.best_objective_bound
    optimal = status == cp_model.OPTIMAL
    gap = 0.0 if optimal else (objective - bound) / objective if objective > 0 else 0.0
    schedule = Schedule(graph=graph.name, method="moccasin", ops=schedule_ops(graph, sequence), budget=budget,
                        graph_hash=graph.hash)
    schedule.stats = {"status": "optimal" if optimal else "feasible", "gap": max(gap, 0.0), **size,
                      "solve_seconds": solve_seconds,
                      "objective": graph.total_cost + objective * unit, "copies": c_max,
                      "model_nodes": small.n}
    return schedule
