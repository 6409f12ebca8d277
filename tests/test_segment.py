import json
import math
from pathlib import Path

import numpy as np
import pytest

from bonsai_core.errors import SolverError
from bonsai_core.graph import Graph
from bonsai_core.segment import default_granularity, op_count, segment, splits_an_output
from tests.graphs import chain

ASSET = Path(__file__).resolve().parent.parent / "assets" / "gpt-default.json"


@pytest.fixture(scope="module")
def gpt() -> Graph:
    return Graph.from_dict(json.loads(ASSET.read_text()))


def _check(graph: Graph, seg) -> None:
    m = int(graph.is_forward.sum())
    assert seg.forward.tolist() == np.flatnonzero(graph.is_forward).tolist()
    atoms = np.diff(seg.atom_ptr)
    assert seg.atom_ptr[0] == 0 and seg.atom_ptr[-1] == m and (atoms > 0).all()
    starts_atom = np.searchsorted(seg.atom_ptr, seg.starts)
    ends_atom = np.searchsorted(seg.atom_ptr, seg.ends)
    # Candidates are runs of whole atoms ...
    assert (seg.atom_ptr[starts_atom] == seg.starts).all() and (seg.atom_ptr[ends_atom] == seg.ends).all()
    # ... of at most `granularity` ops, unless a single atom is longer.
    single = ends_atom - starts_atom == 1
    assert ((seg.sizes <= seg.granularity) | single).all()
    # Every atom alone is a candidate, so every cover can be built.
    assert set(zip(seg.atom_ptr[:-1].tolist(), seg.atom_ptr[1:].tolist())) <= set(zip(seg.starts.tolist(),
                                                                                     seg.ends.tolist()))
    # Every non-view op starts an atom, so an atom holds at most one: the finest cover that counts;
    # but a separated output rides with its op (the simulator's separated-output rule): no cut between them.
    views = graph.is_view[seg.forward]
    cuts = set(seg.atom_ptr.tolist())
    riding = splits_an_output(graph, seg.forward)
    assert all(p in cuts for p in np.flatnonzero(~views & ~riding[:-1]).tolist())
    assert not any(riding[c] for c in cuts)
    # A cut before a view never separates a view from its base (a view rides with the op before it).
    pos = np.full(graph.n, -1)
    pos[seg.forward] = np.arange(m)
    for v in seg.forward:
        a = graph.alias_of[v]
        if a >= 0 and graph.is_forward[a]:
            assert not any(c in cuts and views[c] for c in range(pos[a] + 1, pos[v] + 1)), (v, a)
    # Every run of atoms within the bound is there, once.
    runs = {(int(s), int(e)) for s, e in zip(seg.starts, seg.ends)}
    assert len(runs) == seg.count


@pytest.mark.parametrize("granularity", [1, 2, 3, 8])
def test_chain_candidates_are_all_runs_within_the_bound(granularity):
    g = chain(8)
    seg = segment(g, granularity)
    _check(g, seg)
    expected = {(s, e) for s in range(8) for e in range(s + 1, min(8, s + granularity) + 1)}
    assert set(zip(seg.starts.tolist(), seg.ends.tolist())) == expected


@pytest.mark.parametrize("granularity", [1, 5, None, 40, 1000])
def test_gpt_segmentation_covers_respects_bound_and_cuts_before_every_op(gpt, granularity):
    _check(gpt, segment(gpt, granularity))


def test_granularity_one_gives_the_atoms_and_no_bound_gives_every_run(gpt):
    atoms = segment(gpt, 1)
    assert atoms.count == atoms.atoms
    every = segment(gpt, 10_000)
    assert every.granularity == op_count(gpt) < int(gpt.is_forward.sum())  # views do not count
    assert every.count == atoms.atoms * (atoms.atoms + 1) // 2


def test_candidate_count_grows_at_most_linearly_with_granularity(gpt):
    for g in (2, 10, 21):
        seg = segment(gpt, g)
        assert seg.count <= seg.atoms * g


def test_default_granularity_is_about_twice_the_root_of_the_non_view_forward_ops(gpt):
    m = int((gpt.is_forward & ~gpt.is_view).sum())
    assert default_granularity(gpt) == round(2 * math.sqrt(m))
    assert segment(gpt).granularity == default_granularity(gpt)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True])
def test_bad_granularity_is_refused_with_a_clear_message(bad):
    with pytest.raises(SolverError, match="positive whole number"):
        segment(chain(4), bad)


def test_summary_reports_what_the_explorer_shows(gpt):
    s = segment(gpt, 10).summary()
    assert s["candidates"] > s["atoms"] > 0 and s["forward_ops"] == int(gpt.is_forward.sum())
    assert s["max_size"] <= max(10, s["largest_atom"])


def test_views_ride_with_their_base_and_do_not_count_towards_the_size(gpt):
    seg = segment(gpt, 12)
    positions = seg.ends - seg.starts
    assert (seg.sizes <= positions).all() and (seg.sizes < positions).any()
    multi = np.searchsorted(seg.atom_ptr, seg.ends) - np.searchsorted(seg.atom_ptr, seg.starts) > 1
    assert positions[multi].max() > 12 >= seg.sizes[multi].max()


def test_extra_candidates_are_added_and_their_ends_become_atom_boundaries(gpt):
    base = segment(gpt, 3)
    m, ptr = len(base.forward), base.atom_ptr
    riding = splits_an_output(gpt, base.forward)
    # a cut inside an atom (between an op and its view)
    inside = next(int(ptr[a]) + 1 for a in np.flatnonzero(np.diff(ptr) > 1) if not riding[ptr[a] + 1])
    extra = [(0, m), (int(ptr[1]), inside)]
    seg = segment(gpt, 3, extra)
    got = set(zip(seg.starts.tolist(), seg.ends.tolist()))
    assert set(extra) <= got and inside in seg.atom_ptr.tolist() and seg.atoms == base.atoms + 1 and seg.count == base.count + 2
    assert (np.diff(seg.starts) >= 0).all()


def test_a_candidate_never_ends_between_an_op_and_its_separated_output(gpt):
    """Layer norm's statistics are nodes of their own whose bytes only its kernel makes: a module
    span (or Chen segment) ending right after the layer norm takes them in."""
    seg = segment(gpt, 3)
    outs = seg.forward[gpt.output_of[seg.forward] >= 0]
    assert len(outs)
    pos = {int(v): p for p, v in enumerate(seg.forward.tolist())}
    op = int(gpt.output_of[outs[0]])
    last = max(pos[int(o)] for o in outs if gpt.output_of[o] == op)
    moved = segment(gpt, 3, [(0, pos[op] + 1)])
    assert (0, last + 1) in set(zip(moved.starts.tolist(), moved.ends.tolist()))
    assert pos[op] + 1 not in moved.atom_ptr.tolist()
