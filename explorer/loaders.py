"""Turn what a user hands the explorer into a :class:`Graph`, without ever running their code.

* a bonsai-graph JSON upload is parsed as data (``json.loads`` + ``Graph.from_dict``);
* a ``.pt2`` file from ``torch.export.save`` is loaded by :func:`bonsai_core.models.pt2.load` only
  after the archive has been checked to hold nothing that loading would execute
  (:func:`bonsai_core.models.pt2.check_pt2`), and its training step is traced with
  :func:`bonsai_core.trace.trace_step` under the documented loss
  :class:`bonsai_core.models.pt2.SumOfSquares`.

No Streamlit here: the app wraps these in its caches, the tests call them directly.
"""

from __future__ import annotations

import json

from bonsai_core.errors import GraphError
from bonsai_core.graph import MAX_FILE_BYTES, Graph


def graph_from_json_bytes(data: bytes, filename: str = "upload.json") -> Graph:
    """Parse an uploaded bonsai-graph document. Raises GraphError saying what is wrong."""
    if not data.strip():
        raise GraphError(f"{filename} is empty. Upload a bonsai-graph file written by `bonsai trace ... -o graph.json`.")
    if len(data) > MAX_FILE_BYTES:
        raise GraphError(f"{filename} is {len(data) / 2**20:.0f} MiB; graph files are limited to "
                         f"{MAX_FILE_BYTES // 2**20} MiB. Trace a smaller model.")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphError(f"{filename} is not valid JSON ({e}). Upload a bonsai-graph file written by "
                         "`bonsai trace ... -o graph.json`.") from None
    return Graph.from_dict(doc)


def graph_from_pt2_bytes(data: bytes, name: str = "uploaded") -> Graph:
    """Load an exported program (:func:`bonsai_core.models.pt2.load`) and trace one training step of
    it with :class:`~bonsai_core.models.pt2.SumOfSquares` as the loss. Raises ModelError with what to do."""
    from bonsai_core.models import pt2
    from bonsai_core.trace import trace_step

    if not data:
        raise GraphError(f"{name} is empty. Upload a program saved with torch.export.save.")
    module, args, loss_fn = pt2.load(data)
    return trace_step(module, args, loss_fn, name=name).graph
