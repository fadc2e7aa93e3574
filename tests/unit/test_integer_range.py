"""Integers a JSON schema leaves unbounded stay within +-(2^53 - 1) by default, in every mode (``IntegerRange.SAFE``).

The rules on schemas (which nodes get which bound) are checked on the pure function; the grammars are checked through
the compiler the grammar service uses (real xgrammar on the embedded tokenizer): with the default range a matcher
takes ``2^53 - 1`` and refuses ``2^53``, in strict, checked and loose mode; with ``IntegerRange.UNBOUNDED`` it takes an
84-digit integer. The grammar tests fail if the call of ``bound_integers`` in ``JsonSchemaCompiler.compile`` is
removed (the matcher then takes ``2^53``), and the unbounded one if that call ignores the configured range.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
from engine.grammar import CompilerConfig, ConstraintCompiler, IntegerRange
from engine.grammar.schema.integer_range import SAFE_INTEGER, bound_integers
from tests.unit.test_json_schema_policy import accepts

S = SAFE_INTEGER
BOUNDED = {"type": "integer", "minimum": -S, "maximum": S}
SHARED = {"$ref": "#/$defs/ordinal_safe_integer"}  # what a nested plain integer becomes
HUGE = "17154902112512202" * 5  # 85 digits: what a random model wrote for an unbounded id


# (name, schema, the schema once bounded)
RULES: list[tuple[str, Any, Any]] = [
    ("an unbounded integer gets both bounds", {"type": "integer"}, BOUNDED),
    ("in a type list", {"type": ["integer", "null"]}, {"type": ["integer", "null"], "minimum": -S, "maximum": S}),
    ("only the open side", {"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 0, "maximum": S}),
    (
        "an exclusive bound is a bound",
        {"type": "integer", "exclusiveMaximum": 10},
        {"type": "integer", "exclusiveMaximum": 10, "minimum": -S},
    ),
    (
        "a draft-4 boolean modifier alone bounds nothing",
        {"type": "integer", "exclusiveMinimum": True, "maximum": 3},
        {"type": "integer", "exclusiveMinimum": True, "maximum": 3, "minimum": -S},
    ),
    ("a minimum beyond the range keeps the maximum open", {"type": "integer", "minimum": 2**60}, None),
    ("a maximum below the range keeps the minimum open", {"type": "integer", "maximum": -(2**60)}, None),
    ("explicit bounds beyond the range stay", {"type": "integer", "minimum": -(2**62), "maximum": 2**62}, None),
    ("numbers are not integers", {"type": "number"}, None),
    ("a step stays as written (xgrammar counts small ranges only)", {"type": "integer", "multipleOf": 2}, None),
    ("integer or number is a number", {"type": ["integer", "number"]}, None),
    ("listed values stay", {"type": "integer", "const": 2**60}, None),
    ("listed values stay (enum)", {"type": "integer", "enum": [2**60, 1]}, None),
    ("a $ref node stays (its target is bounded)", {"type": "integer", "$ref": "#/$defs/a"}, None),
    ("a bound under not would widen the schema", {"not": {"type": "integer"}}, None),
    ("malformed bounds are xgrammar's to report", {"type": "integer", "minimum": "0"}, None),
    ("no type: any value, left as it is", {"minimum": 0}, None),
    (
        "a nested integer with keywords of its own stays in place",
        {"type": "array", "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": S}},
    ),
    (
        "nested plain integers share one bounded definition (a free name)",
        {"type": "array", "items": {"type": "integer", "description": "n"}, "$defs": {"ordinal_safe_integer": {}}},
        {
            "type": "array",
            "items": {"$ref": "#/$defs/ordinal_safe_integer_"},
            "$defs": {"ordinal_safe_integer": {}, "ordinal_safe_integer_": BOUNDED},
        },
    ),
    (
        "everywhere an instance is checked against a subschema",
        {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "n": {"type": ["integer", "null"]}},
            "additionalProperties": {"type": "integer"},
            "patternProperties": {"^x": {"type": "integer"}},
            "$defs": {"a": {"type": "integer"}},
            "definitions": {"b": {"type": "integer"}},
            "dependentSchemas": {"id": {"properties": {"n": {"type": "integer"}}}},
            "anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "integer"}}],
            "oneOf": [{"type": "array", "prefixItems": [{"type": "integer"}], "contains": {"type": "integer"}}],
            "allOf": [{"if": {"type": "integer"}, "then": {"type": "integer"}, "else": {"type": "integer"}}],
        },
        {
            "type": "object",
            "properties": {"id": SHARED, "n": {"type": ["integer", "null"], "minimum": -S, "maximum": S}},
            "additionalProperties": SHARED,
            "patternProperties": {"^x": SHARED},
            "$defs": {"a": SHARED, "ordinal_safe_integer": BOUNDED},
            "definitions": {"b": SHARED},
            "dependentSchemas": {"id": {"properties": {"n": SHARED}}},
            "anyOf": [SHARED, {"type": "array", "items": SHARED}],
            "oneOf": [{"type": "array", "prefixItems": [SHARED], "contains": SHARED}],
            "allOf": [{"if": {"type": "integer"}, "then": SHARED, "else": SHARED}],
        },
    ),
]


@pytest.mark.parametrize(("name", "schema", "bounded"), RULES, ids=[r[0] for r in RULES])
def test_which_integers_get_which_bounds(name: str, schema: Any, bounded: Any) -> None:
    expected = schema if bounded is None else bounded
    work = copy.deepcopy(schema)
    changed = bound_integers(work)
    assert work == expected
    assert (changed > 0) == (bounded is not None)


def test_a_deep_schema_is_bounded_without_recursion() -> None:
    schema: Any = {"type": "integer"}
    for _ in range(5000):  # far deeper than Python's recursion limit
        schema = {"type": "array", "items": schema}
    assert bound_integers(schema) == 1


@pytest.fixture(scope="module")
def compilers(embedded_model_dir: Path) -> Iterator[dict[tuple[IntegerRange, JsonSchemaMode], ConstraintCompiler]]:
    made = {
        (r, m): ConstraintCompiler.from_model_dir(
            embedded_model_dir, CompilerConfig(workers=1, json_schema_mode=m, json_integer_range=r)
        )
        for r in IntegerRange
        for m in JsonSchemaMode
    }
    yield made
    for compiler in made.values():
        compiler.shutdown()


def _accepts(compiler: ConstraintCompiler, schema: Any, text: str) -> bool:
    compiled = compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), timeout_s=60)
    return accepts(compiled.grammar, text)


TOOL_ARGS = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


@pytest.mark.parametrize("mode", list(JsonSchemaMode), ids=lambda m: m.value)
def test_by_default_no_mode_lets_an_integer_past_2_53(
    compilers: dict[tuple[IntegerRange, JsonSchemaMode], ConstraintCompiler], mode: JsonSchemaMode
) -> None:
    compiler = compilers[(IntegerRange.SAFE, mode)]
    for edge in (S, -S, 0):
        assert _accepts(compiler, TOOL_ARGS, f'{{"id": {edge}}}'), edge
    for beyond in (S + 1, -S - 1, int(HUGE)):
        assert not _accepts(compiler, TOOL_ARGS, f'{{"id": {beyond}}}'), beyond
    # What the schema asks for explicitly stays: a const beyond the range, bounds beyond it.
    assert _accepts(compiler, {"type": "integer", "const": 2**60}, str(2**60))
    assert _accepts(compiler, {"type": "integer", "minimum": S + 1, "maximum": S + 9}, str(S + 2))


@pytest.mark.parametrize("mode", list(JsonSchemaMode), ids=lambda m: m.value)
def test_unbounded_range_compiles_integers_as_written(
    compilers: dict[tuple[IntegerRange, JsonSchemaMode], ConstraintCompiler], mode: JsonSchemaMode
) -> None:
    compiler = compilers[(IntegerRange.UNBOUNDED, mode)]
    assert _accepts(compiler, TOOL_ARGS, f'{{"id": {S + 1}}}')
    assert _accepts(compiler, TOOL_ARGS, f'{{"id": {HUGE}}}')


def test_the_request_text_stays_as_given(
    compilers: dict[tuple[IntegerRange, JsonSchemaMode], ConstraintCompiler],
) -> None:
    """Only what xgrammar compiles is bounded: the constraint (its cache key, what the request said) is unchanged."""
    text = json.dumps(TOOL_ARGS)
    compiled = compilers[(IntegerRange.SAFE, JsonSchemaMode.CHECKED)].compile(
        Constraint(ConstraintKind.JSON_SCHEMA, text), timeout_s=60
    )
    assert compiled.constraint.text == text
