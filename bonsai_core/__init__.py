"""Bonsai explorer's library: trace a training step, segment it, solve for a rematerialization
schedule, simulate it and export it.

Data flows one way: model -> trace -> Graph -> segment -> solve -> Schedule -> simulate -> show/export.
In a training script, ``bonsai_core.checkpoint(model, inputs, loss_fn, budget="20GiB")`` runs it all and
applies the plan to the model (:mod:`bonsai_core.training`).
Nothing here imports Streamlit; heavy dependencies (torch, cvxpy, ortools) are imported by the
modules that need them, so ``import bonsai_core`` is cheap.
"""

from bonsai_core.errors import BonsaiError, BudgetError, GraphError, ModelError, ScheduleError, SolverError
from bonsai_core.graph import Graph, load_graph, save_graph
from bonsai_core.schedule import Schedule, SimResult, load_schedule, save_schedule, simulate
from bonsai_core.version import __version__  # noqa: F401 (bonsai_core.__version__)

__all__ = [
    "BonsaiError", "BudgetError", "GraphError", "ModelError", "ScheduleError", "SolverError",
    "Graph", "load_graph", "save_graph",
    "Schedule", "SimResult", "load_schedule", "save_schedule", "simulate",
    "checkpoint", "plan", "remove_checkpoints", "Plan", "Report",
]

# The one call in a training script (bonsai_core.training imports torch: loaded on first use).
_TRAINING = ("checkpoint", "plan", "remove_checkpoints", "Plan", "Report")


def __getattr__(name: str):  # noqa: ANN202 (PEP 562 module attribute)
    if name in _TRAINING:
        from bonsai_core import training
        from bonsai_core.export_runtime.checkpointing import remove_checkpoints

        return remove_checkpoints if name == "remove_checkpoints" else getattr(training, name)
    raise AttributeError(f"module 'bonsai_core' has no attribute {name!r}")
