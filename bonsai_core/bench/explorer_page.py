"""The explorer's latencies: the budget slider, first paint, ten sessions dragging at once (solving ahead
on and off), the module graph and the tensor lifetimes, in headless Chromium as the browser tests drive
it (explorer/browser.py) and in-process for the parts the pages compute.

    bonsai bench explorer --page docs/results/explorer.md                 # measures, writes results.json and the page
    bonsai bench explorer --page docs/results/explorer.md --report-only   # the page again from results.json
    bonsai bench explorer --quick --out /tmp/e --page /tmp/explorer.md    # small counts, no large graphs: a smoke test
    bonsai bench explorer --parts titan --page docs/results/explorer.md   # the 8B step again, the rest kept

``--parts`` picks the studies to run: ``main`` (everything on the default GPT, hf:gpt2, the 32-layer Llama and the
60-layer GPT) and ``titan`` (torchtitan's 8B step: an hour of sweeping on a loaded machine). The parts not run are
kept from ``--out``'s results.json, and the page names the run that measured the 8B step where it is not the
page's own.

With ``--page`` the whole page is written from this run: every number and comparison on it is computed
from ``results.json``. Needs Playwright for Python, Debian's Chromium (/usr/bin/chromium) and
transformers (the Hugging Face models it traces); latencies mean something on a quiet machine only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import importlib.util
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np

from bonsai_core.bench import common
from bonsai_core.graph import load_graph, save_graph
from bonsai_core.regions import CheckpointPlan
from bonsai_core.schedule import no_remat_peak, simulate
from bonsai_core.solvers import solve

SOURCES = ["bonsai_core/bench/explorer_page.py", "explorer/browser.py", common.template_source("explorer")]
DEFAULT_OUT = "docs/bench/explorer"
RECORD_PAGE = "docs/results/explorer.md"

# how many of each measurement: the full run, and --quick's smoke test
FULL = {"first_paints": 3, "drags": 7, "sessions": 10, "rounds": 3, "revisits": 3}
QUICK = {"first_paints": 2, "drags": 3, "sessions": 3, "rounds": 1, "revisits": 1}
# the targets the page judges medians by (seconds); judged here only: the browser tests share a loaded machine
SLIDER_TARGET, FIRST_PAINT_TARGET, SESSIONS_TARGET, MODULE_VIEW_TARGET = 1.0, 3.0, 2.0, 2.0
SWEEP_TARGET, FIT_TARGET = 60.0, 60.0  # the 8B step: its slider swept, What fits answered (issue 57)
SWEEP_PATIENCE = 3600.0  # seconds the run waits for the 8B step's sweep before it says how far it got
SCRUB_PRESSES = 10  # arrow-key steps of the scrubber, as tests/test_browser_timeline.py presses them
SHARE = 0.5  # the lifetimes' budget, of the no-remat peak
REGIONS_AT_ONCE = 12  # regions the "Why this plan" panel explains per click (pages/memory.py's WHY_AT_ONCE)
TIME_LIMIT = 20.0  # seconds per bonsai solve: the explorer's default (explorer/state.py)
LARGE_GPT = ("gpt", {"layers": 60})  # browser.LARGE_LINK's model
PARTS = ("main", "titan")  # --parts: the studies a run measures, the others kept from its --out


def harness() -> ModuleType:
    """explorer/browser.py, the browser tests' harness, imported from the checkout (the explorer is no
    package of the library's: imported when measuring, not when the command line is built)."""
    common.import_test_models()
    from explorer import browser

    return browser


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common.add_page_arguments(ap, DEFAULT_OUT, RECORD_PAGE, quick="small counts and no large graphs")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="the studies to run (default all): main (the default GPT and the other small graphs), titan "
                         "(torchtitan's 8B step); the others are kept from --out's results.json")


# -- measuring in-process ---------------------------------------------------------------------------

def seconds_of(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def traced(name: str, options: dict[str, Any], label: str) -> dict[str, Any]:
    """``trace_model(name, **options)``'s graph, timed: {label, graph, trace_s}."""
    from bonsai_core.trace import trace_model

    result, seconds = seconds_of(lambda: trace_model(name, **options))
    return {"label": label, "graph": result.graph, "trace_s": seconds}


def graphs_to_measure(quick: bool) -> dict[str, dict[str, Any]]:
    """The default GPT (the explorer's model), hf:gpt2 and, unless ``quick``, the 32-layer Llama and the
    60-layer GPT."""
    browser = harness()
    graphs = {"default": {"label": "default GPT", "graph": load_graph(browser.DEFAULT_GRAPH), "trace_s": None},
              "gpt2": traced("hf:gpt2", {}, "`hf:gpt2`")}
    if not quick:
        graphs["llama"] = traced(*browser.LLAMA_32, "32-layer Llama")
        graphs["large"] = traced(*LARGE_GPT, "60-layer GPT")
    return graphs


def module_structure_row(key: str, label: str, graph: Any) -> dict[str, Any]:
    """What the Graph page computes once per graph (the module tree, each forward op's call, each backward
    op's anchor, the depth to open at), then per fold depth: the boxes, their layout, their stats with
    the chart's spec; timed as ``explorer.compute.module_structure`` and the page call them."""
    browser = harness()
    from explorer import module_chart, module_graph

    def structure():
        tree = module_graph.module_tree(graph)
        owners = module_graph.forward_owners(graph, tree)
        anchors = module_graph.backward_anchors(graph)
        return tree, owners, anchors, module_graph.default_depth(graph, tree)

    (tree, owners, anchors, start_depth), structure_s = seconds_of(structure)
    depths = sorted({start_depth, *(d for d in browser.FOLD_STEPS if d <= tree.max_depth)})
    rows = []
    for depth in depths:
        boxes, boxes_s = seconds_of(lambda: module_graph.module_boxes(graph, depth, tree, owners, anchors))
        layout, layout_s = seconds_of(lambda: module_graph.box_layout(graph, boxes))
        _, chart_s = seconds_of(lambda: module_chart.module_chart(
            boxes, layout, module_graph.box_stats(graph, boxes), tree.paths, tree.parent, []))
        rows.append({"depth": depth, "boxes": boxes.count, "boxes_s": boxes_s, "layout_s": layout_s,
                     "stats_chart_s": chart_s})
    return {"key": key, "graph": label, "ops": graph.n, "structure_s": structure_s, "default_depth": start_depth,
            "depths": rows}


def lifetimes_row(label: str, graph: Any, method: str, share: float = SHARE) -> dict[str, Any]:
    """The Memory page's lifetimes of ``method``'s plan at ``share`` of the no-remat peak: the bars, the chart's
    rows and spec, the step line at the plan's peak and the reasons of the first REGIONS_AT_ONCE recomputed regions,
    each timed as pages/memory.py calls them."""
    from explorer import timeline
    from explorer.compute import DEFAULTS

    budget = int(share * no_remat_peak(graph))
    # the explorer's own defaults (bonsai: checkpoint regions, whose reasons the page explains)
    options = {**DEFAULTS.get(method, {}), **({"time_limit": TIME_LIMIT} if method == "bonsai" else {})}
    schedule, solve_s = seconds_of(lambda: solve(graph, budget, method=method, **options))
    sim = simulate(graph, schedule)
    modules = timeline.node_modules(graph)
    bars, bars_s = seconds_of(lambda: timeline.bars(graph, sim.residency, modules))
    step = max(0, min(sim.peak_op, len(schedule.ops) - 1))
    x = np.arange(len(schedule.ops), dtype=float)
    _, chart_s = seconds_of(lambda: timeline.timeline_chart(timeline.bar_frame(bars, x, step, graph.fixed_mem),
                                                             sorted(set(modules.group)), x[step],
                                                             (0.0, x[-1]), "schedule step (op)"))
    _, step_s = seconds_of(lambda: timeline.step_line(graph, schedule.ops, step, modules, sim.events))
    regions = sorted(CheckpointPlan.from_extra(schedule.extra).recomputed)
    todo = regions[:REGIONS_AT_ONCE]
    _, reasons_s = seconds_of(lambda: timeline.reasons(graph, schedule, budget, modules, regions=todo))
    return {"graph": label, "ops": graph.n, "method": method, "share": share, "steps": len(schedule.ops),
            "solve_s": solve_s,
            "bars": len(bars.start), "threshold": bars.threshold, "bars_s": bars_s, "chart_s": chart_s,
            "step_line_s": step_s, "regions": len(regions), "explained": len(todo), "reasons_s": reasons_s}


def lifetime_cases(graphs: dict[str, dict[str, Any]]) -> list[tuple[str, str, float]]:
    """(graph key, method, share of the no-remat peak) of the lifetimes' rows: bonsai on the default GPT and
    on hf:gpt2 at 55% (as tests/test_browser_timeline.py opens it: bonsai's checkpoint regions reach 50.6% of
    its peak), chen on the 60-layer GPT (browser.LARGE_LINK's plan)."""
    cases = [("default", "bonsai", SHARE), ("gpt2", "bonsai", 0.55), ("large", "chen", SHARE)]
    return [case for case in cases if case[0] in graphs]


# -- measuring in the browser ---------------------------------------------------------------------

def no_exception(page: Any, what: str) -> None:
    if page.locator('[data-testid="stException"]').count():
        raise RuntimeError(f"the explorer showed an exception: {what}")


def slider_drags(chromium: Any, url: str, drags: int) -> list[float]:
    """One session on the Memory page drags the budget slider ``drags`` times (browser.DRAG_FRACTIONS, as
    the browser test): seconds from each release until the plot shows the budget the slider settled on."""
    browser = harness()
    reference = browser.default_reference()
    context, page = browser.open_page(chromium)
    try:
        browser.open_memory_for_drags(page, url)
        latencies = []
        for fraction in (browser.DRAG_FRACTIONS * drags)[:drags]:
            seconds, _, _ = browser.timed_drag(page, fraction, reference)
            latencies.append(seconds)
            browser.wait_idle(page)
        no_exception(page, "slider drags")
        return latencies
    finally:
        context.close()


def first_paints(chromium: Any, url: str, count: int) -> list[float]:
    browser = harness()
    context, page = browser.open_page(chromium)
    try:
        return [browser.first_paint(page, url) for _ in range(count)]
    finally:
        context.close()


def memory_page(chromium: Any, url: str, link: str, presses: int, key: str) -> dict[str, float]:
    """A new page on the Memory page ``link``: seconds until both its charts are drawn, then ``presses``
    of ``key`` on the step scrubber until the step line changed; with the link (the page names what was
    measured, whatever the harness opens today)."""
    browser = harness()
    page, seconds = browser.open_memory(chromium, f"{url}/{link}")
    try:
        no_exception(page, link)
        page.wait_for_timeout(1000)  # the charts' first draw settled, as the test waits before its step
        return {"link": link, "charts_s": seconds, "scrub_s": browser.scrub(page, key, presses)}
    finally:
        page.close()


def graph_page(chromium: Any, url: str, revisits: int) -> dict[str, Any]:
    """The Graph page of the default model in a new session: the first click on "Graph" and ``revisits``
    more from the Model page, each until the module chart is painted and the server idle."""
    browser = harness()
    context, page = browser.open_page(chromium)
    try:
        page.goto(url)
        browser.wait_idle(page)
        first = browser.graph_drawn(page)
        again = browser.graph_revisits(page, revisits)
        no_exception(page, "the Graph page")
        return {"first_s": first, "again_s": again}
    finally:
        context.close()


def llama_view(chromium: Any, url: str, path: Path, ops: int, revisits: int) -> dict[str, Any]:
    """The 32-layer Llama uploaded as JSON at browser.LLAMA_32_BUDGET: its module view the first time (the
    plan solved), ``revisits`` more times, then each step of browser.FOLD_STEPS."""
    browser = harness()
    context, page = browser.open_page(chromium)
    try:
        browser.upload_graph(page, url, path, ops, browser.LLAMA_32_BUDGET)
        first = browser.graph_drawn(page)
        again = browser.graph_revisits(page, revisits)
        folds = [[depth, browser.fold_to(page, depth)] for depth in browser.FOLD_STEPS]
        no_exception(page, "the Llama's module view")
        return {"first_s": first, "again_s": again, "folds": folds}
    finally:
        context.close()


def one_session_studies(counts: dict[str, int], llama: tuple[Path, int] | None, large: bool) -> dict[str, Any]:
    """Everything one session at a time measures, on one server that solves only what a session asks
    for (as in the browser tests), in the order a first visitor would meet it."""
    from playwright.sync_api import sync_playwright

    browser = harness()
    out: dict[str, Any] = {}
    with browser.serve() as url, sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser.CHROMIUM, args=browser.BROWSER_ARGS)
        try:
            out["first_paint_s"] = first_paints(chromium, url, counts["first_paints"])
            out["memory_first"] = memory_page(chromium, url, "memory", SCRUB_PRESSES, "ArrowLeft")
            out["memory_again"] = memory_page(chromium, url, "memory", SCRUB_PRESSES, "ArrowLeft")
            out["slider_s"] = slider_drags(chromium, url, counts["drags"])
            out["graph"] = graph_page(chromium, url, counts["revisits"])
            out["gpt2_link"] = memory_page(chromium, url, browser.GPT2_LINK, 1, "Home")
            if llama:
                out["llama"] = llama_view(chromium, url, *llama, counts["revisits"])
            if large:
                out["large_link"] = memory_page(chromium, url, browser.LARGE_LINK, 1, "Home")
        finally:
            chromium.close()
    return out


def sessions_study(solve_ahead: bool, counts: dict[str, int]) -> dict[str, Any]:
    """``counts["sessions"]`` sessions dragging at once on a fresh server (browser.measure_sessions)."""
    browser = harness()
    result = browser.measure_sessions(solve_ahead, browser.default_reference(), counts["sessions"], counts["rounds"])
    return {"solve_ahead": solve_ahead, **result}


def titan_study(path: Path, graph: Any, drags: int) -> dict[str, Any]:
    """Torchtitan's 8B step on a fresh server that sweeps (browser.big_step)."""
    from playwright.sync_api import sync_playwright

    browser = harness()
    with browser.serve(solve_ahead=True) as url, sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser.CHROMIUM, args=browser.BROWSER_ARGS)
        try:
            context, page = browser.open_page(chromium, width=1440, height=1800)
            found = browser.big_step(page, url, path, graph.n, no_remat_peak(graph), drags, SWEEP_PATIENCE)
            no_exception(page, "the 8B step")
            context.close()
            return found
        finally:
            chromium.close()


def titan_fit(graph: Any) -> dict[str, Any]:
    """What fits on the 8B step as the page runs it by default: the GPU at twice the step's lower bound,
    batch searched from the step's own (its graph taken, not traced again), none/bonsai/chen/dtr, overhead
    at most 10%, AdamW, 10 s per solve; each answer's moment kept."""
    from bonsai_core import fit

    browser = harness()
    name, options = browser.TITAN_8B
    begun = time.perf_counter()
    answers: list[list[Any]] = []
    result = fit.fit(name, 2 * graph.peak_lower_bound, ["none", "bonsai", "chen", "dtr"], vary="batch",
                     max_overhead=0.1, options={k: v for k, v in options.items() if k != "batch"}, optimizer="adamw",
                     solver_options={"time_limit": 10.0}, start=options["batch"], traced={options["batch"]: graph},
                     answered=lambda a: answers.append([a.size, a.method, a.fits, time.perf_counter() - begun]))
    return {"seconds": time.perf_counter() - begun, "answers": answers, "traces": result.traces,
            "table": fit.markdown_table(result), "limit": result.limit}


# -- the run ----------------------------------------------------------------------------------------

def timed_part(parts: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, its seconds and the 1-minute load average as it started and ended kept in ``parts[name]``."""
    load_start = os.getloadavg()[0]
    out, seconds = seconds_of(fn)
    parts[name] = {"seconds": seconds, "load_start": load_start, "load_end": os.getloadavg()[0]}
    print(f"{name}: {seconds:.1f} s", flush=True)
    return out


def measure(quick: bool, parts: Sequence[str] = PARTS, out: str = DEFAULT_OUT) -> dict[str, Any]:
    """The studies ``parts`` names (:data:`PARTS`), run now; the others kept from ``out``/results.json."""
    results = earlier_results(Path(out) / "results.json") if set(parts) != set(PARTS) else {}
    if "titan" in parts and "meta" in results:  # the kept run's page no longer counts its 8B step's parts
        results["meta"] = without_titan_parts(results["meta"])
    if "main" in parts:
        kept_titan = results.get("titan") and titan_of_its_run(results["titan"], results["meta"])
        results.update(measure_main(quick))
        if kept_titan:
            results["titan"] = kept_titan
    if "titan" in parts and not quick and importlib.util.find_spec("torchtitan") is not None:
        results["titan"] = measure_titan(FULL["drags"])
        run = results["titan"]["run"]
        run["alone"] = "main" not in parts  # else a part of the run the page's first lines name
        if not run["alone"]:
            results["meta"]["seconds"] += run["seconds"]
    return results


def earlier_results(path: Path) -> dict[str, Any]:
    """results.json of an earlier run, or nothing."""
    return json.loads(path.read_text()) if path.is_file() else {}


def titan_of_its_run(titan: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The 8B step's results kept beside a new run of the other parts: with the run that measured them (from its
    ``meta`` where that run measured everything)."""
    run = titan.get("run") or {**{k: meta[k] for k in ("command", "date", "machine")},
                                "parts": {n: p for n, p in meta["parts"].items() if n in TITAN_PARTS},
                                "seconds": sum(p["seconds"] for n, p in meta["parts"].items() if n in TITAN_PARTS)}
    return {**titan, "run": {**run, "alone": True}}


TITAN_PARTS = ("tracing the 8B step", "the 8B step in the browser", "What fits on the 8B step")  # timed_part's names


def without_titan_parts(meta: dict[str, Any]) -> dict[str, Any]:
    """A run's ``meta`` less the 8B step's timed parts (their seconds and load averages), for a page whose 8B
    step another run measured."""
    mine = {name: part for name, part in meta["parts"].items() if name in TITAN_PARTS}
    return {**meta, "parts": {name: part for name, part in meta["parts"].items() if name not in mine},
            "seconds": meta["seconds"] - sum(part["seconds"] for part in mine.values())}


def titan_run(results: dict[str, Any]) -> dict[str, Any] | None:
    """The run that measured the 8B step where it is not the one the page's first lines name (None when it is)."""
    run = (results.get("titan") or {}).get("run")
    if run is None or not run["alone"]:
        return None
    loads = [x for part in run["parts"].values() for x in (part["load_start"], part["load_end"])]
    return {**run, "minutes": run["seconds"] / 60, "load_low": min(loads), "load_high": max(loads)}


def measure_main(quick: bool) -> dict[str, Any]:
    """Everything but the 8B step: the default GPT, hf:gpt2 and, unless ``quick``, the 32-layer Llama and the
    60-layer GPT, in-process and in Chromium."""
    browser = harness()
    start = time.perf_counter()
    counts = QUICK if quick else FULL
    parts: dict[str, Any] = {}
    results: dict[str, Any] = {"meta": common.run_meta(streamlit=importlib.metadata.version("streamlit"), quick=quick,
                                                       counts=counts, parts=parts)}
    results["yardstick_s"] = timed_part(parts, "yardstick", browser.yardstick_seconds)
    graphs = timed_part(parts, "tracing", lambda: graphs_to_measure(quick))
    results["traces"] = [{"graph": g["label"], "ops": g["graph"].n, "trace_s": g["trace_s"]}
                         for g in graphs.values() if g["trace_s"] is not None]
    module_keys = [k for k in ("default", "llama") if k in graphs]
    results["module_graph"] = timed_part(parts, "module graph in-process", lambda: [
        module_structure_row(k, graphs[k]["label"], graphs[k]["graph"]) for k in module_keys])
    results["lifetimes"] = timed_part(parts, "lifetimes in-process", lambda: [
        lifetimes_row(graphs[k]["label"], graphs[k]["graph"], m, share) for k, m, share in lifetime_cases(graphs)])
    with tempfile.TemporaryDirectory() as folder:
        llama = None
        if "llama" in graphs:
            llama = (Path(folder) / "llama32.json", graphs["llama"]["graph"].n)
            save_graph(graphs["llama"]["graph"], llama[0])
        results["browser"] = timed_part(parts, "one session at a time",
                                        lambda: one_session_studies(counts, llama, large=not quick))
    results["sessions"] = [timed_part(parts, f"sessions, solving ahead {'on' if ahead else 'off'}",
                                      lambda: sessions_study(ahead, counts)) for ahead in (True, False)]
    results["meta"]["seconds"] = time.perf_counter() - start
    return results


def measure_titan(drags: int) -> dict[str, Any]:
    """Torchtitan's 8B step: traced, in Chromium (uploaded, swept, ``drags`` drags after the sweep) and What fits;
    with the run that measured it (``run``: its command, date, machine, seconds and the parts' load averages)."""
    browser = harness()
    start = time.perf_counter()
    parts: dict[str, Any] = {}
    run = common.run_meta(streamlit=importlib.metadata.version("streamlit"), parts=parts)
    name, options = browser.TITAN_8B
    titan = timed_part(parts, "tracing the 8B step", lambda: traced(name, options, "torchtitan's 8B step"))
    results: dict[str, Any] = {"ops": titan["graph"].n, "trace_s": titan["trace_s"], "run": run}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "llama3-8b.json"
        save_graph(titan["graph"], path)
        results["browser"] = timed_part(parts, "the 8B step in the browser",
                                        lambda: titan_study(path, titan["graph"], drags))
    results["fit"] = timed_part(parts, "What fits on the 8B step", lambda: titan_fit(titan["graph"]))
    run["seconds"] = time.perf_counter() - start
    return results


# -- the page: words made of numbers -------------------------------------------------------------

def secs(x: float) -> str:
    return f"{x:.2f} s"


def ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1e-3 else f"{x * 1e3:.1f} ms"


def spread(xs: Sequence[float]) -> str:
    """Every value of a short series, in the run's order: ``0.21 0.25 0.19 s``."""
    return " ".join(f"{x:.2f}" for x in xs) + " s"


def p90(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.9 * (len(xs) - 1))]  # as the browser test's report takes it


def against(value: float, target: float) -> str:
    """Whether a median meets its target: ``within the 1 s target`` or ``over the 1 s target by 0.20 s``."""
    if value <= target:
        return f"within the {target:g} s target"
    return f"over the {target:g} s target by {value - target:.2f} s"


def loads(results: dict[str, Any]) -> list[float]:
    """The 1-minute load averages at the starts and ends of the run's parts and the sessions' drags."""
    run = (results.get("titan") or {}).get("run")
    runs = [results["meta"]] + ([run] if run is not None and not run["alone"] else [])
    said = [x for run in runs for part in run["parts"].values() for x in (part["load_start"], part["load_end"])]
    return said + [s[key][0] for s in results["sessions"] for key in ("load_before", "load_after")]


def sessions_facts(results: dict[str, Any]) -> dict[str, Any]:
    """The sessions study: its counts and budgets, its table, each mode's median, the server's CPU per drag
    with and without solving ahead, the tabs' CPU against the server's, whether every chart updated in place."""
    browser = harness()
    count, rounds = results["meta"]["counts"]["sessions"], results["meta"]["counts"]["rounds"]
    by_mode = {s["solve_ahead"]: s for s in results["sessions"]}
    cpu = {ahead: s["server_cpu"] / len(s["drawn"]) for ahead, s in by_mode.items()}
    return {"count": count, "rounds": rounds, "budgets": len(results["sessions"][0]["drawn"]),
            "lowest": browser.session_budget(0, 0), "highest": browser.session_budget(count - 1, rounds - 1),
            "modes": [{"ahead": ahead, "median": statistics.median(s["drawn"])} for ahead, s in by_mode.items()],
            "cpu_on": cpu[True], "cpu_off": cpu[False],
            "tabs_per_server": sum(s["browser_cpu"] for s in results["sessions"])
            / sum(s["server_cpu"] for s in results["sessions"]),
            "in_place": all(all(s["in_place"]) for s in results["sessions"])}


def module_graph_facts(results: dict[str, Any]) -> dict[str, Any]:
    """The module graph study's rows, the Llama traced for it (its row, boxes per fold depth) and its view's
    median draw (None where not run)."""
    browser = harness()
    rows, b = results["module_graph"], results["browser"]
    view = llama = None
    if "llama" in b:
        row = next(r for r in rows if r["key"] == "llama")
        llama = {"row": row, "boxes": {d["depth"]: d["boxes"] for d in row["depths"]}}
        view = {"graph": row["graph"], "median": statistics.median(b["llama"]["again_s"])}
    return {"rows": rows, "llama": llama, "llama_view": view,
            "llama_trace": browser.LLAMA_32 if any(r["key"] == "llama" for r in rows) else None}


def first_words(alert: str) -> str:
    """An alert's message as the page shows it, without its icon's name ("error")."""
    return next((line for line in alert.splitlines() if line.strip() and line.strip() != "error"), alert)


def swept(titan: dict[str, Any]) -> tuple[int, int, int] | None:
    """(positions swept, of how many, in how many seconds) as the 8B step's page said them; None before it did."""
    found = re.search(r"Swept (\d+) of (\d+) budgets in (\d+) s", titan["browser"]["sweep"]["said"])
    return tuple(map(int, found.groups())) if found else None


def page(results: dict[str, Any], header: str) -> str:
    browser = harness()
    titan = results.get("titan")
    return common.fill(
        "explorer", header=header, meta=results["meta"], chromium=browser.CHROMIUM, loads=loads(results),
        yardstick=results["yardstick_s"], slider=results["browser"]["slider_s"],
        paint=results["browser"]["first_paint_s"], sessions=sessions_facts(results),
        module_graph=module_graph_facts(results), regions_at_once=REGIONS_AT_ONCE, time_limit=TIME_LIMIT,
        run=results, browser=browser, share=SHARE, scrub_presses=SCRUB_PRESSES, ms=ms, first_words=first_words,
        swept=titan and swept(titan), traces=results["traces"], titan_8b=browser.TITAN_8B,
        titan_budget=browser.TITAN_8B_BUDGET, titan=titan, titan_run=titan_run(results),
        targets={
            "slider": SLIDER_TARGET, "first_paint": FIRST_PAINT_TARGET, "sessions": SESSIONS_TARGET,
            "module_view": MODULE_VIEW_TARGET, "sweep": SWEEP_TARGET, "fit": FIT_TARGET},
        secs=secs, spread=spread, against=against, p90=p90)


# -- the command ----------------------------------------------------------------------------------

def refusal(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, before anything is measured; None when they can."""
    why = common.page_refusal(args, DEFAULT_OUT, RECORD_PAGE)
    if why:
        return why
    if set(args.parts) != set(PARTS):
        if args.report_only:
            return "--report-only measures nothing: leave out --parts"
        if args.quick and args.parts == ["titan"]:
            return "--quick measures no 8B step: leave out --quick or --parts titan"
        if not common.results_file(args).is_file():
            return (f"--parts {' '.join(args.parts)} keeps the other parts from {common.results_file(args)}, which is "
                    "missing: run them first (leave out --parts)")
    if args.report_only:
        return None
    absent = harness().missing()
    if absent:
        return f"cannot drive the explorer in a browser: {absent}"
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed: the suite traces hf:gpt2 and hf:llama (pip install transformers)"
    return None


def main(args: argparse.Namespace) -> int:
    return common.run_page_suite("explorer", args, refusal(args), lambda: measure(args.quick, args.parts, args.out),
                                 common.page_writer(page, SOURCES))
