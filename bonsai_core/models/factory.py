"""Models from the user's own code: a ``package.module:factory`` spec names a callable that returns
``(model, example_inputs, loss_fn)``.

Building calls the user's code, so every failure is said in words, naming the line of their code that
failed (:func:`bonsai_core.user_code.user_code`), never with a traceback.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn as nn

from bonsai_core.errors import BonsaiError, ModelError, ValueReadError
from bonsai_core.models.entry import Built
from bonsai_core.user_code import DATA_DEPENDENT_ERRORS, user_code


def build(spec: str, seed: int, **options: Any) -> Built:
    """Import ``package.module``, seed torch and call its ``factory(**options)``; raises ModelError
    (ValueReadError for a read of a tensor's value) saying what failed where."""
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ModelError(f"Cannot load the model factory {spec!r} ({e}). Give 'package.module:function' "
                         "with the module importable (for a file in the current directory, run with PYTHONPATH=.).") from None
    torch.manual_seed(seed)
    call = f"{spec}({', '.join(f'{k}={v!r}' for k, v in options.items())})"
    try:
        built = factory(**options)
    except TypeError as e:
        raise ModelError(f"Calling {call} failed: {e}.") from None
    except BonsaiError:
        raise
    except Exception as e:  # the factory's own code: say where, never a traceback
        if type(e).__name__ in DATA_DEPENDENT_ERRORS:
            raise ValueReadError(f"Calling {call} failed in {user_code(e)} ({type(e).__name__}: {e}); it reads a "
                                 "tensor's value, which tracing (on fake tensors: shapes only) cannot give, so "
                                 "compute it from plain Python numbers.") from None
        raise ModelError(f"Calling {call} failed in {user_code(e)} ({type(e).__name__}: {e}).") from None
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nn.Module)):
        raise ModelError(f"{spec} must return (model, example_inputs, loss_fn); it returned {type(built).__name__}.")
    model, inputs, loss_fn = built
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), loss_fn

