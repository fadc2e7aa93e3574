"""A small validator: whether a listed JSON value satisfies the keywords next to it, or None when it cannot tell."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.grammar.schema.pointer import MISSING
from engine.grammar.schema.values import is_number, json_equal, type_set, value_has_type
from engine.grammar.schema.vocabulary import Draft

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker


@dataclass
class Validator:
    """Decides whether a JSON value satisfies a schema, for the keywords that occur next to const and enum.

    Answers None for anything it does not evaluate: the caller then refuses instead of guessing.
    """

    walker: Walker

    def valid(self, value: Any, schema: Any, depth: int) -> bool | None:
        if schema is True or schema == {}:
            return True
        if schema is False:
            return False
        if not isinstance(schema, dict) or depth > 32:
            return None
        keys = self.walker.validation_keys(schema)
        if isinstance(schema.get("$ref"), str):
            target = self.walker.resolve(schema["$ref"])
            verdict = None if target is MISSING else self.valid(value, target, depth + 1)
            if verdict is not True or self.walker.draft <= Draft.DRAFT7:
                return verdict
        verdicts = [self.keyword(value, k, schema, depth) for k in sorted(keys - {"$ref"})]
        if False in verdicts:
            return False
        return None if None in verdicts else True

    def keyword(self, value: Any, key: str, schema: dict[str, Any], depth: int) -> bool | None:
        arg = schema[key]
        check = _CHECKS.get(key)
        if check is not None:
            return check(value, arg)
        if key in ("allOf", "anyOf", "oneOf") and isinstance(arg, list):
            verdicts = [self.valid(value, s, depth + 1) for s in arg]
            if None in verdicts:
                return None
            hits = sum(1 for v in verdicts if v)
            return {"allOf": hits == len(arg), "anyOf": hits >= 1, "oneOf": hits == 1}[key]
        if key == "not":
            verdict = self.valid(value, arg, depth + 1)
            return None if verdict is None else not verdict
        if key == "properties" and isinstance(arg, dict):
            if not isinstance(value, dict):
                return True
            verdicts = [self.valid(value[k], s, depth + 1) for k, s in arg.items() if k in value]
            return None if None in verdicts else all(verdicts)
        if key == "items" and isinstance(arg, dict | bool):
            if not isinstance(value, list):
                return True
            verdicts = [self.valid(v, arg, depth + 1) for v in value]
            return None if None in verdicts else all(verdicts)
        return None


def _check_type(value: Any, arg: Any) -> bool | None:
    types = type_set(arg)
    return None if types is None else any(value_has_type(value, t) for t in types)


def _check_enum(value: Any, arg: Any) -> bool | None:
    return any(json_equal(value, e) for e in arg) if isinstance(arg, list) else None


def _check_pattern(value: Any, arg: Any) -> bool | None:
    if not isinstance(value, str):
        return True
    try:
        return re.search(arg, value) is not None
    except (re.error, TypeError):
        return None


def _check_multiple(value: Any, arg: Any) -> bool | None:
    if not is_number(value):
        return True
    if not is_number(arg) or arg <= 0:
        return None
    quotient = value / arg
    return math.isfinite(quotient) and float(quotient).is_integer()


def _check_unique(value: Any, arg: Any) -> bool | None:
    if not isinstance(value, list) or arg is not True:
        return True
    return all(not json_equal(value[i], value[j]) for i in range(len(value)) for j in range(i + 1, len(value)))


def _check_required(value: Any, arg: Any) -> bool | None:
    if not isinstance(value, dict):
        return True
    return all(k in value for k in arg) if isinstance(arg, list) else None


def _bound(kind: str, test: Any) -> Any:
    """A check of a size or a bound, vacuous for values of another kind."""

    def check(value: Any, arg: Any) -> bool | None:
        if not value_has_type(value, kind):
            return True
        if not is_number(arg):
            return None
        return bool(test(len(value) if kind != "number" else value, arg))

    return check


_CHECKS: dict[str, Any] = {
    "type": _check_type,
    "enum": _check_enum,
    "const": lambda value, arg: json_equal(value, arg),
    "pattern": _check_pattern,
    "multipleOf": _check_multiple,
    "uniqueItems": _check_unique,
    "required": _check_required,
    "minLength": _bound("string", lambda n, a: n >= a),
    "maxLength": _bound("string", lambda n, a: n <= a),
    "minItems": _bound("array", lambda n, a: n >= a),
    "maxItems": _bound("array", lambda n, a: n <= a),
    "minProperties": _bound("object", lambda n, a: n >= a),
    "maxProperties": _bound("object", lambda n, a: n <= a),
    "minimum": _bound("number", lambda n, a: n >= a),
    "maximum": _bound("number", lambda n, a: n <= a),
    "exclusiveMinimum": _bound("number", lambda n, a: n > a),
    "exclusiveMaximum": _bound("number", lambda n, a: n < a),
}
