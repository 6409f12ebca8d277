"""The explorer in a real browser: served with the README's command, driven by headless Chromium.

Visits every page, drags the budget slider on the memory page and waits for the plot's budget line
to move, timing slider release -> plot updated; ten sessions drag at once (slow); the sweep's Pareto
line is sampled pixel by pixel in the light and the dark theme. Screenshots go to ``screenshots/``
(ignored by git). Skips only when Debian's chromium is not installed (``apt-get install -y chromium``).
"""

from __future__ import annotations

import io
import math
import os
import statistics
import time
from pathlib import Path

import pytest

from explorer.browser import (CHART_CANVAS, CHART_TEXT, CHROMIUM, DRAG_FRACTIONS, budget_annotation,
                             default_reference, first_paint, measure_sessions, open_memory_for_drags,
                             timed_drag, wait_idle, yardstick_seconds)

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "screenshots"
# page -> (URL path, whether it opens with a plot)
PAGES = {"model": ("", False), "graph": ("graph", True), "solve": ("solve", True), "memory": ("memory", True),
         "compare": ("compare", False), "fit": ("fit", False), "export": ("export", False)}
# colour schemes a test is drawn in: the light one in the default run, the dark one in the slow stage
THEMES = ["light", pytest.param("dark", marks=pytest.mark.slow)]

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


def yardstick() -> str:
    """This machine's speed, so that reports from different machines can be compared (the project's
    2-core machines differ between sessions): the best of five runs of a fixed pure-Python loop, on one core."""
    return f"yardstick (a fixed Python loop, best of 5): {yardstick_seconds():.3f} s on one of {os.cpu_count()} CPUs"


@pytest.fixture(scope="module")
def page(browser):
    pg = browser.new_page(viewport={"width": 1440, "height": 1000})
    pg.set_default_timeout(60_000)
    yield pg
    pg.close()


def test_every_page_renders_without_an_exception(page, server):
    for name, (path, has_plot) in PAGES.items():
        start = time.perf_counter()
        page.goto(f"{server}/{path}")
        wait_idle(page)
        assert "Page not found" not in page.content(), name
        if has_plot:  # a Plotly figure's traces, or the memory chart's labels (Vega-Lite)
            page.wait_for_selector('[data-testid="stPlotlyChart"] .main-svg .scatterlayer .trace, '
                                   + CHART_TEXT)
        page.wait_for_timeout(500)  # let the charts finish their transitions before the screenshot
        assert page.locator('[data-testid="stException"]').count() == 0, name
        page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
        print(f"{name}: {time.perf_counter() - start:.2f} s")


@pytest.mark.slow  # the search traces the model at a dozen batch sizes (about 20 s); tests/test_fit.py runs it in AppTest
def test_the_fit_search_runs_in_the_browser(page, server):
    """The search, its table and its chart (the compare page's sweep runs in the Pareto test below)."""
    page.goto(f"{server}/fit")
    wait_idle(page)
    page.get_by_role("button", name="Find what fits").click()
    page.wait_for_selector('[data-testid="stPlotlyChart"] .main-svg .scatterlayer .trace', timeout=240_000)
    wait_idle(page)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.get_by_text("Largest batch within").count() == 1
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "fit-search.png"), full_page=True)


def test_a_fresh_session_paints_the_default_model(page, server):
    """A fresh session on a running server shows the model's summary; the time it takes is printed and
    measured against its 3 s target by ``bonsai bench explorer`` (docs/results/explorer.md), not asserted
    here, where other tests share the machine."""
    times = [first_paint(page, server) for _ in range(3)]
    print("first paint (s):", " ".join(f"{t:.3f}" for t in times))
    (SHOTS / "first-paint.txt").write_text(" ".join(f"{t:.4f}" for t in times) + "\n")


def redrawn_elements(frames: list[bytes]) -> list[str]:
    """The kinds of the elements Streamlit (re)drew in these websocket frames, e.g. ["slider", "markdown"]."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    kinds = []
    for payload in frames:
        msg = ForwardMsg()
        msg.ParseFromString(payload)
        if msg.WhichOneof("type") == "delta" and msg.delta.WhichOneof("type") == "new_element":
            kinds.append(msg.delta.new_element.WhichOneof("type"))
    return kinds


def test_budget_slider_moves_the_memory_plot_in_place(page, server):
    """Each drag reruns the budget's fragment alone and updates the same chart; its latency is printed and
    measured against its 1 s target by ``bonsai bench explorer`` (docs/results/explorer.md)."""
    frames: list[bytes] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda p: frames.append(p) if isinstance(p, bytes) else None))
    open_memory_for_drags(page, server)
    reference = default_reference()
    page.evaluate(f"() => {{ window.memoryCanvas = document.querySelector('{CHART_CANVAS}'); }}")
    latencies = []
    for i, fraction in enumerate(DRAG_FRACTIONS):
        before = budget_annotation(page)
        frames.clear()
        seconds, pct, expected = timed_drag(page, fraction, reference)
        latencies.append(seconds)
        assert budget_annotation(page) != before
        wait_idle(page)
        assert page.locator('[data-testid="stException"]').count() == 0
        # the drag reran the budget's fragment alone (state.budget_fragment): the slider, its caption in the
        # sidebar, the plot and the table; not the page's title, its other widgets or the rest of the sidebar
        redrawn = redrawn_elements(frames)
        assert "vega_lite_chart" in redrawn and "slider" in redrawn, redrawn
        assert not {"heading", "selectbox", "multiselect", "radio", "text_input"} & set(redrawn), redrawn
        assert page.locator('[data-testid="stSidebar"]').get_by_text(expected.removeprefix("budget ")).count() >= 1
        assert f"budget={pct}" in page.url
        if i == 0:
            page.screenshot(path=str(SHOTS / "memory-after-drag.png"), full_page=True)
    # the drags changed the chart's data in place (plots.memory_chart): the same chart, never a new one
    assert page.evaluate(f"() => window.memoryCanvas === document.querySelector('{CHART_CANVAS}')")
    median = statistics.median(latencies)
    print("slider release -> plot updated (s):", " ".join(f"{x:.3f}" for x in latencies), f"median {median:.3f}")
    (SHOTS / "latency.txt").write_text(" ".join(f"{x:.4f}" for x in latencies) + f"\nmedian {median:.4f}\n"
                             + yardstick() + "\n")


# -- both themes: the Pareto line must stand out from the background ---------------------------------

PARETO_PIXELS = """() => {
    // points along the Pareto front's path, in page pixels, and the plot's background colour
    const plot = [...document.querySelectorAll('[data-testid="stPlotlyChart"] .js-plotly-plot')]
        .find(p => p.data && p.data.some(t => t.name === 'Pareto front'));
    const i = plot.data.findIndex(t => t.name === 'Pareto front');
    const traces = plot.querySelectorAll('.scatterlayer .trace');
    // leave only the Pareto line drawn, so that no other trace, grid or axis line is sampled
    traces.forEach((t, k) => { if (k !== i) t.style.visibility = 'hidden'; });
    plot.querySelectorAll('.gridlayer, .zerolinelayer, .xlines-above, .ylines-above, .legend, .annotation')
        .forEach(e => e.style.visibility = 'hidden');
    const path = traces[i].querySelector('path.js-line');
    const m = path.getScreenCTM(), n = 200, L = path.getTotalLength(), pts = [];
    for (let k = 0; k <= n; k++) {
        const p = path.getPointAtLength(L * k / n);
        pts.push([m.a * p.x + m.c * p.y + m.e + window.scrollX, m.b * p.x + m.d * p.y + m.f + window.scrollY]);
    }
    const app = getComputedStyle(document.querySelector('[data-testid="stApp"]')).backgroundColor;
    const r = plot.getBoundingClientRect();
    return {pts, stroke: getComputedStyle(path).stroke, app,
            box: [r.left + window.scrollX, r.top + window.scrollY, r.right + window.scrollX, r.bottom + window.scrollY]};
}"""


def luminance(rgb) -> float:
    lin = [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in (c / 255 for c in rgb[:3])]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a, b) -> float:
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("scheme", THEMES)
def test_the_pareto_line_stands_out_in_the_light_and_the_dark_theme(browser, server, scheme):
    """Streamlit follows the browser's colour scheme (no theme in .streamlit/config.toml): the sweep's
    Pareto line, sampled pixel by pixel in a screenshot, must contrast with the app's background."""
    from PIL import Image

    context = browser.new_context(viewport={"width": 1440, "height": 1000}, color_scheme=scheme)
    try:
        pg = context.new_page()
        pg.set_default_timeout(120_000)
        pg.goto(f"{server}/compare")
        wait_idle(pg)
        pg.get_by_role("button", name="Run the sweep").click()
        pg.wait_for_selector('[data-testid="stPlotlyChart"] .main-svg .scatterlayer .trace')
        wait_idle(pg)
        pg.wait_for_timeout(500)
        pg.screenshot(path=str(SHOTS / f"compare-sweep-{scheme}.png"), full_page=True)
        found = pg.evaluate(PARETO_PIXELS)
        shot = Image.open(io.BytesIO(pg.screenshot(full_page=True))).convert("RGB")
    finally:
        context.close()
    # the plot's background: its most common pixel colour
    background = max(shot.crop(tuple(int(v) for v in found["box"])).getcolors(1 << 24))[1]
    app = [int(x) for x in found["app"][found["app"].index("(") + 1:-1].split(",")[:3]]
    assert (luminance(app) < 0.2) == (scheme == "dark"), found["app"]  # the theme followed the browser
    assert (luminance(background) < 0.2) == (scheme == "dark"), background
    # the best pixel within a pixel of each point (the line is dotted and anti-aliased)
    best = [max(contrast(shot.getpixel((int(x) + dx, int(y) + dy)), background) for dx in (-1, 0, 1)
                for dy in (-1, 0, 1)) for x, y in found["pts"] if 1 <= x < shot.width - 1 and 1 <= y < shot.height - 1]
    visible = sum(c >= 3.0 for c in best) / len(best)
    print(f"{scheme}: stroke {found['stroke']} on {found['app']}: {100 * visible:.0f}% of {len(best)} points "
          "at contrast >= 3")
    assert visible >= 0.5  # dots and gaps: at least the dots stand out


# -- ten sessions at once ------------------------------------------------------------------------------

SESSIONS = 10
ROUNDS = 3


def summary(xs) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs):.3f}, p90 {xs[int(0.9 * (len(xs) - 1))]:.3f}, max {xs[-1]:.3f}"


def measure_ten_sessions(solve_ahead: bool, reference: int) -> tuple[str, float]:
    """Ten sessions dragging on a fresh server (``explorer.browser.many_sessions``): the report's
    lines and the server's CPU seconds per drag."""
    try:
        result = measure_sessions(solve_ahead, reference, SESSIONS, ROUNDS, shots=SHOTS)
    except TimeoutError as e:
        pytest.fail(str(e))
    drawn, answered = result["drawn"], result["answered"]
    assert len(drawn) == SESSIONS * ROUNDS and all(x > 0 for x in drawn)
    assert all(0 < x < math.inf for x in answered)  # every drag's rerun reached its own session
    assert all(result["in_place"])  # under load too, every drag changed the chart's data in place
    mode = ("solve ahead on (the server's default): the slider's positions solved in the background after each "
            "session's first solve" if solve_ahead else "solve ahead off (BONSAI_SOLVE_AHEAD=0): every drag a fresh "
            "solve, or a plan reused across budgets")
    load_before, load_after = result["load_before"], result["load_after"]
    report = (f"{mode}; the drags began once the server was idle, {result['waited']:.1f} s after the pages had loaded\n"
              f"{SESSIONS} sessions x {ROUNDS} rounds, slider release -> plot updated (s): {summary(drawn)}; "
              f"-> server's rerun arrived: {summary(answered)}; server CPU {result['server_cpu']:.2f} s for the "
              f"{len(drawn)} drags ({result['server_cpu'] / len(drawn):.3f} s each); the tabs' Chromium processes "
              f"{result['browser_cpu']:.2f} s\n"
              f"plot updated: {' '.join(f'{x:.3f}' for x in drawn)}\n"
              f"server answered: {' '.join(f'{x:.3f}' for x in answered)}\n"
              f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
              f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} CPUs)\n"
              f"{yardstick()}\n")
    return report, result["server_cpu"] / len(drawn)


@pytest.mark.slow
def test_ten_sessions_dragging_at_once_all_see_their_plot_update():
    """A classroom: ten browser sessions on a fresh server drag their budget sliders at the same
    moment, three times; every drag updates its own session's plot. Measured twice: as the server
    runs by default (solving the slider's positions ahead, explorer/ahead.py) and with that off (each
    drag a fresh solve). The latencies are a measurement, written to screenshots/concurrent-latency.txt
    (the target, median <= 2 s, is judged from that report on an idle machine and by `bonsai bench
    explorer` in docs/results/explorer.md, not asserted: a loaded machine would fail it). Besides "plot
    updated" the report gives "server answered" (the rerun's last message arrived). The ten tabs draw on
    the same two cores as the server, at the lowest priority (as if each ran on its own machine, as in a
    classroom, except that their drawing still takes the cores' spare time)."""
    reference = default_reference()
    SHOTS.mkdir(exist_ok=True)
    (ahead, ahead_cpu), (fresh, fresh_cpu) = measure_ten_sessions(True, reference), measure_ten_sessions(False, reference)
    print(ahead + "\n" + fresh)
    (SHOTS / "concurrent-latency.txt").write_text(ahead + "\n" + fresh)
    # CPU, not wall-clock: a drag that finds its plan solved costs the server only its rerun. How much a
    # fresh drag costs more depends on how many of the 30 budgets reuse a plan solved at another
    # (measured per drag: 0.04-0.06 against 0.15-0.18 CPU-s, and 0.063 against 0.088 in CI on 2026-12-03);
    # with solving ahead not running, the two would be the same work
    assert ahead_cpu < fresh_cpu
