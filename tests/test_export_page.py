"""docs/results/export.md's writer (``bonsai bench export --page``): its sentences say what made-up results
say, a measurement that misses its prediction included; ``--report-only`` writes the page from a finished
run's results.json; bad options are refused before anything is measured."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bonsai_core.bench import common, export
from bonsai_core.cli import main
from tests.pages import compact

META = {"command": "bonsai bench export --page P", "date": "2026-01-01 00:00 UTC", "machine": "2 CPUs",
        "torch": "2.13.0", "time_limit": 30.0, "quick": False, "seconds": 600.0,
        "study_seconds": {"zoo": 100.0, "methods": 50.0, "verified": 30.0, "attention": 20.0, "backends": 400.0}}


def replay(predicted, measured, original=None, loss=0.0, grad=0.0, problems=(), seconds=(0.01, 0.02)):
    return {"predicted_peak": predicted, "measured_peak": measured, "original_peak": original or predicted,
            "measured_peak_grads_none": measured - 100, "loss_diff": loss, "max_grad_diff": grad,
            "max_grad_diff_grads_none": 0.0, "seconds_original": seconds[0], "seconds_exported": seconds[1],
            "measured_overhead": seconds[1] / seconds[0] - 1, "predicted_overhead": 0.3, "problems": list(problems)}


def zoo_row(model, schedule, level, recomputes, predicted, measured, original, direct=None):
    return {"model": model, "schedule": schedule, "level": level, "nodes": 72, "recomputes": recomputes,
            "autograd": replay(predicted, measured, original),
            "direct": replay(predicted, measured if direct is None else direct, original)}


def checkpoint(plan, realised, measured, original, dropped=1000, left=0, unjudged=None, problems=()):
    return {"plan_peak": plan, "plan_realised_peak": realised, "measured_peak": measured, "original_peak": original,
            "dropped_bytes": dropped, "unrealised_dropped_bytes": left, "unjudged": unjudged,
            "loss_diff": 0.0, "max_grad_diff": 0.0, "problems": list(problems)}


def backend_row(model, regions, plan, realised, measured, *, recomputes=3, options=None, autocast=None, **ck):
    options = {"batch": 2} if options is None else options
    return {"model": model, "options": options, "autocast": autocast, "regions": regions, "share": 0.5,
            "predicted": plan, "recomputes": recomputes, "replay": replay(plan, plan + 8),
            "checkpoint": checkpoint(plan, realised, measured, ck.pop("original", 2 * plan), **ck)}


def results():
    zoo = [zoo_row("mlp", "none", None, 0, 1000, 1008, 1008),
           zoo_row("mlp", "recompute-before-use", 2, 50, 600, 604, 1008),
           zoo_row("resnet", "none", None, 0, 2000, 2008, 1900),
           zoo_row("resnet", "recompute-before-use", 2, 40, 1950, 1958, 1900)]
    methods = [{"model": "gpt", "options": {"batch": 2}, "method": "bonsai", "budget": 900, "recomputes": 4,
                "replay": replay(880, 888)},
               {"model": "gpt", "options": {"batch": 2}, "method": "dtr", "budget": 900,
                "error": "BudgetError: dtr cannot meet 900 bytes"}]
    verified = [{"model": "tests.export_models:hf_llama", "options": {}, "autocast": None, "schedule": "none",
                 "level": None, "recomputes": 0, "replay": replay(5000, 5008, grad=2.2e-8)},
                {"model": "gpt", "options": {"batch": 2}, "autocast": "bf16", "schedule": "recompute-before-use",
                 "level": 2, "recomputes": 56, "replay": replay(4000, 4600, problems=["the measured peak is +15.0% "
                                                                                      "above the prediction"])}]
    attention = [{"model": "hf:gpt2", "dtype": d, "attention": a, "nodes": 300, "no_remat_peak": mib * 2**20}
                 for d, a, mib in [("fp32", "eager", 200), ("fp32", "sdpa", 100), ("bf16", "eager", 120),
                                   ("bf16", "sdpa", 50)]]
    backends = [backend_row("gpt", "any", 1000, 1050, 1060),
                backend_row("gpt", "modules", 1000, 1002, 1001),
                backend_row("tests.export_models:unused_param", "any", 1000, 1000, 1172, recomputes=0, original=1172),
                backend_row("hf:gpt2", "any", 2000, 2100, 2500, unjudged="SDPA dropout on the CPU"),
                backend_row("mlp", "any", 500, 700, 701, dropped=300, left=300),
                {"model": "mlp", "options": {"batch": 2}, "autocast": None, "regions": "modules", "no_plan": True}]
    return {"meta": META, "zoo": zoo, "methods": methods, "verified": verified, "attention": attention,
            "backends": backends}


def said(macro: str, *args) -> str:
    """One of the sentences of templates/export_said.md, said of ``args`` with the values export.page gives it."""
    module = common._jinja().get_template("export_said.md").make_module(
        {"near": export.NEAR, "met_split": export.met_split, "differing": export.differing,
         "byte_range": export.byte_range})
    return str(getattr(module, macro)(*args))


def test_met_sentence_names_the_rows_that_miss_their_prediction():
    rows = [("a", 1008, 1000), ("b", 1004, 1000), ("c", 1200, 1000)]
    assert said("met", rows[:2], "The step") == (
        "The step meets its prediction in every row: measured − predicted is +4 to +8 B.")
    assert said("met", rows, "The step") == (
        "The step meets its prediction within 64 bytes in 2 of 3 rows (+4 to +8 B); it misses in c (+200 B, +20.00%).")
    assert said("met", rows[2:], "The step") == (
        "The step misses its prediction by more than 64 bytes in every row: c (+200 B, +20.00%).")


def test_exact_sentence_lists_the_rows_whose_loss_or_gradients_differ():
    assert said("exact", [("a", 0.0, 0.0, 0.0), ("b", 0.0, 0.0, 0.0)], "X") == (
        "X: loss and gradients bitwise equal to the original's in every row.")
    assert said("exact", [("a", 0.0, 0.0, 0.0), ("b", 0.0, 2.24e-8, 0.0), ("c", 0.0, 0.5, 0.012)], "X") == (
        "X: loss and gradients bitwise equal to the original's in 1 of 3 rows; they differ in b (loss 0, "
        "gradients 2.2e-08) and c (loss 0, gradients 0.5, 0.012 of the tensor's largest magnitude).")


def page_with(**studies: list) -> str:
    """The page of :func:`results` with ``studies`` in place of its own."""
    return compact(export.page({**results(), **studies}, "<!-- header -->"))


def test_the_zoo_findings_compare_each_step_with_its_prediction_and_the_original():
    text = page_with()
    assert "meets its prediction in every row: measured − predicted is +4 to +8 B." in text
    assert "tiny tensors the graph does not hold" in text
    assert "Both gradient modes measure the same peak in every row." in text
    assert ("The original eager step measures the plain schedule's prediction within 64 bytes on mlp and measures "
            "less than the plain schedule predicts on resnet") in text
    assert ("A schedule that recomputes measures at or above the original model on resnet recompute-before-use L2."
            in text)


def test_the_zoo_findings_name_a_missed_prediction_and_a_gradient_mode_that_differs():
    zoo = results()["zoo"]
    zoo[1] = zoo_row("mlp", "recompute-before-use", 2, 50, 600, 900, 1008, direct=904)
    text = page_with(zoo=zoo)
    assert ("it misses in mlp recompute-before-use L2 (+300 B, +50.00%) and mlp recompute-before-use L2 (grads direct) "
            "(+304 B, +50.67%)") in text
    assert "tiny tensors" not in text
    assert "The gradient modes measure different peaks in mlp recompute-before-use L2 (900 vs 904 B)." in text


def test_the_page_says_what_the_run_measured_in_every_study():
    text = compact(export.page(results(), "<!-- header -->"))
    assert text.startswith("<!-- header -->\n\n# Export: measurements\n\n`bonsai bench export --page P`")
    assert "600 s in all (zoo 100 s, methods 50 s, verified 30 s, attention 20 s, backends 400 s)" in text
    assert "No schedule within the budget: gpt (dtr)." in text
    # verify's full report: the bf16 row misses its prediction and verify says so
    assert "it misses in gpt autocast bf16 recompute-before-use (+600 B, +15.00%)" in text
    assert "they differ in export_models:hf_llama fp32 none (loss 0, gradients 2.2e-08)" in text
    assert ("`bonsai verify` reports a problem with these exports in 1 of 2 rows: gpt autocast bf16 "
            "recompute-before-use: the measured peak is +15.0% above the prediction.") in text
    assert "| `hf:gpt2` | 200.00 | 100.00 (-50.0%) | 120.00 | 50.00 (-58.3%) |" in text
    assert "bf16 against fp32: -40.0% on `hf:gpt2` on eager attention, -50.0% on `hf:gpt2` on SDPA." in text
    assert "nan" not in text and "None" not in text.replace("`.grad` None", "").replace("grads None", "")


def test_the_back_ends_findings_are_computed_from_the_rows():
    text = page_with()
    assert "The replay back-end meets its prediction in every row: measured − predicted is +8 B." in text
    assert "With `regions=modules` the checkpoints run the plan (realised within 1% of it) in its one row." in text
    assert "With `regions=any` the checkpoints run the plan (realised within 1% of it) in 1 of 4 rows." in text
    assert ("In the other 3 rows the realised peak departs from the plan by +5.0% to +40.0%: gpt (any +5.0%), "
            "hf:gpt2 (any +5.0%) and mlp (any +40.0%).") in text
    assert ("It is above by more where the plan recomputes nothing, and so is the original step: "
            "export_models:unused_param (any checkpointed +17.2%, original +17.2%)") in text
    assert "without judging it in 1 row (SDPA dropout on the CPU: hf:gpt2 (any))" in text
    assert "math path" in text and "autocast the checkpointed" not in text
    assert ("Every byte the plan drops stays saved (no submodule holds a dropped tensor with its readers, so "
            "nothing is checkpointed) in mlp (any).") in text
    assert "bonsai finds no plan at lb + 50/70/90% for mlp (modules)." in text
    assert "`bonsai verify` finds no problem with either back-end (10 verdicts)." in text


def test_a_checkpoint_peak_far_above_its_simulation_is_said_with_the_eager_autograd_effects():
    rows = [backend_row("tests.export_models:hf_gpt2", "any", 1000, 1000, 1150,
                        problems=["the measured peak is +15.0% off the prediction"])]
    text = page_with(backends=rows)
    assert "It is above by more in export_models:hf_gpt2 (any +15.0%). Eager autograd holds some tensors" in text
    assert ("`bonsai verify` reports a problem with either back-end in 1 of 2 verdicts: export_models:hf_gpt2 any "
            "(checkpoint): the measured peak is +15.0% off the prediction.") in text


def test_report_only_writes_the_page_from_the_run_s_results(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(results()))
    page = tmp_path / "export.md"
    assert main(["bench", "export", "--out", str(tmp_path), "--page", str(page), "--report-only"]) == 0
    text = compact(page.read_text())
    assert text.startswith("<!-- written by: `bonsai bench export --page P` at commit ")
    assert ("| `gpt` | fp32 | any | lb + 50% | 1,000 | 1,008 (+8 B) | 1,050 | 1,060 (+6.0%) | 2,000 | 0 of 1,000 "
            "| OK / OK |") in text
    assert "| `mlp` | fp32 | modules | no plan at lb + 50/70/90% |" in text


@pytest.mark.parametrize("argv, said", [
    (["--report-only"], "name it with --page PAGE"),
    (["--report-only", "--page", "{tmp}/p.md"], "results.json is missing"),
    (["--report-only", "--quick", "--page", "{tmp}/p.md"], "measures nothing: leave out --quick"),
    (["--page", "{tmp}/missing/p.md"], "does not exist"),
    (["--time-limit", "0"], "a positive number of seconds"),
    (["--quick", "--out", "docs/bench/export"], "would overwrite the full run's"),
    (["--quick", "--page", "docs/results/export.md"], "not the record docs/results/export.md")])
def test_bad_options_are_refused_before_measuring(tmp_path, capsys, monkeypatch, argv, said):
    monkeypatch.setattr(export, "measure", lambda *a: pytest.fail("measured despite bad options"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path)]
    assert main(["bench", "export", *out, *argv]) == 2
    assert said in capsys.readouterr().out


def test_a_solver_refusal_is_a_row_of_the_page_not_the_end_of_the_run(monkeypatch):
    from bonsai_core.errors import SolverError

    def first_plan(graph, regions, time_limit):  # no budget met with any regions; no module calls to plan with
        if regions == "modules":
            raise SolverError("regions 'modules': the graph records no module calls")
        return None

    traced = SimpleNamespace(graph=None)
    monkeypatch.setattr("bonsai_core.trace.trace_model", lambda model, autocast=None, **options: traced)
    monkeypatch.setattr(export, "first_plan", first_plan)
    rows = export.backend_rows([("tests.real_models:vit_assert", {"batch": 2}, None)], 30.0)
    assert [r.get("error") for r in rows] == [None, "solve: SolverError: regions 'modules': the graph records no "
                                                    "module calls"]
    assert rows[0]["no_plan"] is True
    text = page_with(backends=rows)
    assert "| `real_models:vit_assert` | fp32 | modules | solve: SolverError |" in text
    assert "Refused or failed: real_models:vit_assert modules: solve: SolverError: regions 'modules'" in text
