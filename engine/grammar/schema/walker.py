"""One walk of the policy over one schema: bookkeeping, references, and the visit of each node.

A node is decided by the first of ``$ref``, ``const``/``enum``, ``allOf``, ``anyOf``/``oneOf`` it has (as xgrammar
reads it); a typed node goes through the rules of each of its JSON types (``strings``, ``numbers``, ``arrays``,
``objects``), after the keywords that apply to every type (``not``, ``if``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.grammar.pattern import Unsatisfiable
from engine.grammar.schema import arrays, conditionals, negations, numbers, objects, strings
from engine.grammar.schema.disjointness import PARTITION, Cover, Shape, first_clash
from engine.grammar.schema.merger import Merger
from engine.grammar.schema.pointer import MISSING, pointer_of, refs_in, replace_refs, resolve_pointer, stable_ref
from engine.grammar.schema.refused import UNCHECKABLE, Refused, Unenforced
from engine.grammar.schema.validator import Validator
from engine.grammar.schema.values import is_number, json_equal
from engine.grammar.schema.vocabulary import (
    ALL_TYPES,
    JSON_TYPES,
    TYPE_KEYS,
    VOCABULARY,
    XGRAMMAR_READS,
    Draft,
    draft_of,
)

if TYPE_CHECKING:
    from engine.grammar.schema.policy import JsonSchemaPolicy

PENDING = object()  # a $ref target queued for its visit
_KEYWORDS = frozenset().union(*VOCABULARY.values())  # every draft's: a refusal's keyword, or a phrase naming several
# The rules of each JSON type, in the order xgrammar's reading needs them; ``number`` also covers integers.
_TYPE_RULES = (
    ("string", strings.rules),
    ("number", numbers.rules),
    ("array", arrays.rules),
    ("object", objects.rules),
)


@dataclass
class Walker:
    """One application of the policy: the state of a single walk over a single schema.

    ``checking`` (checked mode): what cannot be made exact is left out of the grammar where it would be read loosely
    and recorded in ``checked`` for the output check, instead of refusing the schema; only what even the check
    cannot take over (:data:`UNCHECKABLE`) goes to ``unenforced``.
    """

    policy: JsonSchemaPolicy
    original: Any
    checking: bool = False
    rewrites: Counter[str] = field(default_factory=Counter)
    unenforced: list[Unenforced] = field(default_factory=list)
    checked: list[Unenforced] = field(default_factory=list)
    visited: int = 0
    root: Any = None
    draft: Draft = Draft.DRAFT2020
    targets: dict[str, Any] = field(default_factory=dict)  # stable ref -> rewritten target (or PENDING)
    pending: list[str] = field(default_factory=list)  # refs whose targets wait for their visit
    target_pointers: dict[str, str] = field(default_factory=dict)  # hoisted ref -> pointer of the original target
    generated: set[str] = field(default_factory=set)  # the patterns the policy wrote
    shared: dict[str, str] = field(default_factory=dict)  # generated pattern -> its shared $defs entry's ref
    stopped: bool = False

    def run(self) -> Any:
        self.draft = draft_of(self.original)
        self.root = self._hoist_refs(self.original)
        rewritten = self.visit(self.root, "", 0)
        # Referenced schemas are visited one after the other, not inside the reference: a long chain of
        # definitions neither deepens the recursion nor counts against max_depth.
        while self.pending:
            ref = self.pending.pop()
            target = self.resolve(ref)
            self.targets[ref] = self.visit(target, self.target_pointers.get(ref, pointer_of(ref)), 0)
        return self._install_targets(rewritten)

    # ------------------------------------------------------------------ bookkeeping

    def count(self, rewrite: str) -> None:
        self.rewrites[rewrite] += 1

    def refuse(self, keyword: str, pointer: str, detail: str = "", covers: tuple[str, ...] | None = None) -> None:
        """Record a keyword the grammar will not enforce: refused, or in checked mode checked on the output.

        ``covers``: the schema locations under ``pointer`` the check takes over (default: the keyword itself when it
        is one, else the whole node)."""
        if covers is None:
            covers = (keyword,) if keyword in _KEYWORDS else ()
        place = Unenforced(keyword, pointer, detail, covers)
        places = self.checked if self.checking and keyword not in UNCHECKABLE else self.unenforced
        if place not in places:
            places.append(place)

    def check(self, node: dict[str, Any], keys: tuple[str, ...], pointer: str, detail: str = "") -> None:
        """Checked mode: leave ``keys`` out of the grammar (xgrammar would read them loosely or wrongly) and check
        them on the output. Only call when :attr:`checking`."""
        for key in keys:
            node.pop(key, None)
        self.refuse(keys[0], pointer, detail, keys)

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
        return {k for k in node if k in VOCABULARY[self.draft]}

    # ------------------------------------------------------------------ references

    def _hoist_refs(self, schema: Any) -> Any:
        """Give every $ref into a deep location its own ``$defs`` entry, so that rewrites never break its path.

        ``#``, ``#/$defs/x`` and ``#/definitions/x`` stay: rewrites change those entries' contents, never their
        location. A deeper path (``#/properties/a``) or an escaped one (xgrammar does not unescape ``~1``/``%25``)
        is copied to ``#/$defs/<fresh name>``.
        """
        if not isinstance(schema, dict):
            return schema
        deep = sorted({r for r in refs_in(schema) if r.startswith("#") and not stable_ref(r)})
        found = [(r, t) for r in deep if (t := resolve_pointer(schema, r)) is not MISSING]
        if not found:
            return schema
        defs = schema["$defs"] if isinstance(schema.get("$defs"), dict) else {}
        mapping: dict[str, str] = {}
        for index, (ref, _) in enumerate(found):
            name = f"ordinal_ref_{index}"
            while name in defs:
                name += "_"
            mapping[ref] = f"#/$defs/{name}"
            self.target_pointers[mapping[ref]] = pointer_of(ref)
        hoisted = replace_refs(schema, mapping)
        entries = dict(hoisted["$defs"]) if isinstance(hoisted.get("$defs"), dict) else {}
        for ref, target in found:
            entries[mapping[ref].rsplit("/", 1)[1]] = replace_refs(target, mapping)
        hoisted["$defs"] = entries
        self.count("deep $ref given its own $defs entry")
        return hoisted

    def resolve(self, ref: str) -> Any:
        return resolve_pointer(self.root, ref)

    def _visit_target(self, ref: str) -> None:
        """Queue the schema ``ref`` names for a visit (once; a dangling reference is xgrammar's to report)."""
        if ref in self.targets or ref == "#" or self.resolve(ref) is MISSING:
            return
        self.targets[ref] = PENDING
        self.pending.append(ref)

    def _install_targets(self, root: Any) -> Any:
        if not isinstance(root, dict):
            return root
        for ref, target in self.targets.items():
            if target is PENDING or not stable_ref(ref) or ref == "#":
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
            if target is MISSING:
                raise Refused("$ref", f"{ref!r} does not resolve inside the schema")
            siblings = {k: v for k, v in node.items() if k != "$ref"} if self.draft >= Draft.DRAFT2019 else {}
            node = self.merge(target, siblings, depth + 1) if siblings else target
            if not isinstance(node, dict):
                return node
        raise Refused("$ref", "a chain of more than 8 references")

    # ------------------------------------------------------------------ the node visit

    def visit(self, node: Any, pointer: str, depth: int, default_type: str | None = None) -> Any:
        """``node`` rewritten so that xgrammar enforces it exactly; what cannot be is recorded as unenforced.

        Returns ``False`` for a node no instance satisfies (the parent decides what that means).
        """
        if not isinstance(node, dict) or not self._enter(pointer, depth):
            return node
        notes: list[str] = []
        node = self.normalise(node, notes)
        entered = dict(node) if self.checking else node  # the rules change ``node``; a relaxed retry starts afresh
        try:
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
        except Refused as refused:
            if self.checking and refused.keyword not in UNCHECKABLE:
                return self._relaxed(entered, refused, pointer, depth, default_type)
            self.refuse(refused.keyword, pointer, refused.detail)
            return node

    def _relaxed(
        self, node: dict[str, Any], refused: Refused, pointer: str, depth: int, default_type: str | None
    ) -> Any:
        """Checked mode: ``node`` without the keys the refusal names, visited again, and those keys checked on the
        output; without such keys, the whole node is checked and the grammar allows any value there."""
        drop = tuple(k for k in refused.drop if k in node)
        self.refuse(refused.keyword, pointer, refused.detail, drop)
        if not drop:
            return {"type": default_type} if default_type is not None else {}
        return self.visit({k: v for k, v in node.items() if k not in drop}, pointer, depth + 1, default_type)

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
        known = VOCABULARY[self.draft]
        for key in [k for k in node if k in XGRAMMAR_READS and k not in known]:
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
                if flag and is_number(node.get(bound)):
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
            raise Refused("$ref", f"{ref!r}: only references inside the schema (#/...) are resolved")
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
        validator = Validator(self)
        for value in values:
            verdict = validator.valid(value, siblings, 0)
            if verdict is None:
                undecided = next(k for k in sorted(siblings) if validator.keyword(value, k, siblings, 0) is None)
                raise Refused(undecided, "next to const/enum, and not checkable against the listed values")
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
        later = [(i, e) for i, e in enumerate(entries) if conditionals.is_conditional(e)]  # once the rest is merged
        for index, entry in enumerate(entries):
            if not conditionals.is_conditional(entry):
                merged = self._merge_entry(merged, entry, index, pointer, depth)
        for index, entry in later:
            choice = conditionals.apply(self, merged, entry, depth + 1)
            if choice is not None:
                merged = choice
                self.count("if/then/else made a choice")
            elif self.checking:  # xgrammar ignores if/then/else: the grammar does without this entry
                self.refuse(
                    "if", pointer, f"in allOf/{index}, with a test the grammar cannot spell", (f"allOf/{index}",)
                )
            else:
                merged = self._merge_entry(merged, entry, index, pointer, depth)
        self.count("allOf merged into one schema")
        return self.visit(merged, pointer, depth + 1, default_type)

    def _merge_entry(self, merged: Any, entry: Any, index: int, pointer: str, depth: int) -> Any:
        """``merged`` and allOf entry ``index`` as one schema; in checked mode an entry that cannot be merged is left
        out of the grammar (and checked on the output)."""
        try:
            return self.merge(merged, entry, depth + 1)
        except Refused as refused:
            detail = f"its entries cannot be merged: {refused.keyword}" + (
                f" ({refused.detail})" if refused.detail else ""
            )
            if not self.checking:
                raise Refused("allOf", detail) from None
            self.refuse("allOf", pointer, detail, (f"allOf/{index}",))
            return merged

    def _visit_choice(self, node: dict[str, Any], pointer: str, depth: int, default_type: str | None) -> Any:
        keyword = "anyOf" if "anyOf" in node else "oneOf"
        branches = node[keyword]
        if not isinstance(branches, list) or not branches:
            return node
        keys = self.validation_keys(node)
        siblings = {k: v for k, v in node.items() if k != keyword and k in keys}
        if siblings:
            branches = self._with_siblings(keyword, branches, siblings, pointer, depth)
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

    def _with_siblings(
        self, keyword: str, branches: list[Any], siblings: dict[str, Any], pointer: str, depth: int
    ) -> list[Any]:
        """Every branch merged with the keywords next to the anyOf/oneOf (xgrammar ignores them there). In checked
        mode a keyword that cannot be merged stays out of the grammar and is checked on the output."""
        while True:
            try:
                return [self.merge(branch, siblings, depth + 1) for branch in branches]
            except Refused as refused:
                detail = f"cannot move {refused.keyword} into its branches"
                if not self.checking or refused.keyword not in siblings:
                    raise Refused(f"keywords next to {keyword}", detail, drop=tuple(siblings)) from None
                self.refuse(refused.keyword, pointer, f"next to {keyword}: {detail}")
                siblings = {k: v for k, v in siblings.items() if k != refused.keyword}

    def _one_of_as_any_of(self, live: list[tuple[int, Any]], pointer: str, depth: int) -> list[tuple[int, Any]]:
        """oneOf as anyOf, type by type.

        Where one branch accepts instances of a JSON type alone, or several do but provably never the same one,
        the branches stay as they are; where two branches accept every instance of a type, no instance of it is
        valid and the type leaves every branch. Anything else (one branch accepting some instances of a type
        another accepts all of, say) would need a negation xgrammar lacks: the oneOf is refused.
        """
        shapes = [(i, Shape.of(self, b, depth)) for i, b in live]
        kept: dict[int, list[str]] = {i: [] for i, _ in live}
        for json_type in PARTITION:
            present = [(i, shape) for i, shape in shapes if shape.covers(json_type) is not Cover.NONE]
            if sum(1 for _, shape in present if shape.covers(json_type) is Cover.ALL) >= 2:
                continue  # every instance of the type matches two branches
            clash = first_clash(present, json_type)
            if clash is not None:
                self.refuse("oneOf", pointer, f"branches {clash[0]} and {clash[1]} may both match one {json_type}")
                return live
            for i, _ in present:
                kept[i].append(json_type)
        out = []
        for (i, branch), (_, shape) in zip(live, shapes, strict=True):
            covered = [t for t in PARTITION if shape.covers(t) is not Cover.NONE]
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
        replaced = self._universal(node, pointer, depth)
        if replaced is not None:
            return self.visit(replaced, pointer, depth + 1, default_type)
        node = self._complete_types(node, default_type)
        types = self.types_of(node, default_type)
        if {"integer", "number"} <= types and isinstance(node.get("type"), list):
            node["type"] = [t for t in node["type"] if t != "integer"]  # every integer is a number
            types = self.types_of(node, default_type)
        if "object" in types:
            expanded = objects.expand_dependencies(self, node, depth)
            if expanded is not None:
                return self.visit(expanded, pointer, depth + 1, default_type)
        dead: set[str] = set()
        for json_type, rules in _TYPE_RULES:
            present = types & ({"integer", "number"} if json_type == "number" else {json_type})
            if not present:
                continue
            try:
                rules(self, node, pointer, depth)
            except Unsatisfiable:
                dead |= present
            except Refused as refused:
                if self.checking:
                    raise  # visit relaxes the node: without the refused keyword, checked on the output
                self.refuse(refused.keyword, pointer, refused.detail)
        if dead:
            if "type" not in node and default_type is None:
                # xgrammar made the typeless node an object (or array) and that part is impossible: the schema
                # still accepts every other type, each with its own keywords.
                self.count("impossible type removed")
                return self.visit({**node, "type": [t for t in JSON_TYPES if t not in dead]}, pointer, depth + 1)
            types = self.types_of(node, default_type)  # the handlers may have narrowed the types (number to integer)
            alive = [t for t in (*JSON_TYPES, "integer") if t in types and t not in dead]
            if not alive or not isinstance(node.get("type", default_type), list):
                raise Unsatisfiable
            node["type"] = alive
            self.count("impossible type removed")
        return node

    def types_of(self, node: dict[str, Any], default_type: str | None) -> frozenset[str]:
        """The JSON types xgrammar generates for ``node``: a typeless node with properties is an object, ..."""
        declared = node.get("type", default_type)
        if isinstance(declared, str):
            return frozenset({declared})
        if isinstance(declared, list):
            return frozenset(t for t in declared if isinstance(t, str)) or ALL_TYPES
        if {"properties", "additionalProperties", "unevaluatedProperties"} & node.keys():
            return frozenset({"object"})
        if {"items", "prefixItems", "unevaluatedItems"} & node.keys():
            return frozenset({"array"})
        return ALL_TYPES

    def _complete_types(self, node: dict[str, Any], default_type: str | None) -> dict[str, Any]:
        """A node xgrammar reads as *any value* ignores its keywords: list every type, so each applies to its own."""
        if "type" in node or default_type is not None or self.types_of(node, None) != ALL_TYPES:
            return node
        keys = self.validation_keys(node)
        if not any(keys & TYPE_KEYS[t] for t in JSON_TYPES):
            return node
        self.count("typeless keywords given every type")
        return {**node, "type": list(JSON_TYPES)}

    def _universal(self, node: dict[str, Any], pointer: str, depth: int) -> Any:
        """The keywords that apply to every type: ``not``, ``if`` and dynamic references. Returns a schema to visit in
        place of ``node`` when a rule rewrote it into another form (an anyOf), else None (``node`` changed in place)."""
        keys = self.validation_keys(node)
        if "not" in keys:
            try:
                replaced = negations.rules(self, node)
            except Refused as refused:
                if self.checking:
                    self.check(node, ("not",), pointer, refused.detail)
                else:
                    self.refuse(refused.keyword, pointer, refused.detail)
            else:
                if replaced is not None:
                    return replaced
        if "if" in keys:
            choice = conditionals.as_choice(self, node, depth)
            if choice is not None:
                self.count("if/then/else made a choice")
                return choice
            detail = "with then/else" if {"then", "else"} & node.keys() else ""
            if self.checking:
                self.check(node, conditionals.CONDITIONAL_KEYS, pointer, detail)
            else:
                self.refuse("if", pointer, detail)
        for dynamic in ("$dynamicRef", "$recursiveRef"):
            if dynamic in keys:
                if self.checking:
                    self.check(node, (dynamic,), pointer)
                else:
                    self.refuse(dynamic, pointer)
        return None

    # ------------------------------------------------------------------ merging (allOf semantics)

    def merge(self, a: Any, b: Any, depth: int) -> Any:
        """One schema accepting exactly what both ``a`` and ``b`` accept; ``Refused`` when that is not simple."""
        if depth > self.policy.max_depth:
            raise Refused("schema", f"nested deeper than {self.policy.max_depth} levels")
        if a is True or a == {}:
            return b
        if b is True or b == {}:
            return a
        if a is False or b is False:
            return False
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise Refused("schema", "a subschema that is neither an object nor a boolean")
        a, b = self.normalise(a), self.normalise(b)
        if "$ref" in a and "$ref" in b and a["$ref"] == b["$ref"] and json_equal(a, b):
            return a
        if "$ref" in a:
            a = self.inline(a, depth)
        if "$ref" in b:
            b = self.inline(b, depth)
        if not isinstance(a, dict) or not isinstance(b, dict):
            return self.merge(a, b, depth + 1)
        try:
            return Merger(self, depth).merge(a, b)
        except Unsatisfiable:
            return False
