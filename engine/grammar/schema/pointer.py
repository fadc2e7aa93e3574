r"""JSON pointers and in-document references: resolving, escaping, finding and renaming ``$ref``\ s."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

MISSING = object()  # what a pointer that leads nowhere resolves to


def refs_in(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if isinstance(current.get("$ref"), str):
                yield current["$ref"]
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)


def stable_ref(ref: str) -> bool:
    return ref == "#" or re.fullmatch(r"#/(\$defs|definitions)/[^/~%]+", ref) is not None


def replace_refs(value: Any, mapping: dict[str, str]) -> Any:
    if isinstance(value, dict):
        out = {k: replace_refs(v, mapping) for k, v in value.items()}
        if isinstance(out.get("$ref"), str) and out["$ref"] in mapping:
            out["$ref"] = mapping[out["$ref"]]
        return out
    if isinstance(value, list):
        return [replace_refs(v, mapping) for v in value]
    return value


def unescape(part: str) -> str:
    return urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")


def escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def pointer_of(ref: str) -> str:
    return "".join("/" + escape(unescape(p)) for p in ref[2:].split("/")) if ref.startswith("#/") else ""


def resolve_pointer(root: Any, ref: str) -> Any:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return MISSING
    node = root
    for part in ref[2:].split("/"):
        key = unescape(part)
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return MISSING
    return node
