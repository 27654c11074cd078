"""A pydantic validation error as kvfuzz's one-line :class:`ScenarioError`.

Of all the errors pydantic collects, the first unknown field is reported if
there is one (a misspelt key explains the missing one), else the first error
in field order. The field path is dotted with list indices
(``kv_cache_groups[1].kind``); the allowed values are read from the JSON
Schema node of that field, so the message and the published schema cannot
disagree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from differential.errors import ScenarioError

__all__ = ["field_path", "scenario_error"]

_Node = Mapping[str, Any]


_KEY_CHARS = 80  # longest key shown in a field path


def field_path(loc: Sequence[int | str], *, prefix: str = "", root: str = "scenario") -> str:
    """``("requests", 2, "name")`` -> ``requests[2].name`` (``prefix`` before
    it; ``root`` for the document itself). A key that could not be read back
    from the path is quoted as JSON: the empty key as ``""`` (not the
    document, ``root``), one holding control characters escaped; one over
    80 characters is cut short."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            key = _key(part)
            path += f".{key}" if path else key
    return path or root


def _key(key: str) -> str:
    if key and key.isprintable() and len(key) <= _KEY_CHARS:
        return key
    text = json.dumps(key)
    return text if len(text) <= _KEY_CHARS else f'{text[: _KEY_CHARS - 4]}..."'


def scenario_error(
    exc: ValidationError,
    schema: _Node,
    *,
    prefix: str = "",
    root: str = "scenario",
    python: bool = False,
) -> ScenarioError:
    """The :class:`ScenarioError` reporting ``exc`` (see the module docstring).

    Args:
        exc: pydantic's error.
        schema: the JSON Schema of the validated model (with its ``$defs``).
        prefix: a path prepended to every field (e.g. ``model``).
        root: the name of the document itself, for an error at its top.
        python: the value was a Python object (a list field is then a tuple).
    """
    errors = exc.errors(include_url=False)
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = error["loc"]
    where = field_path(loc, prefix=prefix, root=root)
    if error["type"] == "extra_forbidden":
        parent = _node_at(schema, loc[:-1])
        if "anyOf" in parent:  # a nullable object (workload.connector): its object branch
            branches = [_resolve(schema, b) for b in parent["anyOf"]]
            parent = next((b for b in branches if "properties" in b), {})
        known = ", ".join(sorted(parent.get("properties", {})))
        return ScenarioError(where, error["input"], f"no such field; known fields: {known}")
    if error["type"] == "missing":
        return ScenarioError(where, None, "a value (the field is required)")
    allowed = _allowed(schema, _node_at(schema, loc), python)
    if error["type"] == "is_instance_of":  # a Python value, not an enum member
        allowed = f"a {error.get('ctx', {}).get('class', 'enum')} member, {allowed}"
    return ScenarioError(where, error["input"], allowed)


def _resolve(schema: _Node, node: _Node) -> _Node:
    while "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _node_at(schema: _Node, loc: Sequence[int | str]) -> _Node:
    """The schema node of the field at ``loc`` (``{}``: unknown, anything)."""
    node = _resolve(schema, schema)
    for part in loc:
        node = _resolve(schema, node)
        if "anyOf" in node:  # nullable: the branch that can hold ``part``
            want = "items" if isinstance(part, int) else "properties"
            node = next(
                (_resolve(schema, b) for b in node["anyOf"] if want in _resolve(schema, b)), {}
            )
        if isinstance(part, int):
            node = node.get("items", {})
        else:
            node = node.get("properties", {}).get(part, {})
    return _resolve(schema, node)


def _allowed(schema: _Node, node: _Node, python: bool) -> str:
    """The values ``node`` allows, in words."""
    node = _resolve(schema, node)
    if "anyOf" in node:
        branches = [_resolve(schema, b) for b in node["anyOf"]]
        words = [_allowed(schema, b, python) for b in branches if b.get("type") != "null"]
        null = any(b.get("type") == "null" for b in branches)
        return " or ".join((["null"] if null else []) + words)
    if "const" in node:
        return repr(node["const"])
    if "enum" in node:
        return "one of " + ", ".join(repr(v) for v in node["enum"])
    kind = node.get("type")
    if kind == "integer":
        low, high = node.get("minimum"), node.get("maximum")
        if high is not None:
            return f"an integer {low}..{high}" if low is not None else f"an integer <= {high}"
        return "an integer" if low is None else f"an integer >= {low}"
    if kind == "number":
        low, below = node.get("minimum"), node.get("exclusiveMaximum")
        if low is not None and below is not None:
            return f"a number {low} <= x < {below}"
        return "a number"
    if kind == "boolean":
        return "true or false"
    if kind == "string":
        return "a non-empty string" if node.get("minLength") else "a string"
    if kind == "array":
        sort = "tuple" if python else "list"
        return f"a non-empty {sort}" if node.get("minItems") else f"a {sort}"
    if kind == "object":
        return "a JSON object"
    return "a JSON value"
