"""The walker's rules for objects: required names declared, patternProperties merged into the names they match,
propertyNames applied to declared names, dependencies resolved or made a choice, impossible properties undeclared."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from engine.grammar.pattern import Regex, Unsatisfiable
from engine.grammar.schema import strings
from engine.grammar.schema.pointer import escape
from engine.grammar.schema.refused import Refused
from engine.grammar.schema.validator import Validator
from engine.grammar.schema.values import clip, json_equal
from engine.grammar.schema.vocabulary import constraints

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker

# The keywords that decide which schema a member's value follows: xgrammar can mix them up (see rules).
_NAME_KEYWORDS = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "propertyNames")


def rules(walker: Walker, node: dict[str, Any], pointer: str, depth: int) -> None:
    """An object node made exact for xgrammar: patterns, dependencies, required and forbidden names, children."""
    properties = dict(node["properties"]) if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", node.get("unevaluatedProperties"))
    names = node.get("propertyNames") not in (None, True, {})
    if properties and extra not in (None, False) and (node.get("patternProperties") or names):
        # xgrammar then lets a declared name in as an additional one, with the additional schema's value:
        # {"properties": {"b": {"type": "object"}}, "additionalProperties": true, "patternProperties": {...}}
        # accepts {"b": 2}.
        keyword = "patternProperties" if node.get("patternProperties") else "propertyNames"
        detail = "next to properties and additionalProperties, which xgrammar then mixes up"
        walker.refuse(keyword, pointer, detail, _NAME_KEYWORDS)
    raw_required = node.get("required")
    required = [k for k in raw_required if isinstance(k, str)] if isinstance(raw_required, list) else []
    patterns = key_patterns(walker, node, pointer)
    merged = patterns_on_declared(walker, properties, patterns, depth)
    one_path_per_name(walker, merged, patterns, pointer)
    properties = merged
    dependencies(walker, node, properties, patterns, required, pointer)  # may require (and declare) more names
    declare_required(walker, node, properties, patterns, required)
    properties = property_names_on_declared(walker, node, properties, required)
    if "propertyNames" in node and extra is False and not patterns:
        # Only declared names can appear, and those were just checked. Kept, propertyNames would make
        # xgrammar accept undeclared ones: {"propertyNames": ..., "additionalProperties": false} accepts {"a": 1}.
        del node["propertyNames"]
        walker.count("propertyNames of a closed object applied to its properties")
    if properties or "properties" in node:
        node["properties"] = properties
    visit_children(walker, node, pointer, depth)
    if isinstance(node.get("properties"), dict):
        node["properties"] = drop_impossible(walker, node, node["properties"], patterns, required, pointer)


def key_patterns(walker: Walker, node: dict[str, Any], pointer: str) -> dict[str, Any]:
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict) or not patterns:
        return {}
    checked: dict[str, Any] = {}
    for pattern, schema in patterns.items():
        try:
            checked[strings.checked_pattern(walker, pattern, "patternProperties")] = schema
        except Refused as refused:
            walker.refuse(refused.keyword, pointer, refused.detail, (f"patternProperties/{escape(pattern)}",))
            if not walker.checking:  # checked mode leaves the pattern out of the grammar: xgrammar would misread it
                checked[pattern] = schema
    names = list(checked)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            if not Regex.parse(names[a]).disjoint(Regex.parse(names[b])):
                detail = f"{clip(names[a])} and {clip(names[b])} may match the same name"
                walker.refuse("patternProperties", pointer, detail)
    if names != list(patterns):
        node["patternProperties"] = checked
    return patterns


def property_names_on_declared(
    walker: Walker, node: dict[str, Any], properties: dict[str, Any], required: list[str]
) -> dict[str, Any]:
    """xgrammar checks propertyNames only on undeclared names: undeclare the declared ones it forbids."""
    names = node.get("propertyNames")
    if names is None or names is True or names == {} or not properties:
        return properties
    validator = Validator(walker)
    kept = {}
    for key, schema in properties.items():
        verdict = validator.valid(key, names, 0)
        if verdict is None:
            raise Refused("propertyNames", "next to declared properties, and not checkable against them")
        if verdict:
            kept[key] = schema
        elif key in required:
            raise Unsatisfiable
    if len(kept) != len(properties):
        walker.count("properties forbidden by propertyNames undeclared")
    return kept


def patterns_on_declared(
    walker: Walker, properties: dict[str, Any], patterns: dict[str, Any], depth: int
) -> dict[str, Any]:
    """A declared property whose name a patternProperties pattern matches must satisfy both schemas."""
    if not patterns:
        return properties
    out = {}
    for key, schema in properties.items():
        for pattern, extra in patterns.items():
            if search(pattern, key):
                try:
                    schema = walker.merge(schema, extra, depth + 1)
                except Refused as refused:
                    raise Refused(
                        "patternProperties",
                        f"{clip(pattern)} also matches property {key!r}, and "
                        f"the schemas cannot be merged ({refused.keyword})",
                    ) from None
                walker.count("patternProperties merged into the properties they match")
        out[key] = schema
    return out


def one_path_per_name(walker: Walker, merged: dict[str, Any], patterns: dict[str, Any], pointer: str) -> None:
    """A declared name a pattern fully matches also takes the pattern's path in xgrammar, with only the
    pattern's schema: exact only when the declared (merged) schema is that same schema."""
    for key, schema in merged.items():
        for pattern, extra in patterns.items():
            if fullmatch(pattern, key) and not json_equal(constraints(schema), constraints(extra)):
                detail = f"{clip(pattern)} matches property {key!r} whose schema differs: xgrammar accepts either"
                walker.refuse("patternProperties", pointer, detail, ("properties", "patternProperties"))


def declare_required(
    walker: Walker, node: dict[str, Any], properties: dict[str, Any], patterns: dict[str, Any], required: list[str]
) -> None:
    """xgrammar ignores a required name ``properties`` does not declare: declare it, with the schema it has."""
    for key in required:
        if key in properties:
            continue
        matching = [s for p, s in patterns.items() if search(p, key)]
        schema: Any = {}
        if matching:
            for extra in matching:
                schema = walker.merge(schema, extra, 0)
        else:
            extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
            if extra is False:
                raise Unsatisfiable
            schema = {} if extra is True else extra
        properties[key] = schema
        walker.count("required property declared")


def dependencies(
    walker: Walker,
    node: dict[str, Any],
    properties: dict[str, Any],
    patterns: dict[str, Any],
    required: list[str],
    pointer: str,
) -> None:
    """A dependency on a required name becomes required names; one on a name that cannot appear is vacuous."""
    for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
        rules = node.get(keyword)
        if keyword not in walker.validation_keys(node) or not isinstance(rules, dict):
            continue
        resolved = True
        for trigger, rule in rules.items():
            names = rule if isinstance(rule, list) else None
            if names is not None and all(k in required for k in names):
                continue
            if trigger in required and names is not None:
                added = [k for k in names if isinstance(k, str) and k not in required]
                required.extend(added)
                node["required"] = list(required)
                declare_required(walker, node, properties, patterns, added)
                continue
            if trigger not in required and not can_appear(walker, node, trigger, properties, patterns):
                continue
            walker.refuse(keyword, pointer, f"on {trigger!r}")
            resolved = False
        if resolved:
            del node[keyword]
            walker.count(f"{keyword} resolved")


def expand_dependencies(walker: Walker, node: dict[str, Any], depth: int) -> dict[str, Any] | None:
    """Dependencies made keywords xgrammar enforces: those of a required name always apply (merged in); in a
    closed object, the others become a choice, each trigger either absent (undeclared, so that the closed
    object cannot hold it) or present (required, with what it demands). None when nothing changes, or when
    that is not exact (an open object, a trigger a pattern matches) or too large (more than 3 triggers)."""
    keys = walker.validation_keys(node)
    keywords = [k for k in ("dependencies", "dependentRequired", "dependentSchemas") if k in keys]
    if not keywords or any(not isinstance(node[k], dict) for k in keywords):
        return None
    properties: dict[str, Any] = node["properties"] if isinstance(node.get("properties"), dict) else {}
    raw_required = node.get("required")
    required = [k for k in raw_required if isinstance(k, str)] if isinstance(raw_required, list) else []
    rules = [(trigger, rule) for keyword in keywords for trigger, rule in node[keyword].items()]
    if any(not isinstance(rule, list | dict | bool) for _, rule in rules):
        return None
    always = [rule for trigger, rule in rules if trigger in required]
    optional = [(t, r) for t, r in rules if t not in required and not (isinstance(r, list) and set(r) <= set(required))]
    triggers = list(dict.fromkeys(trigger for trigger, _ in optional))  # one name may head several rules
    patterns: dict[str, Any] = node["patternProperties"] if isinstance(node.get("patternProperties"), dict) else {}
    if triggers and (len(triggers) > 3 or not closed(node)):
        return None
    if any(any(search(p, t) for p in patterns) or properties.get(t, {}) is False for t in triggers):
        return None
    base: Any = {k: v for k, v in node.items() if k not in keywords}
    for rule in always:
        base = walker.merge(base, {"required": rule} if isinstance(rule, list) else rule, depth + 1)
    if base is False:
        raise Unsatisfiable
    walker.count("dependencies resolved")
    if not triggers:
        return base
    branches: list[Any] = []
    for present in range(2 ** len(triggers)):
        branch: Any = {**base, "properties": dict(base.get("properties") or {})}
        demands: list[Any] = []
        for bit, trigger in enumerate(triggers):
            if not present >> bit & 1:
                branch["properties"].pop(trigger, None)
                continue
            for rule in (r for t, r in optional if t == trigger):
                demands.append({"required": [trigger, *rule]} if isinstance(rule, list) else {"required": [trigger]})
                if not isinstance(rule, list):
                    demands.append(rule)
        for demand in demands:
            branch = walker.merge(branch, demand, depth + 1)
        if branch is not False:
            branches.append(branch)
    if not branches:
        raise Unsatisfiable
    walker.count("dependencies of a closed object made a choice")
    return {**{k: v for k, v in node.items() if k not in keys}, "anyOf": branches}


def can_appear(
    walker: Walker, node: dict[str, Any], key: str, properties: dict[str, Any], patterns: dict[str, Any]
) -> bool:
    if key in properties:
        return properties[key] is not False
    if any(search(p, key) for p in patterns):
        return True
    return not closed(node)


def drop_impossible(
    walker: Walker,
    node: dict[str, Any],
    properties: dict[str, Any],
    patterns: dict[str, Any],
    required: list[str],
    pointer: str,
) -> dict[str, Any]:
    """A property no value satisfies must be absent: xgrammar cannot compile ``false``, so undeclare it."""
    impossible = [k for k, s in properties.items() if s is False]
    if not impossible:
        return properties
    if any(k in required for k in impossible):
        raise Unsatisfiable
    for key in impossible:
        if not closed(node) or any(search(p, key) for p in patterns):
            detail = f"{key!r} must be absent, but the object accepts other names"
            if not walker.checking:
                raise Refused("properties", detail)
            walker.refuse("properties", pointer, detail, (f"properties/{escape(key)}",))  # undeclared, and checked
    walker.count("impossible property undeclared")
    return {k: s for k, s in properties.items() if s is not False}


def visit_children(walker: Walker, node: dict[str, Any], pointer: str, depth: int) -> None:
    if isinstance(node.get("properties"), dict):
        node["properties"] = {
            key: walker.visit(schema, f"{pointer}/properties/{escape(key)}", depth + 1)
            for key, schema in node["properties"].items()
        }
    if isinstance(node.get("patternProperties"), dict):
        node["patternProperties"] = {
            p: walker.visit(s, f"{pointer}/patternProperties/{escape(p)}", depth + 1)
            for p, s in node["patternProperties"].items()
        }
    for key in ("additionalProperties", "unevaluatedProperties"):
        if isinstance(node.get(key), dict):
            node[key] = walker.visit(node[key], f"{pointer}/{key}", depth + 1)
    if isinstance(node.get("propertyNames"), dict):
        node["propertyNames"] = walker.visit(node["propertyNames"], f"{pointer}/propertyNames", depth + 1, "string")


def closed(node: dict[str, Any]) -> bool:
    """Whether xgrammar lets no undeclared name into the object (strict mode closes one without
    additionalProperties, unless propertyNames opens it to the names it allows)."""
    extra = node.get("additionalProperties", node.get("unevaluatedProperties"))
    names = node.get("propertyNames") not in (None, True, {})
    return extra is False or (extra is None and not names)


def fullmatch(pattern: str, text: str) -> bool:
    try:
        return re.fullmatch(pattern, text) is not None
    except re.error:
        return False


def search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False
