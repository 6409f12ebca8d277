"""The Compare page's sweeps: one method or many over budgets, or over granularities at one budget.

Each point is a full solve through :func:`explorer.compute.solve`, so a point solved once (by a sweep,
the sidebar or another session) is not solved again. No Streamlit here: the page draws the progress
from ``on_solve`` (called before each solve with its index, the number of jobs and the job).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from bonsai_core.graph import Graph
from explorer import compute

OnSolve = Callable[[int, int, str, int], None]  # (index, jobs, method, budget or granularity)


@dataclass
class Sweep:
    """What a sweep found: one dict per schedule (``rows``) and (method, value, error) per failure,
    where value is the budget of a budget sweep and the granularity of a granularity sweep."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[tuple[str, int, str]] = field(default_factory=list)


def budgets(reference: int, low: float, high: float, points: int) -> list[int]:
    """``points`` budgets evenly from ``low`` to ``high`` percent of the no-remat peak ``reference``."""
    return [int(reference * p / 100) for p in np.linspace(low, high, int(points))]


def solve_seconds(out: compute.Outcome) -> float:
    """The solver's own time when it reports one, else the whole call's."""
    return float(out.schedule.stats.get("solve_seconds", out.wall_seconds))


def budget_sweep(graph: Graph, methods: Sequence[str], budget_list: Sequence[int],
                 options_for: Callable[[str], compute.Options], on_solve: OnSolve | None = None) -> Sweep:
    """Each method at each budget, with the options ``options_for(method)`` gives. Rows: method,
    budget, peak, overhead, solve_seconds."""
    sweep = Sweep()
    jobs = [(m, b) for m in methods for b in budget_list]
    for i, (method, budget) in enumerate(jobs):
        if on_solve is not None:
            on_solve(i, len(jobs), method, budget)
        out = compute.solve(graph, budget, method, options_for(method))
        if out.ok:
            sweep.rows.append({"method": method, "budget": budget, "peak": out.sim.peak, "overhead": out.sim.overhead,
                               "solve_seconds": solve_seconds(out)})
        else:
            sweep.failures.append((method, budget, out.error))
    return sweep


def granularity_sweep(graph: Graph, budget: int, methods: Sequence[str], granularities: Sequence[int],
                      options_for: Callable[[str], compute.Options], on_solve: OnSolve | None = None) -> Sweep:
    """Each method at each granularity under ``budget`` (its other options from ``options_for``). Rows:
    method, granularity, variables, constraints, solve_seconds, overhead %."""
    sweep = Sweep()
    jobs = [(m, k) for m in methods for k in granularities]
    for i, (method, k) in enumerate(jobs):
        if on_solve is not None:
            on_solve(i, len(jobs), method, k)
        options = {**dict(options_for(method)), "granularity": k}
        out = compute.solve(graph, budget, method, tuple(sorted(options.items())))
        if out.ok:
            stats = out.schedule.stats
            sweep.rows.append({"method": method, "granularity": k, "variables": stats.get("variables", 0),
                               "constraints": stats.get("constraints", 0), "solve_seconds": solve_seconds(out),
                               "overhead %": round(100 * out.sim.overhead, 3)})
        else:
            sweep.failures.append((method, k, out.error))
    return sweep


def parse_granularities(text: str) -> list[int]:
    """The whole numbers >= 1 in ``text`` (commas or spaces between), sorted; ValueError otherwise."""
    values = sorted({int(v) for v in text.replace(",", " ").split()})
    if not values or values[0] < 1:
        raise ValueError(f"no granularities >= 1 in {text!r}")
    return values


def default_granularities(forward_ops: int) -> str:
    """A spread of granularities for a graph of ``forward_ops`` forward ops: 2%, 5%, 10% and 20% of them."""
    return ", ".join(str(v) for v in sorted({max(1, int(forward_ops * f)) for f in (0.02, 0.05, 0.1, 0.2)}))


def sweep_table(sweep: Sweep, reference: int) -> pd.DataFrame:
    """One row per solve of a budget sweep, failures included (with their error), by method then budget."""
    solved = [{"method": r["method"], "budget %": round(100 * r["budget"] / reference, 1), "budget (bytes)": r["budget"],
               "peak (bytes)": r["peak"], "peak %": round(100 * r["peak"] / reference, 2),
               "overhead %": round(100 * r["overhead"], 3), "solve seconds": round(r["solve_seconds"], 4), "error": ""}
              for r in sweep.rows]
    failed = [{"method": m, "budget %": round(100 * b / reference, 1), "budget (bytes)": b, "error": e}
              for m, b, e in sweep.failures]
    columns = ["method", "budget %", "budget (bytes)", "peak (bytes)", "peak %", "overhead %", "solve seconds", "error"]
    return pd.DataFrame(solved + failed, columns=columns).sort_values(["method", "budget (bytes)"], kind="stable")
