"""Merging two schemas into one that accepts exactly what both accept (the semantics of allOf), keyword by keyword."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.grammar.pattern import Unsatisfiable
from engine.grammar.schema.refused import Refused
from engine.grammar.schema.values import is_number, json_equal, type_in, type_set
from engine.grammar.schema.vocabulary import JSON_TYPES, VOCABULARY

if TYPE_CHECKING:
    from engine.grammar.schema.walker import Walker


@dataclass
class Merger:
    """The keyword-by-keyword conjunction of two schema objects whose $refs are already inlined."""

    walker: Walker
    depth: int

    def merge(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._types(a, b, out)
        self._finite(a, b, out)
        self._object(a, b, out)
        self._items(a, b, out)
        for key in list(a) + [k for k in b if k not in a]:
            if key in _MERGED_TOGETHER:
                continue
            if key not in b or key not in a:
                out[key] = a[key] if key in a else b[key]
            else:
                out[key] = self._keyword(key, a[key], b[key])
        return out

    def _keyword(self, key: str, x: Any, y: Any) -> Any:
        if json_equal(x, y):
            return x
        if key in _LOWER_BOUNDS and is_number(x) and is_number(y):
            return max(x, y)
        if key in _UPPER_BOUNDS and is_number(x) and is_number(y):
            return min(x, y)
        if key == "uniqueItems":
            return bool(x) or bool(y)
        if key == "multipleOf" and isinstance(x, int) and isinstance(y, int) and x > 0 and y > 0:
            return math.lcm(x, y)
        if key == "allOf" and isinstance(x, list) and isinstance(y, list):
            return x + y
        if key in ("anyOf", "oneOf") and isinstance(x, list) and isinstance(y, list) and len(x) * len(y) <= 64:
            # (A1|A2)&(B1|B2) is A1&B1|A1&B2|...; exactly one Ai and exactly one Bj hold iff exactly one pair does.
            pairs = [self.walker.merge(p, q, self.depth + 1) for p in x for q in y]
            live = [p for p in pairs if p is not False]
            if not live:
                raise Unsatisfiable
            return live
        if key == "not":
            return {"anyOf": [x, y]}  # not A and not B is not (A or B)
        if key == "propertyNames":
            return self.walker.merge(x, y, self.depth + 1)
        if key not in VOCABULARY[self.walker.draft]:
            return x  # annotations and unknown keywords constrain nothing
        raise Refused(key, "with different values in the schemas merged")

    def _types(self, a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
        ta, tb = type_set(a.get("type")), type_set(b.get("type"))
        if ta is None or tb is None:
            if "type" in a or "type" in b:
                out["type"] = a["type"] if "type" in a else b["type"]
            return
        common = [t for t in (*JSON_TYPES, "integer") if type_in(t, ta) and type_in(t, tb)]
        if "number" in common:
            common.remove("integer")
        if not common:
            raise Unsatisfiable
        out["type"] = common[0] if len(common) == 1 else common

    def _finite(self, a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
        lists = [s["enum"] for s in (a, b) if isinstance(s.get("enum"), list)]
        lists += [[s["const"]] for s in (a, b) if "const" in s]
        if not lists:
            return
        values = lists[0]
        for other in lists[1:]:
            values = [v for v in values if any(json_equal(v, w) for w in other)]
        if not values:
            raise Unsatisfiable
        if "const" in a or "const" in b:
            out["const"] = values[0]
        else:
            out["enum"] = values

    def _object(self, a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
        required = [*(a.get("required") or []), *(b.get("required") or [])]
        if required:
            out["required"] = list(dict.fromkeys(k for k in required if isinstance(k, str)))
        pa, pb = a.get("patternProperties"), b.get("patternProperties")
        props_a = a["properties"] if isinstance(a.get("properties"), dict) else {}
        props_b = b["properties"] if isinstance(b.get("properties"), dict) else {}
        if pa is not None or pb is not None:
            # A name a pattern matches is governed by the pattern's schema, not by additionalProperties: merging
            # per name is only right when both sides list the same patterns, names and fallback.
            shaped = [s for s in (a, b) if {"properties", "additionalProperties", "unevaluatedProperties"} & s.keys()]
            same = (
                json_equal(pa, pb)
                and props_a.keys() == props_b.keys()
                and json_equal(_extra(a, "Properties"), _extra(b, "Properties"))
            )
            if (len(shaped) == 2 and not same) or (pa is not None and pb is not None and not json_equal(pa, pb)):
                raise Refused("patternProperties", "with other properties in the merged schemas")
            out["patternProperties"] = pa if pa is not None else pb
        if not any(k in s for k in ("properties", "additionalProperties", "unevaluatedProperties") for s in (a, b)):
            return
        name_a, extra_a = _extra(a, "Properties")
        name_b, extra_b = _extra(b, "Properties")
        merged = {}
        for key in list(props_a) + [k for k in props_b if k not in props_a]:
            merged[key] = self.walker.merge(props_a.get(key, extra_a), props_b.get(key, extra_b), self.depth + 1)
        if merged or "properties" in a or "properties" in b:
            out["properties"] = merged
        if name_a is not None or name_b is not None:
            if name_a and name_b and name_a != name_b:
                raise Refused("unevaluatedProperties", "next to additionalProperties")
            out[name_a or name_b or "additionalProperties"] = self.walker.merge(extra_a, extra_b, self.depth + 1)

    def _items(self, a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
        if not any(k in s for k in ("items", "prefixItems", "unevaluatedItems") for s in (a, b)):
            return
        name_a, extra_a = _extra(a, "Items")
        name_b, extra_b = _extra(b, "Items")
        prefix_a = a["prefixItems"] if isinstance(a.get("prefixItems"), list) else []
        prefix_b = b["prefixItems"] if isinstance(b.get("prefixItems"), list) else []
        if prefix_a or prefix_b:
            length = max(len(prefix_a), len(prefix_b))
            left = [*prefix_a, *[extra_a] * (length - len(prefix_a))]
            right = [*prefix_b, *[extra_b] * (length - len(prefix_b))]
            out["prefixItems"] = [self.walker.merge(x, y, self.depth + 1) for x, y in zip(left, right, strict=True)]
        if name_a is not None or name_b is not None:
            if name_a and name_b and name_a != name_b:
                raise Refused("unevaluatedItems", "next to items")
            out[name_a or name_b or "items"] = self.walker.merge(extra_a, extra_b, self.depth + 1)


_LOWER_BOUNDS = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"})
_UPPER_BOUNDS = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"})
_MERGED_TOGETHER = frozenset(
    {"type", "const", "enum", "required", "properties", "patternProperties", "additionalProperties"}
    | {"unevaluatedProperties", "items", "prefixItems", "unevaluatedItems"}
)


def _extra(schema: dict[str, Any], suffix: str) -> tuple[str | None, Any]:
    """The keyword governing members the schema does not list (``additionalProperties``/``items`` or
    ``unevaluated...``) and its schema, ``True`` when absent, as the validator reads it."""
    for key in ("additionalProperties" if suffix == "Properties" else "items", f"unevaluated{suffix}"):
        if key in schema:
            return key, schema[key]
    return None, True
