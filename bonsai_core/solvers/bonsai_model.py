"""Bonsai's segment ILP for one segmentation, built once in CVXPY and re-solved per budget.

**Variables.** ``rec[s]`` (binary) for each candidate whose recomputation lowers the modelled memory
somewhere (:func:`bonsai_core.solvers.bonsai_coef.lowers_memory`) and that no candidate inside it
dominates (:func:`~bonsai_core.solvers.bonsai_coef.dominated`): the others are never needed by an
optimum of the model, see there. ``keep[a]`` (binary) for each atom, and one continuous ``delta[k]``
per interval of the memory axis on which recomputed segments change the memory. A kept segment of
several atoms has exactly the schedule of its atoms kept one by one, so kept segments need no
variables of their own; the plan merges consecutive kept atoms into kept stretches.

**Cover.** Every forward op lies in exactly one recomputed candidate or kept atom. Candidates are runs
of whole atoms, so a cover is a path from the first atom boundary to the last whose arcs are the
``rec`` candidates and the ``keep`` atoms: flow conservation at every inner boundary (a network
matrix, 2 non-zeros per variable).

**Memory.** ``delta = cumsum(G @ rec)`` over the event points (``G``: the step heights of
:func:`~bonsai_core.solvers.bonsai_coef.memory_steps`), and ``delta[k] + max(P over interval k) <=
budget``: one row per interval, which covers every point where a peak can occur.

**Microbatches in flight** (a pipeline rank, simulator rule 11): the rank holds, for each other microbatch in
flight, what each stage holds at the end of its forward, so a plan that holds X bytes less there holds
``copies * X`` less wherever ``copies`` of that stage are in flight
(:func:`bonsai_core.in_flight.copies`). One continuous ``held[j]`` per stage, the change at its forward's end
(``H @ rec``: each candidate's ``cumsum D`` at the end of its stage's forward), and each memory row adds
``copies[k] @ held``; the intervals are cut where the copies change, so they are constant on each.

**Outputs dropped** (``drop_outputs``): each candidate whose outputs later forward ops read gets a
second ``rec`` column with its own coefficients (``coefficients(..., drop_outputs=True)``), and one row
per atom holding such a reader: ``rec[s] <= keep[a]`` (a recomputed reader's rebuild would have
nothing to read).

**Saved self-contained nodes** (``save_self_contained``): a recomputed candidate keeps its self-contained nodes
(``bonsai_coef.self_contained``: an attention mask, a weight's bf16 copy) instead of rebuilding them;
its coefficients say so, and :meth:`BuiltModel.plan` lists them in ``CheckpointPlan.saved``.

**Ops saved inside recomputed segments** (``levels``: :func:`bonsai_coef.density_levels`): each
candidate also gets one column per density level L, "recomputed, saving the outputs of L's ops
inside it" (selective activation checkpointing's MUST_SAVE: the matmuls and attention kernels first),
with its own coefficients (``coefficients(..., pinned=L)``); :meth:`BuiltModel.plan` lists those ops in
``CheckpointPlan.saved``. The columns grow by a factor of 1 + len(levels) (times 2 with
``drop_outputs``), before pruning, which applies within each kind of column.

**Offload** (``offload``): one binary ``off[v]`` per saved tensor that may go to host memory, with its
own steps in the memory rows and its rows (``bonsai_offload.py``): keep, recompute or offload.

**Objective**: the recomputation time, ``sum cost[s] * rec[s]`` with ``cost[s]`` the cost of the nodes
actually rebuilt, divided by the graph's total cost: the predicted overhead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan
from bonsai_core.segment import Segmentation
from bonsai_core.solvers.bonsai_coef import (Coefficients, PlainProfile, coefficients, dominated, lowers_memory,
                                             memory_steps, saved_positions, self_contained)
from bonsai_core.solvers.bonsai_offload import OffloadColumns, offload_columns
from bonsai_core.solvers.deadline import Deadline

# The model counts memory in units of a thousandth of the plain peak: raw byte counts near 1e10 (or near
# 1e1 on toy graphs) would strain the solvers' tolerances, and 1e-7 of a unit is under a byte up to 10 GB.
UNITS_PER_PEAK = 1000.0


@dataclass
class BuiltModel:
    """A built segment ILP for one segmentation, reused across budgets."""

    graph_hash: str
    seg: Segmentation
    coef: Coefficients  # the candidates recomputed with their outputs kept, no op saved
    coefs: dict[tuple[bool, int], Coefficients]  # per kind of column: (drops its outputs, density level)
    plain: PlainProfile
    candidates: np.ndarray  # int64[C']: the segmentation candidate of each rec variable
    drops_outputs: np.ndarray  # bool[C']: the rec variable recomputes its candidate with its outputs dropped
    levels: np.ndarray  # int64[C']: the density level whose ops the rec variable's segment saves (0: none)
    pinned: list[np.ndarray]  # per level, bool over forward positions: its ops (level 0: none)
    saving: np.ndarray  # bool[C] over the segmentation's candidates: recomputed, it saves its self-contained nodes
    constant: np.ndarray  # bool[m]: bonsai_coef.self_contained
    events: sp.csr_matrix  # (K, C') bytes: step heights of the memory change at each event point
    interval_peak: np.ndarray  # int64[K]: the plain memory's maximum from each event point to the next
    problem: Any
    rec: Any
    keep: Any
    delta: Any
    budget: Any  # cp.Parameter, in units
    unit: float  # bytes per unit of the model's memory rows
    build_seconds: float
    _min_peak: Any = None
    relaxation: Any = None  # the LP relaxation kept between budgets (bonsai_core.solvers.relaxation), once solved
    min_peak_found: tuple[int, str] | None = None  # the min-peak MILP's proven answer (bonsai._min_peak), once solved
    off: Any = None  # cp.Variable over offload.nodes (offload=True), else None
    offload: OffloadColumns | None = None
    off_events: sp.csr_matrix | None = None  # (K, V) bytes: the offload columns' steps at the event points
    in_flight: InFlightTerms | None = None  # on a pipeline rank: the other microbatches' copies (module doc)

    def predicted_peak(self, rec: np.ndarray, off: np.ndarray | None = None) -> int:
        """The model's bound on the peak of the plan whose recomputed ILP candidates are ``rec``
        (0/1 over :attr:`candidates`) and offloaded candidates ``off`` (0/1 over ``offload.nodes``)."""
        change = self.events @ np.asarray(rec, dtype=np.float64)
        if off is not None and self.off_events is not None:
            change = change + self.off_events @ np.asarray(off, dtype=np.float64)
        rows = self.interval_peak + np.cumsum(change)
        if self.in_flight is not None:
            rows = rows + self.in_flight.copies @ self.in_flight.held_bytes(rec, off)
        return int(np.ceil(rows.max()))

    def offloaded_of(self, off: np.ndarray | None) -> list[int]:
        """The node ids an ILP solution offloads."""
        if off is None or self.offload is None:
            return []
        return self.offload.nodes[np.asarray(off) > 0.5].tolist()

    def plan(self, rec: np.ndarray, off: np.ndarray | None = None) -> CheckpointPlan:
        """The checkpoint plan of an ILP solution: the recomputed candidates, and the stretches
        between them kept (merging kept atoms changes nothing in the schedule, and the explorer then
        shows recomputed regions and kept stretches, not a confetti of atoms)."""
        picked = np.asarray(rec) > 0.5
        chosen = self.candidates[picked]
        opened = {(int(self.seg.starts[c]), int(self.seg.ends[c])) for c in self.candidates[picked & self.drops_outputs]}
        saved = [v for i in np.flatnonzero(picked).tolist() for v in self.saved_nodes(i)]
        chosen = chosen[np.argsort(self.seg.starts[chosen])]
        m = len(self.seg.forward)
        spans: list[tuple[int, int]] = []
        pos = 0
        for c in chosen.tolist():
            start, end = int(self.seg.starts[c]), int(self.seg.ends[c])
            if start > pos:
                spans.append((pos, start))
            spans.append((start, end))
            pos = end
        if pos < m:
            spans.append((pos, m))
        recomputed = {(int(self.seg.starts[c]), int(self.seg.ends[c])) for c in chosen.tolist()}
        return CheckpointPlan.of([self.seg.forward[a:b].tolist() for a, b in spans],
                                 [i for i, span in enumerate(spans) if span in recomputed],
                                 [i for i, span in enumerate(spans) if span in opened], saved,
                                 self.offloaded_of(off))

    def self_contained_saved(self, c: int) -> list[int]:
        """The nodes candidate ``c`` saves when recomputed: its self-contained ones, if it saves them."""
        if not self.saving[c]:
            return []
        return self.seg.forward[saved_positions(self.constant, int(self.seg.starts[c]), int(self.seg.ends[c]))].tolist()

    def saved_nodes(self, i: int) -> list[int]:
        """The nodes rec variable ``i`` saves when recomputed: its candidate's self-contained ones and
        its level's ops inside it."""
        c = int(self.candidates[i])
        a, b = int(self.seg.starts[c]), int(self.seg.ends[c])
        ops = self.seg.forward[a + np.flatnonzero(self.pinned[int(self.levels[i])][a:b])].tolist()
        return sorted(set(self.self_contained_saved(c)) | set(ops))

    def rec_of(self, plan: CheckpointPlan) -> np.ndarray | None:
        """0/1 over :attr:`candidates` for ``plan``'s recomputed segments, or None when one of them is
        not an ILP column (the plan is outside the model, or a pruned candidate is in it, or it saves
        other nodes than the candidate does)."""
        pos = np.full(int(self.seg.forward.max(initial=-1)) + 1, -1, dtype=np.int64)
        pos[self.seg.forward] = np.arange(len(self.seg.forward))
        index: dict[tuple[int, int, bool], list[int]] = {}
        for i, (c, o) in enumerate(zip(self.candidates.tolist(), self.drops_outputs.tolist())):
            index.setdefault((int(self.seg.starts[c]), int(self.seg.ends[c]), bool(o)), []).append(i)
        out = np.zeros(len(self.candidates))
        for s in plan.recomputed:
            members = pos[list(plan.segments[s])]
            key = (int(members.min()), int(members.max()) + 1, s in plan.drop_outputs)
            saved = sorted(plan.saved & set(plan.segments[s]))
            match = [i for i in index.get(key, ()) if self.saved_nodes(i) == saved]
            if not match or key[1] - key[0] != len(members):
                return None
            out[match[0]] = 1.0
        return out

    def start_values(self, rec: np.ndarray) -> dict[Any, np.ndarray]:
        """Every variable's value for the plan recomputing the candidates ``rec`` (0/1 over
        :attr:`candidates`, a cover of the forward pass) with nothing offloaded: a MIP start. The atoms
        no recomputed candidate covers are kept; the memory changes are the running sum of the steps."""
        rec = np.asarray(rec, dtype=np.float64)
        covered = np.zeros(self.seg.atoms + 1, dtype=np.int64)
        chosen = self.candidates[rec > 0.5]
        np.add.at(covered, np.searchsorted(self.seg.atom_ptr, self.seg.starts[chosen]), 1)
        np.add.at(covered, np.searchsorted(self.seg.atom_ptr, self.seg.ends[chosen]), -1)
        values = {self.rec: rec, self.keep: (np.cumsum(covered)[:-1] == 0).astype(np.float64),
                  self.delta: np.cumsum((self.events @ rec) / self.unit)}
        if self.off is not None:
            values[self.off] = np.zeros(self.off.size)
        if self.in_flight is not None:
            values[self.in_flight.held] = self.in_flight.held_bytes(rec, None) / self.unit
        return values

    def min_peak_problem(self) -> tuple[Any, Any]:
        """(problem, z): the smallest budget the model can meet, for the infeasible-budget message."""
        if self._min_peak is None:
            import cvxpy as cp

            z = cp.Variable()
            cons = list(self.problem.constraints[:-1])  # all but the budget row
            cons.append(self.memory_rows() <= z)
            self._min_peak = (cp.Problem(cp.Minimize(z / UNITS_PER_PEAK), cons), z)
        return self._min_peak

    def memory_rows(self) -> Any:
        """The model's memory at each interval, in units: the plain memory's peak there, the plan's change, and
        on a pipeline rank the change of the other microbatches' copies."""
        rows = self.delta + self.interval_peak / self.unit
        return rows if self.in_flight is None else rows + self.in_flight.copies @ self.in_flight.held


@dataclass
class InFlightTerms:
    """The microbatches in flight of a pipeline rank in the model (module doc)."""

    copies: np.ndarray  # float64[K, stages]: the copies of each stage's held bytes in flight at each interval
    rec_steps: sp.csr_matrix  # (stages, C') bytes: each rec column's change of its stage's held bytes
    off_steps: sp.csr_matrix | None  # (stages, V) bytes: the same of each offload column
    held: Any  # cp.Variable[stages], in units: the plan's change of each stage's held bytes

    def held_bytes(self, rec: np.ndarray, off: np.ndarray | None) -> np.ndarray:
        """float64[stages]: the change of each stage's held bytes of the plan ``rec`` (and ``off``)."""
        out = self.rec_steps @ np.asarray(rec, dtype=np.float64)
        if off is not None and self.off_steps is not None:
            out = out + self.off_steps @ np.asarray(off, dtype=np.float64)
        return out


def _interval_starts(steps: sp.csr_matrix, plain: PlainProfile) -> np.ndarray:
    """The points opening the memory rows' intervals: where a column steps, and on a pipeline rank where the
    copies in flight change (constant on each interval); point 0 always, so the whole axis is covered."""
    points = np.union1d([0], np.flatnonzero(np.diff(steps.indptr)))
    if plain.in_flight is None:
        return points
    return np.union1d(points, 1 + np.flatnonzero((np.diff(plain.in_flight[0], axis=0) != 0).any(axis=1)))


def _in_flight_terms(plain: PlainProfile, steps: sp.csr_matrix, points: np.ndarray, starts: np.ndarray,
                     offloads: OffloadColumns | None, unit: float, rec: Any,
                     off: Any) -> tuple[InFlightTerms | None, list[Any], Any]:
    """The microbatches in flight in the model (module doc), the rows defining ``held`` and what they add to each
    memory row (None, none and 0 for a graph that is no pipeline rank): ``steps`` the memory axis's steps of the
    rec columns (their candidates start at forward positions ``starts``) then of the offload columns."""
    import cvxpy as cp

    if plain.in_flight is None:
        return None, [], 0
    count = len(starts)
    positions = np.concatenate([starts, plain.seq_pos[offloads.nodes] if off is not None else np.zeros(0, np.int64)])
    copies, ends = plain.in_flight
    held_steps = _held_steps(steps, positions, ends)
    held = cp.Variable(len(ends), name="held")
    terms = InFlightTerms(copies[points].astype(np.float64), held_steps[:, :count],
                          held_steps[:, count:] if off is not None else None, held)
    change = (held_steps[:, :count] / unit) @ rec
    if off is not None:
        change = change + (held_steps[:, count:] / unit) @ off
    return terms, [held == change], terms.copies @ held


def _held_steps(steps: sp.csr_matrix, positions: np.ndarray, ends: np.ndarray) -> sp.csr_matrix:
    """(stages, columns) bytes: each column's ``cumsum D`` at the end of its stage's forward (``ends``, points
    on the memory axis, ascending), its stage the one whose forward holds its forward position ``positions``."""
    stage = np.minimum(np.searchsorted(ends, positions, side="left"), len(ends) - 1)
    running = sp.csc_matrix(steps)
    rows = []
    for j, end in enumerate(ends.tolist()):
        at_end = np.asarray(running[:end + 1].sum(axis=0)).ravel() if end >= 0 else np.zeros(steps.shape[1])
        rows.append(np.where(stage == j, at_end, 0.0))
    return sp.csr_matrix(np.vstack(rows)) if rows else sp.csr_matrix((0, steps.shape[1]))


def _columns(coef: Coefficients, seg: Segmentation, m: int, allowed: np.ndarray | None) -> np.ndarray:
    """The candidates that get a rec variable: those that lower the memory, are allowed, and that no
    candidate inside them dominates."""
    useful = lowers_memory(coef, m)
    candidates = np.flatnonzero(useful if allowed is None else useful & allowed)
    return candidates[~dominated(coef, seg, candidates, m)]


def build_model(graph: Graph, seg: Segmentation, plain: PlainProfile, allowed: np.ndarray | None = None,
                drop_outputs: bool = False, save_self_contained: bool = False,
                levels: list[np.ndarray] | None = None, offload: bool = False, clock: Deadline | None = None) -> BuiltModel:
    """The segment ILP of one segmentation (see the module docstring). ``allowed`` (bool over the
    segmentation's candidates): only those may be recomputed (None: all). ``drop_outputs``: each
    candidate whose outputs are read by later forward ops may also be recomputed with its outputs
    dropped, as long as the atoms holding those readers are kept. ``save_self_contained``: a recomputed
    candidate saves its self-contained nodes (``bonsai_coef.saves_self_contained``) instead of rebuilding them.
    ``levels`` (:func:`bonsai_coef.density_levels`): each candidate may also be recomputed saving the ops
    of one level inside it. ``offload``: saved tensors may be offloaded to host memory (``bonsai_offload.py``).
    Past ``clock``: :class:`~bonsai_core.solvers.deadline.OutOfTime`."""
    import cvxpy as cp

    start = time.perf_counter()
    m = len(seg.forward)
    constant = self_contained(graph)
    pinned = [np.zeros(m, dtype=bool), *(levels or [])]
    kinds, coefs, columns = _column_kinds(graph, seg, plain, m, allowed, drop_outputs, save_self_contained, pinned,
                                          clock)
    coef = coefs[False, 0]
    candidates = np.concatenate([columns[k] for k in kinds])
    drops = np.concatenate([np.full(len(columns[k]), k[0]) for k in kinds]).astype(bool)
    column_levels = np.concatenate([np.full(len(columns[k]), k[1]) for k in kinds]).astype(np.int64)
    count, atoms = len(candidates), seg.atoms

    memory = plain.memory
    steps = sp.hstack([memory_steps(coefs[k], columns[k], m, points=len(memory)) for k in kinds]).tocsr()
    offloads = None
    if offload:
        from bonsai_core.schedule import host_link

        offloads = offload_columns(graph, seg, plain, host_link([])[0], points=len(memory))
        steps = sp.hstack([steps, offloads.steps]).tocsr()
    points = _interval_starts(steps, plain)
    events = steps[points][:, :count]
    off_events = steps[points][:, count:] if offloads is not None else None
    interval_peak = np.maximum.reduceat(memory, points)

    # Cover: a path through the atom boundaries; arcs are rec candidates and kept atoms.
    a_start = np.searchsorted(seg.atom_ptr, seg.starts[candidates])
    a_end = np.searchsorted(seg.atom_ptr, seg.ends[candidates])
    arange = np.arange(atoms)

    rhs = np.zeros(atoms)
    if atoms:
        rhs[0] = 1.0

    k = len(points)
    diff = sp.eye(k, format="csr") - sp.eye(k, k=-1, format="csr")
    rec = cp.Variable(count, boolean=True, name="rec")
    keep = cp.Variable(atoms, boolean=True, name="keep")
    delta = cp.Variable(k, name="delta")
    budget = cp.Parameter(nonneg=True, name="budget")
    unit = max(1.0, float(memory.max()) / UNITS_PER_PEAK)
    budget.value = float(memory.max()) / unit
    cost = np.concatenate([coefs[k].cost[columns[k]] for k in kinds])
    cost = cost / graph.total_cost if graph.total_cost > 0 else cost
    change = (events / unit) @ rec
    objective = cost @ rec
    off, off_rows = None, []
    if offloads is not None and len(offloads.nodes):
        off, off_change, off_cost, off_rows = _offload_terms(graph, offloads, off_events, unit, keep, atoms)
        change, objective = change + off_change, objective + off_cost
    constraints = [
        _arcs(a_start, a_end, atoms) @ rec + _arcs(arange, arange + 1, atoms) @ keep == rhs,
        diff @ delta == change,
        *off_rows,
    ]
    constraints += _readers_kept(kinds, coefs, columns, count, atoms, rec, keep)
    in_flight, held_rows, rows_in_flight = _in_flight_terms(plain, steps, points, seg.starts[candidates], offloads,
                                                            unit, rec, off)
    constraints += held_rows
    constraints.append(delta + interval_peak / unit + rows_in_flight <= budget)  # last: min_peak_problem replaces it
    problem = cp.Problem(cp.Minimize(objective), constraints)
    return BuiltModel(graph_hash=graph.hash, seg=seg, coef=coef, coefs=coefs, plain=plain, candidates=candidates,
                      drops_outputs=drops, levels=column_levels, pinned=pinned, saving=coef.saving, constant=constant,
                      events=events, interval_peak=interval_peak, problem=problem, rec=rec, keep=keep,
                      delta=delta, budget=budget, unit=unit, build_seconds=time.perf_counter() - start,
                      off=off, offload=offloads if off is not None else None,
                      off_events=off_events if off is not None else None, in_flight=in_flight)



def _column_kinds(graph: Graph, seg: Segmentation, plain: PlainProfile, m: int, allowed: np.ndarray | None,
                  drop_outputs: bool, save_self_contained: bool, pinned: list[np.ndarray], clock: Deadline | None = None):
    """The kinds of columns, (drops its candidate's outputs, density level saved inside it), with each
    kind's coefficients and the candidates it gets a column for."""
    kinds = [(drop, level) for drop in [False, True][:1 + drop_outputs] for level in range(len(pinned))]
    coefs, columns = {}, {}
    for drop, level in kinds:
        coef_k = coefficients(graph, seg, plain, drop_outputs=drop, save_self_contained=save_self_contained,
                              pinned=pinned[level] if level else None, clock=clock)
        ok = np.ones(seg.count, dtype=bool) if allowed is None else allowed.copy()
        if drop:
            ok &= np.diff(coef_k.reader_ptr) > 0  # else the same as keeping its outputs
        if level:  # else the same as saving no op
            inside = np.concatenate([[0], np.cumsum(pinned[level])])
            ok &= inside[seg.ends] > inside[seg.starts]
        coefs[drop, level], columns[drop, level] = coef_k, _columns(coef_k, seg, m, ok)
    return kinds, coefs, columns


def _arcs(tail: np.ndarray, head: np.ndarray, atoms: int) -> sp.csr_matrix:
    """The cover's arcs from atom boundary ``tail`` to ``head``, one column each (the path's rows)."""
    k = len(tail)
    return sp.csr_matrix((np.concatenate([np.ones(k), -np.ones(k)]),
                          (np.concatenate([tail, head]), np.tile(np.arange(k), 2))),
                         shape=(atoms + 1, k))[:atoms]  # the last row is implied by the others

def _offload_terms(graph: Graph, offloads, off_events: sp.csr_matrix, unit: float, keep, atoms: int):
    """The offload choice (``bonsai_offload.py``): one binary per candidate tensor, its memory steps and
    copy cost, and its rows: only a kept atom's tensor is offloaded, no two copies of one direction
    overlap, the host memory bounds them all. Returns (off, memory change, cost, rows)."""
    import cvxpy as cp

    from bonsai_core.schedule import host_link

    v = len(offloads.nodes)
    off = cp.Variable(v, boolean=True, name="off")
    rows = [off <= sp.csr_matrix((np.ones(v), (np.arange(v), offloads.atom)), shape=(v, atoms)) @ keep]
    rows += [cliques @ off <= 1 for cliques in (offloads.d2h, offloads.h2d) if cliques.shape[0]]
    host_limit = host_link([])[1]
    if host_limit is not None:
        rows.append((offloads.mem / unit) @ off <= host_limit / unit)
    return off, (off_events / unit) @ off, (offloads.cost / max(graph.total_cost, 1e-30)) @ off, rows


def _readers_kept(kinds, coefs, columns, count: int, atoms: int, rec, keep) -> list:
    """Rows saying that a column which drops its candidate's outputs needs the atoms of their readers kept."""
    which, readers, first = [], [], 0
    for k in kinds:
        if k[0]:
            ptr, atom = coefs[k].reader_ptr, coefs[k].reader_atom
            for i, c in enumerate(columns[k].tolist()):
                which.extend([first + i] * int(ptr[c + 1] - ptr[c]))
                readers.extend(atom[ptr[c]:ptr[c + 1]].tolist())
        first += len(columns[k])
    if not which:
        return []
    rows = np.arange(len(which))
    return [sp.csr_matrix((np.ones(len(rows)), (rows, which)), shape=(len(rows), count)) @ rec
            <= sp.csr_matrix((np.ones(len(rows)), (rows, readers)), shape=(len(rows), atoms)) @ keep]
