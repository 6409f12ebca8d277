"""docs/results/explorer.md's writer (``bonsai bench explorer --page``): its sentences say what made-up
results say, missed targets included; ``--report-only`` writes the page from a finished run's
results.json; bad options, and a machine without Chromium or Playwright, are refused before anything is
measured. No browser runs here (tests/test_browser*.py drive the same harness)."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from bonsai_core.bench import explorer_page
from bonsai_core.cli import main
from explorer import browser
from tests.pages import compact

META = {"command": "bonsai bench explorer --page P", "date": "2026-01-01 00:00 UTC", "machine": "2 CPUs",
        "torch": "2.13.0", "streamlit": "1.67.0", "quick": False, "seconds": 480.0,
        "counts": {"first_paints": 3, "drags": 4, "sessions": 2, "rounds": 2, "revisits": 3},
        "parts": {"yardstick": {"seconds": 1.0, "load_start": 0.4, "load_end": 0.5},
                  "one session at a time": {"seconds": 100.0, "load_start": 0.5, "load_end": 1.3}}}


def sessions(ahead, drawn, server_cpu, in_place=(True, True)):
    return {"solve_ahead": ahead, "drawn": drawn, "answered": [d / 2 for d in drawn], "server_cpu": server_cpu,
            "browser_cpu": 4 * server_cpu, "waited": 3.0, "in_place": list(in_place),
            "load_before": [0.9, 0.5, 0.4], "load_after": [1.6, 0.7, 0.5]}


def depth(d, boxes):
    return {"depth": d, "boxes": boxes, "boxes_s": 0.0004, "layout_s": 0.01, "stats_chart_s": 0.008}


def lifetime(graph, ops, method, threshold=0):
    return {"graph": graph, "ops": ops, "method": method, "steps": 2 * ops, "solve_s": 1.2, "bars": 150,
            "threshold": threshold, "bars_s": 0.0015, "chart_s": 0.007, "step_line_s": 0.00004, "regions": 20,
            "explained": 12, "reasons_s": 2.2}


def results():
    return {
        "meta": copy.deepcopy(META), "yardstick_s": 0.104,
        "traces": [{"graph": "`hf:gpt2`", "ops": 243, "trace_s": 1.0}, {"graph": "32-layer Llama", "ops": 7216,
                                                                         "trace_s": 20.0}],
        "module_graph": [
            {"key": "default", "graph": "default GPT", "ops": 277, "structure_s": 0.015, "default_depth": 2,
             "depths": [depth(2, 23), depth(3, 27)]},
            {"key": "llama", "graph": "32-layer Llama", "ops": 7216, "structure_s": 0.6, "default_depth": 3,
             "depths": [depth(3, 39), depth(4, 199), depth(5, 455)]}],
        "lifetimes": [lifetime("default GPT", 277, "bonsai"), lifetime("60-layer GPT", 7469, "chen", threshold=4096)],
        "browser": {"first_paint_s": [1.1, 1.4, 1.25], "slider_s": [0.2, 0.3, 0.25, 0.9],
                    "memory_first": {"charts_s": 6.0, "scrub_s": 1.7},
                    "memory_again": {"charts_s": 3.3, "scrub_s": 2.1},
                    "graph": {"first_s": 1.8, "again_s": [1.4, 1.5, 1.6]},
                    "gpt2_link": {"link": "memory?model=hf:gpt2&budget=50", "charts_s": 9.5, "scrub_s": 0.2},
                    "llama": {"first_s": 14.0, "again_s": [0.5, 0.7, 0.4], "folds": [[4, 1.4], [5, 2.1], [4, 1.2],
                                                                                       [3, 0.45]]},
                    "large_link": {"link": browser.LARGE_LINK, "charts_s": 50.0, "scrub_s": 0.19}},
        "sessions": [sessions(True, [1.0, 1.5, 1.8, 2.1], 0.2), sessions(False, [2.0, 2.4, 2.6, 2.2], 0.6)]}


def page(r) -> str:
    return compact(explorer_page.page(r, "<!-- header -->"))


def test_slider_and_first_paint_are_judged_against_their_targets():
    r = results()
    text = page(r)
    assert ("**Slider released → memory plot updated: median 0.28 s** over 4 drags (0.20 0.30 0.25 0.90 s), "
            "within the 1 s target.") in text
    assert "**First paint: median 1.25 s** over 3 new sessions (1.10 1.40 1.25 s), within the 3 s target." in text
    r["browser"]["slider_s"] = [1.3, 1.1, 1.2]
    r["browser"]["first_paint_s"] = [3.5]
    text = page(r)
    assert "median 1.20 s** over 3 drags (1.30 1.10 1.20 s), over the 1 s target by 0.20 s." in text
    assert "median 3.50 s** over 1 new sessions (3.50 s), over the 3 s target by 0.50 s." in text


def sessions_findings(r) -> list[str]:
    """The sessions section's findings, the page's bullets between its table and the next section."""
    section = explorer_page.page(r, "<!-- header -->").split("## Many sessions dragging at once")[1]
    return [line[2:] for line in section.split("## Module graph")[0].splitlines() if line.startswith("* ")]


def test_the_sessions_findings_say_each_mode_s_target_and_what_solving_ahead_saved():
    said = sessions_findings(results())
    assert said == [
        "Solving ahead on: plot updated in a median of 1.65 s, within the 2 s target.",
        "Solving ahead off: plot updated in a median of 2.30 s, over the 2 s target by 0.30 s.",
        "Solving ahead cut the server's CPU per drag from 0.150 to 0.050 s (-66.7%).",
        "Over both runs the tabs' Chromium processes used 4.0 times the server's CPU.",
        "Every session's memory chart was updated in place (the same chart element after all its drags)."]


def test_solving_ahead_that_saved_nothing_and_a_chart_mounted_anew_are_said_so():
    r = results()
    r["sessions"] = [sessions(True, [1.0, 1.2], 0.4, in_place=(True, False)), sessions(False, [1.0, 1.2], 0.3)]
    said = sessions_findings(r)
    assert "Solving ahead did not cut the server's CPU per drag: 0.200 s with it, 0.150 s without." in said
    assert said[-1] == "Some session's memory chart was mounted anew instead of updated in place."


def test_the_sessions_table_has_a_row_per_mode():
    text = page(results())
    assert "## Many sessions dragging at once\n\nA fresh server, one headless Chromium with 2 contexts" in text
    assert "2 rounds in which all drag" in text and "4 different budgets between 66% and 70%" in text
    assert ("| on | 1.65 s / 1.80 s / 2.10 s | 0.82 s / 0.90 s / 1.05 s | 0.050 s | 0.20 s | 3.0 s | "
            "0.90 → 1.60 |") in text


def test_the_module_graph_section_judges_the_llama_s_median():
    text = page(results())
    assert ("| the same, 32-layer Llama (7,216 ops) uploaded as JSON at 90%, folded to depth 3 (39 boxes) | "
            "**median 0.50 s** (0.50 0.70 0.40 s); the first visit 14.00 s (the plan solved) |") in text
    assert "to 4 (199 boxes) 1.40 s, to 5 (455 boxes) 2.10 s, to 4 (199 boxes) 1.20 s, to 3 (39 boxes) 0.45 s" in text
    assert "draws in a median of 0.50 s: within the 2 s target" in text
    assert "depth 3 (39 boxes): 0.40 ms / 10.0 ms / 8.0 ms" in text
    r = results()
    r["browser"]["llama"]["again_s"] = [2.5, 2.2, 3.0]
    assert "draws in a median of 2.50 s: over the 2 s target by 0.50 s" in page(r)


def test_a_quick_run_without_the_large_graphs_leaves_their_rows_out():
    r = results()
    r["meta"]["quick"] = True
    r["module_graph"] = r["module_graph"][:1]
    r["lifetimes"] = r["lifetimes"][:1]
    r["traces"] = r["traces"][:1]
    del r["browser"]["llama"], r["browser"]["large_link"]
    text = explorer_page.page(r, "<!-- header -->")
    assert "(`--quick`: small counts, no large graphs; a smoke test, not the record)" in text
    assert "32-layer Llama" not in text and "The Llama is" not in text and "layers:60" not in text and "60-layer" not in text


def test_the_intro_names_the_machine_its_load_and_yardstick():
    text = page(results())
    assert "on 2026-01-01 00:00 UTC, 2 CPUs; torch 2.13.0, Streamlit 1.67.0" in text
    assert "8.0 min in all, the 1-minute load average between 0.40 and 1.60 during the run" in text
    assert "yardstick" in text and "0.104 s" in text


def test_the_lifetimes_section_names_grouped_tensors_and_the_links():
    text = page(results())
    assert ("| 60-layer GPT (7,469 ops, 14,938 schedule steps), chen at 50% | bars 1.5 ms (150 bars, tensors under "
            "4.00 KiB grouped per module), chart rows and spec 7.0 ms, step line 0.04 ms, reasons of 12 of 20 regions "
            "2.20 s") in text
    assert f"| `{browser.LARGE_LINK}` in a new session: trace, solve, both charts | 50.00 s;" in text
    # the link the run opened, not the one the harness opens today
    assert "| `memory?model=hf:gpt2&budget=50` in a new session: trace, solve, both charts | 9.50 s;" in text
    assert "| 10 arrow-key steps of the scrubber until the step line changed | 1.70 2.10 s" in text


def test_report_only_writes_the_page_from_the_run_s_results(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(results()))
    page = tmp_path / "explorer.md"
    assert main(["bench", "explorer", "--out", str(tmp_path), "--page", str(page), "--report-only"]) == 0
    text = page.read_text()
    assert text.startswith("<!-- written by: `bonsai bench explorer --page P` at commit ")
    assert ("sources bonsai_core/bench/explorer_page.py,explorer/browser.py,bonsai_core/bench/templates/explorer.md "
            "hash ") in text.split("\n")[0]
    assert "## Tensor lifetimes and the step scrubber" in text and "nan" not in text


@pytest.mark.parametrize("argv, said", [
    (["--out", "{tmp}", "--report-only"], "name it with --page PAGE"),
    (["--out", "{tmp}", "--report-only", "--page", "{tmp}/p.md"], "results.json is missing"),
    (["--out", "{tmp}", "--report-only", "--quick", "--page", "{tmp}/p.md"], "measures nothing: leave out --quick"),
    (["--quick", "--page", "{tmp}/p.md"], "would overwrite the full run's docs/bench/explorer/results.json"),
    (["--out", "{tmp}", "--quick", "--page", "docs/results/explorer.md"], "not the record"),
    (["--out", "{tmp}", "--page", "{tmp}/missing/p.md"], "does not exist")])
def test_bad_options_are_refused_before_measuring(tmp_path, capsys, argv, said):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", "explorer", *argv]) == 2
    assert said in capsys.readouterr().out


def test_without_chromium_or_playwright_the_suite_says_so_and_measures_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(browser, "CHROMIUM", str(tmp_path / "no-chromium"))
    assert main(["bench", "explorer", "--out", str(tmp_path), "--page", str(tmp_path / "p.md")]) == 2
    out = capsys.readouterr().out
    assert "cannot drive the explorer in a browser: Debian's chromium is not installed at" in out
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "playwright" else find_spec(name, *a))
    assert main(["bench", "explorer", "--out", str(tmp_path)]) == 2
    assert "Playwright for Python is not installed" in capsys.readouterr().out
    assert not (tmp_path / "results.json").exists()


def titan(done=True, after=(0.4, 0.6, 1.4)):
    return {"ops": 5970, "trace_s": 30.0,
            "browser": {"upload_s": 12.0, "first_plan_s": 25.0, "rebuilds": 66, "patterns": 7, "legend": 9,
                        "read_at": 60, "first_plan_error": None,
                        "during": {"pct": 45, "seconds": 1.2, "stand_in": True, "sweep": "Swept 7 of 96 budgets in 30 s"},
                        "sweep": {"said": f"Swept {96 if done else 40} of 96 budgets in 290 s"
                                          + (" (done: each answers at once)" if done else ""),
                                  "done": done, "waited_s": 260.0},
                        "after": [[90, after[0], False], [75, after[1], False], [95, after[2], False]]},
            "fit": {"seconds": 95.0, "answers": [[2, "none", False, 1.0], [2, "bonsai", True, 13.0]],
                    "traces": {"4": 30.0, "1": 31.0}, "table": "| method | largest batch |", "limit": 80 * 2**30}}


def titan_said(r) -> str:
    """The 8B section's words and table, its cells' padding taken out."""
    return " ".join(explorer_page.page(r, "<!-- header -->").split("## The 8B step")[1].split())


def test_the_8b_section_judges_the_sweep_the_drags_after_it_and_what_fits():
    r = results()
    r["titan"] = titan()
    text = titan_said(r)
    assert ("| the slider swept in the background | 96 of 96 positions in 290 s, over the 60 s target by 230.00 s; "
            'the charts beside the plans (allocator replays, bonsai\'s reach) prepared by a child process at the '
            'lowest priority, the sidebar\'s "done" 260 s after the drag above |') in text
    assert ("| drags after the sweep | 90% 0.40 s, 75% 0.60 s, 95% 1.40 s: median 0.60 s, the slowest 1.40 s, over "
            "the 1 s target by 0.40 s |") in text
    assert "| a drag to 45% while the sweep runs (Swept 7 of 96 budgets in 30 s) | 1.20 s, the nearest solved plan" in text
    assert "| the plan at 60% as the page reads it (after the sweep) | 66 rebuilds in 7 patterns" in text
    assert "legend 9 entries" in text and "its plan and charts" in text
    assert "95.00 s, over the 60 s target by 35.00 s; 2 answers, the last after 13.00 s; traced batch 4 30.00 s" in text
    r["titan"] = titan(done=False)
    r["titan"]["browser"]["first_plan_error"] = ("error\n\nbonsai: bonsai found no checkpoint plan before the time "
                                                 "limit.\n\nRaise the budget.")
    text = titan_said(r)
    assert 'no plan, the page said "bonsai: bonsai found no checkpoint plan before the time limit."' in text
    assert "40 of 96 positions in 290 s when the run stopped waiting (260 s), not done |" in text
    del r["titan"]
    assert "Not measured in this run" in titan_said(r)
    page = explorer_page.page(results(), "<!-- header -->")
    assert "## The 8B step" in page and "`bonsai trace torchtitan:llama3:8B --batch 2 --seq 8192 --fsdp 8`" in page


def titan_alone(minutes=50.0):
    """The 8B step as measured by ``--parts titan``: its own run."""
    run = {"command": "bonsai bench explorer --parts titan --page P", "date": "2026-02-02 00:00 UTC",
           "machine": "2 CPUs", "torch": "2.13.0", "streamlit": "1.67.0", "seconds": 60 * minutes, "alone": True,
           "parts": {"tracing the 8B step": {"seconds": 30.0, "load_start": 2.5, "load_end": 3.0},
                     "What fits on the 8B step": {"seconds": 95.0, "load_start": 3.0, "load_end": 7.25}}}
    return {**titan(), "run": run}


def test_the_8b_step_rerun_alone_is_merged_into_the_stored_run(tmp_path, monkeypatch):
    stored = results()
    stored["meta"]["parts"]["What fits on the 8B step"] = {"seconds": 80.0, "load_start": 9.0, "load_end": 12.0}
    stored["titan"] = titan(done=False)
    (tmp_path / "results.json").write_text(json.dumps(stored))
    monkeypatch.setattr(explorer_page, "measure_titan", lambda drags: titan_alone())
    monkeypatch.setattr(explorer_page, "measure_main", lambda quick: pytest.fail("the main part ran"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # torchtitan "installed"
    merged = explorer_page.measure(False, ["titan"], str(tmp_path))
    assert merged["titan"]["browser"]["sweep"]["done"] and merged["titan"]["run"]["alone"]
    assert merged["lifetimes"] == stored["lifetimes"] and merged["sessions"] == stored["sessions"]
    # the stored run's own 8B parts no longer count in its minutes and loads
    assert "What fits on the 8B step" not in merged["meta"]["parts"] and merged["meta"]["seconds"] == 400.0
    assert max(explorer_page.loads(merged)) == 1.6
    text = titan_said(merged)
    assert ("Measured by a run of its own: `bonsai bench explorer --parts titan --page P` on 2026-02-02 00:00 UTC, 2 CPUs; "
            "50.0 min, the 1-minute load average between 2.50 and 7.25.") in text
    assert "Measured by a run of its own" not in titan_said({**results(), "titan": titan()})


def test_the_main_part_rerun_keeps_the_8b_step_as_a_run_of_its_own(tmp_path, monkeypatch):
    stored = results()
    stored["meta"]["parts"]["tracing the 8B step"] = {"seconds": 30.0, "load_start": 9.0, "load_end": 12.0}
    stored["titan"] = titan()
    (tmp_path / "results.json").write_text(json.dumps(stored))
    fresh = results()
    fresh["meta"]["date"] = "2026-03-03 00:00 UTC"
    monkeypatch.setattr(explorer_page, "measure_main", lambda quick: copy.deepcopy(fresh))
    merged = explorer_page.measure(False, ["main"], str(tmp_path))
    assert merged["meta"]["date"] == "2026-03-03 00:00 UTC" and merged["titan"]["browser"] == stored["titan"]["browser"]
    assert "on 2026-01-01 00:00 UTC, 2 CPUs; 0.5 min, the 1-minute load average between 9.00 and 12.00." in titan_said(merged)


@pytest.mark.parametrize("argv, said", [
    (["--out", "{tmp}", "--parts", "titan", "--page", "{tmp}/p.md"], "results.json, which is missing: run them first"),
    (["--out", "{tmp}", "--parts", "titan", "--report-only", "--page", "{tmp}/p.md"], "leave out --parts"),
    (["--out", "{tmp}", "--parts", "titan", "--quick"], "--quick measures no 8B step")])
def test_parts_that_cannot_run_are_refused(tmp_path, capsys, argv, said):
    if "--report-only" in argv:
        (tmp_path / "results.json").write_text(json.dumps(results()))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", "explorer", *argv]) == 2
    assert said in capsys.readouterr().out
