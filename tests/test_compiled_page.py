"""docs/results/compiled.md's writer (``bonsai bench compiled --page``): what its sentences say of made-up
results, ``--report-only`` from a finished run's results.json, refusals before anything is measured."""

from __future__ import annotations

import json

from bonsai_core.bench import compiled
from bonsai_core.cli import main

META = {"command": "bonsai bench compiled --page P", "date": "2026-01-01 00:00 UTC", "machine": "2 CPUs",
        "torch": "2.13.0", "parts": ["cpu", "peers", "titan"], "seconds": 600.0}
GIB = 2**30


def cpu(variant, predicted, measured, **extra):
    return {"model": "gpt", "options": {"layers": 1}, "variant": variant, "predicted": predicted,
            "measured": measured, "fixed": 1000, "seconds": 1.0, **extra}


def parts(saved, transients, reserved, live):
    return {"saved forward tensors": saved * GIB, "backward tensors (transients)": transients * GIB,
            "FSDP buffers": GIB // 2, "live peak": live * GIB, "reserved peak (expandable)": reserved * GIB,
            "allocator's extra": (reserved - live) * GIB, "peak op": "7: _log_softmax_backward_data"}


def results():
    return {"meta": META,
            "cpu": [cpu("none", 500, 500, eager_predicted=520), cpu("budget:0.5", 300, 310),
                    cpu("bonsai", 250, 250, budget=1300, regions=2, overhead=0.1)],
            "peers": [{"model": "gpt", "budget": 0.5, "torch_peak": 1200, "torch_predicted": 1200, "torch_overhead": 0.08,
                       "bonsai_predicted": 1150, "bonsai_overhead": 0.05, "bonsai_peak": 1150},
                      {"model": "gpt", "budget": 0.0, "torch_peak": 900, "torch_predicted": 900, "torch_overhead": 0.3,
                       "bonsai_error": "budget=900 B cannot be met"}],
            "titan": [{"world": 8, "compiled": False, "float8": False, "nodes": 5970, "published_gib": 82.4,
                       "parts": parts(39.5, 15.7, 79.56, 72.5), "seconds": 60.0},
                      {"world": 8, "compiled": True, "float8": False, "nodes": 3052, "published_gib": 77.0,
                       "parts": parts(35.5, 15.7, 75.2, 68.5), "seconds": 20.0}]}


def test_the_page_says_what_the_run_found():
    page = compiled.page(results(), "<!-- header -->")
    assert "Equal to the byte in 2 of 3 rows" in page
    assert "`gpt` layers=1 (budget:0.5): 0.9677" in page
    assert "measured within their budgets in 1 of 1" in page
    assert "below the eager step's prediction on `gpt` layers=1" in page
    assert "costs less than torch's partitioner at the same measured memory in 1 of 1 cells where both ran; " \
           "1 memory levels bonsai could not meet" in page
    assert "8 ranks: compiling lowers the reserved peak by 4.36 GiB (published: 5.4 GiB)" in page
    assert "| 8       | compiled" in page and "-2.3%" in page


def test_report_only_writes_the_page_from_results_json(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results()))
    page = tmp_path / "compiled.md"
    assert main(["bench", "compiled", "--out", str(out), "--page", str(page), "--report-only"]) == 0
    assert page.read_text().startswith("<!-- written by: `bonsai bench compiled --page P`")


def test_report_only_without_results_is_refused_before_measuring(tmp_path, capsys):
    assert main(["bench", "compiled", "--out", str(tmp_path), "--page", str(tmp_path / "p.md"), "--report-only"]) == 2
    assert "results.json is missing" in capsys.readouterr().out


def test_a_plan_the_call_refuses_is_a_result_with_the_smallest_peak_it_names():
    r = results()
    r["cpu"].append({"model": "hf:llama", "options": {}, "variant": "bonsai", "seconds": 1.0,
                     "error": "budget=18.95 MiB (19873375 bytes) cannot be met by checkpointing WithLabels's "
                              "submodules: the smallest peak the checkpoints realise is 21.49 MiB (22535752 bytes)."})
    page = compiled.page(r, "<!-- header -->")
    assert "no plan (the smallest peak its checkpoints reach under compile is 21.49 MiB)" in page
    assert "on `hf:llama` the call raised BudgetError" in page
    assert "Equal to the byte in 2 of 3 rows" in page


def test_float8_rows_say_what_float8_linears_change_on_the_compiled_step():
    r = results()
    r["titan"].append({"world": 8, "compiled": True, "float8": True, "nodes": 7596, "published_gib": 76.8,
                       "parts": parts(35.5, 15.7, 75.92, 68.5), "seconds": 30.0})
    page = compiled.page(r, "<!-- header -->")
    assert "| 8       | compiled, Float8 |" in page and "-1.1%" in page
    assert "with `--float8` too for the Float8 ones" in page
    assert ("Float8 linears change the compiled step's reserved peak by +0.72 GiB (published: -0.2 GiB): the saved "
            "forward tensors at the peak by +0.00 GiB, the backward transients by +0.00 GiB, the allocator's extra "
            "by +0.72 GiB") in page
    assert "Float8 linears change" not in compiled.page(results(), "<!-- header -->")


def test_a_schedules_peak_parts_add_up_to_its_live_peak_and_the_allocators_extra_to_its_reserved_peak():
    from bonsai_core.solvers import solve
    from tests.graphs import fsdp_chain

    graph = fsdp_chain()
    found = compiled.peak_parts(graph, solve(graph, None, "none"))
    held = {k: v for k, v in found.items() if k.startswith("fixed: ") or k in (
        "saved forward tensors", "backward tensors (transients)", "FSDP buffers")}
    saved, transients = found["saved forward tensors"], found["backward tensors (transients)"]
    assert (saved, transients, found["FSDP buffers"]) == (40, 10, 800)  # at b3: f0..f3, b3, both blocks unsharded
    assert sum(held.values()) == found["live peak"]
    assert found["live peak"] + found["allocator's extra"] == found["reserved peak (expandable)"]
    assert found["peak op"] == "4: b3"
