"""The ``bonsai`` method: Bonsai's segment ILP (OOPSLA 2026), the solve entry and its cache.

The forward pass is cut into candidate segments (:mod:`bonsai_core.segment`); the ILP
(:mod:`bonsai_core.solvers.bonsai_model`, coefficients from :mod:`bonsai_core.solvers.bonsai_coef`)
picks a cover of the forward pass out of them and which of them to recompute. Its schedule space is
exactly :class:`bonsai_core.regions.CheckpointPlan`: a recomputed segment keeps its boundary and its
self-contained nodes (an attention mask built inside it: cheaper to keep than to rebuild), drops the
rest after the forward pass and is rebuilt once right before the first backward node that reads a
dropped node (with the option ``drop_outputs``, a recomputed segment may drop its outputs too when
only kept ops read them in the forward pass).

**Candidates.** Every run of whole atoms with at most ``granularity`` non-view ops, plus every segment
of Chen's checkpoint plans (:func:`bonsai_core.solvers.chen.candidate_plans`, any length) and every
module call the trace recorded (``Graph.modules``: a transformer block, its attention, its MLP): so
Chen's plans and per-module checkpointing are in the model's space at every granularity.

**Granularity "auto"** (``granularity=None``, the default): the ladder d, 2d, 4d, 8d (d = round(2·√(non-view
forward ops)), capped at their count); the smallest rung whose model meets the budget is solved (the
built problems are cached, so a later budget reuses them). A set ``granularity`` solves that one.

**Fallback plans.** Chen's plans and the per-block plans of the model's block stack
(:func:`bonsai_core.regions.block_plans`: every 1st, 2nd, 4th block checkpointed, as the per-block
peer does) are also simulated (exactly, once per graph); the cheapest that fits the budget is
returned instead of the ILP's plan when it is cheaper or the ILP found none. The model is
conservative (it may overestimate a plan's peak), so this keeps bonsai at or below chen and
per-block checkpointing wherever one of their plans fits (``stats["plan_source"]``: "ilp" or
"fallback", with the plan's label in ``stats["fallback_plan"]``).

**The simulator judges**: the ILP's plan is simulated; should its peak ever exceed the budget, the
budget given to the model is tightened by the excess and the ILP re-solved (``stats["tightened_by"]``).

**Plans reused across budgets.** A plan the ILP found at budget B, within the gap (relative or absolute),
whose modelled and simulated peaks are at most p, is within the same gap of the optimum at every budget b
in [p, B]: the optimum at b is no cheaper than at B, and the plan fits b. So a solve at such a b returns that plan
(``stats["reused_from"]``: B) without solving; dragging the explorer's budget slider over a plan's
interval costs nothing (``reuse=False`` always solves, as the benchmarks do).

**Pipeline ranks.** A rank holding other microbatches in flight holds, for each, what its stage kept at its
forward's end (simulator rule 11). The segment ILP counts those copies exactly, as linear terms of its columns,
and solves once; the op-level search counts them at the point after each stage's forward
(:class:`~bonsai_core.solvers.bonsai_ops.InFlight`) but refines its plan round by round on simulated peaks,
where every copy moves at once: on the 405B rank 1 of FSDP 8 x TP 8 x PP 8 it had no plan after 8 minutes of
CPU, where the segment ILP took 32 s (docs/REAL_RUNS.md). So there ``space="auto"`` searches checkpoint regions only;
``space="ops"`` still searches op-level plans.

**Time limit**: ``time_limit`` bounds the whole call (the fallback plans, every rung's build and MILP solve, the
tightening and the smallest-budget search). Past it: the best valid plan found so far (``status``
"feasible" with the MILP's gap, or "time_limit" for a fallback plan, no gap known) or a
BudgetError saying none was found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from bonsai_core.bound import BoundParts, LowerBound, Tensors, lower_bound
from bonsai_core.errors import BudgetError, SolverError
from bonsai_core.graph import Graph
from bonsai_core.in_flight import holds_others
from bonsai_core.regions import (CheckpointPlan, block_plans, checkpoint_sequence, forward_positions, plan_schedule,
                                 region_peak_bound, useful_saved)
from bonsai_core.schedule import Schedule, simulate, simulated
from bonsai_core.segment import default_granularity, op_count, segment
from bonsai_core.solvers.bonsai_coef import (PlainProfile, density_levels, plain_profile, saved_positions,
                                             self_contained)
from bonsai_core.solvers.bonsai_model import BuiltModel, build_model
from bonsai_core.solvers.bonsai_ops import OpsOutcome, plan_ops
from bonsai_core.solvers.deadline import Deadline, OutOfTime, now
from bonsai_core.solvers.milp import DEFAULT_BACKEND, MilpOutcome, problem_size, solve_milp
from bonsai_core.solvers.sparse_milp import from_cvxpy, proven_within, satisfies, solve_sparse_milp
from bonsai_core.solvers.relaxation import (proven_infeasible, relaxation_of, round_relaxation, same_structure,
                                           solve_from)
from bonsai_core.units import format_bytes

_CACHE_SIZE = 32  # entries: per graph its plain profile, its fallback plans, one model per rung tried, its solved plans
_PLANS_KEPT = 64  # solved plans remembered per graph and options, for reuse at budgets they fit
_MAX_TIGHTEN = 4
_LADDER = (1, 2, 4, 8)  # the auto granularity's rungs, in multiples of the default
DEFAULT_GAP = 0.01  # the target ("optimal, gap <= 1%"); HiGHS closes the last 0.2% slowly on GPTs
Regions = Literal["any", "modules"]  # which candidate segments may be recomputed
Space = Literal["auto", "ops", "regions"]  # which plans bonsai searches
REGIONS_SHARE = 0.5  # with an op-level plan found, the segment ILP runs only if this share of the time limit is left


class Gaps(NamedTuple):
    """Where the segment ILP's search stops: within the relative MIP gap, or within the absolute one (shares of
    one plain step's compute, the objective's unit; 0: none)."""

    relative: float
    absolute: float = 0.0

    def proven(self, incumbent: float, bound: float) -> bool:
        return proven_within(incumbent, bound, self.relative, self.absolute)

    def met_by(self, stats: dict[str, Any]) -> bool:
        """Whether a solved plan's stats (its ``gap`` to the bound, relative, and its ``objective``) prove it
        within these gaps."""
        gap, objective = stats.get("gap"), stats.get("objective")
        if not isinstance(gap, (int, float)):
            return False
        return gap <= self.relative or (isinstance(objective, (int, float))
                                        and gap * abs(objective) <= self.absolute + 1e-12)


@dataclass
class FallbackPlans:
    """Chen's checkpoint plans and the per-block plans of one graph: what bonsai can always fall back
    on. Each plan's compute cost is exact (its rebuilds counted) and its peak is simulated only when
    needed (once), cheapest first."""

    spans: tuple[tuple[int, int], ...]  # their recomputed segments as (start, end) forward positions
    plans: tuple[tuple[str, CheckpointPlan, tuple[tuple[int, int], ...]], ...]  # (label, plan, its spans)
    peaks: dict[int, int]  # plan index -> simulated peak
    costs: list[float] | None = None  # plan index -> compute cost, filled on first use

    def peak(self, graph: Graph, i: int) -> int:
        if i not in self.peaks:
            self.peaks[i] = simulate(graph, plan_schedule(graph, self.plans[i][1], "bonsai")).peak
        return self.peaks[i]

    def best(self, graph: Graph, budget: int, below: float = np.inf,
             clock: "Deadline | None" = None) -> tuple[int, float, str, CheckpointPlan] | None:
        """The cheapest plan within ``budget`` whose compute cost is below ``below``, as (peak, cost,
        label, plan)."""
        if self.costs is None:
            if clock is not None and clock.passed():
                return None  # every plan's cost takes a pass over it: past the time limit, none is known
            self.costs = [float(graph.cost[checkpoint_sequence(graph, plan)].sum()) for _, plan, _ in self.plans]
        costs = self.costs
        for i in sorted(range(len(self.plans)), key=costs.__getitem__):
            if costs[i] >= below:
                return None
            if i not in self.peaks and clock is not None and clock.passed():
                continue  # past the time limit only plans already simulated are considered
            if self.peak(graph, i) <= budget:
                return self.peak(graph, i), costs[i], self.plans[i][0], self.plans[i][1]
        return None

    def lowest_peak(self, graph: Graph) -> int | None:
        return min((self.peak(graph, i) for i in range(len(self.plans))), default=None)


def saving_self_contained(graph: Graph, plan: CheckpointPlan, spans: tuple[tuple[int, int], ...],
                     constant: np.ndarray) -> CheckpointPlan:
    """``plan``, whose recomputed segments are the forward-position ``spans`` (fallback plans' segments are runs of
    the forward order), with each of them saving its self-contained nodes (when it holds others too),
    as bonsai's own plans do; ``constant``: :func:`self_contained`."""
    forward = np.flatnonzero(graph.is_forward)
    return useful_saved(graph, dataclasses.replace(plan, saved=frozenset(
        int(v) for a, b in spans for v in forward[saved_positions(constant, a, b)])))


_cache: "OrderedDict[tuple[str, Any], Any]" = OrderedDict()
_cache_lock = threading.Lock()  # guards the dict itself, never held while building
_graph_locks: dict[str, threading.RLock] = {}


def _graph_lock(graph: Graph) -> threading.RLock:
    """One lock per graph: its cached problems hold a budget Parameter that a solve sets, so solves
    of one graph take turns, while explorer sessions on other graphs solve at the same time."""
    with _cache_lock:
        return _graph_locks.setdefault(graph.hash, threading.RLock())


def _cached(key: tuple[str, Any], make: Any) -> Any:
    """``make()`` once per key (keys start with the graph's hash; callers hold that graph's lock)."""
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    value = make()
    with _cache_lock:
        _cache[key] = value
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return value


def module_spans(graph: Graph) -> set[tuple[int, int]]:
    """The recorded module calls (``Graph.modules``) as (start, end) forward positions."""
    pos = forward_positions(graph)
    return {(int(pos[first]), int(pos[last]) + 1) for _, first, last in graph.modules}


def fallback_plans(graph: Graph, regions: Regions = "any", save_self_contained: bool = True) -> FallbackPlans:
    """The fallback plans of ``graph``, simulated when needed; cached per graph. ``regions="any"``: Chen's
    plans (both variants) and the per-block plans; ``"modules"``: the per-block plans only. With
    ``save_self_contained``, each also as bonsai's plans run it (:func:`saving_self_contained`), where that differs."""
    from bonsai_core.solvers.chen import candidate_plans

    def make() -> FallbackPlans:
        pos = forward_positions(graph)
        constant = self_contained(graph) if save_self_contained else None
        plans = []
        chen = candidate_plans(graph, "auto") if regions == "any" else []
        for label, plan in [*chen, *block_plans(graph)]:
            spans = tuple((int(pos[list(plan.segments[i])].min()), int(pos[list(plan.segments[i])].max()) + 1)
                          for i in sorted(plan.recomputed))
            plans.append((label, plan, spans))
            saving = saving_self_contained(graph, plan, spans, constant) if save_self_contained else plan
            if saving != plan:
                plans.append((f"{label}, self-contained nodes saved", saving, spans))
        return FallbackPlans(spans=tuple(sorted({sp for *_, spans in plans for sp in spans} | module_spans(graph))),
                     plans=tuple(plans), peaks={})

    return _cached((graph.hash, ("fallbacks", regions, save_self_contained)), make)


def _plain(graph: Graph) -> PlainProfile:
    return _cached((graph.hash, "plain"), lambda: plain_profile(graph))


def auto_ladder(graph: Graph) -> list[int]:
    """The granularities "auto" tries, smallest first."""
    top = max(1, op_count(graph))
    return sorted({min(top, default_granularity(graph) * k) for k in _LADDER})


def build(graph: Graph, granularity: int | None = None, regions: Regions = "any",
          drop_outputs: bool = False, save_self_contained: bool = True, save_ops: bool = False,
          offload: bool = False, clock: Deadline | None = None) -> BuiltModel:
    """The segment ILP of ``graph`` at ``granularity`` (None: the paper's default, round(2·√ops)),
    with Chen's segments and the module calls as extra candidates; built once per (graph hash,
    granularity, regions) and cached (the last few), so a budget change only sets the Parameter.
    ``regions="modules"``: only module calls may be recomputed (the rest of the forward pass is kept
    atom by atom), so the granularity plays no part. ``drop_outputs``: candidates may also be
    recomputed with their outputs dropped (:class:`~bonsai_core.regions.CheckpointPlan`); ``save_self_contained``:
    a recomputed candidate saves its self-contained nodes; ``save_ops``: it may also save the ops of a
    density level (:func:`~bonsai_core.solvers.bonsai_coef.density_levels`) inside it; ``offload``: saved
    tensors may go to host memory. Past ``clock`` the build stops (:class:`OutOfTime`) and nothing is cached."""
    if regions == "modules":
        granularity = 1
    gran = default_granularity(graph) if granularity is None else granularity
    seg = segment(graph, gran)  # validates the granularity before anything is built
    key = (graph.hash, ("model", seg.granularity, regions, drop_outputs, save_self_contained, save_ops)
           + (("offload",) if offload else ()))

    def make() -> BuiltModel:
        full = segment(graph, seg.granularity, fallback_plans(graph, regions, save_self_contained).spans)
        allowed = None
        if regions == "modules":
            calls = module_spans(graph)
            allowed = np.array([(a, b) in calls for a, b in zip(full.starts.tolist(), full.ends.tolist())], dtype=bool)
        levels = density_levels(graph) if save_ops else None
        return build_model(graph, full, _plain(graph), allowed, drop_outputs, save_self_contained, levels, offload,
                           clock)

    return _cached(key, make)


def solve_bonsai(graph: Graph, budget: int | None, *, time_limit: float | None = None,
                 granularity: int | None = None, backend: str = DEFAULT_BACKEND,
                 gap: float = DEFAULT_GAP, regions: Regions = "any", drop_outputs: bool = False,
                 save_self_contained: bool = True, save_ops: bool = False, reuse: bool = True,
                 offload: bool = False, space: Space = "auto", abs_gap: float = 0.0) -> Schedule:
    """Bonsai: the cheapest plan it finds within ``budget``, of its op-level plans (a MILP over a few
    memory points, run lazily: :mod:`bonsai_core.solvers.bonsai_ops`) and of its segment ILP's
    checkpoint plans; every result carries the lower bound no schedule within the budget goes below
    (:mod:`bonsai_core.bound`) and its distance from it.

    Options:
        space: which plans to search: "auto" (op-level plans, then checkpoint regions unless the
            op-level plan's compute cost is already within ``gap`` of the lower bound; the cheaper is the answer;
            on a pipeline rank holding other microbatches in flight, checkpoint regions only: module doc),
            "ops" (op-level plans only) or "regions" (checkpoint regions only: plans the ``checkpoint``
            export back-end and ``bonsai.checkpoint`` apply as torch.utils.checkpoint regions; implied by
            regions "modules"). ``stats["space"]`` says which plan won, ``stats["spaces"]`` which were searched.
        time_limit: seconds for the whole call (None: no limit).
        granularity: the largest number of non-view ops in a short candidate segment; None: "auto",
            the smallest of a ladder of granularities whose model meets the budget.
        backend: the MILP backend, "highs" or "scip".
        gap: the relative MIP gap at which the search stops (0.01: within 1% of the model's optimum;
            1e-4 proves the optimum, as "optimal" means everywhere in this project).
        abs_gap: the absolute gap at which the segment ILP's search stops too, in shares of one plain step's
            compute (its objective: the recomputed time over the step's): 5e-4 stops once no plan can be more
            than 0.05% of the step faster, which on a plan of tiny overhead comes long before the relative
            gap does; 0: the relative gap alone. The status stays "feasible" with the relative gap it proved.
        regions: "any" (contiguous runs of ops, Chen's segments and module calls) or "modules" (only
            the module calls the trace recorded may be recomputed: plans that the ``checkpoint``
            export back-end applies to those submodules one to one).
        drop_outputs: also let a recomputed segment drop its outputs when only kept ops read them in the
            forward pass (rebuilt before their first backward reader): a larger schedule space, beyond
            torch.utils.checkpoint regions, and a model about 1.7 times larger (docs/BONSAI.md).
        save_self_contained: a recomputed segment saves its self-contained nodes (those that read nothing
            computed outside it: attention masks, position ids) instead of rebuilding them, as selective
            checkpointing's "must save" does; False: it rebuilds them with the rest.
        save_ops: a recomputed segment may also save the outputs of its costliest ops per byte (one of a
            few density levels: matmuls and attention first, as selective activation checkpointing's
            MUST_SAVE does) and recompute the rest; each saved output is held until its segment's
            rebuild, as SAC's storage holds it, and the model counts that. False (the default): only
            whole segments; opt-in for its solve time on the largest steps (docs/results/real_runs.md).
        reuse: answer with a plan solved earlier (same graph and options) at a larger budget when it
            fits this one (it is then within the same gap of this budget's optimum); False: always solve.
        offload: keep, recompute or offload each saved tensor: a kept one may be copied to host memory
            after its last forward reader and reloaded before its first backward reader, its copies
            hidden by compute in the model (simulator rule 9; docs/BONSAI.md). The op-level plan may
            copy a saved tensor out after its compute and bring it back once where it would rebuild it;
            the checkpoint plan's model is solved from the plan without offload as a MIP start, so
            never costlier than that plan (``stats["offload_start"]``).

    Raises BudgetError (naming the smallest budget bonsai can meet) when none fits or none was found in
    time, SolverError when the backend fails."""
    _check_gaps(gap, abs_gap)
    if regions not in ("any", "modules"):
        raise SolverError(f"regions {regions!r}: use 'any' (runs of ops) or 'modules' (the model's module calls).")
    if regions == "modules" and not graph.modules:
        raise SolverError(f"regions 'modules': the graph {graph.name!r} records no module calls (its file has no "
                          "'modules' field). Trace the model again with this version of bonsai, or use regions 'any'.")
    if drop_outputs and regions == "modules":
        raise SolverError("drop_outputs needs regions 'any': with regions 'modules' the plan is applied to the "
                          "module calls as torch.utils.checkpoint regions, which keep their outputs.")
    if space not in ("auto", "ops", "regions"):
        raise SolverError(f"space {space!r}: use 'auto' (op-level plans and checkpoint regions), 'ops' or 'regions'.")
    if regions == "modules" and space == "ops":
        raise SolverError("space 'ops' plans single ops, not module calls: use regions 'any', or space 'regions'.")
    if not graph.is_forward.any():  # nothing to checkpoint
        schedule = plan_schedule(graph, CheckpointPlan.of([]), "bonsai")
        schedule.stats = {"status": "optimal", "gap": 0.0, "variables": 0, "constraints": 0,
                          "build_seconds": 0.0, "solve_seconds": 0.0, "candidates": 0, "segments": 0,
                          "granularity": 0, "plan_source": "ilp", "space": "regions", "spaces": ["regions"]}
        return schedule
    if regions == "modules" or budget is None:
        space = "regions"  # module calls are checkpoint regions; with no budget nothing is recomputed
    elif space == "auto" and holds_others(graph):
        space = "regions"  # module doc, "Pipeline ranks"
    return _search(graph, budget, space, time_limit, backend, gap, offload,
                   lambda left: _regions(graph, budget, left, granularity, backend, Gaps(gap, abs_gap), regions,
                                         drop_outputs, save_self_contained, save_ops, reuse, offload))


def _check_gaps(gap: float, abs_gap: float) -> None:
    """SolverError, saying what to give, unless both gaps are numbers in [0, 1)."""
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < 1:
        raise SolverError(f"gap {gap!r} is not a relative MIP gap in [0, 1): 0.01 stops within 1% of the "
                          "model's optimum, 1e-4 proves it.")
    if isinstance(abs_gap, bool) or not isinstance(abs_gap, (int, float)) or not 0 <= abs_gap < 1:
        raise SolverError(f"abs_gap {abs_gap!r} is not an absolute gap in [0, 1) of one step's compute: 5e-4 stops "
                          "once no plan can be more than 0.05% of the step faster, 0 leaves the relative gap alone.")


def _search(graph: Graph, budget: int | None, space: Space, time_limit: float | None, backend: str, gap: float,
            offload: bool, regions: Any) -> Schedule:
    """The spaces ``space`` names, within one time limit: the lower bound, the op-level plan, then (unless
    that plan is within ``gap`` of the bound, or less than REGIONS_SHARE of the time limit is left: a
    large step's segment ILP takes its time to build) ``regions(seconds left)``, the checkpoint plan; the
    cheaper plan (a tie: the checkpoint plan), with the bound in its stats."""
    clock = Deadline(time_limit)
    bound = _bound(graph, budget, offload) if budget is not None else None
    ops = _ops(graph, budget, clock, backend, gap, bound, offload) if space != "regions" else None
    if ops is not None and (space == "ops" or _within(ops.sim.compute_cost, bound, gap)):
        return _with_bound(ops.schedule, bound, ["ops"], ops.sim.compute_cost)
    if space == "ops":
        raise _no_ops_plan(graph, budget, bound)
    left = clock.remaining()
    if ops is not None and left is not None and time_limit is not None and left < REGIONS_SHARE * time_limit:
        return _with_bound(ops.schedule, bound, ["ops"], ops.sim.compute_cost)  # too little time to build the ILP
    try:
        if left is not None and left <= 0:
            raise BudgetError(f"bonsai found no plan of {graph.name!r} within {format_bytes(budget)} before the time "
                              f"limit of {time_limit:g} s. Raise --time-limit or the budget.", timed_out=True)
        schedule = regions(left)
    except BudgetError:
        if ops is None:
            raise
        return _with_bound(ops.schedule, bound, ["ops", "regions"], ops.sim.compute_cost)
    searched = ["regions"] if space == "regions" else ["ops", "regions"]
    sim = simulated(graph, schedule)
    if ops is not None and ops.sim.compute_cost < sim.compute_cost:
        ops.schedule.stats["regions_overhead"] = sim.overhead
        return _with_bound(ops.schedule, bound, searched, ops.sim.compute_cost)
    if ops is not None:
        schedule.stats = {**schedule.stats, "ops_overhead": ops.sim.overhead}
    return _with_bound(schedule, bound, searched, sim.compute_cost)


def _regions(graph: Graph, budget: int | None, time_limit: float | None, granularity: int | None, backend: str,
             gaps: Gaps, regions: Regions, drop_outputs: bool, save_self_contained: bool, save_ops: bool,
             reuse: bool, offload: bool) -> Schedule:
    """The segment ILP's checkpoint plan (with the plans solved earlier reused where they fit)."""
    plans_key = (graph.hash, ("plans", granularity, regions, drop_outputs, save_self_contained, save_ops, backend, gaps)
                 + (("offload",) if offload else ()))
    # looked up before waiting for the graph's lock (another session may be solving for minutes), and again
    # after it (the one that held it may have solved a plan that fits)
    earlier = _reused(plans_key, budget) if reuse else None
    if earlier is not None:
        return earlier
    with _graph_lock(graph):  # the cached problems are shared (explorer sessions run in threads)
        earlier = _reused(plans_key, budget) if reuse else None
        if earlier is not None:
            return earlier
        schedule = _solve(graph, budget, time_limit, granularity, backend, gaps, regions, drop_outputs,
                          save_self_contained, save_ops, offload)
        if budget is not None and _reusable(schedule, gaps):
            st = schedule.stats
            simulated_peak = st["model_peak"] - st["model_slack"]
            entry = (max(st["model_peak"], simulated_peak), int(budget), _copy(schedule))
            solved = _cached(plans_key, list)
            with _cache_lock:
                solved.insert(0, entry)
                del solved[_PLANS_KEPT:]
        return schedule


def _reused(plans_key: tuple[str, Any], budget: int | None) -> Schedule | None:
    """A copy of a plan solved for a larger budget that fits ``budget`` (module docstring), if one is known."""
    if budget is None:
        return None
    with _cache_lock:
        solved = list(_cache.get(plans_key, ()))
    for low, high, earlier in solved:  # (lowest budget it fits, budget it was solved for, plan)
        if low <= budget <= high:
            return _copy(earlier, reused_from=high, solve_seconds=0.0, build_seconds=0.0, cached=True)
    return None


def _reusable(schedule: Schedule, gaps: Gaps) -> bool:
    """Whether ``schedule`` (just solved) is within ``gaps`` of the model's optimum at the budget it was
    solved for: an ILP plan, found within them, the model's budget not tightened."""
    st = schedule.stats
    return st.get("plan_source") == "ilp" and st.get("tightened_by") == 0 and gaps.met_by(st)


def _copy(schedule: Schedule, **stats: Any) -> Schedule:
    """A copy whose stats and fields the caller may change (``solve`` sets them on what it returns)."""
    return dataclasses.replace(schedule, ops=list(schedule.ops), stats={**schedule.stats, **stats},
                               extra=dict(schedule.extra))


def _bound(graph: Graph, budget: int, offload: bool) -> LowerBound:
    """The lower bound at ``budget`` (:func:`bonsai_core.bound.lower_bound`; with host copies when
    ``offload``), cached per graph and budget; what it builds whatever the budget, once per graph."""
    parts = lambda: _cached((graph.hash, ("bound parts", offload)),  # noqa: E731
                            lambda: BoundParts(graph, _tensors(graph), offload))
    return _cached((graph.hash, ("bound", int(budget), offload)),
                   lambda: lower_bound(graph, int(budget), offload=offload, parts=parts()))


def _tensors(graph: Graph) -> Tensors:
    return _cached((graph.hash, "tensors"), lambda: Tensors(graph))


def _within(cost: float, bound: LowerBound | None, gap: float) -> bool:
    """Whether a plan of compute ``cost`` is within ``gap`` of the lower bound, relative to its compute cost
    (the step's time): no schedule within the budget is more than that share faster."""
    return bound is not None and np.isfinite(bound.cost) and _proven_gap(cost, bound) <= gap


def _proven_gap(cost: float, bound: LowerBound) -> float:
    """(cost - bound) / cost: how much faster a schedule within the budget could be, at most."""
    return max(0.0, cost - bound.cost) / cost if cost > 0 else 0.0


def _ops(graph: Graph, budget: int, clock: Deadline, backend: str, gap: float,
         bound: LowerBound | None, offload: bool = False) -> OpsOutcome | None:
    """The op-level plan within ``budget`` (None: none found before the clock ran out), its stats set;
    ``offload``: with host copies."""
    if bound is not None and not np.isfinite(bound.cost):
        return None
    start = time.perf_counter()
    found = plan_ops(graph, budget, clock, backend, gap, points=(bound.node,) if bound and bound.node >= 0 else (),
                     tensors=_tensors(graph), offload=offload)
    if found.schedule is None:
        return None
    proven = None if bound is None else _proven_gap(found.sim.compute_cost, bound)
    found.schedule.stats = {
        "status": "optimal" if proven is not None and proven <= 1e-4 else "feasible", "gap": proven,
        "plan_source": "ops", "space": "ops", "points": len(found.points), "rounds": found.rounds,
        "variables": found.variables, "constraints": found.constraints, "milp_seconds": found.milp_seconds,
        "solve_seconds": time.perf_counter() - start, "backend": backend,
        **({"offloaded": len(found.schedule.extra["offloaded"])} if offload else {})}
    return found


def _with_bound(schedule: Schedule, bound: LowerBound | None, searched: list[str], cost: float) -> Schedule:
    """``schedule`` (of compute ``cost``) with the lower bound and its distance from it in its stats, and
    the spaces searched."""
    stats = {**schedule.stats, "spaces": searched}
    stats.setdefault("space", "regions")
    if bound is not None:
        stats.update(bound.stats(cost))
    schedule.stats = stats
    return schedule


def _no_ops_plan(graph: Graph, budget: int, bound: LowerBound | None) -> BudgetError:
    why = f" ({bound.how})" if bound is not None and not np.isfinite(bound.cost) else ""
    return BudgetError(f"bonsai found no op-level plan of {graph.name!r} within {format_bytes(budget)}{why}. Raise "
                       "the budget or the time limit, or search checkpoint regions too (space 'auto').")


def _solve(graph: Graph, budget: int | None, time_limit: float | None, granularity: int | None,
           backend: str, gaps: Gaps, regions: Regions, drop_outputs: bool, save_self_contained: bool,
           save_ops: bool, offload: bool = False) -> Schedule:
    clock = Deadline(time_limit)
    times = _Times()
    with times("profile"):
        plain_peak = int(_plain(graph).memory.max())
        fallbacks = fallback_plans(graph, regions, save_self_contained)
    target = int(budget) if budget is not None else plain_peak
    ladder = [1] if regions == "modules" else auto_ladder(graph) if granularity is None else [granularity]
    tried: list[int] = []
    found: _Found | None = None
    built, cached = None, False
    for gran in ladder:
        if clock.passed():
            break
        cached = (graph.hash, ("model", min(gran, max(1, op_count(graph))), regions, drop_outputs,
                               save_self_contained, save_ops) + (("offload",) if offload else ())) in _cache
        before = dict(times.parts)
        try:
            with times("build"):
                built = build(graph, gran, regions, drop_outputs, save_self_contained, save_ops, offload, clock)
        except OutOfTime:
            break  # no time left to build this rung: what the rungs before found, or a fallback plan
        tried.append(built.seg.granularity)
        start = None
        if offload:  # the plan without offload is the offload model's MIP start, and its answer if it finds none
            try:
                with times("build"):
                    plain_built = build(graph, gran, regions, drop_outputs, save_self_contained, save_ops, clock=clock)
            except OutOfTime:
                break
            start = _solve_model(graph, plain_built, target, backend, clock, gaps, times)
            if start is not None and not np.array_equal(plain_built.candidates, built.candidates):
                raise AssertionError("the models with and without offload have different candidates")
        found = _solve_model(graph, built, target, backend, clock, gaps, times, start)
        if found is not None:
            break
        times.spent_on("ladder", since=before)  # a rung whose model cannot meet the budget
    if found is None:
        with times("fallback"):
            fallback = fallbacks.best(graph, target, clock=clock) if built is not None else None
            if fallback is None:
                raise _no_plan(graph, built, target, backend, clock, fallbacks, tried, regions, drop_outputs)
        return _fallen_back(graph, fallback, tried, clock, built, regions, times)
    schedule, outcome = found.schedule, found.outcome
    with times("validate"):
        sim = simulated(graph, schedule)
    model_peak, ilp_peak = built.predicted_peak(found.rec, found.off), sim.peak
    source = "ilp"
    with times("fallback"):
        fallback = fallbacks.best(graph, target, below=sim.compute_cost * (1 - 1e-9), clock=clock)
        if fallback is not None:
            schedule, source = plan_schedule(graph, fallback[3], "bonsai"), "fallback"
            sim = simulated(graph, schedule)
    schedule.stats = {
        **outcome.stats(), **times.stats(), "milp_seconds": outcome.solve_seconds, "build_seconds": built.build_seconds,
        "cached": cached, "backend": backend, "granularity": built.seg.granularity,
        "granularity_mode": "auto" if granularity is None else "set", "granularities_tried": tried,
        "candidates": built.seg.count, "ilp_candidates": len(built.candidates),
        "segments": len(CheckpointPlan.from_extra(schedule.extra).segments),
        "recomputed_segments": len(CheckpointPlan.from_extra(schedule.extra).recomputed),
        "model_peak": model_peak, "model_slack": model_peak - ilp_peak,
        "tightened_by": found.tightened, "plan_source": source, "regions": regions,
        "outputs_dropped": len(CheckpointPlan.from_extra(schedule.extra).drop_outputs),
        "saved_nodes": len(CheckpointPlan.from_extra(schedule.extra).saved),
        "self_contained_saved": _self_contained_count(graph, CheckpointPlan.from_extra(schedule.extra)),
        "save_ops": save_ops, "levels": len(built.pinned) - 1,
        "offloaded": len(CheckpointPlan.from_extra(schedule.extra).offloaded),
        **({"offload_candidates": len(built.offload.nodes)} if built.offload is not None else {}),
        **({"offload_start": found.start_note} if found.start_note else {}),
    }
    if source == "fallback":
        schedule.stats.update(status="feasible", gap=None, fallback_plan=fallback[2],
                              ilp_overhead=outcome.objective)
    return schedule


class _Times:
    """Where a solve's wall time goes: ``with times("build"): ...`` adds the seconds to that part."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.parts: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, part: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - start

    def spent_on(self, part: str, since: dict[str, float]) -> None:
        """Book the seconds every part gained since the snapshot ``since`` to ``part`` instead."""
        moved = sum(v - since.get(k, 0.0) for k, v in self.parts.items())
        self.parts = {**since, part: since.get(part, 0.0) + moved}

    def stats(self) -> dict[str, Any]:
        """``solve_seconds``: the wall time of the call so far; ``time_split``: its parts."""
        return {"solve_seconds": time.perf_counter() - self.start,
                "time_split": {k: round(v, 3) for k, v in self.parts.items()}}


def _self_contained_count(graph: Graph, plan: CheckpointPlan) -> int:
    """How many of ``plan``'s saved nodes are self-contained in their recomputed segment."""
    pos = forward_positions(graph)
    constant = _cached((graph.hash, "self-contained"), lambda: self_contained(graph))  # each solve's stats read it
    return sum(1 for v in plan.saved if constant[pos[v]])


class _Found(NamedTuple):
    schedule: Schedule
    outcome: MilpOutcome  # its solve_seconds: all solves of the tightening together
    rec: np.ndarray  # 0/1 over the built model's candidates
    tightened: int  # bytes taken off the budget handed to the model
    off: np.ndarray | None = None  # 0/1 over the built model's offload candidates
    start_note: str | None = None  # what became of the MIP start (offload models)
    cost: float = 0.0  # the schedule's simulated compute cost


def _solve_model(graph: Graph, built: BuiltModel, target: int, backend: str, clock: Deadline,
                 gaps: Gaps, times: _Times, start: _Found | None = None) -> _Found | None:
    """The ILP at ``target`` with tightening, or None when the model cannot meet it (or no time is
    left before a plan was found). ``start``: a plan of the same candidates that offloads nothing,
    the MIP start of an offload model (whose own search can go minutes without an incumbent on the
    largest steps) and the answer when that model finds nothing better that fits."""
    tightened, seconds, note = 0, 0.0, None
    best = None
    for _attempt in range(_MAX_TIGHTEN + 1):
        left = clock.remaining()
        if left is not None and left <= 0:
            break
        built.budget.value = (target - tightened) / built.unit
        try:
            with times("solve"):
                if start is None:
                    outcome = _rounded(built, backend, left, gaps) or solve_milp(
                        built.problem, backend=backend, time_limit=clock.remaining(), gap=gaps.relative,
                        abs_gap=gaps.absolute)
                else:
                    outcome, note = _solve_from(built, start.rec, backend, left, gaps)
        except SolverError:
            if left is None and start is None:
                raise
            break  # the time ran out before the backend had a plan: fall back on what else was found
        seconds += outcome.solve_seconds
        if outcome.status == "infeasible":
            break
        with times("validate"):
            rec = np.round(built.rec.value)
            off = np.round(built.off.value) if built.off is not None else None
            schedule = plan_schedule(graph, useful_saved(graph, built.plan(rec, off)), "bonsai")
            sim = simulated(graph, schedule)
            peak = sim.peak
        if peak <= target:
            outcome = MilpOutcome(outcome.status, outcome.objective, outcome.gap, seconds, outcome.variables,
                                  outcome.constraints)
            best = _Found(schedule, outcome, rec, tightened, off, note, sim.compute_cost)
            break
        tightened += peak - target  # the model was not conservative here: ask it for the excess less
    if start is not None and (best is None or best.cost > start.cost):
        off = None if built.off is None else np.zeros(built.off.size)
        outcome = MilpOutcome("feasible", start.outcome.objective, None, start.outcome.solve_seconds + seconds,
                              *problem_size(built.problem))
        best = _Found(start.schedule, outcome, start.rec, start.tightened, off,
                      "the plan without offload: the offload model found none that fits and costs less", start.cost)
    return best


def _rounded(built: BuiltModel, backend: str, time_limit: float | None, gaps: Gaps) -> MilpOutcome | None:
    """The model's plan from its LP relaxation's rounding when that proves it within ``gaps``, else from the
    full MILP solved with that plan as its start (:mod:`bonsai_core.solvers.relaxation`; the relaxation is
    kept on ``built`` and re-solved from its last basis at each budget), its variables' values set as CVXPY's
    own solve sets them; status "infeasible" when the LP relaxation has no solution (proven twice:
    :func:`~bonsai_core.solvers.relaxation.proven_infeasible`); None: solve the MILP from scratch.
    HiGHS only, and not with offload columns (their solve starts from the plan without offload)."""
    if backend != "highs" or built.off is not None:
        return None
    canonical = from_cvxpy(built.problem)
    if built.relaxation is None or not same_structure(built.relaxation, canonical.milp):
        built.relaxation = relaxation_of(canonical.milp)
    offset = _objective_offset(built.problem)
    clock = Deadline(time_limit)
    found = round_relaxation(canonical.milp, built.relaxation, time_limit, gaps.relative, offset, gaps.absolute)
    if found is None and proven_infeasible(built.relaxation, canonical.milp, clock.remaining()):
        return MilpOutcome("infeasible", None, None, now() - clock.start, len(canonical.milp.cost),
                           canonical.milp.matrix.shape[0])  # the MILP from scratch would only prove it again
    if found is None:
        return None
    outcome, values, lp_bound = found
    if not gaps.proven(outcome.objective, lp_bound):  # not proven close enough: the MILP decides, from this plan
        whole = solve_from(canonical.milp, built.relaxation, values, lp_bound, clock.remaining(), gaps.relative,
                           offset, gaps.absolute)
        if whole is None:
            return None
        rounding_seconds, (outcome, values) = outcome.solve_seconds, whole
        outcome = dataclasses.replace(outcome, solve_seconds=outcome.solve_seconds + rounding_seconds)
    values = np.where(canonical.milp.integer, np.round(values), values)
    for variable in built.problem.variables():
        variable.save_value(canonical.value_of(values, variable))
    # the objective as CVXPY's solve reports it: with the constant its canonical form leaves out
    return dataclasses.replace(outcome, objective=float(built.problem.objective.value))


def _objective_offset(problem: Any) -> float:
    """The constant of ``problem``'s (linear) objective: its value with every variable at 0."""
    for variable in problem.variables():
        variable.save_value(np.zeros(variable.shape))
    return float(problem.objective.value)


def _solve_from(built: BuiltModel, start: np.ndarray, backend: str, time_limit: float | None,
                gaps: Gaps) -> tuple[MilpOutcome, str]:
    """The model's MILP on the backend itself, from the MIP start that recomputes the candidates ``start``
    and offloads nothing (when the start meets the model at its budget), its variables' values set as
    CVXPY's own solve sets them; and what became of the start. Never worse than the start
    (:func:`solve_sparse_milp`)."""
    canonical = from_cvxpy(built.problem)
    x = canonical.vector(built.start_values(start))
    meets = satisfies(canonical.milp, x)
    found = solve_sparse_milp(canonical.milp, backend, x if meets else None, time_limit=time_limit,
                              gap=gaps.relative, abs_gap=gaps.absolute)
    if found.values is not None:
        values = np.where(canonical.milp.integer, np.round(found.values), found.values)  # within the backend's tolerance
        for variable in built.problem.variables():  # CVXPY's validation refuses an empty boolean value
            variable.save_value(canonical.value_of(values, variable))
    return found.outcome, found.start_note if meets else "the plan without offload does not meet the model's budget: no start"


def _fallen_back(graph: Graph, fallback: tuple[int, float, str, CheckpointPlan], tried: list[int], clock: Deadline,
                 built: BuiltModel | None, regions: Regions, times: _Times) -> Schedule:
    schedule = plan_schedule(graph, fallback[3], "bonsai")
    plan = fallback[3]
    schedule.stats = {"status": "time_limit" if clock.passed() else "feasible", "gap": None,
                      "plan_source": "fallback", "fallback_plan": fallback[2], "granularities_tried": tried,
                      "granularity": built.seg.granularity if built is not None else None,
                      "segments": len(plan.segments), "recomputed_segments": len(plan.recomputed),
                      "build_seconds": built.build_seconds if built is not None else 0.0, "regions": regions,
                      **times.stats()}
    return schedule


def _no_plan(graph: Graph, built: BuiltModel | None, budget: int, backend: str, clock: Deadline, fallbacks: FallbackPlans,
             tried: list[int], regions: Regions = "any", drop_outputs: bool = False) -> BudgetError:
    """The error for a budget no plan was found for: the smallest budget bonsai can meet (its model's
    or a Chen plan's, whichever is lower), or that the time ran out."""
    lowest_fallback = fallbacks.lowest_peak(graph) if not clock.passed() else None
    smallest, proven = lowest_fallback, False
    left = clock.remaining()
    if built is not None and (left is None or left > 0):
        peak, status = _min_peak(graph, built, backend, left)  # None: only Chen's lowest peak is known
        if peak is not None:
            model = max(peak, budget + 1)  # above the budget just refused, whatever the solvers' tolerances
            smallest = model if smallest is None else min(smallest, model)
            proven = status == "optimal"
    where = f"granularit{'y' if len(tried) == 1 else 'ies'} {', '.join(map(str, tried)) or 'none'}"
    if clock.passed() and smallest is None:
        return BudgetError(f"bonsai found no checkpoint plan of {graph.name!r} within {format_bytes(budget)} "
                           f"before the time limit ({where}). Raise --time-limit or the budget.", timed_out=True)
    if smallest is None:
        return BudgetError(f"bonsai found no checkpoint plan of {graph.name!r} within {format_bytes(budget)}.")
    note = "" if proven else " (the search for it stopped early; it may be lower)"
    widen = "a larger --granularity" + ("" if drop_outputs else ", --option drop_outputs=true")
    if regions == "modules":
        where, widen = "module calls only", "regions 'any' (runs of ops)"
    bound = region_peak_bound(graph)
    if budget < bound.peak:  # the limit of checkpoint regions themselves, not of this model
        widen = "or use a method that also recomputes backward ops (moccasin, checkmate)"
        note += (f". No checkpoint plan fits below {format_bytes(bound.peak)}: when {graph.names[bound.node]!r} runs "
                 f"in the backward pass, every plan holds {format_bytes(bound.backward_bytes)} of backward tensors")
    else:
        widen = f"try {widen}, or another method"
    return BudgetError(
        f"bonsai ({where}) found no checkpoint plan of {graph.name!r} within {format_bytes(budget)}: the smallest "
        f"budget it can guarantee is {format_bytes(smallest)} ({smallest} bytes){note}. Raise the budget to at "
        f"least that, {widen}.", smallest=smallest)


def smallest_budget(graph: Graph, granularity: int | None = None, backend: str = DEFAULT_BACKEND,
                    time_limit: float | None = None, offload: bool = False,
                    drop_outputs: bool = False) -> tuple[int | None, str]:
    """(bytes, status): the smallest budget bonsai's model meets at ``granularity`` (None: the top of
    the auto ladder), by the min-peak MILP; status is the MILP's ("optimal" proves it). (None,
    "time_limit") when the backend had no plan within ``time_limit``. ``offload``, ``drop_outputs``:
    the model with those columns (the options of :func:`solve_bonsai`)."""
    with _graph_lock(graph):
        return _min_peak(graph, build(graph, auto_ladder(graph)[-1] if granularity is None else granularity,
                                      drop_outputs=drop_outputs, offload=offload), backend, time_limit)


def _min_peak(graph: Graph, built: BuiltModel, backend: str, time_limit: float | None) -> tuple[int | None, str]:
    """(bytes, status) of the model's min-peak MILP: the largest of its peak, the model's exact peak of the
    plan it found (a budget the main problem accepts even at the solvers' tolerances) and that plan's
    simulated peak (what the model leaves out, such as an FSDP rank's unsharded blocks, included);
    (None, status) when it has no plan: infeasible, or none within ``time_limit`` ("time_limit"; without a
    limit a failure raises). A proven answer is kept on ``built``: each budget below it asks again."""
    if built.min_peak_found is not None:
        return built.min_peak_found
    problem, z = built.min_peak_problem()
    try:
        outcome = solve_milp(problem, backend=backend, time_limit=time_limit)
    except SolverError:
        if time_limit is None:
            raise
        return None, "time_limit"
    if outcome.status == "infeasible":
        return None, outcome.status
    rec, off = np.round(built.rec.value), np.round(built.off.value) if built.off is not None else None
    simulated = simulate(graph, plan_schedule(graph, useful_saved(graph, built.plan(rec, off)), "bonsai")).peak
    found = max(int(np.ceil(float(z.value) * built.unit)), built.predicted_peak(rec, off), simulated), outcome.status
    if outcome.status == "optimal":
        built.min_peak_found = found
    return found


def lowest_budget(graph: Graph, backend: str = DEFAULT_BACKEND, time_limit: float | None = None) -> int | None:
    """The smallest budget bonsai meets with its default options: its model's at the top of the auto
    ladder (:func:`smallest_budget`) or a fallback plan's simulated peak, whichever is lower (None when the
    model's search found nothing in ``time_limit`` and there is no fallback plan)."""
    model, _ = smallest_budget(graph, backend=backend, time_limit=time_limit)
    with _graph_lock(graph):
        fallback = fallback_plans(graph).lowest_peak(graph)
    return min((b for b in (model, fallback) if b is not None), default=None)
