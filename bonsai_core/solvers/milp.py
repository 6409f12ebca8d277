"""Solving CVXPY mixed-integer programs on HiGHS or SCIP, with one way of reporting the outcome.

Both MILP methods (``checkmate``, ``bonsai``) build a ``cp.Problem`` from sparse matrices with the
budget as a ``cp.Parameter`` and hand it here. :func:`solve_milp` applies the time limit in each
backend's own terms, and turns what each backend says (HiGHS' ``user_limit``, SCIP's
``optimal_inaccurate`` on a time-out, SCIP's ``SolverError`` with no incumbent) into one
:class:`MilpOutcome`: ``optimal``, ``feasible`` (with its gap), or ``infeasible``; a run with no
solution at all raises SolverError with what to do.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from bonsai_core.errors import SolverError
from bonsai_core.solvers.deadline import backend_seconds

# CVXPY warns "Solution may be inaccurate" when a backend stops at its time limit with an incumbent;
# solve_milp judges that incumbent itself (its gap, or "no solution") and says so in its status.
warnings.filterwarnings("ignore", message="Solution may be inaccurate", category=UserWarning)

BACKENDS = ("highs", "scip")
DEFAULT_BACKEND = "highs"


@dataclass(frozen=True)
class MilpOutcome:
    status: str  # "optimal" | "feasible" | "infeasible"
    objective: float | None
    gap: float | None  # relative MIP gap; 0 when optimal, None when the backend could not say
    solve_seconds: float
    variables: int
    constraints: int

    def stats(self) -> dict[str, Any]:
        return {"status": self.status, "gap": self.gap, "solve_seconds": self.solve_seconds,
                "variables": self.variables, "constraints": self.constraints, "objective": self.objective}


def problem_size(problem: Any) -> tuple[int, int]:
    """(scalar decision variables, scalar constraints) of a CVXPY problem."""
    m = problem.size_metrics
    return int(m.num_scalar_variables), int(m.num_scalar_eq_constr + m.num_scalar_leq_constr)


@functools.lru_cache(maxsize=None)
def _installed_solvers() -> frozenset[str]:
    """CVXPY's installed solvers, asked once (it probes every solver package: ~20 ms a call, which
    an explorer re-solve would pay on every slider move)."""
    import cvxpy as cp

    return frozenset(cp.installed_solvers())


def check_backend(backend: str) -> None:
    """SolverError unless ``backend`` is one of :data:`BACKENDS` and installed."""
    if backend not in BACKENDS:
        raise SolverError(f"Unknown MILP backend {backend!r}; choose one of: {', '.join(BACKENDS)}.")
    if backend not in _installed_solvers() and backend.upper() not in _installed_solvers():
        package = {"highs": "highspy", "scip": "pyscipopt"}[backend]
        raise SolverError(f"The {backend} backend is not installed: pip install {package}.")


def canonicalise(problem: Any, backend: str) -> None:
    """Turn a parametrised problem into ``backend``'s matrices now and cache them in the problem, so
    that its solves (at any parameter value) start at once: a time limit then covers this step
    rather than overrunning by it inside the first solve."""
    check_backend(backend)
    problem.get_problem_data(backend.upper())


def solve_milp(problem: Any, backend: str = DEFAULT_BACKEND, time_limit: float | None = None,
               verbose: bool = False, whole_limit: float | None = None, gap: float | None = None,
               abs_gap: float = 0.0) -> MilpOutcome:
    """Solve ``problem`` (a CVXPY MILP) on ``backend`` within ``time_limit`` seconds: what is left
    of the method's ``whole_limit`` (the user's ``--time-limit``, named in messages) if given.
    The solve stops at the relative MIP ``gap`` (default 1e-4 on both backends) or, when ``abs_gap`` is
    positive, at that absolute gap (objective units), whichever comes first."""
    import cvxpy as cp

    check_backend(backend)
    # SCIP's default gap limit is 0 (prove the exact optimum); HiGHS stops at a relative gap of 1e-4.
    # Give SCIP the same 1e-4, so that "optimal" means the same thing on both backends.
    options: dict[str, Any] = {} if backend == "highs" else {"scip_params": {"limits/gap": 1e-4}}
    if gap is not None:
        if backend == "highs":
            options["mip_rel_gap"] = float(gap)
        else:
            options["scip_params"]["limits/gap"] = float(gap)
    if abs_gap > 0:
        if backend == "highs":
            options["mip_abs_gap"] = float(abs_gap)
        else:
            options["scip_params"]["limits/absgap"] = float(abs_gap)
    if time_limit is not None:
        if backend == "highs":
            options["time_limit"] = float(backend_seconds(time_limit))
        else:
            options["scip_params"]["limits/time"] = float(backend_seconds(time_limit))
    if backend == "highs":
        _swallow_highs_banner()
    variables, constraints = problem_size(problem)
    start = time.perf_counter()
    try:
        # No warm start: CVXPY 1.9 hands HiGHS the previous solution after a Parameter change and
        # HiGHS can return that stale point as "optimal" (seen on the bonsai ILP when raising the budget).
        problem.solve(solver=backend.upper(), verbose=verbose, warm_start=False, **options)
    except cp.error.SolverError as e:
        limit = _limit_words(time_limit, whole_limit)
        raise SolverError(f"The {backend} backend found no solution{limit} ({e}). Raise --time-limit, raise "
                          "the budget, or try the other backend.") from None
    except Exception as e:  # a backend crash must not surface as a traceback
        raise SolverError(f"The {backend} backend failed: {type(e).__name__}: {e}") from None
    seconds = time.perf_counter() - start
    status = problem.status
    if status in ("infeasible", "infeasible_inaccurate"):
        return MilpOutcome("infeasible", None, None, seconds, variables, constraints)
    has_solution = all(v.value is not None for v in problem.variables()) and _backend_has_solution(problem, backend)
    if not has_solution:
        limit = _limit_words(time_limit, whole_limit)
        raise SolverError(f"The {backend} backend stopped with status {status!r} and no solution{limit}. "
                          "Raise --time-limit or the budget, or try the other backend.")
    gap = _gap(problem, backend)
    # A gap within 1e-4 is optimal on either backend, whatever CVXPY calls SCIP's "gap limit" stop.
    if (gap is not None and gap <= 1e-4) or (status == "optimal" and gap is None):
        return MilpOutcome("optimal", float(problem.value), 0.0, seconds, variables, constraints)
    return MilpOutcome("feasible", float(problem.value), gap, seconds, variables, constraints)


def _limit_words(time_limit: float | None, whole_limit: float | None) -> str:
    limit = whole_limit if whole_limit is not None else time_limit
    return f" within the time limit of {limit:g} s" if limit else ""


_banner_swallowed = False
_banner_lock = threading.Lock()  # two threads swapping fd 1 at once could leave stdout on stderr


def _swallow_highs_banner() -> None:
    """HiGHS prints a banner on stdout when a process makes its first solver object, which would
    corrupt ``bonsai solve --json`` and adds two lines of noise to every command. Make that first
    object with stdout pointed at the null device."""
    with _banner_lock:
        if not _banner_swallowed:
            _make_first_highs_quietly()


def _make_first_highs_quietly() -> None:
    global _banner_swallowed
    import ctypes

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        highspy.Highs()
        ctypes.CDLL(None).fflush(None)  # C stdio may hold the banner in its buffer
    except (OSError, TypeError, AttributeError):  # no libc by that name: the banner may show, no harm
        pass
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    _banner_swallowed = True


def _backend_has_solution(problem: Any, backend: str) -> bool:
    """HiGHS stopped by its time limit before any incumbent still hands CVXPY a vector (not a
    solution): its primal solution status says so (0 = none, 2 = feasible)."""
    if backend != "highs":
        return True
    status = getattr(problem.solver_stats.extra_stats, "primal_solution_status", None)
    return status is None or int(status) == 2


def _gap(problem: Any, backend: str) -> float | None:
    """(incumbent - bound) / |incumbent|, HiGHS' definition; SCIP's own getGap() divides by the
    smaller of the two, which reads as several hundred percent for the same solution."""
    extra = problem.solver_stats.extra_stats
    try:
        if backend == "highs":
            gap = extra.mip_gap
        else:
            primal, dual = extra["model"].getPrimalbound(), extra["model"].getDualbound()
            gap = 0.0 if primal == dual else abs(primal - dual) / abs(primal) if primal else math.inf
    except (AttributeError, KeyError, TypeError):
        return None
    return float(gap) if gap is not None and math.isfinite(gap) else None
