"""The explorer's latencies: the budget slider, first paint, ten sessions dragging at once (solving ahead
on and off), the module graph and the tensor lifetimes, in headless Chromium as the browser tests drive
it (explorer/browser.py) and in-process for the parts the pages compute.

``--parts titan`` reruns torchtitan's 8B step alone (an hour on a loaded machine), ``--parts main`` the rest; the
parts not run are kept from ``--out``'s results.json. Needs Playwright for Python, Debian's Chromium and
transformers; latencies mean something on a quiet machine only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

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
# the targets the page judges medians by (seconds; the 8B step's sweep and What fits: issue 57), judged here
# only: the browser tests share a loaded machine
TARGETS = {"slider": 1.0, "first_paint": 3.0, "sessions": 2.0, "module_view": 2.0, "sweep": 60.0, "fit": 60.0}
SWEEP_PATIENCE = 3600.0  # seconds the run waits for the 8B step's sweep before it says how far it got
SCRUB_PRESSES = 10  # arrow-key steps of the scrubber, as tests/test_browser_timeline.py presses them
SHARE = 0.5  # the lifetimes' budget, of the no-remat peak
REGIONS_AT_ONCE = 12  # regions the "Why this plan" panel explains per click (pages/memory.py's WHY_AT_ONCE)
TIME_LIMIT = 20.0  # seconds per bonsai solve: the explorer's default (explorer/state.py)
LARGE_GPT = ("gpt", {"layers": 60})  # browser.LARGE_LINK's model
PARTS = ("main", "titan")  # --parts: the studies a run measures, the others kept from its --out
TITAN_PARTS = ("tracing the 8B step", "the 8B step in the browser", "What fits on the 8B step")  # timed_run's
# the lifetimes' rows (graph, method, share of the no-remat peak): hf:gpt2 at 55% as tests/test_browser_timeline.py
# opens it (bonsai's checkpoint regions reach 50.6% of its peak), chen on the 60-layer GPT as browser.LARGE_LINK
LIFETIMES = (("default", "bonsai", SHARE), ("gpt2", "bonsai", 0.55), ("large", "chen", SHARE))


def harness() -> ModuleType:
    """explorer/browser.py, the browser tests' harness, imported from the checkout when measuring."""
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
    """The module structure the Graph page computes once per graph, then per fold depth the boxes, their layout,
    their stats with the chart's spec; timed as ``explorer.compute.module_structure`` and the page call them."""
    browser = harness()
    from explorer import module_chart, module_graph

    def structure():
        tree = module_graph.module_tree(graph)
        return (tree, module_graph.forward_owners(graph, tree), module_graph.backward_anchors(graph),
                module_graph.default_depth(graph, tree))

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


def lifetimes_row(label: str, graph: Any, method: str, share: float) -> dict[str, Any]:
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
            "solve_s": solve_s, "bars": len(bars.start), "threshold": bars.threshold, "bars_s": bars_s,
            "chart_s": chart_s, "step_line_s": step_s, "regions": len(regions), "explained": len(todo),
            "reasons_s": reasons_s}


# -- measuring in the browser ---------------------------------------------------------------------

@contextlib.contextmanager
def served_to_chromium(solve_ahead: bool = False) -> Iterator[tuple[str, Any]]:
    """A fresh explorer server's URL (browser.serve) and a headless Chromium, both closed after."""
    from playwright.sync_api import sync_playwright

    browser = harness()
    with browser.serve(solve_ahead=solve_ahead) as url, sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser.CHROMIUM, args=browser.BROWSER_ARGS)
        try:
            yield url, chromium
        finally:
            chromium.close()


def no_exception(page: Any, what: str) -> None:
    if page.locator('[data-testid="stException"]').count():
        raise RuntimeError(f"the explorer showed an exception: {what}")


@contextlib.contextmanager
def new_session(chromium: Any, what: str, **size: int) -> Iterator[Any]:
    """A page in a new browser context (a new Streamlit session) for measuring ``what``, closed after."""
    context, page = harness().open_page(chromium, **size)
    try:
        yield page
        no_exception(page, what)
    finally:
        context.close()


def memory_page(chromium: Any, url: str, link: str, presses: int, key: str) -> dict[str, float]:
    """The Memory page ``link`` in a new page: seconds until both its charts are drawn, then until ``presses`` of
    ``key`` on the step scrubber changed the step line; with the link (the page names what was measured)."""
    browser = harness()
    page, seconds = browser.open_memory(chromium, f"{url}/{link}")
    try:
        no_exception(page, link)
        page.wait_for_timeout(1000)  # the charts' first draw settled, as the test waits before its step
        return {"link": link, "charts_s": seconds, "scrub_s": browser.scrub(page, key, presses)}
    finally:
        page.close()


def one_session_studies(counts: dict[str, int], llama: tuple[Path, int] | None, large: bool) -> dict[str, Any]:
    """Everything one session at a time measures, on one server that solves only what a session asks for (as in
    the browser tests), in the order a first visitor meets it; ``llama``: the 32-layer Llama's graph file and ops."""
    browser = harness()
    out: dict[str, Any] = {}
    with served_to_chromium() as (url, chromium):
        with new_session(chromium, "first paint") as page:
            out["first_paint_s"] = [browser.first_paint(page, url) for _ in range(counts["first_paints"])]
        out["memory_first"] = memory_page(chromium, url, "memory", SCRUB_PRESSES, "ArrowLeft")
        out["memory_again"] = memory_page(chromium, url, "memory", SCRUB_PRESSES, "ArrowLeft")
        reference = browser.default_reference()
        with new_session(chromium, "slider drags") as page:
            browser.open_memory_for_drags(page, url)
            out["slider_s"] = []
            for fraction in (browser.DRAG_FRACTIONS * counts["drags"])[:counts["drags"]]:
                out["slider_s"].append(browser.timed_drag(page, fraction, reference)[0])
                browser.wait_idle(page)
        with new_session(chromium, "the Graph page") as page:
            page.goto(url)
            browser.wait_idle(page)
            out["graph"] = {"first_s": browser.graph_drawn(page),
                            "again_s": browser.graph_revisits(page, counts["revisits"])}
        out["gpt2_link"] = memory_page(chromium, url, browser.GPT2_LINK, 1, "Home")
        if llama:
            with new_session(chromium, "the Llama's module view") as page:
                browser.upload_graph(page, url, *llama, browser.LLAMA_32_BUDGET)
                out["llama"] = {"first_s": browser.graph_drawn(page),
                                "again_s": browser.graph_revisits(page, counts["revisits"]),
                                "folds": [[depth, browser.fold_to(page, depth)] for depth in browser.FOLD_STEPS]}
        if large:
            out["large_link"] = memory_page(chromium, url, browser.LARGE_LINK, 1, "Home")
    return out


def sessions_study(solve_ahead: bool, counts: dict[str, int]) -> dict[str, Any]:
    """``counts["sessions"]`` sessions dragging at once on a fresh server (browser.measure_sessions)."""
    browser = harness()
    result = browser.measure_sessions(solve_ahead, browser.default_reference(), counts["sessions"], counts["rounds"])
    return {"solve_ahead": solve_ahead, **result}


def titan_study(path: Path, graph: Any, drags: int) -> dict[str, Any]:
    """Torchtitan's 8B step on a fresh server that sweeps (browser.big_step)."""
    browser = harness()
    with served_to_chromium(solve_ahead=True) as (url, chromium):
        with new_session(chromium, "the 8B step", width=1440, height=1800) as page:
            return browser.big_step(page, url, path, graph.n, no_remat_peak(graph), drags, SWEEP_PATIENCE)


def titan_fit(graph: Any) -> dict[str, Any]:
    """What fits on the 8B step as the page runs it by default (the GPU at twice the step's lower bound, the
    batch searched from the step's own, its graph not traced again); each answer's moment kept."""
    from bonsai_core import fit

    name, options = harness().TITAN_8B
    begun = time.perf_counter()
    answers: list[list[Any]] = []
    result = fit.fit(name, 2 * graph.peak_lower_bound, ["none", "bonsai", "chen", "dtr"], vary="batch",
                     max_overhead=0.1, options={k: v for k, v in options.items() if k != "batch"}, optimizer="adamw",
                     solver_options={"time_limit": 10.0}, start=options["batch"], traced={options["batch"]: graph},
                     answered=lambda a: answers.append([a.size, a.method, a.fits, time.perf_counter() - begun]))
    return {"seconds": time.perf_counter() - begun, "answers": answers, "traces": result.traces,
            "table": fit.markdown_table(result), "limit": result.limit}


# -- the run ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def timed_run(**extra: Any) -> Iterator[tuple[dict[str, Any], Callable[[str, Callable[[], Any]], Any]]]:
    """A run's meta (:func:`common.run_meta` with streamlit's version and ``extra``) and ``timed(name, fn)``:
    ``fn()``, its seconds and the 1-minute load average as it started and ended kept in the meta's
    ``parts[name]``; the meta's ``seconds`` kept as the run ends."""
    meta = common.run_meta(streamlit=importlib.metadata.version("streamlit"), **extra, parts={})
    start = time.perf_counter()

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        load_start = os.getloadavg()[0]
        out, seconds = seconds_of(fn)
        meta["parts"][name] = {"seconds": seconds, "load_start": load_start, "load_end": os.getloadavg()[0]}
        print(f"{name}: {seconds:.1f} s", flush=True)
        return out

    yield meta, timed
    meta["seconds"] = time.perf_counter() - start


def measure(quick: bool, parts: Sequence[str] = PARTS, out: str = DEFAULT_OUT) -> dict[str, Any]:
    """The studies ``parts`` names (:data:`PARTS`), run now; the others kept from ``out``/results.json."""
    stored = Path(out) / "results.json"
    results = json.loads(stored.read_text()) if set(parts) != set(PARTS) and stored.is_file() else {}
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


def titan_of_its_run(titan: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The 8B step's results kept beside a new run of the other parts: with the run that measured them (from its
    ``meta`` where that run measured everything)."""
    run = titan.get("run") or {**{k: meta[k] for k in ("command", "date", "machine")},
                                "parts": {n: p for n, p in meta["parts"].items() if n in TITAN_PARTS},
                                "seconds": sum(p["seconds"] for n, p in meta["parts"].items() if n in TITAN_PARTS)}
    return {**titan, "run": {**run, "alone": True}}


def without_titan_parts(meta: dict[str, Any]) -> dict[str, Any]:
    """A run's ``meta`` less the 8B step's timed parts (their seconds and load averages), for a page whose 8B
    step another run measured."""
    mine = {name: part for name, part in meta["parts"].items() if name in TITAN_PARTS}
    return {**meta, "parts": {name: part for name, part in meta["parts"].items() if name not in mine},
            "seconds": meta["seconds"] - sum(part["seconds"] for part in mine.values())}


def measure_main(quick: bool) -> dict[str, Any]:
    """Everything but the 8B step: the default GPT, hf:gpt2 and, unless ``quick``, the 32-layer Llama and the
    60-layer GPT, in-process and in Chromium."""
    browser = harness()
    counts = QUICK if quick else FULL
    with timed_run(quick=quick, counts=counts) as (meta, timed), tempfile.TemporaryDirectory() as folder:
        results: dict[str, Any] = {"meta": meta, "yardstick_s": timed("yardstick", browser.yardstick_seconds)}
        graphs = timed("tracing", lambda: graphs_to_measure(quick))
        results["traces"] = [{"graph": g["label"], "ops": g["graph"].n, "trace_s": g["trace_s"]}
                             for g in graphs.values() if g["trace_s"] is not None]
        module_keys = [k for k in ("default", "llama") if k in graphs]
        results["module_graph"] = timed("module graph in-process", lambda: [
            module_structure_row(k, graphs[k]["label"], graphs[k]["graph"]) for k in module_keys])
        results["lifetimes"] = timed("lifetimes in-process", lambda: [
            lifetimes_row(graphs[k]["label"], graphs[k]["graph"], m, s) for k, m, s in LIFETIMES if k in graphs])
        llama = None
        if "llama" in graphs:
            llama = (Path(folder) / "llama32.json", graphs["llama"]["graph"].n)
            save_graph(graphs["llama"]["graph"], llama[0])
        results["browser"] = timed("one session at a time", lambda: one_session_studies(counts, llama, not quick))
        results["sessions"] = [timed(f"sessions, solving ahead {'on' if ahead else 'off'}",
                                     lambda: sessions_study(ahead, counts)) for ahead in (True, False)]
    return results


def measure_titan(drags: int) -> dict[str, Any]:
    """Torchtitan's 8B step: traced, in Chromium (uploaded, swept, ``drags`` drags after the sweep) and What fits;
    with the run that measured it (``run``: its command, date, machine, seconds and the parts' load averages)."""
    name, options = harness().TITAN_8B
    with timed_run() as (run, timed), tempfile.TemporaryDirectory() as folder:
        titan = timed("tracing the 8B step", lambda: traced(name, options, "torchtitan's 8B step"))
        results: dict[str, Any] = {"ops": titan["graph"].n, "trace_s": titan["trace_s"], "run": run}
        path = Path(folder) / "llama3-8b.json"
        save_graph(titan["graph"], path)
        results["browser"] = timed("the 8B step in the browser", lambda: titan_study(path, titan["graph"], drags))
        results["fit"] = timed("What fits on the 8B step", lambda: titan_fit(titan["graph"]))
    return results


# -- the page ---------------------------------------------------------------------------------------

def loads(results: dict[str, Any]) -> list[float]:
    """The 1-minute load averages at the starts and ends of the run's parts and the sessions' drags."""
    run = (results.get("titan") or {}).get("run")
    runs = [results["meta"]] + ([run] if run is not None and not run["alone"] else [])
    said = [x for run in runs for part in run["parts"].values() for x in (part["load_start"], part["load_end"])]
    return said + [s[key][0] for s in results["sessions"] for key in ("load_before", "load_after")]


def titan_run(results: dict[str, Any]) -> dict[str, Any] | None:
    """The run that measured the 8B step where it is not the one the page's first lines name (None when it is)."""
    run = (results.get("titan") or {}).get("run")
    if run is None or not run["alone"]:
        return None
    loads = [x for part in run["parts"].values() for x in (part["load_start"], part["load_end"])]
    return {**run, "minutes": run["seconds"] / 60, "load_low": min(loads), "load_high": max(loads)}


def first_words(alert: str) -> str:
    """An alert's message as the page shows it, without its icon's name ("error")."""
    return next((line for line in alert.splitlines() if line.strip() and line.strip() != "error"), alert)


def swept(titan: dict[str, Any]) -> tuple[int, int, int] | None:
    """(positions swept, of how many, in how many seconds) as the 8B step's page said them; None before it did."""
    found = re.search(r"Swept (\d+) of (\d+) budgets in (\d+) s", titan["browser"]["sweep"]["said"])
    return tuple(map(int, found.groups())) if found else None


def page(results: dict[str, Any], header: str) -> str:
    titan = results.get("titan")
    return common.fill("explorer", header=header, run=results, meta=results["meta"], browser=harness(),
                       loads=loads(results), titan=titan, titan_run=titan_run(results), swept=titan and swept(titan),
                       first_words=first_words, targets=TARGETS, share=SHARE, scrub_presses=SCRUB_PRESSES,
                       regions_at_once=REGIONS_AT_ONCE, time_limit=TIME_LIMIT)


# -- the command ----------------------------------------------------------------------------------

def refusal(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, before anything is measured; None when they can."""
    if why := common.page_refusal(args, DEFAULT_OUT, RECORD_PAGE):
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
    if absent := harness().missing():
        return f"cannot drive the explorer in a browser: {absent}"
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed: the suite traces hf:gpt2 and hf:llama (pip install transformers)"
    return None


def main(args: argparse.Namespace) -> int:
    return common.run_page_suite("explorer", args, refusal(args), lambda: measure(args.quick, args.parts, args.out),
                                 common.page_writer(page, SOURCES))
