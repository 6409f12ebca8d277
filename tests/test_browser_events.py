"""In Chromium (served and driven as in tests/test_browser.py): the recompute events listed
and clickable on the Graph and Memory pages, the memory curve's event marks, the boxes of the current
event lit, labels on every view of the graph; screenshots in both themes (``screenshots/``, ignored;
copies in docs/screenshots). Slow: GPT-2 small from a link."""

from __future__ import annotations

import pytest

from tests.test_browser import CHROMIUM, SHOTS, THEMES, wait_idle
from tests.test_browser_graph import assert_labels_legible

# every text of the page's Vega-Lite charts (their marks, labels and annotations)
CHART_TEXTS = "() => [...document.querySelectorAll('[data-testid=\"stVegaLiteChart\"] text')].map(t => t.textContent)"

pytestmark = pytest.mark.skipif(not __import__("os").path.exists(CHROMIUM), reason="Debian's chromium is not installed")

GRID = '[data-testid="stDataFrame"]'
ROW_PX = 35  # Streamlit's data grid: header and rows


def open_at(browser, url: str, scheme: str = "light"):
    context = browser.new_context(viewport={"width": 1600, "height": 1400}, color_scheme=scheme)
    pg = context.new_page()
    pg.set_default_timeout(180_000)
    pg.goto(url)
    wait_idle(pg)
    pg.wait_for_timeout(500)
    return context, pg


def click_event(pg, k: int) -> None:
    """Click the k-th (1-based) row of the events table (a canvas grid: by position)."""
    grid = pg.locator(GRID).first
    grid.scroll_into_view_if_needed()
    box = grid.bounding_box()
    pg.mouse.click(box["x"] + 12, box["y"] + ROW_PX * k + ROW_PX / 2)
    pg.wait_for_selector(f"text=↻{k} At ")
    wait_idle(pg)
    pg.wait_for_timeout(500)


def no_exception(pg) -> None:
    assert pg.locator('[data-testid="stException"]').count() == 0


@pytest.mark.parametrize("scheme", THEMES)
def test_events_are_listed_clickable_and_light_the_graph(browser, server, scheme):
    context, pg = open_at(browser, f"{server}/graph?budget=50", scheme)
    try:
        pg.wait_for_selector("text=6 recompute events")  # bonsai at 50% on the default GPT
        wait_idle(pg)
        assert_labels_legible(pg)
        click_event(pg, 2)
        line = pg.get_by_text("↻2 At backward step").inner_text()
        assert "recompute" in line and "blocks.1" in line
        no_exception(pg)
        pg.screenshot(path=str(SHOTS / f"graph-events-{scheme}.png"))
        # the same cursor on the Memory page: the step line is the event's
        pg.locator('[data-testid="stSidebarNav"] a[href$="/memory"]').click()
        wait_idle(pg)
        pg.wait_for_selector("text=↻2 At backward step")
        # the events marked on the memory curve, one mark per block's run of rebuilds (Vega draws the
        # chart's text after the page settles)
        pg.wait_for_function(f"() => ['↻1', '↻2–4', '↻5–6'].every(m => ({CHART_TEXTS})().includes(m))")
        marks = pg.evaluate(CHART_TEXTS)
        assert not any("reserved" in t for t in marks)  # reserved bytes are off by default
        click_event(pg, 4)
        no_exception(pg)
        pg.screenshot(path=str(SHOTS / f"memory-events-{scheme}.png"))
    finally:
        context.close()


# each text of the op-level graph's labels: its words, font size and box on the page
PLOT_LABELS = """() => [...document.querySelectorAll('[data-testid="stPlotlyChart"] .textpoint text')].map(t => {
  const r = t.getBoundingClientRect();
  return [t.textContent, parseFloat(t.style.fontSize), r.left, r.top, r.right, r.bottom]; })"""


def overlapping(texts) -> list[tuple[str, str]]:
    """The pairs of labels whose boxes on the page overlap."""
    return [(a[0], b[0]) for i, a in enumerate(texts) for b in texts[i + 1:]
            if a[2] < b[4] and b[2] < a[4] and a[3] < b[5] and b[3] < a[5]]


@pytest.mark.parametrize("width", [1280, 1600])
def test_every_view_of_the_graph_carries_ten_readable_labels_none_overlapping(browser, server, width):
    context = browser.new_context(viewport={"width": width, "height": 1400})
    pg = context.new_page()
    pg.set_default_timeout(180_000)
    try:
        pg.goto(f"{server}/graph?budget=50")
        wait_idle(pg)
        for view in ("collapsed", "every op"):
            pg.locator('[data-testid="stButtonGroup"] button').filter(has_text=view).first.click()
            wait_idle(pg)
            if view == "every op":  # its legend names the op kinds; the collapsed view has none
                pg.wait_for_selector('[data-testid="stPlotlyChart"] .legendtext >> text=forward op')
            pg.wait_for_selector('[data-testid="stPlotlyChart"] .textpoint')
            pg.locator('[data-testid="stPlotlyChart"]').first.scroll_into_view_if_needed()
            texts = pg.evaluate(PLOT_LABELS)
            print(f"{view} at {width} px: {len(texts)} labels: " + ", ".join(t[0] for t in texts))
            assert len(texts) >= 10 and {"blocks.0", "blocks.1"} <= {t[0] for t in texts}
            assert all(size >= 12 for _, size, *_ in texts)
            assert not overlapping(texts)
            no_exception(pg)
            pg.screenshot(path=str(SHOTS / f"graph-{view.replace(' ', '-')}-labelled-{width}.png"))
    finally:
        context.close()


GPT2_SMALL = "batch:8,heads:12,layers:12,seq:512,vocab:50257,width:768"  # bonsai_core.models.zoo.GPT2_SMALL


@pytest.mark.slow  # traces GPT-2 small (1,517 ops) and solves it at 70% (about 25 s in all)
def test_gpt2_small_opens_labelled_with_its_recompute_events(browser, server):
    context, pg = open_at(browser, f"{server}/graph?model=gpt&size={GPT2_SMALL}&budget=70")
    try:
        pg.wait_for_selector("text=recompute events")
        wait_idle(pg)
        no_exception(pg)
        assert_labels_legible(pg)  # its 12 blocks and the rest, at the depth it opens at
        click_event(pg, 3)
        no_exception(pg)
        pg.screenshot(path=str(SHOTS / "graph-gpt2-small-events.png"))
    finally:
        context.close()
