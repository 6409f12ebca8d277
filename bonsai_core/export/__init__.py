"""Schedule -> a runnable checkpointed model, and its verification against the original.

``export_model`` writes a folder that runs with plain PyTorch (no ``bonsai_core`` needed):

* ``checkpointed.py``: a small runtime (``bonsai_core/export_runtime/runtime.py``, copied as text) and a
  generated *program*: the traced AOTAutograd joint graph (forward, loss, backward; aten ops) written
  out as straight-line Python in the schedule's order, one line per ``compute`` op and a ``del`` per
  ``free`` op. A recomputation is the same line run again. ``load(model)`` wraps ``model`` in a
  ``Checkpointed`` module whose ``autograd.Function`` runs the ops up to the loss in ``forward`` and the
  rest in ``backward``; parameter gradients land in ``model``'s ``.grad``.
* ``schedule.json``: the schedule, with the simulator's predicted peak in ``stats``.
* ``README.md``: how to train with it and how to check it on a GPU.

Because every tensor the program creates is a node of the graph and Python frees it at the scheduled
``del``, the real step allocates what the simulator counted: checkpoint-region schedules (bonsai, chen)
and general ones (checkmate, moccasin, dtr, coop) run the same way. ``verify_export`` runs the original
and the exported step side by side and compares loss, gradients and peak memory.
"""

from bonsai_core.export.folder import export_model, export_traced, load_export, trace_for_schedule
from bonsai_core.export.program import ExportError, StepSignature, generate_program, signature_of, step_signature
from bonsai_core.export.verify import Verification, verify_export

__all__ = ["ExportError", "StepSignature", "Verification", "export_model", "export_traced", "generate_program",
           "load_export", "signature_of", "step_signature", "trace_for_schedule", "verify_export"]
