"""Invariants that must hold on every graph, checked on random ones (hypothesis)."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule, no_remat_peak, none_schedule, schedule_ops, simulate
from bonsai_core.solvers import available_methods, solve
from tests.strategies import graphs

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(graphs())
def test_graph_json_round_trips(g):
    h = Graph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert h.to_dict() == g.to_dict() and h.hash == g.hash


@SETTINGS
@given(graphs())
def test_plain_schedule_invariants(g):
    s = none_schedule(g)
    sim = simulate(g, s)
    assert sim.peak == sim.timeline.max() >= g.peak_lower_bound
    assert sim.recomputes == 0 and abs(sim.overhead) < 1e-12
    assert sim.timeline[-1] == g.fixed_mem  # everything freed at the end
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))).ops == s.ops


@SETTINGS
@given(graphs(), st.randoms(use_true_random=False))
def test_recomputing_sequences_give_valid_schedules(g, rnd):
    # insert recomputations of (non-view) nodes right before a random later consumer
    seq = list(range(g.n))
    for v in range(g.n):
        users = g.users(v).tolist()
        if users and not g.is_view[v] and not any(g.alias_of[u] == v for u in users) and rnd.random() < 0.3:
            u = rnd.choice(users)
            seq.insert(seq.index(u), v)
    try:
        ops = schedule_ops(g, seq)
    except BonsaiError:
        return  # an impossible sequence is refused with a clear error; that is the contract
    sim = simulate(g, ops)
    assert sim.compute_cost >= g.total_cost - 1e-12


@pytest.mark.parametrize("method", available_methods())
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=graphs(max_nodes=10), share=st.floats(0.3, 1.2))
def test_every_method_respects_the_budget_when_it_succeeds(method, g, share):
    budget = int(share * no_remat_peak(g))
    try:
        s = solve(g, budget, method=method, time_limit=5)
    except BonsaiError:
        return  # infeasible or limited: reported as a typed error, never a crash
    sim = simulate(g, s)
    assert sim.peak <= budget and s.stats["peak"] == sim.peak
    assert np.isclose(s.stats["compute_cost"], sim.compute_cost)
