"""The Memory page's tensor lifetimes and step scrubber in headless Chromium: both charts render on
the default GPT and on hf:gpt2 (a link traces it), the scrubber and the play button move the cursor
without mounting a new chart, and screenshots in the light and the dark theme."""

from __future__ import annotations

import pytest

from explorer import browser as harness
from explorer.browser import CHART, CHART_CANVAS, GPT2_LINK, LARGE_LINK, scrub, step_text, wait_for_another_step, wait_idle
from tests.test_browser import SHOTS, THEMES
from tests.test_browser import pytestmark  # noqa: F401  (skips without chromium)


def open_memory(browser, url: str, scheme: str = "light"):
    """``explorer.browser.open_memory``, its time printed, no exception on the page."""
    pg, seconds = harness.open_memory(browser, url, scheme)
    print(f"{url} ({scheme}): both charts in {seconds:.2f} s")
    assert pg.locator('[data-testid="stException"]').count() == 0
    return pg


def chart_pixels(pg) -> bytes:
    return pg.locator(CHART).first.screenshot()


def moved(pg, pixels: bytes, seconds: float = 30) -> bool:
    """Whether the chart's pixels differ from ``pixels`` within ``seconds`` (Vega redraws after the page settles)."""
    for _ in range(int(seconds / 0.3)):
        if chart_pixels(pg) != pixels:
            return True
        pg.wait_for_timeout(300)
    return False


def test_the_scrubber_moves_the_cursor_in_place(browser, server):
    pg = open_memory(browser, f"{server}/memory")
    pg.evaluate(f"() => {{ window.charts = [...document.querySelectorAll('{CHART_CANVAS}')]; }}")
    before, pixels = step_text(pg), chart_pixels(pg)
    assert before.startswith("step ")
    seconds = scrub(pg, "ArrowLeft", 10)
    wait_idle(pg)
    print(f"scrub: step line updated {seconds:.2f} s after the first key")
    after = step_text(pg)
    assert int(after.split(":")[0].split()[1]) < int(before.split(":")[0].split()[1])
    assert moved(pg, pixels)  # the cursor moved
    # the same chart elements, their data updated in place
    assert pg.evaluate(f"() => [...document.querySelectorAll('{CHART_CANVAS}')].every((c, i) => c === window.charts[i])")
    pg.get_by_role("button", name="Play").click()
    pg.wait_for_timeout(2500)
    wait_for_another_step(pg, after)  # at least one step played, however loaded the machine
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
    pg = open_memory(browser, f"{server}/{GPT2_LINK}")
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
    pg = open_memory(browser, f"{server}/{LARGE_LINK}")
    assert "7469 ops" in pg.locator('[data-testid="stSidebar"]').inner_text()
    assert "are grouped per module" in pg.locator('[data-testid="stCaptionContainer"]').all_inner_texts().__str__()
    wait_idle(pg)
    pg.wait_for_timeout(1000)
    print(f"7k ops, one step of the scrubber: {scrub(pg, 'Home'):.2f} s")
    pg.screenshot(path=str(SHOTS / "memory-timeline-7k.png"), full_page=True)
    assert pg.locator('[data-testid="stException"]').count() == 0
    pg.close()
