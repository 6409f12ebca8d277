"""Shared fixtures: small hand-made graphs and traced zoo graphs (traced once per session)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from bonsai_core.graph import Graph
from tests.graphs import chain

# The explorer solves the budget slider's other positions in a background thread (explorer/ahead.py):
# off for the whole run (it would compete with every other test for the two cores, and the app tests
# measure what a session solves). The tests of that thread and the ten-session test turn it on.
os.environ.setdefault("BONSAI_SOLVE_AHEAD", "0")
# What the explorer keeps on disk (uploaded configs, solved budget sweeps) goes to a folder of this run's own:
# a sweep solved by an earlier run (or by the explorer on this machine) would answer what a test solves.
if "BONSAI_EXPLORER_CACHE" not in os.environ:  # set by the run's first process; its workers inherit it
    os.environ["BONSAI_EXPLORER_CACHE"] = tempfile.mkdtemp(prefix="bonsai-explorer-tests-")
    _KEPT_BY_THIS_RUN = os.environ["BONSAI_EXPLORER_CACHE"]


def pytest_unconfigure(config):
    """The run's own folder goes with the process that made it (never a worker's, nor a folder given)."""
    folder = globals().get("_KEPT_BY_THIS_RUN")
    if folder and not hasattr(config, "workerinput"):
        shutil.rmtree(folder, ignore_errors=True)


# -- the order the two workers take the test files in (pytest-xdist's --dist loadfile --no-loadscope-reorder) --

# Files of a few tests that take long (a served explorer and Chromium each, gloo processes, a model trained
# several ways): xdist's own queue (the files of most tests first) leaves them for last, where one of them
# keeps a worker busy after the other has run out of files. They go first, each beside a file of many tests.
FEW_BUT_LONG = ("test_browser", "test_ddp.py", "test_hf_end_to_end.py", "test_fuzz.py")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    files = sorted(by_file, key=lambda f: -len(by_file[f]))  # xdist's order: most tests first
    long = [f for f in files if Path(f).name.startswith(FEW_BUT_LONG)]
    rest = [f for f in files if f not in long]
    order = [f for pair in zip(long, rest) for f in pair] + long[len(rest):] + rest[len(long):]
    items[:] = [item for f in order for item in by_file[f]]


@pytest.fixture
def chain4() -> Graph:
    return chain(4)


class _TracedOnFirstUse(dict):
    """name -> Traced of a zoo model at its default size, traced when a test first asks for it: a worker
    that runs only the tests of one model traces that model alone."""

    def __missing__(self, name: str):
        from bonsai_core.trace import trace_model

        self[name] = trace_model(name)
        return self[name]


@pytest.fixture(scope="session")
def traced_zoo() -> dict:
    """Every zoo model at its default size, each traced once per session: name -> Traced."""
    return _TracedOnFirstUse()


# -- the browser tests' served app and headless Chromium (tests/test_browser*.py), one of each per module --

@pytest.fixture(scope="module")
def server():
    """The explorer served on a free port (explorer.browser.serve): its URL."""
    from explorer.browser import serve

    with serve() as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless, driven by Playwright."""
    from playwright.sync_api import sync_playwright

    from explorer.browser import BROWSER_ARGS, CHROMIUM
    from tests.test_browser import SHOTS

    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield b
        b.close()
