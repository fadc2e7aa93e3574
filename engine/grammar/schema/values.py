"""JSON values as the validator sees them: kinds, numbers, equality (``1 == 1.0`` but ``true != 1``), and how they are
shown in messages."""

from __future__ import annotations

import math
from typing import Any

from engine.grammar.schema.vocabulary import ANNOTATIONS


def clip(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_count(value: Any) -> bool:
    return is_number(value) and float(value).is_integer() and value >= 0


def type_set(declared: Any) -> frozenset[str] | None:
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list) and declared and all(isinstance(t, str) for t in declared):
        return frozenset(declared)
    return None


def type_in(json_type: str, types: frozenset[str]) -> bool:
    """Whether every instance of ``json_type`` has one of ``types`` (every integer is a number)."""
    return json_type in types or (json_type == "integer" and "number" in types)


def value_has_type(value: Any, json_type: str) -> bool:
    if json_type == "null":
        return value is None
    if json_type == "boolean":
        return isinstance(value, bool)
    if json_type == "string":
        return isinstance(value, str)
    if json_type == "array":
        return isinstance(value, list)
    if json_type == "object":
        return isinstance(value, dict)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return json_type == "number" or float(value).is_integer()


def json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values as the validator sees it: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def single_value(schema: dict[str, Any]) -> bool:
    return "const" in schema or (isinstance(schema.get("enum"), list) and len(schema["enum"]) == 1)


def same_json(a: Any, b: Any) -> bool:
    """Whether two JSON values are identical, kinds included (``True == 1`` in Python); iterative, for deep ones."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif x != y:
            return False
    return True


def listed_values(schema: Any) -> list[Any] | None:
    """The values a schema that is only a ``const`` or an ``enum`` (annotations aside) allows; None for another one."""
    if not isinstance(schema, dict) or len(set(schema) - ANNOTATIONS) != 1:
        return None
    if "const" in schema:
        return [schema["const"]]
    values = schema.get("enum")
    return list(values) if isinstance(values, list) else None
