"""The walker's rules for ``if``/``then``/``else``: a test xgrammar can spell becomes a choice of exact branches.

xgrammar ignores ``if``, ``then`` and ``else``. When the ``if`` is a simple test, the instances split into cases the
walker can spell, each going to ``then`` or to ``else``, and the node becomes an ``anyOf`` of the cases, each merged
with the node and with its branch:

- ``{"required": [k]}``: k present (then), k absent (else; spelled as ``k: false``, which the object rules make
  exact in a closed object, or which is impossible when the node requires k);
- ``{"properties": {k: S}}`` with S a ``const`` or an ``enum`` (and ``"required": [k]`` or not), when the node lists
  the values k may take (an ``enum``, a ``const``, a boolean): the values S allows (then, with k's absence on the
  side of the test that holds when k is missing) and the other listed values (else).

Anything else is left as it is, for the policy to refuse or for checked mode to check on the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.grammar.schema.refused import Refused
from engine.grammar.schema.values import json_equal, listed_values
from engine.grammar.schema.vocabulary import ANNOTATIONS

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker

CONDITIONAL_KEYS = ("if", "then", "else")
MAX_BRANCHES = 16  # a choice grows two-fold per conditional: a node with more is left for the fallback


def is_conditional(entry: Any) -> bool:
    """An allOf entry that is only a conditional (annotations aside)."""
    return isinstance(entry, dict) and "if" in entry and set(entry) - ANNOTATIONS <= set(CONDITIONAL_KEYS)


def as_choice(walker: Walker, node: dict[str, Any], depth: int) -> dict[str, Any] | None:
    """``node``, which holds an ``if``, as ``{"anyOf": [...]}`` of exact cases; None when the test is not simple."""
    context = {k: v for k, v in node.items() if k not in CONDITIONAL_KEYS}
    return apply(walker, context, {k: node[k] for k in CONDITIONAL_KEYS if k in node}, depth)


def apply(walker: Walker, context: Any, conditional: dict[str, Any], depth: int) -> dict[str, Any] | None:
    """``context`` constrained further by ``conditional`` (an ``if`` with its ``then``/``else``), as an anyOf.

    A context that is itself only an anyOf (an earlier conditional's cases) takes the conditional in each branch.
    """
    if isinstance(context, dict) and set(context) - ANNOTATIONS == {"anyOf"} and isinstance(context["anyOf"], list):
        branches: list[Any] = []
        for branch in context["anyOf"]:
            split = apply(walker, branch, conditional, depth + 1)
            if split is None:
                return None
            branches.extend(split["anyOf"])
        return _choice(branches)
    if not isinstance(context, dict):
        return None
    cases = _cases(walker, context, conditional["if"])
    if cases is None:
        return None
    then, otherwise = conditional.get("then", True), conditional.get("else", True)
    branches = []
    try:
        for test, holds in cases:
            branch = walker.merge(walker.merge(context, test, depth + 1), then if holds else otherwise, depth + 1)
            if branch is not False:
                branches.append(branch)
    except Refused:
        return None
    return _choice(branches)


def _choice(branches: list[Any]) -> dict[str, Any] | None:
    if len(branches) > MAX_BRANCHES:
        return None
    return {"anyOf": branches} if branches else {"anyOf": [False]}


def _cases(walker: Walker, context: dict[str, Any], test: Any) -> list[tuple[Any, bool]] | None:
    """The instances of ``context`` split by ``test`` into cases spelled as schemas: (case, whether the test holds)."""
    if not isinstance(test, dict):
        return None
    keys = set(test) - ANNOTATIONS
    required = test.get("required")
    if keys == {"required"} and isinstance(required, list) and len(required) == 1 and isinstance(required[0], str):
        name = required[0]
        return [({"required": [name]}, True), ({"properties": {name: False}}, False)]
    properties = test.get("properties")
    if keys - {"required"} != {"properties"} or not isinstance(properties, dict) or len(properties) != 1:
        return None
    name, allowed = next(iter(properties.items()))
    if required is not None and required != [name]:
        return None
    listed = listed_values(allowed)
    domain = _domain(walker, context, name)
    if listed is None or domain is None:
        return None
    others = [v for v in domain if not any(json_equal(v, w) for w in listed)]
    rest: Any = {"enum": others} if others else False
    if required is None:  # a missing name passes the test
        return [({"properties": {name: allowed}}, True), ({"required": [name], "properties": {name: rest}}, False)]
    return [({"required": [name], "properties": {name: allowed}}, True), ({"properties": {name: rest}}, False)]


def _domain(walker: Walker, context: dict[str, Any], name: str) -> list[Any] | None:
    """The values property ``name`` of ``context`` may take, when the context lists them."""
    properties = context.get("properties")
    if not isinstance(properties, dict) or name not in properties:
        return None
    declared = properties[name]
    try:
        if isinstance(declared, dict) and "$ref" in declared:
            declared = walker.inline(declared, 0)
    except Refused:
        return None
    if declared is False:
        return []  # the name cannot appear: only the missing case is left
    if not isinstance(declared, dict):
        return None
    if "const" in declared:
        return [declared["const"]]
    if isinstance(declared.get("enum"), list):
        return list(declared["enum"])
    if declared.get("type") == "boolean":
        return [False, True]
    return None
