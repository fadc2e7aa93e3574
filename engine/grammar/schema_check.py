"""Checked mode's validator: a JSON schema's keywords the grammar does not enforce, checked on the output.

A :class:`SchemaCheck` is built once per compiled schema. It holds a real validator (``jsonschema``, the draft the
schema's ``$schema`` names, else 2020-12; formats are annotations, as in strict mode; no document is fetched) and
the places the policy left to it (:class:`~engine.grammar.schema.Unenforced` records). It judges a whole output
(:meth:`output_violation`) and, for the incremental check of :class:`~engine.grammar.output_checker.OutputChecker`,
a completed value against one subschema (:meth:`value_violation`) at the *sites*: the schema nodes that hold a checked
keyword. Which subschemas apply to a value is followed only through keywords that apply unconditionally
(``properties``, ``patternProperties``, ``additionalProperties``, ``items``/``prefixItems``, ``allOf``, ``$ref``):
a value that fails one of them makes the whole output invalid, so ending the request early is always right.

Of a failing output the reported error is the first one a checked place explains (its keyword sits where the
policy left a keyword to the check, or below it), looked for through anyOf/oneOf sub-errors too; failing that,
the validator's best match, marked as not checked (a keyword the grammar was meant to enforce).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator as JsonValidator
from jsonschema_specifications import REGISTRY as METASCHEMAS

from engine.grammar.schema.pointer import MISSING, escape, resolve_pointer
from engine.grammar.schema.refused import Unenforced
from engine.grammar.schema.values import clip
from engine.grammar.schema.vocabulary import Draft, draft_of
from engine.grammar.violation import NOT_JSON, Violation

Path = tuple[str | int, ...]  # a place in the output: object keys and array indices from the root
Schemas = tuple[Any, ...]  # the subschemas (dicts) that apply to one value of the output

_VALUE_CHARS = 80  # how much of an offending value a message shows
_APPLICATOR_LISTS = ("allOf",)
_SUBTREE_KEYWORDS = frozenset({"then", "else"})  # what fails there is the conditional's doing


class SchemaCheckError(ValueError):
    """The schema cannot serve as the output check (it is not valid under its own metaschema)."""


class SchemaCheck:
    """A schema, its validator and the places its output check takes over. Shared by every request of the schema."""

    def __init__(self, schema: Any, checked: Sequence[Unenforced], token_bytes: Sequence[bytes]) -> None:
        """``token_bytes[t]``: the bytes token t adds to the output (xgrammar's decoded vocabulary).

        Raises :class:`SchemaCheckError` when jsonschema finds the schema malformed: it could not judge outputs."""
        self.schema = schema
        self.checked = tuple(checked)
        self.token_bytes = token_bytes
        validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            validator_class.check_schema(schema)
        except jsonschema.exceptions.SchemaError as error:
            where = "/" + "/".join(escape(str(p)) for p in error.absolute_path)
            raise SchemaCheckError(
                f"the schema is not valid under its metaschema at {where}: {error.message}"
            ) from None
        self._validator: JsonValidator = validator_class(schema, registry=METASCHEMAS)
        self._draft = draft_of(schema)
        self._pointers = _pointer_index(schema)
        self._sites = {id(node): node for node in self._site_nodes()}
        self._site_validators: dict[int, JsonValidator] = {}
        self._closures: dict[int, Schemas] = {}

    @property
    def has_sites(self) -> bool:
        """Whether completed values can be checked before the output ends (some keyword is checked at all)."""
        return bool(self._sites)

    # ---------------------------------------------------------------- judging

    def output_violation(self, text: bytes) -> Violation | None:
        """The violation of the whole output ``text`` (the JSON the grammar terminated on), or None when valid."""
        try:
            instance = json.loads(text)
        except (ValueError, RecursionError) as error:  # not JSON, or not UTF-8
            whole = next((u for u in self.checked if not u.covers and u.pointer == ""), None)
            shown = clip(text.decode("utf-8", "replace"), _VALUE_CHARS)
            reason = f"the output is not JSON ({error})"
            return Violation(NOT_JSON, "", "", shown, reason, _place(whole) if whole is not None else "")
        return self._violation(self._validator, instance, ())

    def value_violation(self, value: Any, path: Path, site: Any) -> Violation | None:
        """The violation of the completed ``value`` at ``path`` by the site ``site`` (a schema node that applies to
        it unconditionally), or None."""
        validator = self._site_validators.get(id(site))
        if validator is None:
            validator = self._site_validators[id(site)] = self._validator.evolve(schema=site)
        return self._violation(validator, value, path)

    def is_site(self, node: Any) -> bool:
        return id(node) in self._sites

    def _violation(self, validator: JsonValidator, instance: Any, path: Path) -> Violation | None:
        try:
            errors = list(validator.iter_errors(instance))
        except Exception as failure:  # jsonschema itself failed (a regex it cannot compile, ...): no verdict, no stop
            reason = f"could not be checked: {failure}"
            return Violation("schema", "", _pointer(path), _shown(instance), reason)
        if not errors:
            return None
        for strict in (True, False):
            for error in _flattened(errors):
                record = self._explaining(error, strict)
                if record is not None:
                    return self._describe(error, path, _place(record))
        return self._describe(jsonschema.exceptions.best_match(errors), path, "")

    def _explaining(self, error: ValidationError, strict: bool) -> Unenforced | None:
        """The checked place that covers ``error``: one whose covered locations hold the failing keyword
        (``strict``), or, for keywords the rewrite moved (merged allOf entries, siblings moved into branches), one
        whose covered keyword the location names."""
        location = self._location(error)
        if strict:
            return next((u for u in self.checked if u.covers_location(location)), None)
        segments = location.split("/")
        for record in self.checked:
            for cover in record.covers or (record.keyword,):
                if cover in _SUBTREE_KEYWORDS or "/" in cover:  # a subtree (then/else, allOf/1): anywhere on the way
                    head = cover.split("/")
                    if any(segments[i : i + len(head)] == head for i in range(len(segments))):
                        return record
                elif segments[-1] == cover:  # a keyword: the failing one itself
                    return record
        return None

    def _location(self, error: ValidationError) -> str:
        """The JSON pointer of the failing keyword in the schema."""
        node = self._pointers.get(id(error.schema)) if isinstance(error.schema, dict) else None
        if node is not None and error.validator is not None:
            return f"{node}/{escape(str(error.validator))}"
        # A ``false`` subschema: jsonschema reports where its parent keyword is, through the schema path.
        return "".join(f"/{escape(str(part))}" for part in error.absolute_schema_path)

    def _describe(self, error: ValidationError, path: Path, checked_as: str) -> Violation:
        location = self._location(error)
        keyword = str(error.validator) if error.validator is not None else "false"
        holder = location.rsplit("/", 1)[0] if error.validator is not None else location
        instance = _pointer((*path, *error.absolute_path))
        return Violation(keyword, holder, instance, _shown(error.instance), error.message, checked_as)

    # ---------------------------------------------------------------- what applies where

    def root_schemas(self) -> Schemas:
        return self._closure(self.schema)

    def member_schemas(self, parents: Schemas, key: str) -> Schemas:
        """The subschemas that apply to member ``key`` of an object every schema of ``parents`` applies to."""
        found: list[Any] = []
        for parent in parents:
            declared = parent.get("properties")
            hit = isinstance(declared, dict) and key in declared
            if hit:
                found.extend(self._closure(declared[key]))
            patterns = parent.get("patternProperties")
            for pattern, sub in patterns.items() if isinstance(patterns, dict) else ():
                if _search(pattern, key):
                    hit = True
                    found.extend(self._closure(sub))
            if not hit:
                found.extend(self._closure(parent.get("additionalProperties")))
        return tuple(found)

    def item_schemas(self, parents: Schemas, index: int) -> Schemas:
        """The subschemas that apply to item ``index`` of an array every schema of ``parents`` applies to."""
        found: list[Any] = []
        for parent in parents:
            items = parent.get("items")
            if self._draft >= Draft.DRAFT2020:
                prefix = parent.get("prefixItems")
                if isinstance(prefix, list) and index < len(prefix):
                    found.extend(self._closure(prefix[index]))
                else:
                    found.extend(self._closure(items))
            elif isinstance(items, list):
                found.extend(self._closure(items[index] if index < len(items) else parent.get("additionalItems")))
            else:
                found.extend(self._closure(items))
        return tuple(found)

    def _closure(self, node: Any) -> Schemas:
        """``node`` and what applies with it unconditionally (allOf entries, local $ref targets), as dicts; nothing
        for a node that moves the base URI (``$id``), where a subschema's references would resolve elsewhere."""
        if not isinstance(node, dict):
            return ()
        cached = self._closures.get(id(node))
        if cached is not None:
            return cached
        self._closures[id(node)] = ()  # a $ref cycle ends here
        out: list[Any] = []
        stack = [node]
        seen: set[int] = set()
        while stack:
            current = stack.pop()
            if not isinstance(current, dict) or id(current) in seen or _moves_base(current, self.schema):
                continue
            seen.add(id(current))
            out.append(current)
            for key in _APPLICATOR_LISTS:
                if isinstance(current.get(key), list):
                    stack.extend(current[key])
            ref = current.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                target = resolve_pointer(self.schema, ref)
                if target is not MISSING:
                    stack.append(target)
        result = tuple(out)
        self._closures[id(node)] = result
        return result

    def _site_nodes(self) -> Iterator[Any]:
        for record in self.checked:
            node = resolve_pointer(self.schema, "#" + record.pointer)
            if isinstance(node, dict) and not _moves_base(node, self.schema):
                yield node


def _pointer_index(schema: Any) -> dict[int, str]:
    """The JSON pointer of every object in ``schema``, by identity (a parsed schema shares no objects)."""
    index: dict[int, str] = {}
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        value, pointer = stack.pop()
        if isinstance(value, dict):
            index[id(value)] = pointer
            stack.extend((v, f"{pointer}/{escape(k)}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{pointer}/{i}") for i, v in enumerate(value))
    return index


def _flattened(errors: Sequence[ValidationError]) -> Iterator[ValidationError]:
    """Every error with, depth first, the sub-errors of the anyOf/oneOf branches it reports."""
    stack = list(reversed(errors))
    while stack:
        error = stack.pop()
        yield error
        stack.extend(reversed(error.context or ()))


def _moves_base(node: dict[str, Any], root: Any) -> bool:
    return node is not root and (isinstance(node.get("$id"), str) or isinstance(node.get("id"), str))


def _place(record: Unenforced) -> str:
    return f"{record.keyword} at {record.pointer or '/'}"


def _pointer(path: Sequence[str | int]) -> str:
    return "".join(f"/{escape(str(part))}" for part in path)


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _VALUE_CHARS else text[:_VALUE_CHARS] + "…"


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False
