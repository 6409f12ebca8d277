"""docs/bench/one_call.md's writer (``bonsai bench one-call --page``): a row per model from its stored
numbers, a refused budget as the call's words; ``--report-only`` writes the page from results.json.
Nothing is measured here."""

from __future__ import annotations

import json

from bonsai_core.bench import one_call
from bonsai_core.cli import main

MIB = 2**20


def results():
    return {"meta": {"command": "bonsai bench one-call --page P", "date": "2026-01-01 00:00 UTC", "machine": "2 CPUs",
                     "torch": "2.13.0", "budget": "70%"},
            "rows": [{"model": "Llama", "regions": 6, "no_remat": 262 * MIB, "measured_no_remat": 262 * MIB,
                      "predicted": 182 * MIB, "measured": 180 * MIB, "error": 180 / 182 - 1, "overhead": 0.037,
                      "same": False, "first": 21.74, "cached": 0.031},
                     {"model": "ViT", "refused": "budget=3.57 MiB cannot be met."}]}


def test_each_model_is_a_row_and_a_refused_budget_is_said():
    page = one_call.page(results(), "<!-- header -->")
    assert "budget='70%')`, then one real step measured" in page
    assert ("| Llama | 6 | 262.00 MiB | 262.00 MiB | 182.00 MiB | 180.00 MiB | -1.10% | +3.7% | NO | 21.7 s | "
            "0.03 s |\n") in page
    assert "| ViT | refused: budget=3.57 MiB cannot be met. | | | | | | | | | |\n" in page


def test_report_only_writes_the_page_from_results_json(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(results()))
    page = tmp_path / "p.md"
    assert main(["bench", "one-call", "--out", str(tmp_path), "--page", str(page), "--report-only"]) == 0
    assert page.read_text().startswith("<!-- written by: `bonsai bench one-call --page P`")
    assert main(["bench", "one-call", "--out", str(tmp_path / "none"), "--page", str(page), "--report-only"]) == 2
    assert "results.json is missing" in capsys.readouterr().out
