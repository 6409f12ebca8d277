"""The explorer in headless Chromium, driven by Playwright: how the browser tests (tests/test_browser*.py)
and ``bonsai bench explorer`` (bonsai_core/bench/explorer_page.py) serve it, drag its budget slider,
wait for its charts and time them, so that both measure the same way.

The server is the README's command (``streamlit run explorer/app.py``) on a free port; a moment is
read with ``time.perf_counter`` in this process. Playwright and Debian's Chromium are imported and
started only by the functions that need them (:func:`missing` says what is absent). Here, not in
bonsai_core, because it reads Streamlit's messages (the library imports no Streamlit).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]  # the folder that holds explorer/app.py and assets/
CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]
DEFAULT_GRAPH = ROOT / "assets" / "gpt-default.json"  # the explorer's default model

# the Vega-Lite charts (memory, module graph, lifetimes; "hybrid" renderer): marks on a canvas, labels as SVG text
CHART = '[data-testid="stVegaLiteChart"]'
CHART_TEXT = f"{CHART} text"
CHART_CANVAS = f"{CHART} canvas"
SLIDER = '[data-testid="stSlider"]:has-text("Memory budget")'
DRAG_FRACTIONS = (0.9, 0.75, 0.95, 0.8, 1.0, 0.85, 0.97)  # where one session drags the slider, of its track
ANNOTATION_IS = """(expected) => [...document.querySelectorAll('""" + CHART_TEXT + """')]
                       .map(e => e.textContent).some(t => t === expected)"""
# the module chart's canvas, once Vega has painted on it (some pixel not transparent), and not one marked old
PAINTED = """() => {
  const c = document.querySelector('[data-testid="stVegaLiteChart"] canvas');
  if (!c || !c.width || c.dataset.old) return false;
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  for (let i = 3; i < d.length; i += 4 * 61) if (d[i] > 0) return true;
  return false;
}"""
MARK_OLD = """() => document.querySelectorAll('[data-testid="stVegaLiteChart"] canvas')
                      .forEach(c => c.dataset.old = 1)"""
STEP = '[data-testid="stMarkdownContainer"] p'  # the Memory page's step line is one of these

# ``bonsai trace hf:llama --layers 32 --width 32 --heads 2 --seq 16 --batch 1 --attention eager``: 32
# blocks, over 7,000 ops (eager attention: the larger graph), uploaded as JSON to time the module view
LLAMA_32 = ("hf:llama", {"layers": 32, "width": 32, "heads": 2, "seq": 16, "batch": 1, "attention": "eager"})
LLAMA_32_BUDGET = 90  # % of its no-remat peak: the budget it is uploaded at
FOLD_STEPS = (4, 5, 4, 3)  # the fold depths stepped through on it, one rerun each, from its default 3

# links that open the Memory page on a model the server traces first: GPT-2 from Hugging Face (at 55%:
# bonsai's checkpoint regions reach 50.6% of its no-remat peak, so 50% has no plan), and a 60-layer zoo
# GPT (7,469 ops) whose tensors the lifetimes chart groups
GPT2_LINK = "memory?model=hf:gpt2&budget=55"
LARGE_LINK = "memory?model=gpt&size=layers:60&method=chen&budget=50"

SERVER_PIDS: dict[str, int] = {}  # url -> the streamlit process serving it


def missing() -> str | None:
    """What is absent to drive the explorer in a browser, None when nothing is."""
    if importlib.util.find_spec("playwright") is None:
        return "Playwright for Python is not installed (pip install playwright)"
    if not os.path.exists(CHROMIUM):
        return f"Debian's chromium is not installed at {CHROMIUM} (apt-get install -y chromium)"
    return None


def yardstick_seconds() -> float:
    """This machine's speed, so that measurements from different machines can be compared: the best of
    five runs of a fixed pure-Python loop, on one core."""
    return min(timeit.repeat("sum(i * i for i in range(3 * 10**6))", number=1, repeat=5))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(solve_ahead: bool = False, cache: Path | None = None) -> Iterator[str]:
    """``streamlit run explorer/app.py`` (the README's command), headless on a free port, its URL; stopped
    on exit. Without ``solve_ahead`` the server solves only what a session asks for
    (``BONSAI_SOLVE_AHEAD=0``, as in the whole test run), so a drag measures a fresh solve. Each server
    keeps its plans in a folder of its own (``BONSAI_EXPLORER_CACHE``), so none is read from an earlier one,
    unless ``cache`` names the folder (its plans read and kept there)."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a full pipe would stall the server
    kept = None if cache is not None else tempfile.TemporaryDirectory(prefix="bonsai-explorer-served-")
    folder = str(cache) if kept is None else kept.name
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "explorer/app.py", "--server.headless", "true",
         "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
        env=os.environ | {"BONSAI_SOLVE_AHEAD": "1" if solve_ahead else "0", "BONSAI_EXPLORER_CACHE": folder})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(proc, port, log)
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
        if kept is not None:
            kept.cleanup()


def wait_listening(proc: subprocess.Popen, port: int, log: Any, timeout: float = 60.0) -> None:
    """Until the server accepts connections on ``port``; RuntimeError with its output if it exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError("streamlit exited: " + log.read()) from None
            time.sleep(0.2)
    raise RuntimeError(f"streamlit did not listen on port {port} within {timeout:.0f} s")


def default_reference() -> int:
    """The default model's no-remat peak: the budget slider's 100%."""
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import no_remat_peak

    return no_remat_peak(load_graph(DEFAULT_GRAPH))


def budget_label(pct: int, reference: int) -> str:
    """The memory chart's budget label at ``pct``% of ``reference``, as the app writes it."""
    from bonsai_core.units import format_bytes

    return "budget " + format_bytes(math.floor(pct / 100 * reference))


# -- one session (Playwright's sync API) ------------------------------------------------------------

def open_page(browser: Any, scheme: str = "light", width: int = 1440, height: int = 1000) -> tuple[Any, Any]:
    """A new context (a new Streamlit session once it navigates) and its page: (context, page)."""
    context = browser.new_context(viewport={"width": width, "height": height}, color_scheme=scheme)
    pg = context.new_page()
    pg.set_default_timeout(180_000)
    return context, pg


def wait_idle(page: Any) -> None:
    """Wait for the page's own title, then until Streamlit's 'running' status widget has gone."""
    page.wait_for_selector('[data-testid="stMain"] h1')
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)


def first_paint(page: Any, url: str) -> float:
    """A new session on a running server: seconds from navigation to the model's summary on screen."""
    start = time.perf_counter()
    page.goto(url)
    page.wait_for_selector('[data-testid="stMetric"]')
    seconds = time.perf_counter() - start
    wait_idle(page)
    return seconds


def budget_annotation(page: Any) -> str:
    return page.evaluate("""() => [...document.querySelectorAll('""" + CHART_TEXT + """')]
                               .map(e => e.textContent).find(t => t.startsWith('budget')) || ''""")


def open_memory_for_drags(page: Any, url: str) -> None:
    """The Memory page with its tour closed and both its charts drawn, ready for budget drags."""
    page.goto(f"{url}/memory")
    wait_idle(page)
    # the tour's "drag the budget" step reruns the whole app once when done (explorer/tour.py): closed
    # here, so every drag reruns the budget's fragment alone
    page.get_by_role("button", name="Close tour").click()
    page.get_by_role("button", name="Close tour").wait_for(state="detached")  # the close's whole-app rerun ran
    wait_idle(page)
    page.wait_for_selector(CHART_TEXT)
    # every Vega-Lite chart of the page (the memory chart first, the tensor lifetimes under it) drawn
    page.wait_for_function("() => { const charts = document.querySelectorAll('[data-testid=\"stVegaLiteChart\"]');"
                           " return charts.length >= 2 && [...charts].every(c => c.querySelector('canvas')); }")


def drag_budget(page: Any, fraction: float) -> float:
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


def timed_drag(page: Any, fraction: float, reference: int) -> tuple[float, int, str]:
    """Drag the budget slider to ``fraction`` of its track: (seconds from the release until the memory
    plot's budget label shows exactly the budget the slider settled on, that budget in %, the label)."""
    start = drag_budget(page, fraction)
    # the value the slider settled on, read in the browser: the plot must show exactly its budget
    pct = int(page.locator('[data-testid="stSlider"]').filter(has_text="Memory budget").first
              .locator('input[type="range"]').get_attribute("value"))
    expected = budget_label(pct, reference)
    page.wait_for_function(ANNOTATION_IS, arg=expected)
    return time.perf_counter() - start, pct, expected


def nav(page: Any, title: str) -> None:
    """Open a page from the sidebar: the session (and its model) stays, as when a person clicks."""
    page.locator('[data-testid="stSidebarNav"] a').filter(has_text=title).click()


def graph_drawn(page: Any) -> float:
    """Open the Graph page and wait for the module chart painted and the server idle; the seconds it took."""
    page.evaluate(MARK_OLD)
    start = time.perf_counter()
    nav(page, "Graph")
    page.wait_for_function(PAINTED, polling=50)
    wait_idle(page)
    return time.perf_counter() - start


def graph_revisits(page: Any, visits: int) -> list[float]:
    """The Graph page opened again ``visits`` times, from the Model page: the seconds of each (:func:`graph_drawn`)."""
    times = []
    for _ in range(visits):
        nav(page, "Model")
        wait_idle(page)
        times.append(graph_drawn(page))
    return times


def upload_graph(page: Any, url: str, path: Path, ops: int, budget: int) -> None:
    """A new session on the Model page at ``budget``%, the graph JSON ``path`` (``ops`` ops) uploaded."""
    page.goto(f"{url}/?budget={budget}")
    wait_idle(page)
    page.get_by_role("tab", name="Upload a graph or a .pt2").click()
    page.locator('[data-testid="stFileUploader"] input[type="file"]').last.set_input_files(str(path))
    try:
        page.wait_for_function(f"() => document.body.innerText.includes('{ops} ops')")
    except Exception as e:  # the page as it stood, for the report
        raise AssertionError(f"the uploaded graph's '{ops} ops' never showed; the page read:\n"
                             + page.evaluate("() => document.body.innerText")[-3000:]) from e
    wait_idle(page)


def fold_to(page: Any, depth: int) -> float:
    """On the Graph page, the fold depth slider moved to ``depth`` by arrow keys (one rerun each); the
    seconds until the new module chart is painted and the server idle."""
    page.evaluate(MARK_OLD)
    slider = page.locator('[data-testid="stSlider"]').filter(has_text="Fold depth").locator('input[type="range"]')
    current = int(slider.input_value())
    start = time.perf_counter()
    slider.focus()
    for _ in range(abs(depth - current)):
        page.keyboard.press("ArrowRight" if depth > current else "ArrowLeft")
    page.wait_for_function(PAINTED, polling=50)
    wait_idle(page)
    return time.perf_counter() - start


def open_memory(browser: Any, url: str, scheme: str = "light") -> tuple[Any, float]:
    """A new page at ``url`` (a Memory page link): (the page, seconds until both its charts are drawn and
    the server idle)."""
    pg = browser.new_page(viewport={"width": 1440, "height": 1700}, color_scheme=scheme)
    pg.set_default_timeout(120_000)
    start = time.perf_counter()
    pg.goto(url)
    # a link to a large model traces and solves first (a minute for a 7k-op graph): longer than wait_idle waits
    pg.wait_for_function(f"() => document.querySelectorAll('{CHART_CANVAS}').length >= 2", timeout=240_000)
    wait_idle(pg)
    return pg, time.perf_counter() - start


def step_text(page: Any) -> str:
    """The Memory page's step line (``step N: ...``), '' when none is shown."""
    return page.evaluate(f"""() => [...document.querySelectorAll('{STEP}')].map(e => e.textContent)
                              .find(t => /^step \\d+: /.test(t)) || ''""")


def wait_for_another_step(page: Any, before: str) -> None:
    page.wait_for_function(f"(b) => {{ const t = [...document.querySelectorAll('{STEP}')].map(e => e.textContent)"
                           ".find(t => /^step \\d+: /.test(t)); return t && t !== b; }", arg=before)


def scrub(page: Any, key: str, presses: int = 1) -> float:
    """Press ``key`` ``presses`` times on the step scrubber: seconds from the first press until the
    step line changed."""
    thumb = page.locator('[data-testid="stSlider"]').filter(has_text="Step through").get_by_role("slider")
    before = step_text(page)
    thumb.focus()
    start = time.perf_counter()
    for _ in range(presses):
        thumb.press(key)
    wait_for_another_step(page, before)
    return time.perf_counter() - start


# -- many sessions at once (Playwright's async API) ------------------------------------------------

def record_script_ends(pg: Any) -> list[float]:
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


async def drag_and_time(pg: Any, pct: int, reference: int, script_ends: list[float]) -> tuple[float, float]:
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
    await pg.wait_for_function(ANNOTATION_IS, arg=budget_label(settled, reference), polling=50)
    drawn = time.perf_counter() - released
    deadline = time.perf_counter() + 60  # the plot can be drawn before the rerun's last message arrives
    while not any(t > released for t in script_ends) and time.perf_counter() < deadline:
        await asyncio.sleep(0.02)
    answered = min((t for t in script_ends if t > released), default=math.inf) - released
    return drawn, answered


def chromium_processes() -> list[int]:
    """The Chromium processes this process started, at any depth (their parents read from /proc)."""
    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
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


def chromium_cpu() -> dict[int, float]:
    """CPU seconds used so far by each Chromium process this process started."""
    used = {}
    for pid in chromium_processes():
        with contextlib.suppress(OSError):
            used[pid] = cpu_seconds(pid)
    return used


@contextlib.contextmanager
def browsers_at_lowest_priority() -> Iterator[None]:
    """While inside, every thread of every Chromium process this process started runs at ``nice 19``
    (re-applied every half second: Chromium sets its own threads' priorities). In a classroom each
    browser draws on its own machine; here ten tabs share the server's two cores and take the
    server's turn (medians measured without this: 5.1 and 5.6 s; with it: 3.4 to 4.6 s)."""
    stop = threading.Event()

    def renice():
        while not stop.wait(0.5):
            for pid in chromium_processes():
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


def session_budget(session: int, round_: int) -> int:
    """The budget (%) session ``session`` drags to in round ``round_``: all different, 66% to 95% for
    ten sessions and three rounds."""
    return 66 + 3 * session + round_


async def many_sessions(url: str, reference: int, sessions: int, rounds: int, shots: Path | None) -> dict[str, Any]:
    """One browser, ``sessions`` contexts (separate Streamlit sessions) on the memory page; once they
    have all drawn it and the server is idle, ``rounds`` times every session drags to its own new budget
    at the same moment. Returns the (plot updated, server's rerun arrived) latencies per drag, the CPU
    seconds the server and the browser's processes used over the drags (on a small shared machine the
    tabs' own rendering competes with the server; this separates the two), the seconds waited for the
    server and whether each session's memory chart is still the one it drew first (updated in place).
    A screenshot of the first session goes to ``shots``/memory-concurrent.png when given."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            pages, ends = [], []
            for _ in range(sessions):
                pg = await (await browser.new_context(viewport={"width": 1280, "height": 900})).new_page()
                pg.set_default_timeout(300_000)  # ten tabs on a loaded machine: a bound on waiting, not a measure
                ends.append(record_script_ends(pg))
                pages.append(pg)
            for pg in pages:  # one after the other: ten tabs parsing Streamlit's bundle at once time out here
                await pg.goto(f"{url}/memory", wait_until="commit")
                await pg.wait_for_selector(CHART_TEXT)
                await pg.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')")
            waited = await server_idle(SERVER_PIDS[url])
            for pg in pages:
                await pg.evaluate(f"() => {{ window.memoryCanvas = document.querySelector('{CHART_CANVAS}'); }}")
            latencies = []
            server_cpu, browser_cpu = cpu_seconds(SERVER_PIDS[url]), chromium_cpu()
            for r in range(rounds):
                latencies += await asyncio.gather(*(drag_and_time(pg, session_budget(i, r), reference, ends[i])
                                                    for i, pg in enumerate(pages)))
            server_cpu = cpu_seconds(SERVER_PIDS[url]) - server_cpu
            browser_cpu = sum(used - browser_cpu.get(pid, 0.0) for pid, used in chromium_cpu().items())
            in_place = [await pg.evaluate(f"() => window.memoryCanvas === document.querySelector('{CHART_CANVAS}')")
                        for pg in pages]
            if shots:
                await pages[0].screenshot(path=str(shots / "memory-concurrent.png"), full_page=True)
            return {"latencies": latencies, "server_cpu": server_cpu, "browser_cpu": browser_cpu, "waited": waited,
                    "in_place": in_place}
        finally:
            await browser.close()


def measure_sessions(solve_ahead: bool, reference: int, sessions: int = 10, rounds: int = 3,
                     shots: Path | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """:func:`many_sessions` on a fresh server (solving ahead or not), its Chromium processes at
    ``nice 19``: its results with the drags split into ``drawn`` and ``answered`` and the load average
    (1, 5, 15 minutes) before and after. Raises TimeoutError when the sessions did not finish within
    ``timeout`` seconds, and what the sessions raised."""
    result: dict[str, Any] = {}

    def drive(url):  # the async API in its own thread: a sync Playwright may own this one's loop
        try:
            result.update(asyncio.run(many_sessions(url, reference, sessions, rounds, shots)))
        except Exception as e:  # re-raised in the caller's thread
            result["error"] = e

    with serve(solve_ahead) as url, browsers_at_lowest_priority():
        load_before = os.getloadavg()
        worker = threading.Thread(target=drive, args=(url,), daemon=True)
        worker.start()
        worker.join(timeout=timeout)
        load_after = os.getloadavg()
    if worker.is_alive():
        raise TimeoutError(f"the {sessions} sessions did not finish within {timeout:.0f} s")
    if "error" in result:
        raise result["error"]
    latencies = result.pop("latencies")
    return {**result, "drawn": [d for d, _ in latencies], "answered": [a for _, a in latencies],
            "load_before": list(load_before), "load_after": list(load_after)}


# -- torchtitan's 8B step, the model people train (issue 57) ---------------------------------------

# ``bonsai trace torchtitan:llama3:8B --batch 2 --seq 8192 --fsdp 8``: one of 8 FSDP ranks, 5,970 ops
TITAN_8B = ("torchtitan:llama3:8B", {"batch": 2, "seq": 8192, "fsdp": 8})
TITAN_8B_BUDGET = 70  # % of its no-remat peak: the budget it is uploaded at
SWEPT = """() => [...document.querySelectorAll('[data-testid="stSidebar"] [data-testid="stProgress"]')]
  .map(e => e.innerText).join(' ')"""
STAND_IN = "text=Not solved yet"


def sweep_said(page: Any) -> str:
    """The sidebar's line on the background sweep ('' before it starts)."""
    return page.evaluate(SWEPT)


def legend_entries(page: Any, title: str) -> int:
    """How many entries the Vega-Lite legend titled ``title`` lists (its aria-label says so)."""
    words = page.evaluate("""(title) => { const e = [...document.querySelectorAll('[data-testid="stVegaLiteChart"] [aria-label]')]
      .find(e => e.getAttribute('aria-label').includes(`legend titled '${title}'`));
      return e ? e.getAttribute('aria-label') : ''; }""", title)
    found = re.search(r"with (\d+) values", words)
    return int(found.group(1)) if found else 0


def big_step(page: Any, url: str, path: Path, ops: int, reference: int, drags: int,
             sweep_timeout: float = 3600.0) -> dict[str, Any]:
    """Torchtitan's 8B step uploaded as JSON at TITAN_8B_BUDGET% on a server that sweeps: seconds until the
    Memory page has drawn its first solve (a plan, or the method's error); a drag while the sweep runs
    (answered by its own plan or the nearest solved one); the sweep until done (or ``sweep_timeout``);
    ``drags`` drags after it; then at READ_AT the plan as the page reads it (its rebuilds and patterns, the
    lifetimes' legend entries)."""
    start = time.perf_counter()
    upload_graph(page, url, path, ops, TITAN_8B_BUDGET)
    uploaded = time.perf_counter() - start
    start = time.perf_counter()
    page.locator('[data-testid="stSidebarNav"] a[href$="/memory"]').click()
    page.wait_for_selector('[data-testid="stMain"] h1')
    # its first solve, however long it takes: a plan (its charts) or the method's error
    page.wait_for_function(f"() => document.querySelectorAll('{CHART_CANVAS}').length >= 2 || "
                           "document.querySelector('[data-testid=\"stAlert\"]')", timeout=900_000, polling=500)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=900_000)
    first_plan = time.perf_counter() - start
    out: dict[str, Any] = {"upload_s": uploaded, "first_plan_s": first_plan,
                           "first_plan_error": page.locator('[data-testid="stAlert"]').first.inner_text()[:300]
                           if page.locator(f"{CHART_CANVAS}").count() < 2 else None,
                           "sweep_at_first_plan": sweep_said(page)}
    during, pct, _ = timed_drag(page, 0.45, reference)
    out["during"] = {"pct": pct, "seconds": during, "stand_in": page.locator(STAND_IN).count() > 0,
                     "sweep": sweep_said(page)}
    wait_idle(page)
    begun = time.perf_counter()
    try:
        page.wait_for_function(f"() => ({SWEPT})().includes('done')", timeout=sweep_timeout * 1000, polling=2000)
    except Exception:  # not done in time: how far it got is said below
        pass
    said = sweep_said(page)
    out["sweep"] = {"said": said, "done": "done" in said, "waited_s": time.perf_counter() - begun}
    after = []
    for fraction in (DRAG_FRACTIONS * drags)[:drags]:
        seconds, pct, _ = timed_drag(page, fraction, reference)
        after.append([pct, seconds, page.locator(STAND_IN).count() > 0])
        wait_idle(page)
    out["after"] = after
    _, out["read_at"], _ = timed_drag(page, READ_AT, reference)  # a mid budget, solved by the sweep: the plan read
    wait_idle(page)
    page.wait_for_function("() => document.body.innerText.includes('recompute events')")
    rebuilds = re.search(r"(\d+) recompute events of \w+ in (\d+) patterns", page.evaluate("() => document.body.innerText"))
    out["rebuilds"], out["patterns"] = (int(rebuilds.group(1)), int(rebuilds.group(2))) if rebuilds else (None, None)
    out["legend"] = legend_entries(page, "made by")
    return out


READ_AT = 0.58  # of the slider's track: about 60%, where the 8B step's plan rebuilds in every block
