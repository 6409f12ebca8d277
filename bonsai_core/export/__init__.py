"""Schedule -> a runnable checkpointed model, and its verification against the original.

Two back-ends write an export folder (``checkpointed.py``, ``schedule.json``, ``README.md``) that runs
with plain PyTorch (no ``bonsai_core`` needed):

* ``replay`` (:mod:`bonsai_core.export.replay`, ``export_model``): ``checkpointed.py`` is a small runtime
  (``bonsai_core/export_runtime/runtime.py``, copied as text) and a generated *program*: the traced
  AOTAutograd joint graph (forward, loss, backward; aten ops) written out as straight-line Python in the
  schedule's order, one line per ``compute`` op and a ``del`` per ``free`` op. A recomputation is the
  same line run again. ``load(model)`` wraps ``model`` in a ``Checkpointed`` module whose
  ``autograd.Function`` runs the ops up to the loss in ``forward`` and the rest in ``backward``;
  parameter gradients land in ``model``'s ``.grad``. Because every tensor the program creates is a node
  of the graph and Python frees it at the scheduled ``del``, the real step allocates what the simulator
  counted: checkpoint-region schedules (bonsai, chen) and general ones (checkmate, moccasin, dtr, coop)
  run the same way.
* ``checkpoint`` (:mod:`bonsai_core.export.checkpoint`, ``export_checkpoint``): a checkpoint-region plan
  applied to the user's own module with ``torch.utils.checkpoint`` (imported when used).

What both share lives once: :mod:`~bonsai_core.export.folder` (the traced step a schedule was made for,
writing and loading the folder), :mod:`~bonsai_core.export.readme` (the README of each back-end) and
:mod:`~bonsai_core.export.verify` (``verify_export`` and ``verify_checkpoint``: the original and the
exported step side by side, loss, gradients and peak memory judged with the same tolerances).

``bonsai_core/export_runtime/`` stays a package of its own: its files are copied as text into exports,
and ``bonsai_core.checkpoint`` imports ``export_runtime.checkpointing`` at run time without loading
this package (and with it torch.fx and the tracer).
"""

from bonsai_core.export.folder import ExportError, load_export, trace_for_schedule
from bonsai_core.export.replay import (StepSignature, export_model, export_traced, generate_program, signature_of,
                                      step_signature)
from bonsai_core.export.verify import Verification, verify_export

__all__ = ["ExportError", "StepSignature", "Verification", "export_model", "export_traced", "generate_program",
           "load_export", "signature_of", "step_signature", "trace_for_schedule", "verify_export"]
