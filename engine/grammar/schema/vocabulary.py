"""The drafts' vocabularies: which keywords a draft validates with, and which ones xgrammar reads whatever the draft."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

from engine.grammar.schema.pointer import escape

JSON_TYPES = ("null", "boolean", "object", "array", "number", "string")
ALL_TYPES = frozenset((*JSON_TYPES, "integer"))


class Draft(enum.IntEnum):
    """The JSON Schema drafts whose vocabularies differ in what the policy must enforce."""

    DRAFT4 = 4
    DRAFT6 = 6
    DRAFT7 = 7
    DRAFT2019 = 2019
    DRAFT2020 = 2020


DRAFT_URIS = {
    "draft-04": Draft.DRAFT4,
    "draft-06": Draft.DRAFT6,
    "draft-07": Draft.DRAFT7,
    "draft/2019-09": Draft.DRAFT2019,
    "draft/2020-12": Draft.DRAFT2020,
}

# The keywords jsonschema's validator checks for each draft (its VALIDATORS table, without ``format``: it asserts
# nothing unless a format checker is configured).
_COMMON = frozenset(
    {
        "$ref", "additionalProperties", "allOf", "anyOf", "enum", "maxItems", "maxLength", "maxProperties",
        "maximum", "minItems", "minLength", "minProperties", "minimum", "multipleOf", "not", "oneOf", "pattern",
        "patternProperties", "properties", "required", "type", "uniqueItems", "items",
    }
)  # fmt: skip
VOCABULARY = {
    Draft.DRAFT4: _COMMON | {"additionalItems", "dependencies"},
    Draft.DRAFT6: _COMMON
    | {"additionalItems", "dependencies", "const", "contains", "exclusiveMaximum", "exclusiveMinimum", "propertyNames"},
    Draft.DRAFT7: _COMMON
    | {"additionalItems", "dependencies", "const", "contains", "exclusiveMaximum", "exclusiveMinimum", "propertyNames"}
    | {"if"},
    Draft.DRAFT2019: _COMMON
    | {"additionalItems", "const", "contains", "exclusiveMaximum", "exclusiveMinimum", "propertyNames", "if"}
    | {"$recursiveRef", "dependentRequired", "dependentSchemas", "unevaluatedItems", "unevaluatedProperties"}
    | {"minContains", "maxContains"},
    Draft.DRAFT2020: _COMMON
    | {"const", "contains", "exclusiveMaximum", "exclusiveMinimum", "propertyNames", "if", "prefixItems"}
    | {"$dynamicRef", "dependentRequired", "dependentSchemas", "unevaluatedItems", "unevaluatedProperties"}
    | {"minContains", "maxContains"},
}
# Keywords xgrammar 0.2.9 acts on whatever the draft: when the draft's validator ignores one, it is removed.
XGRAMMAR_READS = frozenset(
    {
        "const", "prefixItems", "unevaluatedItems", "unevaluatedProperties", "propertyNames", "minContains",
        "exclusiveMinimum", "exclusiveMaximum", "additionalItems",
    }
)  # fmt: skip
STRING_KEYS = frozenset({"minLength", "maxLength", "pattern"})
NUMBER_KEYS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
ARRAY_KEYS = frozenset(
    {"items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems"}
    | {"contains", "minContains", "maxContains"}
)
OBJECT_KEYS = frozenset(
    {"properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "required"}
    | {"propertyNames", "minProperties", "maxProperties", "dependencies", "dependentRequired", "dependentSchemas"}
)
TYPE_KEYS = {"string": STRING_KEYS, "number": NUMBER_KEYS, "integer": NUMBER_KEYS}
TYPE_KEYS |= {"array": ARRAY_KEYS, "object": OBJECT_KEYS, "boolean": frozenset(), "null": frozenset()}

# The keywords xgrammar 0.2.9 itself treats as annotations (besides them, a lone "type" keeps an array open).
XGRAMMAR_ANNOTATIONS = frozenset(
    {"title", "default", "description", "examples", "deprecated", "readOnly", "writeOnly", "$comment", "$schema"}
)


ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "$schema", "$id", "id", "deprecated",
        "readOnly", "writeOnly", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "contentMediaType",
        "contentEncoding", "contentSchema", "$defs", "definitions", "format",
    }
)  # fmt: skip


def draft_of(schema: Any) -> Draft:
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    if isinstance(uri, str):
        for marker, draft in DRAFT_URIS.items():
            if marker in uri:
                return draft
    return Draft.DRAFT2020


def constraints(schema: Any) -> Any:
    """``schema`` without its annotations (in subschemas too), for comparing what two schemas accept."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in ("properties", "patternProperties", "dependentSchemas") and isinstance(value, dict):
            out[key] = {name: constraints(sub) for name, sub in value.items()}  # names are data, not keywords
        elif key in ("allOf", "anyOf", "oneOf", "prefixItems") and isinstance(value, list):
            out[key] = [constraints(sub) for sub in value]
        elif isinstance(value, dict) and key not in ("const", "enum", "dependencies", "dependentRequired"):
            out[key] = constraints(value)  # items, additionalProperties, not, ...
        else:
            out[key] = value  # values (enum, const, required, bounds) are compared as they are
    return out


# Where subschemas sit: under a name (a map of them), in a list, or alone.
_SUBSCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SUBSCHEMAS = frozenset(
    {"items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "not", "if"}
    | {"then", "else", "contains", "propertyNames"}
)


def keyword_places(schema: Any) -> Iterator[tuple[str, str]]:
    """Every validation keyword of ``schema`` (by its draft) with the JSON pointer of its place, subschemas included."""
    known = VOCABULARY[draft_of(schema)]
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            place = f"{pointer}/{escape(key)}"
            if key in known:
                yield key, place
            if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
                stack.extend((sub, f"{place}/{escape(name)}") for name, sub in value.items())
            elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
                stack.extend((sub, f"{place}/{i}") for i, sub in enumerate(value))
            elif key in _SUBSCHEMAS:
                stack.append((value, place))
