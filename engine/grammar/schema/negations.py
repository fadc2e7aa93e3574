"""The walker's rules for ``not``: a negation xgrammar can spell without one.

xgrammar ignores ``not``. Two forms become keywords it enforces: ``not`` of types (the remaining types as a type
list) and ``not`` of listed values on a node of one type whose values the walker can enumerate or split: a boolean
(the other value), null, or an integer (the ranges between the excluded integers, as an anyOf).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.grammar.pattern import Unsatisfiable
from engine.grammar.schema.refused import Refused
from engine.grammar.schema.values import json_equal, listed_values, type_in, type_set, value_has_type
from engine.grammar.schema.vocabulary import ANNOTATIONS, JSON_TYPES

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker

MAX_EXCLUDED = 8  # excluded integers split a range into this many + 1 pieces at most


def rules(walker: Walker, node: dict[str, Any]) -> Any:
    """Make ``node["not"]`` exact: changes ``node`` in place (None) or returns a schema to visit instead.

    Raises Refused("not") when the negation has no exact spelling, Unsatisfiable when nothing is left."""
    negated = node["not"]
    if negated is True or negated == {}:
        raise Unsatisfiable
    if negated is False:
        del node["not"]
        walker.count("vacuous keyword removed")
        return None
    if isinstance(negated, dict) and set(negated) - ANNOTATIONS == {"type"} and _types_left(walker, node, negated):
        return None
    excluded = listed_values(negated)
    if excluded is not None:
        replaced = _values_left(walker, node, excluded)
        if replaced is not None:
            return replaced
    raise Refused("not")


def _types_left(walker: Walker, node: dict[str, Any], negated: dict[str, Any]) -> bool:
    excluded = type_set(negated["type"])
    allowed = walker.types_of(node, None)
    if excluded is None or ("integer" in excluded and "number" not in excluded and "number" in allowed):
        return False
    remaining = [t for t in (*JSON_TYPES, "integer") if t in allowed and not type_in(t, excluded)]
    if not remaining:
        raise Unsatisfiable
    del node["not"]
    node["type"] = remaining[0] if len(remaining) == 1 else remaining
    walker.count("not of types made a type list")
    return True


def _values_left(walker: Walker, node: dict[str, Any], excluded: list[Any]) -> Any:
    """The node without the excluded values, for a node of a single type: None when that type is not one of those
    whose values split exactly (boolean, null, integer)."""
    types = walker.types_of(node, None)
    if len(types) != 1 or not isinstance(node.get("type"), str):
        return None
    (json_type,) = types
    hits = [v for v in excluded if value_has_type(v, json_type)]
    rest = {k: v for k, v in node.items() if k != "not"}
    if json_type == "boolean":
        left = [b for b in (False, True) if not any(json_equal(b, v) for v in hits)]
        if not left:
            raise Unsatisfiable
        walker.count("not of values made the values left")
        return {**rest, "enum": left}
    if json_type == "null":
        if hits:
            raise Unsatisfiable
        walker.count("vacuous keyword removed")
        return rest
    if json_type != "integer" or len(hits) > MAX_EXCLUDED:
        return None
    if not hits:
        walker.count("vacuous keyword removed")
        return rest
    cuts = sorted({int(v) for v in hits})
    pieces: list[dict[str, Any]] = []
    low: int | None = None
    for cut in cuts:
        pieces.append({"maximum": cut - 1} if low is None else {"minimum": low, "maximum": cut - 1})
        low = cut + 1
    pieces.append({} if low is None else {"minimum": low})
    branches = [walker.merge(rest, piece, 0) for piece in pieces]
    walker.count("not of values made the ranges left")
    return {"anyOf": [b for b in branches if b is not False] or [False]}
