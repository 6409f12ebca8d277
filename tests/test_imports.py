"""No import circle anywhere in the library, the explorer or its pages.

The import graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for
every ``import b`` / ``from b import x`` in module ``a``, at the top level or inside a function (a lazy
import still runs ``b``, and a circle through it breaks as soon as the function is called first).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. Importing
``pkg.sub`` runs ``pkg/__init__.py`` too, so it is also an edge to ``pkg``, unless the importer is
inside ``pkg`` (whose ``__init__`` is then already running or done).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bonsai_core", "explorer")
PAGES = "pages"  # the explorer's Streamlit pages: scripts, each a module of its own


def module_files() -> dict[str, Path]:
    """Module name -> source file, for every module of the packages and every page."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / PAGES).glob("*.py")):
        files[f"{PAGES}.{path.stem}"] = path
    return files


def imported_names(module: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that ``module`` imports, at any depth of its source, under ``if TYPE_CHECKING:``
    too: that import never runs, but two modules naming each other's types know each other all the same."""
    is_package = path.name == "__init__.py"
    names = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.module, node.level)
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    targets = set()
    for name in names:
        while name and name not in known:  # `import a.b.c` of something not ours, or an attribute
            name = name.rpartition(".")[0]
        if not name or name == module:
            continue
        targets.add(name)
        targets.update(p for p in _parents(name) if p in known and not _inside(module, p))
    return targets


def import_graph() -> nx.DiGraph:
    """Directed graph of the imports between the modules of :func:`module_files`."""
    files = module_files()
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        graph.add_edges_from((module, target) for target in imported_names(module, path, set(files)))
    return graph


def _absolute(module: str, is_package: bool, name: str | None, level: int) -> str:
    """The absolute module name of ``from {'.' * level}{name} import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _parents(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``: the packages whose ``__init__`` importing ``a.b.c`` runs."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_the_modules_and_their_imports():
    """A check on the reader itself: a known edge of each kind is found."""
    graph = import_graph()
    assert "pages.model" in graph and "bonsai_core.trace.to_graph" in graph
    assert graph.has_edge("bonsai_core.trace", "bonsai_core.trace.to_graph")  # top level, package
    assert graph.has_edge("bonsai_core.trace", "bonsai_core.models")  # inside a function
    assert graph.has_edge("explorer.compute", "bonsai_core.models.pt2")  # `from pkg import module`
    assert graph.has_edge("explorer.compute", "bonsai_core")  # a submodule runs its package


def test_there_is_no_import_circle():
    graph = import_graph()
    cycles = sorted(nx.simple_cycles(graph), key=lambda c: (len(c), c))
    assert not cycles, f"{len(cycles)} import circle(s), shortest first: " + "; ".join(
        " -> ".join(c + c[:1]) for c in cycles[:20])


def test_pages_reach_the_solvers_and_their_plans_only_through_the_explorer():
    """Pages stay thin (docs/DESIGN.md, layout): a page imports nothing from ``bonsai_core.solvers``
    and reads no ``schedule.extra`` (``compute.Outcome.plan`` and ``.bound`` say what it holds)."""
    graph = import_graph()
    reaching = sorted((page, target) for page, target in graph.edges
                      if page.startswith(PAGES + ".") and _inside(target, "bonsai_core.solvers"))
    assert not reaching, f"pages importing the solvers: {reaching}; call explorer/ (compute.methods, compute.solve)"
    extra = sorted(f"{path.name}:{node.lineno}" for path in sorted((ROOT / PAGES).glob("*.py"))
                   for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
                   and node.attr == "extra")
    assert not extra, f"pages reading a schedule's extra: {extra}; use compute.Outcome.plan"


def test_the_pages_check_sees_an_import_of_the_solvers(tmp_path):
    page = tmp_path / PAGES / "bad.py"
    page.parent.mkdir()
    page.write_text("from bonsai_core import solvers\n")
    files = {**module_files(), f"{PAGES}.bad": page}
    assert "bonsai_core.solvers" in imported_names(f"{PAGES}.bad", page, set(files))
