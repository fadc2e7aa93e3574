"""The constraint value: which grammar language a request's output must follow, and the grammar text itself."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from engine.errors import InvalidRequestError


class ConstraintKind(enum.Enum):
    """The grammar languages xgrammar compiles. The value is the name used in messages and cache keys."""

    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF = "ebnf"
    STRUCTURAL_TAG = "structural_tag"


MODE_PARAM = "json_schema_mode"  # a request's choice of JsonSchemaMode (SamplingParams.custom_params)


class JsonSchemaMode(enum.Enum):
    """How a JSON schema the grammar cannot enforce exactly is served. The value is its name in flags and requests.

    STRICT: compiled only in a form xgrammar enforces exactly, else refused (naming keyword and place). CHECKED:
    compiled into the closest grammar xgrammar enforces, the rest checked on the output with a JSON-schema validator;
    a violation ends the request with an abort naming keyword, place and value. LOOSE: compiled as given (SGLang's
    way): xgrammar enforces some keywords loosely and nothing checks them.
    """

    STRICT = "strict"
    CHECKED = "checked"
    LOOSE = "loose"

    @classmethod
    def parse(cls, text: str, field: str) -> JsonSchemaMode:
        """The mode named ``text``; InvalidRequestError naming ``field`` otherwise."""
        try:
            return cls(text)
        except ValueError:
            raise InvalidRequestError(field, f"must be one of {[m.value for m in cls]}, got {text!r}") from None


# The names of the ``constraint`` oneof of SglangScheduler's SamplingParams (smg-grpc-proto), by kind.
_PUBLIC_FIELD_KINDS: dict[str, ConstraintKind] = {
    "json_schema": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "ebnf_grammar": ConstraintKind.EBNF,
    "structural_tag": ConstraintKind.STRUCTURAL_TAG,
}


@dataclass(frozen=True)
class Constraint:
    """A grammar a request's output must match: ``kind`` says how to read ``text``.

    The text is kept verbatim (smg forwards a client's JSON schema as given): two constraints are the same
    grammar exactly when kind, text and JSON-schema mode are equal, which is what :attr:`cache_key` encodes.
    ``json_schema_mode`` (JSON schemas only) is the request's choice; None leaves it to the grammar service's default.
    """

    kind: ConstraintKind
    text: str
    json_schema_mode: JsonSchemaMode | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            raise InvalidRequestError("constraint.kind", f"must be a ConstraintKind, got {self.kind!r}")
        if not self.text:
            raise InvalidRequestError(f"constraint.{self.kind.value}", "the grammar text is empty")
        if self.json_schema_mode is not None and self.kind is not ConstraintKind.JSON_SCHEMA:
            raise InvalidRequestError(
                "constraint.json_schema_mode", f"applies to json_schema constraints only, not to {self.kind.value}"
            )

    @classmethod
    def from_public_field(cls, field: str, text: str, json_schema_mode: JsonSchemaMode | None = None) -> Constraint:
        """Build from the name of the public API's ``constraint`` oneof field (``ebnf_grammar`` etc.) and its value."""
        kind = _PUBLIC_FIELD_KINDS.get(field)
        if kind is None:
            raise InvalidRequestError(
                f"sampling_params.{field}", f"unknown constraint; one of {sorted(_PUBLIC_FIELD_KINDS)}"
            )
        return cls(kind, text, json_schema_mode)

    @property
    def cache_key(self) -> str:
        """A digest of kind, mode and text: equal keys mean the same compiled grammar (one compiler reads an unset mode
        always as its one default)."""
        digest = hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:32]
        mode = f"{self.json_schema_mode.value}:" if self.json_schema_mode is not None else ""
        return f"{self.kind.value}:{mode}{digest}"

    def describe(self, limit: int = 80) -> str:
        """A short human-readable form for messages: the kind and the start of the text."""
        head = self.text if len(self.text) <= limit else self.text[:limit] + "…"
        return f"{self.kind.value} {head!r}"
