"""Where a budget drag's time goes on a large graph whose plans are all kept on disk (issue 57).

    BONSAI_EXPLORER_CACHE=DIR python scripts/explorer_sweep.py GRAPH.json    # once: every plan kept in DIR
    BONSAI_EXPLORER_CACHE=DIR python scripts/explorer_drags.py GRAPH.json [--drags N] [--no-sweep] [--js-profile]
    BONSAI_EXPLORER_CACHE=DIR python scripts/explorer_drags.py GRAPH.json --profile OUT

In Chromium (explorer/browser.py's helpers): a server that reads DIR, the graph uploaded as JSON at 70%, the
Memory page opened and its sweep (every position read from DIR) and the pages' work it puts off done; then
``--drags`` drags of the budget slider, each printed with its seconds from the release until the memory chart
shows the budget and until the server's rerun ended, the bytes that rerun sent, the CPU seconds the server and
the browser used and the page's own task time (Chromium's Performance metrics: script, layout, style).
``--no-sweep`` skips the sweep (minutes) and visits each drag's position once before instead; ``--js-profile``
prints the page's costliest JavaScript over the drags. ``--profile`` instead reruns the Memory page in-process
(Streamlit's AppTest) at each of several budgets, once to fill the caches as a sweep does and once under
cProfile, whose statistics it writes to OUT, printing each rerun's seconds and the 45 costliest calls.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

from bonsai_core.graph import load_graph
from bonsai_core.schedule import no_remat_peak
from explorer import browser

FIRST = 70  # % of the no-remat peak the graph is uploaded at, as the bench's 8B step
PCTS = (91, 76, 95, 81, 100, 86, 97, 60, 45, 30)  # the in-process reruns' budgets: the bench's drags, then lower


def websocket_log(page: Any) -> list[tuple[float, int, bool]]:
    """Every message ``page`` receives from the server: (moment, bytes, whether it ends a rerun)."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    frames: list[tuple[float, int, bool]] = []

    def on_frame(payload):
        if isinstance(payload, bytes):
            msg = ForwardMsg()
            msg.ParseFromString(payload)
            frames.append((time.perf_counter(), len(payload), msg.WhichOneof("type") == "script_finished"))

    page.on("websocket", lambda ws: ws.on("framereceived", on_frame))
    return frames


def wait_server_idle(pid: int, timeout: float = 1800.0) -> float:
    """Until the server used under 0.05 CPU-seconds in a second (its sweep's put-off work done); seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        before = browser.cpu_seconds(pid)
        time.sleep(1.0)
        if browser.cpu_seconds(pid) - before < 0.05:
            break
    return time.perf_counter() - start


RENDERER = ("ScriptDuration", "LayoutDuration", "RecalcStyleDuration", "TaskDuration")  # Chromium's, in seconds


def renderer_seconds(cdp: Any) -> dict[str, float]:
    """The page's renderer time so far by kind (the DevTools protocol's Performance metrics)."""
    got = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {name: got.get(name, 0.0) for name in RENDERER}


def js_profile_top(profile: dict, count: int = 25) -> list[tuple[float, str]]:
    """The ``count`` costliest (self milliseconds, function at its script) of a DevTools CPU profile."""
    self_ms: dict[str, float] = {}
    nodes = {n["id"]: n for n in profile["nodes"]}
    deltas = dict.fromkeys(nodes, 0.0)
    for sample, delta in zip(profile["samples"], profile["timeDeltas"]):
        deltas[sample] += delta / 1e3
    for node_id, ms in deltas.items():
        frame = nodes[node_id]["callFrame"]
        where = (f"{frame['functionName'] or '(anonymous)'} {Path(frame['url']).name}:{frame['lineNumber']}:"
                 f"{frame['columnNumber']}")
        self_ms[where] = self_ms.get(where, 0.0) + ms
    return sorted(((ms, where) for where, ms in self_ms.items()), reverse=True)[:count]


def drags_in_chromium(path: Path, drags: int, cache: Path, sweep: bool, js_profile: bool) -> None:
    """``drags`` drags on the Memory page after the sweep (``sweep``), or each position visited once before
    (solving ahead off: every plan read from the disk as the page asks for it); ``js_profile``: the page's
    JavaScript profiled over the drags, its costliest functions printed."""
    from playwright.sync_api import sync_playwright

    graph = load_graph(path)
    reference = no_remat_peak(graph)
    fractions = (browser.DRAG_FRACTIONS * drags)[:drags]
    with browser.serve(sweep, cache) as url, sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser.CHROMIUM, args=browser.BROWSER_ARGS)
        context, page = browser.open_page(chromium, width=1440, height=1800)
        frames = websocket_log(page)
        server = browser.SERVER_PIDS[url]
        begun = time.perf_counter()
        try:
            browser.upload_graph(page, url, path, graph.n, FIRST)
        except AssertionError:  # Chromium under load now and then drops the file input's upload: once more
            browser.upload_graph(page, url, path, graph.n, FIRST)
        page.locator('[data-testid="stSidebarNav"] a[href$="/memory"]').click()
        page.wait_for_function(f"() => document.querySelectorAll('{browser.CHART_CANVAS}').length >= 1",
                               timeout=900_000)
        if sweep:
            page.wait_for_function(f"() => ({browser.SWEPT})().includes('done')", timeout=1_800_000, polling=1000)
            print(f"uploaded and swept from the disk in {time.perf_counter() - begun:.1f} s; the put-off work "
                  f"{wait_server_idle(server):.1f} s more", flush=True)
        else:
            for fraction in dict.fromkeys(fractions):
                browser.timed_drag(page, fraction, reference)
                browser.wait_idle(page)
            print(f"uploaded and each position visited once in {time.perf_counter() - begun:.1f} s", flush=True)
        browser.wait_idle(page)
        cdp = context.new_cdp_session(page)
        cdp.send("Performance.enable")
        if js_profile:
            cdp.send("Profiler.enable")
            cdp.send("Profiler.start")
        seconds = []
        for fraction in fractions:
            server_cpu, browser_cpu = browser.cpu_seconds(server), sum(browser.chromium_cpu().values())
            renderer, start = renderer_seconds(cdp), len(frames)
            drawn, pct, _ = browser.timed_drag(page, fraction, reference)
            released = time.perf_counter() - drawn
            browser.wait_idle(page)
            time.sleep(0.3)  # the rerun's last messages
            sent = [f for f in frames[start:] if f[0] >= released]
            answered = next((t - released for t, _, last in sent if last), float("nan"))
            spent = {k: v - renderer[k] for k, v in renderer_seconds(cdp).items()}
            server_cpu = browser.cpu_seconds(server) - server_cpu
            browser_cpu = sum(browser.chromium_cpu().values()) - browser_cpu
            seconds.append(drawn)
            print(f"  {pct}%: drawn {drawn:.2f} s, the server's rerun ended after {answered:.2f} s, "
                  f"{sum(n for _, n, _ in sent) / 1e6:.2f} MB in {len(sent)} messages; cpu: server "
                  f"{server_cpu:.2f} s, browser {browser_cpu:.2f} s "
                  f"(page's tasks {spent['TaskDuration']:.2f} s: script {spent['ScriptDuration']:.2f}, layout "
                  f"{spent['LayoutDuration']:.2f}, style {spent['RecalcStyleDuration']:.2f})", flush=True)
        if js_profile:
            for ms, where in js_profile_top(cdp.send("Profiler.stop")["profile"]):
                print(f"  {ms:8.0f} ms  {where}")
        print(f"{drags} drags: median {statistics.median(seconds):.2f} s, the slowest {max(seconds):.2f} s; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        context.close()
        chromium.close()


def reruns_in_process(path: Path, out: str) -> None:
    """The Memory page rerun in AppTest at each of PCTS, twice: the second pass profiled."""
    from streamlit.runtime.scriptrunner.script_runner import ScriptRunner
    from streamlit.testing.v1 import AppTest

    from explorer import compute

    os.environ["BONSAI_SOLVE_AHEAD"] = "0"  # each position read from the disk, as the sweep would
    profile = cProfile.Profile()
    profiled = False
    run_script = ScriptRunner._run_script

    def run_profiled(runner, rerun_data):  # AppTest runs the script in a thread of its own
        if profiled:
            profile.runcall(run_script, runner, rerun_data)
        else:
            run_script(runner, rerun_data)

    ScriptRunner._run_script = run_profiled
    graph = load_graph(path)
    at = AppTest.from_file(str(browser.ROOT / "explorer" / "app.py"), default_timeout=600)
    at.session_state["model"] = compute.Model(graph, "json", path.name)
    at.session_state["budget_pct"] = FIRST
    at.run()
    at.switch_page("../pages/memory.py").run()
    if at.exception:
        raise RuntimeError(at.exception)
    for profiled in (False, True):
        for pct in PCTS:
            at.session_state["budget_pct"] = pct
            start = time.perf_counter()
            at.run()
            print(f"  {'profiled' if profiled else 'first'} {pct}%: {time.perf_counter() - start:.2f} s", flush=True)
            if at.exception:
                raise RuntimeError(at.exception)
    profile.dump_stats(out)
    pstats.Stats(out).sort_stats("cumulative").print_stats(45)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graph", type=Path)
    ap.add_argument("--drags", type=int, default=7)
    ap.add_argument("--no-sweep", action="store_true", help="solving ahead off: each drag's position visited once "
                                                             "before the timed drags, its plan read from the disk")
    ap.add_argument("--js-profile", action="store_true", help="profile the page's JavaScript over the drags")
    ap.add_argument("--profile", default=None, help="rerun the Memory page in-process, profiled, and write its "
                                                     "statistics here (no browser)")
    args = ap.parse_args()
    if not os.environ.get("BONSAI_EXPLORER_CACHE"):
        ap.error("set BONSAI_EXPLORER_CACHE to the folder scripts/explorer_sweep.py filled with the graph's plans")
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.profile:
        reruns_in_process(args.graph, args.profile)
    else:
        cache = Path(os.environ["BONSAI_EXPLORER_CACHE"])
        drags_in_chromium(args.graph, args.drags, cache, not args.no_sweep, args.js_profile)


if __name__ == "__main__":
    main()
