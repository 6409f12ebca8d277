"""What every model source gives and how its size options are described.

``Built``: (model, example_inputs, loss_fn), what :func:`bonsai_core.models.build` returns;
``ZooEntry``: a named factory of the built-in zoo or of the built-in Hugging Face architectures,
whose keyword parameters are its size options.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from bonsai_core.errors import ModelError

Built = tuple[nn.Module, tuple[torch.Tensor, ...], nn.Module]


def check_divisible(value: int, by: int, what: str) -> None:
    if value <= 0 or value % by:
        raise ModelError(f"{what}={value} must be a positive multiple of {by} for this model.")


@dataclass(frozen=True)
class ZooEntry:
    name: str
    factory: Callable[..., Built]
    description: str

    @property
    def options(self) -> dict[str, int]:
        """The model's size options and their defaults (the factory's parameters that are not
        keyword-only: a keyword-only one, like ``attention``, is a build choice, not a size)."""
        return {p.name: p.default for p in inspect.signature(self.factory).parameters.values()
                if p.kind is not p.KEYWORD_ONLY}

    def check_options(self, options: dict[str, Any], label: str) -> None:
        """Raise ModelError naming the options this model does not take, and the ones it does."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ModelError(f"Model {label} has no option {', '.join(map(repr, unknown))}; its options are "
                             + ", ".join(f"{k} (default {v})" for k, v in self.options.items()) + ".")

