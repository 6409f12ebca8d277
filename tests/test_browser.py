"""The explorer in a real browser: served with the README's command, driven by headless Chromium.

Visits every page, drags the budget slider on the memory page and waits for the plot's budget line
to move, timing slider release -> plot updated; ten sessions drag at once (slow); the sweep's Pareto
line is sampled pixel by pixel in the light and the dark theme. Screenshots go to ``screenshots/``
(ignored by git). Skips only when Debian's chromium is not installed (``apt-get install -y chromium``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

import pytest

from bonsai_core.graph import load_graph
from bonsai_core.schedule import no_remat_peak
from bonsai_core.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / "screenshots"
# page -> (URL path, whether it opens with a plot)
PAGES = {"model": ("", False), "graph": ("graph", True), "solve": ("solve", True), "memory": ("memory", True),
         "compare": ("compare", False), "fit": ("fit", False), "export": ("export", False)}
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]

# the memory chart (Vega-Lite, "hybrid" renderer): its marks on a canvas, its labels as SVG text
CHART_TEXT = '[data-testid="stVegaLiteChart"] text'
CHART_CANVAS = '[data-testid="stVegaLiteChart"] canvas'
# colour schemes a test is drawn in: the light one in the default run, the dark one in the slow stage
THEMES = ["light", pytest.param("dark", marks=pytest.mark.slow)]

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_PIDS: dict[str, int] = {}  # url -> the streamlit process serving it


def yardstick() -> str:
    """This machine's speed, so that reports from different machines can be compared (the project's
    2-core machines differ between sessions: the server's CPU per drag in the ten-session test was 0.04-0.06 s
    on one and 0.017-0.022 s on another): the best of five runs of a fixed pure-Python loop, on one core."""
    best = min(timeit.repeat("sum(i * i for i in range(3 * 10**6))", number=1, repeat=5))
    return f"yardstick (a fixed Python loop, best of 5): {best:.3f} s on one of {os.cpu_count()} CPUs"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def serve(solve_ahead: bool = False):
    """``streamlit run explorer/app.py`` (the README's command), headless on a free port; stopped on exit.
    Without ``solve_ahead`` the server solves only what a session asks for (``BONSAI_SOLVE_AHEAD=0``,
    as in the whole test run: tests/conftest.py), so a drag measures a fresh solve."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "explorer/app.py", "--server.headless", "true",
         "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
        env=os.environ | {"BONSAI_SOLVE_AHEAD": "1" if solve_ahead else "0"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail("streamlit exited: " + log.read())
            time.sleep(0.2)
    try:
        SERVER_PIDS[url] = proc.pid
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def page(browser):
    pg = browser.new_page(viewport={"width": 1440, "height": 1000})
    pg.set_default_timeout(60_000)
    yield pg
    pg.close()


def wait_idle(page) -> None:
    """Wait for the page's own title, then until Streamlit's 'running' status widget has gone."""
    page.wait_for_selector('[data-testid="stMain"] h1')
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)


def budget_annotation(page) -> str:
    return page.evaluate("""() => [...document.querySelectorAll('""" + CHART_TEXT + """')]
                               .map(e => e.textContent).find(t => t.startsWith('budget')) || ''""")


def drag_budget(page, fraction: float) -> float:
    """Press the budget slider's thumb, move it to ``fraction`` of the track and release it;
    returns the ``perf_counter`` time just before the release."""
    slider = page.locator('[data-testid="stSlider"]').filter(has_text="Memory budget").first
    track = slider.locator('[role="group"] > div').first.bounding_box()
    box = slider.locator('input[type="range"]').locator("xpath=../..").bounding_box()  # the thumb
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(track["x"] + fraction * track["width"], box["y"] + box["height"] / 2, steps=2)
    released = time.perf_counter()
    page.mouse.up()
    return released


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


def test_first_paint_of_the_default_model_within_three_seconds(page, server):
    """A fresh session on a running server: from navigation to the model's summary on screen."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        page.goto(server)
        page.wait_for_selector('[data-testid="stMetric"]')
        times.append(time.perf_counter() - start)
        wait_idle(page)
    print("first paint (s):", " ".join(f"{t:.3f}" for t in times))
    (SHOTS / "first-paint.txt").write_text(" ".join(f"{t:.4f}" for t in times) + "\n")
    assert statistics.median(times) <= 3.0


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


def test_budget_slider_moves_the_memory_plot_within_a_second(page, server):
    frames: list[bytes] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda p: frames.append(p) if isinstance(p, bytes) else None))
    page.goto(f"{server}/memory")
    wait_idle(page)
    # the tour's "drag the budget" step reruns the whole app once when done (explorer/tour.py): closed
    # here, so every drag below reruns the budget's fragment alone
    page.get_by_role("button", name="Close tour").click()
    page.get_by_role("button", name="Close tour").wait_for(state="detached")  # the close's whole-app rerun ran
    wait_idle(page)
    page.wait_for_selector(CHART_TEXT)
    # every Vega-Lite chart of the page (the memory chart first, the tensor lifetimes under it) drawn
    # before the memory chart's canvas is taken
    page.wait_for_function("() => { const charts = document.querySelectorAll('[data-testid=\"stVegaLiteChart\"]');"
                           " return charts.length >= 2 && [...charts].every(c => c.querySelector('canvas')); }")
    reference = no_remat_peak(load_graph(ROOT / "assets" / "gpt-default.json"))
    page.evaluate(f"() => {{ window.memoryCanvas = document.querySelector('{CHART_CANVAS}'); }}")
    latencies = []
    for i, fraction in enumerate((0.9, 0.75, 0.95, 0.8, 1.0, 0.85, 0.97)):
        before = budget_annotation(page)
        frames.clear()
        start = drag_budget(page, fraction)
        # the value the slider settled on, read in the browser: the plot must show exactly its budget
        pct = int(page.locator('[data-testid="stSlider"]').filter(has_text="Memory budget").first
                  .locator('input[type="range"]').get_attribute("value"))
        expected = "budget " + format_bytes(math.floor(pct / 100 * reference))
        page.wait_for_function(ANNOTATION_IS, arg=expected)
        latencies.append(time.perf_counter() - start)
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
    assert median <= 1.0


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
SLIDER = '[data-testid="stSlider"]:has-text("Memory budget")'
ANNOTATION_IS = """(expected) => [...document.querySelectorAll('""" + CHART_TEXT + """')]
                       .map(e => e.textContent).some(t => t === expected)"""


def record_script_ends(pg) -> list[float]:
    """The moments (``time.perf_counter``) at which ``pg`` receives Streamlit's "script finished"
    message: the server has sent all of a rerun. Attach before the page connects."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    ends: list[float] = []

    def on_frame(payload):
        if isinstance(payload, bytes):
            msg = ForwardMsg()
            msg.ParseFromString(payload)
            if msg.WhichOneof("type") == "script_finished":
                ends.append(time.perf_counter())

    pg.on("websocket", lambda ws: ws.on("framereceived", on_frame))
    return ends


async def drag_and_time(pg, pct: int, reference: int, script_ends: list[float]) -> tuple[float, float]:
    """Drag this session's budget slider to about ``pct``% and return the seconds from the release
    until (a) its memory plot's budget line shows exactly the budget the slider settled on, and (b) the
    server's rerun for it had finished arriving (``script_ends``, from :func:`record_script_ends`)."""
    slider = pg.locator(SLIDER).first
    track = await slider.locator('[role="group"] > div').first.bounding_box()
    thumb = await slider.locator('input[type="range"]').locator("xpath=../..").bounding_box()
    y = thumb["y"] + thumb["height"] / 2
    await pg.mouse.move(thumb["x"] + thumb["width"] / 2, y)
    await pg.mouse.down()
    await pg.mouse.move(track["x"] + (pct - 5) / 95 * track["width"], y, steps=2)
    released = time.perf_counter()
    await pg.mouse.up()
    settled = int(await slider.locator('input[type="range"]').get_attribute("value"))
    # polled every 50 ms: the default (every animation frame, in ten tabs at once) takes CPU the server needs
    await pg.wait_for_function(ANNOTATION_IS, arg="budget " + format_bytes(math.floor(settled / 100 * reference)),
                               polling=50)
    drawn = time.perf_counter() - released
    deadline = time.perf_counter() + 60  # the plot can be drawn before the rerun's last message arrives
    while not any(t > released for t in script_ends) and time.perf_counter() < deadline:
        await asyncio.sleep(0.02)
    answered = min((t for t in script_ends if t > released), default=math.inf) - released
    return drawn, answered


@contextlib.contextmanager
def browsers_at_lowest_priority():
    """While inside, every thread of every Chromium process this test started runs at ``nice 19``
    (re-applied every half second: Chromium sets its own threads' priorities). In a classroom each
    browser draws on its own machine; here ten tabs share the server's two cores and take the
    server's turn (medians measured without this: 5.1 and 5.6 s; with it: 3.4 to 4.6 s)."""
    stop = threading.Event()

    def ours() -> list[int]:
        parent = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                parent[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        mine, grew = {os.getpid()}, True
        while grew:
            grew = False
            for pid, ppid in parent.items():
                if ppid in mine and pid not in mine:
                    mine.add(pid)
                    grew = True
        chromium = []
        for pid in mine:
            with contextlib.suppress(OSError):  # a process may exit while we look
                if "chrom" in Path(f"/proc/{pid}/comm").read_text(errors="ignore"):
                    chromium.append(pid)
        return chromium

    def renice():
        while not stop.wait(0.5):
            for pid in ours():
                with contextlib.suppress(OSError):
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        with contextlib.suppress(OSError):
                            os.setpriority(os.PRIO_PROCESS, int(tid), 19)

    worker = threading.Thread(target=renice, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


async def server_idle(pid: int, timeout: float = 120.0) -> float:
    """Wait until the server process has used under 0.05 CPU-seconds in one second (the solves it
    runs in the background after the pages' first solves are done); the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        before = cpu_seconds(pid)
        await asyncio.sleep(1.0)
        if cpu_seconds(pid) - before < 0.05:
            break
    return time.perf_counter() - start


async def ten_sessions(url: str, reference: int) -> tuple[list[tuple[float, float]], float, float]:
    """One browser, SESSIONS contexts (separate Streamlit sessions) on the memory page; once they
    have all drawn it and the server is idle, ROUNDS times every session drags to its own new budget
    at the same moment. Returns (plot updated, server's rerun arrived) latencies per drag, the CPU
    seconds the server used over the drags (on a small shared machine the ten tabs' own rendering
    competes with the server; this separates the two) and the seconds waited for the server."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            pages, ends = [], []
            for _ in range(SESSIONS):
                pg = await (await browser.new_context(viewport={"width": 1280, "height": 900})).new_page()
                pg.set_default_timeout(120_000)
                ends.append(record_script_ends(pg))
                pages.append(pg)

            for pg in pages:  # one after the other: ten tabs parsing Streamlit's bundle at once time out here
                await pg.goto(f"{url}/memory", wait_until="commit")
                await pg.wait_for_selector('[data-testid="stVegaLiteChart"] text')
                await pg.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')")
            waited = await server_idle(SERVER_PIDS[url])
            for pg in pages:
                await pg.evaluate(f"() => {{ window.memoryCanvas = document.querySelector('{CHART_CANVAS}'); }}")
            latencies = []
            server_cpu = cpu_seconds(SERVER_PIDS[url])
            for r in range(ROUNDS):  # 30 different budgets between 66% and 97%
                latencies += await asyncio.gather(*(drag_and_time(pg, 66 + 3 * i + r, reference, ends[i])
                                                    for i, pg in enumerate(pages)))
            server_cpu = cpu_seconds(SERVER_PIDS[url]) - server_cpu
            for pg in pages:  # under load too, every drag changed the chart's data in place
                assert await pg.evaluate(f"() => window.memoryCanvas === document.querySelector('{CHART_CANVAS}')")
            await pages[0].screenshot(path=str(SHOTS / "memory-concurrent.png"), full_page=True)
            return latencies, server_cpu, waited
        finally:
            await browser.close()


def summary(xs) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs):.3f}, p90 {xs[int(0.9 * (len(xs) - 1))]:.3f}, max {xs[-1]:.3f}"


def measure_ten_sessions(solve_ahead: bool, reference: int) -> tuple[str, float]:
    """Ten sessions dragging on a fresh server (:func:`ten_sessions`): the report's lines and the
    server's CPU seconds per drag."""
    result: dict = {}

    def drive(url):  # the async API in its own thread: the module's sync Playwright owns this one's loop
        try:
            result["latencies"], result["server_cpu"], result["waited"] = asyncio.run(ten_sessions(url, reference))
        except Exception as e:  # re-raised in the test's thread
            result["error"] = e

    with serve(solve_ahead) as url, browsers_at_lowest_priority():
        load_before = os.getloadavg()
        worker = threading.Thread(target=drive, args=(url,), daemon=True)
        worker.start()
        worker.join(timeout=600)
        load_after = os.getloadavg()
    assert not worker.is_alive(), "the ten sessions did not finish within 600 s"
    if "error" in result:
        raise result["error"]
    drawn, answered = zip(*result["latencies"])
    assert len(drawn) == SESSIONS * ROUNDS and all(x > 0 for x in drawn)
    assert all(0 < x < math.inf for x in answered)  # every drag's rerun reached its own session
    mode = ("solve ahead on (the server's default): the slider's positions solved in the background after each "
            "session's first solve" if solve_ahead else "solve ahead off (BONSAI_SOLVE_AHEAD=0): every drag a fresh "
            "solve, or a plan reused across budgets")
    report = (f"{mode}; the drags began once the server was idle, {result['waited']:.1f} s after the pages had loaded\n"
            f"{SESSIONS} sessions x {ROUNDS} rounds, slider release -> plot updated (s): {summary(drawn)}; "
            f"-> server's rerun arrived: {summary(answered)}; server CPU {result['server_cpu']:.2f} s for the "
            f"{len(drawn)} drags ({result['server_cpu'] / len(drawn):.3f} s each)\n"
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
    (the target, median <= 2 s, is judged from that report on an idle machine and in docs/EXPLORER.md,
    not asserted: a loaded machine would fail it). Besides "plot updated" the report gives "server
    answered" (the rerun's last message arrived). The ten tabs draw on the same two cores as the
    server, at the lowest priority (as if each ran on its own machine, as in a classroom, except that
    their drawing still takes the cores' spare time)."""
    reference = no_remat_peak(load_graph(ROOT / "assets" / "gpt-default.json"))
    SHOTS.mkdir(exist_ok=True)
    (ahead, ahead_cpu), (fresh, fresh_cpu) = measure_ten_sessions(True, reference), measure_ten_sessions(False, reference)
    print(ahead + "\n" + fresh)
    (SHOTS / "concurrent-latency.txt").write_text(ahead + "\n" + fresh)
    # CPU, not wall-clock: a drag that finds its plan solved costs the server only its rerun. How much a
    # fresh drag costs more depends on how many of the 30 budgets reuse a plan solved at another
    # (measured per drag: 0.04-0.06 against 0.15-0.18 CPU-s, and 0.063 against 0.088 in CI on 2026-12-03);
    # with solving ahead not running, the two would be the same work
    assert ahead_cpu < fresh_cpu
