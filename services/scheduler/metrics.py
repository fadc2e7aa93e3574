"""The scheduler's Prometheus metrics: an engine observer plus gauges read from ``Engine.stats()`` at scrape time.

:class:`SchedulerMetrics` is an :class:`engine.scheduler.metrics.EngineObserver`: pass it to ``Engine(observer=...)``
and call :meth:`SchedulerMetrics.watch` with ``engine.stats`` so that queue, running and KV gauges are read at scrape
time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.scheduler.metrics import RequestFinished, StepCommitted, prefix_hit_rate
from engine.scheduler.scheduler import SchedulerStats
from services.metrics import LATENCY_BUCKETS, STEP_BUCKETS, STEP_TOKEN_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS

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
        yield CounterMetricFamily(
            "ordinal_spec_verify_steps", "Speculative verifies (a request's decode with a draft).", s.spec.verify_steps
        )
        yield CounterMetricFamily("ordinal_spec_draft_tokens", "Draft tokens verified.", s.spec.draft_tokens)
        yield CounterMetricFamily("ordinal_spec_accepted_tokens", "Draft tokens accepted.", s.spec.accepted_tokens)
        yield _gauge(
            "ordinal_spec_accept_length",
            "Tokens per speculative verify: accepted drafts plus the sampled one (since start; 0 before any).",
            s.spec.accept_length,
        )
        yield _gauge(
            "ordinal_spec_accept_rate", "Accepted draft tokens per draft token (since start).", s.spec.accept_rate
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
