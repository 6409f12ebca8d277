"""Every model source behind one call: ``build(spec, **options) -> (model, example_inputs, loss_fn)``.

``model(*example_inputs)`` is the output and ``loss_fn(output)`` a scalar loss; ``loss_fn`` holds its
targets as buffers. Nothing here knows of tracing: :mod:`bonsai_core.trace` calls :func:`build` under
``FakeTensorMode``, ``bonsai export``/``verify`` call it on real tensors. A spec is one of:

* a name of the built-in zoo (:mod:`bonsai_core.models.zoo`: ``mlp``, ``gpt``, ...);
* ``hf:ARCH`` or ``hf:PATH/config.json``, a Hugging Face ``transformers`` model built from its config
  (:mod:`bonsai_core.models.hf`);
* ``torchtitan:llama3:FLAVOUR``, torchtitan's own Llama 3 and loss (:mod:`bonsai_core.models.torchtitan`);
* ``package.module:factory``, a callable of the user's (:mod:`bonsai_core.models.factory`).

An exported program saved as ``.pt2`` (an upload in the explorer) is loaded as data by
:func:`bonsai_core.models.pt2.load`, which gives the same triple.

Build options beside the sizes: ``dtype`` ("fp32", "bf16", "fp16"; any model) builds the model and
batch in that type (:func:`in_dtype`), and ``attention`` ("sdpa", "eager"; ``hf:`` models only) picks
the attention implementation (:func:`bonsai_core.models.hf.build`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from bonsai_core.errors import ModelError
from bonsai_core.models import factory, hf, torchtitan
from bonsai_core.models.entry import Built
from bonsai_core.models.zoo import ZOO

__all__ = ["build", "in_dtype", "Built", "DTYPES"]

# ``dtype`` build option: the type of the parameters, floating buffers and floating inputs
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(name: str, seed: int = 0, **options: Any) -> Built:
    """Build a zoo model, a Hugging Face model (``hf:ARCH`` or ``hf:PATH/config.json``, see
    :mod:`bonsai_core.models.hf`) or a ``package.module:factory`` callable, with its batch and loss.

    Options not given take the entry's defaults; unknown options raise ModelError. ``dtype`` (any
    model) and ``attention`` (``hf:`` models) are build options (module docstring).
    """
    dtype = options.pop("dtype", None)
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"dtype={dtype!r}; choose one of: {', '.join(DTYPES)}.")
    return in_dtype(_build(name, seed, options), DTYPES[dtype] if dtype else None)


def in_dtype(built: Built, dtype: torch.dtype | None) -> Built:
    """``built`` with its floating parameters and buffers in ``dtype`` (what ``model.to(dtype)``
    makes), and its floating inputs and loss buffers too, as a training run in that type holds them.
    None: unchanged."""
    if dtype is None:
        return built
    model, inputs, loss_fn = built
    cast = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    if isinstance(loss_fn, nn.Module):
        _tensors_to(loss_fn, dtype)  # floating targets (integer class ids stay as they are)
    return _tensors_to(model, dtype), cast, loss_fn


def _tensors_to(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with every floating parameter and buffer replaced by a copy in ``dtype``, a tied one
    (one tensor under several names) by one copy. ``module.to(dtype)`` does this for real tensors, but
    refuses parameters that are fake tensors (it swaps them, and the fake tensor mode holds weak
    references to them), so the trace, which builds on fake tensors, converts them here."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original, kept alive; copy)

    def copy(t: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if id(t) not in copies:
            copies[id(t)] = (t, make(t))
        return copies[id(t)][1]

    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_floating_point():
                m._parameters[name] = copy(p, lambda t: nn.Parameter(t.detach().to(dtype), t.requires_grad))
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point():
                m._buffers[name] = copy(b, lambda t: t.to(dtype))
    return module


def _build(name: str, seed: int, options: dict[str, Any]) -> Built:
    """:func:`build` without the ``dtype`` option."""
    is_hf = name.startswith("hf:")
    if "attention" in options and not is_hf:
        raise ModelError(f"Option attention applies to hf: models only; {name!r} is not one.")
    if name.startswith(torchtitan.PREFIX):
        _check_sizes(name, options)
        torch.manual_seed(seed)
        return torchtitan.build(name[len(torchtitan.PREFIX):], **options)
    if ":" in name and not is_hf:
        return factory.build(name, seed, **options)
    if not is_hf and name not in ZOO:
        raise ModelError(f"Unknown model {name!r}. Built-in models: {', '.join(ZOO)}; Hugging Face models: "
                         "hf:ARCH (see `bonsai zoo`) or hf:PATH/config.json; torchtitan: torchtitan:llama3:FLAVOUR; or pass "
                         "'package.module:factory' for a callable returning (model, example_inputs, loss_fn).")
    _check_sizes(name, {k: v for k, v in options.items() if not (k == "attention" and is_hf)})  # a name: hf.build checks it
    if is_hf:
        torch.manual_seed(seed)
        return hf.build(name[len("hf:"):], **options)
    entry = ZOO[name]
    entry.check_options(options, repr(name))
    torch.manual_seed(seed)
    return entry.factory(**options)




def _check_sizes(name: str, options: dict[str, Any]) -> None:
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelError(f"Option {key}={value!r} of model {name!r} must be a positive whole number.")
