"""docs/DESIGN.md's layout names every module of bonsai_core/ and explorer/ under its package's entry,
so a module added without a word there fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bonsai_core", "explorer")


def layout_lines(design: str) -> list[str]:
    """The lines of the code block under the ``## Layout`` heading."""
    section = re.split(r"^## Layout$", design, maxsplit=1, flags=re.M)[1]
    return section.split("```\n", 2)[1].splitlines()


def entries(lines: list[str]) -> dict[str, str]:
    """Entry path -> its own text. An entry is a line whose first word is a folder (``solvers/``) or a
    module (``graph.py``), at the left margin or two spaces right of the entry it belongs to; the
    lines indented further are its text, up to the next entry."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, path) of the entry and its ancestors
    for line in lines:
        indent = len(line) - len(line.lstrip())
        first = line.split()[0] if line.strip() else ""
        if re.fullmatch(r"[\w.]+(/|\.py)", first) and (not stack or indent <= stack[-1][0] + 2):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = (stack[-1][1] if stack else "") + first
            stack.append((indent, path))
            out[path] = line
        elif stack:
            out[stack[-1][1]] += "\n" + line
    return out


def missing_modules(design: str, root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """The modules (``bonsai_core/solvers/coop.py``) not named (``coop.py``) in their folder's entry nor
    in an entry of a module beside them (``units.py ... budget.py``), and the subpackages without an
    entry."""
    found = entries(layout_lines(design))
    missing = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            folder = "".join(f"{part}/" for part in rel.parts[:-1])
            if rel.name == "__init__.py":
                if folder not in found:
                    missing.append(folder)
                continue
            beside = [text for entry, text in found.items()
                      if entry == folder or (entry.startswith(folder) and re.fullmatch(r"[\w.]+\.py", entry[len(folder):]))]
            if not re.search(rf"(?<![\w/.]){re.escape(rel.name)}\b", "\n".join(beside)):
                missing.append(rel.as_posix())
    return missing


def test_the_layout_names_every_module():
    assert missing_modules((ROOT / "docs" / "DESIGN.md").read_text()) == []


def test_the_check_sees_a_missing_module(tmp_path):
    for rel in ("lib/__init__.py", "lib/a.py", "lib/b.py", "lib/c.py", "lib/sub/__init__.py", "lib/sub/c.py",
                "lib/sub/d.py", "lib/other/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    design = ("# Design\n\n## Layout\n\n```\nlib/  the library\n  a.py   one module, beside b.py\n"
              "  sub/   its own c.py and\n         d.py, under it\n```\n\n## Next\n")
    assert missing_modules(design, tmp_path, ("lib",)) == ["lib/c.py", "lib/other/"]
