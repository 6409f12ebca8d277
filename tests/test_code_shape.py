"""The shape of the library's code: no function of bonsai_core runs over ``LONGEST`` lines unless its
docstring says why (a line starting ``Long:``), so each step of a method stays a named function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONGEST = 80


def long_functions(package: Path, longest: int = LONGEST) -> list[str]:
    """``path:line name (n lines)`` of every function over ``longest`` lines without a ``Long:`` reason."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                reason = any(line.strip().startswith("Long:") for line in (ast.get_docstring(node) or "").splitlines())
                if lines > longest and not reason:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_the_library_is_long_without_a_reason():
    assert long_functions(ROOT / "bonsai_core") == []


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    '''Long: a table.'''\n{body}\n")
    assert [line.split()[1] for line in long_functions(tmp_path)] == ["f"]
