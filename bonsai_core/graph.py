"""The operator graph of one training step, and its bonsai-graph JSON format (version 1).

A :class:`Graph` is immutable. Per-node data lives in numpy arrays (costs, sizes) and the edges in
CSR form, so a graph of ten thousand operators is cheap to hold, hash and hand to a solver. Every
property an algorithm needs is computed once: in the constructor, or on first read for the costlier ones
(the hash, the per-op lower bound); :meth:`Graph.with_fields` makes a graph with other fields and the same
nodes without deriving them again.

Example::

    >>> g = Graph.from_nodes("tiny", fixed_mem=0, nodes=[
    ...     dict(name="a", op="aten.relu.default", phase="forward", cost=1.0, mem=4, deps=[]),
    ...     dict(name="b", op="aten.relu.default", phase="forward", cost=1.0, mem=4, deps=[0])])
    >>> g.n, g.outputs.tolist()
    (2, [1])
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from bonsai_core.errors import GraphError
from bonsai_core.schema import schema

FORMAT = "bonsai-graph"
VERSION = 1
_FORMAT = schema("graph")  # the file format's fields (schemas/graph.schema.json): what a graph built here obeys too
PHASES = tuple(_FORMAT["$defs"]["node"]["properties"]["phase"]["enum"])
FIXED_KINDS = tuple(_FORMAT["properties"]["fixed_tensors"]["items"]["prefixItems"][2]["enum"])

# Refused before any heavy work: a graph beyond these is not a training step this tool can help with
# interactively (the op-level solvers have tighter limits of their own).
MAX_NODES = _FORMAT["properties"]["nodes"]["maxItems"]
MAX_EDGES = 2_000_000
# a pipeline rank's fixed tensor of FSDP's unsharded parameters, held until each stage's gradient reduction
UNSHARDED_TO_REDUCE = "fsdp.units_unsharded (pipeline: resharded by each stage's gradient reduction)"
MAX_FILE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class NodeInfo:
    """One node, as a plain record (for display and JSON); the Graph itself stores arrays."""

    id: int
    name: str
    op: str
    phase: str
    cost: float
    mem: int
    deps: tuple[int, ...]
    alias_of: int | None
    shape: str = ""
    inplace_of: int | None = None


class Graph:
    """A training step's operators in a valid execution order, with costs and output sizes.

    Attributes (all read-only):
        name: the graph's name (the model it was traced from).
        n: number of nodes; ids are ``0..n-1`` in a topological (plain execution) order.
        fixed_mem: bytes live for the whole step whatever the schedule (params, grads, batch, and the
            optimizer's state when the graph has an ``optimizer``).
        optimizer: None, or ``{"name", "step_bytes"}``: the optimizer step that follows the backward pass
            and the bytes it allocates above ``fixed_mem`` (``optimizer_peak``).
        fsdp: None, or ``{"world", "reshard_after_forward", "root_bytes", "units"[, "param_dtype",
            "reduce_dtype"]}``: the step as one FSDP
            rank holds it (:mod:`bonsai_core.fsdp`); ``units`` are [path, first, last, parameter bytes].
        grads_set_to_none: the bytes of the parameter gradients when they are set to None between steps
            (``optimizer.zero_grad()``'s default): not in ``fixed_mem``, made in the backward pass and held
            to the optimizer step (:func:`bonsai_core.optimizer.with_grads_set_to_none`); 0: kept
            allocated and zeroed between steps, in ``fixed_mem``.
        parallel: None, or ``{"layout": {degrees, ...}[, "pipeline": {...}]}``: the rank of a tensor, context
            or pipeline parallel run this graph is (:mod:`bonsai_core.parallel`, :mod:`bonsai_core.pipeline`).
        names, ops, phases, shapes: per-node strings.
        cost: float64[n], seconds to compute each node (0 only for views).
        mem: int64[n], bytes of each node's output(s) (0 for views).
        alias_of: int64[n], the node whose storage a view shares, or -1.
        inplace_of: int64[n], the input whose bytes eager overwrites with the node's output (``relu_``,
            ``x += y``; simulator rule 8), or -1.
        dep_ptr, dep_idx: CSR of each node's inputs (``deps(v)``), sorted.
        user_ptr, user_idx: CSR of each node's consumers (``users(v)``), sorted.
        is_output: bool[n], nodes with no consumers (the loss, parameter gradients).
        is_forward: bool[n], nodes of the forward pass (phase ``forward``).
        output_of: int64[n], for an output of a multi-output op that is a node of its own (op
            ``getitem`` with bytes of its own, reading only the op's node): that op's node; else -1.
            Its bytes come from the op's kernel only, so it is computed once per run of the op.
    """

    def __init__(
        self,
        name: str,
        fixed_mem: int,
        names: Sequence[str],
        ops: Sequence[str],
        phases: Sequence[str],
        cost: Iterable[float],
        mem: Iterable[int],
        deps: Sequence[Sequence[int]],
        alias_of: Iterable[int | None],
        shapes: Sequence[str] | None = None,
        fixed_tensors: Sequence[Sequence[Any]] = (),
        modules: Sequence[Sequence[Any]] = (),
        optimizer: dict[str, Any] | None = None,
        fsdp: dict[str, Any] | None = None,
        parallel: dict[str, Any] | None = None,
        inplace_of: Iterable[int | None] | None = None,
        held: Sequence[Sequence[int]] | None = None,
        grads_set_to_none: int = 0,
    ) -> None:
        n = len(names)
        if n == 0:
            raise GraphError("The graph has no nodes: trace a model or load a graph with at least one operator.")
        if n > MAX_NODES:
            raise GraphError(f"The graph has {n} nodes; this tool handles at most {MAX_NODES}. Trace a smaller model.")
        self.names = tuple(names)
        self.ops = tuple(ops)
        self.phases = tuple(phases)
        self.shapes = tuple(shapes) if shapes is not None else ("",) * n
        self._set_header(name, fixed_mem, fixed_tensors, modules, optimizer, fsdp, parallel, grads_set_to_none)
        try:
            self.cost = np.asarray(list(cost), dtype=np.float64)
            self.mem = np.asarray(list(mem), dtype=np.int64)
            self.alias_of = _node_ids(alias_of)
            self.inplace_of = _node_ids([None] * n if inplace_of is None else inplace_of)
            dep_lists = [sorted(set(int(d) for d in ds)) for ds in deps]
            held_lists = [()] * n if held is None else [tuple(sorted(set(int(d) for d in ds))) for ds in held]
        except (OverflowError, ValueError, TypeError) as e:
            raise GraphError(f"A node's cost, mem, deps or alias_of is not a number in range ({e}).") from None
        self.dep_ptr, self.dep_idx = _csr(dep_lists)
        for arr, what in ((self.ops, "ops"), (self.phases, "phases"), (self.cost, "cost"), (self.mem, "mem"),
                          (self.alias_of, "alias_of"), (self.inplace_of, "inplace_of"), (self.shapes, "shapes"),
                          (dep_lists, "deps"), (held_lists, "held")):
            if len(arr) != n:
                raise GraphError(f"The graph has {n} names but {len(arr)} {what}: every node needs each field.")
        # optional: per node, the deps that are no data read, only eager holding a tensor (the model's
        # Python code, autograd's engine: trace's _held_by_eager); they count as deps everywhere but in drawing the data flow (without_held)
        self.held = tuple(held_lists)
        self._without_held: Graph | None = None  # computed once, on first use
        self._validate()
        self._validate_held(dep_lists)
        self._derive()

    def _set_header(self, name: str, fixed_mem: int, fixed_tensors: Sequence[Sequence[Any]],
                    modules: Sequence[Sequence[Any]], optimizer: dict[str, Any] | None, fsdp: dict[str, Any] | None,
                    parallel: dict[str, Any] | None, grads_set_to_none: int) -> None:
        """The document's fields other than its nodes."""
        self.name = str(name)
        self.fixed_mem = int(fixed_mem)
        # optional: the tensors fixed_mem is made of, (name, bytes, kind) in allocation order
        self.fixed_tensors = tuple((str(t[0]), int(t[1]), str(t[2])) for t in fixed_tensors)
        # optional: the user's module calls, (path, first, last) forward node ids, inclusive
        self.modules = tuple((str(t[0]), int(t[1]), int(t[2])) for t in modules)
        # optional: the optimizer whose step follows the backward pass (bonsai_core.optimizer): its name and
        # the bytes its step allocates on top of fixed_mem (its state is in fixed_mem, kind "optimizer")
        self.optimizer = None if optimizer is None else {"name": str(optimizer["name"]),
                                                         "step_bytes": int(optimizer["step_bytes"])}
        # optional: the FSDP rank this graph is (bonsai_core.fsdp): sharded state and the root's parameters
        # are in fixed_mem; the blocks' unsharded bytes are the simulator's (fsdp.working_profile)
        self.fsdp = None if fsdp is None else dict(fsdp)
        # optional: the gradients' bytes when they are set to None between steps (out of fixed_mem)
        self.grads_set_to_none = int(grads_set_to_none)
        self.parallel = None if parallel is None else dict(parallel)  # optional: the rank's layout (and pipeline)

    def _derive(self) -> None:
        """What follows from the fields: consumers, outputs, phases, views, totals; all read-only (the hash and the
        per-op lower bound are computed on first read: a graph built on the way to another never needs them)."""
        n = len(self.names)
        self.user_ptr, self.user_idx = _transposed(self.dep_ptr, self.dep_idx)  # consumers, as CSR
        self.is_output = np.diff(self.user_ptr) == 0
        self._validate_inplace()
        self.is_forward = np.array([p == "forward" for p in self.phases], dtype=bool)
        self.is_view = self.alias_of >= 0
        self.output_of = np.array([int(self.dep_idx[self.dep_ptr[v]]) if self.ops[v] == "getitem" and self.mem[v] > 0
                                   and self.alias_of[v] < 0 and self.dep_ptr[v + 1] - self.dep_ptr[v] == 1 else -1
                                   for v in range(n)], dtype=np.int64)
        self.total_cost = math.fsum(self.cost.tolist())
        self.activation_bytes = int(self.mem[self.is_forward].sum())
        for arr in (self.cost, self.mem, self.alias_of, self.inplace_of, self.dep_ptr, self.dep_idx, self.user_ptr,
                    self.user_idx, self.is_output, self.is_forward, self.is_view, self.output_of):
            arr.setflags(write=False)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_nodes(cls, name: str, fixed_mem: int, nodes: Sequence[dict[str, Any]],
                   fixed_tensors: Sequence[Sequence[Any]] = (), modules: Sequence[Sequence[Any]] = (),
                   optimizer: dict[str, Any] | None = None, fsdp: dict[str, Any] | None = None,
                   parallel: dict[str, Any] | None = None, grads_set_to_none: int = 0) -> "Graph":
        """Build a graph from node dicts (``name, op, phase, cost, mem, deps`` and optional
        ``alias_of``, ``inplace_of``, ``shape``, ``held``), listed in execution order; ids are their positions."""
        return cls(
            fixed_tensors=fixed_tensors,
            modules=modules,
            optimizer=optimizer,
            fsdp=fsdp,
            grads_set_to_none=grads_set_to_none,
            parallel=parallel,
            name=name,
            fixed_mem=fixed_mem,
            names=[nd.get("name", f"n{i}") for i, nd in enumerate(nodes)],
            ops=[nd.get("op", "") for nd in nodes],
            phases=[nd.get("phase", "forward") for nd in nodes],
            cost=[nd["cost"] for nd in nodes],
            mem=[nd["mem"] for nd in nodes],
            deps=[nd.get("deps", []) for nd in nodes],
            alias_of=[nd.get("alias_of") for nd in nodes],
            inplace_of=[nd.get("inplace_of") for nd in nodes],
            held=[nd.get("held", ()) for nd in nodes],
            shapes=[str(nd.get("shape", "")) for nd in nodes],
        )

    def _validate(self) -> None:
        self._validate_header()
        n = self.n
        for v in range(n):
            where = f"Node {v} ({self.names[v]!r})"
            if self.phases[v] not in PHASES:
                raise GraphError(f"{where} has phase {self.phases[v]!r}; use one of {', '.join(PHASES)}.")
            c, m = self.cost[v], self.mem[v]
            if not math.isfinite(c) or c < 0:
                raise GraphError(f"{where} has cost {c}; a cost is a finite number of seconds >= 0.")
            if m < 0:
                raise GraphError(f"{where} has mem {m}; mem is a byte count >= 0.")
            deps = self.deps(v)
            if len(deps) and (deps[-1] >= v or deps[0] < 0):
                bad = deps[-1] if deps[-1] >= v else deps[0]
                raise GraphError(
                    f"{where} depends on node {bad}, which is not an earlier node: deps must name nodes "
                    "listed before it (the node order must be a valid execution order, with no cycles)."
                )
            a = int(self.alias_of[v])
            if a >= 0:
                if a not in deps:
                    raise GraphError(f"{where} is a view of node {a} (alias_of) but does not read it: "
                                     "a view's base must be one of its deps.")
                if m != 0:
                    raise GraphError(f"{where} is a view (alias_of={a}) but has mem {m}; a view shares its "
                                     "base's storage, so its mem must be 0.")
            elif c <= 0:
                raise GraphError(f"{where} has cost 0 but is not a view; every computed node costs time > 0.")

    def _validate_header(self) -> None:
        """The fields other than the nodes, against the nodes."""
        n = self.n
        if self.fixed_mem < 0:
            raise GraphError(f"fixed_mem is {self.fixed_mem}; it must be a byte count >= 0.")
        if self.optimizer is not None and self.optimizer["step_bytes"] < 0:
            raise GraphError(f"'optimizer' step_bytes is {self.optimizer['step_bytes']}; it must be >= 0.")
        if self.fixed_tensors:
            bad = [t for t in self.fixed_tensors if t[1] < 0 or t[2] not in FIXED_KINDS]
            if bad:
                raise GraphError(f"'fixed_tensors' entry {list(bad[0])} is not [name, bytes >= 0, kind] with kind "
                                 f"one of {', '.join(FIXED_KINDS)}.")
            if sum(t[1] for t in self.fixed_tensors) != self.fixed_mem:
                raise GraphError(f"'fixed_tensors' add up to {sum(t[1] for t in self.fixed_tensors)} bytes, not "
                                 f"fixed_mem ({self.fixed_mem}); fix one of them or drop 'fixed_tensors'.")
        for path, first, last in self.modules:
            if not (0 <= first <= last < n and self.phases[first] == self.phases[last] == "forward"):
                raise GraphError(f"'modules' entry [{path!r}, {first}, {last}] is not [path, first, last] with "
                                 "first <= last forward node ids; fix it or drop 'modules' (it is optional).")

    def _validate_held(self, dep_lists: list[list[int]]) -> None:
        for v, hs in enumerate(self.held):
            if hs and not set(hs) <= set(dep_lists[v]):
                raise GraphError(f"Node {v} ({self.names[v]!r}) lists 'held' ids {sorted(set(hs) - set(dep_lists[v]))} "
                                 "that are not in its 'deps': a held tensor is a dep too. Drop 'held' (it is optional).")

    def _validate_inplace(self) -> None:
        """An in-place write (``inplace_of`` u of node v) reads u, has u's bytes, and is u's last reader in
        the listed order: eager overwrote u, so nothing after v could have read it."""
        for v in np.flatnonzero(self.inplace_of >= 0).tolist():
            u = int(self.inplace_of[v])
            where = f"Node {v} ({self.names[v]!r}) has inplace_of {u}"
            if u not in self.deps(v):
                raise GraphError(f"{where} but does not read it: an in-place op writes one of its inputs.")
            if self.alias_of[v] >= 0 or self.alias_of[u] >= 0 or self.mem[u] != self.mem[v] or self.mem[v] <= 0:
                raise GraphError(f"{where}, but an in-place write takes its input's bytes: both must hold the same "
                                 f"bytes (> 0) and neither may be a view ({self.mem[u]} and {self.mem[v]} bytes).")
            last = int(self.users(u)[-1])
            if last != v:
                raise GraphError(f"{where}, but node {last} reads {u} after it: eager could not have "
                                 "overwritten it. Drop 'inplace_of' (it is optional).")

    @cached_property
    def hash(self) -> str:
        """The first 16 hex digits of the sha256 of the graph's document (:meth:`to_dict`, keys sorted)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @cached_property
    def peak_lower_bound(self) -> int:
        """The memory of the largest single compute step: fixed_mem + a node's output + its inputs
        (and the bases of views among them). No schedule can peak below this (Checkmate's
        ``max_degree_ram``)."""
        return max(self.fixed_mem + self._largest_step(), self.optimizer_peak)

    def _largest_step(self) -> int:
        """The most bytes one op holds: over nodes v, the bytes of the storages of v and its deps (each once; a
        view's bytes are its base's, views hold none) less what v writes in place (rule 8: it takes those bytes)."""
        n = self.n
        if n == 0:
            return 0
        storage = self.storages
        readers = np.concatenate([np.arange(n, dtype=np.int64), np.repeat(np.arange(n, dtype=np.int64),
                                                                            np.diff(self.dep_ptr))])
        read = np.concatenate([storage, storage[self.dep_idx]])
        pairs = np.unique(readers * n + read)  # each (node, storage) once
        held = np.zeros(n, dtype=np.int64)
        np.add.at(held, pairs // n, self.mem[pairs % n])
        written = np.where(self.inplace_of >= 0, self.mem[np.maximum(self.inplace_of, 0)], 0)
        return max(0, int((held - written).max()))

    @cached_property
    def storages(self) -> np.ndarray:
        """int64[n]: each node's :meth:`storage_of`, every chain of views followed at once."""
        storage = np.arange(self.n, dtype=np.int64)
        views = self.alias_of >= 0
        while True:
            up = np.where(views[storage], self.alias_of[storage], storage)
            if np.array_equal(up, storage):
                storage.setflags(write=False)  # shared by the graphs with_fields makes
                return storage
            storage = up

    def with_view_bases(self, nodes: set[int]) -> set[int]:
        """``nodes`` and the bases of every view among them, transitively: what must be resident
        while they are (a resident view keeps its base resident)."""
        return {u for v in nodes for u in self.view_chain(v)}

    def view_chain(self, v: int) -> list[int]:
        """``v``, the node it views, the node that one views, ... up to the node whose bytes they all share
        (:meth:`storage_of`): what a resident ``v`` keeps resident. O(length of the chain)."""
        chain = [int(v)]
        while self.alias_of[chain[-1]] >= 0:
            chain.append(int(self.alias_of[chain[-1]]))
        return chain

    def without_held(self) -> "Graph":
        """This graph with only its data deps: what the model's code holds (``held``) dropped. Its data flow,
        for drawing; memory is the whole graph's."""
        if not any(self.held):
            return self
        if self._without_held is None:
            data = self.to_dict()
            for nd in data["nodes"]:
                held = set(nd.pop("held", ()))
                nd["deps"] = [d for d in nd["deps"] if d not in held]
            self._without_held = Graph.rebuilt(data)
        return self._without_held

    def storage_of(self, v: int, stop_before: np.ndarray | None = None) -> int:
        """The node whose bytes ``v`` shares: ``v`` itself, or the base at the end of its chain of
        views (a view of a view ...). With ``stop_before`` (bool[n]), the walk ends at the last node
        before a base marked there. O(length of the chain)."""
        chain = self.view_chain(v)
        if stop_before is None:
            return chain[-1]
        return next((u for u, base in zip(chain, chain[1:]) if stop_before[base]), chain[-1])

    @property
    def optimizer_peak(self) -> int:
        """Memory during the optimizer step after the backward pass (0 without an optimizer): the fixed
        memory (its state included) plus what the step allocates, and the gradients where they are set to
        None between steps; on a pipeline rank under FSDP without its units' unsharded parameters, which each
        stage's gradient reduction has resharded (rule 11). No schedule changes it."""
        if self.optimizer is None:
            return 0
        resharded = sum(t[1] for t in self.fixed_tensors if t[0] == UNSHARDED_TO_REDUCE)
        return self.fixed_mem - resharded + self.optimizer["step_bytes"] + self.grads_set_to_none

    # -- queries -------------------------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def num_edges(self) -> int:
        return int(self.dep_ptr[-1])

    @property
    def outputs(self) -> np.ndarray:
        """Ids of the step's outputs: the nodes nobody consumes (loss, parameter gradients)."""
        return np.flatnonzero(self.is_output)

    def deps(self, v: int) -> np.ndarray:
        """Sorted ids of the nodes whose outputs node ``v`` reads."""
        return self.dep_idx[self.dep_ptr[v]:self.dep_ptr[v + 1]]

    @cached_property
    def read_by_backward(self) -> np.ndarray:
        """bool[n]: the nodes some backward node reads (what the step keeps, or rebuilds, for the backward pass)."""
        reader = np.repeat(np.arange(self.n), np.diff(self.dep_ptr))  # the reader of each edge
        read = np.zeros(self.n, dtype=bool)
        read[self.dep_idx[~self.is_forward[reader]]] = True
        read.setflags(write=False)
        return read

    @cached_property
    def dep_lists(self) -> tuple[tuple[int, ...], ...]:
        """Every node's ``deps`` as a tuple of ints: what a Python loop over the nodes indexes (a numpy slice
        per node costs it more than the loop's own work)."""
        idx, ptr = tuple(self.dep_idx.tolist()), self.dep_ptr.tolist()
        return tuple(idx[ptr[v]:ptr[v + 1]] for v in range(self.n))

    def users(self, v: int) -> np.ndarray:
        """Sorted ids of the nodes that read node ``v``'s output."""
        return self.user_idx[self.user_ptr[v]:self.user_ptr[v + 1]]

    def node(self, v: int) -> NodeInfo:
        a = int(self.alias_of[v])
        w = int(self.inplace_of[v])
        return NodeInfo(v, self.names[v], self.ops[v], self.phases[v], float(self.cost[v]), int(self.mem[v]),
                        tuple(self.deps(v).tolist()), None if a < 0 else a, self.shapes[v], None if w < 0 else w)

    def summary(self) -> dict[str, Any]:
        """Counts and sizes a person wants first (the explorer's model page, ``bonsai trace``)."""
        return {
            "name": self.name,
            "nodes": self.n,
            "edges": self.num_edges,
            "forward_nodes": int(self.is_forward.sum()),
            "backward_nodes": int((~self.is_forward).sum()),
            "views": int(self.is_view.sum()),
            "inplace_writes": int((self.inplace_of >= 0).sum()),
            "fixed_mem": self.fixed_mem,
            "activation_bytes": self.activation_bytes,
            "peak_lower_bound": self.peak_lower_bound,
            "total_cost": self.total_cost,
        }

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, n={self.n}, edges={self.num_edges}, fixed_mem={self.fixed_mem})"

    # -- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for v in range(self.n):
            a = int(self.alias_of[v])
            nd = {"id": v, "name": self.names[v], "op": self.ops[v], "phase": self.phases[v],
                  "cost": float(self.cost[v]), "mem": int(self.mem[v]), "deps": self.deps(v).tolist(),
                  "alias_of": None if a < 0 else a}
            if self.shapes[v]:
                nd["shape"] = self.shapes[v]
            if self.inplace_of[v] >= 0:  # only when set: graphs without in-place writes keep their hash
                nd["inplace_of"] = int(self.inplace_of[v])
            if self.held[v]:
                nd["held"] = list(self.held[v])
            nodes.append(nd)
        out = {"format": FORMAT, "version": VERSION, "name": self.name, "fixed_mem": self.fixed_mem, "nodes": nodes}
        out.update(self._optional_fields())
        return out

    def _optional_fields(self) -> dict[str, Any]:
        """The document's optional fields other than the nodes', those this graph has."""
        out: dict[str, Any] = {}
        if self.fixed_tensors:
            out["fixed_tensors"] = [list(t) for t in self.fixed_tensors]
        if self.modules:
            out["modules"] = [list(t) for t in self.modules]
        if self.optimizer is not None:
            out["optimizer"] = dict(self.optimizer)
        if self.fsdp is not None:
            out["fsdp"] = dict(self.fsdp)
        if self.grads_set_to_none:
            out["grads"] = {"set_to_none": True, "bytes": self.grads_set_to_none}
        if self.parallel is not None:
            out["parallel"] = dict(self.parallel)
        return out

    def with_fields(self, **fields: Any) -> "Graph":
        """This graph with fields of its document other than ``nodes`` replaced (``name``, ``fixed_mem``,
        ``fixed_tensors``, ``modules``, ``optimizer``, ``fsdp``, ``grads``, ``parallel``; None drops an optional
        one): the graph :meth:`rebuilt` makes of its edited :meth:`to_dict`, without converting and checking the
        nodes again (the new graph shares this one's node arrays, read-only). The fields are checked as there."""
        unknown = set(fields) - set(HEADER_FIELDS)
        if unknown:
            raise ValueError(f"with_fields replaces {', '.join(HEADER_FIELDS)}, not {', '.join(sorted(unknown))}")
        data: dict[str, Any] = {"name": self.name, "fixed_mem": self.fixed_mem, **self._optional_fields()}
        for key, value in fields.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        new = copy.copy(self)
        for derived in ("hash", "peak_lower_bound"):  # cached properties that read the fields
            new.__dict__.pop(derived, None)
        new._without_held = None
        new._set_header(**_header_of(data, self.n))
        new._validate_header()
        return new

    @classmethod
    def from_dict(cls, data: Any) -> "Graph":
        """Parse a bonsai-graph document (already JSON-decoded), naming the field of any defect: each field's
        type and range against the format's JSON Schema (:mod:`bonsai_core.schema`), then what it cannot
        say (ids in listed order, references to earlier nodes: here and in the constructor)."""
        from bonsai_core.schema import check

        check_header(data, GraphError, FORMAT, VERSION, fields="'format', 'version', 'name', 'fixed_mem' and 'nodes'",
                     other="a schedule file? pass it as the schedule instead",
                     too_new=" Re-trace the model with this version of bonsai.")
        check(data, "graph", GraphError)
        return cls.rebuilt(data)

    @classmethod
    def rebuilt(cls, data: dict[str, Any]) -> "Graph":
        """The graph of a document whose fields are of their types (one :meth:`from_dict` checked, or
        :meth:`to_dict` of a graph, edited): the references between nodes are checked, not the fields."""
        nodes = data["nodes"]
        parsed = []
        for i, nd in enumerate(nodes):
            if nd["id"] != i:
                raise GraphError(f"Node at position {i} has id {nd['id']!r}; ids must be 0, 1, 2, ... in listed order "
                                 "(no duplicates, no gaps).")
            alias, inplace = nd.get("alias_of"), nd.get("inplace_of")
            for name, ref in (("alias_of", alias), ("inplace_of", inplace)):
                if ref is not None and not ref < i:
                    raise GraphError(f"Node {i} has {name} {ref}, which is not an earlier node.")
            parsed.append({"name": nd["name"], "op": nd.get("op", ""), "phase": nd["phase"], "cost": float(nd["cost"]),
                           "mem": int(nd["mem"]), "deps": [int(d) for d in nd["deps"]],
                           "alias_of": None if alias is None else int(alias),
                           "inplace_of": None if inplace is None else int(inplace), "shape": str(nd.get("shape", "")),
                           "held": [int(d) for d in nd.get("held", [])]})
        return cls.from_nodes(nodes=parsed, **_header_of(data, len(parsed)))


HEADER_FIELDS = ("name", "fixed_mem", "fixed_tensors", "modules", "optimizer", "fsdp", "grads", "parallel")


def _header_of(data: dict[str, Any], n: int) -> dict[str, Any]:
    """The fields of a document other than its nodes (of their types), as the constructor takes them, for a graph
    of ``n`` nodes."""
    optimizer = data.get("optimizer")
    if optimizer is not None:
        optimizer = {"name": optimizer["name"], "step_bytes": int(optimizer["step_bytes"])}
    fsdp = data.get("fsdp")
    if fsdp is not None:
        fsdp = _fsdp_field(fsdp, n)
    grads = data.get("grads")
    parallel = data.get("parallel")
    if parallel is not None:
        parallel = _parallel_field(parallel, n)
    return {"name": data.get("name", "graph"), "fixed_mem": int(data["fixed_mem"]),
            "fixed_tensors": [(t[0], int(t[1]), t[2]) for t in data.get("fixed_tensors", [])],
            "modules": [(t[0], int(t[1]), int(t[2])) for t in data.get("modules", [])], "optimizer": optimizer,
            "fsdp": fsdp, "parallel": parallel,
            "grads_set_to_none": int(grads["bytes"]) if grads and grads["set_to_none"] else 0}


def _csr(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The CSR (ptr, idx) of ``rows`` (a node's deps each), refused beyond ``MAX_EDGES`` entries."""
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(r) for r in rows])
    if ptr[-1] > MAX_EDGES:
        raise GraphError(f"The graph has {int(ptr[-1])} edges; this tool handles at most {MAX_EDGES}.")
    return ptr, np.fromiter((d for r in rows for d in r), dtype=np.int64, count=int(ptr[-1]))


def _transposed(ptr: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CSR (ptr, idx) of the transpose of the CSR (``ptr``, ``idx``) of n rows over n columns."""
    n = len(ptr) - 1
    order = np.argsort(idx, kind="stable")
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr))
    t_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(idx, minlength=n), out=t_ptr[1:])
    return t_ptr, rows[order]


def _node_ids(ids: Iterable[int | None]) -> np.ndarray:
    """int64 node ids, -1 for None (a field that names no node)."""
    return np.asarray([-1 if a is None else a for a in ids], dtype=np.int64)


def block_stack(graph: Graph) -> list[tuple[str, int, int]]:
    """The model's repeated blocks from the graph's ``modules`` field: the calls named
    ``<parent>.<index>`` under the parent with the most of them (a transformer's layers, a ResNet's
    blocks), as (path, first, last) forward node ids, in order; [] when the graph records no modules."""
    children: dict[str, list[tuple[str, int, int]]] = {}
    for path, first, last in graph.modules:
        parent, _, index = path.rpartition(".")
        if index.isdigit():
            children.setdefault(parent, []).append((path, first, last))
    return max(children.values(), key=len, default=[])


def _parallel_field(parallel: dict[str, Any], n: int) -> dict[str, Any]:
    """The optional ``parallel`` object (bonsai_core.parallel, bonsai_core.pipeline): a pipeline rank's stages
    covering the graph's nodes in order, its actions naming its stages."""
    out = {"layout": dict(parallel["layout"])}
    pipeline = parallel.get("pipeline")
    if pipeline is not None:
        spans = [(int(first), int(last)) for _, first, last in pipeline["stages"]]
        if spans[0][0] != 0 or spans[-1][1] != n - 1 or any(a > b for a, b in spans) \
                or any(spans[k][1] + 1 != spans[k + 1][0] for k in range(len(spans) - 1)):
            raise GraphError(f"'parallel' pipeline stages {spans} do not cover the graph's {n} nodes in order; trace "
                             "the pipeline rank again.")
        if any(int(stage) >= len(spans) for _, stage, _ in pipeline["actions"]):
            raise GraphError(f"A 'parallel' pipeline action names a stage beyond the rank's {len(spans)}.")
        out["pipeline"] = dict(pipeline)
    return out


def _fsdp_field(fsdp: dict[str, Any], n: int) -> dict[str, Any]:
    """The optional ``fsdp`` object (bonsai_core.fsdp.with_fsdp), its units and last node within the graph."""
    units = [[u[0], int(u[1]), int(u[2]), int(u[3])] for u in fsdp["units"]]
    bad = next((u for u in units if not u[1] <= u[2] < n), None)
    if bad is not None:
        raise GraphError(f"'fsdp' unit {bad} does not span forward node ids first <= last < {n}; trace the model again.")
    model_last = int(fsdp.get("model_last", n - 1))
    if not model_last < n:
        raise GraphError(f"'fsdp' model_last {model_last} is not a node id (the graph has {n} nodes).")
    reshard = fsdp["reshard_after_forward"]
    if isinstance(reshard, list) and len(reshard) != len(units):
        raise GraphError(f"'fsdp' reshard_after_forward has {len(reshard)} flags for {len(units)} units: give one "
                         "bool, or one per unit.")
    out = {"world": int(fsdp["world"]), "reshard_after_forward": list(reshard) if isinstance(reshard, list) else reshard,
           "root_bytes": int(fsdp["root_bytes"]), "model_last": model_last, "units": units}
    out.update({k: fsdp[k] for k in ("param_dtype", "reduce_dtype") if fsdp.get(k) is not None})
    return out


def parse_json_bytes(raw: bytes, what: str) -> Any:
    """Decode a JSON document, turning every way it can be broken into one clear GraphError."""
    if len(raw) > MAX_FILE_BYTES:
        raise GraphError(f"The {what} is {len(raw) / 2**20:.0f} MiB; files over {MAX_FILE_BYTES // 2**20} MiB "
                         "are refused.")
    if not raw.strip():
        raise GraphError(f"The {what} is empty.")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise GraphError(f"The {what} is not text (it is not UTF-8): expected a JSON file.") from None
    except (json.JSONDecodeError, RecursionError) as e:
        msg = getattr(e, "msg", "nesting too deep")
        where = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise GraphError(f"The {what} is not valid JSON{where}: {msg}.") from None


def check_header(data: Any, error: type[Exception], fmt: str, version: int, fields: str, other: str,
                 too_new: str = "") -> None:
    """Raise ``error`` unless ``data`` is a JSON object of format ``fmt`` and version ``version`` (the
    bonsai-graph and bonsai-schedule files); ``other`` says what a file of another format may be."""
    if not isinstance(data, dict):
        raise error(f"A {fmt} file holds one JSON object with {fields}; this one holds a {type(data).__name__}.")
    if data.get("format") != fmt:
        raise error(f"'format' is {data.get('format')!r}, not {fmt!r}: this is not a {fmt} file ({other}).")
    if data.get("version") != version:
        raise error(f"'version' is {data.get('version')!r}; this tool reads {fmt} version {version}.{too_new}")


def read_json_file(path: str | os.PathLike, what: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise GraphError(f"No such {what}: {str(p)!r}.")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise GraphError(f"{str(p)!r} is {p.stat().st_size / 2**20:.0f} MiB; files over "
                         f"{MAX_FILE_BYTES // 2**20} MiB are refused.")
    return parse_json_bytes(p.read_bytes(), f"{what} {str(p)!r}")


def load_graph(path: str | os.PathLike) -> Graph:
    """Read and validate a bonsai-graph JSON file."""
    return Graph.from_dict(read_json_file(path, "graph file"))


def save_graph(graph: Graph, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(graph.to_dict(), separators=(",", ":")) + "\n")
