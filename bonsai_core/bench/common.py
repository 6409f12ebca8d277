"""What the bench suites share: the budget bisection, what a report says of its run (command, machine, dates),
a page's first line (:func:`page_header`), its template filled with Jinja2 (:func:`fill`, its tables by
:func:`table` and its numbers by the filters below), and the command of a suite that writes its page from its
results (:func:`page_refusal`, :func:`run_page_suite`)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from bonsai_core.budget import smallest_meeting
from bonsai_core.units import format_bytes

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = Path(__file__).resolve().parent / "templates"  # one markdown template per page


def bisect_budget(meets: Callable[[int], bool], lo: int, hi: int, steps: int, try_lo: bool = False) -> int | None:
    """The smallest budget in ``[lo, hi]`` that ``meets`` accepts after at most ``steps`` bisections (``lo`` first
    when ``try_lo``), None when ``hi`` fails. A heuristic's success is not monotone in the budget: this is where
    the bisection lands, not a proven minimum. ``meets`` may raise TimeoutError: the smallest met so far."""
    try:
        if try_lo and meets(lo):
            return lo
        if not meets(hi):
            return None
    except TimeoutError:
        return None
    return smallest_meeting(meets, lo, hi, steps, stop=TimeoutError)


def machine() -> str:
    """This machine as a report names it: CPUs, memory, the load when the run starts, Python."""
    cpu = platform.processor() or platform.machine()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} CPUs ({cpu}), {memory:.0f} GiB, load average at start {os.getloadavg()[0]:.1f}, "
            f"Python {platform.python_version()}")


def utc_now() -> str:
    """This minute as a report dates a run: ``2026-12-05 19:05 UTC``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_meta(stamp: str = "date", **extra: Any) -> dict[str, Any]:
    """What a page says of a run, kept as it starts: the command line, its start (under ``stamp``), the machine,
    torch's version, and ``extra``."""
    import torch

    return {"command": "bonsai " + " ".join(sys.argv[1:]), stamp: utc_now(), "machine": machine(),
            "torch": torch.__version__, **extra}


def run_studies(studies: dict[str, Callable[[], Any]], seconds: dict[str, float] | None = None,
                progress: Callable[[dict[str, Any]], None] = lambda done: None) -> dict[str, Any]:
    """Each study's result by its name, run in turn, its seconds printed (and kept in ``seconds``);
    ``progress(the results so far)`` after each."""
    out: dict[str, Any] = {}
    for name, study in studies.items():
        start = time.perf_counter()
        out[name] = study()
        took = time.perf_counter() - start
        if seconds is not None:
            seconds[name] = took
        print(f"{name}: {took:.0f} s", flush=True)
        progress(out)
    return out


def run_dates(meta: dict[str, Any]) -> str:
    """A run's ``started`` and ``ended`` as a page says them: ``2026-12-05, 19:05–19:15 UTC`` (both dates in
    full when it crossed midnight)."""
    start_day, start_time, _ = meta["started"].split()
    end_day, end_time, _ = meta["ended"].split()
    if start_day == end_day:
        return f"{start_day}, {start_time}–{end_time} UTC"
    return f"{meta['started']} to {meta['ended']}"


# -- a page's numbers and tables, as Python and as its template's filters ------------------------------------

def pct(x: float, digits: int = 1) -> str:
    """A relative change as a page writes it: ``+1.6%`` (``digits`` decimals)."""
    return f"{x:+.{digits}%}"


def budget(fraction: float) -> str:
    """A budget as a share of the no-remat peak: ``45%``."""
    return f"{fraction * 100:g}%"


def mib(nbytes: float, digits: int = 2, unit: str = " MiB") -> str:
    """Bytes in MiB as a page writes them: ``12.34 MiB`` (a table whose header says MiB: ``unit=""``)."""
    return f"{nbytes / 2**20:.{digits}f}{unit}"


def span(values: Iterable[Any], fmt: Callable[[Any], str], between: str = "–", unit: str = "") -> str:
    """The smallest and largest of ``values`` as ``fmt`` writes them: ``4–9 s``; one when they read the same."""
    values = list(values)
    low, high = fmt(min(values)), fmt(max(values))
    return (low if low == high else f"{low}{between}{high}") + unit


def listing(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``; ``none`` when empty."""
    items = list(items)
    if not items:
        return "none"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def median(xs: Iterable[float]) -> float | None:
    """The median of ``xs``; None when there are none."""
    xs = list(xs)
    return statistics.median(xs) if xs else None


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A markdown table of ``rows`` under ``columns``, each cell as its text (no number read and rewritten);
    ``align``: a letter per column, ``l``, ``r`` or ``c`` (default left)."""
    import pandas as pd

    frame = pd.DataFrame([[str(v) for v in row] for row in rows], columns=list(columns))
    names = {"l": "left", "r": "right", "c": "center"}
    colalign = [names[a] for a in align.ljust(len(columns), "l")]
    return frame.to_markdown(index=False, colalign=colalign, disable_numparse=True)


def table_of_lines(text: str, *columns: str, align: str = "") -> str:
    """A template's block as a :func:`table`, a row a non-blank line, its cells split at `` | ``
    (``{% filter table("what", "measured") %}``)."""
    return table(columns, [line.split(" | ") for line in text.split("\n") if line.strip()], align)


def pipe_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table as the pages written by hand set them: ``| a | b |`` lines, no padding."""
    return "\n".join(f"| {' | '.join(map(str, cells))} |" for cells in [columns, ["---"] * len(columns), *rows])


FILTERS: dict[str, Callable[..., Any]] = {
    "pct": pct, "pct2": lambda x: pct(x, 2), "budget": budget, "mib": mib, "listing": listing, "median": median,
    "bytes": format_bytes, "fmt": format, "table": table_of_lines,
    "pct_or_fails": lambda x: "fails" if x is None else pct(x),  # an overhead, or no schedule found
    "budgets": lambda fractions: "/".join(f"{f * 100:g}" for f in fractions) + "%",  # 90/70/50%
    "capitalized": lambda text: text[:1].upper() + text[1:],  # a sentence that starts with a method's name
    "said": lambda items: listing([item for item in items if item]),  # a sentence's optional parts
    # what follows an item of a Jinja2 loop as listing joins them: {{ loop|sep }}
    "sep": lambda loop: ", " if loop.revindex > 2 else " and " if loop.revindex == 2 else "",
}


def fill(template: str, **values: Any) -> str:
    """The page template ``templates/TEMPLATE.md`` filled with ``values`` by Jinja2: the prose, its conditions
    and loops there, what was measured here (:data:`FILTERS` write its numbers: ``{{ x|pct }}``)."""
    return _jinja().get_template(f"{template}.md").render(values)


@functools.cache
def _jinja() -> Any:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters.update(FILTERS)
    return env


def template_source(template: str) -> str:
    """A template's path from the repository root, as a page's sources name it."""
    return str((TEMPLATES / f"{template}.md").relative_to(ROOT))


# -- what the suites measure with -------------------------------------------------------------------------

TIE = 1e-9  # overheads this close are the same plan's


def compare(pairs: Iterable[tuple[Any, float | None, float | None]]) -> dict[str, list[tuple[Any, float]]]:
    """(key, a, b) -> the keys where a is lower than b (with b - a), higher (a - b), equal, only a is there (b is
    None), only b, neither; a page's sentence of where one option costs less than another."""
    out: dict[str, list[tuple[Any, float]]] = {k: [] for k in ("lower", "higher", "equal", "only a", "only b",
                                                               "neither")}
    for key, a, b in pairs:
        if a is None or b is None:
            out["neither" if a is None and b is None else "only a" if b is None else "only b"].append((key, 0.0))
        elif a < b - TIE:
            out["lower"].append((key, b - a))
        elif a > b + TIE:
            out["higher"].append((key, a - b))
        else:
            out["equal"].append((key, 0.0))
    return out


def graph_of(model: str, **options: Any) -> Any:
    """The graph ``bonsai trace MODEL`` makes with ``options`` (tracing imported here: building the command line
    stays cheap)."""
    from bonsai_core.trace import trace_model

    return trace_model(model, **options).graph


def import_test_models() -> None:
    """The checkout's root on ``sys.path``: the suites that measure the models of ``tests/`` import them from any
    working directory."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def overhead_or_none(graph: Any, budget: int, method: str, **options: Any) -> float | None:
    """The overhead of ``method``'s schedule under ``budget`` (no budget hint), None where it finds none."""
    from bonsai_core.errors import BonsaiError
    from bonsai_core.solvers import solve

    try:
        return solve(graph, budget, method, budget_hint=False, **options).stats["overhead"]
    except BonsaiError:
        return None


# -- a page's first line: what wrote it -----------------------------------------------------------------------

# a suite or script (``written by``, with the hash of its sources: tests/test_docs.py fails when they changed
# since), or a person recording measurements by hand (``measured by hand``, with the commands run)
WRITTEN_BY = re.compile(r"<!-- written by: `(?P<command>[^`]+)` at commit (?P<commit>\S+); "
                        r"sources (?P<sources>\S+) hash (?P<hash>[0-9a-f]+) -->")
MEASURED_BY_HAND = re.compile(r"<!-- measured by hand: .+ -->")


def source_hash(sources: Sequence[str]) -> str:
    """The first 12 hex digits of the SHA-256 of the files ``sources`` (from the repository root), names and
    contents."""
    digest = hashlib.sha256()
    for rel in sources:
        digest.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def page_header(command: str, sources: Sequence[str]) -> str:
    """The first line of a page written by ``command`` from the files ``sources`` (the suite or script and what
    it alone reads): the command, the commit checked out (``-dirty`` with changes) and the sources' hash."""
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return (f"<!-- written by: `{command}` at commit {commit}; sources {','.join(sources)} "
            f"hash {source_hash(sources)} -->")


# -- a suite that writes a page from its results.json ---------------------------------------------------------

def add_page_arguments(ap: Any, default_out: str | None, record_page: str, quick: str | None = None) -> None:
    """``--out`` (unless the suite names its own), ``--page``, ``--report-only`` and, where the suite has one,
    ``--quick`` with ``quick`` saying what it measures."""
    if default_out is not None:
        ap.add_argument("--out", default=default_out, help="folder of results.json (default %(default)s)")
    ap.add_argument("--page", metavar="PAGE", help=f"also write the results page there ({record_page})")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: write the page from the run's stored results (needs --page)")
    if quick:
        ap.add_argument("--quick", action="store_true",
                        help=f"{quick}, a smoke test (needs another --out than the default, and another page than "
                             f"{record_page})")


def same_path(a: str, b: str) -> bool:
    """Whether path ``a`` is ``b``, ``b`` read from the working directory or from the repository root."""
    return Path(a).resolve() in ((ROOT / b).resolve(), Path(b).resolve())


def results_file(args: Any, results: Path | None = None) -> Path:
    """Where a page suite keeps its run: ``--out``/results.json, or the file ``results`` a suite names."""
    return results if results is not None else Path(args.out) / "results.json"


def changed(args: Any, names: Sequence[str]) -> list[str]:
    """The options among ``names`` (argument names) given other values than their defaults, as flags."""
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) != args.parser.get_default(name)]


def page_refusal(args: Any, default_out: str | None = None, record_page: str | None = None,
                 results: Path | None = None, narrowed: Sequence[str] = (), whole: str | None = None,
                 studies: bool = False) -> str | None:
    """Why ``--out``/``--page``/``--report-only`` cannot run, before anything is measured; None when they can.
    ``narrowed``: the options given that measure less than the page reports (``--quick`` counts), which cannot
    be ``--report-only`` nor overwrite ``default_out`` or ``record_page``, nor write a page that reports only
    ``whole``; ``results``: :func:`results_file`'s; ``studies``: ``--report-only`` needs a finished run there."""
    narrowed = list(dict.fromkeys([*narrowed, *(["--quick"] if getattr(args, "quick", False) else [])]))
    results = results_file(args, results)
    if args.report_only and not args.page:
        return "--report-only writes the page only: name it with --page PAGE"
    if args.report_only and narrowed:
        return f"--report-only writes the page of the stored run and measures nothing: leave out {listing(narrowed)}"
    if args.report_only and not results.is_file():
        return f"{results} is missing: run without --report-only first"
    if args.report_only and studies and (why := stored_refusal(results)):
        return why
    if narrowed and args.page and whole:
        return f"--page reports {whole}: leave out {listing(narrowed)}"
    if narrowed and default_out and same_path(args.out, default_out):
        return (f"a run with {listing(narrowed)} measures less than the full run and would overwrite the full run's "
                f"{default_out}/results.json: give another --out")
    if narrowed and args.page and record_page and same_path(args.page, record_page):
        return (f"a run with {listing(narrowed)} measures less than the full run: its page is not the record "
                f"{record_page}, give another --page")
    if args.page and not Path(args.page).parent.is_dir():
        return f"--page {args.page}: the folder {Path(args.page).parent} does not exist"
    return None


def stored_refusal(path: Path) -> str | None:
    """Why ``path`` holds no finished run of a page's studies to write the page from; None when it does."""
    try:
        results = json.loads(path.read_text())
    except ValueError as e:
        return f"{path} is not JSON ({e}); run with --page again"
    if not isinstance(results, dict) or "studies" not in results:
        return f"{path} holds no page studies (a run without --page); run with --page, without --report-only"
    if "started" in results["meta"] and "ended" not in results["meta"]:
        return f"{path} is from a run that did not finish; run with --page again"
    return None


def page_writer(page: Callable[..., str], sources: Sequence[str],
                link: str | Path | None = None) -> Callable[[dict[str, Any], str], None]:
    """Writes ``page(results, header)`` to a path, the header naming the command that measured ``results`` and
    the ``sources``; with ``link`` (the run's results, from the working directory) also that path from the
    page's folder."""
    def write(results: dict[str, Any], path: str) -> None:
        links = () if link is None else (os.path.relpath(link, Path(path).parent),)
        Path(path).write_text(page(results, page_header(results["meta"]["command"], sources), *links))
    return write


def run_page_suite(suite: str, args: Any, refusal: str | None, measure: Callable[[], dict[str, Any]],
                   write_page: Callable[[dict[str, Any], str], None],
                   beside: Callable[[dict[str, Any], Path], None] | None = None, results: Path | None = None) -> int:
    """``bonsai bench SUITE``: refuse (exit 2) with ``refusal``'s words, else measure into :func:`results_file`
    (with ``--report-only``, read it), write what the suite keeps ``beside`` it (tables, figures) and ``--page``."""
    if refusal:
        print(f"bonsai bench {suite}: {refusal}.")
        return 2
    path = results_file(args, results)
    if args.report_only:
        run = json.loads(path.read_text())
    else:
        run = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run, indent=1, default=str))
    if beside is not None:
        beside(run, path.parent)
    if args.page:
        write_page(run, args.page)
    print(f"wrote {path}" + (f" and {args.page}" if args.page else ""))
    return 0


# -- a run's rows grouped (the methods, solvers-opt, bonsai and export pages) ---------------------------------

def grouped(items: Iterable[Any], key: Callable[[Any], Any],
            value: Callable[[Any], Any] = lambda item: item) -> dict[Any, list[Any]]:
    """``value(item)`` of every item under ``key(item)``, the keys in the order they first come."""
    out: dict[Any, list[Any]] = {}
    for item in items:
        out.setdefault(key(item), []).append(value(item))
    return out


def cells(rows: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Any],
          by: str = "method") -> dict[Any, dict[str, dict[str, Any]]]:
    """``key(row)`` -> ``row[by]`` (its method) -> row: a results table's cells, in the order of the rows."""
    return {k: {r[by]: r for r in of} for k, of in grouped(rows, key).items()}


def progress(row: dict[str, Any], keys: Sequence[str] | None = None) -> dict[str, Any]:
    """``row``, its ``keys`` (default all) that hold a value printed as one JSON line: a suite's progress as each
    measurement ends."""
    print(json.dumps({k: row[k] for k in keys or row if row.get(k) is not None}, default=str), flush=True)
    return row


# -- a page filled with its results as they are stored (fsdp, one-call) ---------------------------------------

def filled(template: str) -> Callable[[dict[str, Any], str], str]:
    """``page(results, header)``: the template ``template`` filled with a run's results as they are stored."""
    return lambda results, header: fill(template, header=header, **results)
