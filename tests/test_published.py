"""The published-rows suite (``bonsai_core.bench.published``): which rows are predicted compiled, which are kept
from the stored results, and what holds a rank's peak as the page names it (``bonsai_core.rank_memory``'s parts)."""


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


def test_a_ranks_peak_is_named_by_its_fixed_kinds_fsdps_parts_and_the_steps_tensors():
    from bonsai_core.bench.published import breakdown
    from bonsai_core.schedule import simulate
    from bonsai_core.solvers import solve
    from tests.graphs import fsdp_chain

    graph = fsdp_chain()
    schedule = solve(graph, None, "none")
    sim = simulate(graph, schedule)
    parts = breakdown(graph, schedule.ops, sim)
    assert list(parts)[:3] == ["fixed: param", "fixed: grad", "fixed: fsdp"]
    # at the first backward op: both blocks unsharded (the last running, the one before prefetched), f0..f3 and b3
    assert parts["FSDP: all-gathered blocks"] == 800 and parts["the step's tensors"] == 50
    assert sum(parts.values()) == sim.peak
