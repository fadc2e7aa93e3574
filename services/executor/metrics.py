"""The executor's Prometheus metrics: time and size of each executed step, its wait for grammar masks, drafting, and
live per-request buffers.

:class:`ExecutorMetrics` records each executed step (:meth:`ExecutorMetrics.track_step` on the future that
``runner.launch`` returns) and reads the live per-request buffer count.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.step import StepPlan, StepResult
from services.metrics import MASK_WAIT_BUCKETS, STEP_BUCKETS


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
        self._draft = Histogram(
            "ordinal_executor_draft_seconds",
            "Speculative proposer time per step that drafted.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._mask_wait = Histogram(
            "ordinal_executor_mask_wait_seconds",
            "Per step with a constrained row, how long sampling waited for the grammar masks after the forward.",
            buckets=MASK_WAIT_BUCKETS,
            registry=r,
        )
        self._drafted = Counter("ordinal_executor_spec_draft_tokens", "Draft tokens verified.", registry=r)
        self._accepted = Counter("ordinal_executor_spec_accepted_tokens", "Draft tokens accepted.", registry=r)
        self._buffers = Gauge(
            "ordinal_executor_buffers_alive", "Per-request buffers (sampling state) held now.", registry=r
        )

    def step_executed(self, seconds: float, num_tokens: int, num_samples: int) -> None:
        """Record one executed step: ``seconds`` is the executor's time for it (``StepTiming.done``)."""
        self._step.observe(seconds)
        self._tokens.inc(num_tokens)
        self._samples.inc(num_samples)

    def speculated(self, result: StepResult) -> None:
        """Record a step's drafting: the proposer's time, the draft tokens verified and accepted."""
        drafted = sum(r.num_drafted for r in result.runs)
        if drafted:
            self._draft.observe(result.timing.draft_seconds)
            self._drafted.inc(drafted)
            self._accepted.inc(sum(r.num_accepted for r in result.runs))

    def track_step(self, plan: StepPlan, future: Future[StepResult]) -> None:
        """Record ``plan`` once its launched ``future`` succeeds (a failed step is not a step executed)."""

        def done(f: Future[StepResult]) -> None:
            if not f.cancelled() and f.exception() is None:
                result = f.result()
                self.step_executed(result.timing.done, plan.num_tokens, sum(len(r.token_ids) for r in result.runs))
                self.speculated(result)
                if (waited := result.timing.mask_wait_seconds) is not None:
                    self._mask_wait.observe(waited)

        future.add_done_callback(done)

    def watch_buffers(self, count: Callable[[], int]) -> None:
        """Read the buffer gauge from ``count`` (typically ``lambda: runner.num_buffers``) on every scrape."""
        self._buffers.set_function(lambda: float(count()))
