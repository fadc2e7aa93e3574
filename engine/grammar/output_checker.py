"""One request's output check in checked mode: the output's bytes as they are committed, and its values as they close.

Each committed token's bytes (xgrammar's decoded vocabulary) are kept for the final check of the whole output when
the grammar terminates (:meth:`OutputChecker.finish`). When the schema has sites (nodes holding a checked keyword,
:class:`~engine.grammar.schema_check.SchemaCheck`), the bytes also go to an incremental JSON parser (``ijson``, its
C backend): every value that closes (a scalar, or a ``]``/``}``) is built and, where a site applies to it, validated
against that site at once, so that a violation ends the request when it happens rather than at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import ijson

from engine.grammar.schema_check import Path, SchemaCheck, Schemas
from engine.grammar.violation import Violation


@dataclass
class _Open:
    """A container of the output that has not closed yet."""

    value: dict[str, Any] | list[Any]
    path: Path
    schemas: Schemas  # the subschemas that apply to it unconditionally
    key: str = ""  # objects: the member now being read


class OutputChecker:
    """The check of one output; fed token by token by the request's matcher (under its lock: no locking here)."""

    def __init__(self, check: SchemaCheck) -> None:
        self._check = check
        self._parts: list[bytes] = []
        self._events: list[tuple[str, Any]] = ijson.sendable_list()
        self._parser = ijson.basic_parse_coro(self._events) if check.has_sites else None
        self._open: list[_Open] = []

    def feed(self, token: int) -> Violation | None:
        """Take the next committed token (not the stop token); a violation a value that just closed shows."""
        data = self._check.token_bytes[token]
        self._parts.append(data)
        if self._parser is None:
            return None
        try:
            self._parser.send(data)
        except ijson.JSONError:
            self._parser = None  # not JSON after all: the final check will say so
            return None
        if not self._events:
            return None
        try:
            return self._consume()
        finally:
            del self._events[:]

    def finish(self) -> Violation | None:
        """The grammar terminated: the violation of the whole output, or None when it validates."""
        return self._check.output_violation(b"".join(self._parts))

    def _consume(self) -> Violation | None:
        for event, value in self._events:
            if event == "map_key":
                self._open[-1].key = value
            elif event in ("start_map", "start_array"):
                path, schemas = self._next_place()
                self._open.append(_Open({} if event == "start_map" else [], path, schemas))
            elif event in ("end_map", "end_array"):
                closed = self._open.pop()
                violation = self._closed(closed.value, closed.path, closed.schemas)
                if violation is not None:
                    return violation
            else:
                path, schemas = self._next_place()
                violation = self._closed(float(value) if isinstance(value, Decimal) else value, path, schemas)
                if violation is not None:
                    return violation
        return None

    def _next_place(self) -> tuple[Path, Schemas]:
        """Where the value that starts now sits, and what applies to it."""
        if not self._open:
            return (), self._check.root_schemas()
        parent = self._open[-1]
        if isinstance(parent.value, dict):
            return (*parent.path, parent.key), self._check.member_schemas(parent.schemas, parent.key)
        index = len(parent.value)
        return (*parent.path, index), self._check.item_schemas(parent.schemas, index)

    def _closed(self, value: Any, path: Path, schemas: Schemas) -> Violation | None:
        """A value is complete: put it into its container and validate it against the sites that apply to it."""
        if self._open:
            parent = self._open[-1]
            if isinstance(parent.value, dict):
                parent.value[parent.key] = value
            else:
                parent.value.append(value)
        for schema in schemas:
            if self._check.is_site(schema):
                violation = self._check.value_violation(value, path, schema)
                if violation is not None:
                    return violation
        return None
