"""Exported steps against their predictions, both back-ends: the zoo under tests/test_export.py's schedules,
every solver's schedule, verify's full report on real models, SDPA and bf16 no-remat peaks, and the replay
and checkpoint back-ends side by side. ``--page`` writes docs/results/export.md from this run's results.json
(``--report-only``: from the stored one); ``--quick``, one model per study, is a smoke test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial
from typing import Any, Sequence

from bonsai_core.bench import common
from bonsai_core.errors import BonsaiError, BudgetError
from bonsai_core.schedule import no_remat_peak, none_schedule, simulate
from bonsai_core.solvers import solve

# the files that decide what the page says (tests/test_docs.py checks their hash against the page's)
SOURCES = ["bonsai_core/bench/export.py", "tests/export_models.py", "tests/real_models.py",
           common.template_source("export"), common.template_source("export_said")]
DEFAULT_OUT = "docs/bench/export"
RECORD_PAGE = "docs/results/export.md"

ZOO = ("mlp", "vgg", "resnet", "unet", "gpt")
# tests/test_export.py's schedule factories at the level each runs (none: no recomputation)
ZOO_SCHEDULES = (("none", None), ("checkpoint-every-other", 1), ("recompute-before-use", 2))
METHODS = ("bonsai", "chen", "dtr", "coop", "moccasin")
METHOD_SHARE = 0.5  # of the headroom from the graph's peak lower bound to its no-remat peak
TIMING_REPEATS = 3
TEXT = {"batch": 2, "seq": 16, "width": 32, "layers": 2, "heads": 2, "vocab": 64}
IMAGE_TRANSFORMER = {"batch": 2, "image": 16, "width": 32, "layers": 2, "heads": 2}
SMALL_GPT2 = {"batch": 2, "seq": 16, "width": 32, "vocab": 64, "heads": 2}
ATTENTION_MODELS = ("hf:gpt2", "hf:llama")
ATTENTION_SEQ = 512
# verify's full report: (model, options, autocast); None options: tests/test_export.py's small size
VERIFIED = (("tests.export_models:dropout_mlp", {}, None), ("tests.export_models:hf_gpt2", {}, None),
            ("tests.export_models:hf_llama", {}, None), ("gpt", None, "bf16"), ("gpt", None, "fp16"))
# both back-ends besides the zoo at its small sizes: (model, options, autocast)
BACKEND_MODELS = (
    ("tests.export_models:dropout_mlp", {}, None), ("tests.export_models:batchnorm_cnn", {}, None),
    ("tests.export_models:unused_param", {}, None), ("tests.export_models:hf_gpt2", {}, None),
    ("tests.export_models:hf_llama", {}, None),
    ("hf:gpt2", TEXT, None), ("hf:gpt2", {**TEXT, "attention": "eager"}, None), ("hf:bert", TEXT, None),
    ("hf:llama", TEXT, None), ("hf:vit", IMAGE_TRANSFORMER, None),
    ("hf:resnet", {"batch": 4, "image": 32, "width": 8, "layers": 2}, None),
    ("tests.real_models:vit_assert", IMAGE_TRANSFORMER, None), ("tests.real_models:gpt2", SMALL_GPT2, None),
    ("tests.real_models:bert_mlm", SMALL_GPT2, None),
    ("tests.real_models:resnet18_bn", {"batch": 2, "image": 32, "width": 8}, None),
    ("tests.real_models:mobilenet_v3_small", {"batch": 2, "image": 32}, None),
    ("hf:gpt2", {**TEXT, "dtype": "bf16"}, None), ("hf:gpt2", TEXT, "bf16"),
    ("hf:llama", {**TEXT, "dtype": "bf16"}, None), ("hf:llama", TEXT, "bf16"))
BACKEND_SHARES = (0.5, 0.7, 0.9)  # bonsai at the first of these (of the headroom above lb) that it meets
REGIONS = ("any", "modules")
NEAR = 64  # bytes: a measured peak this close to its prediction meets it (the tracker sees a few tiny tensors more)
REALISED = 0.01  # the checkpoint back-end runs the plan when its realised peak is this close (verify's rule)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common.add_page_arguments(ap, DEFAULT_OUT, RECORD_PAGE, quick="one model per study")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve (default %(default)s)")


# -- measuring ------------------------------------------------------------------------------------

def export_tests() -> Any:
    """tests/test_export.py: its schedule factories and small sizes."""
    common.import_test_models()
    import tests.test_export

    return tests.test_export


def headroom_budget(graph: Any, share: float) -> int:
    """The graph's peak lower bound plus ``share`` of the headroom up to its no-remat peak."""
    lb = graph.peak_lower_bound
    return int(lb + share * (no_remat_peak(graph) - lb))


def report(v: Any) -> dict[str, Any]:
    """verify's report and its verdict (``problems``: empty when verified)."""
    return {**v.to_dict(), "problems": v.problems()}


def replay_row(traced: Any, model: str, options: dict[str, Any], autocast: str | None, schedule: Any,
               repeats: int = 0, grads: Sequence[str] = ("autograd",)) -> dict[str, Any]:
    """The schedule exported with the replay back-end and verified (:func:`report`); with several ``grads``
    modes, the report of each by its mode."""
    from bonsai_core.export import export_traced, step_signature, verify_export

    with tempfile.TemporaryDirectory() as folder:
        export_traced(traced, step_signature(model, options), schedule, folder,
                      spec={"model": model, "options": dict(options), "autocast": autocast})
        reports = {mode: report(verify_export(model, options, folder, repeats=repeats, grads=mode))
                   for mode in grads}
    return reports if len(grads) > 1 else reports[grads[0]]


def zoo_schedule(graph: Any, factory: str, level: int | None) -> Any:
    return none_schedule(graph) if level is None else export_tests().FACTORIES[factory](graph, level)


def zoo_rows(models: Sequence[str]) -> list[dict[str, Any]]:
    """Each zoo model at its default size under ZOO_SCHEDULES, exported and verified with gradients
    through autograd and written directly (``grads="direct"``)."""
    from bonsai_core.trace import trace_model

    rows = []
    for model in models:
        traced = trace_model(model)
        for factory, level in ZOO_SCHEDULES:
            schedule = zoo_schedule(traced.graph, factory, level)
            row = {"model": model, "schedule": factory, "level": level, "nodes": traced.graph.n,
                   "recomputes": simulate(traced.graph, schedule).recomputes,
                   **replay_row(traced, model, {}, None, schedule, grads=("autograd", "direct"))}
            rows.append(common.progress(row, ("model", "schedule", "recomputes")))
    return rows


def method_rows(models: Sequence[str], time_limit: float) -> list[dict[str, Any]]:
    """Every method of METHODS at lb + METHOD_SHARE on the zoo at tests/test_export.py's small sizes,
    exported and verified; a budget the method does not meet is recorded as its error."""
    from bonsai_core.trace import trace_model

    small = export_tests().SMALL
    rows = []
    for model in models:
        traced = trace_model(model, **small[model])
        budget = headroom_budget(traced.graph, METHOD_SHARE)
        for method in METHODS:
            row: dict[str, Any] = {"model": model, "options": small[model], "method": method, "budget": budget}
            try:
                schedule = solve(traced.graph, budget, method=method, time_limit=time_limit)
            except BonsaiError as e:
                row["error"] = failure(e)
            else:
                row["recomputes"] = simulate(traced.graph, schedule).recomputes
                row["replay"] = replay_row(traced, model, small[model], None, schedule)
            rows.append(common.progress(row, ("model", "method", "recomputes", "error")))
    return rows


def verified_rows(cases: Sequence[tuple[str, dict[str, Any] | None, str | None]]) -> list[dict[str, Any]]:
    """verify's full report (TIMING_REPEATS timed steps) of each case under no recomputation and
    recompute-before-use at level 2."""
    from bonsai_core.trace import trace_model

    small = export_tests().SMALL
    rows = []
    for model, options, autocast in cases:
        options = small[model] if options is None else options
        traced = trace_model(model, autocast=autocast, **options)
        for factory, level in (ZOO_SCHEDULES[0], ZOO_SCHEDULES[2]):
            schedule = zoo_schedule(traced.graph, factory, level)
            row = {"model": model, "options": options, "autocast": autocast, "schedule": factory, "level": level,
                   "recomputes": simulate(traced.graph, schedule).recomputes,
                   "replay": replay_row(traced, model, options, autocast, schedule, TIMING_REPEATS)}
            rows.append(common.progress(row, ("model", "autocast", "schedule", "recomputes")))
    return rows


def attention_rows(models: Sequence[str]) -> list[dict[str, Any]]:
    """No-remat peaks of ``models`` at their default sizes and seq ATTENTION_SEQ, eager attention and
    SDPA, fp32 and bf16 parameters (traces only)."""
    rows = []
    for model in models:
        for dtype in ("fp32", "bf16"):
            for attention in ("eager", "sdpa"):
                graph = common.graph_of(model, seq=ATTENTION_SEQ, attention=attention, dtype=dtype)
                row = {"model": model, "dtype": dtype, "attention": attention, "nodes": graph.n,
                       "no_remat_peak": no_remat_peak(graph)}
                rows.append(common.progress(row, list(row)))
    return rows


def first_plan(graph: Any, regions: str, time_limit: float) -> tuple[float, Any] | None:
    """bonsai's plan at the first share of BACKEND_SHARES it meets, with that share; None if at none. Another
    refusal (a graph without module calls, for ``regions="modules"``) is raised."""
    for share in BACKEND_SHARES:
        try:
            return share, solve(graph, headroom_budget(graph, share), method="bonsai", regions=regions,
                                time_limit=time_limit)
        except BudgetError:
            continue
    return None


def failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def checkpoint_side(model: str, options: dict[str, Any], autocast: str | None, schedule: Any) -> dict[str, Any]:
    """The plan through the checkpoint back-end: ``verify_checkpoint``'s report, its verdict, and the export's
    own figures (``INFO``: the schedule's and the realised peak, the dropped bytes left saved)."""
    from bonsai_core.export.checkpoint import export_checkpoint
    from bonsai_core.export.verify import (CHECKPOINT_AUTOCAST, CPU_ATTENTION_DROPOUT, load_checkpointed,
                                           verify_checkpoint)

    with tempfile.TemporaryDirectory() as folder:
        export_checkpoint(model, options, schedule, folder, autocast=autocast)
        info = load_checkpointed(folder).INFO
        v = verify_checkpoint(model, options, folder, repeats=1)
    words = {CHECKPOINT_AUTOCAST: "autocast", CPU_ATTENTION_DROPOUT: "SDPA dropout on the CPU"}  # why not judged
    return {**report(v), "unjudged": words.get(v.unpredicted, v.unpredicted),
            "plan_peak": int(info["predicted_peak"]), "plan_realised_peak": int(info["realised_peak"]),
            "dropped_bytes": int(info["dropped_bytes"]),
            "unrealised_dropped_bytes": int(info["unrealised_dropped_bytes"])}


def both_backends(traced: Any, model: str, options: dict[str, Any], autocast: str | None, share: float,
                  schedule: Any) -> dict[str, Any]:
    """One plan through the replay and the checkpoint back-end; a refusal or a crash of either is recorded
    as its error (a crash is a result here: the page lists it)."""
    sim = simulate(traced.graph, schedule)
    out: dict[str, Any] = {"share": share, "predicted": sim.peak, "recomputes": sim.recomputes}
    for side, export in (("replay", partial(replay_row, traced)), ("checkpoint", checkpoint_side)):
        try:
            out[side] = export(model, options, autocast, schedule)
        except Exception as e:  # noqa: BLE001
            out[f"{side}_error"] = failure(e)
    return out


def backend_rows(cases: Sequence[tuple[str, dict[str, Any], str | None]], time_limit: float) -> list[dict[str, Any]]:
    """Each case with bonsai's free-form and module plans (REGIONS) through both back-ends. A refusal of the
    trace or the solver is recorded as the row's error; the other rows still run."""
    from bonsai_core.trace import trace_model

    rows = []
    for model, options, autocast in cases:
        base = {"model": model, "options": options, "autocast": autocast}
        try:
            traced = trace_model(model, autocast=autocast, **options)
        except BonsaiError as e:
            rows.append({**base, "regions": None, "error": "trace: " + failure(e)})
            continue
        for regions in REGIONS:
            row: dict[str, Any] = {**base, "regions": regions}
            try:
                plan = first_plan(traced.graph, regions, time_limit)
            except BonsaiError as e:
                row["error"] = "solve: " + failure(e)
            else:
                row.update({"no_plan": True} if plan is None
                           else both_backends(traced, model, options, autocast, *plan))
            rows.append(common.progress(row, ("model", "autocast", "regions", "share", "error", "replay_error",
                                              "checkpoint_error")))
    return rows


def measure(time_limit: float, quick: bool = False) -> dict[str, Any]:
    meta = common.run_meta(time_limit=time_limit, quick=quick, study_seconds={})
    zoo = [(name, opts, None) for name, opts in export_tests().SMALL.items()]  # both back-ends: the zoo first
    first = 1 if quick else None  # --quick: one model per study
    start = time.perf_counter()
    results = {"meta": meta, **common.run_studies({
        "zoo": lambda: zoo_rows(ZOO[:first]),
        "methods": lambda: method_rows(ZOO[:first], time_limit),
        "verified": lambda: verified_rows(VERIFIED[:first]),
        "attention": lambda: attention_rows(ATTENTION_MODELS[:first]),
        "backends": lambda: backend_rows(zoo[:1] + list(BACKEND_MODELS[-1:]) if quick else zoo + list(BACKEND_MODELS),
                                         time_limit)}, meta["study_seconds"])}
    meta["seconds"] = time.perf_counter() - start
    return results


# -- words and numbers ----------------------------------------------------------------------------

byte_range = partial(common.span, fmt="{:+,}".format, between=" to ", unit=" B")  # +8 B, -8 to +8 B
percent_range = partial(common.span, fmt=common.pct, between=" to ")


def met_split(rows: Sequence[tuple[str, int, int]]) -> tuple[list[int], list[tuple[str, int, int]]]:
    """Of ``rows`` ((label, measured, predicted)): the errors of those within NEAR bytes of their prediction,
    and the rows that miss it."""
    return ([m - p for _, m, p in rows if abs(m - p) <= NEAR],
            [(label, m, p) for label, m, p in rows if abs(m - p) > NEAR])


def differences(label: str, *reports: dict[str, Any]) -> tuple[str, float, float, float]:
    """(label, loss difference, largest gradient difference, largest relative to its tensor's largest
    magnitude) over verify's ``reports`` of one row."""
    return (label, max(v["loss_diff"] for v in reports),
            max(max(v["max_grad_diff"], v.get("max_grad_diff_grads_none", 0.0)) for v in reports),
            max(v.get("max_grad_scaled_diff", 0.0) for v in reports))


def checks(reports: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, list[Any]]:
    """verify's ``reports`` (label, report) as the page's sentences read them: (label, measured, predicted)
    peaks where a report predicts one (the checkpoint back-end's is judged against its plan instead),
    :func:`differences`, (label, problems)."""
    return {"peaks": [(label, v["measured_peak"], v["predicted_peak"]) for label, v in reports
                      if "predicted_peak" in v],
            "diffs": [differences(label, v) for label, v in reports],
            "problems": [(label, v["problems"]) for label, v in reports]}


def differing(rows: Sequence[tuple[str, float, float, float]]) -> list[tuple[str, float, float, float]]:
    """The rows of :func:`differences` whose loss or gradients are not bitwise equal to eager's."""
    return [(label, loss, grad, scaled) for label, loss, grad, scaled in rows if loss or grad]


def off(ck: dict[str, Any], peak: str, of: str = "plan_peak") -> float:
    """The checkpoint back-end's ``peak`` (measured, realised: what its checkpoints run, simulated) against
    ``of`` (the plan's, the realised)."""
    return ck[peak] / ck[of] - 1


def short(model: str) -> str:
    return model.removeprefix("tests.")


def precision(options: dict[str, Any], autocast: str | None) -> str:
    return f"autocast {autocast}" if autocast else options.get("dtype") or "fp32"


def options_said(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"


def schedule_said(row: dict[str, Any]) -> str:
    """A zoo row's schedule with its level: ``recompute-before-use L2``."""
    return row["schedule"] + ("" if row["level"] is None else f" L{row['level']}")


def backend_label(row: dict[str, Any], regions: bool = True) -> str:
    """A back-end row as the sentences name it: ``hf:gpt2 on eager attention bf16 any``."""
    attention, kind = row["options"].get("attention"), precision(row["options"], row["autocast"])
    return (short(row["model"]) + (f" on {attention} attention" if attention else "")
            + (f" {kind}" if kind != "fp32" else "") + (f" {row['regions']}" if regions and row.get("regions") else ""))


def rows_said(rows: Sequence[dict[str, Any]], values: Sequence[str] = ()) -> str:
    """Back-end rows by their model, each with its regions (and value): ``gpt (any +5.0%; modules +1.0%)``."""
    plans = common.grouped(zip(rows, values or [None] * len(rows)), lambda pair: backend_label(pair[0], regions=False),
                           lambda pair: pair[0]["regions"] + ("" if pair[1] is None else f" {pair[1]}"))
    return common.listing([f"{label} ({('; ' if values else ', ').join(of)})" for label, of in plans.items()])


def zoo_said(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The zoo's rows as its sentences read them: both gradient modes' (label, measured, predicted) peaks, whether
    every step is above its prediction by a few bytes only (``tiny``), the rows whose modes measure different
    peaks, their :func:`differences`, the recomputing rows at or above the original model, and the original
    step against the plain schedule's prediction."""
    both, modes_differ, exact, not_below = [], [], [], []
    for r in rows:
        a, d, label = r["autograd"], r["direct"], f"{r['model']} {schedule_said(r)}"
        both += [(label, a["measured_peak"], a["predicted_peak"]),
                 (f"{label} (grads direct)", d["measured_peak"], d["predicted_peak"])]
        exact.append(differences(label, a, d))
        if d["measured_peak"] != a["measured_peak"]:
            modes_differ.append((label, a["measured_peak"], d["measured_peak"]))
        if r["recomputes"] and a["measured_peak"] >= a["original_peak"]:
            not_below.append(label)
    return {"nodes": {m: of[0]["nodes"] for m, of in common.grouped(rows, lambda r: r["model"]).items()},
            "both": both, "tiny": all(0 < m - p <= NEAR for _, m, p in both), "modes_differ": modes_differ,
            "exact": exact, "recomputing": any(r["recomputes"] for r in rows), "not_below": not_below,
            **original_said(rows)}


def original_said(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The zoo's models whose original step measures the plain schedule's prediction within NEAR bytes
    (``near``), and (model, original, predicted) of those below and above it."""
    out: dict[str, list[Any]] = {"near": [], "below": [], "above": []}
    for r in rows:
        if r["level"] is None:
            orig, pred = r["autograd"]["original_peak"], r["autograd"]["predicted_peak"]
            if abs(orig - pred) <= NEAR:
                out["near"].append(r["model"])
            else:
                out["below" if orig < pred else "above"].append((r["model"], orig, pred))
    return out


def methods_said(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The solved rows' :func:`checks`, and the methods that met no schedule by model."""
    return {"models": {r["model"]: r["options"] for r in rows},
            "checks": checks([(f"{r['method']} on {r['model']}", r["replay"]) for r in rows if "replay" in r]),
            "unmet": common.grouped([r for r in rows if "replay" not in r], lambda r: r["model"],
                                    lambda r: r["method"])}


def verified_said(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """verify's full report: the models with their options, the rows' :func:`checks`, and each step's peak
    from ``.grad`` None against the step with ``.grad`` allocated."""
    return {"models": sorted({f"`{r['model']}` ({options_said(r['options'])})" for r in rows}),
            "checks": checks([(f"{short(r['model'])} {precision(r['options'], r['autocast'])} {r['schedule']}",
                               r["replay"]) for r in rows]),
            "none_peaks": [r["replay"]["measured_peak_grads_none"] / r["replay"]["measured_peak"] - 1 for r in rows]}


def attention_said(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The models, and each no-remat peak by (model, dtype, attention)."""
    return {"models": list(dict.fromkeys(r["model"] for r in rows)),
            "peaks": {(r["model"], r["dtype"], r["attention"]): r["no_remat_peak"] for r in rows}}


def backends_said(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The back-end rows as the sentences read them: each side's :func:`checks`, the verdicts and errors, and
    the checkpoint back-end's peaks (:func:`checkpoint_said`)."""
    planned = [r for r in rows if "share" in r]
    sides = ("replay", "checkpoint")
    return {"models": {backend_label(r, regions=False): r["options"] for r in rows},
            "checks": {side: checks([(backend_label(r), r[side]) for r in planned if side in r]) for side in sides},
            "verdicts": [(f"{backend_label(r)} ({side})", r[side]["problems"]) for r in planned
                         for side in sides if side in r],
            "errors": [f"{backend_label(r)}: {r[k].rstrip('.')}" for r in rows
                       for k in ("error", "replay_error", "checkpoint_error") if k in r],
            "no_plan": [r for r in rows if "no_plan" in r],
            **checkpoint_said([r for r in planned if "checkpoint" in r])}


def checkpoint_said(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint back-end's rows: per REGIONS (rows that run the plan, rows), the judged rows that run it
    against the plan (``judged_follow``), the rows whose realised peak departs from the plan, the measured
    peak against the realised (:func:`judged_said`) and the dropped bytes left saved."""
    follows = [abs(off(r["checkpoint"], "plan_realised_peak")) <= REALISED for r in rows]
    depart = [(r, off(r["checkpoint"], "plan_realised_peak")) for r, follow in zip(rows, follows) if not follow]
    some_left = [(r, left) for r in rows if 0 < (left := dropped_left(r["checkpoint"])) < 1]
    return {"follow": {regions: (sum(f for r, f in zip(rows, follows) if r["regions"] == regions),
                                 sum(r["regions"] == regions for r in rows)) for regions in REGIONS},
            "judged_follow": [off(r["checkpoint"], "measured_peak") for r, follow in zip(rows, follows)
                              if follow and not r["checkpoint"]["unjudged"]],
            "depart": [r for r, _ in depart], "depart_gaps": [gap for _, gap in depart],
            "nothing_left": [r for r in rows if dropped_left(r["checkpoint"]) == 1],
            "some_left": [r for r, _ in some_left], "shares": [left for _, left in some_left],
            **judged_said(rows)}


def dropped_left(ck: dict[str, Any]) -> float:
    """The share of the plan's dropped bytes left saved; 0 when it drops none."""
    return ck["unrealised_dropped_bytes"] / ck["dropped_bytes"] if ck["dropped_bytes"] else 0.0


def judged_said(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint back-end's measured peak against its realised: the rows left unjudged by why, how many are
    judged and within REALISED of it, and those above it (recomputing, or not: ``untouched``, said with the
    original step's gap) and below it, with their gaps."""
    out: dict[str, Any] = {"reasons": {}, "unjudged": 0, "judged": 0, "within": 0, "recomputing": [],
                           "recomputing_gaps": [], "untouched": [], "untouched_said": [], "below": [], "below_gaps": []}
    for r in rows:
        ck = r["checkpoint"]
        gap = off(ck, "measured_peak", "plan_realised_peak")
        if ck["unjudged"]:
            out["reasons"].setdefault(ck["unjudged"], []).append(r)
            out["unjudged"] += 1
            continue
        out["judged"] += 1
        if gap > REALISED and r["recomputes"]:
            out["recomputing"].append(r)
            out["recomputing_gaps"].append(gap)
        elif gap > REALISED:
            out["untouched"].append(r)
            out["untouched_said"].append(f"checkpointed {common.pct(gap)}, original "
                                         f"{common.pct(off(ck, 'original_peak', 'plan_realised_peak'))}")
        elif gap < -REALISED:
            out["below"].append(r)
            out["below_gaps"].append(gap)
        else:
            out["within"] += 1
    return out


# -- the page -------------------------------------------------------------------------------------

def values(results: dict[str, Any]) -> dict[str, Any]:
    """What export.md says of ``results``: its rows, the sentences' readings of them, the suite's settings and
    the formatters its sentences call."""
    return {"meta": results["meta"], "zoo_rows": results["zoo"], "method_rows": results["methods"],
            "verified_rows": results["verified"], "backend_rows": results["backends"],
            "zoo": zoo_said(results["zoo"]), "methods": methods_said(results["methods"]),
            "verified": verified_said(results["verified"]), "attention": attention_said(results["attention"]),
            "backends": backends_said(results["backends"]), "backend_shares": BACKEND_SHARES,
            "realised": REALISED, "near": NEAR, "method_share": METHOD_SHARE,
            "repeats": TIMING_REPEATS, "seq": ATTENTION_SEQ, "met_split": met_split, "differing": differing,
            "byte_range": byte_range, "percent_range": percent_range, "short": short, "precision": precision,
            "options_said": options_said, "schedule_said": schedule_said, "rows_said": rows_said}


def page(results: dict[str, Any], header: str) -> str:
    return common.fill("export", header=header, **values(results))


def refusal(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, before anything is measured; None when they can."""
    if args.time_limit <= 0:
        return f"--time-limit {args.time_limit:g}: give a positive number of seconds"
    return common.page_refusal(args, DEFAULT_OUT, RECORD_PAGE)


def main(args: argparse.Namespace) -> int:
    return common.run_page_suite("export", args, refusal(args), lambda: measure(args.time_limit, args.quick),
                                 common.page_writer(page, SOURCES))
