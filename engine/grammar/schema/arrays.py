"""The walker's rules for arrays: explicit items, tuples cut at an impossible position, the uniqueItems it can spell."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.grammar.pattern import Unsatisfiable
from engine.grammar.schema.refused import Refused
from engine.grammar.schema.values import is_count, single_value
from engine.grammar.schema.vocabulary import XGRAMMAR_ANNOTATIONS

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker


def rules(walker: Walker, node: dict[str, Any], pointer: str, depth: int) -> None:
    """An array node made exact for xgrammar: explicit items, its children visited, uniqueItems where spelled."""
    keys = walker.validation_keys(node)
    for key in ("minContains", "maxContains"):
        if key in keys and "contains" not in keys:
            del node[key]  # without contains they constrain nothing
            walker.count("vacuous keyword removed")
    if "contains" in keys:
        if walker.checking:  # xgrammar misreads contains with minContains: no array passes
            walker.check(node, ("contains", "minContains", "maxContains"), pointer)
        else:
            walker.refuse("contains", pointer)
    prefix = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
    min_items = node.get("minItems", 0) if is_count(node.get("minItems", 0)) else 0
    # An array node without items: xgrammar allows any items only when the node says nothing but its type
    # (and annotations); with anything else it allows none beyond prefixItems, which minItems can contradict.
    unlisted = "items" not in node and "unevaluatedItems" not in node
    bare = set(node) <= {"type"} | XGRAMMAR_ANNOTATIONS
    if unlisted and ((not prefix and not bare) or min_items > len(prefix)):
        node["items"] = {}
        walker.count("array items made explicit")
    if "uniqueItems" in node:
        try:
            unique_items(walker, node)
        except Refused as refused:
            if walker.checking:
                walker.check(node, ("uniqueItems",), pointer, refused.detail)
            else:
                walker.refuse(refused.keyword, pointer, refused.detail)
    if isinstance(node.get("prefixItems"), list):
        prefix = [walker.visit(s, f"{pointer}/prefixItems/{i}", depth + 1) for i, s in enumerate(node["prefixItems"])]
        if False in prefix:  # the array must end before that position
            cut = prefix.index(False)
            if min_items > cut:
                raise Unsatisfiable
            prefix = prefix[:cut]
            node["items"] = False
            walker.count("impossible tuple position made the array shorter")
        node["prefixItems"] = prefix
    for key in ("items", "unevaluatedItems"):
        if isinstance(node.get(key), dict):
            node[key] = walker.visit(node[key], f"{pointer}/{key}", depth + 1)
    if node.get("items") is False and not node.get("prefixItems") and min_items > 0:
        raise Unsatisfiable


def unique_items(walker: Walker, node: dict[str, Any]) -> None:
    if node["uniqueItems"] is not True:
        del node["uniqueItems"]
        walker.count("vacuous keyword removed")
        return
    prefix = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
    longest = node["maxItems"] if is_count(node.get("maxItems")) else None
    if node.get("items") is False:
        longest = len(prefix) if longest is None else min(longest, len(prefix))
    if longest is not None and longest <= 1:
        del node["uniqueItems"]
        walker.count("vacuous keyword removed")
        return
    items = node.get("items")
    if not prefix and isinstance(items, dict) and single_value(items):
        node["maxItems"] = 1  # two equal items are all that could repeat
        del node["uniqueItems"]
        walker.count("uniqueItems of a single-valued item made maxItems")
        return
    raise Refused("uniqueItems")
