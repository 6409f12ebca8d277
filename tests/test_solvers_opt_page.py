"""docs/results/checkmate_moccasin.md's writer (``bonsai bench solvers-opt --page``): its sentences say what
made-up rows say (the suite itself takes about 40 minutes), ``--report-only`` writes the page from a
finished run's results.json, and bad options are refused before anything is measured."""

from __future__ import annotations

import json

import pytest

from bonsai_core.bench import solvers_opt, solvers_opt as sp
from bonsai_core.cli import main
from tests.pages import compact

GRAPHS = {"gpt-l1": (153, 72, 13722), "gpt-l2": (277, 125, 35000), "resnet": (86, 79, 16476), "unet": (87, 81, 17215)}
RUN = {"command": "bonsai bench solvers-opt --page P", "started": "2026-01-01 00:00 UTC",
       "ended": "2026-01-01 00:40 UTC", "seconds": 2400.0, "machine": "2 CPUs (x86_64), 24 GiB", "load_end": 1.5,
       "torch": "2.x", "versions": {"highspy": "1.0", "pyscipopt": "5.0", "ortools": "9.0", "cvxpy": "1.0"},
       "time_limit": 60.0}
ERRORS = {"infeasible": "BudgetError: no schedule with at most 2 computations per node fits",
          "none": "SolverError: The highs backend stopped with status 'Time limit reached' and no solution within "
                  "the time limit of 60 s.",
          "killed": "killed: no answer within the hard limit of 150 s"}


def row(graph: str, fraction: float, method: str, status: str, overhead: float | None = None, gap: float = 0.0,
        study: str = "main", solve_seconds: float = 1.0, time_limit: float = 60.0, **fields) -> dict:
    """One row as the suite writes it: ``status`` optimal or feasible with ``overhead``, or an error
    (infeasible, none: no solution in the limit, killed)."""
    nodes, model_nodes, variables = GRAPHS[graph]
    out = {"graph": graph, "nodes": nodes, "model_nodes": model_nodes, "edges": nodes + 30, "method": method,
           "budget_share": fraction, "budget": int(fraction * 20_000_000), "no_remat_peak": 20_000_000,
           "peak_lower_bound": 9_000_000, "time_limit": time_limit, "study": study,
           "variables": variables if method.startswith("checkmate") else 6 * model_nodes, "constraints": 2 * variables,
           "build_seconds": 0.01, "wall_seconds": solve_seconds + 0.5}
    if status in ERRORS:
        out.update(status="error", error=ERRORS[status])
    else:
        out.update(status=status, overhead=overhead, gap=gap, solve_seconds=solve_seconds,
                   compute_cost=1.0 + overhead)
    out.update(fields)
    return out


def main_rows() -> list[dict]:
    """The old hand page's outcomes: checkmate optimal only on gpt-l1 at 90% (as moccasin, +1.59%), SCIP
    returning more schedules than HiGHS, moccasin infeasible at 50% on three graphs."""
    outcomes = {  # (graph, share): (highs, scip, moccasin), each (status, overhead, gap)
        ("gpt-l1", 0.9): (("optimal", 0.0159, 0), ("optimal", 0.0159, 0), ("optimal", 0.0159, 0)),
        ("gpt-l1", 0.7): (("none",), ("feasible", 0.2423, 0.73), ("optimal", 0.1021, 0)),
        ("gpt-l1", 0.5): (("none",), ("none",), ("infeasible",)),
        ("gpt-l2", 0.9): (("feasible", 0.3515, 0.97), ("feasible", 0.0801, 1.0), ("optimal", 0.0182, 0)),
        ("gpt-l2", 0.7): (("none",), ("feasible", 0.1497, 1.0), ("feasible", 0.0696, 1.0)),
        ("gpt-l2", 0.5): (("none",), ("feasible", 0.4475, 1.0), ("feasible", 0.1984, 1.0)),
        ("resnet", 0.9): (("feasible", 0.0879, 0.83), ("feasible", 0.0523, 0.63), ("optimal", 0.0494, 0)),
        ("resnet", 0.7): (("none",), ("feasible", 0.1723, 0.54), ("optimal", 0.1026, 0)),
        ("resnet", 0.5): (("none",), ("none",), ("infeasible",)),
        ("unet", 0.9): (("feasible", 0.0401, 0.63), ("feasible", 0.0510, 0.53), ("optimal", 0.0391, 0)),
        ("unet", 0.7): (("none",), ("feasible", 0.1887, 0.54), ("feasible", 0.1499, 0.92)),
        ("unet", 0.5): (("none",), ("none",), ("infeasible",))}
    rows = []
    for (graph, fraction), results in outcomes.items():
        for method, (status, *numbers) in zip(solvers_opt.DEFAULT_METHODS, results):
            seconds = {"optimal": 1.0 + 5 * fraction if method == "moccasin" else 4.5}.get(status, 60.0)
            rows.append(row(graph, fraction, method, status, *numbers, solve_seconds=seconds))
    return rows


def copies_rows() -> list[dict]:
    return [row("gpt-l1", 0.5, "moccasin-c3", "feasible", 0.3774, 0.74, study="copies"),
            row("gpt-l2", 0.5, "moccasin-c3", "feasible", 0.2060, 1.0, study="copies"),
            row("resnet", 0.5, "moccasin-c3", "infeasible", study="copies"),
            row("unet", 0.5, "moccasin-c3", "none", study="copies")]


def warm_row(method: str, limit: float, status: str, overhead: float | None = None, gap: float = 0.5,
             start_overhead: float | None = None, ready: float = 4.0) -> dict:
    """A row of the warm-start study; a warm-started one with a moccasin start of ``start_overhead``
    (the schedule's own overhead when not given)."""
    out = row("gpt-l1", 0.6, method, status, overhead, gap, study="warm-start", solve_seconds=limit, time_limit=limit)
    if method in sp.WARM and status in ("optimal", "feasible"):
        start = overhead if start_overhead is None else start_overhead
        out.update(warm_start=f"moccasin, cost {1 + start:.6g} s (overhead {start:+.2%}), found in {ready:.1f} s",
                   warm_start_cost=1 + start, warm_start_seconds=ready,
                   warm_start_tried={"none": "no schedule within the budget", "chen": "no schedule within the budget",
                                     "moccasin": f"optimal, overhead {start:+.2%}, peak 11.70 MiB",
                                     "bonsai": "skipped: moccasin's proven optimum is no costlier"})
    return out


def warm_rows() -> list[dict]:
    return [warm_row("checkmate-highs", 60, "none"), warm_row("checkmate-scip", 60, "none"),
            warm_row("checkmate-highs-warm", 60, "feasible", 0.1762, 0.5267),
            warm_row("checkmate-scip-warm", 60, "feasible", 0.1762, 0.4486, ready=7.7),
            warm_row("checkmate-highs-warm", 30, "feasible", 0.1886, 0.5613, ready=6.4),
            warm_row("checkmate-highs-warm", 10, "feasible", 0.1907, 0.5663, ready=2.6)]


def write(rows: list[dict]) -> str:
    return compact(sp.page({"rows": rows, "meta": RUN}, "<!-- header -->", "../bench/solvers_opt/results.json"))


def bullets(rows: list[dict]) -> list[str]:
    return write(rows).split("What the numbers say:\n\n")[1].split("\n\n")[0].strip().split("\n")


def test_moccasin_is_called_the_practical_exact_method_where_it_proves_the_most_cells():
    moccasin = bullets(main_rows() + copies_rows())[0]
    assert moccasin.startswith("* **moccasin** (432–750 variables) is the practical exact method here: it proves 6 of "
                               "the 12 graph × budget cells optimal, checkmate 1 on HiGHS and 1 on SCIP. It is optimal "
                               "in 4.5–5.5 s at 90% on all four graphs and at 70% on gpt-l1 and resnet. At the 60 s "
                               "limit it returns a schedule without proving it on gpt-l2 at 70% and 50% and unet at "
                               "70% (gap 92%–100%). With 2 copies per node it proves gpt-l1 at 50%, resnet at 50% and "
                               "unet at 50% infeasible, each in 60 s or less.")
    assert ("At 50%, 3 copies per node find a schedule for gpt-l1 (+37.7%, feasible) and gpt-l2 (+20.6%, feasible), "
            "prove resnet infeasible and find nothing within 60 s on unet: 3 copies make a schedule fit where 2 were "
            "proven infeasible on gpt-l1.") in moccasin


def test_checkmate_optimal_cells_match_moccasin_and_the_backends_are_counted():
    checkmate = bullets(main_rows())[1]
    assert checkmate == ("* **checkmate** (13,722–35,000 variables, 27,444–70,000 constraints) is solved to "
                         "optimality only on gpt-l1 at 90% (HiGHS and SCIP). Where a backend and moccasin are both "
                         "optimal their overheads match (+1.59%), as they should where 2 computations per node "
                         "suffice: with enough copies moccasin's model is checkmate's. Elsewhere it ends with an "
                         "unproven schedule at the limit in 11 runs (costlier than moccasin's in 11, the widest "
                         "difference on gpt-l2 at 90%: HiGHS +35.1% against +1.8%) and with no schedule in 11. SCIP "
                         "returns a schedule in 9 of its 12 runs, HiGHS in 4.")


def test_the_smallest_budget_names_checkmates_only_schedule_and_no_bound():
    smallest = bullets(main_rows())[2]
    assert smallest == ("* At 50% checkmate returns a schedule only for gpt-l2 (SCIP: +44.8%, against moccasin's "
                        "+19.8%), with no bound proven: the open-source backends are far from what Checkmate's Gurobi "
                        "runs needed, which is the segment ILP's reason to exist.")
    rows = main_rows()
    rows[7] = row("gpt-l1", 0.5, "checkmate-scip", "optimal", 0.40)
    assert bullets(rows)[2] == ("* At 50% checkmate returns a schedule only for gpt-l1 (SCIP: +40.0%, where moccasin "
                                "is infeasible) and gpt-l2 (SCIP: +44.8%, against moccasin's +19.8%), the gap 0%–100%.")


def test_sentences_follow_a_run_where_checkmate_finds_nothing_and_moccasin_is_infeasible():
    rows = [row(g, f, m, "infeasible" if m == "moccasin" else "none") for g in ("gpt-l1", "resnet")
            for f in (0.9, 0.5) for m in solvers_opt.DEFAULT_METHODS]
    moccasin, checkmate, smallest = bullets(rows)
    assert moccasin == ("* **moccasin** (432–474 variables): it proves 0 of the 4 graph × budget cells optimal, "
                        "checkmate 0 on HiGHS and 0 on SCIP. With 2 copies per node it proves gpt-l1 at 90% and 50% and "
                        "resnet at 90% and 50% infeasible, each in 1.5 s or less.")
    assert checkmate == ("* **checkmate** (13,722–16,476 variables, 27,444–32,952 constraints) is solved to optimality "
                         "in no cell. It ends with no schedule in 8. HiGHS and SCIP each return a schedule in 0 of "
                         "their 4 runs.")
    assert smallest.startswith("* At 50% checkmate returns no schedule on any graph within 60 s: the open-source")


def test_a_cheaper_checkmate_schedule_and_differing_optima_are_said():
    rows = main_rows()
    rows[0] = row("gpt-l1", 0.9, "checkmate-highs", "optimal", 0.0150)  # below moccasin's optimum with 2 copies
    rows[15] = row("gpt-l2", 0.7, "checkmate-highs", "feasible", 0.05, 0.9)  # below moccasin's +7.0%
    rows[18] = row("resnet", 0.9, "checkmate-highs", "feasible", 0.0494, 0.5)  # moccasin's optimum, not proven
    checkmate = bullets(rows)[1]
    assert "the overheads differ on gpt-l1 at 90% (HiGHS +1.50% against +1.59%)" in checkmate
    assert ("cheaper than moccasin's, or where moccasin has none, in 1: gpt-l2 at 70%, HiGHS +5.0% against +7.0%; "
            "as cheap as moccasin's in 1: resnet at 90%, HiGHS +4.9%) and with no schedule in 10.") in checkmate
    assert "is solved to optimality only on gpt-l1 at 90% (HiGHS and SCIP). Where" in checkmate


def test_the_warm_start_study_says_what_the_start_gives_and_what_the_bound_proves():
    text = write(main_rows() + warm_rows()).split("### Checkmate's warm start on gpt-l1 at 60%")[1]
    assert "| highs |" not in text and "| HiGHS | on | 30 s | 6.4 s: moccasin (optimal), +18.86% | +18.86% | 56.13% |" \
        " feasible | 30 s |" in text
    assert "| SCIP | off | 60 s | off |  |  | no solution in limit | 60 s |" in text
    assert "Without the warm start, no schedule within 60 s on either backend." in text
    assert "With it, every run returns a schedule within the budget, the start ready 2.6–7.7 s into the call " \
           "(from moccasin)." in text
    assert ("Neither backend found a cheaper schedule than its start in any run: the MILP's value here is the proven "
            "bound, which after the full 60 s limit puts the recomputation cost at no less than 47% (HiGHS's "
            "bound) and 55% (SCIP's bound) of the returned schedule's, not a better schedule.") in text
    assert "What the start search found (the HiGHS run at 60 s): `none`: no schedule within the budget;" in text
    assert "The calls overran their limit by at most 0.5 s." in text
    assert ("With a 30 s limit, HiGHS returns in 30 s with a schedule 1.2 points of overhead worse than at 60 s. "
            "With a 10 s limit, HiGHS returns in 10 s with a schedule 1.5 points of overhead worse than at 60 s.") in text


def test_the_warm_start_sentences_follow_an_improvement_and_a_run_without_a_start():
    rows = warm_rows()
    rows[2] = warm_row("checkmate-highs-warm", 60, "feasible", 0.15, 0.3, start_overhead=0.1762)
    rows[5] = warm_row("checkmate-highs-warm", 10, "none")
    rows[1] = warm_row("checkmate-scip", 60, "feasible", 0.3, 1.0)
    rows[4] = warm_row("checkmate-highs-warm", 30, "feasible", 0.15, 0.3, start_overhead=0.16)
    text = write(main_rows() + rows)
    assert "Without the warm start, HiGHS ends no solution in limit and SCIP ends feasible at +30.0% within 60 s." in text
    assert "With it, 3 of the 4 runs return a schedule within the budget" in text
    assert "; no start was found in the runs at 10 s on HiGHS." in text
    assert "The backend improved on its start in the HiGHS run at 60 s (+17.6% to +15.0%)" in text
    assert "With a 10 s limit, HiGHS ends no solution in limit." in text
    assert "With a 30 s limit, HiGHS returns in 30 s with a schedule as cheap as at 60 s." in text
    assert "| HiGHS | on | 10 s | none found |" in text


def test_the_page_quotes_the_run_and_the_graphs():
    text = write(main_rows() + copies_rows() + warm_rows())
    assert "Date: 2026-01-01, 00:00–00:40 UTC (40 minutes)" in text
    assert "load average at the end 1.5. torch" in text and "SCIP (PySCIPOpt) 5.0" in text
    rows = main_rows()
    rows[0]["load"], rows[1]["load"] = 0.8, 4.25
    assert "load average at the end 1.5, 0.8 to 4.2 as the solves ended. torch" in write(rows)
    assert "```\nbonsai bench solvers-opt --page P\n```" in text
    assert "| gpt-l2 | 277 | 125 | 307 | 20,000,000 B | 9,000,000 B |" in text
    assert "at 3 copies per node (`copies=3`) at 50%, where 2 copies were proven infeasible for gpt-l1, resnet and " \
           "unet:" in text.replace("Moccasin with", "at")
    assert "| unet | 87 | 50% | moccasin-c3 | no solution in limit |" in text
    assert "in [../bench/solvers_opt/results.json](../bench/solvers_opt/results.json)." in text


def test_the_main_table_lists_each_cells_methods_together():
    """The suite writes a (graph, method)'s budgets in turn; the table goes graph, budget, method."""
    rows = sorted(main_rows(), key=lambda r: (list(GRAPHS).index(r["graph"]), r["method"], -r["budget_share"]))
    lines = [line for line in write(rows).split("\n") if line.startswith("| gpt-l1 | 153 |") and "%" in line][:4]
    assert [line.split(" | ")[2:4] for line in lines] == [["90%", "checkmate-highs"], ["90%", "checkmate-scip"],
                                                          ["90%", "moccasin"], ["70%", "checkmate-highs"]]


def test_a_killed_child_is_a_row_of_its_own():
    rows = main_rows()
    rows[-1] = {"graph": "unet", "method": "moccasin", "budget_share": 0.5, "time_limit": 60.0, "status": "error",
                "error": ERRORS["killed"], "study": "main"}
    assert "| unet |  | 50% | moccasin | killed |" in write(rows)
    assert bullets(rows)[0].endswith("each in 60 s or less. It finds no schedule within the limit on unet at 50%.")


def saved_run(tmp_path) -> tuple:
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"meta": RUN, "rows": main_rows() + copies_rows() + warm_rows()}))
    return out, tmp_path / "page.md"


def test_report_only_writes_the_page_from_results_json_with_its_header(tmp_path):
    out, page = saved_run(tmp_path)
    assert main(["bench", "solvers-opt", "--out", str(out), "--page", str(page), "--report-only"]) == 0
    text = compact(page.read_text())
    assert text.startswith("<!-- written by: `bonsai bench solvers-opt --page P` at commit ")
    assert "sources bonsai_core/bench/solvers_opt.py,bonsai_core/bench/templates/checkmate_moccasin.md hash" in text.split("\n")[0]
    assert "[run/results.json](run/results.json)" in text and "### Checkmate's warm start on gpt-l1 at 60%" in text


@pytest.mark.parametrize("argv, said", [
    (["--report-only", "--page", "{tmp}/p.md", "--out", "{tmp}/none"], "{tmp}/none/results.json is missing"),
    (["--report-only"], "name it with --page PAGE"),
    (["--page", "{tmp}/missing/p.md"], "does not exist"),
    (["--page", "{tmp}/p.md", "--graphs", "resnet"], "leave out --graphs"),
    (["--page", "{tmp}/p.md", "--budgets", "50", "--methods", "moccasin"], "leave out --methods and --budgets"),
    (["--graphs", "resnet"], "a run without --page measures less than docs/bench/solvers_opt/results.json holds")])
def test_bad_page_options_are_refused_before_measuring(tmp_path, capsys, monkeypatch, argv, said):
    monkeypatch.setattr(solvers_opt, "run_child", lambda *a: pytest.fail("measured"))
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["bench", "solvers-opt", *argv]) == 2
    assert said.format(tmp=tmp_path) in capsys.readouterr().out


def test_the_page_runs_every_study_and_the_options_grid_otherwise():
    args = solvers_opt_args(["--page", "p.md", "--time-limit", "6"])
    runs = solvers_opt.planned_runs(args)
    assert {(s, m) for s, _, m, _, _ in runs} >= {("main", "moccasin"), ("copies", "moccasin-c3"),
                                                  ("warm-start", "checkmate-scip-warm")}
    assert [limit for s, *_, limit in runs if s == "warm-start"] == [6.0, 6.0, 6.0, 6.0, 3.0, 1.0]
    assert len([r for r in runs if r[0] == "main"]) == 12
    plain = solvers_opt.planned_runs(solvers_opt_args(["--graphs", "unet", "--methods", "moccasin"]))
    assert plain == [("main", "unet", "moccasin", [0.9, 0.7, 0.5], 60.0)]


def solvers_opt_args(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    solvers_opt.add_arguments(parser)
    return parser.parse_args(argv)
