"""The integer range of JSON grammars: an integer a schema leaves unbounded stays within what every reader keeps.

JSON puts no limit on integers, but its readers do: JavaScript and most JSON libraries parse numbers as IEEE doubles,
exact for integers only within +-(2^53 - 1) (the interoperable range of I-JSON, RFC 7493), and the smg gateway, which
parses a tool call's arguments before it returns them, keeps 64-bit integers and turns longer ones into doubles
(``1.7154902112512202e+83``). A model asked for an ``integer`` without bounds may write any number of digits, and
the client would then read another number than the one generated, a silently corrupted id.

So by default (:attr:`IntegerRange.SAFE`) every schema node typed ``integer`` gets ``minimum`` ``-(2^53 - 1)`` where it
has no lower bound and ``maximum`` ``2^53 - 1`` where it has no upper bound, before anything else reads the schema:
the grammar, the policy's rewrite and checked mode's output check all see the bounded schema, in every mode (a nested
node that is nothing but an integer refers to one shared bounded definition, compiled once). What the
schema says explicitly stays as written: its own bounds (also beyond the range: ``{"minimum": 2**60}`` keeps no
maximum, since it asks for integers beyond the range), listed values (``const``, ``enum``), nodes that combine
(``$ref``, ``anyOf``, ``oneOf``, ``allOf``: their branches are bounded where they are typed) and steps
(``multipleOf``: xgrammar enforces a step only over a range small enough to count, and would drop it between
+-(2^53 - 1)). Nodes under ``not`` and ``if`` are left alone (a bound there would widen the schema, not narrow it). A
node typed ``number`` (or both) is not bounded: any double is a number as its readers read it.
:attr:`IntegerRange.UNBOUNDED` (``--json-integer-range unbounded``) compiles schemas as given.
"""

from __future__ import annotations

import enum
from typing import Any

from engine.grammar.schema.values import is_number

SAFE_INTEGER = 2**53 - 1  # the largest integer every double-reading client keeps exact (JavaScript's MAX_SAFE_INTEGER)
RANGE_FLAG = "--json-integer-range"

# Keywords whose value is one subschema, a list of them, or a map of names to them, where an instance of the node
# may be checked against the subschema itself (``not`` and ``if`` are not among them: see the module docstring).
_ONE = (
    *("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems", "contains"),
    *("then", "else"),
)
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_BOUND_KEYS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
_COMBINING = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# Keywords that change nothing about which instances a node accepts (a subset of the drafts' annotations).
_PLAIN_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated"})


class IntegerRange(enum.Enum):
    """What a JSON grammar allows for an integer its schema leaves unbounded. The value is the flag's spelling."""

    SAFE = "safe"  # within +-(2^53 - 1)
    UNBOUNDED = "unbounded"  # any number of digits, as the schema is written


def bound_integers(schema: Any) -> int:
    """Bound, in place, every integer node of ``schema`` (a parsed JSON value) that leaves a side open, as the module
    docstring says; returns how many nodes changed. Iterative: a deeply nested schema cannot exhaust the stack.

    A node that says nothing but ``"type": "integer"`` (annotations aside) becomes a reference to one shared bounded
    integer in the root's ``$defs``: xgrammar compiles a range once per occurrence but a reference once per target,
    and the range of +-(2^53 - 1) costs it about 1.5 ms per occurrence on a 2k vocabulary (ten integer properties: 15
    ms inline, 3 ms shared), more on a large one."""
    shared = _SharedInteger(schema)
    changed = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        changed += _bound_node(node)
        for container, key in _subschema_slots(node):
            if shared.replace(container, key):
                changed += 1
            else:
                stack.append(container[key])
    shared.install()
    return changed


class _SharedInteger:
    """The root's ``$defs`` entry every plain integer node refers to (created on first use)."""

    def __init__(self, root: Any) -> None:
        defs = root.get("$defs", {}) if isinstance(root, dict) else None
        self._root = root if isinstance(defs, dict) else None  # a malformed $defs is xgrammar's to report
        self._ref: str | None = None
        self._name = ""

    def replace(self, container: Any, key: Any) -> bool:
        """Replace ``container[key]`` by the shared reference if it is a plain integer node."""
        node = container[key]
        if self._root is None or not isinstance(node, dict) or node.get("type") != "integer":
            return False
        if not set(node) - {"type"} <= _PLAIN_ANNOTATIONS:
            return False
        if self._ref is None:
            taken = self._root.get("$defs", {})
            self._name = "ordinal_safe_integer"
            while self._name in taken:
                self._name += "_"
            self._ref = f"#/$defs/{self._name}"
        container[key] = {"$ref": self._ref}
        return True

    def install(self) -> None:
        if self._root is not None and self._ref is not None:
            defs = dict(self._root.get("$defs", {}))
            defs[self._name] = {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
            self._root["$defs"] = defs


def _subschema_slots(node: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(container, key) of every subschema of ``node`` an instance may be checked against."""
    slots: list[tuple[Any, Any]] = [(node, key) for key in _ONE if isinstance(node.get(key), dict)]
    for key in _LISTS:
        if isinstance(node.get(key), list):
            slots.extend((node[key], i) for i in range(len(node[key])))
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            slots.extend((node[key], name) for name in node[key])
    return slots


def _bound_node(node: dict[str, Any]) -> int:
    declared = node.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    if "integer" not in types or "number" in types or any(key in node for key in _COMBINING):
        return 0
    if node.get("multipleOf", 1) != 1:
        return 0  # xgrammar counts steps only over a small range: between +-(2^53 - 1) it would drop the step
    if any(key in node and not isinstance(node[key], bool) and not is_number(node[key]) for key in _BOUND_KEYS):
        return 0  # a bound that is not a number: xgrammar reports it
    low = _bound(node, "minimum", "exclusiveMinimum")
    high = _bound(node, "maximum", "exclusiveMaximum")
    added = 0
    if low is None and (high is None or high >= -SAFE_INTEGER):
        node["minimum"] = -SAFE_INTEGER
        added = 1
    if high is None and (low is None or low <= SAFE_INTEGER):
        node["maximum"] = SAFE_INTEGER
        added = 1
    return added


def _bound(node: dict[str, Any], inclusive: str, exclusive: str) -> int | float | None:
    """The node's bound on one side, None when it has none. A draft-4 boolean ``exclusiveMinimum`` only modifies
    ``minimum``: alone it bounds nothing."""
    values = [node[key] for key in (inclusive, exclusive) if key in node and not isinstance(node[key], bool)]
    if not values:
        return None
    return max(values) if inclusive == "minimum" else min(values)
