"""The Compare page's side-by-side view in headless Chromium: bonsai against chen at 60% on the default
GPT draws its four charts (memory, module boxes, two lifetimes) without an error; a screenshot."""

from __future__ import annotations

from tests.test_browser import SHOTS, wait_idle
from tests.test_browser import pytestmark  # noqa: F401  (skips without chromium)

CHART = '[data-testid="stVegaLiteChart"]'


def test_bonsai_and_chen_side_by_side_draw_their_four_charts(browser, server):
    pg = browser.new_page(viewport={"width": 1440, "height": 2600})
    pg.set_default_timeout(120_000)
    pg.goto(server + "/compare?method=bonsai&budget=60")
    pg.wait_for_function(f"() => document.querySelectorAll('{CHART} canvas').length >= 4")
    wait_idle(pg)
    assert pg.locator('[data-testid="stException"]').count() == 0
    assert pg.get_by_text("Two methods side by side").count() == 1
    top = pg.get_by_text("Two methods side by side").bounding_box()["y"]
    pg.screenshot(path=str(SHOTS / "compare-side-by-side.png"),
                  clip={"x": 0, "y": max(0, top - 20), "width": 1440, "height": 2600 - max(0, top - 20)},
                  full_page=True)
    pg.close()
