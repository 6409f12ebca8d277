"""The explorer in a real browser: served with the README's command, driven by headless Chromium.

Visits every page, drags the budget slider on the memory page and waits for the plot's budget line
to move, timing slider release -> plot updated. Screenshots go to ``screenshots/`` (ignored by git).
Skips only when Debian's chromium is not installed (``apt-get install -y chromium``).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import math

import pytest

from bonsai_core.budget import format_bytes
from bonsai_core.graph import load_graph
from bonsai_core.schedule import no_remat_peak

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / "screenshots"
# page -> (URL path, whether it opens with a plot)
PAGES = {"model": ("", False), "graph": ("graph", True), "solve": ("solve", True), "memory": ("memory", True),
         "compare": ("compare", False), "export": ("export", False)}
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """``streamlit run explorer/app.py`` (the README's command), headless on a free port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "explorer/app.py", "--server.headless", "true",
         "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail("streamlit exited: " + proc.stdout.read())
            time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        pg = browser.new_page(viewport={"width": 1440, "height": 1000})
        pg.set_default_timeout(60_000)
        yield pg
        browser.close()


def wait_idle(page) -> None:
    """Wait for the page's own title, then until Streamlit's 'running' status widget has gone."""
    page.wait_for_selector('[data-testid="stMain"] h1')
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)


def budget_annotation(page) -> str:
    return page.evaluate("""() => [...document.querySelectorAll('[data-testid="stPlotlyChart"] .annotation-text')]
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
        if has_plot:
            page.wait_for_selector('[data-testid="stPlotlyChart"] .main-svg .scatterlayer .trace')
        page.wait_for_timeout(500)  # let plotly finish its transitions before the screenshot
        assert page.locator('[data-testid="stException"]').count() == 0, name
        page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
        print(f"{name}: {time.perf_counter() - start:.2f} s")
        if name == "compare":  # the sweep, with its progress bar, in the browser too
            page.get_by_role("button", name="Run the sweep").click()
            page.wait_for_selector('[data-testid="stPlotlyChart"] .main-svg .scatterlayer .trace', timeout=120_000)
            wait_idle(page)
            assert page.locator('[data-testid="stException"]').count() == 0
            page.wait_for_timeout(500)
            page.screenshot(path=str(SHOTS / "compare-sweep.png"), full_page=True)


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


def test_budget_slider_moves_the_memory_plot_within_a_second(page, server):
    page.goto(f"{server}/memory")
    wait_idle(page)
    page.wait_for_selector('[data-testid="stPlotlyChart"] .annotation-text')
    reference = no_remat_peak(load_graph(ROOT / "assets" / "gpt-default.json"))
    latencies = []
    for i, fraction in enumerate((0.9, 0.75, 0.95, 0.8, 1.0, 0.85, 0.97)):
        before = budget_annotation(page)
        start = drag_budget(page, fraction)
        # the value the slider settled on, read in the browser: the plot must show exactly its budget
        pct = int(page.locator('[data-testid="stSlider"]').filter(has_text="Memory budget").first
                  .locator('input[type="range"]').get_attribute("value"))
        expected = "budget " + format_bytes(math.floor(pct / 100 * reference))
        page.wait_for_function(
            """(expected) => [...document.querySelectorAll('[data-testid="stPlotlyChart"] .annotation-text')]
                   .map(e => e.textContent).some(t => t === expected)""", arg=expected)
        latencies.append(time.perf_counter() - start)
        assert budget_annotation(page) != before
        wait_idle(page)
        assert page.locator('[data-testid="stException"]').count() == 0
        if i == 0:
            page.screenshot(path=str(SHOTS / "memory-after-drag.png"), full_page=True)
    median = statistics.median(latencies)
    print("slider release -> plot updated (s):", " ".join(f"{x:.3f}" for x in latencies), f"median {median:.3f}")
    (SHOTS / "latency.txt").write_text(" ".join(f"{x:.4f}" for x in latencies) + f"\nmedian {median:.4f}\n")
    assert median <= 1.0
