"""What the page tests share: a page's tables as the tests write their rows."""

from __future__ import annotations


def compact(text: str) -> str:
    """``text`` with each table row written ``| a | b |`` (one space around every cell, as the tests quote
    rows) and each alignment row ``| --- | --- |``, whatever padding the table helper gave them."""
    lines = []
    for line in text.split("\n"):
        if line.startswith("|") and line.rstrip().endswith("|"):
            cells = [c.strip() for c in line.strip()[1:-1].split("|")]
            if all(c and set(c) <= set(":-") for c in cells):
                cells = ["---"] * len(cells)
            line = "| " + " | ".join(cells) + " |"
        lines.append(line)
    return "\n".join(lines)
