"""docs/results/offload.md's writer (``bonsai bench offload --page``): its sentences say what made-up
results say, ``--report-only`` writes the page from a finished run's results.json, bad options are
refused before anything is measured."""

from __future__ import annotations

import json

import pytest

from bonsai_core.bench import offload
from bonsai_core.cli import main
from tests.pages import compact

META = {"command": "bonsai bench offload --page P", "date": "2026-01-01 00:00 UTC", "machine": "2 CPUs",
        "torch": "2.13.0", "time_limit": 120.0, "seconds": 20.0}
PEAK = 1000


def row(share, method, offload_, overhead=None, stall=0.0, offloaded=0):
    r = {"share": share, "method": method, "offload": offload_, "seconds": 0.1}
    if overhead is None:
        r["error"] = "BudgetError"
    else:
        r.update(overhead=overhead, peak=int(share * PEAK), offloaded_bytes=offloaded, stall=stall)
    return r


def results(export=None):
    rows = [row(0.8, "bonsai", False, 0.036), row(0.8, "bonsai", True, 0.028, offloaded=10),
            row(0.5, "bonsai", False, 0.233), row(0.5, "bonsai", True, 0.201, offloaded=20),
            row(0.45, "bonsai", False), row(0.45, "bonsai", True),
            row(0.8, "dtr", False, 0.1), row(0.8, "dtr", True, 0.1),
            row(0.5, "dtr", False), row(0.5, "dtr", True, 1.5, stall=2e-4, offloaded=30),
            row(0.45, "dtr", False), row(0.45, "dtr", True),
            row(0.8, "coop", False, 0.07), row(0.8, "coop", True, 0.2, stall=3e-4, offloaded=5),
            row(0.5, "coop", False, 0.9), row(0.5, "coop", True),
            row(0.45, "coop", False), row(0.45, "coop", True)]
    export = export or {"offloaded_tensors": 3, "offloaded_bytes": 1572864, "overhead": 0.118, "stall": 0.0,
                        "host_peak": 1572864, "loss_diff": 0.0, "max_grad_diff": 0.0, "predicted_peak": 19641344,
                        "measured_peak": 19641352, "measured_host_peak": 1572864}
    return {"meta": META, "graph": {"name": "gpt", "nodes": 277, "no_remat_peak": PEAK}, "rows": rows,
            "export": export}


def method_sentence(results: dict, method: str) -> str:
    """``method``'s bullet of the page written from ``results``."""
    page = offload.page(results, "<!-- header -->")
    return next(line for line in page.splitlines() if line.startswith(f"* **{method}**")).removeprefix("* ")


def test_each_method_s_sentence_says_what_offload_did_to_it():
    r = results()
    assert method_sentence(r, "bonsai") == (
        "**bonsai** with offload: the overhead falls at 80% and 50% (by 0.8–3.2 points) and its copies never "
        "stall compute.")
    assert method_sentence(r, "dtr") == (
        "**dtr** with offload: the overhead is the same at 80%, it meets 50% only with offload and its copies "
        "stall compute by up to 0.200 ms.")
    assert method_sentence(r, "coop") == (
        "**coop** with offload: the overhead rises at 80% (by 13.0 points), it meets 50% only without offload "
        "and its copies stall compute by up to 0.300 ms.")


def test_a_method_that_meets_no_budget_or_never_offloads_is_said_so():
    r = results()
    r["rows"] = [x for x in r["rows"] if x["method"] != "coop"] + [row(0.5, "coop", o) for o in (False, True)]
    assert method_sentence(r, "coop") == "**coop** meets none of the budgets, with or without offload."
    r["rows"] = [row(0.8, "dtr", False, 0.1), row(0.8, "dtr", True, 0.1)]
    assert method_sentence(r, "dtr") == (
        "**dtr** with offload: the overhead is the same at 80% and none of its plans offloads.")


def test_the_export_section_says_how_far_the_measurement_is_from_the_prediction():
    text = compact(offload.page(results(), "<!-- header -->"))
    assert "measured device peak is 19,641,352 B against 19,641,344 B predicted (+8 B)" in text
    assert "the simulator's `host_peak` to the byte" in text and "equal eager’s exactly" in text
    off = results({**results()["export"], "measured_host_peak": 1000, "loss_diff": 1e-7})
    text = compact(offload.page(off, "<!-- header -->"))
    assert "peak at 1,000 B, against the simulator's `host_peak` of 1,572,864 B" in text
    assert "differ from eager’s" in text
    assert text.startswith("<!-- header -->\n\n# Keep, recompute or offload") and "nan" not in text


def test_report_only_writes_the_page_from_the_run_s_results(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(results()))
    page = tmp_path / "offload.md"
    assert main(["bench", "offload", "--out", str(tmp_path), "--page", str(page), "--report-only"]) == 0
    text = compact(page.read_text())
    assert text.startswith("<!-- written by: `bonsai bench offload --page P` at commit ")
    assert "| 50% | dtr | True | +150.0% | 50.0% |" in text


@pytest.mark.parametrize("argv, said", [
    (["--report-only"], "name it with --page PAGE"),
    (["--report-only", "--page", "{tmp}/p.md"], "results.json is missing"),
    (["--page", "{tmp}/missing/p.md"], "does not exist")])
def test_bad_options_are_refused_before_measuring(tmp_path, capsys, argv, said):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", "offload", "--out", str(tmp_path), *argv]) == 2
    assert said in capsys.readouterr().out
