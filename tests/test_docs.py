"""docs/results pages say what wrote them (their first line, ``bonsai_core.bench.common``), and a page a
suite or script wrote is no older than that suite's code: the hash of its sources recorded in the page
is theirs now (a hash, not file times, which a clone resets). DESIGN.md's layout naming every module:
tests/test_design_layout.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from bonsai_core.bench.common import MEASURED_BY_HAND, WRITTEN_BY, page_header, source_hash

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PAGES = sorted(p for p in RESULTS.glob("*.md") if p.name != "index.md")  # the index lists them, measures nothing


def first_line(page: Path) -> str:
    return page.read_text().split("\n", 1)[0]


def stale_or_unsaid(page: Path) -> str | None:
    """Why ``page``'s first line fails the convention, None when it holds."""
    line = first_line(page)
    written = WRITTEN_BY.fullmatch(line)
    if written:
        sources = written["sources"].split(",")
        missing = [s for s in sources if not (ROOT / s).is_file()]
        if missing:
            return f"{page.name}: its sources {missing} are gone"
        if source_hash(sources) != written["hash"]:
            return (f"{page.name}: {', '.join(sources)} changed since the page was written: run "
                    f"`{written['command']}` again")
        return None
    if MEASURED_BY_HAND.fullmatch(line):
        return None
    return (f"{page.name}: the first line says neither what wrote it (<!-- written by: ... -->) nor that it "
            "records measurements by hand (<!-- measured by hand: COMMANDS -->)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_results_page_says_what_wrote_it_and_is_not_older_than_its_suite(page):
    assert stale_or_unsaid(page) is None


# the pages whose runs take hours here (8B/70B steps, bonsai fit, gloo ranks): records, not rerun by a suite
HAND_RECORDS = {"real_runs.md"}


def test_every_page_but_the_hour_scale_records_is_written_by_its_suite():
    by_hand = {p.name for p in PAGES if MEASURED_BY_HAND.fullmatch(first_line(p))}
    assert by_hand == HAND_RECORDS, "a page measured by hand: have a `bonsai bench` suite write it (--page)"


def test_the_check_sees_a_page_without_a_header_and_a_stale_one(tmp_path):
    bare = tmp_path / "bare.md"
    bare.write_text("# Results\n")
    assert "neither" in stale_or_unsaid(bare)
    header = page_header("bonsai bench fsdp", ["bonsai_core/bench/fsdp.py"])
    fresh, stale = tmp_path / "fresh.md", tmp_path / "stale.md"
    fresh.write_text(header + "\n# FSDP\n")
    stale.write_text(header.replace(source_hash(["bonsai_core/bench/fsdp.py"]), "0" * 12) + "\n# FSDP\n")
    assert stale_or_unsaid(fresh) is None
    assert "changed since the page was written: run `bonsai bench fsdp` again" in stale_or_unsaid(stale)
