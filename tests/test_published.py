"""The published-rows suite's account of a rank's peak (``bonsai_core.bench.published``): which op the live
peak follows and which tensors hold it, grouped by phase and shape."""

from bonsai_core.bench.published import held_at_peak, peak_at
from bonsai_core.schedule import simulate
from bonsai_core.solvers import solve
from tests.graphs import chain


def test_a_chains_peak_is_its_first_backward_op_holding_every_forward_tensor():
    graph = chain(3, mem=10)
    schedule = solve(graph, None, "none")
    sim = simulate(graph, schedule)
    assert peak_at(graph, schedule.ops, sim).startswith("backward `b` (node b")
    held = held_at_peak(graph, sim)
    forward = next(g for g in held if g["phase"] == "forward")
    assert (forward["count"], forward["bytes"], forward["ops"]) == (3, 30, ["f"])
    assert sum(g["bytes"] for g in held) == sim.peak - graph.fixed_mem


def test_held_groups_are_the_largest_first_and_at_most_the_number_asked():
    graph = chain(4, mem=10)
    schedule = solve(graph, None, "none")
    sim = simulate(graph, schedule)
    held = held_at_peak(graph, sim, largest=1)
    assert len(held) == 1 and held[0]["phase"] == "forward" and held[0]["bytes"] == 40


def test_a_peak_at_a_nodes_second_compute_is_named_its_recompute():
    from types import SimpleNamespace

    graph = chain(2, mem=10)
    ops = [("compute", 0), ("compute", 1), ("free", 0), ("compute", 2), ("compute", 0), ("compute", 3)]
    assert peak_at(graph, ops, SimpleNamespace(peak_op=4, peak=30)) == "forward `f` (node f0, its recompute)"
    assert peak_at(graph, ops, SimpleNamespace(peak_op=3, peak=30)) == "backward `b` (node b1, its compute)"


def test_after_the_backward_tensors_held_at_a_chains_peak_are_freed_it_holds_one_tensor_less():
    from bonsai_core.bench.published import after_peak

    graph = chain(3, mem=10)  # peak 40 at b2 (f0, f1, f2, b2), again at b1 while b2 lives; after b2: 30
    sim = simulate(graph, solve(graph, None, "none"))
    assert (sim.peak, after_peak(graph, sim)) == (40, 30)


def test_a_row_is_predicted_compiled_where_the_trace_runs_its_rank_compiled():
    from bonsai_core.bench.published import compiled_refusal

    assert compiled_refusal(dict(fsdp=32, tp=8)) is None
    assert "pipeline or context parallel" in compiled_refusal(dict(fsdp=8, tp=8, pp=8, microbatches=8))
    assert "pipeline or context parallel" in compiled_refusal(dict(fsdp=4, cp=2))
    assert compiled_refusal(dict(fsdp=8)) is None


def test_rows_not_asked_for_are_kept_as_stored_in_the_suite_s_order(tmp_path):
    """``--rows 4`` reruns table 4 only: the other tables' rows come from the stored results, in the page's
    order, each saying why it has no compiled prediction."""
    import json

    from bonsai_core.bench.published import ROWS, measure

    stored = [{"table": t, "row": label, "degrees": degrees, "ranks": []}
              for t, label, _, degrees, *_ in reversed(ROWS)]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": stored}))
    rows = measure([], path)["rows"]
    assert [r["row"] for r in rows] == [label for _, label, *_ in ROWS]
    assert all(bool(r["compiled_refused"]) == (r["degrees"].get("pp", 1) > 1 or r["degrees"].get("cp", 1) > 1)
               for r in rows)
    assert measure([], tmp_path / "none.json") == {"rows": []}
