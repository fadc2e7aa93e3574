"""The grammar service's Prometheus metrics (served with :func:`services.metrics.serve_metrics`).

:class:`GrammarMetrics` is an :class:`engine.grammar.EnforcementObserver` of the grammar registry: JSON-schema requests
by mode, their keywords by who enforces them (the grammar, the output check, nobody in loose mode), and the violations
checked mode finds, by keyword.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from engine.constraint import JsonSchemaMode
from engine.grammar import Enforcement, Violation


class GrammarMetrics:
    """The grammar service's metrics: how each JSON-schema request's keywords are enforced, and violations found."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            "ordinal_json_schema_requests", "JSON-schema requests opened, by mode.", ["mode"], registry=r
        )
        self._keywords = Counter(
            "ordinal_json_schema_keywords",
            "JSON-schema requests using a keyword, by who enforces it: the grammar, the output check (checked mode) "
            "or nobody (loose mode). A request counts once per keyword and enforcer.",
            ["keyword", "enforced_by"],
            registry=r,
        )
        self._violations = Counter(
            "ordinal_json_schema_violations",
            "Requests aborted because the output violated a keyword of its JSON schema (checked mode), by keyword.",
            ["keyword"],
            registry=r,
        )

    def schema_opened(self, request_id: str, enforcement: Enforcement) -> None:
        self._requests.labels(enforcement.mode.value).inc()
        for keyword in enforcement.enforced:
            self._keywords.labels(keyword, "grammar").inc()
        other = "check" if enforcement.mode is JsonSchemaMode.CHECKED else "nobody"
        for keyword in enforcement.unenforced_keywords:
            self._keywords.labels(keyword, other).inc()

    def schema_violated(self, request_id: str, violation: Violation) -> None:
        self._violations.labels(violation.keyword).inc()
