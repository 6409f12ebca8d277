"""docs/results/predicted_vs_measured.md's writer (``bonsai bench predicted-vs-measured --page``): a row per
model from its stored bytes, the largest deviation with the CPU's kernels said; ``--report-only`` writes the
page from results.json; a run of some parts may not overwrite the record. Nothing is measured here."""

from __future__ import annotations

import json

from bonsai_core.bench import predicted_vs_measured
from bonsai_core.cli import main

MIB = 2**20


def results():
    return {"meta": {"command": "bonsai bench predicted-vs-measured --page P", "date": "2026-01-01 00:00 UTC",
                     "machine": "2 CPUs", "torch": "2.13.0", "parts": ["zoo", "real", "hf"]},
            "rows": [{"model": "mlp", "ops": 72, "forward": 15, "predicted": 16 * MIB, "predicted_cuda_kernels": 16 * MIB,
                      "measured": 16 * MIB},
                     {"model": "vit dropout=0.1", "ops": 280, "forward": 124, "predicted": 99 * MIB,
                      "predicted_cuda_kernels": 80 * MIB, "measured": 100 * MIB}]}


def test_each_row_and_the_largest_deviation_are_written_from_the_stored_bytes():
    page = predicted_vs_measured.page(results(), "<!-- header -->")
    assert "| mlp | 72 (15 forward) | 16.00 MiB | 16.00 MiB | 1.0000 | 1.0000 |\n" in page
    assert "| vit dropout=0.1 | 280 (124 forward) | 99.00 MiB | 100.00 MiB | 0.9900 | 0.8000 |\n" in page
    assert "the largest deviation here is\n-1.00% (predicted / measured 0.9900)." in page


def test_report_only_writes_the_page_from_results_json(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(results()))
    page = tmp_path / "p.md"
    assert main(["bench", "predicted-vs-measured", "--out", str(tmp_path), "--page", str(page), "--report-only"]) == 0
    assert page.read_text().startswith("<!-- written by: `bonsai bench predicted-vs-measured --page P`")


def test_a_run_of_some_parts_may_not_overwrite_the_record_and_report_only_measures_nothing(tmp_path, capsys):
    assert main(["bench", "predicted-vs-measured", "--zoo"]) == 2
    assert "a run with --zoo measures less than the full run and would overwrite" in capsys.readouterr().out
    assert main(["bench", "predicted-vs-measured", "--hf", "--report-only", "--out", str(tmp_path),
                 "--page", str(tmp_path / "p.md")]) == 2
    assert "--report-only writes the page of the stored run" in capsys.readouterr().out
