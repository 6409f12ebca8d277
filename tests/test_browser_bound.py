"""In Chromium (served and driven as in tests/test_browser.py): a plan solved for the
allocator's reserved bytes, opened from a link, labels its budget line as that bound and draws the
reserved bytes under it; the Model page's torchtitan tab opens on debugmodel and says tracing is slow.
Screenshots go to ``screenshots/`` (ignored)."""

from __future__ import annotations

import pytest

from tests.test_browser import CHROMIUM, SHOTS, wait_idle
from tests.test_browser_events import CHART_TEXTS, no_exception, open_at

pytestmark = pytest.mark.skipif(not __import__("os").path.exists(CHROMIUM), reason="Debian's chromium is not installed")


def test_a_reserved_plan_from_a_link_shows_its_bound_on_the_memory_chart(browser, server):
    context, pg = open_at(browser, f"{server}/memory?method=chen&exact=34MiB&bound=caching")
    try:
        pg.wait_for_selector("text=reserved-bytes bound")
        wait_idle(pg)
        # Vega draws the chart's text after the page settles, later still under load: wait for the label
        pg.wait_for_function(f"() => ({CHART_TEXTS})().includes('reserved-bytes bound 34.00 MiB')")
        texts = pg.evaluate(CHART_TEXTS)
        assert not any(t.startswith("budget ") for t in texts)
        assert any(t.startswith("chen reserved") for t in texts)  # the bounded bytes, labelled at their peak
        no_exception(pg)
        pg.locator('[data-testid="stVegaLiteChart"]').first.screenshot(path=str(SHOTS / "memory-reserved-bound.png"))
    finally:
        context.close()


def test_the_torchtitan_tab_opens_on_debugmodel_and_says_tracing_is_slow(browser, server):
    pytest.importorskip("torchtitan")
    context, pg = open_at(browser, server)
    try:
        pg.get_by_role("tab", name="torchtitan").click()
        pg.wait_for_selector("text=Slow to trace")
        wait_idle(pg)
        flavour = pg.locator('[data-testid="stSelectbox"]').filter(has_text="Flavour")
        assert "debugmodel" in flavour.inner_html()  # the selected flavour
        pg.screenshot(path=str(SHOTS / "model-torchtitan.png"))
        no_exception(pg)
    finally:
        context.close()
