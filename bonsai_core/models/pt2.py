"""Exported programs (``torch.export.save``'s ``.pt2``) as a model source, loaded as data.

``load(data) -> (module, example_inputs, loss_fn)``: the program's module, the example inputs saved
with it and :class:`SumOfSquares` as the loss, the triple every model source gives
(:func:`bonsai_core.models.build`). ``torch.export.load`` runs only after the archive has been checked
to hold nothing that loading would execute (:func:`check_pt2`), and the sample inputs are read with
``weights_only`` forced on: the explorer loads uploads with it, and never runs code from one.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
import zipfile
from typing import Any

from bonsai_core.errors import ModelError
from bonsai_core.models.entry import Built

MAX_PT2_BYTES = 200 * 2**20  # what the upload widget accepts, and what we load
MAX_PT2_UNPACKED = 1024 * 2**20  # a zip bomb is refused before anything is inflated
LOSS_DESCRIPTION = "sum of squares of every floating-point output (loss = Σ out²)"
_ENV_LOCK = threading.Lock()


def check_pt2(data: bytes) -> None:
    """Refuse a ``.pt2`` archive that ``torch.export.load`` could not load as pure data.

    ``torch.export.load`` unpickles with ``weights_only=False`` for tensors stored as pickles,
    ``pickle.loads`` for opaque constants, loads TorchBind objects and AOTInductor shared
    libraries, falls back to an older format on errors, resolves call targets by attribute path
    from ``torch``, parses shape expressions with ``sympify``, and ``.module()`` compiles guard code.
    We accept only archives in the current format whose weights and constants are raw tensor
    payloads and whose program has static shapes, no guard code and only aten/prims call targets
    (see :func:`_check_program`); the sample inputs are then read with ``weights_only`` forced on.
    O(archive size)."""
    from torch.export.pt2_archive import constants as c

    if len(data) > MAX_PT2_BYTES:
        raise ModelError(f"The .pt2 file is {len(data) / 2**20:.0f} MiB; the explorer loads at most "
                         f"{MAX_PT2_BYTES // 2**20} MiB. Trace it with `bonsai trace` instead.")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError):
        raise ModelError("This is not a .pt2 archive (not a zip file). Save the model with "
                         "`torch.export.save(torch.export.export(model, example_inputs), 'model.pt2')`.") from None
    if sum(i.file_size for i in infos) > MAX_PT2_UNPACKED:
        raise ModelError(f"The .pt2 archive unpacks to more than {MAX_PT2_UNPACKED // 2**20} MiB; refused.")
    # Member names sit under one root folder ("archive/..." by default): compare what follows it.
    names = {i.filename.split("/", 1)[1] if "/" in i.filename else i.filename: i.filename for i in infos}
    refuse = "The .pt2 file cannot be loaded safely: it {}. The explorer never runs code from an upload; " \
             "export a plain model (no custom objects, no AOTInductor) with torch {} and save it again."
    import torch
    if not any(n.startswith(c.MODELS_DIR) and n.endswith(".json") for n in names):
        raise ModelError(refuse.format("is in an old format (or holds no exported program)", torch.__version__))
    for n in names:
        if n.startswith(c.MODELS_DIR) and n.endswith(".json"):
            try:
                program = json.loads(archive.read(names[n]))
            except ValueError:
                raise ModelError(refuse.format(f"has an unreadable program ({n})", torch.__version__)) from None
            _check_program(program, refuse, torch.__version__)
        if n.startswith((c.AOTINDUCTOR_DIR, c.EXECUTORCH_DIR, c.MTIA_DIR, c.XL_MODEL_WEIGHTS_DIR)):
            raise ModelError(refuse.format(f"holds compiled artifacts ({n})", torch.__version__))
        if n.startswith((c.WEIGHTS_DIR, c.CONSTANTS_DIR)) and n.endswith(".pt"):
            raise ModelError(refuse.format(f"stores weights in the legacy pickled format ({n})", torch.__version__))
        if n.startswith((c.WEIGHTS_DIR, c.CONSTANTS_DIR)) and n.endswith("_config.json"):
            try:
                config = json.loads(archive.read(names[n]))["config"]
            except (KeyError, ValueError, TypeError):
                raise ModelError(refuse.format(f"has an unreadable payload config ({n})", torch.__version__)) from None
            for fqn, meta in config.items():
                if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
                    raise ModelError(refuse.format(f"stores {fqn!r} as a pickle", torch.__version__))
                path = str(meta.get("path_name", ""))
                if path.startswith((c.CUSTOM_OBJ_FILENAME_PREFIX, c.OPAQUE_OBJ_FILENAME_PREFIX)):
                    raise ModelError(refuse.format(f"holds a custom object {fqn!r}", torch.__version__))


# What an uploaded program may call: aten/prims kernels and tuple indexing. Deserialisation resolves
# any "torch.<path>" target by attribute lookup (torch.os.system is one), so anything else is refused.
_SAFE_TARGET = re.compile(r"^(torch\.ops\.(aten|prims)\.\w+(\.\w+)?|_operator\.getitem)$")


def _check_program(program: Any, refuse: str, version: str) -> None:
    """Refuse a serialised ExportedProgram whose loading or unlifting would evaluate strings:
    guard code (compiled into a guard function by ``.module()``), symbolic shape expressions (parsed
    with sympy's eval-based ``sympify``), custom objects, or call targets outside aten/prims."""
    if not isinstance(program, dict):
        raise ModelError(refuse.format("holds no exported program object", version))
    if program.get("guards_code"):
        raise ModelError(refuse.format("carries guard code, which loading would compile and run", version))
    if program.get("range_constraints"):
        raise ModelError(refuse.format("has dynamic shapes (export with static shapes)", version))
    stack = [program]
    while stack:  # O(size of the document)
        x = stack.pop()
        if isinstance(x, dict):
            for key, value in x.items():
                if key == "expr_str":
                    raise ModelError(refuse.format("has symbolic shape expressions (export with static shapes)",
                                                   version))
                if key == "custom_obj_values" and value:
                    raise ModelError(refuse.format("holds custom objects", version))
                if key == "target" and isinstance(value, str) and not _SAFE_TARGET.match(value):
                    raise ModelError(refuse.format(f"calls {value[:80]!r}, which is not an aten or prims operator",
                                                   version))
                stack.append(value)
        elif isinstance(x, list):
            stack.extend(x)


class SumOfSquares:
    """The loss used for an uploaded ``.pt2`` model: the sum of squares of its floating outputs.

    A plain callable (not a module): it holds no tensors, so tracing has nothing to lift."""

    def __call__(self, out: Any) -> Any:
        from torch.utils._pytree import tree_flatten

        tensors = [t for t in tree_flatten(out)[0] if hasattr(t, "is_floating_point") and t.is_floating_point()]
        if not tensors:
            raise ModelError("The exported model has no floating-point output to put a loss on.")
        total = (tensors[0].float() ** 2).sum()
        for t in tensors[1:]:
            total = total + (t.float() ** 2).sum()
        return total


def load(data: bytes) -> Built:
    """The exported program in ``data`` (after :func:`check_pt2`) as (module, example inputs,
    :class:`SumOfSquares`). Raises ModelError with what to do."""
    check_pt2(data)
    import torch

    try:
        with _ENV_LOCK:  # torch reads this at every torch.load: no pickle runs beyond tensors
            old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
            try:
                program = torch.export.load(io.BytesIO(data))
            finally:
                if old is None:
                    os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
                else:
                    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old
    except Exception as e:  # torch raises many types on a bad archive; the user needs the message
        raise ModelError(f"torch.export.load could not read this .pt2 file ({type(e).__name__}: {e}). Save it "
                         f"again with torch.export.save from torch {torch.__version__}.") from None
    example = program.example_inputs
    if not example or not example[0]:
        raise ModelError("The .pt2 file holds no example inputs to trace a step with. Export with "
                         "torch.export.export(model, example_inputs) and save that program.")
    args, kwargs = example
    if kwargs:
        raise ModelError("The exported model takes keyword inputs; export it with positional inputs only.")
    try:
        module = program.module()
    except Exception as e:  # an unflattenable program: say so instead of a stack trace
        raise ModelError(f"The exported program cannot be turned back into a module ({type(e).__name__}: {e}).") from None
    return module, tuple(args), SumOfSquares()
