"""Disjointness of oneOf branches: what a branch accepts, coarsely, and proofs that two never accept one instance."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.grammar.pattern import Regex
from engine.grammar.schema.refused import Refused
from engine.grammar.schema.validator import Validator
from engine.grammar.schema.values import is_count, is_number, json_equal, type_set, value_has_type
from engine.grammar.schema.vocabulary import ALL_TYPES, TYPE_KEYS

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker


class Cover(enum.Enum):
    """How much of one JSON type a schema accepts."""

    NONE = "none"
    SOME = "some"
    ALL = "all"


PARTITION = ("null", "boolean", "object", "array", "number", "string")  # integers are among the numbers
_ANY_TYPE_KEYS = frozenset({"not", "if", "allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "$recursiveRef"})


@dataclass(frozen=True)
class Shape:
    """What a oneOf branch accepts, coarsely: enough to prove that two branches never accept one instance."""

    types: frozenset[str]
    values: tuple[Any, ...] | None  # the instances, when the branch lists them
    schema: dict[str, Any] | None  # the branch with $ref and allOf resolved, when that was possible
    walker: Walker

    @classmethod
    def of(cls, walker: Walker, branch: Any, depth: int) -> Shape:
        if branch is False:
            return cls(frozenset(), (), None, walker)
        if not isinstance(branch, dict):
            return cls(ALL_TYPES, None, None, walker)
        try:
            flat: Any = walker.inline(walker.normalise(branch), depth)
            if isinstance(flat, dict) and isinstance(flat.get("allOf"), list):
                merged: Any = {k: v for k, v in flat.items() if k != "allOf"}
                for entry in flat["allOf"]:
                    merged = walker.merge(merged, entry, depth + 1)
                flat = merged
        except Refused:
            return cls(ALL_TYPES, None, None, walker)
        if flat is False:
            return cls(frozenset(), (), None, walker)
        if not isinstance(flat, dict):
            return cls(ALL_TYPES, None, None, walker)
        values: tuple[Any, ...] | None = None
        if "const" in flat:
            values = (flat["const"],)
        elif isinstance(flat.get("enum"), list):
            values = tuple(flat["enum"])
        types = type_set(flat.get("type")) or ALL_TYPES
        if values is not None:
            types = frozenset(t for t in types if any(value_has_type(v, t) for v in values))
        return cls(types, values, flat, walker)

    def covers(self, json_type: str) -> Cover:
        """NONE, SOME or ALL of the instances of ``json_type`` (one of PARTITION)."""
        numeric = json_type == "number"
        if json_type not in self.types and not (numeric and "integer" in self.types):
            return Cover.NONE
        if self.values is not None:
            return Cover.SOME if any(value_has_type(v, json_type) for v in self.values) else Cover.NONE
        if self.schema is None or (numeric and "number" not in self.types):
            return Cover.SOME
        relevant = TYPE_KEYS[json_type] | _ANY_TYPE_KEYS
        return Cover.SOME if self.walker.validation_keys(self.schema) & relevant else Cover.ALL

    def disjoint_on(self, other: Shape, json_type: str) -> bool:
        """True when no instance of ``json_type`` is accepted by both."""
        mine = None if self.values is None else [v for v in self.values if value_has_type(v, json_type)]
        theirs = None if other.values is None else [v for v in other.values if value_has_type(v, json_type)]
        if mine is not None and theirs is not None:
            return not any(json_equal(v, w) for v in mine for w in theirs)
        validator = Validator(self.walker)
        for listed, schema in ((mine, other.schema), (theirs, self.schema)):
            if listed is not None:
                return schema is not None and all(validator.valid(v, schema, 0) is False for v in listed)
        a, b = self.schema, other.schema
        if a is None or b is None:
            return False
        if json_type == "object":
            return _objects_disjoint(self.walker, a, b) or _objects_disjoint(self.walker, b, a)
        if json_type == "string":
            return _strings_disjoint(a, b)
        if json_type == "number":
            return _ranges_disjoint(a, b)
        return False


def first_clash(present: list[tuple[int, Shape]], json_type: str) -> tuple[int, int] | None:
    """The first two branches that may both accept one instance of ``json_type``."""
    for a in range(len(present)):
        for b in range(a + 1, len(present)):
            if not present[a][1].disjoint_on(present[b][1], json_type):
                return present[a][0], present[b][0]
    return None


def _objects_disjoint(walker: Walker, a: dict[str, Any], b: dict[str, Any]) -> bool:
    props_a = a["properties"] if isinstance(a.get("properties"), dict) else {}
    props_b = b["properties"] if isinstance(b.get("properties"), dict) else {}
    required_a = set(a["required"]) if isinstance(a.get("required"), list) else set()
    required_b = set(b["required"]) if isinstance(b.get("required"), list) else set()
    for key in sorted(k for k in required_a & required_b if isinstance(k, str)):
        # A discriminator: a name both require, whose listed values differ.
        if key in props_a and key in props_b:
            left, right = Shape.of(walker, props_a[key], 0), Shape.of(walker, props_b[key], 0)
            listed = left.values is not None and right.values is not None
            if listed and not any(json_equal(v, w) for v in left.values or () for w in right.values or ()):
                return True
    # A closed object cannot hold a name the other one requires.
    closed = a.get("additionalProperties", a.get("unevaluatedProperties")) is False and not a.get("patternProperties")
    return closed and any(isinstance(k, str) and props_a.get(k, False) is False for k in required_b)


def _strings_disjoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    low_a, high_a = _length_range(a)
    low_b, high_b = _length_range(b)
    if (high_a is not None and high_a < low_b) or (high_b is not None and high_b < low_a):
        return True
    pa, pb = a.get("pattern"), b.get("pattern")
    return isinstance(pa, str) and isinstance(pb, str) and Regex.parse(pa).disjoint(Regex.parse(pb))


def _length_range(schema: dict[str, Any]) -> tuple[int, int | None]:
    """The lengths a string of ``schema`` may have, as the validator counts them."""
    low = int(schema["minLength"]) if is_count(schema.get("minLength")) else 0
    high = int(schema["maxLength"]) if is_count(schema.get("maxLength")) else None
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        shape = Regex.parse(pattern)
        if shape.problem is None and shape.anchored == (True, True):
            # Python's "$" also matches before a final newline: one character more.
            longest = None if shape.width[1] is None else shape.width[1] + 1
            low = max(low, shape.width[0])
            high = longest if high is None else (high if longest is None else min(high, longest))
    return low, high


def _ranges_disjoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def bounds(s: dict[str, Any]) -> tuple[float, float, bool, bool]:
        low, high, open_low, open_high = -math.inf, math.inf, False, False
        if is_number(s.get("minimum")):
            low = s["minimum"]
        if is_number(s.get("exclusiveMinimum")) and s["exclusiveMinimum"] >= low:
            low, open_low = s["exclusiveMinimum"], True
        if is_number(s.get("maximum")):
            high = s["maximum"]
        if is_number(s.get("exclusiveMaximum")) and s["exclusiveMaximum"] <= high:
            high, open_high = s["exclusiveMaximum"], True
        return low, high, open_low, open_high

    la, ha, ola, oha = bounds(a)
    lb, hb, olb, ohb = bounds(b)
    return ha < lb or (ha == lb and (oha or olb)) or hb < la or (hb == la and (ohb or ola))
