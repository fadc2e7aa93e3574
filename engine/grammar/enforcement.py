"""What a request's JSON schema gets from the grammar service: which keywords the grammar enforces, which are checked.

An :class:`Enforcement` is computed once per compiled schema and reported for every request that opens it, to an
:class:`EnforcementObserver` (logs and Prometheus counters by keyword); a :class:`~engine.grammar.violation.Violation`
found by the output check is reported to it as well.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.constraint import JsonSchemaMode
from engine.grammar.schema import Unenforced
from engine.grammar.schema.vocabulary import keyword_places
from engine.grammar.violation import Violation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Enforcement:
    """How one JSON schema is served. ``enforced``: the keywords the grammar enforces somewhere in it; ``unenforced``:
    the places it does not, which checked mode checks on the output and loose mode leaves to chance."""

    mode: JsonSchemaMode
    enforced: tuple[str, ...]
    unenforced: tuple[Unenforced, ...] = ()

    @classmethod
    def of(cls, schema: Any, mode: JsonSchemaMode, unenforced: Sequence[Unenforced] = ()) -> Enforcement:
        places = list(keyword_places(schema))
        enforced = {k for k, place in places if not any(u.covers_location(place) for u in unenforced)}
        return cls(mode, tuple(sorted(enforced)), tuple(unenforced))

    @property
    def unenforced_keywords(self) -> tuple[str, ...]:
        return tuple(sorted({u.keyword for u in self.unenforced}))

    def describe(self, max_places: int = 5) -> str:
        """One line for the log: the mode, what the grammar enforces and what it does not."""
        line = f"json_schema {self.mode.value}: enforced by the grammar: {', '.join(self.enforced) or 'nothing'}"
        if not self.unenforced:
            return line
        places = "; ".join(u.describe() for u in self.unenforced[:max_places])
        more = len(self.unenforced) - max_places
        what = "checked on the output" if self.mode is JsonSchemaMode.CHECKED else "not enforced (loose)"
        return f"{line}; {what}: {places}" + (f"; and {more} more" if more > 0 else "")


class EnforcementObserver(Protocol):
    """Told about every JSON-schema request the grammar service opens and every violation its check finds."""

    def schema_opened(self, request_id: str, enforcement: Enforcement) -> None: ...

    def schema_violated(self, request_id: str, violation: Violation) -> None: ...


class LoggingObserver:
    """The default observer: one log line per request (INFO when something is not enforced by the grammar)."""

    def schema_opened(self, request_id: str, enforcement: Enforcement) -> None:
        level = logging.INFO if enforcement.unenforced else logging.DEBUG
        log.log(level, "grammar of %s: %s", request_id, enforcement.describe())

    def schema_violated(self, request_id: str, violation: Violation) -> None:
        log.info("grammar of %s: %s; the request is aborted", request_id, violation.describe())
