"""The split engine with a step gate in the middle, and the checks the abort contract tests share.

    Engine (scheduler) ──RemoteRunner──▶ StepGate (services/gate.py) ──▶ executor service ──▶ ModelRunner

Everything is real: the engine, its scheduler and RemoteRunner, the executor service and its ModelRunner on the
embedded model. The gate only holds and releases messages in order. The checks:

- ``Stream`` records what the engine streamed for one request (on the loop thread) and lets a test wait, bounded,
  for a number of tokens or the finish.
- ``mark_abort`` aborts and records how far the request could legitimately have got when the abort was issued;
  ``assert_abort_honoured`` then checks C7 (no token from a result that reached the scheduler after the abort) and
  C8 (no step planned after the abort was recorded names the request).
- ``Baseline``/``assert_back_to`` check C9 after a drain: free KV pages, slots, reservations, executor buffers and
  open matchers equal their baseline, and the prefix cache's invariants hold.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.constraint import Constraint
from engine.finish import AbortCause, FinishReason
from engine.grammar.backend import LocalGrammar
from engine.grammar_calls import CommitEntry, CommitOutcome, GrammarBackend
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from engine.scheduler.metrics import EngineObserver, NullObserver, RequestFinished, StepCommitted
from engine.scheduler.request import RequestOutput
from services.remote_runner import RemoteRunner
from tests.support.gate import StepGate, entries_of
from tests.support.grammar_doubles import DelegatingGrammar

WAIT_S = 30.0


def greedy(max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, stop_token_ids=stop_token_ids
    )


# ---------------------------------------------------------------------------------------------------- recording


@dataclass
class Stream:
    """What the engine streamed for one request, in order. ``sink`` runs on the engine's loop thread."""

    request_id: str
    outputs: list[RequestOutput] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    on_output: Callable[[RequestOutput], None] | None = None

    def sink(self, out: RequestOutput) -> None:
        if self.on_output is not None:
            self.on_output(out)
        with self.cond:
            self.outputs.append(out)
            self.cond.notify_all()

    @property
    def tokens(self) -> list[int]:
        with self.cond:
            return [t for out in self.outputs for t in out.new_token_ids]

    @property
    def finished(self) -> bool:
        with self.cond:
            return bool(self.outputs) and self.outputs[-1].finished

    def wait_tokens(self, n: int, timeout: float = WAIT_S) -> list[int]:
        with self.cond:
            ok = self.cond.wait_for(lambda: sum(len(o.new_token_ids) for o in self.outputs) >= n, timeout)
        assert ok, f"{self.request_id}: {n} tokens not streamed within {timeout} s; got {self.outputs}"
        return self.tokens

    def wait_final(self, timeout: float = WAIT_S) -> RequestOutput:
        with self.cond:
            ok = self.cond.wait_for(lambda: bool(self.outputs) and self.outputs[-1].finished, timeout)
            assert ok, f"{self.request_id} did not finish within {timeout} s; got {self.outputs}"
            final = self.outputs[-1]
            assert sum(o.finished for o in self.outputs) == 1, f"{self.request_id} finished twice: {self.outputs}"
        return final

    def assert_aborted(self, num_tokens: int) -> None:
        """The stream ended with a client abort after exactly ``num_tokens`` tokens, and said so consistently."""
        final = self.wait_final()
        assert final.finish is not None and final.finish.reason is FinishReason.ABORT, final
        assert final.finish.cause is AbortCause.CLIENT, final
        assert len(self.tokens) == num_tokens, (self.tokens, final)
        assert final.output_ids == tuple(self.tokens) and final.num_output_tokens == num_tokens, final


def submit(
    engine: Engine, rid: str, prompt: Sequence[int], params: SamplingParams, constraint: Constraint | None = None
) -> Stream:
    stream = Stream(rid)
    engine.submit(prompt, params, stream.sink, rid, constraint)
    return stream


class EngineEvents(NullObserver):
    """An engine observer (the metrics hook, called on the loop thread) that records every request's end and every
    committed step, for tests that cannot see the engine's outputs directly (they stream through the scheduler
    service) or must wait until the loop has taken a result in."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.finished: dict[str, RequestFinished] = {}
        self.committed: set[int] = set()
        self.tokens: Counter[str] = Counter()  # output tokens committed, per request

    def first_token(self, request_id: str, num_tokens: int, seconds: float) -> None:
        self.output_tokens(request_id, num_tokens, seconds)

    def output_tokens(self, request_id: str, num_tokens: int, seconds: float) -> None:
        with self._cond:
            self.tokens[request_id] += num_tokens
            self._cond.notify_all()

    def wait_tokens(self, rid: str, n: int, timeout: float = WAIT_S) -> None:
        """Until the engine committed at least ``n`` output tokens of ``rid`` (streamed or not)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.tokens[rid] >= n, timeout)
            assert ok, f"{rid}: {n} tokens not committed within {timeout} s (got {self.tokens[rid]})"

    def request_finished(self, event: RequestFinished) -> None:
        with self._cond:
            assert event.request_id not in self.finished, f"{event.request_id} finished twice"
            self.finished[event.request_id] = event
            self._cond.notify_all()

    def step_committed(self, event: StepCommitted) -> None:
        with self._cond:
            self.committed.add(event.step_id)
            self._cond.notify_all()

    def wait_finished(self, rid: str, timeout: float = WAIT_S) -> RequestFinished:
        with self._cond:
            assert self._cond.wait_for(lambda: rid in self.finished, timeout), f"{rid} never finished"
            return self.finished[rid]

    def wait_committed(self, step_id: int, timeout: float = WAIT_S) -> None:
        """Until the scheduler committed (or dropped) step ``step_id``'s result; its outputs follow at once."""
        with self._cond:
            assert self._cond.wait_for(lambda: step_id in self.committed, timeout), f"step {step_id} never committed"


class WatchedEngine(Engine):
    """The real Engine; additionally records every ``abort`` call (and what it returned), so that a test can wait
    until a service on another thread has issued one. Behaviour is unchanged."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.abort_calls: list[tuple[str, bool]] = []
        self._abort_cond = threading.Condition()

    def abort(self, request_id: str, message: str = "aborted by client", cause: AbortCause = AbortCause.CLIENT) -> bool:
        live = super().abort(request_id, message, cause)
        with self._abort_cond:
            self.abort_calls.append((request_id, live))
            self._abort_cond.notify_all()
        return live

    def wait_abort_call(self, rid: str, timeout: float = WAIT_S) -> bool:
        """Wait until ``abort(rid)`` was called; returns what it returned."""
        with self._abort_cond:
            ok = self._abort_cond.wait_for(lambda: any(r == rid for r, _ in self.abort_calls), timeout)
            assert ok, f"abort({rid!r}) was never called"
            return next(live for r, live in self.abort_calls if r == rid)


class GrammarProbe(DelegatingGrammar[LocalGrammar]):
    """A grammar backend delegating every call to a real one (a shared :class:`LocalGrammar`, which the engine then
    does not shut down). It records every commit, so a test can see what reached a request's grammar state (C7), and
    with ``hold_open`` its ``open`` (the compile) waits until the test sets ``proceed``; ``opening`` is set when a
    compile started. After :meth:`hold_commits` a commit waits (as one to a wedged grammar service would) until the
    test sets ``proceed_commits``; ``committing`` is set once a commit is waiting."""

    def __init__(self, inner: LocalGrammar, hold_open: bool = False) -> None:
        super().__init__(inner)
        self.opening = threading.Event()
        self.proceed = threading.Event()
        if not hold_open:
            self.proceed.set()
        self.committing = threading.Event()
        self.proceed_commits = threading.Event()
        self.proceed_commits.set()
        self._lock = threading.Lock()
        self._commits: list[CommitEntry] = []

    def hold_commits(self) -> None:
        self.committing.clear()
        self.proceed_commits.clear()

    def open(self, request_id: str, constraint: Constraint) -> int:
        self.opening.set()
        if not self.proceed.wait(WAIT_S):
            raise TimeoutError("the test never let the grammar compile proceed")
        return self.inner.open(request_id, constraint)

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        if not self.proceed_commits.is_set():
            self.committing.set()
            if not self.proceed_commits.wait(WAIT_S):
                raise TimeoutError("the test never let the held grammar commit proceed")
        with self._lock:
            self._commits.extend(entries)
        return self.inner.commit(entries)

    def committed(self, request_id: str) -> list[tuple[int, tuple[int, ...]]]:
        """(from ordinal, tokens) of every commit of ``request_id``'s grammar, in order."""
        with self._lock:
            return [(c.from_ordinal, c.tokens) for c in self._commits if c.request_id == request_id]


# ---------------------------------------------------------------------------------------------------- the stack


@contextmanager
def gated_engine(
    executor_target: str,
    config: EngineConfig,
    grammar: GrammarBackend | None = None,
    observer: EngineObserver | None = None,
    engine_type: type[Engine] = Engine,
) -> Iterator[tuple[Engine, StepGate]]:
    """A fresh gate in front of the executor and a fresh engine behind it; torn down with everything released
    (a test that failed midway must not leave the executor's single session stuck behind a held message)."""
    gate = StepGate(executor_target, wait_s=WAIT_S)
    try:
        engine = engine_type(config, RemoteRunner.connect(gate.target, timeout=WAIT_S), observer, grammar)
        try:
            yield engine, gate
        finally:
            gate.release_all()
            engine.shutdown()
    finally:
        gate.stop()


class WritePause:
    """The servicer's ``before_write`` hook: lets the first ``after`` stream messages of request ``rid`` through,
    then holds the next one until :meth:`release` (the event loop serves other RPCs meanwhile)."""

    def __init__(self, rid: str, after: int) -> None:
        self.rid = rid
        self.after = after
        self.writes = 0
        self.paused = threading.Event()
        self._go = threading.Event()

    async def __call__(self, rid: str) -> None:
        if rid != self.rid:
            return
        self.writes += 1
        if self.writes > self.after and not self._go.is_set():
            self.paused.set()
            assert await asyncio.to_thread(self._go.wait, WAIT_S), "the test never released the paused write"

    def release(self) -> None:
        self._go.set()

    @property
    def released(self) -> bool:
        return self._go.is_set()


# ---------------------------------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class AbortMark:
    """An abort and what had happened when it was issued (read *after* the abort call returned).

    ``last_planned``: the newest step id the scheduler had planned. The engine drains its inbox before every plan
    and every commit, so at most one more plan (``last_planned + 1``) can be built before the abort is recorded;
    any later step naming the request breaks C8. ``sampled``: ordinals of the request whose results had already
    passed the gate back to the scheduler; a result passing later reaches a commit only after the abort is in the
    inbox, so it must be dropped (C7): at most ``max(sampled) + 1`` tokens may ever be streamed."""

    request_id: str
    live: bool
    last_planned: int
    sampled: frozenset[int]

    @property
    def max_tokens(self) -> int:
        return max(self.sampled, default=-1) + 1


def mark_abort(engine: Engine, gate: StepGate, rid: str) -> AbortMark:
    live = engine.abort(rid)
    last = engine.stats().steps
    sampled = frozenset(
        o
        for s in gate.returned_steps()
        if s.result is not None
        for run in s.result.runs
        if run.request_id == rid
        for o in range(run.ordinal, run.end_ordinal)
    )
    return AbortMark(rid, live, last, sampled)


def assert_watermark(engine: Engine, prompt_len: int, num_tokens: int, page_size: int) -> None:
    """C7/C11 for a lone aborted request on a fresh engine: after the drain the prefix cache holds exactly the full
    pages below its KV watermark, which covers the prompt and every committed token but the last (whose KV no
    retired step wrote). A dropped result that moved the watermark anyway shows up as one page more when the held
    step would have completed a page."""
    assert engine.wait_idle(WAIT_S), "the engine did not drain"
    assert engine.stats().evictable_pages == (prompt_len + num_tokens - 1) // page_size, engine.stats()


def steps_naming(gate: StepGate, rid: str) -> list[int]:
    return [p.step_id for p in gate.launched_steps() if any(e.request_id == rid for e in p.entries)]


def assert_one_tick_lag(engine: Engine, gate: StepGate, rid: str) -> None:
    """C9 at the executor: the Release that frees ``rid``'s slot is sent only after the reply of every step naming
    ``rid`` went back to the scheduler (the gate's trace is one global forwarding order). Waits for the drain
    first: an idle engine has had every release answered."""
    assert engine.wait_idle(WAIT_S), "the engine did not drain"
    named = entries_of(gate.launched_steps(), rid)
    if not named:
        return
    slot = named[0][1].slot
    trace = gate.trace()
    first = next(i for i, ev in enumerate(trace) if ev.kind == "plan" and ev.step_id == named[0][0])
    release = next((i for i, ev in enumerate(trace) if i > first and ev.kind == "release" and slot in ev.slots), None)
    assert release is not None, f"{rid}'s slot {slot} was never released at the executor"
    for sid, _ in named:
        answer = next(i for i, ev in enumerate(trace) if ev.kind in ("result", "error") and ev.step_id == sid)
        assert answer < release, f"C9: slot {slot} of {rid} released before step {sid} retired: {trace}"


def assert_not_planned_after(engine: Engine, gate: StepGate, rid: str, last_planned: int) -> None:
    """C8: once the engine drained, no step after ``last_planned + 1`` names ``rid`` (see :class:`AbortMark`)."""
    assert engine.wait_idle(WAIT_S), "the engine did not drain"
    late = [s for s in steps_naming(gate, rid) if s > last_planned + 1]
    assert not late, f"C8: {rid} was planned into steps {late} after its abort (last planned before: {last_planned})"


def assert_abort_honoured(mark: AbortMark, stream: Stream, engine: Engine, gate: StepGate) -> None:
    """C7 and C8 for an abort issued at any moment (see :class:`AbortMark`), checked after the drain."""
    final = stream.wait_final()
    assert final.finish is not None
    assert_not_planned_after(engine, gate, mark.request_id, mark.last_planned)
    assert len(stream.tokens) <= mark.max_tokens, f"C7: tokens committed after the abort: {stream.outputs} ({mark})"
    if final.finish.reason is FinishReason.ABORT:
        assert final.output_ids == tuple(stream.tokens), final


@dataclass(frozen=True)
class Baseline:
    """What a drained engine holds: everything a request may take, and must give back (C9)."""

    free_or_evictable_pages: int
    free_slots: int
    reserved_pages: int
    executor_buffers: int
    open_matchers: int


def baseline(engine: Engine, gate: StepGate) -> Baseline:
    assert engine.wait_idle(WAIT_S), "the engine did not drain"
    s = engine.stats()
    matchers = engine.grammar.num_open if engine.grammar is not None else 0
    return Baseline(
        s.free_pages + s.evictable_pages, s.free_slots, s.reserved_pages, gate.executor_state().buffers, matchers
    )


def assert_back_to(before: Baseline, engine: Engine, gate: StepGate) -> None:
    """C9: after the drain everything is back; the allocator and prefix cache agree with each other."""
    after = baseline(engine, gate)
    assert after == before, f"leaked: before {before}, after {after}, stats {engine.stats()}"
    s = engine.stats()
    assert s.num_waiting == s.num_running == s.inflight_steps == 0 and s.used_pages == 0, s
    assert s.free_pages + s.evictable_pages + s.used_pages == s.total_pages, s
    engine.scheduler.check_invariants()  # read from this thread: a drained loop changes nothing


def solo_outputs(engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[list[int]]:
    """Each prompt run alone (one at a time) to completion: the outputs a greedy request must reproduce."""
    outs = []
    for prompt, p in zip(prompts, params, strict=True):
        (final,) = engine.generate_batch([prompt], [p], timeout=WAIT_S)
        assert final.finish is not None and final.finish.reason is FinishReason.LENGTH, final
        outs.append(list(final.output_ids or ()))
    return outs
