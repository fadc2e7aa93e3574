"""The walker's rules for numbers: whole inclusive integer bounds, and the integer steps xgrammar can count."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from engine.grammar.pattern import Unsatisfiable
from engine.grammar.schema.refused import Refused
from engine.grammar.schema.values import is_number

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# xgrammar 0.2.9 counts an integer step only over a range of at most this many integers; over a wider one it drops the
# step silently ({"minimum": 0, "maximum": 10000, "multipleOf": 2} accepts 1; found by bisecting the range).
STEP_RANGE_LIMIT = 10_000


def rules(walker: Walker, node: dict[str, Any], pointer: str, depth: int) -> None:
    """A number or integer node made exact for xgrammar: whole inclusive integer bounds, the steps it can count."""
    if any(k in node and not is_number(node[k]) for k in _BOUNDS):
        return  # xgrammar reports it
    types = walker.types_of(node, None)
    step = node.get("multipleOf")
    whole_step = isinstance(step, int | float) and is_number(step) and step > 0 and float(step).is_integer()
    if whole_step and "number" in types:
        # A number that is a multiple of an integer is an integer: xgrammar's integer rule counts steps.
        declared = node.get("type")
        node["type"] = (
            [("integer" if t == "number" else t) for t in declared] if isinstance(declared, list) else "integer"
        )
        types = walker.types_of(node, None)
        walker.count("number with an integer multipleOf made integer")
    if "integer" in types:
        integer_bounds(walker, node)
    if step is None:
        return
    if not is_number(step) or step <= 0:
        return  # xgrammar reports it
    if "number" in types or not float(step).is_integer():
        raise Refused("multipleOf", "other than a whole number" if "number" not in types else "on numbers")
    if step == 1:
        del node["multipleOf"]
        walker.count("vacuous keyword removed")
        return
    if step > 1024:
        raise Refused("multipleOf", "xgrammar handles integer steps up to 1024")
    if ("minimum" in node) != ("maximum" in node):
        raise Refused("multipleOf", "with a bound on one side only")
    if "minimum" in node and node["maximum"] - node["minimum"] >= STEP_RANGE_LIMIT:
        raise Refused("multipleOf", f"over a range of more than {STEP_RANGE_LIMIT} integers")


def integer_bounds(walker: Walker, node: dict[str, Any]) -> None:
    """xgrammar wants whole inclusive bounds on integers: round them inward, the same integers pass."""
    changed = False
    if "exclusiveMinimum" in node:
        low = math.floor(node.pop("exclusiveMinimum")) + 1
        node["minimum"] = max(low, math.ceil(node["minimum"])) if "minimum" in node else low
        changed = True
    if "exclusiveMaximum" in node:
        high = math.ceil(node.pop("exclusiveMaximum")) - 1
        node["maximum"] = min(high, math.floor(node["maximum"])) if "maximum" in node else high
        changed = True
    for key, rounding in (("minimum", math.ceil), ("maximum", math.floor)):
        value = node.get(key)
        if isinstance(value, float):
            node[key] = int(rounding(value))
            changed = True
    if changed:
        walker.count("integer bounds made whole and inclusive")
    if "minimum" in node and "maximum" in node and node["minimum"] > node["maximum"]:
        raise Unsatisfiable
