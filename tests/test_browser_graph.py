"""The module graph (Graph page) in a real browser: served with the README's command, driven by headless
Chromium as in tests/test_browser.py (the harness: explorer/browser.py).

On the default model: the module view draws, a click on a box opens its ops, screenshots in the light
and the dark theme. Slow: a Llama with 32 layers and eager attention (over 7,000 ops) uploaded as a
graph JSON, its module view (folded to blocks) timed from the click on "Graph" until the chart is
painted; also at every fold depth. Reports go to ``screenshots/module-graph.txt``; screenshots to
``screenshots/`` (ignored; the ones in docs/screenshots are copies).
"""

from __future__ import annotations

import statistics

import pytest

from bonsai_core.graph import load_graph
from bonsai_core.regions import block_stack
from explorer import module_graph
from explorer.browser import (CHART, CHROMIUM, FOLD_STEPS, LLAMA_32, LLAMA_32_BUDGET, fold_to, graph_drawn,
                             graph_revisits, open_page, upload_graph, wait_idle)
from explorer.state import DEFAULT_GRAPH
from tests.test_browser import SHOTS, THEMES, yardstick

pytestmark = pytest.mark.skipif(not __import__("os").path.exists(CHROMIUM), reason="Debian's chromium is not installed")


def chart_shot(pg, name: str) -> None:
    chart = pg.locator(CHART).first
    chart.scroll_into_view_if_needed()
    pg.wait_for_timeout(300)
    chart.screenshot(path=str(SHOTS / name))


LABELS = f"""() => [...document.querySelectorAll('{CHART} text')]
  .filter(t => getComputedStyle(t).opacity !== '0' && t.getAttribute('opacity') !== '0' && t.textContent.trim())
  .map(t => ({{text: t.textContent, size: parseFloat(t.getAttribute('font-size') || getComputedStyle(t).fontSize),
              rotated: /rotate\((?!0)/.test(t.getAttribute('transform') || '')}}))"""


def assert_labels_legible(pg, at_least: int = 10) -> None:
    """The module chart's shown labels: at least ``at_least``, each 12 px or more and horizontal."""
    pg.wait_for_function(f"() => ({LABELS})().length >= {at_least}", timeout=60_000)  # Vega draws after the page
    shown = pg.evaluate(LABELS)
    assert all(t["size"] >= 12 and not t["rotated"] for t in shown), [t for t in shown if t["size"] < 12 or t["rotated"]]


def box_centre(pg, graph, depth: int, name: str) -> tuple[float, float]:
    """Where box ``name`` is drawn on the page: its layout position mapped through the chart's domains
    (as ``module_chart.module_chart`` sets them) onto the chart's canvas."""
    from explorer import module_chart

    boxes = module_graph.module_boxes(graph, depth)
    layout = module_graph.box_layout(graph, boxes)
    tree = module_graph.module_tree(graph)
    spec = module_chart.module_chart(boxes, layout, module_graph.box_stats(graph, boxes), tree.paths,
                                     tree.parent, [])
    rows = spec["datasets"]["boxes"]
    row = rows[(rows.name == name) & (rows.part == "forward")].iloc[0]
    encoding = spec["layer"][0]["encoding"]
    (x0, x1), (y0, y1) = encoding["x"]["scale"]["domain"], encoding["y"]["scale"]["domain"]
    canvas = pg.locator(f"{CHART} canvas").first.bounding_box()
    pad = 5  # Vega's default padding around the plot
    width, height = canvas["width"] - 2 * pad, canvas["height"] - 2 * pad
    return (canvas["x"] + pad + (row.xc - x0) / (x1 - x0) * width,
            canvas["y"] + pad + (row.yc - y0) / (y1 - y0) * height)


@pytest.mark.parametrize("scheme", THEMES)
def test_the_module_view_draws_and_a_click_on_a_box_opens_its_ops(browser, server, scheme):
    context, pg = open_page(browser, scheme)
    try:
        pg.goto(server)
        wait_idle(pg)
        seconds = graph_drawn(pg)
        assert pg.locator('[data-testid="stException"]').count() == 0
        labels = pg.evaluate(f"() => [...document.querySelectorAll('{CHART} text')].map(t => t.textContent)")
        assert {"ln2", "∇ ln2", "attn", "blocks.1", "forward →"} <= set(labels)  # boxes, backward boxes, frames
        assert_labels_legible(pg)
        chart_shot(pg, f"graph-modules-{scheme}.png")
        graph = load_graph(DEFAULT_GRAPH)
        x, y = box_centre(pg, graph, module_graph.default_depth(graph), "blocks.1.ln2")
        pg.mouse.click(x, y)
        pg.wait_for_selector('[data-testid="stPlotlyChart"] .main-svg .scatterlayer .trace')  # its ops
        wait_idle(pg)
        assert pg.get_by_text("blocks.1.ln2", exact=False).count() >= 2  # the select box and the caption
        assert pg.locator('[data-testid="stException"]').count() == 0
        pg.screenshot(path=str(SHOTS / f"graph-modules-opened-{scheme}.png"), full_page=True)
        print(f"{scheme}: module view of the default model drawn {seconds:.2f} s after the click on Graph")
    finally:
        context.close()


@pytest.fixture(scope="module")
def llama_graph(tmp_path_factory):
    """``explorer.browser.LLAMA_32``: a Llama with 32 layers and eager attention (the larger
    graph; with SDPA, the default, fewer ops), saved as JSON."""
    from bonsai_core.graph import save_graph
    from bonsai_core.trace import trace_model

    path = tmp_path_factory.mktemp("llama") / "llama32.json"
    name, options = LLAMA_32
    save_graph(trace_model(name, **options).graph, path)
    return path


@pytest.mark.slow
def test_the_module_view_of_a_llama_sized_graph_draws_and_folds(browser, server, llama_graph):
    """A 32-layer Llama's module view: drawn, labelled and folded in both themes. Its times are printed;
    ``bonsai bench explorer`` measures them against the 2 s target (docs/results/explorer.md)."""
    graph = load_graph(llama_graph)
    assert graph.n > 7000 and len(block_stack(graph)) == 32
    report = []
    for scheme in ("light", "dark"):
        context, pg = open_page(browser, scheme)
        try:
            upload_graph(pg, server, llama_graph, graph.n, LLAMA_32_BUDGET)  # bonsai: one block in two recomputed
            first = graph_drawn(pg)  # the first time: the chen solve and the module structure, computed
            times = graph_revisits(pg, 3)
            assert pg.locator('[data-testid="stException"]').count() == 0
            assert_labels_legible(pg, at_least=32)  # the 32 layers named, horizontally
            chart_shot(pg, f"graph-modules-llama-{scheme}.png")
            depths = []
            for depth in FOLD_STEPS:  # one step at a time (each arrow key is a rerun): one new chart each
                depths.append((depth, fold_to(pg, depth)))
                if depth == 5:
                    chart_shot(pg, f"graph-modules-llama-depth5-{scheme}.png")
            again = " ".join(f"{t:.2f}" for t in times)
            report.append(f"{scheme}: first visit {first:.2f} s; again (median of {again}) "
                          f"{statistics.median(times):.2f} s; fold depth "
                          + ", ".join(f"{d}: {t:.2f} s" for d, t in depths))
        finally:
            context.close()
    counts = {d: module_graph.module_boxes(graph, d).count for d in range(1, 6)}
    lines = [f"hf:llama, 32 layers: {graph.n} ops; boxes per fold depth {counts}", *report, yardstick()]
    print("\n".join(lines))
    (SHOTS / "module-graph.txt").write_text("\n".join(lines) + "\n")
