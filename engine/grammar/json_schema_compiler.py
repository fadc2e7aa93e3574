"""Compiling a JSON schema in its mode (strict, checked or loose): the grammar, the output check and the report.

- STRICT: the policy's rewrite (:class:`~engine.grammar.schema.JsonSchemaPolicy`), which xgrammar enforces exactly,
  or a refusal naming each keyword and place it cannot enforce.
- CHECKED: the closest grammar xgrammar enforces (the policy's rewrite for what it can, the rest left out of the
  grammar) and a :class:`~engine.grammar.schema_check.SchemaCheck` for what it left out. The whole output is validated
  when the grammar terminates even when nothing was left out: a ``stop`` then never carries an invalid output. A
  rewrite xgrammar does not compile falls back to the schema as given, checked as a whole; only what neither
  xgrammar compiles nor the check can read (a ``$ref`` to another document) is refused.
- LOOSE: the schema as given (SGLang's way); the policy only tells, for the report, what xgrammar reads loosely.

The schema text that is not JSON goes to xgrammar as given, for xgrammar to report the error in its own words.

Before any of this, in every mode, integers the schema leaves unbounded are bounded to +-(2^53 - 1)
(:mod:`engine.grammar.schema.integer_range`; ``IntegerRange.UNBOUNDED`` leaves them as written), so that the grammar,
the rewrite and the output check all read the same bounded schema.

Every mode's grammar bounds the whitespace between JSON tokens (outside strings) to ``max_whitespace`` characters in a
row, :data:`DEFAULT_JSON_MAX_WHITESPACE` by default (xgrammar's ``max_whitespace_cnt``). xgrammar's own default lets
any amount through, and a model unsure what comes next often takes it: ``{`` followed by newlines until
``max_tokens``, finish reason "length", output that does not parse; a failure known from other engines that serve
unbounded JSON whitespace (vLLM, SGLang and ollama issues report it). Eight characters still allow pretty-printing (a
newline and an indent three levels deep); ``None`` (``--json-whitespace unbounded``) restores xgrammar's default.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from engine.constraint import JsonSchemaMode
from engine.grammar.enforcement import Enforcement
from engine.grammar.schema import JsonSchemaPolicy, Unenforced, UnenforcedSchemaError
from engine.grammar.schema.integer_range import IntegerRange, bound_integers
from engine.grammar.schema_check import SchemaCheck, SchemaCheckError

_XGRAMMAR_ERRORS = (RuntimeError, ValueError, TypeError)  # how xgrammar refuses a grammar, whatever the language
DEFAULT_JSON_MAX_WHITESPACE = 8  # whitespace characters in a row between JSON tokens (see the module docstring)


@dataclass(frozen=True)
class CompiledSchema:
    """A JSON schema compiled in its mode: the grammar, the output check (checked mode) and the enforcement report."""

    grammar: xgr.CompiledGrammar
    check: SchemaCheck | None
    enforcement: Enforcement | None  # None: the text was not JSON (xgrammar compiled it anyway, which cannot happen)


class JsonSchemaCompiler:
    """Compiles JSON schemas for one xgrammar compiler. Raises :class:`UnenforcedSchemaError` or
    :class:`SchemaCheckError` (the caller turns them into an invalid grammar), or xgrammar's own error."""

    def __init__(
        self,
        xgr_compiler: xgr.GrammarCompiler,
        token_bytes: Sequence[bytes],
        policy: JsonSchemaPolicy,
        default_mode: JsonSchemaMode,
        integer_range: IntegerRange = IntegerRange.SAFE,
        max_whitespace: int | None = DEFAULT_JSON_MAX_WHITESPACE,
    ) -> None:
        """``token_bytes[t]``: the bytes token t adds to an output (xgrammar's decoded vocabulary); ``integer_range``:
        what an integer the schema leaves unbounded may be; ``max_whitespace``: whitespace characters allowed in a row
        between JSON tokens, None for any number."""
        self._xgr = xgr_compiler
        self._token_bytes = token_bytes
        self._policy = policy
        self._default_mode = default_mode
        self._integer_range = integer_range
        self._max_whitespace = max_whitespace

    @property
    def default_mode(self) -> JsonSchemaMode:
        return self._default_mode

    def _xgrammar(self, text: str) -> xgr.CompiledGrammar:
        """xgrammar's compile of a schema text: every mode's grammar comes from here, whitespace bounded."""
        return self._xgr.compile_json_schema(text, max_whitespace_cnt=self._max_whitespace)

    def compile(self, text: str, mode: JsonSchemaMode | None) -> CompiledSchema:
        mode = mode if mode is not None else self._default_mode
        try:
            schema = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return CompiledSchema(self._xgrammar(text), None, None)  # xgrammar says what is wrong
        if self._integer_range is IntegerRange.SAFE and bound_integers(schema):
            text = json.dumps(schema)  # what every mode compiles from here on, loose included
        if mode is JsonSchemaMode.LOOSE:
            told = self._policy.apply(schema, checking=True)
            loose = (*told.unenforced, *told.checked)
            return CompiledSchema(self._xgrammar(text), None, Enforcement.of(schema, mode, loose))
        outcome = self._policy.apply(schema, checking=mode is JsonSchemaMode.CHECKED)
        if not outcome.accepted:
            raise UnenforcedSchemaError(outcome, self._policy.max_reported)
        prepared = json.dumps(outcome.schema) if outcome.changed else text
        if mode is JsonSchemaMode.STRICT:
            return CompiledSchema(self._compile_rewrite(prepared, text), None, Enforcement.of(schema, mode))
        return self._checked(schema, text, prepared, outcome.checked)

    def _compile_rewrite(self, prepared: str, text: str) -> xgr.CompiledGrammar:
        try:
            return self._xgrammar(prepared)
        except _XGRAMMAR_ERRORS:
            if prepared is not text:
                # The client should read xgrammar's reason about the schema they wrote ("minimum greater than
                # maximum"), not about our rewrite of it ("Schema 'false' cannot accept any value"): compile the
                # original once more, only on this failure path; if it compiles after all, the rewrite's error stands.
                self._xgrammar(text)
            raise

    def _checked(self, schema: Any, text: str, prepared: str, checked: tuple[Unenforced, ...]) -> CompiledSchema:
        try:
            grammar = self._xgrammar(prepared)
        except _XGRAMMAR_ERRORS:
            if prepared is text:
                raise
            # xgrammar compiles the schema but not our rewrite of it: its own reading, and the whole schema checked.
            grammar = self._xgrammar(text)
            checked = (Unenforced("schema", "", "its rewrite did not compile: xgrammar's reading, checked as a whole"),)
        try:
            check = SchemaCheck(schema, checked, self._token_bytes)
        except SchemaCheckError as error:
            if checked:
                listed = "; ".join(u.describe() for u in checked[: self._policy.max_reported])
                raise SchemaCheckError(f"{listed}: not enforced by the grammar, and not checkable: {error}") from None
            check = None  # everything is enforced by the grammar: served as in strict mode, without the check
        return CompiledSchema(grammar, check, Enforcement.of(schema, JsonSchemaMode.CHECKED, checked))
