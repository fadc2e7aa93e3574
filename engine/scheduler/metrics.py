"""Engine observability: the hooks the engine loop calls, and the bookkeeping that turns loop events into them.

The engine knows nothing about Prometheus (or any exporter): it reports events to an :class:`EngineObserver`.
:class:`RequestTimeline` sits between the loop and the observer. It keeps the few timestamps needed to turn raw
events (a request submitted, a step launched, a step committed, an output delivered) into latencies: time to
first token, time per output token, request latency and step time. Gauges (queue length, pages, ...) are not
pushed: an exporter reads ``Engine.stats()`` when it is scraped, so an idle engine costs nothing.

Observer hooks run on the engine's loop thread (``request_added`` on the submitting thread): they must be cheap
and must not call back into the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.finish import AbortCause, FinishReason
from engine.scheduler.request import RequestOutput
from engine.scheduler.scheduler import SchedulerStats
from engine.step import StepPlan, StepResult

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True)
class RequestFinished:
    """A request's end, as an observer sees it. ``latency_seconds`` runs from submit to the final output."""

    request_id: str
    reason: FinishReason
    abort_cause: AbortCause | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    latency_seconds: float


@dataclass(frozen=True)
class StepCommitted:
    """One committed step.

    ``seconds`` is the step's share of the loop's wall time: from its launch, or from the previous commit if
    that came later (under overlap a step is launched before its predecessor is committed), to its commit.
    Summed over a busy period it is the busy time, so ``1 / seconds`` is the step rate. ``forward_seconds`` is
    what the executor measured for the forward and sampling alone.
    """

    step_id: int
    num_requests: int
    num_tokens: int
    num_prefill_tokens: int
    num_samples: int
    seconds: float
    forward_seconds: float


class EngineObserver(Protocol):
    """What the engine reports. Implementations must be thread-safe and cheap (see the module docstring)."""

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None: ...

    def first_token(self, request_id: str, num_tokens: int, seconds: float) -> None:
        """The first ``num_tokens`` output tokens were committed ``seconds`` after submit (time to first token)."""
        ...

    def output_tokens(self, request_id: str, num_tokens: int, seconds: float) -> None:
        """``num_tokens`` more output tokens were committed ``seconds`` after the request's previous ones."""
        ...

    def request_finished(self, event: RequestFinished) -> None: ...

    def step_committed(self, event: StepCommitted) -> None: ...


class NullObserver:
    """The default observer: records nothing."""

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        pass

    def first_token(self, request_id: str, num_tokens: int, seconds: float) -> None:
        pass

    def output_tokens(self, request_id: str, num_tokens: int, seconds: float) -> None:
        pass

    def request_finished(self, event: RequestFinished) -> None:
        pass

    def step_committed(self, event: StepCommitted) -> None:
        pass


@dataclass
class _Times:
    submitted: float
    last_output: float | None = None


class RequestTimeline:
    """Turns the engine loop's events into observer calls with latencies.

    Thread-safe: ``added`` runs on the submitting thread, everything else on the loop thread. An observer that
    raises is logged, never propagated: metrics must not take the engine loop down.
    """

    def __init__(self, observer: EngineObserver, clock: Clock = time.perf_counter) -> None:
        self._observer = observer
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, _Times] = {}
        self._launched: dict[int, float] = {}
        self._last_commit = float("-inf")

    def added(self, request_id: str, num_prompt_tokens: int) -> None:
        with self._lock:
            self._requests[request_id] = _Times(submitted=self._clock())
        self._notify(self._observer.request_added, request_id, num_prompt_tokens)

    def step_launched(self, plan: StepPlan) -> None:
        with self._lock:
            self._launched[plan.step_id] = self._clock()

    def step_committed(self, plan: StepPlan, result: StepResult) -> None:
        now = self._clock()
        with self._lock:
            # Steps commit in launch order; a step that failed or was dropped is never committed, so forget every
            # launch up to this one rather than keep a stale entry.
            launched = self._launched.pop(plan.step_id, now)
            for step_id in [s for s in self._launched if s < plan.step_id]:
                del self._launched[step_id]
            started = max(launched, self._last_commit)
            self._last_commit = now
        prefill = sum(e.num_tokens for e in plan.entries if e.is_prefill)
        self._notify(
            self._observer.step_committed,
            StepCommitted(
                step_id=plan.step_id,
                num_requests=len(plan.entries),
                num_tokens=plan.num_tokens,
                num_prefill_tokens=prefill,
                num_samples=sum(len(r.token_ids) for r in result.runs),
                seconds=now - started,
                forward_seconds=result.timing.done,
            ),
        )

    def output(self, out: RequestOutput) -> None:
        now = self._clock()
        with self._lock:
            times = self._requests.pop(out.request_id, None) if out.finished else self._requests.get(out.request_id)
            if times is None:
                return  # submitted before this timeline existed, or already finished
            previous = times.last_output
            if out.new_token_ids:
                times.last_output = now
        if out.new_token_ids:
            if previous is None:
                self._notify(self._observer.first_token, out.request_id, len(out.new_token_ids), now - times.submitted)
            else:
                self._notify(self._observer.output_tokens, out.request_id, len(out.new_token_ids), now - previous)
        if out.finish is not None:
            self._notify(
                self._observer.request_finished,
                RequestFinished(
                    request_id=out.request_id,
                    reason=out.finish.reason,
                    abort_cause=out.finish.cause,
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_output_tokens=out.num_output_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    latency_seconds=now - times.submitted,
                ),
            )

    @staticmethod
    def _notify(hook: Callable[..., None], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            log.exception("metrics observer %s failed (ignored)", getattr(hook, "__qualname__", hook))


def prefix_hit_rate(stats: SchedulerStats) -> float:
    """Fraction of admitted prompt tokens served from the prefix cache instead of being prefilled (0 when none)."""
    total = stats.cached_prompt_tokens + stats.prefill_tokens
    return stats.cached_prompt_tokens / total if total else 0.0
