"""Every rematerialization method behind one interface.

A method is a function ``solve_x(graph, budget, *, time_limit=None, **options) -> Schedule`` in a
module of this package. :func:`solve` looks it up by name in :data:`METHODS` (imported lazily, so
cvxpy and ortools load only when their method is used), runs it, and validates the result with the
simulator before anyone sees it: the returned schedule's ``stats`` always hold the simulator's
``peak``, ``compute_cost`` and ``overhead``, plus what the method reports (``status``, ``gap``,
``variables``, ``constraints``, ``build_seconds``, ``solve_seconds``).
"""

from __future__ import annotations

import importlib
import inspect
import time
from typing import Any, Callable

from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, simulate
from bonsai_core.budget import format_bytes

# name -> (module, function, one-line description)
METHODS: dict[str, tuple[str, str, str]] = {
    "none": ("bonsai_core.solvers.baseline", "solve_none", "no rematerialization (the baseline peak)"),
    "bonsai": ("bonsai_core.solvers.bonsai", "solve_bonsai", "Bonsai's segment ILP: checkpoint regions, optimal in its model"),
    "chen": ("bonsai_core.solvers.chen", "solve_chen", "sqrt(n) / memory-balanced greedy checkpointing (Chen et al. 2016)"),
    "dtr": ("bonsai_core.solvers.dtr", "solve_dtr", "dynamic greedy eviction, h = cost / (memory * staleness) (DTR)"),
    "coop": ("bonsai_core.solvers.coop", "solve_coop", "sliding-window contiguous eviction in the allocator's address space (Coop)"),
    "checkmate": ("bonsai_core.solvers.checkmate", "solve_checkmate", "Checkmate's op-level MILP (optimal in its stage model; up to 400 nodes)"),
    "moccasin": ("bonsai_core.solvers.moccasin", "solve_moccasin", "Moccasin's retention-interval CP model on CP-SAT (option copies, default 2)"),
}


def available_methods() -> list[str]:
    return list(METHODS)


def describe(method: str) -> str:
    return METHODS[method][2]


def get_solver(method: str) -> Callable[..., Schedule]:
    if method not in METHODS:
        raise SolverError(f"Unknown method {method!r}; choose one of: {', '.join(METHODS)}.")
    module, func, _ = METHODS[method]
    return getattr(importlib.import_module(module), func)


def declared_options(method: str) -> set[str]:
    """The keyword options ``method``'s solver declares (``time_limit`` among them)."""
    params = inspect.signature(get_solver(method)).parameters.values()
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def solve(graph: Graph, budget: int | None, method: str = "none", **options: Any) -> Schedule:
    """Run ``method`` on ``graph`` under ``budget`` bytes (None: unconstrained) and return its
    schedule, validated by the simulator. Raises BudgetError if the method cannot meet the budget
    (naming the smallest budget it can meet, or a proven lower bound) and SolverError if it fails."""
    solver = get_solver(method)
    params = inspect.signature(solver).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        unknown = sorted(set(options) - declared_options(method))
        if unknown:
            raise SolverError(f"Method {method!r} has no option {', '.join(map(repr, unknown))}; its options are: "
                              f"{', '.join(sorted(declared_options(method)))}.")
    if budget is not None and budget < graph.peak_lower_bound:
        raise BudgetError(
            f"No schedule can fit in {format_bytes(budget)}: the largest single operator of "
            f"{graph.name!r} needs {format_bytes(graph.peak_lower_bound)} ({graph.peak_lower_bound} bytes) "
            "with its inputs and the fixed memory. Raise the budget to at least that.")
    start = time.perf_counter()
    schedule = solver(graph, budget, **options)
    wall = time.perf_counter() - start
    sim = simulate(graph, schedule)
    schedule.graph, schedule.graph_hash, schedule.budget = graph.name, graph.hash, budget
    schedule.stats = {**schedule.stats, **sim.stats()}
    schedule.stats.setdefault("solve_seconds", wall)
    if not sim.feasible(budget):
        raise BudgetError(
            f"Method {method!r} found no schedule of {graph.name!r} within {format_bytes(budget)}: its best "
            f"peaks at {format_bytes(sim.peak)} ({sim.peak} bytes). Raise the budget to at least that, "
            "or try another method.")
    return schedule
