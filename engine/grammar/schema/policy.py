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
  "multipleOf": 3, "minimum": 0}`` accepts ``4``) and, with both, only over at most 10000 integers (``{"minimum": 0,
  "maximum": 10000, "multipleOf": 2}`` accepts ``1``); a non-integer bound on an integer is a compile error.
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

- lengths become a pattern over the raw JSON text, one escape sequence one character
  (:func:`~engine.grammar.schema.strings.length_pattern`);
  next to a pattern they are folded into it (:meth:`Regex.with_length`);
- oneOf becomes anyOf type by type, where the branches provably never accept one instance
  (:class:`~engine.grammar.schema.disjointness.Shape`);
- keywords next to anyOf/oneOf move into every branch, allOf entries merge into one schema
  (:class:`~engine.grammar.schema.merger.Merger`),
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

import json
from dataclasses import dataclass
from typing import Any

from engine.constraint import MODE_PARAM
from engine.grammar.schema.refused import Unenforced
from engine.grammar.schema.values import same_json
from engine.grammar.schema.walker import Walker

XGRAMMAR = "xgrammar 0.2.9"
MODE_FLAG = "--json-schema"  # the grammar service's flag choosing strict, checked or loose


@dataclass(frozen=True)
class PolicyOutcome:
    """What the policy made of one schema: the schema to compile, the rewrites applied, what is refused and (checked
    mode) what the output check takes over."""

    schema: Any
    changed: bool
    rewrites: tuple[tuple[str, int], ...]
    unenforced: tuple[Unenforced, ...]
    checked: tuple[Unenforced, ...] = ()
    checking: bool = False

    @property
    def accepted(self) -> bool:
        return not self.unenforced

    def reason(self, max_places: int = 5) -> str:
        """One readable line naming every refused keyword (at most ``max_places``, then a count) and the way out."""
        places = [u.describe() for u in self.unenforced[:max_places]]
        more = len(self.unenforced) - len(places)
        listed = "; ".join(places) + (f"; and {more} more" if more > 0 else "")
        one = len(self.unenforced) == 1
        verb, them = ("is", "it") if one else ("are", "them")
        if self.checking:
            return (
                f"{listed} {verb} neither enforced by the grammar engine ({XGRAMMAR}) nor checkable on the output "
                f"(only references inside the schema are resolved); remove or rewrite {them}, or choose loose mode "
                f"({MODE_FLAG} loose) to accept such schemas without any guarantee"
            )
        return (
            f"{listed} {verb} not enforced by the grammar engine ({XGRAMMAR}); remove or rewrite {them}, or choose "
            f'checked mode ({MODE_FLAG} checked on the grammar service, or {MODE_PARAM} "checked" in the request\'s '
            "custom_params), which accepts such schemas and checks these keywords on each output"
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

    def apply(self, schema: Any, checking: bool = False) -> PolicyOutcome:
        """Rewrite ``schema`` (a parsed JSON value; it is not modified) and list what stays unenforced.

        ``checking`` (checked mode): what cannot be made exact stays out of the grammar and is listed in
        :attr:`PolicyOutcome.checked` instead of refusing the schema. A schema past the limits is then compiled as
        given, and checked as a whole."""
        walker = Walker(self, schema, checking=checking)
        try:
            rewritten = walker.run()
        except RecursionError:  # a pathological nesting the depth limit does not see (a regex, a deep $ref target)
            walker.refuse("schema", "", "nested too deeply to check")
            walker.stopped = True
            rewritten = schema
        checked = tuple(walker.checked)
        if checking and walker.stopped:  # the walk did not reach every node: xgrammar reads the rest as it likes
            rewritten = schema
            checked = (Unenforced("schema", "", "too large or deep to rewrite: checked as a whole"),)
        return PolicyOutcome(
            schema=rewritten,
            changed=not same_json(rewritten, schema),
            rewrites=tuple(sorted(walker.rewrites.items())),
            unenforced=tuple(walker.unenforced),
            checked=checked,
            checking=checking,
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
