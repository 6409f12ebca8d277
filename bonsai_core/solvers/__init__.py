"""Every rematerialization method behind one interface.

A method is a function ``solve_x(graph, budget, *, time_limit=None, <options>) -> Schedule`` in a
module of this package. Its options are its keyword-only parameters, each with a default, and a
docstring line ``name: what it does``. :func:`solve` looks the
method up by name in :data:`METHODS` (imported lazily, so cvxpy and ortools load only when their
method is used), refuses options the method does not declare (naming those it accepts), runs it,
and validates the result with the simulator before anyone sees it: the returned schedule's
``stats`` always hold the simulator's ``peak``, ``compute_cost`` and ``overhead``, plus what the
method reports (``status``, ``gap``, ``variables``, ``constraints``, ``build_seconds``,
``solve_seconds``).

:func:`method_options` lists a method's options (name, default, help) for the CLI and the explorer;
:func:`parse_option` turns an option's text (``bonsai solve --option copies=3``) into its type.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import time
import typing
from typing import Any, Callable, NamedTuple

from bonsai_core.errors import BonsaiError, BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, simulate, simulated
from bonsai_core.solvers.deadline import Deadline
from bonsai_core.units import format_bytes

# name -> (module, function, one-line description)
METHODS: dict[str, tuple[str, str, str]] = {
    "none": ("bonsai_core.solvers.baseline", "solve_none", "no rematerialization (the baseline peak)"),
    "bonsai": ("bonsai_core.solvers.bonsai", "solve_bonsai", "Bonsai's segment ILP: checkpoint regions, optimal in its model"),
    "chen": ("bonsai_core.solvers.chen", "solve_chen", "sqrt(n) / memory-balanced greedy checkpointing (Chen et al. 2016)"),
    "dtr": ("bonsai_core.solvers.dtr", "solve_dtr", "dynamic greedy eviction, h = cost / (memory * staleness) (DTR)"),
    "coop": ("bonsai_core.solvers.coop", "solve_coop", "sliding-window contiguous eviction in the allocator's address space (Coop)"),
    "checkmate": ("bonsai_core.solvers.checkmate", "solve_checkmate", "Checkmate's op-level MILP (optimal in its stage model; up to 400 nodes)"),
    "moccasin": ("bonsai_core.solvers.moccasin", "solve_moccasin", "Moccasin's retention-interval CP model on CP-SAT (option copies, default 2)"),
    "torchtitan-full": ("bonsai_core.solvers.torchtitan", "solve_torchtitan_full",
                        "torchtitan's full activation checkpointing: every block of the block stack recomputed (fixed plan)"),
    "torchtitan-selective": ("bonsai_core.solvers.torchtitan", "solve_torchtitan_selective",
                             "torchtitan's op-level selective checkpointing per block: saves matmuls (every second one "
                             "recomputed) and attention (fixed plan)"),
}
DEFAULT_METHOD = "bonsai"
# Methods that plan only a graph with a block stack (graph.block_stack: a transformer's layers), as the
# framework they mirror wraps its blocks; the others plan any graph.
BLOCK_STACK_METHODS = ("torchtitan-full", "torchtitan-selective")
# Methods whose plan does not depend on the budget: a budget below its peak is refused, not planned for.
FIXED_PLAN_METHODS = ("none", "torchtitan-full", "torchtitan-selective")
# Tried, in order, for a budget another method could not meet (:func:`method_meeting`): Moccasin's op-level
# optimum, which may recompute backward ops too (beyond checkpoint regions), then DTR's fast heuristic.
FALLBACK_METHODS = ("moccasin", "dtr")


class MethodOption(NamedTuple):
    """One option of a method: its name, default value, one-line help and Python type."""

    name: str
    default: Any
    help: str
    type: Any


def available_methods(any_graph: bool = False) -> list[str]:
    """Every method's name; ``any_graph``: only those that plan any graph (not :data:`BLOCK_STACK_METHODS`)."""
    return [m for m in METHODS if not (any_graph and m in BLOCK_STACK_METHODS)]


def describe(method: str) -> str:
    return METHODS[method][2]


def get_solver(method: str) -> Callable[..., Schedule]:
    if method not in METHODS:
        raise SolverError(f"Unknown method {method!r}; choose one of: {', '.join(METHODS)}.")
    module, func, _ = METHODS[method]
    return getattr(importlib.import_module(module), func)


def _option_help(doc: str | None, names: list[str]) -> dict[str, str]:
    """The docstring's line ``name: text`` for each option name (under an ``Options:`` heading or
    not); the lines after it continue the text up to a blank line or the next option."""
    helps: dict[str, str] = {}
    current = None
    for line in inspect.cleandoc(doc or "").splitlines():
        m = re.match(r"\s*(\w+):\s*(.*)", line)
        if m and m.group(1) in names:
            current = m.group(1)
            helps[current] = m.group(2).strip()
        elif current is not None and line.strip():
            helps[current] += " " + line.strip()
        else:
            current = None
    return helps


@functools.lru_cache(maxsize=None)
def method_options(method: str) -> tuple[MethodOption, ...] | None:
    """The options ``method`` declares, in signature order (None: its solver takes ``**kwargs``, so any keyword passes).
    Read once per method from its signature and docstring."""
    solver = get_solver(method)
    params = inspect.signature(solver).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None  # keyword-only parameters are the declared options; **kwargs declares none
    try:
        hints = typing.get_type_hints(solver)
    except Exception:  # an annotation that does not resolve: fall back to the default's type
        hints = {}
    declared = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    helps = _option_help(solver.__doc__, [p.name for p in declared])
    return tuple(MethodOption(p.name, p.default, helps.get(p.name, ""), hints.get(p.name, type(p.default)))
                 for p in declared)


def accepted_options(method: str) -> set[str] | None:
    """Names of the options ``method`` accepts (None: any)."""
    options = method_options(method)
    return None if options is None else {o.name for o in options}


def check_options(method: str, options: dict[str, Any]) -> None:
    """Refuse an option ``method`` does not declare, naming the ones it does."""
    accepted = method_options(method)
    if accepted is None:
        return
    unknown = sorted(set(options) - {o.name for o in accepted})
    if unknown:
        listed = ", ".join(f"{o.name} (default {o.default!r})" for o in accepted) or "none"
        raise SolverError(f"Method {method!r} has no option {', '.join(map(repr, unknown))}; its options are: "
                          f"{listed}. `bonsai methods` lists every method's options.")


def type_name(kind: Any) -> str:
    """An option's type in words: ``int``, ``one of 'sqrt', 'greedy'``, ``float or none``."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if args:  # a union such as int | None
        return " or ".join("none" if a is type(None) else type_name(a) for a in args)
    return getattr(kind, "__name__", str(kind))


def parse_option(method: str, text: str) -> tuple[str, Any]:
    """``name=value`` as the option's name and its value, typed from the option's declared type
    (``copies=3`` -> 3, ``allocator=true`` -> True, ``segments=none`` -> None)."""
    name, eq, raw = text.partition("=")
    name, raw = name.strip().replace("-", "_"), raw.strip()
    if not eq or not name:
        raise SolverError(f"Option {text!r} is not name=value (for example copies=3).")
    options = method_options(method)
    if options is None:
        return name, _guess(raw)
    check_options(method, {name: None})
    kind = next(o.type for o in options if o.name == name)
    try:
        return name, parse_value(raw, kind)
    except ValueError as e:
        raise SolverError(f"Option {name}={raw!r} of method {method!r}: {e}.") from None


def parse_value(raw: str, kind: Any) -> Any:
    """An option's value from its text, typed by its declared type (the CLI's ``--option`` and the
    app's links share these rules: ``true/yes/1``, ``false/no/0``, ``none``, a Literal's members);
    ValueError naming the expected type when the text is not one."""
    value = _convert(raw.strip(), kind)
    if value is _BAD:
        raise ValueError(f"expected {type_name(kind)}")
    return value


_BAD = object()
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _convert(raw: str, kind: Any) -> Any:
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        return next((a for a in args if str(a) == raw), _BAD)
    if args:  # a union: the first member the text converts to
        for a in args:
            value = (None if raw.lower() == "none" else _BAD) if a is type(None) else _convert(raw, a)
            if value is not _BAD:
                return value
        return _BAD
    if kind is bool:
        return _BOOLS.get(raw.lower(), _BAD)
    if kind in (int, float, str):
        try:
            return kind(raw)
        except ValueError:
            return _BAD
    return _BAD


def _guess(raw: str) -> Any:
    """A value for an option whose type is not declared: a number, a boolean, none or the text."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return _BOOLS.get(raw.lower(), None if raw.lower() == "none" else raw)


def solve(graph: Graph, budget: int | None, method: str = DEFAULT_METHOD, **options: Any) -> Schedule:
    """Run ``method`` on ``graph`` under ``budget`` bytes (None: unconstrained) and return its
    schedule, validated by the simulator. Raises BudgetError if the method cannot meet the budget
    (naming the smallest budget it can meet, or a proven lower bound) and SolverError if it fails
    or an option is not one the method declares."""
    solver = get_solver(method)
    check_options(method, options)
    if budget is not None and graph.optimizer is not None and budget < graph.optimizer_peak:
        step = graph.optimizer_peak - graph.fixed_mem
        raise BudgetError(
            f"No schedule can fit in {format_bytes(budget)}: the {graph.optimizer['name']} optimizer step after the "
            f"backward pass of {graph.name!r} needs {format_bytes(graph.optimizer_peak)} "
            f"({graph.optimizer_peak} bytes): the fixed memory with the optimizer's state, "
            f"{format_bytes(graph.fixed_mem)}, and the step's own {format_bytes(step)}. Raise the budget to at "
            "least that, or shard the optimizer state.")
    if budget is not None and budget < graph.peak_lower_bound:
        raise BudgetError(
            f"No schedule can fit in {format_bytes(budget)}: the largest single operator of "
            f"{graph.name!r} needs {format_bytes(graph.peak_lower_bound)} ({graph.peak_lower_bound} bytes) "
            "with its inputs and the fixed memory. Raise the budget to at least that."
            + (f" (A budget of {budget} means bytes; for a share of the no-remat peak write {budget}%.)"
               if budget <= 100 else ""))
    start = time.perf_counter()
    clock = Deadline(options.get("time_limit"))  # bounds the whole call, the solves again below included
    schedule = solver(graph, budget, **options)
    sim = simulated(graph, schedule)  # the method's own check's, when it simulated this plan
    if (graph.parallel or {}).get("pipeline") and budget is not None and not sim.feasible(budget):
        schedule, sim = _within_pipeline(graph, budget, solver, schedule, sim, options, clock)
    elif graph.fsdp is not None and budget is not None and not sim.feasible(budget):
        schedule, sim = _within_fsdp_profile(graph, budget, solver, schedule, sim, options, clock)
    wall = time.perf_counter() - start
    schedule.graph, schedule.graph_hash, schedule.budget = graph.name, graph.hash, budget
    schedule.stats = {**schedule.stats, **sim.stats()}
    schedule.stats.setdefault("solve_seconds", wall)
    schedule.stats["wall_seconds"] = wall  # the whole call: the method and the simulator's check
    if not sim.feasible(budget):
        raise BudgetError(
            f"Method {method!r} found no schedule of {graph.name!r} within {format_bytes(budget)}: its best "
            f"peaks at {format_bytes(sim.peak)} ({sim.peak} bytes). Raise the budget to at least that, "
            "or try another method.")
    return schedule


FSDP_TRIES = 3  # solves with a tighter budget when FSDP's unsharded blocks push a plan over


def _left_of(options: dict[str, Any], clock: Deadline) -> dict[str, Any] | None:
    """``options`` for one more solve within what ``clock`` leaves of the call's time limit (None: none left)."""
    left = clock.remaining()
    if left is None:
        return options
    return {**options, "time_limit": left} if left > 0 else None


def _within_fsdp_profile(graph: Graph, budget: int, solver: Callable[..., Schedule], schedule: Schedule,
                         sim: Any, options: dict[str, Any], clock: Deadline) -> tuple[Schedule, Any]:
    """Methods plan ``fixed_mem`` as constant; on an FSDP rank the unsharded blocks the simulator adds
    (:func:`bonsai_core.fsdp.working_profile`) may push a plan over ``budget`` where they meet its peak.
    Solve again with the budget lowered by the excess (at most :data:`FSDP_TRIES` times); the best
    schedule found is returned (the caller judges it); none past the time limit, which bounds them all."""
    best = (schedule, sim)
    tighter = budget
    for _ in range(FSDP_TRIES):
        tighter -= best[1].peak - budget
        within = _left_of(options, clock)
        if within is None:
            break
        try:
            candidate = solver(graph, tighter, **within)
        except BonsaiError:
            break
        result = simulate(graph, candidate)
        if result.peak < best[1].peak:
            best = (candidate, result)
        if result.feasible(budget):
            break
    return best


PIPELINE_TRIES = 8  # solves bisecting the budget a pipeline rank's one microbatch is planned under


def _within_pipeline(graph: Graph, budget: int, solver: Callable[..., Schedule], schedule: Schedule,
                     sim: Any, options: dict[str, Any], clock: Deadline) -> tuple[Schedule, Any]:
    """On a pipeline rank (rule 11) a plan's peak holds the other microbatches in flight, each what the plan
    leaves resident at the end of its forward: the method plans one microbatch. Bisect the budget it plans
    under, between the graph's lower bound and ``budget``, for the largest whose rank peak meets ``budget``
    (at most :data:`PIPELINE_TRIES` solves, none past the time limit); the best schedule found is returned (the
    caller judges it)."""
    best, low, high = (schedule, sim), graph.peak_lower_bound, budget
    for _ in range(PIPELINE_TRIES):
        if high - low <= max(1, budget // 1000):
            break
        middle = (low + high) // 2
        within = _left_of(options, clock)
        if within is None:
            break
        try:
            candidate = solver(graph, middle, **within)
        except BonsaiError:
            low = middle
            continue
        result = simulate(graph, candidate)
        if result.feasible(budget):
            low = middle
            if not best[1].feasible(budget) or result.compute_cost < best[1].compute_cost:
                best = (candidate, result)
        else:
            high = middle
            if not best[1].feasible(budget) and result.peak < best[1].peak:
                best = (candidate, result)
    return best


def solve_reserved(graph: Graph, budget: int, method: str = DEFAULT_METHOD, *, policy: str = "caching",
                   tries: int = 12, solved: Schedule | BonsaiError | None = None, **options: Any) -> Schedule:
    """Like :func:`solve`, but ``budget`` bounds the bytes the allocator model *reserves* for the step
    (``bonsai_core.allocator.replay`` with ``policy`` "caching", or "expandable" for
    ``expandable_segments:True``), which is what a GPU must hold, rather than its live tensor bytes.

    Every method plans live bytes, so this asks the method for a live budget, replays its schedule
    through the allocator and, while the reserved peak is over ``budget``, asks for the plan's live peak
    less the excess and solves again (at most ``tries`` solves). The schedule's ``budget`` is the reserved budget;
    its stats add ``reserved_peak``, ``live_budget`` (the live budget its method met), ``allocator`` and
    ``reserved_solves``; ``wall_seconds`` is the whole call's. A ``time_limit`` option bounds the whole call:
    each solve gets half of what the earlier ones left. Raises BudgetError naming the smallest reserved peak
    reached when no live budget works. ``solved``: what :func:`solve` answered for ``method`` at ``budget`` with
    these options already (its schedule, or the error it raised), taken as the first solve's answer.

    A fixed plan (:data:`FIXED_PLAN_METHODS`) is the same at every live budget, so once its replay passes ``budget``
    no other live budget can help: the replay stops there (a pipeline rank's, whose replay is long) and the error
    names the reserved bytes where it stopped."""
    from bonsai_core.allocator import bounded_replay
    from bonsai_core.allocator.pipelined import ReservedPast

    clock, wall = Deadline(options.get("time_limit")), time.perf_counter()
    live_budget, best, solves, stopped = budget, None, 0, None
    for _ in range(tries):
        left = clock.remaining()
        if left is not None and left <= 0:
            break
        try:
            # half of what is left: a first plan that reserves too much must leave time for the next
            if solved is not None:
                schedule, solved = _answered(solved), None
            else:
                schedule = solve(graph, live_budget, method, **(options if left is None else {**options, "time_limit": left / 2}))
        except BudgetError:
            break
        solves += 1
        if method in FIXED_PLAN_METHODS:
            try:
                reserved = bounded_replay(graph, schedule, policy, largest_free=False, stop_above=budget).reserved_peak
            except ReservedPast as past:
                stopped = past.reserved
                break
        else:
            reserved = bounded_replay(graph, schedule, policy, largest_free=False).reserved_peak
        if best is None or reserved < best[0]:
            best = (reserved, live_budget)
        if reserved <= budget:
            schedule.budget = budget
            schedule.stats = {**schedule.stats, "reserved_peak": reserved, "live_budget": live_budget,
                              "allocator": policy, "reserved_solves": solves,
                              "wall_seconds": time.perf_counter() - wall}
            return schedule
        # below the plan's own live peak: a plan under a budget also meets every budget down to its peak,
        # and bonsai answers such a budget with that plan again (reused), reserving as much
        live_budget = min(live_budget, schedule.stats["peak"]) - (reserved - budget)
        if method in FIXED_PLAN_METHODS:  # the same plan again, over the lower live budget
            break
    reached = "" if best is None else (f" Its lowest reserved peak was {format_bytes(best[0])} ({best[0]} bytes), "
                                       f"at a live budget of {format_bytes(best[1])}.")
    if stopped is not None:
        reached = (f" Its fixed plan's replay passed the budget at {format_bytes(stopped)} ({stopped} bytes) reserved "
                   "and stopped there: no live budget changes a fixed plan.")
    if clock.passed():
        reached += f" The time limit of {clock.time_limit:g} s ran out after {solves} solve(s)."
    raise BudgetError(f"Method {method!r} found no schedule of {graph.name!r} whose {policy} allocator reserves at "
                      f"most {format_bytes(budget)}.{reached} Raise the budget, or try another method or "
                      "expandable segments (less rounding waste).")


def _answered(solved: Schedule | BonsaiError) -> Schedule:
    """A solve's answer given as its schedule or the error it raised."""
    if isinstance(solved, BonsaiError):
        raise solved
    return solved


def method_meeting(graph: Graph, budget: int, instead_of: str, time_limit: float = 15.0) -> Schedule | None:
    """A schedule of another method within ``budget`` (one of :data:`FALLBACK_METHODS`, each under
    ``time_limit`` seconds), for an error to name the method that meets a budget ``instead_of`` could
    not; None when none does (or the budget is below the graph's per-op lower bound)."""
    if budget < graph.peak_lower_bound:
        return None
    for method in FALLBACK_METHODS:
        if method == instead_of:
            continue
        try:
            return solve(graph, budget, method, time_limit=time_limit)
        except BonsaiError:
            continue
    return None
