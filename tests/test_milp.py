import cvxpy as cp
import numpy as np
import pytest
import scipy.sparse as sp

from bonsai_core.errors import SolverError
from bonsai_core.solvers.milp import solve_milp


def _knapsack(capacity: float):
    weights = sp.csr_matrix(np.array([[3.0, 4.0, 5.0, 6.0]]))
    x = cp.Variable(4, boolean=True)
    cap = cp.Parameter(value=capacity)
    return cp.Problem(cp.Maximize(np.array([4.0, 5.0, 6.0, 7.0]) @ x), [weights @ x <= cap]), cap


@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_both_backends_reach_the_optimum_and_report_size(backend):
    problem, _ = _knapsack(10.0)
    out = solve_milp(problem, backend=backend, time_limit=10)
    assert out.status == "optimal" and out.objective == pytest.approx(12.0) and out.gap == 0.0
    assert out.variables == 4 and out.constraints >= 1


@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_infeasible_is_a_status_not_an_exception(backend):
    problem, cap = _knapsack(10.0)
    cap.value = -1.0
    assert solve_milp(problem, backend=backend).status == "infeasible"


def test_unknown_backend_is_a_clear_error():
    problem, _ = _knapsack(10.0)
    with pytest.raises(SolverError, match="highs, scip"):
        solve_milp(problem, backend="gurobi")



def _sparse_cover(weight: float):
    """The cheapest items weighing at least ``weight``, as a SparseMilp (a nonnegative objective, as the
    recomputation cost is)."""
    from bonsai_core.solvers.sparse_milp import SparseMilp

    return SparseMilp(cost=np.array([4.0, 5.0, 6.0, 7.0]), matrix=sp.csr_matrix(np.array([[3.0, 4.0, 5.0, 6.0]])),
                      row_lower=np.array([weight]), row_upper=np.array([np.inf]), col_lower=np.zeros(4),
                      col_upper=np.ones(4), integer=np.ones(4, dtype=bool))


@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_a_sparse_milp_reaches_the_optimum_from_a_start_on_both_backends(backend):
    from bonsai_core.solvers.sparse_milp import solve_sparse_milp

    found = solve_sparse_milp(_sparse_cover(10.0), backend, start=np.ones(4), time_limit=10)
    assert found.outcome.status == "optimal" and found.outcome.objective == pytest.approx(12.0)
    assert found.values.round().tolist() == [0.0, 1.0, 0.0, 1.0] and found.start_note == f"{backend} improved on it"
    assert solve_sparse_milp(_sparse_cover(100.0), backend, time_limit=10).outcome.status == "infeasible"


def test_a_cvxpy_milp_as_a_sparse_milp_keeps_its_optimum_and_its_variables():
    """``from_cvxpy``: CVXPY's canonical form handed to the backend directly, so a MIP start can go with it."""
    from bonsai_core.solvers.sparse_milp import from_cvxpy, satisfies, solve_sparse_milp

    x, y = cp.Variable(4, boolean=True), cp.Variable(2)
    weights = sp.csr_matrix(np.array([[3.0, 4.0, 5.0, 6.0]]))
    problem = cp.Problem(cp.Minimize(np.array([4.0, 5.0, 6.0, 7.0]) @ x + np.array([1.0, 2.0]) @ y),
                         [weights @ x >= 10.0, y == np.array([0.5, -1.0])])
    canonical = from_cvxpy(problem)
    start = canonical.vector({x: np.ones(4), y: np.array([0.5, -1.0])})
    assert satisfies(canonical.milp, start)
    assert not satisfies(canonical.milp, canonical.vector({x: np.array([1.0, 0, 0, 0]), y: np.array([0.5, -1.0])}))
    assert not satisfies(canonical.milp, canonical.vector({x: np.full(4, 0.5), y: np.array([0.5, -1.0])}))
    found = solve_sparse_milp(canonical.milp, "highs", start=start, time_limit=10)
    assert canonical.value_of(found.values, x).round().tolist() == [0.0, 1.0, 0.0, 1.0]
    assert canonical.value_of(found.values, y).tolist() == pytest.approx([0.5, -1.0])
    assert found.outcome.objective == pytest.approx(12.0 - 1.5)
    assert problem.solve(solver="HIGHS") == pytest.approx(found.outcome.objective)
    with pytest.raises(ValueError, match="every column"):
        canonical.vector({x: np.ones(4)})
