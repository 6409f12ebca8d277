"""The JSON Schemas of the two file formats (``schemas/graph.schema.json``, ``schemas/schedule.schema.json``,
shown in docs/DESIGN.md) and the loaders' check of a document against them.

The schema holds every field's type and range; what it cannot say (ids in listed order, references to
earlier nodes) the loaders check by hand after it. A defect is reported as the loaders always reported
them: where (the node, op or field), what it is, and what it must be, the last taken from the schema's
``description`` of the field. A JSON number is a finite one here (a NaN or an infinity is refused, as
JSON itself has none). Validation costs about 0.15 ms per node (jsonschema 4.26).
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parent / "schemas"
# where a defect is, by the first key of its path (a node, an op, an entry of an optional list)
PLACES = {"nodes": "Node {i}{name}", "ops": "Op {i}", "fixed_tensors": "'fixed_tensors' entry {i}",
          "modules": "'modules' entry {i}"}


@cache
def _schema_text(fmt: str) -> str:
    return (SCHEMAS / f"{fmt}.schema.json").read_text()


def schema(fmt: str) -> dict[str, Any]:
    """The JSON Schema of format ``fmt`` (``graph`` or ``schedule``)."""
    return json.loads(_schema_text(fmt))


@cache
def _validator(fmt: str) -> Any:
    """A Draft 2020-12 validator of ``fmt``'s schema whose numbers are finite."""
    from jsonschema import Draft202012Validator, validators

    def finite_number(checker: Any, x: Any) -> bool:
        return Draft202012Validator.TYPE_CHECKER.is_type(x, "number") and math.isfinite(x)

    checker = Draft202012Validator.TYPE_CHECKER.redefine("number", finite_number)
    return validators.extend(Draft202012Validator, type_checker=checker)(schema(fmt))


def check(document: dict[str, Any], fmt: str, error: type[Exception]) -> None:
    """Raise ``error`` naming the first defect (in document order) of ``document`` against ``fmt``'s schema."""
    found = min(_validator(fmt).iter_errors(document), key=lambda e: _order(e.absolute_path), default=None)
    if found is not None:
        raise error(_said(found, document, fmt))


def _order(path: Any) -> tuple:
    """A defect's path as a key sorting defects in document order (a node's before the next node's)."""
    return tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in path)


def _said(e: Any, document: dict[str, Any], fmt: str) -> str:
    """One defect in words: where, what, and what it must be (the schema's description of it)."""
    path = list(e.absolute_path)
    if path[:1] and path[0] in PLACES and len(path) >= 2 and isinstance(path[1], int):
        place, rest = PLACES[path[0]].format(i=path[1], name=_name(document, path[1])), path[2:]
    elif len(path) >= 2:
        place, rest = repr(path[0]), path[1:]
    else:
        place, rest = "", path
    root = schema(fmt)
    if e.validator == "required":
        missing = next(p for p in e.validator_value if p not in e.instance)
        wanted = _described(root, e.schema.get("properties", {}).get(missing, {})) or e.schema.get("description")
        if path[:1] == ["nodes"] and len(path) == 2:  # what every node needs
            place, wanted = f"Node at position {path[1]}{_name(document, path[1])}", e.schema["description"]
        subject = place or (repr(path[0]) if path else f"The {fmt}")
        return f"{subject} has no {missing!r}" + (f": {wanted}." if wanted else ".")
    field = rest[0] if rest and isinstance(rest[0], str) else None
    subject = ": ".join(filter(None, [place, repr(field) if field else ""])) or f"The {fmt}"
    item = len(rest) > (1 if field else 0)
    problem = ("lists the same id twice" if e.validator == "uniqueItems"
               else f"{'holds' if item else 'is'} {_short(e.instance)}")
    wanted = _description(root, list(e.absolute_schema_path))
    return f"{subject} {problem}; it must be {wanted}." if wanted else f"{subject} {problem}: {e.message}."


def _description(root: dict[str, Any], schema_path: list[Any]) -> str | None:
    """The description nearest the failing keyword along ``schema_path``: its own schema's, else the
    field's it belongs to."""
    node, said = root, root.get("description")
    for key in schema_path[:-1]:
        while isinstance(node, dict) and "$ref" in node and key not in node:
            node = _resolved(root, node)
        node = node[key]
        said = _described(root, node) or said
    return said


def _described(root: dict[str, Any], node: Any) -> str | None:
    if not isinstance(node, dict):
        return None
    return node.get("description") or (_described(root, _resolved(root, node)) if "$ref" in node else None)


def _resolved(root: dict[str, Any], node: dict[str, Any]) -> Any:
    """The schema a local ``$ref`` (``#/$defs/name``) points at."""
    target = root
    for part in node["$ref"].removeprefix("#/").split("/"):
        target = target[part]
    return target


def _name(document: dict[str, Any], i: int) -> str:
    nodes = document.get("nodes")
    node = nodes[i] if isinstance(nodes, list) and i < len(nodes) else None
    return f" ({node['name']!r})" if isinstance(node, dict) and isinstance(node.get("name"), str) else ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
