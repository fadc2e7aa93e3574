"""The walker's rules for strings: lengths become patterns over the raw JSON text, patterns are checked and rewritten
for xgrammar's automaton."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.grammar.pattern import (
    FORCE_EXPANSION,
    JSON_CHAR,
    RAW_CHAR,
    Regex,
    Unsatisfiable,
    for_xgrammar,
    nested_optional,
)
from engine.grammar.schema.refused import Refused
from engine.grammar.schema.values import clip, is_count

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker


def rules(walker: Walker, node: dict[str, Any], pointer: str, depth: int) -> None:
    """A string node made exact for xgrammar: lengths as a pattern (or folded into its pattern), the pattern checked."""
    if node.get("minLength") == 0:
        del node["minLength"]
        walker.count("vacuous keyword removed")
    lengths: dict[str, Any] = {k: node[k] for k in ("minLength", "maxLength") if k in node}
    if not all(is_count(v) for v in lengths.values()):
        return  # xgrammar reports the malformed bound
    if "format" in node and ("pattern" in node or lengths):
        del node["format"]  # an annotation to the validator; to xgrammar it would hide the pattern and lengths
        walker.count("format next to pattern/length removed")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        node["pattern"] = checked_pattern(walker, pattern, "pattern")
        if lengths:
            node["pattern"] = pattern_with_length(walker, node["pattern"], lengths)
            walker.generated.add(node["pattern"])
            for key in lengths:
                del node[key]
            walker.count("length folded into the pattern")
    elif lengths:
        high = lengths.get("maxLength")
        node["pattern"] = length_pattern(walker, int(lengths.get("minLength", 0)), None if high is None else int(high))
        for key in lengths:
            del node[key]
        walker.count("string length made a pattern")


def checked_pattern(walker: Walker, pattern: str, keyword: str) -> str:
    shape = Regex.parse(pattern)
    if shape.problem:
        raise Refused(keyword, f"{clip(pattern)} has {shape.problem}")
    if not shape.avoids_specials:
        raise Refused(keyword, f"{clip(pattern)} needs a character JSON must escape; xgrammar would emit it raw")
    text = for_xgrammar(shape.tree)
    if text is None:
        raise Refused(keyword, f"{clip(pattern)} repeats more than xgrammar's automaton can hold")
    if text != pattern:
        walker.count("pattern rewritten for xgrammar")
    return text


def length_pattern(walker: Walker, low: int, high: int | None) -> str:
    if high is not None and low > high:
        raise Unsatisfiable
    limit = walker.policy.exact_length_limit
    if low <= limit and (high is None or high <= limit):
        body = JSON_CHAR * low + (JSON_CHAR + "*" if high is None else nested_optional(high - low))
        pattern = f"^{body}$"
    else:
        bounds = f"{{{low},}}" if high is None else f"{{{low},{high}}}"
        pattern = f"^{RAW_CHAR}{bounds}{FORCE_EXPANSION}$"
    walker.generated.add(pattern)
    return pattern


def pattern_with_length(walker: Walker, pattern: str, lengths: dict[str, Any]) -> str:
    """xgrammar drops lengths next to a pattern: fold them into the pattern (exactly where possible)."""
    low, high = int(lengths.get("minLength", 0)), lengths.get("maxLength")
    folded = Regex.parse(pattern).with_length(low, None if high is None else int(high))
    if folded is None:
        keyword = "maxLength" if "maxLength" in lengths else "minLength"
        raise Refused(keyword, f"next to a pattern it cannot be folded into ({clip(pattern)})")
    text, exact = folded
    if not exact:
        # A subset: the longest matches are cut per quantifier rather than in total (see capped_to).
        walker.count("length folded into the pattern (subset)")
    return text
