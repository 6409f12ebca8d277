"""docs/results/benchmarks.md's writer (``bonsai bench --page``): its sentences say what made-up results
say (the bench itself takes a quarter of an hour), ``--report-only`` writes the page from a finished run's
results.json, and bad options are refused before anything is measured."""

from __future__ import annotations

import json

import pytest

from bonsai_core.bench import methods as bp
from bonsai_core.bench.methods import COLUMNS, FULL_MODELS, ModelSpec
from bonsai_core.cli import main

GPT = ModelSpec.parse(FULL_MODELS[0]).label
META = {"command": "bonsai bench --page P -o D", "started": "2026-01-01 00:00 UTC", "ended": "2026-01-01 00:15 UTC",
        "seconds": 900.0, "machine": "2 CPUs", "torch": "2.x", "time_limit": 10.0,
        "node_limits": {"checkmate": 160, "moccasin": 700}}


def row(model: str, fraction: float, method: str, overhead: float | None = None, **fields) -> dict:
    """One results.csv row: feasible with ``overhead``, or not (None)."""
    out = dict.fromkeys(COLUMNS)
    out.update(model=model, nodes=525 if model == GPT else 72, method=method, budget_fraction=fraction,
               budget_bytes=int(fraction * 1000), feasible=overhead is not None, overhead=overhead, note="",
               solve_seconds=1.0, status="optimal" if overhead is not None else None, gap=0.0)
    out.update(fields)
    return out


def unknown(model: str, fraction: float, method: str) -> dict:
    return row(model, fraction, method, note=f"CP-SAT found no {method} schedule within 10 s (status UNKNOWN).")


def results() -> list[dict]:
    """The GPT: bonsai cheapest at 90% and 40%, dtr alone at 30%, moccasin never finds one. mlp: moccasin
    0.5 points below bonsai at 90%, checkmate proven and 50x slower at 70%, bonsai out of reach at 50%."""
    return [row(GPT, 0.9, "bonsai", 0.02, gap=0.004), row(GPT, 0.9, "chen", 0.2), unknown(GPT, 0.9, "moccasin"),
            row(GPT, 0.4, "bonsai", 0.24), row(GPT, 0.4, "dtr", 1.68), row(GPT, 0.4, "chen", 0.357),
            unknown(GPT, 0.4, "moccasin"),
            row(GPT, 0.3, "bonsai"), row(GPT, 0.3, "dtr", 8.459), unknown(GPT, 0.3, "moccasin"),
            row("mlp", 0.9, "bonsai", 0.05, variables=10), row("mlp", 0.9, "moccasin", 0.045),
            row("mlp", 0.9, "torch-budget", -0.04, status="measured"),
            row("mlp", 0.7, "bonsai", 0.115, variables=10, solve_seconds=0.1),
            row("mlp", 0.7, "checkmate", 0.115, variables=450, solve_seconds=5.0),
            row("mlp", 0.5, "bonsai"), row("mlp", 0.5, "checkmate", 0.372, gap=0.5, status="feasible"),
            row("mlp", 0.5, "none"), row(GPT, 0.9, "torch-budget", note="could not run: Unsupported"),
            row(GPT, 0.4, "torch-budget", note="could not run: Unsupported"),
            row(GPT, 0.3, "torch-budget", note="could not run: Unsupported")]


def reach() -> list[dict]:
    return [{"model": GPT, "nodes": 525, "no_remat_peak": 1000, "lower_bound": 243, "bonsai": 345,
             "bonsai_status": "optimal", "chen": 386, "dtr": 300, "coop": 400, "seconds": 1.0},
            {"model": "mlp", "nodes": 72, "no_remat_peak": 1000, "lower_bound": 370, "bonsai": 560,
             "bonsai_status": "feasible", "chen": 558, "dtr": 370, "coop": None, "seconds": 1.0}]


def bullets() -> list[str]:
    text = bp.page({"rows": results(), "reach": reach(), "meta": META}, "<!-- header -->", "../bench")
    return text.split("## What it shows\n\n")[1].strip().split("\n")


def test_the_headline_model_says_where_bonsai_is_cheapest_and_who_fits_below_its_reach():
    headline = bullets()[0]
    assert headline.startswith("* **The 4-layer GPT (525 nodes): bonsai is the cheapest method at 90/40%**: "
                               "+2.0% / +24.0% (gap ≤ 0.4%). At 90% only bonsai and chen (+20.0%) fit;")
    assert "at 40% the others cost: chen +35.7% and dtr +168.0%" in headline
    assert "at 30%, below bonsai's reach (34.5%), only dtr (+845.9%) fits." in headline
    assert "Moccasin found no schedule within 10 s at any budget on this graph (CP-SAT status UNKNOWN)." in headline


def test_reach_names_the_unproven_milp_and_the_heuristics_below_bonsai():
    said = bullets()[1]
    assert "the 4-layer GPT 34.5% / 38.6% / 24.3%; mlp 56.0% / 55.8% / 37.0%" in said
    assert "proven within the 10 s on every model but mlp (56.0% found, status feasible)" in said
    # mlp: bonsai's reach is chen's 55.8% (its fallback plans), dtr meets the per-op bound
    assert ("on the 4-layer GPT (dtr 30.0% against 34.5%) and mlp (dtr 37.0%, the per-op bound, against 55.8%).") in said


def test_cells_where_bonsai_is_cheapest_are_counted_and_others_win_where_they_do():
    cells, not_best, solver = bullets()[2:5]
    assert "cheapest feasible method in 3 of the 6 cells where any method fits" in cells
    assert "in no cell does chen or per-block checkpointing" in cells
    assert "mlp: 70% (+11.5%, level with checkmate)" in cells
    assert cells.endswith("PyTorch's budget partitioner could not run on the 4-layer GPT (results.csv says why).")
    assert ("PyTorch's budget partitioner is cheaper by up to 9.00 points on mlp at 90% (-4.00% vs +5.00%; "
            "moccasin's +4.50% also below bonsai)") in not_best
    assert "Below bonsai's reach, others still fit: the 4-layer GPT at 30% (dtr +845.9%); mlp at 50% " \
           "(checkmate +37.2%, gap 50.0%)." in not_best
    assert "costs less than the plain step on mlp at 90% (-4.0%)" in not_best
    assert ("(mlp at 70%), bonsai found the same cost in 1 of the 1 cells, 50× faster with 45× fewer variables; checkmate found a schedule "
            "within 10 s in 2 of the 2 cells it ran") in solver
    assert "moccasin found a schedule within 10 s in 1 of the 4 cells it ran; none at any budget on the 4-layer GPT" in solver


def test_a_chen_plan_cheaper_than_bonsai_is_named_and_the_sentences_follow_the_numbers():
    rows = results()
    rows[1] = row(GPT, 0.9, "chen", 0.01)
    text = bp.page({"rows": rows, "reach": reach(), "meta": META}, "<!-- header -->", "../bench")
    assert "bonsai is the cheapest method at 40%**" in text
    assert "chen or per-block checkpointing (plans in bonsai's space) fits where bonsai does not, or costs less, " \
           "in the 4-layer GPT at 90% (chen +1.0%)" in text
    assert "cheapest feasible method in 2 of the 6 cells" in text


def test_the_lower_bound_per_model_and_budget_with_the_cheapest_and_its_distance():
    rows = [r | {"bound": 0.015 if r["budget_fraction"] == 0.9 else None} for r in results()]
    text = bp.page({"rows": rows, "reach": reach(), "meta": META}, "<!-- header -->", "../bench")
    said = next(b for b in text.split("\n") if b.startswith("* **The lower bound**"))
    assert "90% +1.5% (bonsai +2.0%, 0.49% above)" in said
    assert "90% +1.5% (torch's budget -4.0%" not in said and "+1.5% (moccasin +4.5%, 2.96% above)" in said
    assert "40%" not in said  # no bound recorded there
    assert not any(b.startswith("* **The lower bound**") for b in bullets())  # rows of a run without bounds


def test_report_only_writes_the_page_and_the_tables_from_results_json_with_its_header(tmp_path):
    rows = [r | {"peak": 900 if r["feasible"] else None} for r in results()]  # the plots draw the peaks
    (tmp_path / "results.json").write_text(json.dumps({"meta": META, "rows": rows, "reach": reach()}))
    page = tmp_path / "benchmarks.md"
    assert main(["bench", "-o", str(tmp_path), "--page", str(page), "--report-only"]) == 0
    text = page.read_text()
    assert text.startswith("<!-- written by: `bonsai bench --page P -o D` at commit ")
    assert "Date: 2026-01-01, 00:00–00:15 UTC (15 minutes)" in text and "![overhead vs budget](./overhead_vs_budget.png)" in text
    assert "cheapest feasible method in 3 of the 6 cells" in text
    assert "### mlp" in (tmp_path / "results.md").read_text() and (tmp_path / "reach.csv").is_file()


@pytest.mark.parametrize("argv, said", [
    (["--report-only", "--page", "{tmp}/p.md"], "{tmp}/results.json is missing"),
    (["--report-only"], "name it with --page PAGE"),
    (["--page", "{tmp}/missing/p.md"], "does not exist"),
    (["--quick", "--page", "{tmp}/p.md"], "leave out --quick"),
    (["--models", "mlp", "--budgets", "50", "--page", "{tmp}/p.md"], "leave out --models and --budgets")])
def test_bad_page_options_are_refused_before_measuring(tmp_path, capsys, argv, said):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["bench", "-o", str(tmp_path), *argv]) == 2
    assert said.format(tmp=tmp_path) in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written


def test_the_models_the_page_names_are_the_suites():
    from bonsai_core.bench.methods import MODEL_NAMES

    labels = {ModelSpec.parse(text).label for text in FULL_MODELS}
    assert set(MODEL_NAMES) <= labels | {ModelSpec.parse("gpt:layers=1,seq=64").label}
    assert {ModelSpec.parse(FULL_MODELS[0]).label, ModelSpec.parse(FULL_MODELS[-1]).label} <= set(MODEL_NAMES)
