"""bonsai fit: the largest size each method trains within a GPU's memory."""

from __future__ import annotations

import json

import pytest

from bonsai_core.fit import fit, search_sizes, table, write_report


@pytest.mark.parametrize("limits", [{"a": 1, "b": 37, "c": 0, "d": 64}, {"a": 5, "b": 6, "c": 100, "d": 2}])
def test_the_search_finds_each_methods_largest_size(limits):
    asked = []

    def evaluate(size, methods):
        asked.extend((size, m) for m in methods)
        return {m: size <= limits[m] for m in methods}

    search_sizes(evaluate, list(limits), largest=128)
    assert len(asked) == len(set(asked))  # no method asked twice at a size
    for m, top in limits.items():
        mine = [s for s, k in asked if k == m]
        for i, s in enumerate(mine):  # never asked what its answers so far said: below a fit, above a failure
            assert not any(s <= t <= top or top < t <= s for t in mine[:i])
        if top == 0:
            continue
        assert min(top, 128) in mine and (top >= 128 or top + 1 in mine)  # the boundary was probed


@pytest.fixture(scope="module")
def searched():
    # 7 MiB: eight sizes searched (none fits batch 3, bonsai 6, chen 4); 10 MiB searched thirteen
    return fit("gpt", 7 * 2**20, ["none", "bonsai", "chen"], max_overhead=0.15, options=dict(layers=1, seq=32),
               optimizer="adamw", solver_options={"time_limit": 20})


def test_fit_reports_the_boundary_of_every_method(searched):
    for m in searched.methods:
        best = searched.best(m)
        assert best is not None and best.fits and best.peak <= searched.limit and best.overhead <= 0.15
        above = [a for a in searched.attempts if a.method == m and a.size == best.size + 1]
        assert above and not above[0].fits and above[0].reason
    # rematerialization trains a larger batch than none in the same memory
    assert searched.best("bonsai").size > searched.best("none").size
    assert set(searched.traces) == {a.size for a in searched.attempts}  # each size traced once
    assert [r["method"] for r in table(searched)] == ["none", "bonsai", "chen"]


def test_fit_writes_its_report(searched, tmp_path):
    written = write_report(searched, str(tmp_path))
    assert {"fit.csv", "fit.md", "fit.png", "plan-bonsai.json"} <= set(written)
    plan = json.loads((tmp_path / "plan-bonsai.json").read_text())
    assert plan["method"] == "bonsai" and plan["stats"]["peak"] <= searched.limit
    assert "largest batch" in (tmp_path / "fit.md").read_text()


def test_a_method_that_fits_no_size_reads_as_a_dash_not_nan():
    from bonsai_core.fit import Attempt, FitResult, markdown_table

    result = FitResult("m", "batch", 2**30, 0.1, [Attempt("none", 1, False, reason="no-remat peak over the limit"),
                                                   Attempt("bonsai", 1, True, 2**29, None, 0.05, "optimal"),
                                                   Attempt("bonsai", 2, False, reason="overhead")], {1: 0.1, 2: 0.1}, {})
    rows = markdown_table(result).splitlines()[2:]
    assert rows[0].split("|")[2].strip() == "-" and rows[1].split("|")[2].strip() == "1"
    assert "nan" not in markdown_table(result)


@pytest.mark.slow  # 10-30 s; `bonsai fit` from the command line: test_a_variant_is_searched_and_reported_under_*
def test_cli_fit(tmp_path, capsys):
    from bonsai_core.cli import main

    assert main(["fit", "mlp", "--layers", "2", "--width", "64", "--gpu", "2MiB", "--methods", "none", "chen",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in out["rows"]}
    assert rows["chen"]["largest batch"] >= rows["none"]["largest batch"] >= 1
    with pytest.raises(SystemExit):
        main(["fit", "mlp", "--gpu", "50%"])


def test_the_what_fits_page_searches_the_loaded_model():
    from tests.test_app import app, goto

    at = goto(app(), "fit")
    at.text_input(key="fit_gpu").set_value("16MiB").run()  # four sizes searched (40 MiB: eight)
    at.multiselect(key="fit_methods").set_value(["none", "chen"]).run()
    at.button(key="fit_run").click().run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert list(table["method"]) == ["none", "chen"]
    assert table["largest batch"].min() >= 1
    assert at.get("plotly_chart")


def test_the_what_fits_page_refuses_a_share_as_the_gpu_memory():
    from tests.test_app import app, goto

    at = goto(app(), "fit")
    at.text_input(key="fit_gpu").set_value("50%").run()
    at.button(key="fit_run").click().run()
    assert not at.exception and "not as a share" in at.error[0].value


def test_fit_says_when_the_fixed_memory_alone_is_over_the_gpu():
    searched = fit("mlp", 64 * 1024, ["none", "chen"], options=dict(layers=2, width=64), optimizer="adamw")
    assert all(searched.best(m) is None for m in ("none", "chen"))
    assert all("fixed memory alone" in a.reason for a in searched.attempts)
    assert len(searched.traces) == 1  # nothing fits the first size: the search ends there


def test_a_variant_is_searched_and_reported_under_its_own_name(tmp_path, capsys):
    from bonsai_core.cli import main

    assert main(["fit", "mlp", "--layers", "2", "--width", "64", "--gpu", "2MiB", "--methods",
                 "bonsai:offload=true,gap=0.05", "--json", "-o", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in out["rows"]] == ["bonsai:offload=true,gap=0.05"]
    assert (tmp_path / "plan-bonsai-offload-true-gap-0.05.json").exists()
    plan = json.loads((tmp_path / "plan-bonsai-offload-true-gap-0.05.json").read_text())
    assert plan["method"] == "bonsai"
    for bad, words in (("bonsai:offlod=true", "no option 'offlod'"), ("bonsia", "Unknown method 'bonsia'"),
                       ("bonsai:offload=maybe", "expected bool")):
        with pytest.raises(SystemExit):
            main(["fit", "mlp", "--gpu", "2MiB", "--methods", bad])
        assert words in capsys.readouterr().err


@pytest.mark.slow  # two searches of the 2-layer zoo GPT, about 40 s
def test_offload_allowed_fits_a_larger_batch_at_the_same_overhead_limit():
    """`bonsai fit` with offload allowed finds a larger micro-batch than without (the zoo GPT
    within 24 MiB at 5% overhead: 32 without offload, 36 with, measured 2026-12-05)."""
    result = fit("gpt", 24 * 2**20, ["bonsai", "bonsai:offload=true"], max_overhead=0.05,
                 options=dict(layers=2, seq=32), optimizer="adamw", solver_options={"time_limit": 20})
    plain, offload = result.best("bonsai"), result.best("bonsai:offload=true")
    assert offload.size > plain.size
    assert offload.schedule.stats["offloaded_bytes"] > 0 and offload.peak <= result.limit


def test_a_torchtitan_fsdp_step_made_of_three_blocks_is_the_whole_trace_node_for_node():
    """What fits traces each size of a torchtitan FSDP step as three blocks repeated (fit.three_block_step), not
    every block: the graph a whole trace gives, field for field, the repeated blocks' names aside; a layout or
    option it does not honour is traced whole."""
    from bonsai_core.fit import three_block_step
    from bonsai_core.rank import trace
    from bonsai_core.schedule import no_remat_peak

    model, kwargs = "torchtitan:llama3:debugmodel", dict(batch=3, seq=64, layers=6, fsdp=2)
    whole, made = trace(model, **kwargs).graph, three_block_step(model, kwargs)
    a, b = whole.to_dict(), made.to_dict()
    unnamed = lambda nodes: [{k: v for k, v in nd.items() if k != "name"} for nd in nodes]  # noqa: E731
    assert unnamed(a.pop("nodes")) == unnamed(b.pop("nodes"))
    kinds = lambda tensors: {kind: sum(t[1] for t in tensors if t[2] == kind) for _, _, kind in tensors}  # noqa: E731
    assert kinds(a.pop("fixed_tensors")) == kinds(b.pop("fixed_tensors"))  # the copies' parameters: one per block
    assert a == b  # name, fixed_mem, modules, FSDP units, gradients
    assert no_remat_peak(made) == no_remat_peak(whole)
    assert three_block_step(model, dict(kwargs, fsdp=1)) is None  # unsharded: mixed precision differs, traced whole
    assert three_block_step(model, dict(kwargs, compile="model")) is None
    assert three_block_step("gpt", dict(kwargs)) is None


def test_a_method_that_ran_out_of_time_is_not_said_to_have_no_schedule_within_the_limit():
    """A time limit running out says nothing of the GPU's memory: the reason says which it was."""
    from bonsai_core.fit import attempt
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import no_remat_peak

    graph = load_graph("assets/gpt-default.json")
    for space in ("regions", "auto"):
        out = attempt(graph, 1, "bonsai", int(no_remat_peak(graph) * 0.6), 0.1, None,
                      {"time_limit": 1e-6, "space": space})
        assert not out.fits and out.reason == "its time limit ran out before it found a schedule (1e-06 s)"
    for method in ("chen", "dtr", "checkmate"):  # a SolverError or a BudgetError, each says so
        out = attempt(graph, 1, method, int(no_remat_peak(graph) * 0.6), 0.5, None, {"time_limit": 1e-6})
        assert not out.fits and out.reason == "its time limit ran out before it found a schedule (1e-06 s)"
    assert attempt(graph, 1, "bonsai", int(no_remat_peak(graph) * 0.6), 0.2, None, {}).fits  # given the time, it does
