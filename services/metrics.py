"""Prometheus metrics for the ordinal services.

Each service owns one :class:`~prometheus_client.CollectorRegistry` (nothing is registered in the library's
global registry, so two services, or two tests, in one process never collide) and exposes it with
:func:`serve_metrics` on its ``--metrics-port``.

* :class:`SchedulerMetrics` is an :class:`engine.metrics.EngineObserver`: pass it to ``Engine(observer=...)``
  and call :meth:`SchedulerMetrics.watch` with ``engine.stats`` so that queue, running and KV gauges are read
  at scrape time.
* :class:`ExecutorMetrics` records each executed step (:meth:`ExecutorMetrics.track_step` on the future that
  ``runner.launch`` returns) and reads the live per-request buffer count.
* :class:`GrammarMetrics` is an :class:`engine.grammar.EnforcementObserver` of the grammar registry: JSON-schema
  requests by mode, their keywords by who enforces them (the grammar, the output check, nobody in loose mode), and
  the violations checked mode finds, by keyword.

Names follow Prometheus conventions: base units (seconds), ``_total`` only on counters. Tokens per second is
``rate(ordinal_generation_tokens_total[1m])``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.grammar import Enforcement, JsonSchemaMode, Violation
from engine.metrics import RequestFinished, StepCommitted, prefix_hit_rate
from engine.scheduler import SchedulerStats
from engine.step import StepPlan, StepResult

# Bucket bounds in seconds. Wide on purpose: the same binary serves a tiny CPU model (sub-millisecond steps) and
# large GPU models behind long queues (tens of seconds to the first token).
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

StatsSource = Callable[[], SchedulerStats]


class SchedulerMetrics:
    """The scheduler's metrics: an engine observer plus gauges read from ``Engine.stats()`` at scrape time."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._requests = Counter("ordinal_requests", "Requests accepted by the engine.", registry=r)
        self._finished = Counter(
            "ordinal_requests_finished", "Requests finished, by finish reason.", ["reason"], registry=r
        )
        self._aborted = Counter(
            "ordinal_requests_aborted", "Aborted requests, by who ended them.", ["cause"], registry=r
        )
        self._prompt_tokens = Counter("ordinal_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self._generation_tokens = Counter(
            "ordinal_generation_tokens", "Output tokens committed (rate() of this is tokens per second).", registry=r
        )
        self._ttft = Histogram(
            "ordinal_time_to_first_token_seconds",
            "From submit to the first committed output token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._tpot = Histogram(
            "ordinal_time_per_output_token_seconds",
            "Time between a request's output tokens after the first (inter-token latency).",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self._latency = Histogram(
            "ordinal_request_latency_seconds",
            "From submit to the final output, whatever the finish reason.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._step = Histogram(
            "ordinal_step_seconds",
            "Loop time per committed step (from launch, or the previous commit under overlap, to commit).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._forward = Histogram(
            "ordinal_step_forward_seconds",
            "Forward and sampling time per step, as the executor measured it.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._step_tokens = Histogram(
            "ordinal_step_tokens", "Tokens (prefill and decode) per step.", buckets=STEP_TOKEN_BUCKETS, registry=r
        )
        self._prefill_step_tokens = Counter(
            "ordinal_step_prefill_tokens", "Prompt tokens run through the model in committed steps.", registry=r
        )

    def watch(self, stats: StatsSource) -> None:
        """Read queue, running and KV gauges from ``stats`` (typically ``engine.stats``) on every scrape."""
        self.registry.register(_StatsCollector(stats))

    # ------------------------------------------------------------ EngineObserver

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        self._requests.inc()
        self._prompt_tokens.inc(num_prompt_tokens)

    def first_token(self, request_id: str, num_tokens: int, seconds: float) -> None:
        self._ttft.observe(seconds)
        self._generation_tokens.inc(num_tokens)

    def output_tokens(self, request_id: str, num_tokens: int, seconds: float) -> None:
        self._generation_tokens.inc(num_tokens)
        per_token = seconds / num_tokens
        for _ in range(num_tokens):  # a multi-token commit (speculative) counts each of its tokens
            self._tpot.observe(per_token)

    def request_finished(self, event: RequestFinished) -> None:
        self._finished.labels(reason=event.reason.value).inc()
        if event.abort_cause is not None:
            self._aborted.labels(cause=event.abort_cause.value).inc()
        self._latency.observe(event.latency_seconds)

    def step_committed(self, event: StepCommitted) -> None:
        self._step.observe(event.seconds)
        self._forward.observe(event.forward_seconds)
        self._step_tokens.observe(event.num_tokens)
        self._prefill_step_tokens.inc(event.num_prefill_tokens)


class _StatsCollector(Collector):
    """Gauges (and the engine's own cumulative counters) read from a stats snapshot at scrape time."""

    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        yield _gauge("ordinal_requests_waiting", "Requests queued, not yet admitted.", s.num_waiting)
        yield _gauge("ordinal_requests_running", "Requests admitted (prefilling or decoding).", s.num_running)
        pages = GaugeMetricFamily(
            "ordinal_kv_pages",
            "KV pages by state: used (held by requests), free, evictable (prefix cache only), reserved.",
            labels=["state"],
        )
        pages.add_metric(["used"], s.used_pages)
        pages.add_metric(["free"], s.free_pages)
        pages.add_metric(["evictable"], s.evictable_pages)
        pages.add_metric(["reserved"], s.reserved_pages)
        yield pages
        yield _gauge("ordinal_kv_pages_capacity", "KV pages in the pool.", s.total_pages)
        usage = s.used_pages / s.total_pages if s.total_pages else 0.0
        yield _gauge("ordinal_kv_usage_ratio", "Fraction of KV pages held by requests.", usage)
        yield _gauge("ordinal_request_slots_free", "Request slots free (of max running).", s.free_slots)
        yield _gauge("ordinal_steps_in_flight", "Steps launched and not yet committed.", s.inflight_steps)
        yield _gauge(
            "ordinal_prefix_cache_hit_rate",
            "Fraction of admitted prompt tokens served from the prefix cache (since start).",
            prefix_hit_rate(s),
        )
        yield CounterMetricFamily(
            "ordinal_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", s.cached_prompt_tokens
        )
        yield CounterMetricFamily("ordinal_prefill_tokens", "Prompt tokens planned for prefill.", s.prefill_tokens)
        yield CounterMetricFamily("ordinal_steps", "Steps planned.", s.steps)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class ExecutorMetrics:
    """The executor's metrics: time and size of each executed step, and live per-request buffers."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._step = Histogram(
            "ordinal_executor_step_seconds",
            "Forward and sampling time per executed step.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._tokens = Counter("ordinal_executor_tokens", "Tokens run through the model.", registry=r)
        self._samples = Counter("ordinal_executor_samples", "Tokens sampled.", registry=r)
        self._buffers = Gauge(
            "ordinal_executor_buffers_alive", "Per-request buffers (sampling state) held now.", registry=r
        )

    def step_executed(self, seconds: float, num_tokens: int, num_samples: int) -> None:
        """Record one executed step: ``seconds`` is the executor's time for it (``StepTiming.done``)."""
        self._step.observe(seconds)
        self._tokens.inc(num_tokens)
        self._samples.inc(num_samples)

    def track_step(self, plan: StepPlan, future: Future[StepResult]) -> None:
        """Record ``plan`` once its launched ``future`` succeeds (a failed step is not a step executed)."""

        def done(f: Future[StepResult]) -> None:
            if not f.cancelled() and f.exception() is None:
                result = f.result()
                self.step_executed(result.timing.done, plan.num_tokens, sum(len(r.token_ids) for r in result.runs))

        future.add_done_callback(done)

    def watch_buffers(self, count: Callable[[], int]) -> None:
        """Read the buffer gauge from ``count`` (typically ``lambda: runner.num_buffers``) on every scrape."""
        self._buffers.set_function(lambda: float(count()))


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


@dataclass(frozen=True)
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint. ``close`` stops it."""

    host: str
    port: int
    _server: WSGIServer

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> MetricsServer | None:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread; ``port`` 0 disables it (None)."""
    if port == 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host, server.server_port, server)
