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
    grammar exactly when kind and text are equal, which is what :attr:`cache_key` encodes.
    """

    kind: ConstraintKind
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            raise InvalidRequestError("constraint.kind", f"must be a ConstraintKind, got {self.kind!r}")
        if not self.text:
            raise InvalidRequestError(f"constraint.{self.kind.value}", "the grammar text is empty")

    @classmethod
    def from_public_field(cls, field: str, text: str) -> Constraint:
        """Build from the name of the public API's ``constraint`` oneof field (``ebnf_grammar`` etc.) and its value."""
        kind = _PUBLIC_FIELD_KINDS.get(field)
        if kind is None:
            raise InvalidRequestError(
                f"sampling_params.{field}", f"unknown constraint; one of {sorted(_PUBLIC_FIELD_KINDS)}"
            )
        return cls(kind, text)

    @property
    def cache_key(self) -> str:
        """A digest of kind and text: equal keys mean the same compiled grammar."""
        digest = hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:32]
        return f"{self.kind.value}:{digest}"

    def describe(self, limit: int = 80) -> str:
        """A short human-readable form for messages: the kind and the start of the text."""
        head = self.text if len(self.text) <= limit else self.text[:limit] + "…"
        return f"{self.kind.value} {head!r}"
