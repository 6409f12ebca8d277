"""Operator segmentation: the candidate segments of Bonsai's segment ILP.

The forward pass, in listed order, is cut into **atoms**: one non-view op and the views listed right
after it (a view shares its base's storage and costs nothing to rebuild; a cut between a view and its
base only means the base is kept as the boundary of its segment). A **candidate segment** is a
run of whole consecutive atoms with at most ``granularity`` non-view ops (a view is free to rebuild and
rides with its base, so it does not count); an atom longer than that is still a candidate on its own
(it cannot be split). The ILP picks a cover of the forward pass out of the
candidates and decides which of the picked ones to recompute.

Contiguous runs in the listed (topological) order are what a checkpoint region is in
``torch.utils.checkpoint``: a stretch of the forward code. Such a run is usually connected in the
forward graph (each op of a layer reads the one before it); a run that straddles independent
branches is allowed, it is simply a region with several inputs.

Example::

    >>> from tests.graphs import chain
    >>> s = segment(chain(4), granularity=2)
    >>> s.sizes.tolist()
    [1, 2, 1, 2, 1, 2, 1]

Complexity: O(n + edges) for the atoms, O(candidates) for the candidates, and there are at most
``atoms * granularity`` candidates (fewer where atoms are long): O(n_forward * granularity).

``granularity=None`` is the paper's default bound, round(2·√(non-view forward ops));
:mod:`bonsai_core.solvers.bonsai` chooses the granularity itself ("auto") when it is not given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from bonsai_core.errors import SolverError
from bonsai_core.graph import Graph


def op_count(graph: Graph) -> int:
    """Forward ops that count towards a segment's size: the non-view ones."""
    return int((graph.is_forward & ~graph.is_view).sum())


def default_granularity(graph: Graph) -> int:
    """The paper's default bound on a segment's size: about 2·√(non-view forward ops), at least 1."""
    return max(1, round(2 * math.sqrt(op_count(graph))))


@dataclass(frozen=True)
class Segmentation:
    """Candidate segments of one graph at one granularity.

    Positions are indices into ``forward`` (the forward node ids in listed order). Candidate ``c``
    is the forward positions ``starts[c] <= p < ends[c]``; atom ``a`` is ``atom_ptr[a] <= p <
    atom_ptr[a + 1]``. Candidates are sorted by (start, end).
    """

    graph_hash: str
    granularity: int
    forward: np.ndarray  # int64[m]: forward node ids in listed order
    atom_ptr: np.ndarray  # int64[atoms + 1]: atom boundaries (positions)
    starts: np.ndarray  # int64[C]
    ends: np.ndarray  # int64[C], exclusive
    op_ptr: np.ndarray  # int64[m + 1]: non-view ops before each position (op_ptr[-1]: all of them)

    @property
    def count(self) -> int:
        """Number of candidate segments."""
        return len(self.starts)

    @property
    def sizes(self) -> np.ndarray:
        """int64[C]: non-view ops in each candidate (what the granularity bounds)."""
        return self.op_ptr[self.ends] - self.op_ptr[self.starts]

    @property
    def atoms(self) -> int:
        return len(self.atom_ptr) - 1

    def members(self, c: int) -> np.ndarray:
        """Node ids of candidate ``c``, in listed order."""
        return self.forward[self.starts[c]:self.ends[c]]

    def summary(self) -> dict[str, Any]:
        """What the explorer shows next to the graph."""
        sizes = self.sizes
        return {"granularity": self.granularity, "forward_ops": len(self.forward),
                "non_view_ops": int(self.op_ptr[-1]), "atoms": self.atoms,
                "candidates": self.count, "largest_atom": int(np.diff(self.op_ptr[self.atom_ptr]).max(initial=0)),
                "mean_size": float(sizes.mean()) if len(sizes) else 0.0,
                "max_size": int(sizes.max(initial=0))}


def atom_boundaries(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """(forward ids in listed order, atom boundaries as positions). A cut is allowed before every
    non-view op, and before a view unless the cut separates some forward view from its base; so an
    atom is one non-view op and the views listed right after it (they cost nothing, and ride with
    it), plus the views that are free to stand alone. O(n + edges).

    A cut may separate a view from its base: the base is then read from another segment and kept as
    a boundary (:func:`bonsai_core.regions.dropped_nodes`), while the rest of its segment can still be
    dropped. (Gluing every view to its base instead makes an attention layer one atom of 27 ops, whose
    ``qkv`` matmul is only viewed again at its end, and loses the plans that keep that matmul and drop
    the scores: +7.94% against +6.19% on the zoo GPT at 70%.)"""
    forward = np.flatnonzero(graph.is_forward).astype(np.int64)
    m = len(forward)
    views = forward[graph.alias_of[forward] >= 0]
    splits_a_view = _cuts_between(forward, graph.alias_of[views], views, graph.n)
    before_view = np.append(graph.is_view[forward], False)
    cuts = np.flatnonzero(~(splits_a_view & before_view) & ~splits_an_output(graph, forward))
    cuts = np.union1d(cuts, [0, m])  # the ends of the forward pass are always cuts
    return forward, cuts.astype(np.int64)


def splits_an_output(graph: Graph, forward: np.ndarray) -> np.ndarray:
    """bool[m + 1]: cut p (before forward position p) falls between a multi-output op and one of its
    separated outputs (``Graph.output_of``). Such an output's bytes come only with its op's kernel,
    so it is dropped and rebuilt with its op or kept with it (the simulator's separated-output rule): never cut apart."""
    outs = forward[graph.output_of[forward] >= 0]
    return _cuts_between(forward, graph.output_of[outs], outs, graph.n)


def _cuts_between(forward: np.ndarray, firsts: np.ndarray, lasts: np.ndarray, n: int) -> np.ndarray:
    """bool[m + 1]: cut p (before forward position p) falls between some ``firsts[i]`` and
    ``lasts[i]`` (cuts pos(first) + 1 .. pos(last)); pairs whose first is not a forward node (a view
    of a backward or input node) bind nothing. A difference array: O(m + pairs)."""
    m = len(forward)
    pos = np.full(n, -1, dtype=np.int64)
    pos[forward] = np.arange(m)
    inside = pos[firsts] >= 0
    blocked = np.zeros(m + 2, dtype=np.int64)
    np.add.at(blocked, pos[firsts[inside]] + 1, 1)
    np.add.at(blocked, pos[lasts[inside]] + 1, -1)
    return np.cumsum(blocked)[:m + 1] > 0


def segment(graph: Graph, granularity: int | None = None,
            extra: Sequence[tuple[int, int]] = ()) -> Segmentation:
    """Candidate segments of ``graph``: every run of whole consecutive atoms with at most
    ``granularity`` non-view forward ops, and every atom alone (default granularity: about
    2·√(non-view forward ops); values above that count mean "no bound"). ``extra``: more candidates
    of any length, as (start, end) positions (the solver adds the segments of Chen's plans this way);
    their ends become atom boundaries too (the short runs stay runs of the atoms without them: a
    kept piece of an atom needs no candidate of its own in the ILP). Such a cut may separate a view from its base: harmless,
    since the base is then read from another segment and kept as a boundary
    (:func:`bonsai_core.regions.dropped_nodes`); one between an op and its separated output moves to
    after the output (:func:`splits_an_output`). O(n + edges + candidates)."""
    m = op_count(graph)
    if granularity is None:
        granularity = default_granularity(graph)
    if isinstance(granularity, bool) or not isinstance(granularity, (int, np.integer)) or granularity < 1:
        raise SolverError(f"Granularity {granularity!r} is not a positive whole number: it is the largest "
                          "number of ops in a segment (1 = every op alone).")
    granularity = int(min(granularity, max(m, 1)))
    forward, atom_ptr = atom_boundaries(graph)
    spans = np.asarray(sorted(set(map(tuple, extra))), dtype=np.int64).reshape(-1, 2)
    spans = spans[(0 <= spans[:, 0]) & (spans[:, 0] < spans[:, 1]) & (spans[:, 1] <= len(forward))]
    if len(spans):  # a span that ends (or starts) between an op and its separated output takes it in
        allowed = np.flatnonzero(~splits_an_output(graph, forward))
        spans = allowed[np.searchsorted(allowed, spans)]
        spans = np.unique(spans[spans[:, 0] < spans[:, 1]], axis=0).reshape(-1, 2)
    op_ptr = np.concatenate([[0], np.cumsum(~graph.is_view[forward])]).astype(np.int64)
    k = len(atom_ptr) - 1
    # Candidate (a, b) = atoms a..b-1. For each start atom a, the ends reach as far as the op budget
    # allows (searchsorted on the boundary positions), and at least one atom.
    if k > 0:
        ops_at = op_ptr[atom_ptr]  # non-view ops before each atom boundary
        last_end = np.searchsorted(ops_at, ops_at[:-1] + granularity, side="right") - 1  # index into atom_ptr
        last_end = np.maximum(last_end, np.arange(1, k + 1))
        counts = last_end - np.arange(k)
        start_atom = np.repeat(np.arange(k), counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        end_atom = start_atom + 1 + offsets
        starts, ends = atom_ptr[start_atom], atom_ptr[end_atom]
    else:
        starts = ends = np.zeros(0, dtype=np.int64)
    starts, ends = starts.astype(np.int64), ends.astype(np.int64)
    if len(spans):  # after the short runs, so that they stay runs of the view-respecting atoms
        atom_ptr = np.union1d(atom_ptr, spans.ravel()).astype(np.int64)
        pairs = np.unique(np.concatenate([np.stack([starts, ends], 1), spans]), axis=0)
        starts, ends = pairs[:, 0].copy(), pairs[:, 1].copy()  # np.unique sorts by (start, end)
    for arr in (forward, atom_ptr, starts, ends, op_ptr):
        arr.setflags(write=False)
    return Segmentation(graph_hash=graph.hash, granularity=granularity, forward=forward, atom_ptr=atom_ptr,
                        starts=starts, ends=ends, op_ptr=op_ptr)
