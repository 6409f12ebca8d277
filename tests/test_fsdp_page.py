"""docs/bench/fsdp.md's writer (``bonsai bench fsdp --page``): a row per model, ranks and plan from the stored
bytes; ``--report-only`` writes the page from results.json; a run of other models or options may not
overwrite the page's results. Nothing is measured here (tests/test_fsdp*.py spawn the ranks)."""

from __future__ import annotations

import json

from bonsai_core.bench import fsdp
from bonsai_core.cli import main

MIB = 2**20


def results():
    return {"meta": {"command": "bonsai bench fsdp --page P", "date": "2026-01-01 00:00 UTC", "machine": "2 CPUs",
                     "torch": "2.13.0"},
            "rows": [{"model": "gpt", "ranks": 2, "plan": None, "fixed": 20 * MIB, "predicted": 100 * MIB,
                      "measured": 100 * MIB, "seconds": 11.4},
                     {"model": "gpt", "ranks": 2, "plan": "70%", "fixed": 20 * MIB, "predicted": 80 * MIB,
                      "measured": 79 * MIB, "seconds": 30.6}]}


def test_each_row_says_its_plan_and_error_from_the_stored_bytes():
    page = fsdp.page(results(), "<!-- header -->")
    assert "| gpt | 2 | none | 20.00 MiB | 100.00 MiB | 100.00 MiB | +0.00% | 11 s |\n" in page
    assert page.endswith("| gpt | 2 | 70% | 20.00 MiB | 80.00 MiB | 79.00 MiB | -1.25% | 31 s |\n")


def test_report_only_writes_the_page_from_results_json(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(results()))
    page = tmp_path / "p.md"
    assert main(["bench", "fsdp", "--out", str(tmp_path), "--page", str(page), "--report-only"]) == 0
    assert page.read_text().startswith("<!-- written by: `bonsai bench fsdp --page P`")


def test_other_models_or_options_may_not_overwrite_the_page_s_results(tmp_path, capsys):
    assert main(["bench", "fsdp", "--model", "gpt", "--world", "2"]) == 2
    assert ("a run with --model and --world measures less than the full run and would overwrite the full run's "
            "docs/bench/fsdp/results.json") in capsys.readouterr().out
    assert main(["bench", "fsdp", "--grads", "none", "--report-only", "--out", str(tmp_path),
                 "--page", str(tmp_path / "p.md")]) == 2
    assert "--report-only writes the page of the stored run" in capsys.readouterr().out
