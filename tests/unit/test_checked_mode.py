"""Checked JSON-schema mode through the real grammar path: real xgrammar matchers, real jsonschema, real ijson.

Each case is a schema using a keyword xgrammar 0.2.9 cannot enforce and two outputs: the tokens of each output (the
embedded model's tokenizer) are committed to a :class:`GrammarRegistry` one step at a time, as the scheduler commits
them, followed by the stop token. The output that violates the keyword must end with the grammar refusing a token
and a violation naming the keyword and its place (the scheduler turns that into the abort, C13); the one that
satisfies it must end with the grammar terminated at the stop token ("stop"). Where a completed value can be
checked before the end (a member, an item, the closing bracket of the root), the refusal comes at that token, not at
the stop token.

Every case's schema is refused by strict mode, so each case fails if checked mode is removed (the open raises) or if
its check is (the violating output would terminate).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
from engine.grammar import CompilerConfig, ConstraintCompiler, GrammarRegistry, JsonSchemaPolicy, load_tokenizer_info
from engine.grammar.json_schema_compiler import JsonSchemaCompiler
from engine.grammar.schema_check import SchemaCheckError
from engine.grammar_calls import CommitEntry, InvalidGrammarError
from engine.model.tokenizer import Tokenizer
from tests.unit.test_json_schema_policy import FUZZ_VALUES, SchemaFuzzer, accepts

_ids = itertools.count()


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(embedded_model_dir)


@pytest.fixture(scope="module")
def registry(embedded_model_dir: Path) -> Iterator[GrammarRegistry]:
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir, CompilerConfig(workers=1))
    assert CompilerConfig().json_schema_mode is JsonSchemaMode.CHECKED  # the default
    yield GrammarRegistry(compiler)
    compiler.shutdown()


@dataclass(frozen=True)
class Ending:
    """How committing an output ended: ``stopped`` at the stop token, or refused at token ``refused_at``."""

    tokens: int  # the output's tokens, the stop token not counted
    stopped: bool
    refused_at: int | None = None
    violation: str | None = None


def commit_output(registry: GrammarRegistry, tokenizer: Tokenizer, schema: Any, output: str) -> Ending:
    """Open a matcher for ``schema`` and commit ``output``'s tokens, then the stop token, one step at a time."""
    rid = f"checked-{next(_ids)}"
    registry.open(rid, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), timeout_s=60)
    ids = tokenizer.encode(output)
    try:
        for ordinal, token in enumerate([*ids, min(tokenizer.eos_token_ids)]):
            (outcome,) = registry.commit([CommitEntry(rid, ordinal, (token,))])
            result = outcome.result
            assert result is not None, outcome.message
            if result.rejected_token is not None:
                return Ending(len(ids), False, ordinal, result.violation)
            if result.terminated:
                return Ending(len(ids), True)
        raise AssertionError(f"{output!r}: neither refused nor terminated")
    finally:
        registry.release([rid])


# (keyword, schema, an output that satisfies it, one that violates it, what the violation names, checked early)
CASES: list[tuple[str, dict[str, Any], str, str, str, bool]] = [
    (
        "uniqueItems",
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        },
        '{"tags": [1, 2, 3]}',
        '{"tags": [1, 2, 1]}',
        "uniqueItems at /properties/tags",
        True,
    ),
    (
        "not",
        {"type": "object", "properties": {"user": {"type": "string", "not": {"enum": ["root", "admin"]}}}},
        '{"user": "alice"}',
        '{"user": "root"}',
        "not at /properties/user",
        True,
    ),
    (
        "contains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}},
        "[1, 3]",
        "[1, 2]",
        "contains at /",
        True,
    ),
    (
        "minContains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 10}, "minContains": 2},
        "[10, 11, 1]",
        "[10, 1, 2]",
        "minContains at /",
        True,
    ),
    (
        "maxContains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 10}, "maxContains": 1},
        "[10, 1]",
        "[10, 11]",
        "maxContains at /",
        True,
    ),
    (
        "if/then/else",
        {
            "type": "object",
            "properties": {"country": {"type": "string"}, "postal": {"type": "string"}},
            "if": {"properties": {"country": {"const": "US"}}, "required": ["country"]},
            "then": {"properties": {"postal": {"pattern": "^[0-9]{5}$"}}},
            "else": {"properties": {"postal": {"pattern": "^[A-Z]"}}},
        },
        '{"country": "US", "postal": "12345"}',
        '{"country": "US", "postal": "ABCDE"}',
        "pattern at /then/properties/postal",
        True,
    ),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
            "additionalProperties": True,  # open: the dependency cannot become a choice of closed objects
            "dependentRequired": {"card": ["billing"]},
        },
        '{"card": "x", "billing": "y"}',
        '{"card": "x"}',
        "dependentRequired at /",
        True,
    ),
    (
        "dependencies",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
            "additionalProperties": True,
            "dependencies": {"card": ["billing"]},
        },
        '{"billing": "y"}',
        '{"card": "x"}',
        "dependencies at /",
        True,
    ),
    (
        "overlapping oneOf",
        {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}}},
        '{"n": -3}',
        '{"n": 5}',
        "oneOf at /properties/n",
        True,
    ),
    (
        "patternProperties next to properties and additionalProperties",  # xgrammar lets "b" in as an extra name
        {
            "type": "object",
            "properties": {"b": {"type": "object"}},
            "additionalProperties": True,
            "patternProperties": {"^x": {"type": "integer"}},
        },
        '{"b": {}, "x1": 1}',
        '{"b": 2}',
        "type at /properties/b",
        True,
    ),
    (
        "multipleOf on numbers",
        {"type": "number", "multipleOf": 0.5},
        "1.5",
        "0.3",
        "multipleOf at /",
        False,  # a number at the root is complete only at the end
    ),
]


@pytest.mark.parametrize(("keyword", "schema", "good", "bad", "named", "early"), CASES, ids=[c[0] for c in CASES])
def test_a_violation_ends_with_the_named_refusal_and_a_valid_output_with_stop(
    registry: GrammarRegistry,
    tokenizer: Tokenizer,
    keyword: str,
    schema: dict[str, Any],
    good: str,
    bad: str,
    named: str,
    early: bool,
) -> None:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    assert validator.is_valid(json.loads(good)) and not validator.is_valid(json.loads(bad)), "the case is wrong"
    assert not JsonSchemaPolicy().apply(schema).accepted, "strict mode would enforce it: not a checked case"

    kept = commit_output(registry, tokenizer, schema, good)
    assert kept.stopped, kept.violation

    refused = commit_output(registry, tokenizer, schema, bad)
    assert not refused.stopped and refused.violation is not None
    assert f"violates {named} of the JSON schema (checked on the output" in refused.violation, refused.violation
    assert "the value at /" in refused.violation
    if early:  # refused at the token that completed the offending value, before the stop token
        assert refused.refused_at is not None and refused.refused_at < refused.tokens, refused
    else:
        assert refused.refused_at == refused.tokens  # at the stop token: the whole output


def test_the_refused_matcher_answers_nothing_more(registry: GrammarRegistry, tokenizer: Tokenizer) -> None:
    """After a violation the matcher is finished like one that refused a token: later commits and masks are
    refused with REJECTED, and the message repeats the violation."""
    schema = CASES[0][1]
    rid = "checked-finished"
    registry.open(rid, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), timeout_s=60)
    try:
        ids = tokenizer.encode('{"tags": [1, 1]}')
        ordinal = 0
        for token in ids:
            (outcome,) = registry.commit([CommitEntry(rid, ordinal, (token,))])
            assert outcome.result is not None
            if outcome.result.rejected_token is not None:
                break
            ordinal += 1
        (again,) = registry.commit([CommitEntry(rid, ordinal, (ids[-1],))])
        assert again.result is None and again.refusal is not None and again.refusal.value == "rejected"
        assert "uniqueItems" in again.message
    finally:
        registry.release([rid])


def test_strict_mode_is_unchanged_and_loose_mode_checks_nothing(embedded_model_dir: Path, tokenizer: Tokenizer) -> None:
    """The same schema per request in strict mode is refused (naming the way out), in loose mode compiled without a
    check: its violating output terminates ("stop", as SGLang would end it)."""
    schema = CASES[0][1]
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir, CompilerConfig(workers=1))
    try:
        strict = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), JsonSchemaMode.STRICT)
        with pytest.raises(InvalidGrammarError, match="choose checked mode"):
            compiler.compile(strict, timeout_s=60)
        registry = GrammarRegistry(compiler)
        loose = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), JsonSchemaMode.LOOSE)
        assert compiler.compile(loose, timeout_s=60).check is None
        registry.open("loose", loose, timeout_s=60)
        ids = [*tokenizer.encode('{"tags": [1, 1]}'), min(tokenizer.eos_token_ids)]
        outcomes = [registry.commit([CommitEntry("loose", i, (t,))])[0] for i, t in enumerate(ids)]
        assert outcomes[-1].result is not None and outcomes[-1].result.terminated
        registry.release(["loose"])
    finally:
        compiler.shutdown()


# ---------------------------------------------------------------------------------------------------- fuzzing


class CheckedFuzzer(SchemaFuzzer):
    """The policy fuzzer's schemas plus the keywords checked mode takes over."""

    def leaf(self, depth: int) -> dict[str, Any]:
        out = super().leaf(depth)
        rng = self.rng
        kind = out.get("type")
        if kind in ("array", None) and rng.random() < 0.3:
            out |= {"uniqueItems": True} if rng.random() < 0.6 else {"contains": {"type": "integer"}}
        if rng.random() < 0.1:
            out |= {"not": {"enum": rng.sample(FUZZ_VALUES, 2)}}
        if kind in ("object", None) and rng.random() < 0.15:
            out |= {"if": {"required": ["a"]}, "then": {"required": ["b"]}}
        if rng.random() < 0.08:
            out |= {"oneOf": [{"type": "integer"}, {"type": "number"}, {}]}
        return out


def test_fuzzed_checked_schemas_compile_and_every_violation_is_of_a_checked_keyword(
    info: xgr.TokenizerInfo,
) -> None:
    """Random schemas in checked mode (the compile path of the grammar service): each compiles wherever xgrammar
    compiles the schema itself; for every value its grammar accepts, the check agrees with jsonschema, and every
    violation it reports is explained by a place the grammar left to the check (a violation of a keyword the
    grammar claims to enforce would mean the policy let xgrammar read a keyword loosely without noticing)."""
    xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    schemas = JsonSchemaCompiler(xgr_compiler, info.decoded_vocab, JsonSchemaPolicy(), JsonSchemaMode.CHECKED)
    fuzzer = CheckedFuzzer(seed=17)
    compiled = checked = 0
    problems: list[str] = []
    while compiled < 250:
        schema = fuzzer.node()
        try:
            xgr_compiler.compile_json_schema(json.dumps(schema))
        except RuntimeError:
            continue  # xgrammar itself refuses it: checked mode may refuse it too
        try:
            result = schemas.compile(json.dumps(schema), None)
        except SchemaCheckError:
            continue  # not a valid schema for jsonschema either (a duplicate type, say), and something to check
        assert result.enforcement is not None
        if result.check is None:
            continue  # invalid for jsonschema, and all of it enforced by the grammar: served as in strict mode
        compiled += 1
        checked += bool(result.enforcement.unenforced)
        validator = jsonschema.Draft202012Validator(schema)
        for value in FUZZ_VALUES:
            text = json.dumps(value)
            if not accepts(result.grammar, text):
                continue
            violation = result.check.output_violation(text.encode())
            if validator.is_valid(value) != (violation is None):
                problems.append(f"{schema} {text}: jsonschema and the check disagree ({violation})")
            elif violation is not None and not violation.checked:
                problems.append(f"{schema} {text}: {violation.describe()}")
    assert problems == []
    assert checked > 50  # the checked keywords were really there


@pytest.fixture(scope="module")
def info(embedded_model_dir: Path) -> xgr.TokenizerInfo:
    return load_tokenizer_info(embedded_model_dir)
