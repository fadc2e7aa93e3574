"""The JSON-schema policy: a schema reaches xgrammar only in a form xgrammar 0.2.9 enforces exactly, or it is refused.

``compile_json_schema`` of xgrammar 0.2.9 silently compiles some keywords into a grammar *looser* than the schema,
so a request could finish with "stop" and an output ``jsonschema`` rejects (or that is not even JSON). Each rule
below was found by experiment: a fresh ``xgrammar.GrammarMatcher`` accepting an instance the schema forbids.

How xgrammar reads a schema node: the *first* of ``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf``, ``allOf``,
``type`` decides the node and every other keyword of the node is ignored (``{"type": "object", "anyOf":
[{"required": ["a"]}]}`` accepts ``7``); a node with none of them is an object when it has ``properties`` (or
``additionalProperties``), an array when it has ``items``, and otherwise *any* JSON value, whatever else it says
(``{"minLength": 2}`` accepts ``"a"``). Per type it enforces:

- string: ``format`` (when known) *or else* ``pattern`` *or else* ``minLength``/``maxLength``; the lengths repeat
  ``[^"\\\\\\r\\n]``, which lets raw control characters through (``{"maxLength": 10}`` accepts ``"a\\x02b"``, not
  JSON) and no escape at all. A ``pattern`` applies to the raw text between the quotes: when the pattern is
  printable ASCII and can match without ``"``, ``\\`` and control characters, xgrammar builds an automaton that
  never matches those (exact, or stricter); otherwise it expands the regex unrestricted (``{"pattern": "^a\\"b$"}``
  accepts ``"a"b"``). Lookaheads are silently dropped.
- integer/number: the bounds; ``multipleOf`` only for integers, only with both or no bounds (``{"type": "integer",
  "multipleOf": 3, "minimum": 0}`` accepts ``4``); a non-integer bound on an integer is a compile error.
- array: ``items``, ``prefixItems``, ``minItems``, ``maxItems``; not ``uniqueItems`` (``[1,1]``), ``contains``;
  an array node with array keywords but no ``items`` allows no items at all (``minItems: 1`` fails to compile).
- object: ``properties``, ``required`` (a required key missing from ``properties`` is ignored: ``{"type":
  "object", "required": ["a"]}`` accepts ``{}``), ``additionalProperties``, ``patternProperties`` (one pattern per
  key: with two overlapping patterns only one schema applies; a declared name a pattern matches gets either
  schema), ``propertyNames`` (not checked against declared names; it opens even an object with
  ``additionalProperties: false``), ``minProperties``/``maxProperties``; not ``dependencies``/
  ``dependentRequired``/``dependentSchemas``. With ``patternProperties`` or ``propertyNames`` next to open
  ``additionalProperties``, a declared name also passes as an additional one (``{"b": 2}`` for a declared
  object ``b``).
- never: ``not``, ``if``/``then``/``else``, ``uniqueItems``, ``contains``; ``oneOf`` is ``anyOf`` (``{"oneOf":
  [{"type": "integer"}, {"type": "number"}]}`` accepts ``5``); ``allOf`` with several entries is *any value*;
  a known ``format`` hides ``pattern`` and the lengths; a ``$ref`` to another document (or an anchor) is *any value*.
- and a mask bug: with a character class of many ranges repeated ``{1,200}``, the mask allows tokens the matcher
  then refuses (a grammar abort instead of an output).

The policy rewrites a schema so that xgrammar enforces it exactly (every rewrite accepts the same instances as the
original, or, where noted, a subset) and refuses, naming keyword and JSON pointer, whatever it cannot rewrite:

- lengths become a pattern over the raw JSON text, one escape sequence one character (:meth:`_Walker._length_pattern`);
  next to a pattern they are folded into it (:meth:`Regex.with_length`);
- oneOf becomes anyOf type by type, where the branches provably never accept one instance (:class:`_Shape`);
- keywords next to anyOf/oneOf move into every branch, allOf entries merge into one schema (:class:`_Merger`),
  $ref siblings (2019-09 on) merge into the target; const/enum keep the values their siblings accept;
- typeless keywords get every type, required names get declared, dependencies of closed objects become a choice,
  patternProperties merge into the declared properties they match, and smaller exact spellings (vacuous keywords
  removed, whole integer bounds, ``not`` of a type as a type list, tuple ``items`` as ``prefixItems``).
Keywords are judged by the draft the schema's ``$schema`` names (2020-12 when absent), as ``jsonschema`` does:
annotations and unknown keywords constrain nothing there and pass untouched (choosing to refuse unknown keywords
would refuse most real schemas, which carry vendor extensions, for no gain in correctness); a keyword the draft
does not know but xgrammar would enforce is removed, since the validator ignores it.

Strictness that is *not* looseness stays: xgrammar's strict mode closes objects without ``additionalProperties``,
keeps properties in declared order, enforces known ``format``\\ s (``jsonschema`` treats ``format`` as an annotation)
and reads patterns as full matches; all of these accept a subset of the schema's instances.
"""

from __future__ import annotations

import enum
import json
import math
import re
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.grammar.pattern import (
    FORCE_EXPANSION,
    JSON_CHAR,
    RAW_CHAR,
    Regex,
    Unsatisfiable,
    for_xgrammar,
    nested_optional,
)

XGRAMMAR = "xgrammar 0.2.9"
LOOSE_FLAG = "--loose-json-schema"

JSON_TYPES = ("null", "boolean", "object", "array", "number", "string")
_ALL_TYPES = frozenset((*JSON_TYPES, "integer"))


class Draft(enum.IntEnum):
    """The JSON Schema drafts whose vocabularies differ in what the policy must enforce."""

    DRAFT4 = 4
    DRAFT6 = 6
    DRAFT7 = 7
    DRAFT2019 = 2019
    DRAFT2020 = 2020


_DRAFT_URIS = {
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
_VOCABULARY = {
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
_XGRAMMAR_READS = frozenset(
    {
        "const", "prefixItems", "unevaluatedItems", "unevaluatedProperties", "propertyNames", "minContains",
        "exclusiveMinimum", "exclusiveMaximum", "additionalItems",
    }
)  # fmt: skip
_STRING_KEYS = frozenset({"minLength", "maxLength", "pattern"})
_NUMBER_KEYS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_ARRAY_KEYS = frozenset(
    {"items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems"}
    | {"contains", "minContains", "maxContains"}
)
_OBJECT_KEYS = frozenset(
    {"properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "required"}
    | {"propertyNames", "minProperties", "maxProperties", "dependencies", "dependentRequired", "dependentSchemas"}
)
_TYPE_KEYS = {"string": _STRING_KEYS, "number": _NUMBER_KEYS, "integer": _NUMBER_KEYS}
_TYPE_KEYS |= {"array": _ARRAY_KEYS, "object": _OBJECT_KEYS, "boolean": frozenset(), "null": frozenset()}


# ==================================================================================================== results


@dataclass(frozen=True)
class Unenforced:
    """A keyword xgrammar would not enforce and no rewrite could make it: the schema is refused for it."""

    keyword: str
    pointer: str  # JSON pointer of the schema node holding the keyword ("" is the root)
    detail: str = ""

    def describe(self) -> str:
        where = self.pointer or "/"
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.keyword} at {where}{detail}"


@dataclass(frozen=True)
class PolicyOutcome:
    """What the policy made of one schema: the schema to compile, the rewrites applied and what is refused."""

    schema: Any
    changed: bool
    rewrites: tuple[tuple[str, int], ...]
    unenforced: tuple[Unenforced, ...]

    @property
    def accepted(self) -> bool:
        return not self.unenforced

    def reason(self, max_places: int = 5) -> str:
        """One readable line naming every refused keyword (at most ``max_places``, then a count) and the way out."""
        places = [u.describe() for u in self.unenforced[:max_places]]
        more = len(self.unenforced) - len(places)
        listed = "; ".join(places) + (f"; and {more} more" if more > 0 else "")
        verb = "is" if len(self.unenforced) == 1 else "are"
        return (
            f"{listed} {verb} not enforced by the grammar engine ({XGRAMMAR}); remove or rewrite "
            f"{'it' if len(self.unenforced) == 1 else 'them'}, or start the grammar service with {LOOSE_FLAG} to "
            "accept such schemas without that guarantee"
        )


class UnenforcedSchemaError(ValueError):
    """The schema uses keywords xgrammar would not enforce; the message says which, where and what to do."""

    def __init__(self, outcome: PolicyOutcome, max_places: int = 5) -> None:
        super().__init__(outcome.reason(max_places))
        self.outcome = outcome


@dataclass(frozen=True)
class JsonSchemaPolicy:
    """Rewrites JSON schemas into forms xgrammar 0.2.9 enforces exactly, and refuses the rest.

    Pure and deterministic (a schema in, a schema out) and bounded: a schema with more than ``max_subschemas``
    visited subschemas or nested deeper than ``max_depth`` is refused rather than walked further ($ref cycles are
    followed once).
    """

    max_subschemas: int = 20_000
    max_depth: int = 96
    # Strings up to this length are rewritten exactly (escapes allowed, each counted as one character); longer
    # bounds use unescaped characters only (a subset), since the exact form costs xgrammar about 1 ms of compile
    # per character on a small vocabulary (70 ms on a 128k one) and nests past its parser's limit near 1000.
    exact_length_limit: int = 64
    max_reported: int = 5

    def __post_init__(self) -> None:
        if min(self.max_subschemas, self.max_depth, self.exact_length_limit, self.max_reported) < 1:
            raise ValueError("JsonSchemaPolicy limits must be >= 1")

    def apply(self, schema: Any) -> PolicyOutcome:
        """Rewrite ``schema`` (a parsed JSON value; it is not modified) and list what stays unenforced."""
        walker = _Walker(self, schema)
        try:
            rewritten = walker.run()
        except RecursionError:  # a pathological nesting the depth limit does not see (a regex, a deep $ref target)
            walker.refuse("schema", "", "nested too deeply to check")
            rewritten = schema
        return PolicyOutcome(
            schema=rewritten,
            changed=not _same_json(rewritten, schema),
            rewrites=tuple(sorted(walker.rewrites.items())),
            unenforced=tuple(walker.unenforced),
        )

    def prepare(self, text: str) -> str:
        """The schema text to hand to xgrammar: ``text`` itself when nothing needed rewriting.

        Raises :class:`UnenforcedSchemaError` when a keyword stays unenforced. Text that is not JSON passes through
        unchanged, so that xgrammar reports the syntax error in its own words.
        """
        try:
            schema = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return text
        outcome = self.apply(schema)
        if not outcome.accepted:
            raise UnenforcedSchemaError(outcome, self.max_reported)
        return json.dumps(outcome.schema) if outcome.changed else text


def _same_json(a: Any, b: Any) -> bool:
    """Whether two JSON values are identical, kinds included (``True == 1`` in Python); iterative, for deep ones."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif x != y:
            return False
    return True


# ==================================================================================================== the walk


class _Refused(Exception):
    """A rewrite is impossible: the keyword (and why) that stays unenforced."""

    def __init__(self, keyword: str, detail: str = "") -> None:
        super().__init__(keyword)
        self.keyword = keyword
        self.detail = detail


_PENDING = object()
_MISSING = object()
# The keywords xgrammar 0.2.9 itself treats as annotations (besides them, a lone "type" keeps an array open).
_XGRAMMAR_ANNOTATIONS = frozenset(
    {"title", "default", "description", "examples", "deprecated", "readOnly", "writeOnly", "$comment", "$schema"}
)


@dataclass
class _Walker:
    """One application of the policy: the state of a single walk over a single schema."""

    policy: JsonSchemaPolicy
    original: Any
    rewrites: Counter[str] = field(default_factory=Counter)
    unenforced: list[Unenforced] = field(default_factory=list)
    visited: int = 0
    root: Any = None
    draft: Draft = Draft.DRAFT2020
    targets: dict[str, Any] = field(default_factory=dict)  # stable ref -> rewritten target (or _PENDING)
    pending: list[str] = field(default_factory=list)  # refs whose targets wait for their visit
    target_pointers: dict[str, str] = field(default_factory=dict)  # hoisted ref -> pointer of the original target
    generated: set[str] = field(default_factory=set)  # the patterns the policy wrote
    shared: dict[str, str] = field(default_factory=dict)  # generated pattern -> its shared $defs entry's ref
    stopped: bool = False

    def run(self) -> Any:
        self.draft = _draft_of(self.original)
        self.root = self._hoist_refs(self.original)
        rewritten = self.visit(self.root, "", 0)
        # Referenced schemas are visited one after the other, not inside the reference: a long chain of
        # definitions neither deepens the recursion nor counts against max_depth.
        while self.pending:
            ref = self.pending.pop()
            target = self.resolve(ref)
            self.targets[ref] = self.visit(target, self.target_pointers.get(ref, _pointer_of(ref)), 0)
        return self._install_targets(rewritten)

    # ------------------------------------------------------------------ bookkeeping

    def count(self, rewrite: str) -> None:
        self.rewrites[rewrite] += 1

    def refuse(self, keyword: str, pointer: str, detail: str = "") -> None:
        place = Unenforced(keyword, pointer, detail)
        if place not in self.unenforced:
            self.unenforced.append(place)

    def _enter(self, pointer: str, depth: int) -> bool:
        """Count one visited subschema; False once a limit is hit (reported once)."""
        if self.stopped:
            return False
        self.visited += 1
        if self.visited > self.policy.max_subschemas:
            self.refuse("schema", "", f"more than {self.policy.max_subschemas} subschemas to check")
            self.stopped = True
        elif depth > self.policy.max_depth:
            self.refuse("schema", pointer, f"nested deeper than {self.policy.max_depth} levels")
            self.stopped = True
        return not self.stopped

    def validation_keys(self, node: dict[str, Any]) -> set[str]:
        """The keywords of ``node`` the schema's draft validates with (annotations and unknown ones excluded)."""
        return {k for k in node if k in _VOCABULARY[self.draft]}

    # ------------------------------------------------------------------ references

    def _hoist_refs(self, schema: Any) -> Any:
        """Give every $ref into a deep location its own ``$defs`` entry, so that rewrites never break its path.

        ``#``, ``#/$defs/x`` and ``#/definitions/x`` stay: rewrites change those entries' contents, never their
        location. A deeper path (``#/properties/a``) or an escaped one (xgrammar does not unescape ``~1``/``%25``)
        is copied to ``#/$defs/<fresh name>``.
        """
        if not isinstance(schema, dict):
            return schema
        deep = sorted({r for r in _refs_in(schema) if r.startswith("#") and not _stable_ref(r)})
        found = [(r, t) for r in deep if (t := _resolve_pointer(schema, r)) is not _MISSING]
        if not found:
            return schema
        defs = schema["$defs"] if isinstance(schema.get("$defs"), dict) else {}
        mapping: dict[str, str] = {}
        for index, (ref, _) in enumerate(found):
            name = f"ordinal_ref_{index}"
            while name in defs:
                name += "_"
            mapping[ref] = f"#/$defs/{name}"
            self.target_pointers[mapping[ref]] = _pointer_of(ref)
        hoisted = _replace_refs(schema, mapping)
        entries = dict(hoisted["$defs"]) if isinstance(hoisted.get("$defs"), dict) else {}
        for ref, target in found:
            entries[mapping[ref].rsplit("/", 1)[1]] = _replace_refs(target, mapping)
        hoisted["$defs"] = entries
        self.count("deep $ref given its own $defs entry")
        return hoisted

    def resolve(self, ref: str) -> Any:
        return _resolve_pointer(self.root, ref)

    def _visit_target(self, ref: str) -> None:
        """Queue the schema ``ref`` names for a visit (once; a dangling reference is xgrammar's to report)."""
        if ref in self.targets or ref == "#" or self.resolve(ref) is _MISSING:
            return
        self.targets[ref] = _PENDING
        self.pending.append(ref)

    def _install_targets(self, root: Any) -> Any:
        if not isinstance(root, dict):
            return root
        for ref, target in self.targets.items():
            if target is _PENDING or not _stable_ref(ref) or ref == "#":
                continue
            container, name = ref[2:].split("/", 1)
            box = dict(root[container]) if isinstance(root.get(container), dict) else {}
            box[name] = target
            root[container] = box
        return root

    def inline(self, node: dict[str, Any], depth: int) -> Any:
        """``node`` with its $ref replaced by the referenced schema (merged with the siblings where they count)."""
        for _ in range(8):
            ref = node.get("$ref")
            if not isinstance(ref, str):
                return node
            target = self.resolve(ref)
            if target is _MISSING:
                raise _Refused("$ref", f"{ref!r} does not resolve inside the schema")
            siblings = {k: v for k, v in node.items() if k != "$ref"} if self.draft >= Draft.DRAFT2019 else {}
            node = self.merge(target, siblings, depth + 1) if siblings else target
            if not isinstance(node, dict):
                return node
        raise _Refused("$ref", "a chain of more than 8 references")

    # ------------------------------------------------------------------ the node visit

    def visit(self, node: Any, pointer: str, depth: int, default_type: str | None = None) -> Any:
        """``node`` rewritten so that xgrammar enforces it exactly; what cannot be is recorded as unenforced.

        Returns ``False`` for a node no instance satisfies (the parent decides what that means).
        """
        if not isinstance(node, dict) or not self._enter(pointer, depth):
            return node
        try:
            notes: list[str] = []
            node = self.normalise(node, notes)
            for note in notes:
                self.count(note)
            if "$ref" in node:
                return self._visit_ref(node, pointer, depth, default_type)
            if "const" in node or "enum" in node:
                return self._visit_finite(node, pointer)
            if "allOf" in node:
                return self._visit_all_of(node, pointer, depth, default_type)
            if "anyOf" in node or "oneOf" in node:
                return self._visit_choice(node, pointer, depth, default_type)
            typed = self._visit_typed(node, pointer, depth, default_type)
            return typed if default_type is not None else self._share(typed)
        except Unsatisfiable:
            return False
        except _Refused as refused:
            self.refuse(refused.keyword, pointer, refused.detail)
            return node

    def _share(self, node: Any) -> Any:
        """A string node the policy gave a generated pattern, as a reference to one shared ``$defs`` entry.

        xgrammar compiles a pattern once per occurrence (a length pattern costs ~0.1 s on a small vocabulary,
        and real schemas repeat ``maxLength: 255`` hundreds of times) but a $ref once per target.
        """
        if not isinstance(node, dict) or node.get("type") != "string" or node.get("pattern") not in self.generated:
            return node
        if self.validation_keys(node) != {"type", "pattern"} or not isinstance(self.root, dict):
            return node
        ref = self.shared.get(node["pattern"])
        if ref is None:
            taken = self.root["$defs"] if isinstance(self.root.get("$defs"), dict) else {}
            name = f"ordinal_string_{len(self.shared)}"
            while name in taken:
                name += "_"
            ref = self.shared[node["pattern"]] = f"#/$defs/{name}"
            self.targets[ref] = {"type": "string", "pattern": node["pattern"]}
        return {"$ref": ref}

    def normalise(self, node: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
        """Draft-specific spellings made the ones xgrammar reads; keywords the draft's validator ignores removed."""
        notes = [] if notes is None else notes
        node = dict(node)
        known = _VOCABULARY[self.draft]
        for key in [k for k in node if k in _XGRAMMAR_READS and k not in known]:
            if self.draft == Draft.DRAFT4 and key in ("exclusiveMinimum", "exclusiveMaximum"):
                continue  # the draft-4 boolean modifier, rewritten below
            del node[key]
            notes.append("keyword unknown to the schema's draft removed")
        if self.draft <= Draft.DRAFT7 and "$ref" in node:
            return node  # these drafts ignore $ref's siblings, and so does xgrammar
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            flag = node.get(exclusive)
            if isinstance(flag, bool):  # draft 4: a boolean modifier of minimum/maximum
                del node[exclusive]
                if flag and _is_number(node.get(bound)):
                    node[exclusive] = node.pop(bound)
                notes.append("draft-4 exclusive bound made numeric")
        items = node.get("items")
        if isinstance(items, list):  # the tuple form of drafts 4 to 2019-09 is prefixItems in 2020-12
            node["prefixItems"] = items
            del node["items"]
            extra = node.pop("additionalItems", True)
            node["items"] = {} if extra is True else extra
            notes.append("tuple items made prefixItems")
        elif "additionalItems" in node:  # without the tuple form it constrains nothing
            del node["additionalItems"]
            notes.append("vacuous keyword removed")
        return node

    # ------------------------------------------------------------------ $ref

    def _visit_ref(self, node: dict[str, Any], pointer: str, depth: int, default_type: str | None) -> Any:
        ref = node["$ref"]
        if not isinstance(ref, str):
            return node  # xgrammar reports it
        if not (ref == "#" or ref.startswith("#/")):
            raise _Refused("$ref", f"{ref!r}: only references inside the schema (#/...) are resolved")
        if self.draft >= Draft.DRAFT2019 and self.validation_keys(node) - {"$ref"}:
            merged = self.inline(node, depth)
            self.count("$ref merged with its sibling keywords")
            return self.visit(merged, pointer, depth + 1, default_type)
        self._visit_target(ref)
        return node

    # ------------------------------------------------------------------ const / enum

    def _visit_finite(self, node: dict[str, Any], pointer: str) -> Any:
        """xgrammar emits the listed values and ignores every sibling: keep only the values the siblings accept."""
        keys = self.validation_keys(node)
        values = [node["const"]] if "const" in node else node.get("enum")
        if not isinstance(values, list) or not values:
            return node  # xgrammar reports the malformed enum
        siblings = {k: node[k] for k in keys - {"const", "enum"}}
        if "const" in node and isinstance(node.get("enum"), list):
            siblings["enum"] = node["enum"]
        if not siblings:
            return node
        kept = []
        validator = _Validator(self)
        for value in values:
            verdict = validator.valid(value, siblings, 0)
            if verdict is None:
                undecided = next(k for k in sorted(siblings) if validator.keyword(value, k, siblings, 0) is None)
                raise _Refused(undecided, "next to const/enum, and not checkable against the listed values")
            if verdict:
                kept.append(value)
        if not kept:
            raise Unsatisfiable
        if len(kept) == len(values) and "enum" not in siblings:
            return node  # xgrammar's reading (only the listed values) is already exact
        self.count("const/enum filtered by its siblings")
        out = {k: v for k, v in node.items() if k not in keys}
        if "const" in node:
            out["const"] = kept[0]
        else:
            out["enum"] = kept
        return out

    # ------------------------------------------------------------------ allOf / anyOf / oneOf

    def _visit_all_of(self, node: dict[str, Any], pointer: str, depth: int, default_type: str | None) -> Any:
        entries = node["allOf"]
        if not isinstance(entries, list):
            return node
        merged: Any = {k: v for k, v in node.items() if k != "allOf"}
        for entry in entries:
            try:
                merged = self.merge(merged, entry, depth + 1)
            except _Refused as refused:
                detail = f"its entries cannot be merged: {refused.keyword}" + (
                    f" ({refused.detail})" if refused.detail else ""
                )
                raise _Refused("allOf", detail) from None
        self.count("allOf merged into one schema")
        return self.visit(merged, pointer, depth + 1, default_type)

    def _visit_choice(self, node: dict[str, Any], pointer: str, depth: int, default_type: str | None) -> Any:
        keyword = "anyOf" if "anyOf" in node else "oneOf"
        branches = node[keyword]
        if not isinstance(branches, list) or not branches:
            return node
        keys = self.validation_keys(node)
        siblings = {k: v for k, v in node.items() if k != keyword and k in keys}
        if siblings:
            try:
                branches = [self.merge(branch, siblings, depth + 1) for branch in branches]
            except _Refused as refused:
                raise _Refused(
                    f"keywords next to {keyword}", f"cannot move {refused.keyword} into its branches"
                ) from None
            self.count(f"keywords next to {keyword} moved into its branches")
        live = [(i, b) for i, b in enumerate(branches) if b is not False]
        if not live:
            raise Unsatisfiable
        if keyword == "oneOf":
            live = self._one_of_as_any_of(live, pointer, depth)
        visited = [self.visit(b, f"{pointer}/{keyword}/{i}", depth + 1, default_type) for i, b in live]
        visited = [b for b in visited if b is not False]
        if not visited:
            raise Unsatisfiable
        # The node's own key order is kept (so that an untouched anyOf compares equal to the original).
        return {
            ("anyOf" if k == keyword else k): (visited if k == keyword else v)
            for k, v in node.items()
            if k not in keys or k == keyword
        }

    def _one_of_as_any_of(self, live: list[tuple[int, Any]], pointer: str, depth: int) -> list[tuple[int, Any]]:
        """oneOf as anyOf, type by type.

        Where one branch accepts instances of a JSON type alone, or several do but provably never the same one,
        the branches stay as they are; where two branches accept every instance of a type, no instance of it is
        valid and the type leaves every branch. Anything else (one branch accepting some instances of a type
        another accepts all of, say) would need a negation xgrammar lacks: the oneOf is refused.
        """
        shapes = [(i, _Shape.of(self, b, depth)) for i, b in live]
        kept: dict[int, list[str]] = {i: [] for i, _ in live}
        for json_type in _PARTITION:
            present = [(i, shape) for i, shape in shapes if shape.covers(json_type) is not _Cover.NONE]
            if sum(1 for _, shape in present if shape.covers(json_type) is _Cover.ALL) >= 2:
                continue  # every instance of the type matches two branches
            clash = _first_clash(present, json_type)
            if clash is not None:
                self.refuse("oneOf", pointer, f"branches {clash[0]} and {clash[1]} may both match one {json_type}")
                return live
            for i, _ in present:
                kept[i].append(json_type)
        out = []
        for (i, branch), (_, shape) in zip(live, shapes, strict=True):
            covered = [t for t in _PARTITION if shape.covers(t) is not _Cover.NONE]
            if not kept[i]:
                continue
            if kept[i] == covered:
                out.append((i, branch))
            else:
                restricted = self.merge(branch, {"type": kept[i][0] if len(kept[i]) == 1 else kept[i]}, depth)
                out.append((i, restricted))
        self.count("oneOf made anyOf")
        if not out:
            raise Unsatisfiable
        return out

    # ------------------------------------------------------------------ typed nodes

    def _visit_typed(self, node: dict[str, Any], pointer: str, depth: int, default_type: str | None) -> Any:
        self._universal(node, pointer)
        node = self._complete_types(node, default_type)
        types = self._types(node, default_type)
        if {"integer", "number"} <= types and isinstance(node.get("type"), list):
            node["type"] = [t for t in node["type"] if t != "integer"]  # every integer is a number
            types = self._types(node, default_type)
        if "object" in types:
            expanded = self._expand_dependencies(node, depth)
            if expanded is not None:
                return self.visit(expanded, pointer, depth + 1, default_type)
        dead: set[str] = set()
        for json_type, handler in (
            ("string", self._string),
            ("number", self._number),
            ("array", self._array),
            ("object", self._object),
        ):
            present = types & ({"integer", "number"} if json_type == "number" else {json_type})
            if not present:
                continue
            try:
                handler(node, pointer, depth)
            except Unsatisfiable:
                dead |= present
            except _Refused as refused:
                self.refuse(refused.keyword, pointer, refused.detail)
        if dead:
            if "type" not in node and default_type is None:
                # xgrammar made the typeless node an object (or array) and that part is impossible: the schema
                # still accepts every other type, each with its own keywords.
                self.count("impossible type removed")
                return self.visit({**node, "type": [t for t in JSON_TYPES if t not in dead]}, pointer, depth + 1)
            types = self._types(node, default_type)  # the handlers may have narrowed the types (number to integer)
            alive = [t for t in (*JSON_TYPES, "integer") if t in types and t not in dead]
            if not alive or not isinstance(node.get("type", default_type), list):
                raise Unsatisfiable
            node["type"] = alive
            self.count("impossible type removed")
        return node

    def _types(self, node: dict[str, Any], default_type: str | None) -> frozenset[str]:
        """The JSON types xgrammar generates for ``node``: a typeless node with properties is an object, ..."""
        declared = node.get("type", default_type)
        if isinstance(declared, str):
            return frozenset({declared})
        if isinstance(declared, list):
            return frozenset(t for t in declared if isinstance(t, str)) or _ALL_TYPES
        if {"properties", "additionalProperties", "unevaluatedProperties"} & node.keys():
            return frozenset({"object"})
        if {"items", "prefixItems", "unevaluatedItems"} & node.keys():
            return frozenset({"array"})
        return _ALL_TYPES

    def _complete_types(self, node: dict[str, Any], default_type: str | None) -> dict[str, Any]:
        """A node xgrammar reads as *any value* ignores its keywords: list every type, so each applies to its own."""
        if "type" in node or default_type is not None or self._types(node, None) != _ALL_TYPES:
            return node
        keys = self.validation_keys(node)
        if not any(keys & _TYPE_KEYS[t] for t in JSON_TYPES):
            return node
        self.count("typeless keywords given every type")
        return {**node, "type": list(JSON_TYPES)}

    def _universal(self, node: dict[str, Any], pointer: str) -> None:
        keys = self.validation_keys(node)
        if "not" in keys:
            try:
                self._not(node)
            except _Refused as refused:
                self.refuse(refused.keyword, pointer, refused.detail)
        if "if" in keys:
            self.refuse("if", pointer, "with then/else" if {"then", "else"} & node.keys() else "")
        for dynamic in ("$dynamicRef", "$recursiveRef"):
            if dynamic in keys:
                self.refuse(dynamic, pointer)

    def _not(self, node: dict[str, Any]) -> None:
        negated = node["not"]
        if negated is True or negated == {}:
            raise Unsatisfiable
        if negated is False:
            del node["not"]
            self.count("vacuous keyword removed")
            return
        if isinstance(negated, dict) and set(negated) - _ANNOTATIONS == {"type"}:
            excluded = _type_set(negated["type"])
            allowed = self._types(node, None)
            if excluded is not None and not (
                "integer" in excluded and "number" not in excluded and "number" in allowed
            ):
                remaining = [t for t in (*JSON_TYPES, "integer") if t in allowed and not _type_in(t, excluded)]
                if not remaining:
                    raise Unsatisfiable
                del node["not"]
                node["type"] = remaining[0] if len(remaining) == 1 else remaining
                self.count("not of types made a type list")
                return
        raise _Refused("not")

    # ------------------------------------------------------------------ strings

    def _string(self, node: dict[str, Any], pointer: str, depth: int) -> None:
        if node.get("minLength") == 0:
            del node["minLength"]
            self.count("vacuous keyword removed")
        lengths: dict[str, Any] = {k: node[k] for k in ("minLength", "maxLength") if k in node}
        if not all(_is_count(v) for v in lengths.values()):
            return  # xgrammar reports the malformed bound
        if "format" in node and ("pattern" in node or lengths):
            del node["format"]  # an annotation to the validator; to xgrammar it would hide the pattern and lengths
            self.count("format next to pattern/length removed")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            node["pattern"] = self._checked_pattern(pattern, "pattern")
            if lengths:
                node["pattern"] = self._pattern_with_length(node["pattern"], lengths)
                self.generated.add(node["pattern"])
                for key in lengths:
                    del node[key]
                self.count("length folded into the pattern")
        elif lengths:
            high = lengths.get("maxLength")
            node["pattern"] = self._length_pattern(
                int(lengths.get("minLength", 0)), None if high is None else int(high)
            )
            for key in lengths:
                del node[key]
            self.count("string length made a pattern")

    def _checked_pattern(self, pattern: str, keyword: str) -> str:
        shape = Regex.parse(pattern)
        if shape.problem:
            raise _Refused(keyword, f"{_clip(pattern)} has {shape.problem}")
        if not shape.avoids_specials:
            raise _Refused(keyword, f"{_clip(pattern)} needs a character JSON must escape; xgrammar would emit it raw")
        text = for_xgrammar(shape.tree)
        if text is None:
            raise _Refused(keyword, f"{_clip(pattern)} repeats more than xgrammar's automaton can hold")
        if text != pattern:
            self.count("pattern rewritten for xgrammar")
        return text

    def _length_pattern(self, low: int, high: int | None) -> str:
        if high is not None and low > high:
            raise Unsatisfiable
        limit = self.policy.exact_length_limit
        if low <= limit and (high is None or high <= limit):
            body = JSON_CHAR * low + (JSON_CHAR + "*" if high is None else nested_optional(high - low))
            pattern = f"^{body}$"
        else:
            bounds = f"{{{low},}}" if high is None else f"{{{low},{high}}}"
            pattern = f"^{RAW_CHAR}{bounds}{FORCE_EXPANSION}$"
        self.generated.add(pattern)
        return pattern

    def _pattern_with_length(self, pattern: str, lengths: dict[str, Any]) -> str:
        """xgrammar drops lengths next to a pattern: fold them into the pattern (exactly where possible)."""
        low, high = int(lengths.get("minLength", 0)), lengths.get("maxLength")
        folded = Regex.parse(pattern).with_length(low, None if high is None else int(high))
        if folded is None:
            keyword = "maxLength" if "maxLength" in lengths else "minLength"
            raise _Refused(keyword, f"next to a pattern it cannot be folded into ({_clip(pattern)})")
        text, exact = folded
        if not exact:
            # A subset: the longest matches are cut per quantifier rather than in total (see capped_to).
            self.count("length folded into the pattern (subset)")
        return text

    # ------------------------------------------------------------------ numbers

    def _number(self, node: dict[str, Any], pointer: str, depth: int) -> None:
        if any(k in node and not _is_number(node[k]) for k in _BOUNDS):
            return  # xgrammar reports it
        types = self._types(node, None)
        step = node.get("multipleOf")
        whole_step = isinstance(step, int | float) and _is_number(step) and step > 0 and float(step).is_integer()
        if whole_step and "number" in types:
            # A number that is a multiple of an integer is an integer: xgrammar's integer rule counts steps.
            declared = node.get("type")
            node["type"] = (
                [("integer" if t == "number" else t) for t in declared] if isinstance(declared, list) else "integer"
            )
            types = self._types(node, None)
            self.count("number with an integer multipleOf made integer")
        if "integer" in types:
            self._integer_bounds(node)
        if step is None:
            return
        if not _is_number(step) or step <= 0:
            return  # xgrammar reports it
        if "number" in types or not float(step).is_integer():
            raise _Refused("multipleOf", "other than a whole number" if "number" not in types else "on numbers")
        if step == 1:
            del node["multipleOf"]
            self.count("vacuous keyword removed")
            return
        if step > 1024:
            raise _Refused("multipleOf", "xgrammar handles integer steps up to 1024")
        if ("minimum" in node) != ("maximum" in node):
            raise _Refused("multipleOf", "with a bound on one side only")

    def _integer_bounds(self, node: dict[str, Any]) -> None:
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
            self.count("integer bounds made whole and inclusive")
        if "minimum" in node and "maximum" in node and node["minimum"] > node["maximum"]:
            raise Unsatisfiable

    # ------------------------------------------------------------------ arrays

    def _array(self, node: dict[str, Any], pointer: str, depth: int) -> None:
        keys = self.validation_keys(node)
        for key in ("minContains", "maxContains"):
            if key in keys and "contains" not in keys:
                del node[key]  # without contains they constrain nothing
                self.count("vacuous keyword removed")
        if "contains" in keys:
            self.refuse("contains", pointer)
        prefix = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
        min_items = node.get("minItems", 0) if _is_count(node.get("minItems", 0)) else 0
        # An array node without items: xgrammar allows any items only when the node says nothing but its type
        # (and annotations); with anything else it allows none beyond prefixItems, which minItems can contradict.
        unlisted = "items" not in node and "unevaluatedItems" not in node
        bare = set(node) <= {"type"} | _XGRAMMAR_ANNOTATIONS
        if unlisted and ((not prefix and not bare) or min_items > len(prefix)):
            node["items"] = {}
            self.count("array items made explicit")
        if "uniqueItems" in node:
            try:
                self._unique_items(node)
            except _Refused as refused:
                self.refuse(refused.keyword, pointer, refused.detail)
        if isinstance(node.get("prefixItems"), list):
            prefix = [self.visit(s, f"{pointer}/prefixItems/{i}", depth + 1) for i, s in enumerate(node["prefixItems"])]
            if False in prefix:  # the array must end before that position
                cut = prefix.index(False)
                if min_items > cut:
                    raise Unsatisfiable
                prefix = prefix[:cut]
                node["items"] = False
                self.count("impossible tuple position made the array shorter")
            node["prefixItems"] = prefix
        for key in ("items", "unevaluatedItems"):
            if isinstance(node.get(key), dict):
                node[key] = self.visit(node[key], f"{pointer}/{key}", depth + 1)
        if node.get("items") is False and not node.get("prefixItems") and min_items > 0:
            raise Unsatisfiable

    def _unique_items(self, node: dict[str, Any]) -> None:
        if node["uniqueItems"] is not True:
            del node["uniqueItems"]
            self.count("vacuous keyword removed")
            return
        prefix = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
        longest = node["maxItems"] if _is_count(node.get("maxItems")) else None
        if node.get("items") is False:
            longest = len(prefix) if longest is None else min(longest, len(prefix))
        if longest is not None and longest <= 1:
            del node["uniqueItems"]
            self.count("vacuous keyword removed")
            return
        items = node.get("items")
        if not prefix and isinstance(items, dict) and _single_value(items):
            node["maxItems"] = 1  # two equal items are all that could repeat
            del node["uniqueItems"]
            self.count("uniqueItems of a single-valued item made maxItems")
            return
        raise _Refused("uniqueItems")

    # ------------------------------------------------------------------ objects

    def _object(self, node: dict[str, Any], pointer: str, depth: int) -> None:
        properties = dict(node["properties"]) if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", node.get("unevaluatedProperties"))
        names = node.get("propertyNames") not in (None, True, {})
        if properties and extra not in (None, False) and (node.get("patternProperties") or names):
            # xgrammar then lets a declared name in as an additional one, with the additional schema's value:
            # {"properties": {"b": {"type": "object"}}, "additionalProperties": true, "patternProperties": {...}}
            # accepts {"b": 2}.
            keyword = "patternProperties" if node.get("patternProperties") else "propertyNames"
            self.refuse(keyword, pointer, "next to properties and additionalProperties, which xgrammar then mixes up")
        raw_required = node.get("required")
        required = [k for k in raw_required if isinstance(k, str)] if isinstance(raw_required, list) else []
        patterns = self._key_patterns(node, pointer)
        merged = self._patterns_on_declared(properties, patterns, depth)
        self._one_path_per_name(merged, patterns, pointer)
        properties = merged
        self._dependencies(node, properties, patterns, required, pointer)  # may require (and declare) more names
        self._declare_required(node, properties, patterns, required)
        properties = self._property_names_on_declared(node, properties, required)
        if "propertyNames" in node and extra is False and not patterns:
            # Only declared names can appear, and those were just checked. Kept, propertyNames would make
            # xgrammar accept undeclared ones: {"propertyNames": ..., "additionalProperties": false} accepts {"a": 1}.
            del node["propertyNames"]
            self.count("propertyNames of a closed object applied to its properties")
        if properties or "properties" in node:
            node["properties"] = properties
        self._visit_object_children(node, pointer, depth)
        if isinstance(node.get("properties"), dict):
            node["properties"] = self._drop_impossible(node, node["properties"], patterns, required)

    def _key_patterns(self, node: dict[str, Any], pointer: str) -> dict[str, Any]:
        patterns = node.get("patternProperties")
        if not isinstance(patterns, dict) or not patterns:
            return {}
        checked: dict[str, Any] = {}
        for pattern, schema in patterns.items():
            try:
                checked[self._checked_pattern(pattern, "patternProperties")] = schema
            except _Refused as refused:
                self.refuse(refused.keyword, pointer, refused.detail)
                checked[pattern] = schema
        names = list(checked)
        for a in range(len(names)):
            for b in range(a + 1, len(names)):
                if not Regex.parse(names[a]).disjoint(Regex.parse(names[b])):
                    detail = f"{_clip(names[a])} and {_clip(names[b])} may match the same name"
                    self.refuse("patternProperties", pointer, detail)
        if names != list(patterns):
            node["patternProperties"] = checked
        return patterns

    def _property_names_on_declared(
        self, node: dict[str, Any], properties: dict[str, Any], required: list[str]
    ) -> dict[str, Any]:
        """xgrammar checks propertyNames only on undeclared names: undeclare the declared ones it forbids."""
        names = node.get("propertyNames")
        if names is None or names is True or names == {} or not properties:
            return properties
        validator = _Validator(self)
        kept = {}
        for key, schema in properties.items():
            verdict = validator.valid(key, names, 0)
            if verdict is None:
                raise _Refused("propertyNames", "next to declared properties, and not checkable against them")
            if verdict:
                kept[key] = schema
            elif key in required:
                raise Unsatisfiable
        if len(kept) != len(properties):
            self.count("properties forbidden by propertyNames undeclared")
        return kept

    def _patterns_on_declared(self, properties: dict[str, Any], patterns: dict[str, Any], depth: int) -> dict[str, Any]:
        """A declared property whose name a patternProperties pattern matches must satisfy both schemas."""
        if not patterns:
            return properties
        out = {}
        for key, schema in properties.items():
            for pattern, extra in patterns.items():
                if _search(pattern, key):
                    try:
                        schema = self.merge(schema, extra, depth + 1)
                    except _Refused as refused:
                        raise _Refused(
                            "patternProperties",
                            f"{_clip(pattern)} also matches property {key!r}, and "
                            f"the schemas cannot be merged ({refused.keyword})",
                        ) from None
                    self.count("patternProperties merged into the properties they match")
            out[key] = schema
        return out

    def _one_path_per_name(self, merged: dict[str, Any], patterns: dict[str, Any], pointer: str) -> None:
        """A declared name a pattern fully matches also takes the pattern's path in xgrammar, with only the
        pattern's schema: exact only when the declared (merged) schema is that same schema."""
        for key, schema in merged.items():
            for pattern, extra in patterns.items():
                if _fullmatch(pattern, key) and not _json_equal(_constraints(schema), _constraints(extra)):
                    detail = f"{_clip(pattern)} matches property {key!r} whose schema differs: xgrammar accepts either"
                    self.refuse("patternProperties", pointer, detail)

    def _declare_required(
        self, node: dict[str, Any], properties: dict[str, Any], patterns: dict[str, Any], required: list[str]
    ) -> None:
        """xgrammar ignores a required name ``properties`` does not declare: declare it, with the schema it has."""
        for key in required:
            if key in properties:
                continue
            matching = [s for p, s in patterns.items() if _search(p, key)]
            schema: Any = {}
            if matching:
                for extra in matching:
                    schema = self.merge(schema, extra, 0)
            else:
                extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
                if extra is False:
                    raise Unsatisfiable
                schema = {} if extra is True else extra
            properties[key] = schema
            self.count("required property declared")

    def _dependencies(
        self,
        node: dict[str, Any],
        properties: dict[str, Any],
        patterns: dict[str, Any],
        required: list[str],
        pointer: str,
    ) -> None:
        """A dependency on a required name becomes required names; one on a name that cannot appear is vacuous."""
        for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
            rules = node.get(keyword)
            if keyword not in self.validation_keys(node) or not isinstance(rules, dict):
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
                    self._declare_required(node, properties, patterns, added)
                    continue
                if trigger not in required and not self._can_appear(node, trigger, properties, patterns):
                    continue
                self.refuse(keyword, pointer, f"on {trigger!r}")
                resolved = False
            if resolved:
                del node[keyword]
                self.count(f"{keyword} resolved")

    def _expand_dependencies(self, node: dict[str, Any], depth: int) -> dict[str, Any] | None:
        """Dependencies made keywords xgrammar enforces: those of a required name always apply (merged in); in a
        closed object, the others become a choice, each trigger either absent (undeclared, so that the closed
        object cannot hold it) or present (required, with what it demands). None when nothing changes, or when
        that is not exact (an open object, a trigger a pattern matches) or too large (more than 3 triggers)."""
        keys = self.validation_keys(node)
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
        optional = [
            (t, r) for t, r in rules if t not in required and not (isinstance(r, list) and set(r) <= set(required))
        ]
        triggers = list(dict.fromkeys(trigger for trigger, _ in optional))  # one name may head several rules
        patterns: dict[str, Any] = node["patternProperties"] if isinstance(node.get("patternProperties"), dict) else {}
        if triggers and (len(triggers) > 3 or not _closed(node)):
            return None
        if any(any(_search(p, t) for p in patterns) or properties.get(t, {}) is False for t in triggers):
            return None
        base: Any = {k: v for k, v in node.items() if k not in keywords}
        for rule in always:
            base = self.merge(base, {"required": rule} if isinstance(rule, list) else rule, depth + 1)
        if base is False:
            raise Unsatisfiable
        self.count("dependencies resolved")
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
                    demands.append(
                        {"required": [trigger, *rule]} if isinstance(rule, list) else {"required": [trigger]}
                    )
                    if not isinstance(rule, list):
                        demands.append(rule)
            for demand in demands:
                branch = self.merge(branch, demand, depth + 1)
            if branch is not False:
                branches.append(branch)
        if not branches:
            raise Unsatisfiable
        self.count("dependencies of a closed object made a choice")
        return {**{k: v for k, v in node.items() if k not in keys}, "anyOf": branches}

    def _can_appear(self, node: dict[str, Any], key: str, properties: dict[str, Any], patterns: dict[str, Any]) -> bool:
        if key in properties:
            return properties[key] is not False
        if any(_search(p, key) for p in patterns):
            return True
        return not _closed(node)

    def _drop_impossible(
        self, node: dict[str, Any], properties: dict[str, Any], patterns: dict[str, Any], required: list[str]
    ) -> dict[str, Any]:
        """A property no value satisfies must be absent: xgrammar cannot compile ``false``, so undeclare it."""
        impossible = [k for k, s in properties.items() if s is False]
        if not impossible:
            return properties
        if any(k in required for k in impossible):
            raise Unsatisfiable
        for key in impossible:
            if not _closed(node) or any(_search(p, key) for p in patterns):
                raise _Refused("properties", f"{key!r} must be absent, but the object accepts other names")
        self.count("impossible property undeclared")
        return {k: s for k, s in properties.items() if s is not False}

    def _visit_object_children(self, node: dict[str, Any], pointer: str, depth: int) -> None:
        if isinstance(node.get("properties"), dict):
            node["properties"] = {
                key: self.visit(schema, f"{pointer}/properties/{_escape(key)}", depth + 1)
                for key, schema in node["properties"].items()
            }
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {
                p: self.visit(s, f"{pointer}/patternProperties/{_escape(p)}", depth + 1)
                for p, s in node["patternProperties"].items()
            }
        for key in ("additionalProperties", "unevaluatedProperties"):
            if isinstance(node.get(key), dict):
                node[key] = self.visit(node[key], f"{pointer}/{key}", depth + 1)
        if isinstance(node.get("propertyNames"), dict):
            node["propertyNames"] = self.visit(node["propertyNames"], f"{pointer}/propertyNames", depth + 1, "string")

    # ------------------------------------------------------------------ merging (allOf semantics)

    def merge(self, a: Any, b: Any, depth: int) -> Any:
        """One schema accepting exactly what both ``a`` and ``b`` accept; ``_Refused`` when that is not simple."""
        if depth > self.policy.max_depth:
            raise _Refused("schema", f"nested deeper than {self.policy.max_depth} levels")
        if a is True or a == {}:
            return b
        if b is True or b == {}:
            return a
        if a is False or b is False:
            return False
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise _Refused("schema", "a subschema that is neither an object nor a boolean")
        a, b = self.normalise(a), self.normalise(b)
        if "$ref" in a and "$ref" in b and a["$ref"] == b["$ref"] and _json_equal(a, b):
            return a
        if "$ref" in a:
            a = self.inline(a, depth)
        if "$ref" in b:
            b = self.inline(b, depth)
        if not isinstance(a, dict) or not isinstance(b, dict):
            return self.merge(a, b, depth + 1)
        try:
            return _Merger(self, depth).merge(a, b)
        except Unsatisfiable:
            return False


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


# ==================================================================================================== merging


@dataclass
class _Merger:
    """The keyword-by-keyword conjunction of two schema objects whose $refs are already inlined."""

    walker: _Walker
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
        if _json_equal(x, y):
            return x
        if key in _LOWER_BOUNDS and _is_number(x) and _is_number(y):
            return max(x, y)
        if key in _UPPER_BOUNDS and _is_number(x) and _is_number(y):
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
        if key not in _VOCABULARY[self.walker.draft]:
            return x  # annotations and unknown keywords constrain nothing
        raise _Refused(key, "with different values in the schemas merged")

    def _types(self, a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
        ta, tb = _type_set(a.get("type")), _type_set(b.get("type"))
        if ta is None or tb is None:
            if "type" in a or "type" in b:
                out["type"] = a["type"] if "type" in a else b["type"]
            return
        common = [t for t in (*JSON_TYPES, "integer") if _type_in(t, ta) and _type_in(t, tb)]
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
            values = [v for v in values if any(_json_equal(v, w) for w in other)]
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
                _json_equal(pa, pb)
                and props_a.keys() == props_b.keys()
                and _json_equal(_extra(a, "Properties"), _extra(b, "Properties"))
            )
            if (len(shaped) == 2 and not same) or (pa is not None and pb is not None and not _json_equal(pa, pb)):
                raise _Refused("patternProperties", "with other properties in the merged schemas")
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
                raise _Refused("unevaluatedProperties", "next to additionalProperties")
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
                raise _Refused("unevaluatedItems", "next to items")
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


# ==================================================================================================== disjointness


class _Cover(enum.Enum):
    """How much of one JSON type a schema accepts."""

    NONE = "none"
    SOME = "some"
    ALL = "all"


_PARTITION = ("null", "boolean", "object", "array", "number", "string")  # integers are among the numbers
_ANY_TYPE_KEYS = frozenset({"not", "if", "allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "$recursiveRef"})


@dataclass(frozen=True)
class _Shape:
    """What a oneOf branch accepts, coarsely: enough to prove that two branches never accept one instance."""

    types: frozenset[str]
    values: tuple[Any, ...] | None  # the instances, when the branch lists them
    schema: dict[str, Any] | None  # the branch with $ref and allOf resolved, when that was possible
    walker: _Walker

    @classmethod
    def of(cls, walker: _Walker, branch: Any, depth: int) -> _Shape:
        if branch is False:
            return cls(frozenset(), (), None, walker)
        if not isinstance(branch, dict):
            return cls(_ALL_TYPES, None, None, walker)
        try:
            flat: Any = walker.inline(walker.normalise(branch), depth)
            if isinstance(flat, dict) and isinstance(flat.get("allOf"), list):
                merged: Any = {k: v for k, v in flat.items() if k != "allOf"}
                for entry in flat["allOf"]:
                    merged = walker.merge(merged, entry, depth + 1)
                flat = merged
        except _Refused:
            return cls(_ALL_TYPES, None, None, walker)
        if flat is False:
            return cls(frozenset(), (), None, walker)
        if not isinstance(flat, dict):
            return cls(_ALL_TYPES, None, None, walker)
        values: tuple[Any, ...] | None = None
        if "const" in flat:
            values = (flat["const"],)
        elif isinstance(flat.get("enum"), list):
            values = tuple(flat["enum"])
        types = _type_set(flat.get("type")) or _ALL_TYPES
        if values is not None:
            types = frozenset(t for t in types if any(_value_has_type(v, t) for v in values))
        return cls(types, values, flat, walker)

    def covers(self, json_type: str) -> _Cover:
        """NONE, SOME or ALL of the instances of ``json_type`` (one of _PARTITION)."""
        numeric = json_type == "number"
        if json_type not in self.types and not (numeric and "integer" in self.types):
            return _Cover.NONE
        if self.values is not None:
            return _Cover.SOME if any(_value_has_type(v, json_type) for v in self.values) else _Cover.NONE
        if self.schema is None or (numeric and "number" not in self.types):
            return _Cover.SOME
        relevant = _TYPE_KEYS[json_type] | _ANY_TYPE_KEYS
        return _Cover.SOME if self.walker.validation_keys(self.schema) & relevant else _Cover.ALL

    def disjoint_on(self, other: _Shape, json_type: str) -> bool:
        """True when no instance of ``json_type`` is accepted by both."""
        mine = None if self.values is None else [v for v in self.values if _value_has_type(v, json_type)]
        theirs = None if other.values is None else [v for v in other.values if _value_has_type(v, json_type)]
        if mine is not None and theirs is not None:
            return not any(_json_equal(v, w) for v in mine for w in theirs)
        validator = _Validator(self.walker)
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


def _first_clash(present: list[tuple[int, _Shape]], json_type: str) -> tuple[int, int] | None:
    """The first two branches that may both accept one instance of ``json_type``."""
    for a in range(len(present)):
        for b in range(a + 1, len(present)):
            if not present[a][1].disjoint_on(present[b][1], json_type):
                return present[a][0], present[b][0]
    return None


def _objects_disjoint(walker: _Walker, a: dict[str, Any], b: dict[str, Any]) -> bool:
    props_a = a["properties"] if isinstance(a.get("properties"), dict) else {}
    props_b = b["properties"] if isinstance(b.get("properties"), dict) else {}
    required_a = set(a["required"]) if isinstance(a.get("required"), list) else set()
    required_b = set(b["required"]) if isinstance(b.get("required"), list) else set()
    for key in sorted(k for k in required_a & required_b if isinstance(k, str)):
        # A discriminator: a name both require, whose listed values differ.
        if key in props_a and key in props_b:
            left, right = _Shape.of(walker, props_a[key], 0), _Shape.of(walker, props_b[key], 0)
            listed = left.values is not None and right.values is not None
            if listed and not any(_json_equal(v, w) for v in left.values or () for w in right.values or ()):
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
    low = int(schema["minLength"]) if _is_count(schema.get("minLength")) else 0
    high = int(schema["maxLength"]) if _is_count(schema.get("maxLength")) else None
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
        if _is_number(s.get("minimum")):
            low = s["minimum"]
        if _is_number(s.get("exclusiveMinimum")) and s["exclusiveMinimum"] >= low:
            low, open_low = s["exclusiveMinimum"], True
        if _is_number(s.get("maximum")):
            high = s["maximum"]
        if _is_number(s.get("exclusiveMaximum")) and s["exclusiveMaximum"] <= high:
            high, open_high = s["exclusiveMaximum"], True
        return low, high, open_low, open_high

    la, ha, ola, oha = bounds(a)
    lb, hb, olb, ohb = bounds(b)
    return ha < lb or (ha == lb and (oha or olb)) or hb < la or (hb == la and (ohb or ola))


# ==================================================================================================== a small validator


@dataclass
class _Validator:
    """Decides whether a JSON value satisfies a schema, for the keywords that occur next to const and enum.

    Answers None for anything it does not evaluate: the caller then refuses instead of guessing.
    """

    walker: _Walker

    def valid(self, value: Any, schema: Any, depth: int) -> bool | None:
        if schema is True or schema == {}:
            return True
        if schema is False:
            return False
        if not isinstance(schema, dict) or depth > 32:
            return None
        keys = self.walker.validation_keys(schema)
        if isinstance(schema.get("$ref"), str):
            target = self.walker.resolve(schema["$ref"])
            verdict = None if target is _MISSING else self.valid(value, target, depth + 1)
            if verdict is not True or self.walker.draft <= Draft.DRAFT7:
                return verdict
        verdicts = [self.keyword(value, k, schema, depth) for k in sorted(keys - {"$ref"})]
        if False in verdicts:
            return False
        return None if None in verdicts else True

    def keyword(self, value: Any, key: str, schema: dict[str, Any], depth: int) -> bool | None:
        arg = schema[key]
        check = _CHECKS.get(key)
        if check is not None:
            return check(value, arg)
        if key in ("allOf", "anyOf", "oneOf") and isinstance(arg, list):
            verdicts = [self.valid(value, s, depth + 1) for s in arg]
            if None in verdicts:
                return None
            hits = sum(1 for v in verdicts if v)
            return {"allOf": hits == len(arg), "anyOf": hits >= 1, "oneOf": hits == 1}[key]
        if key == "not":
            verdict = self.valid(value, arg, depth + 1)
            return None if verdict is None else not verdict
        if key == "properties" and isinstance(arg, dict):
            if not isinstance(value, dict):
                return True
            verdicts = [self.valid(value[k], s, depth + 1) for k, s in arg.items() if k in value]
            return None if None in verdicts else all(verdicts)
        if key == "items" and isinstance(arg, dict | bool):
            if not isinstance(value, list):
                return True
            verdicts = [self.valid(v, arg, depth + 1) for v in value]
            return None if None in verdicts else all(verdicts)
        return None


def _check_type(value: Any, arg: Any) -> bool | None:
    types = _type_set(arg)
    return None if types is None else any(_value_has_type(value, t) for t in types)


def _check_enum(value: Any, arg: Any) -> bool | None:
    return any(_json_equal(value, e) for e in arg) if isinstance(arg, list) else None


def _check_pattern(value: Any, arg: Any) -> bool | None:
    if not isinstance(value, str):
        return True
    try:
        return re.search(arg, value) is not None
    except (re.error, TypeError):
        return None


def _check_multiple(value: Any, arg: Any) -> bool | None:
    if not _is_number(value):
        return True
    if not _is_number(arg) or arg <= 0:
        return None
    quotient = value / arg
    return math.isfinite(quotient) and float(quotient).is_integer()


def _check_unique(value: Any, arg: Any) -> bool | None:
    if not isinstance(value, list) or arg is not True:
        return True
    return all(not _json_equal(value[i], value[j]) for i in range(len(value)) for j in range(i + 1, len(value)))


def _check_required(value: Any, arg: Any) -> bool | None:
    if not isinstance(value, dict):
        return True
    return all(k in value for k in arg) if isinstance(arg, list) else None


def _bound(kind: str, test: Any) -> Any:
    """A check of a size or a bound, vacuous for values of another kind."""

    def check(value: Any, arg: Any) -> bool | None:
        if not _value_has_type(value, kind):
            return True
        if not _is_number(arg):
            return None
        return bool(test(len(value) if kind != "number" else value, arg))

    return check


_CHECKS: dict[str, Any] = {
    "type": _check_type,
    "enum": _check_enum,
    "const": lambda value, arg: _json_equal(value, arg),
    "pattern": _check_pattern,
    "multipleOf": _check_multiple,
    "uniqueItems": _check_unique,
    "required": _check_required,
    "minLength": _bound("string", lambda n, a: n >= a),
    "maxLength": _bound("string", lambda n, a: n <= a),
    "minItems": _bound("array", lambda n, a: n >= a),
    "maxItems": _bound("array", lambda n, a: n <= a),
    "minProperties": _bound("object", lambda n, a: n >= a),
    "maxProperties": _bound("object", lambda n, a: n <= a),
    "minimum": _bound("number", lambda n, a: n >= a),
    "maximum": _bound("number", lambda n, a: n <= a),
    "exclusiveMinimum": _bound("number", lambda n, a: n > a),
    "exclusiveMaximum": _bound("number", lambda n, a: n < a),
}


# ==================================================================================================== regexes


_ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "$schema", "$id", "id", "deprecated",
        "readOnly", "writeOnly", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "contentMediaType",
        "contentEncoding", "contentSchema", "$defs", "definitions", "format",
    }
)  # fmt: skip


def _draft_of(schema: Any) -> Draft:
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    if isinstance(uri, str):
        for marker, draft in _DRAFT_URIS.items():
            if marker in uri:
                return draft
    return Draft.DRAFT2020


def _refs_in(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if isinstance(current.get("$ref"), str):
                yield current["$ref"]
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)


def _stable_ref(ref: str) -> bool:
    return ref == "#" or re.fullmatch(r"#/(\$defs|definitions)/[^/~%]+", ref) is not None


def _replace_refs(value: Any, mapping: dict[str, str]) -> Any:
    if isinstance(value, dict):
        out = {k: _replace_refs(v, mapping) for k, v in value.items()}
        if isinstance(out.get("$ref"), str) and out["$ref"] in mapping:
            out["$ref"] = mapping[out["$ref"]]
        return out
    if isinstance(value, list):
        return [_replace_refs(v, mapping) for v in value]
    return value


def _unescape(part: str) -> str:
    return urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _pointer_of(ref: str) -> str:
    return "".join("/" + _escape(_unescape(p)) for p in ref[2:].split("/")) if ref.startswith("#/") else ""


def _resolve_pointer(root: Any, ref: str) -> Any:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _MISSING
    node = root
    for part in ref[2:].split("/"):
        key = _unescape(part)
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return _MISSING
    return node


def _clip(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: Any) -> bool:
    return _is_number(value) and float(value).is_integer() and value >= 0


def _type_set(declared: Any) -> frozenset[str] | None:
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list) and declared and all(isinstance(t, str) for t in declared):
        return frozenset(declared)
    return None


def _type_in(json_type: str, types: frozenset[str]) -> bool:
    """Whether every instance of ``json_type`` has one of ``types`` (every integer is a number)."""
    return json_type in types or (json_type == "integer" and "number" in types)


def _value_has_type(value: Any, json_type: str) -> bool:
    if json_type == "null":
        return value is None
    if json_type == "boolean":
        return isinstance(value, bool)
    if json_type == "string":
        return isinstance(value, str)
    if json_type == "array":
        return isinstance(value, list)
    if json_type == "object":
        return isinstance(value, dict)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return json_type == "number" or float(value).is_integer()


def _json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values as the validator sees it: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _single_value(schema: dict[str, Any]) -> bool:
    return "const" in schema or (isinstance(schema.get("enum"), list) and len(schema["enum"]) == 1)


def _constraints(schema: Any) -> Any:
    """``schema`` without its annotations (in subschemas too), for comparing what two schemas accept."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key in ("properties", "patternProperties", "dependentSchemas") and isinstance(value, dict):
            out[key] = {name: _constraints(sub) for name, sub in value.items()}  # names are data, not keywords
        elif key in ("allOf", "anyOf", "oneOf", "prefixItems") and isinstance(value, list):
            out[key] = [_constraints(sub) for sub in value]
        elif isinstance(value, dict) and key not in ("const", "enum", "dependencies", "dependentRequired"):
            out[key] = _constraints(value)  # items, additionalProperties, not, ...
        else:
            out[key] = value  # values (enum, const, required, bounds) are compared as they are
    return out


def _closed(node: dict[str, Any]) -> bool:
    """Whether xgrammar lets no undeclared name into the object (strict mode closes one without
    additionalProperties, unless propertyNames opens it to the names it allows)."""
    extra = node.get("additionalProperties", node.get("unevaluatedProperties"))
    names = node.get("propertyNames") not in (None, True, {})
    return extra is False or (extra is None and not names)


def _fullmatch(pattern: str, text: str) -> bool:
    try:
        return re.fullmatch(pattern, text) is not None
    except re.error:
        return False


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False
