"""The JSON-schema policy (engine/grammar/schema/) against real xgrammar 0.2.9 matchers and real jsonschema.

Each rewrite case lists instances with their verdict. The test checks that jsonschema agrees with every verdict on
the *original* schema, that a fresh ``xgrammar.GrammarMatcher`` over the original schema accepts at least one
invalid instance (the looseness the rewrite exists for), and that a fresh matcher over the *rewritten* schema
accepts exactly the valid ones. Remove a rewrite from the policy and its case fails on the last check.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
from engine.grammar import CompilerConfig, ConstraintCompiler, JsonSchemaPolicy, load_tokenizer_info
from engine.grammar_calls import InvalidGrammarError

BENCH = Path(__file__).resolve().parents[2].parent / "shared" / "jsonschemabench"
POLICY = JsonSchemaPolicy()


@pytest.fixture(scope="module")
def info(embedded_model_dir: Path) -> xgr.TokenizerInfo:
    return load_tokenizer_info(embedded_model_dir)


@pytest.fixture(scope="module")
def xgr_compiler(info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def accepts(grammar: xgr.CompiledGrammar, text: str) -> bool:
    """A fresh matcher takes the whole text and could stop there."""
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def valid(schema: Any, text: str) -> bool:
    """jsonschema's verdict (with the draft ``$schema`` names, else 2020-12); text that is not JSON is invalid."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return False
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return validator(schema).is_valid(instance)


# (name, schema, instances that validate, instances that do not)
REWRITES: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    (
        "maxLength counts an escape as one character, never a raw control character",
        {"type": "string", "maxLength": 3},
        ['"abc"', '"a\\nb"', '"\\u00e9\\"x"', '""', '"😀😀😀"', '"\\ud83d\\ude00ab"'],
        ['"abcd"', '"a\x02b"', '"\\n\\n\\n\\n"', '"\x7f\x7f\x7f\x7f"'],
    ),
    (
        "minLength",
        {"type": "string", "minLength": 2},
        ['"ab"', '"\\"\\\\"', '"a\\tb c"'],
        ['"a"', '""', '"\x01\x01"', '"\\n"'],
    ),
    (
        "a long bound keeps the count, without escapes (a subset)",
        {"type": "string", "minLength": 1, "maxLength": 100},
        ['"' + "a" * 100 + '"', '"x"'],
        ['"' + "a" * 101 + '"', '""', '"a\x01"'],
    ),
    (
        "lengths next to a pattern are folded into it",
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        ['"abc"', '"a"'],
        ['"abcd"', '"abcdefgh"', '"ABC"'],
    ),
    (
        "lengths folded into an alternative of the pattern",
        {"type": "string", "pattern": "^([a-z]|[a-z][a-z0-9]*[a-z])$", "maxLength": 4},
        ['"a"', '"ab"', '"a12b"'],
        ['"a123b"', '"1"'],
    ),
    (
        "format next to lengths is an annotation",
        {"type": "string", "format": "date", "maxLength": 3},
        ['"abc"'],
        ['"2020-01-01"'],
    ),
    (
        "oneOf with branches of different types",
        {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]},
        ["5", '"ab"'],
        ["true", '"abc"', "1.5"],
    ),
    (
        "oneOf where two branches accept every boolean: no boolean is valid",
        {"oneOf": [{"type": ["boolean", "null"]}, {"properties": {"a": {"type": "integer"}}}]},
        ['{"a": 1}', "5", '"s"'],
        ["true", "null", '{"a": "x"}'],
    ),
    (
        "oneOf told apart by a required discriminator",
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k"]},
                {
                    "type": "object",
                    "properties": {"k": {"enum": ["b", "c"]}, "x": {"type": "string"}},
                    "required": ["k"],
                },
            ]
        },
        ['{"k": "a", "x": 1}', '{"k": "c", "x": "s"}'],
        ['{"k": "a", "x": "s"}', '{"x": 1}', "7"],
    ),
    (
        "oneOf of strings told apart by their patterns",
        {"oneOf": [{"type": "string", "pattern": "^[0-9]+(m|M)$"}, {"type": "string", "pattern": "^[0-9]+(g|G)$"}]},
        ['"12m"', '"3G"'],
        ['"12"', '"12mg"'],
    ),
    (
        "keywords next to anyOf apply to every branch",
        {"type": "object", "anyOf": [{"required": ["a"]}], "properties": {"a": {"type": "integer"}}},
        ['{"a": 1}'],
        ["7", "{}", '{"a": "x"}'],
    ),
    (
        "allOf of several entries merged",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        ['{"a": 1, "b": "x"}'],
        ['{"a": 1}', '{"b": "x"}', '{"a": "x", "b": "x"}', "3"],
    ),
    (
        "an enum value its type forbids is dropped",
        {"type": "string", "enum": ["a", 1]},
        ['"a"'],
        ["1"],
    ),
    (
        "a required name not in properties is declared",
        {"type": "object", "required": ["a"]},
        ['{"a": 1}', '{"a": "x"}'],
        ["{}"],
    ),
    (
        "typeless keywords apply to their own type",
        {"minLength": 2, "minimum": 3},
        ['"ab"', "5", "null"],
        ['"a"', "2"],
    ),
    (
        "a number with an integer multipleOf is an integer",
        {"type": "number", "multipleOf": 2},
        ["4", "0", "-6"],
        ["3", "2.5"],
    ),
    (
        "draft-4 tuple items",
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "array",
            "items": [{"type": "integer"}, {"type": "string"}],
            "additionalItems": False,
        },
        ['[1, "a"]', "[1]"],
        ['[1, "a", 2]', '["a"]'],
    ),
    (
        "$ref with sibling keywords (2020-12)",
        {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 3},
        ["5", "3"],
        ["2", '"x"'],
    ),
    (
        "a patternProperties pattern matching a declared property",
        {"type": "object", "properties": {"xa": {"type": "string"}}, "patternProperties": {"^x": {"minLength": 2}}},
        ['{"xa": "ab"}', "{}"],
        ['{"xa": "a"}'],
    ),
    (
        "a dependency on a required name makes its dependants required",
        {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"], "dependentRequired": {"a": ["b"]}},
        ['{"a": 1, "b": 2}'],
        ['{"a": 1}'],
    ),
    (
        "dependencies of a closed object",
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {}},
            "dependentRequired": {"a": ["b"]},
            "dependentSchemas": {"c": {"properties": {"a": {"minimum": 5}}}},
        },
        ["{}", '{"b": 1}', '{"a": 1, "b": 2}', '{"a": 5, "b": 0, "c": 0}', '{"c": 0}'],
        ['{"a": 1}', '{"a": 1, "b": 0, "c": 0}', '{"d": 1}'],
    ),
    (
        "dependencies of a required name always apply (found by fuzzing: they were once dropped)",
        {
            "type": "object",
            "required": ["a"],
            "dependentRequired": {"a": ["b"]},
            "dependentSchemas": {"a": {"properties": {"b": {"type": "integer"}}}},
        },
        ['{"b": 2, "a": 1}'],  # xgrammar keeps the declared order: b (from the dependent schema), then a
        ['{"a": 1}', '{"b": "s", "a": 1}', "{}"],
    ),
    (
        "propertyNames of a closed object checked on its properties",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "B": {"type": "integer"}},
            "additionalProperties": False,
            "propertyNames": {"pattern": "^[a-z]+$"},
        },
        ['{"a": 1}', "{}"],
        ['{"B": 1}', '{"c": 1}'],
    ),
    (
        "not of a type",
        {"not": {"type": "string"}},
        ["5", "null", "[]"],
        ['"a"'],
    ),
    (
        "integer bounds made whole",
        {"type": "integer", "exclusiveMinimum": 0.5, "maximum": 3.5},
        ["1", "3"],
        ["0", "4"],
    ),
    (
        "an array with a minimum count and no items schema",
        {"type": "array", "minItems": 1, "maxItems": 2},
        ["[1]", '[1, "a"]'],
        ["[]", "[1, 2, 3]"],
    ),
    (
        "not of an integer value: the ranges around it",
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "not": {"const": 3}}}},
        ['{"a": 2}', '{"a": 4}', '{"a": 0}', "{}"],
        ['{"a": 3}', '{"a": -1}'],
    ),
    (
        "not of integer values",
        {"type": "integer", "not": {"enum": [1, 3, "x"]}},
        ["0", "2", "4", "-7"],
        ["1", "3"],
    ),
    (
        "not of a boolean value",
        {"type": "boolean", "not": {"const": True}},
        ["false"],
        ["true"],
    ),
    (
        "if a required name then more names, in a closed object",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
            "additionalProperties": False,
            "if": {"required": ["a"]},
            "then": {"required": ["b"]},
            "else": {"required": ["c"]},
        },
        ['{"a": 1, "b": 2}', '{"c": 3}', '{"b": 1, "c": 2}'],
        ['{"a": 1}', '{"a": 1, "c": 2}', "{}", '{"b": 2}'],
    ),
    (
        "if a property has a listed value (a discriminator)",
        {
            "type": "object",
            "properties": {"kind": {"enum": ["uri", "text"]}, "source": {"type": "string"}, "body": {"type": "string"}},
            "required": ["kind"],
            "additionalProperties": False,
            "if": {"properties": {"kind": {"const": "uri"}}},
            "then": {"required": ["source"]},
            "else": {"required": ["body"]},
        },
        ['{"kind": "uri", "source": "x"}', '{"kind": "text", "body": "y"}'],
        ['{"kind": "uri", "body": "y"}', '{"kind": "text", "source": "x"}', '{"kind": "text"}'],
    ),
    (
        "allOf of conditionals on one discriminator",
        {
            "type": "object",
            "properties": {"h": {"type": "string", "enum": ["a", "b", "c"]}, "x": {}, "y": {}},
            "required": ["h"],
            "allOf": [
                {"if": {"properties": {"h": {"const": "a"}}}, "then": {"required": ["x"]}},
                {"if": {"properties": {"h": {"const": "b"}}}, "then": {"required": ["y"]}},
            ],
        },
        ['{"h": "a", "x": 1}', '{"h": "b", "y": 1}', '{"h": "c"}'],
        ['{"h": "a"}', '{"h": "b", "x": 1}', '{"h": "d"}'],
    ),
]


@pytest.mark.parametrize(("name", "schema", "good", "bad"), REWRITES, ids=[r[0] for r in REWRITES])
def test_rewrite_is_enforced_exactly(
    xgr_compiler: xgr.GrammarCompiler, name: str, schema: dict[str, Any], good: list[str], bad: list[str]
) -> None:
    for text in good:
        assert valid(schema, text), f"jsonschema rejects {text!r}: the case is wrong"
    for text in bad:
        assert not valid(schema, text), f"jsonschema accepts {text!r}: the case is wrong"
    outcome = POLICY.apply(schema)
    assert outcome.accepted, outcome.reason()
    assert outcome.changed and outcome.rewrites
    rewritten = xgr_compiler.compile_json_schema(json.dumps(outcome.schema))
    assert [t for t in good if not accepts(rewritten, t)] == [], "valid instances the rewritten grammar refuses"
    assert [t for t in bad if accepts(rewritten, t)] == [], "invalid instances the rewritten grammar accepts"


# oneOf cases whose branches are disjoint: xgrammar's own anyOf reading is right there too; they check that the
# policy's proof of disjointness (which turns them into anyOf) holds.
ALREADY_EXACT = {
    "oneOf with branches of different types",
    "oneOf told apart by a required discriminator",
    "oneOf of strings told apart by their patterns",
}


def test_every_other_rewrite_case_is_loose_or_refused_without_the_policy(xgr_compiler: xgr.GrammarCompiler) -> None:
    """The cases are worth having: as given to xgrammar, each schema lets an invalid instance through or fails to
    compile (the tuple form, whole-number bounds on integers, minItems without items)."""
    not_loose = []
    for name, schema, _, bad in REWRITES:
        try:
            grammar = xgr_compiler.compile_json_schema(json.dumps(schema))
        except RuntimeError:
            continue
        if not any(accepts(grammar, t) for t in bad) and name not in ALREADY_EXACT:
            not_loose.append(name)
    assert not_loose == []


UNCHANGED = [
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "string", "format": "date-time"},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
    {
        "definitions": {"a": {"type": "integer", "minimum": 0}},
        "type": "object",
        "properties": {"n": {"$ref": "#/definitions/a"}},
    },
    {"type": "object", "additionalProperties": {"type": "number"}, "minProperties": 1},
    {"type": "string", "enum": ["a", "b"], "description": "annotations and unknown keywords pass", "x-vendor": 1},
]


@pytest.mark.parametrize("schema", UNCHANGED)
def test_schemas_without_loose_features_are_unchanged(schema: dict[str, Any]) -> None:
    outcome = POLICY.apply(schema)
    assert outcome.accepted and not outcome.changed and outcome.schema == schema
    text = json.dumps(schema)
    assert POLICY.prepare(text) is text  # the very text: no re-serialisation


# (schema, keyword, pointer)
REFUSED = [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     "uniqueItems", "/properties/tags"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "/"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf", "/"),
    ({"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 10_000}, "multipleOf", "/"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "/"),
    ({"type": "string", "pattern": '^a"b$'}, "pattern", "/"),
    ({"type": "string", "pattern": "^(?=a)ab$"}, "pattern", "/"),
    ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}, "not", "/properties/a"),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "if": {"properties": {"k": {"const": "a"}}},
      "then": {"required": ["b"]}}, "if", "/"),
    ({"type": "array", "contains": {"const": 3}}, "contains", "/"),
    ({"definitions": {"d": {"type": "object", "dependentRequired": {"a": ["b"]}, "additionalProperties": True}},
      "$ref": "#/definitions/d"}, "dependentRequired", "/definitions/d"),
    ({"$ref": "https://example.com/schema.json"}, "$ref", "/"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}},
     "patternProperties", "/"),
    ({"type": "object", "properties": {"xa": {"type": "string"}}, "patternProperties": {"^x.*$": {"type": "integer"}}},
     "patternProperties", "/"),
    ({"type": "object", "properties": {"b": {"type": "object"}}, "additionalProperties": True,
      "propertyNames": {"maxLength": 3}}, "propertyNames", "/"),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "keyword", "pointer"), REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_keyword_names_keyword_and_pointer(
    info: xgr.TokenizerInfo, schema: Any, keyword: str, pointer: str
) -> None:
    """Strict mode: refused, naming keyword and place, with checked mode as the way out."""
    compiler = ConstraintCompiler(info, CompilerConfig(workers=1, json_schema_mode=JsonSchemaMode.STRICT))
    try:
        with pytest.raises(InvalidGrammarError) as refused:
            compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), timeout_s=60)
    finally:
        compiler.shutdown()
    reason = refused.value.reason
    assert refused.value.field == "constraint.json_schema"
    assert f"{keyword} at {pointer}" in reason, reason
    assert "xgrammar 0.2.9" in reason and "--json-schema checked" in reason and "\n" not in reason


@pytest.mark.parametrize(("schema", "keyword", "pointer"), REFUSED, ids=[r[1] for r in REFUSED])
def test_checked_mode_compiles_what_strict_mode_refuses_and_names_what_it_checks(
    info: xgr.TokenizerInfo, schema: Any, keyword: str, pointer: str
) -> None:
    """The same schemas in checked mode (the default; here chosen per request): compiled, with the refused keyword
    listed as checked on the output, at its place. Only a $ref to another document stays refused: nothing could
    read the schema it names."""
    compiler = ConstraintCompiler(info, CompilerConfig(workers=1, json_schema_mode=JsonSchemaMode.STRICT))
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), JsonSchemaMode.CHECKED)
    try:
        if keyword == "$ref":
            with pytest.raises(InvalidGrammarError) as refused:
                compiler.compile(constraint, timeout_s=60)
            assert "nor checkable" in refused.value.reason and "--json-schema loose" in refused.value.reason
            return
        compiled = compiler.compile(constraint, timeout_s=60)
    finally:
        compiler.shutdown()
    assert compiled.check is not None and compiled.enforcement is not None
    assert compiled.enforcement.mode is JsonSchemaMode.CHECKED
    places = {(u.keyword, u.pointer or "/") for u in compiled.enforcement.unenforced}
    assert (keyword, pointer) in places, places
    assert keyword in compiled.enforcement.unenforced_keywords


def test_loose_mode_compiles_what_strict_mode_refuses(info: xgr.TokenizerInfo) -> None:
    compiler = ConstraintCompiler(info, CompilerConfig(workers=1, json_schema_mode=JsonSchemaMode.LOOSE))
    try:
        for schema, keyword, _ in REFUSED[:5]:
            compiled = compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), timeout_s=60)
            assert compiled.check is None and compiled.enforcement is not None
            assert keyword in compiled.enforcement.unenforced_keywords  # reported as read loosely
    finally:
        compiler.shutdown()


def test_reason_lists_at_most_five_places_then_a_count() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "array", "uniqueItems": True} for i in range(8)}}
    outcome = POLICY.apply(schema)
    reason = outcome.reason()
    assert len(outcome.unenforced) == 8 and reason.count("uniqueItems at") == 5 and "and 3 more" in reason


def test_compiled_constraint_keeps_the_request_text(info: xgr.TokenizerInfo) -> None:
    """The policy rewrites what xgrammar compiles; the constraint (and its cache key) stay as the request gave them."""
    text = json.dumps({"type": "string", "maxLength": 3})
    compiler = ConstraintCompiler(info, CompilerConfig(workers=1))
    try:
        compiled = compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, text), timeout_s=60)
    finally:
        compiler.shutdown()
    assert compiled.constraint.text == text
    assert not accepts(compiled.grammar, '"a\x02b"') and accepts(compiled.grammar, '"a\\nb"')


def test_ref_cycles_finish_and_compile(xgr_compiler: xgr.GrammarCompiler) -> None:
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "string", "maxLength": 2}, "next": {"$ref": "#/$defs/node"}},
                "required": ["v"],
            },
            "loop": {"allOf": [{"$ref": "#/$defs/loop"}, {"type": "string"}]},
        },
        "type": "object",
        "properties": {"head": {"$ref": "#/$defs/node"}, "self": {"$ref": "#"}},
    }
    start = time.perf_counter()
    outcome = POLICY.apply(schema)
    assert time.perf_counter() - start < 5
    assert outcome.accepted, outcome.reason()
    grammar = xgr_compiler.compile_json_schema(json.dumps(outcome.schema))
    text = '{"head": {"v": "ab", "next": {"v": "\\n"}}, "self": {"head": {"v": "x"}}}'
    assert valid(schema, text) and accepts(grammar, text)
    assert not accepts(grammar, '{"head": {"v": "abc"}}')
    looping = {"$defs": schema["$defs"], "$ref": "#/$defs/loop"}
    assert not POLICY.apply(looping).accepted  # an allOf that includes itself: bounded, then refused


def test_deep_and_huge_schemas_are_bounded() -> None:
    deep: dict[str, Any] = {"type": "string", "maxLength": 2}
    for _ in range(500):
        deep = {"type": "object", "properties": {"a": deep}}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(30_000)}}
    for schema, detail in ((deep, "nested deeper"), (huge, "more than")):
        start = time.perf_counter()
        outcome = POLICY.apply(schema)
        assert time.perf_counter() - start < 10
        assert not outcome.accepted and detail in outcome.reason()
    shallow: dict[str, Any] = {"type": "string", "maxLength": 2}
    for _ in range(40):
        shallow = {"type": "object", "properties": {"a": shallow}}
    assert POLICY.apply(shallow).accepted
    # A long chain of definitions is visited one definition at a time: neither deep nor refused.
    chain: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(400)
    }
    chain["d400"] = {"type": "string", "maxLength": 2}
    assert POLICY.apply({"$defs": chain, "$ref": "#/$defs/d0"}).accepted


def mask_disagreements(grammar: xgr.CompiledGrammar, prefix: str, vocab_size: int) -> list[int]:
    """Tokens the matcher's mask allows after ``prefix`` but its ``accept_token`` refuses."""
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string(prefix)
    mask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, W] int32
    matcher.fill_next_token_bitmask(mask)
    words = mask[0].tolist()
    allowed = [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]
    return [t for t in allowed if not matcher.fork().accept_token(t)]


def test_long_counts_are_chunked_so_that_the_mask_agrees_with_the_matcher(
    xgr_compiler: xgr.GrammarCompiler, info: xgr.TokenizerInfo
) -> None:
    """Github_hard--o79409's "name": a class of ~500 Unicode ranges repeated {1,200}. xgrammar 0.2.9's mask allows
    tokens (" ->", " ,,") its matcher refuses, which ended a request with a grammar abort; as {1,64}{0,64}... the
    two agree."""
    path = BENCH / "Github_hard--o79409.json"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    schema = {"type": "string", "pattern": json.loads(path.read_text())["properties"]["name"]["pattern"]}
    vocab = int(info.vocab_size)
    assert mask_disagreements(xgr_compiler.compile_json_schema(json.dumps(schema)), '"__', vocab) != []
    rewritten = POLICY.apply(schema).schema
    assert mask_disagreements(xgr_compiler.compile_json_schema(json.dumps(rewritten)), '"__', vocab) == []


# ---------------------------------------------------------------------------------------------------- fuzzing

FUZZ_VALUES: list[Any] = [
    None, True, False, 0, 1, 2, 3, 5, -1, 7, 2.5, 0.5, "", "a", "ab", "abc", "abcd", "a\nb", 'q"', "é", "12",
    "x-1", [], [1], [1, 1], [1, 2], ["a", "b"], [1, "a"], {}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"a": "x"},
    {"k": "a"}, {"k": "b", "x": 1}, {"a": 1, "b": "s"}, {"x1": 1}, {"c": None},
]  # fmt: skip
FUZZ_PATTERNS = ["^[a-z]+$", "^a", "b$", "^[a-z]{1,3}$", "^(a|bc)+$", "[0-9]", "^[^x]*$", "^.{2}$"]


class SchemaFuzzer:
    """Random small schemas mixing the keywords the policy rewrites (seeded: the same schemas every run)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def node(self, depth: int = 0) -> dict[str, Any]:
        roll = self.rng.random()
        for threshold, keyword in ((0.12, "anyOf"), (0.24, "oneOf"), (0.32, "allOf")):
            if depth < 2 and roll < threshold:
                branches = [self.node(depth + 1) for _ in range(self.rng.randint(1, 3))]
                return {keyword: branches, **(self.leaf(depth) if self.rng.random() < 0.5 else {})}
        return self.leaf(depth)

    def leaf(self, depth: int) -> dict[str, Any]:
        rng, out = self.rng, {}
        kind = rng.choice(["string", "integer", "number", "boolean", "null", "array", "object", None])
        if kind:
            out["type"] = kind if rng.random() < 0.8 else [kind, rng.choice(["null", "string", "integer"])]
        if kind in ("string", None) and rng.random() < 0.5:
            out |= {"minLength": rng.randint(0, 3)} if rng.random() < 0.5 else {}
            out |= {"maxLength": rng.randint(0, 4)} if rng.random() < 0.6 else {}
            out |= {"pattern": rng.choice(FUZZ_PATTERNS)} if rng.random() < 0.4 else {}
        if kind in ("integer", "number", None) and rng.random() < 0.5:
            out |= {"minimum": rng.choice([0, 1, 0.5])} if rng.random() < 0.5 else {}
            out |= {"maximum": rng.choice([3, 7, 2.5])} if rng.random() < 0.5 else {}
            out |= {"multipleOf": rng.choice([1, 2])} if rng.random() < 0.3 else {}
        if kind in ("array", None) and rng.random() < 0.6:
            out |= {"items": self.node(depth + 1)} if rng.random() < 0.6 and depth < 2 else {}
            out |= {"minItems": rng.randint(0, 2)} if rng.random() < 0.4 else {}
            out |= {"maxItems": rng.randint(0, 3)} if rng.random() < 0.4 else {}
        if kind in ("object", None) and rng.random() < 0.6:
            if rng.random() < 0.7 and depth < 2:
                names = rng.sample(["a", "b", "k", "x"], rng.randint(1, 3))
                out["properties"] = {name: self.node(depth + 1) for name in names}
            out |= {"required": rng.sample(["a", "b", "k"], rng.randint(1, 2))} if rng.random() < 0.5 else {}
            extra = rng.choice([False, True, {"type": "integer"}])
            out |= {"additionalProperties": extra} if rng.random() < 0.4 else {}
            out |= {"patternProperties": {"^x": {"type": "integer"}}} if rng.random() < 0.15 else {}
            out |= {"dependentRequired": {"a": ["b"]}} if rng.random() < 0.15 else {}
            out |= {"propertyNames": {"enum": ["a", "k"]}} if rng.random() < 0.05 else {}
        out |= {"enum": rng.sample(FUZZ_VALUES, rng.randint(1, 4))} if rng.random() < 0.15 else {}
        out |= {"not": {"type": rng.choice(["string", "integer", "null"])}} if rng.random() < 0.1 else {}
        return out


def test_fuzzed_schemas_never_let_an_invalid_instance_through(xgr_compiler: xgr.GrammarCompiler) -> None:
    """The soundness side, on random schemas: whatever the rewritten grammar accepts, jsonschema accepts. (How
    several of the rules above were found; a longer run, ~15k compiled schemas per 3 minutes, found nothing more.)"""
    fuzzer = SchemaFuzzer(seed=7)
    loose, compiled = [], 0
    while compiled < 400:
        schema = fuzzer.node()
        outcome = POLICY.apply(schema)
        if not outcome.accepted:
            continue
        try:
            grammar = xgr_compiler.compile_json_schema(json.dumps(outcome.schema))
        except RuntimeError:
            continue  # a schema xgrammar itself refuses (an unsatisfiable one, say)
        compiled += 1
        validator = jsonschema.Draft202012Validator(schema)
        loose += [(schema, v) for v in FUZZ_VALUES if accepts(grammar, json.dumps(v)) and not validator.is_valid(v)]
    assert loose == []


def test_not_json_passes_through_for_xgrammar_to_report() -> None:
    assert POLICY.prepare("{not json") == "{not json"


@pytest.mark.slow
def test_every_bench_schema_through_the_policy(
    xgr_compiler: xgr.GrammarCompiler, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every JSONSchemaBench schema through the policy only (no generation): counts, and each rewrite compiles."""
    if not BENCH.is_dir():
        pytest.skip(f"JSONSchemaBench schemas not found at {BENCH}")
    counts: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    rewrites: Counter[str] = Counter()
    failures = []
    start = time.perf_counter()
    checked: Counter[str] = Counter()
    for path in sorted(BENCH.glob("*.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        in_checked_mode = POLICY.apply(schema, checking=True)
        assert in_checked_mode.accepted, f"{path.name}: {in_checked_mode.reason()}"  # checked mode refuses none
        checked.update({u.keyword for u in in_checked_mode.checked})
        outcome = POLICY.apply(schema)
        assert outcome.accepted == (not in_checked_mode.checked), path.name  # what strict refuses, checked checks
        rewrites.update(name for name, _ in outcome.rewrites)
        if not outcome.accepted:
            counts["refused"] += 1
            refused.update({u.keyword for u in outcome.unenforced})
            continue
        counts["rewritten" if outcome.changed else "unchanged"] += 1
        if outcome.changed:
            try:
                xgr_compiler.compile_json_schema(json.dumps(outcome.schema))
            except RuntimeError as error:
                failures.append(f"{path.name}: {error}")
    with capsys.disabled():
        print(f"\nJSONSchemaBench policy: {dict(counts)} in {time.perf_counter() - start:.1f}s")
        print(f"  refused, per keyword (schemas): {dict(refused.most_common())}")
        print(f"  rewrites (schemas): {dict(rewrites.most_common())}")
        print(f"  checked mode, checked on the output, per keyword (schemas): {dict(checked.most_common())}")
    assert failures == []
    assert sum(counts.values()) == 150 and counts["refused"] <= 20
