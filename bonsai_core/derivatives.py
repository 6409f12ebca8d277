"""What an aten op's autograd formula saves, read from torch's own ``derivatives.yaml`` (shipped with
torch as ``torchgen/packaged/autograd/derivatives.yaml``).

A saved tensor is held by the autograd node of the op whose backward formula names it. Most ops save
their inputs, which their readers hold; some save their *own outputs* (``sigmoid``: ``result``; a
fused kernel such as ``mkldnn_rnn_layer``: ``result0``..``result3``, its workspace; SDPA's kernels:
``output``, ``log_sumexp``). Inside a checkpoint, such an output is saved by an op of the checkpointed
region even when no other op of the region reads it, so a selective-checkpointing policy must name
that op to keep it (:func:`saves_own_output`).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_NOT_BACKWARD_KEYS = {"name", "output_differentiability", "dispatch", "autogen"}


@functools.cache
def _formulas() -> dict[str, tuple[dict[str, int], list[str]]]:
    """schema name (``add.Tensor``, ``sigmoid``) -> (each name formulas give one of its outputs ->
    that output's index, its backward formulas)."""
    import torchgen
    import yaml

    path = Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml"
    out: dict[str, tuple[dict[str, int], list[str]]] = {}
    for entry in yaml.safe_load(path.read_text()) or []:
        schema = entry.get("name", "")
        name, _, rest = schema.partition("(")
        returns = rest.rpartition("->")[2]
        count = max(1, returns.count("Tensor"))
        outputs = {"result": 0, **{f"result{i}": i for i in range(count)}}
        named = re.findall(r"Tensor(?:\([^)]*\))?\??\s+(\w+)", returns)
        outputs.update((n, i) for i, n in enumerate(named))
        backward = [str(formula) for key, formula in entry.items()
                    if key not in _NOT_BACKWARD_KEYS and not key.startswith("result") and key not in named]
        out[name.strip()] = (outputs, backward)
    return out


def saved_outputs(op: str) -> frozenset[int]:
    """The indices of the outputs of aten op ``op`` (as the graph names it: ``aten.sigmoid.default``,
    ``aten.add.Tensor``) that its backward formula saves; empty for an op the file does not list."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return frozenset()
    name = parts[1] if parts[2] == "default" else f"{parts[1]}.{parts[2]}"
    outputs, backward = _formulas().get(name, ({}, []))
    return frozenset(i for o, i in outputs.items() if any(re.search(rf"\b{re.escape(o)}\b", f) for f in backward))


def saves_own_output(op: str) -> bool:
    """Whether the backward formula of aten op ``op`` saves its first output (the one its graph node
    always holds; later small outputs may be nodes of their own)."""
    return 0 in saved_outputs(op)
