"""The Memory page's tensor lifetimes and step scrubber in headless Chromium: both charts render on
the default GPT and on hf:gpt2 (a link traces it), the scrubber and the play button move the cursor
without mounting a new chart, and screenshots in the light and the dark theme."""

from __future__ import annotations

import time

import pytest

from tests.test_browser import CHART_CANVAS, SHOTS, THEMES, wait_idle
from tests.test_browser import pytestmark  # noqa: F401  (skips without chromium)

CHART = '[data-testid="stVegaLiteChart"]'
STEP = '[data-testid="stMarkdownContainer"] p'


def open_memory(browser, url: str, scheme: str = "light"):
    pg = browser.new_page(viewport={"width": 1440, "height": 1700}, color_scheme=scheme)
    pg.set_default_timeout(120_000)
    start = time.perf_counter()
    pg.goto(url)
    # a link to a large model traces and solves first (61 s for the 7k-op graph): longer than wait_idle waits
    pg.wait_for_function(f"() => document.querySelectorAll('{CHART} canvas').length >= 2", timeout=240_000)
    wait_idle(pg)
    print(f"{url} ({scheme}): both charts in {time.perf_counter() - start:.2f} s")
    assert pg.locator('[data-testid="stException"]').count() == 0
    return pg


def step_text(pg) -> str:
    return pg.evaluate(f"""() => [...document.querySelectorAll('{STEP}')].map(e => e.textContent)
                              .find(t => /^step \\d+: /.test(t)) || ''""")


def wait_for_another_step(pg, before: str) -> None:
    pg.wait_for_function(f"(b) => {{ const t = [...document.querySelectorAll('{STEP}')].map(e => e.textContent)"
                         ".find(t => /^step \\d+: /.test(t)); return t && t !== b; }", arg=before)


def chart_pixels(pg) -> bytes:
    return pg.locator(CHART).first.screenshot()


def test_the_scrubber_moves_the_cursor_in_place(browser, server):
    pg = open_memory(browser, f"{server}/memory")
    pg.evaluate(f"() => {{ window.charts = [...document.querySelectorAll('{CHART_CANVAS}')]; }}")
    before, pixels = step_text(pg), chart_pixels(pg)
    assert before.startswith("step ")
    thumb = pg.locator('[data-testid="stSlider"]').filter(has_text="Step through").get_by_role("slider")
    thumb.focus()
    start = time.perf_counter()
    for _ in range(10):
        thumb.press("ArrowLeft")
    wait_for_another_step(pg, before)
    wait_idle(pg)
    print(f"scrub: step line updated {time.perf_counter() - start:.2f} s after the first key")
    after = step_text(pg)
    assert int(after.split(":")[0].split()[1]) < int(before.split(":")[0].split()[1])
    pg.wait_for_timeout(300)
    assert chart_pixels(pg) != pixels  # the cursor moved
    # the same chart elements, their data updated in place
    assert pg.evaluate(f"() => [...document.querySelectorAll('{CHART_CANVAS}')].every((c, i) => c === window.charts[i])")
    pg.get_by_role("button", name="Play").click()
    pg.wait_for_timeout(2500)
    played = step_text(pg)
    pg.get_by_role("button", name="Pause").click()
    wait_idle(pg)
    assert int(played.split(":")[0].split()[1]) > int(after.split(":")[0].split()[1])
    assert pg.locator('[data-testid="stException"]').count() == 0
    pg.close()


@pytest.mark.parametrize("scheme", THEMES)
def test_screenshots_of_the_lifetimes_in_both_themes(browser, server, scheme):
    pg = open_memory(browser, f"{server}/memory", scheme)
    pg.get_by_text("Why this plan").click()
    pg.wait_for_function("() => [...document.querySelectorAll('li')].some(e => e.textContent.startsWith('segment '))")
    wait_idle(pg)
    pg.wait_for_timeout(600)
    pg.screenshot(path=str(SHOTS / f"memory-timeline-{scheme}.png"), full_page=True)
    pg.close()


def test_hf_gpt2_from_a_link(browser, server):
    pytest.importorskip("transformers")
    pg = open_memory(browser, f"{server}/memory?model=hf:gpt2&budget=50")
    assert "hf:gpt2" in pg.locator('[data-testid="stSidebar"]').inner_text()
    assert step_text(pg).startswith("step ")
    pg.screenshot(path=str(SHOTS / "memory-timeline-gpt2.png"), full_page=True)
    pg.close()


def test_the_tour_on_a_first_visit(browser, server):
    pg = browser.new_page(viewport={"width": 1440, "height": 1000})
    pg.goto(server)
    wait_idle(pg)
    pg.wait_for_selector("text=Tour 1/3")
    pg.screenshot(path=str(SHOTS / "tour.png"))
    pg.get_by_role("button", name="Close tour").click()
    pg.wait_for_selector("text=Tour 1/3", state="detached")
    pg.close()


@pytest.mark.slow  # tracing a 60-layer GPT (7,469 ops) and solving it: about a minute before the charts
def test_a_7k_op_graph_groups_small_tensors_and_renders(browser, server):
    pg = open_memory(browser, f"{server}/memory?model=gpt&size=layers:60&method=chen&budget=50")
    assert "7469 ops" in pg.locator('[data-testid="stSidebar"]').inner_text()
    assert "are grouped per module" in pg.locator('[data-testid="stCaptionContainer"]').all_inner_texts().__str__()
    thumb = pg.locator('[data-testid="stSlider"]').filter(has_text="Step through").get_by_role("slider")
    wait_idle(pg)
    pg.wait_for_timeout(1000)
    before = step_text(pg)
    thumb.focus()
    start = time.perf_counter()
    thumb.press("Home")
    wait_for_another_step(pg, before)
    print(f"7k ops, one step of the scrubber: {time.perf_counter() - start:.2f} s")
    pg.screenshot(path=str(SHOTS / "memory-timeline-7k.png"), full_page=True)
    assert pg.locator('[data-testid="stException"]').count() == 0
    pg.close()
