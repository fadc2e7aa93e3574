"""The JSON-schema policy: a schema reaches xgrammar only in a form xgrammar 0.2.9 enforces exactly, or it is refused.

What xgrammar reads loosely and how each keyword is rewritten is told in :mod:`engine.grammar.schema.policy`. The walk
over one schema is :mod:`~engine.grammar.schema.walker`, with the rules per JSON type in ``strings``, ``numbers``,
``arrays`` and ``objects``; ``merger`` conjoins two schemas (allOf), ``disjointness`` proves two oneOf branches never
accept one instance, ``validator`` decides listed values against their sibling keywords, ``pointer`` resolves JSON
pointers and references, ``vocabulary`` says which keywords each draft validates, ``values`` compares JSON values.
"""

from engine.grammar.schema.policy import (
    MODE_FLAG,
    MODE_PARAM,
    XGRAMMAR,
    JsonSchemaPolicy,
    PolicyOutcome,
    Unenforced,
    UnenforcedSchemaError,
)

__all__ = [
    "MODE_FLAG",
    "MODE_PARAM",
    "XGRAMMAR",
    "JsonSchemaPolicy",
    "PolicyOutcome",
    "Unenforced",
    "UnenforcedSchemaError",
]
