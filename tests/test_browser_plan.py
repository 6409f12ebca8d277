"""Issue 57 in Chromium (served and driven as in tests/test_browser.py): one FSDP rank's chart as high as
the rank's memory on both axes; the slider swept in the background, a drag meanwhile shown the nearest
solved plan, every position answered once it is done (times printed, none asserted). Slow: torchtitan's
8B step (5,970 ops) at its real size. Screenshots go to ``screenshots/`` (ignored)."""

from __future__ import annotations

import re
import time

import pytest

from explorer import browser as harness
from tests.test_browser import CHROMIUM, SHOTS, wait_idle
from tests.test_browser_events import no_exception

pytestmark = pytest.mark.skipif(not __import__("os").path.exists(CHROMIUM), reason="Debian's chromium is not installed")

# a Vega-Lite chart's y axis says its domain in words: "Y-axis titled 'T' for a linear scale with values from A to B"
Y_DOMAIN = """(title) => { const g = [...document.querySelectorAll('[data-testid="stVegaLiteChart"] [aria-label]')]
  .find(e => e.getAttribute('aria-label').startsWith(`Y-axis titled '${title}'`));
  return g ? g.getAttribute('aria-label') : ''; }"""
PROGRESS = """() => [...document.querySelectorAll('[data-testid="stSidebar"] [data-testid="stProgress"]')]
  .map(e => e.innerText).join(' ')"""
STAND_IN = "text=Not solved yet"


def y_top(pg, title: str) -> float:
    pg.wait_for_function(f"() => ({Y_DOMAIN})({title!r}) !== ''")
    words = pg.evaluate(Y_DOMAIN, title)
    return float(re.search(r"values from [-\d.,]+ to ([\d.,]+)", words).group(1).replace(",", ""))


# slow: in two of three whole default runs (two xdist workers) its upload waited 180 s for the graph's op count,
# alone it passes in 14 s; the slow stage runs what fails once more alone (.ci/run). upload_graph now reports
# the page's text when it happens.
@pytest.mark.slow
def test_one_ranks_chart_is_as_high_as_the_ranks_memory_on_both_axes(browser, server, tmp_path):
    """On the compute-time axis the chart stood at 800,000 MiB for a rank of about 105 GiB (8B step)."""
    from bonsai_core.allocator import replay
    from bonsai_core.graph import save_graph
    from bonsai_core.schedule import no_remat_peak, simulate
    from bonsai_core.solvers import solve
    from bonsai_core.trace import trace_model
    from explorer import rank
    from tests.test_app_events import FSDP_GPT

    graph = trace_model("gpt", fsdp=4, **FSDP_GPT).graph
    path = tmp_path / "gpt-fsdp4.json"
    save_graph(graph, path)
    # the chart's parts as the page stacks them: bonsai's plan at 85%, the allocator's extra on top
    schedule = solve(graph, int(0.85 * no_remat_peak(graph)), "bonsai", time_limit=20.0)
    sim, alloc = simulate(graph, schedule), replay(graph, schedule)
    parts = rank.breakdown(graph, schedule.ops, sim, alloc.reserved, alloc.live)
    peak_mib = float(sum(parts.values()).max()) / 2**20
    context, pg = harness.open_page(browser, width=1440, height=1800)
    try:
        harness.upload_graph(pg, server, path, graph.n, 85)
        pg.locator('[data-testid="stSidebarNav"] a[href$="/memory"]').click()
        pg.wait_for_selector("text=One rank's memory of 4")
        wait_idle(pg)
        on_time = y_top(pg, "memory per rank (MiB)")
        pg.get_by_text("schedule step").click()
        wait_idle(pg)
        pg.wait_for_function("() => [...document.querySelectorAll('[data-testid=\"stVegaLiteChart\"] [aria-label]')]"
                             ".filter(e => e.getAttribute('aria-label').startsWith(\"X-axis titled 'schedule step\")).length >= 2")
        on_steps = y_top(pg, "memory per rank (MiB)")
        print(f"one rank's chart tops out at {on_time:g} MiB on compute time, {on_steps:g} on steps; its parts "
              f"add up to {peak_mib:.2f} MiB at most")
        for top in (on_time, on_steps):  # the axis rounds up to a nice number above the stack's top
            assert peak_mib <= top <= 1.5 * peak_mib
        no_exception(pg)
    finally:
        context.close()


def wait_for_the_sweep(pg, timeout_s: float = 300) -> float:
    """Until the sidebar says the sweep is done: the seconds it says it took."""
    pg.wait_for_function(f"() => ({PROGRESS})().includes('done')", timeout=timeout_s * 1000)
    return float(re.search(r"in (\d+) s", pg.evaluate(PROGRESS)).group(1))


def test_the_slider_is_swept_and_then_every_position_answers_from_it(browser):
    """The default GPT: a drag while the sweep runs is answered (its own plan or the nearest solved one,
    marked), the sweep ends, then each drag finds its plan solved. Prints the times."""
    reference = harness.default_reference()
    with harness.serve(solve_ahead=True) as url:
        context, pg = harness.open_page(browser)
        try:
            start = time.perf_counter()
            pg.goto(f"{url}/memory?budget=70")
            wait_idle(pg)
            pg.wait_for_function(f"() => ({PROGRESS})().includes('Swept')")
            early, pct, _ = harness.timed_drag(pg, 0.6, reference)
            stood_in = pg.locator(STAND_IN).count() > 0
            swept = wait_for_the_sweep(pg)
            print(f"drag to {pct}% during the sweep: {early:.2f} s ({'the nearest solved plan' if stood_in else 'its own'}"
                  f"); the sweep: {swept:.0f} s ({time.perf_counter() - start:.1f} s from the first navigation)")
            pg.wait_for_selector(STAND_IN, state="detached")  # its own plan replaced the stand-in
            times = []
            for fraction in harness.DRAG_FRACTIONS:
                seconds, pct, _ = harness.timed_drag(pg, fraction, reference)
                times.append((pct, seconds))
                wait_idle(pg)
                assert pg.locator(STAND_IN).count() == 0
            print("after the sweep: " + ", ".join(f"{p}% {s:.2f} s" for p, s in times))
            no_exception(pg)
            pg.screenshot(path=str(SHOTS / "memory-swept.png"))
        finally:
            context.close()


@pytest.fixture(scope="module")
def titan_8b(tmp_path_factory):
    """Torchtitan's 8B step, one of 8 FSDP ranks (browser.TITAN_8B: 5,970 ops; 20-45 s and 0.7 GB to trace)
    saved as JSON: (path, graph)."""
    pytest.importorskip("torchtitan")
    from bonsai_core.graph import save_graph
    from bonsai_core.trace import trace_model

    name, options = harness.TITAN_8B
    graph = trace_model(name, **options).graph
    path = tmp_path_factory.mktemp("titan") / "llama3-8b.json"
    save_graph(graph, path)
    return path, graph


@pytest.mark.slow  # traces the 8B step, solves it at 70% and sweeps it (minutes)
def test_the_8b_step_reads_as_patterns_and_answers_drags_while_it_is_swept(browser, titan_8b):
    from bonsai_core.schedule import no_remat_peak

    path, graph = titan_8b
    with harness.serve(solve_ahead=True) as url:
        context, pg = harness.open_page(browser, width=1440, height=1800)
        try:
            found = harness.big_step(pg, url, path, graph.n, no_remat_peak(graph), drags=3, sweep_timeout=240)
            print(f"8B step: uploaded in {found['upload_s']:.1f} s, first plan on the Memory page "
                  f"{found['first_plan_s']:.1f} s; {found['rebuilds']} rebuilds in {found['patterns']} patterns, "
                  f"{found['legend']} legend entries; a drag to {found['during']['pct']}% during the sweep "
                  f"{found['during']['seconds']:.2f} s ({'the nearest solved plan' if found['during']['stand_in'] else 'its own'}, "
                  f"{found['during']['sweep']}); then {found['sweep']['said']}; after: "
                  + ", ".join(f"{p}% {s:.2f} s{' (nearest)' if near else ''}" for p, s, near in found["after"]))
            assert found["rebuilds"] > 3 * found["patterns"]  # one row per pattern, not per rebuild
            assert found["legend"] <= 12  # one colour per part of a block (9), not one per block (36)
            no_exception(pg)
            pg.screenshot(path=str(SHOTS / "memory-8b.png"), full_page=True)
        finally:
            context.close()
