"""Bonsai explorer's library: trace a training step, segment it, solve for a rematerialization
schedule, simulate it and export it.

Data flows one way: model -> trace -> Graph -> segment -> solve -> Schedule -> simulate -> show/export.
Nothing here imports Streamlit; heavy dependencies (torch, cvxpy, ortools) are imported by the
modules that need them, so ``import bonsai_core`` is cheap.
"""

from bonsai_core.errors import BonsaiError, BudgetError, GraphError, ModelError, ScheduleError, SolverError
from bonsai_core.graph import Graph, load_graph, save_graph
from bonsai_core.schedule import Schedule, SimResult, load_schedule, save_schedule, simulate

__all__ = [
    "BonsaiError", "BudgetError", "GraphError", "ModelError", "ScheduleError", "SolverError",
    "Graph", "load_graph", "save_graph",
    "Schedule", "SimResult", "load_schedule", "save_schedule", "simulate",
]
__version__ = "0.1.0"
