"""Where model code failed, said in words: the shared wording of errors about the user's code.

Both building a model (:mod:`bonsai_core.models`, a ``package.module:factory`` that fails) and tracing
its step (:mod:`bonsai_core.trace`) name the innermost frame of model code with :func:`user_code`, and
tell a tensor-value read (:data:`DATA_DEPENDENT_ERRORS`) apart from other failures.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.nn as nn

# What torch raises when Python code needs a tensor's value (which fake tensors do not have).
DATA_DEPENDENT_ERRORS = ("DataDependentOutputException", "GuardOnDataDependentSymNode",
                          "DynamicOutputShapeException", "UnsupportedOperatorException")
_TORCH_DIR = os.path.dirname(torch.__file__)
_BONSAI_DIR = os.path.dirname(__file__)
_ZOO_FILE = os.path.join(_BONSAI_DIR, "models", "zoo.py")


def user_code(e: BaseException, root: nn.Module | None = None) -> str:
    """'module NAME (Class) at FILE:LINE `code`' for the innermost frame of e in model code: outside
    torch and bonsai's own machinery (the zoo's models count as model code). NAME: the module's path
    in ``root`` (without a root, as while a factory builds the model: 'module Class at ...')."""
    frames = [(f, tb_line) for f, tb_line in traceback.walk_tb(e.__traceback__)
              if not f.f_code.co_filename.startswith(_TORCH_DIR)
              and (not f.f_code.co_filename.startswith(_BONSAI_DIR) or f.f_code.co_filename == _ZOO_FILE)]
    if not frames:
        return "model code"
    frame, line = frames[-1]
    summary = traceback.FrameSummary(frame.f_code.co_filename, line, frame.f_code.co_name)
    where = f"{summary.filename}:{line} `{(summary.line or '').strip()}`"
    owner = frame.f_locals.get("self")
    if isinstance(owner, nn.Module) and root is None:
        return f"module {type(owner).__name__} at {where}"
    if isinstance(owner, nn.Module):
        path = next((n for n, m in root.named_modules() if m is owner), "")
        label = ("" if path == "model" else path.removeprefix("model.")) or "(the model itself)"
        return f"module {label} ({type(owner).__name__}) at {where}"
    return f"{frame.f_code.co_name} at {where}"

