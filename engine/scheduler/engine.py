"""The in-process engine: submit token ids with sampling params, get a stream of outputs; abort by id.

One loop thread drives the scheduler; the runner executes steps on its own worker thread. The overlapped
loop and the plain loop are the same steps in another order:

    overlap:  plan N+1, launch N+1, commit N    (the forward of N+1 runs while N is committed)
    plain:    plan N,   launch N,   commit N

Only the loop thread touches the scheduler, and no lock guards it: the loop may wait on the executor or the
grammar service for as long as they take, and nothing another thread calls (``submit``, ``abort``, ``stats``) ever
waits for the loop. Those calls hand messages to the loop through a queue and read state the loop publishes
(a :class:`SchedulerStats` snapshot, replaced whole after every scheduler event), so a service's event loop that
calls them never stalls behind a wedged executor or grammar service.

When the executor or the grammar service is lost, only the requests that needed it end (UNAVAILABLE); the loop
goes on, and requests wait a bounded time for the service to come back (engine/scheduler/outages.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.constraint import Constraint
from engine.errors import ExecutorUnavailableError, InvalidRequestError
from engine.finish import AbortCause, Finish, FinishReason
from engine.grammar_calls import CommitEntry, GrammarBackend, GrammarUnavailableError
from engine.grammar_calls import CommitOutcome as GrammarCommitOutcome
from engine.model.folder import model_dir
from engine.model.tokenizer import Tokenizer
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from engine.scheduler.metrics import EngineObserver, NullObserver, RequestTimeline
from engine.scheduler.outages import ExecutorOutage, GrammarSessions
from engine.scheduler.request import Request, RequestOutput
from engine.scheduler.scheduler import CommitOutcome, Scheduler, SchedulerStats, pages_for
from engine.scheduler.stop import StopChecker
from engine.step import StepPlan, StepResult, StepRunner

log = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]

_GRAMMAR_RETRY_S = 0.25  # between two opens of a grammar while the grammar service is unavailable


@dataclass(frozen=True)
class _Add:
    request: Request
    sink: OutputSink


@dataclass(frozen=True)
class _Abort:
    request_id: str
    message: str
    cause: AbortCause


@dataclass(frozen=True)
class _Compiling:
    """A constrained request whose grammar is being compiled (off the loop); it is not in the scheduler yet."""

    request_id: str
    sink: OutputSink


@dataclass(frozen=True)
class _Opened:
    """Its grammar compiled and opened in grammar session ``session`` (``error`` None), or failed to."""

    request: Request
    error: Exception | None
    session: int = 0


_Message = _Add | _Abort | _Compiling | _Opened


class Engine:
    """Loads a model (the embedded default when ``config.model_path`` is None) and serves requests."""

    def __init__(
        self,
        config: EngineConfig,
        runner: StepRunner | None = None,
        observer: EngineObserver | None = None,
        grammar: GrammarBackend | None = None,
        flush: Callable[[], None] | None = None,
    ) -> None:
        """``runner`` None loads the model in process, with an in-process grammar service unless ``grammar`` is
        given. With a remote runner, ``grammar`` is the grammar service the executor uses too (None: constrained
        requests are refused). ``flush`` is called on the loop thread after every scheduler event that publishes
        outputs or stats (a commit, an add, an abort): sinks that batch (a front end in another process) send what
        they hold then, one message per commit instead of one per output."""
        self.config = config
        self._flush = flush
        self._close_grammar: Callable[[], None] | None = None  # the grammar registry this engine built, if any
        if runner is None:
            runner, grammar, self._close_grammar = _in_process(config, grammar)
        self.grammar = grammar
        self.runner: StepRunner = runner
        self.info = self.runner.info
        if (self.info.page_size, self.info.num_pages) != (config.page_size, config.num_pages):
            raise ValueError(
                f"executor KV pool ({self.info.num_pages} pages of {self.info.page_size}) differs from the "
                f"scheduler's ({config.num_pages} pages of {config.page_size}): start both with the same flags"
            )
        self.tokenizer = Tokenizer.from_dir(self.info.model_path)
        self.scheduler = Scheduler(config)  # the loop thread's alone
        self._stats = self.scheduler.stats()  # replaced whole by the loop thread after every scheduler event
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        # Constrained ids compiling -> aborted meanwhile. Written by the loop thread only; a compile thread waiting for
        # the grammar service reads its own entry to stop waiting for an aborted request.
        self._opening: dict[str, bool] = {}
        self._compiler = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ordinal-grammar-open")
        self._wake = threading.Event()
        self._last_commit: float | None = None  # perf_counter of the last commit, None after an idle wait
        self._idle = threading.Event()
        self._stopping = False
        # Engine ids submitted and not yet finished. submit() adds with one setdefault (atomic under the GIL, so two
        # threads cannot both take an id); the loop thread removes.
        self._live: dict[str, object] = {}
        self._sinks: dict[str, OutputSink] = {}
        self._seeds = itertools.count()
        self._releases: list[Future[None]] = []
        self._inflight: deque[tuple[StepPlan, Future[StepResult]]] = deque()
        self._timeline = RequestTimeline(observer if observer is not None else NullObserver())
        self._executor_outage = ExecutorOutage(self.runner, config.outage_timeout_s)
        self._grammar_sessions = GrammarSessions(grammar)
        self._thread = threading.Thread(target=self._run_loop, name="ordinal-scheduler", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: OutputSink,
        request_id: str | None = None,
        constraint: Constraint | None = None,
        with_text: bool = True,
    ) -> str:
        """Validate and queue a request; ``sink`` is called on the loop thread with each output.

        ``with_text`` False: the outputs' ``text_delta`` stay empty (a caller that streams token ids saves the
        detokenization); stop strings are still matched on the text.

        Raises :class:`InvalidRequestError` (naming the field) before anything is allocated. A ``constraint`` is
        compiled off the loop before the request is queued; if it does not compile, the only output is a finish
        with cause INVALID_GRAMMAR carrying xgrammar's reason (no forward ever runs for it). While the grammar service
        is unavailable the open is retried until ``outage_timeout_s`` after this call, then the request ends with
        cause GRAMMAR_SERVICE.
        """
        if self._stopping:
            raise RuntimeError("the engine is shut down")
        if constraint is not None and self.grammar is None:
            raise InvalidRequestError("constraint", "this engine was started without a grammar service")
        rid = request_id or uuid.uuid4().hex
        request = self._validated_request(rid, prompt_ids, params, with_text)
        request.constraint = constraint
        claim = object()
        if self._live.setdefault(rid, claim) is not claim:
            raise InvalidRequestError("request_id", f"a request with id {rid!r} is already in flight")
        self._idle.clear()  # after the claim: see _wait_for_work
        self._timeline.added(rid, len(request.prompt_ids))
        if constraint is None:
            self._inbox.put(_Add(request, sink))
        else:
            self._inbox.put(_Compiling(rid, sink))  # before the compile starts: it can finish at once
            self._compiler.submit(self._open_grammar, request)
        self._wake.set()
        return rid

    def _open_grammar(self, request: Request) -> None:
        """Open the request's grammar (on a compile thread), retrying while the grammar service is unavailable until
        the request's outage deadline."""
        assert self.grammar is not None and request.constraint is not None
        deadline = request.queued_at + self.config.outage_timeout_s
        error: Exception | None = None
        session = 0
        while True:
            try:
                session = self.grammar.open(request.request_id, request.constraint)
                break
            except GrammarUnavailableError as exc:
                # An aborted request stops waiting (the loop marks it; a stale read costs one more retry at most).
                aborted = self._opening.get(request.request_id, False)
                if time.monotonic() + _GRAMMAR_RETRY_S > deadline or self._stopping or aborted:
                    error = exc
                    break
                time.sleep(_GRAMMAR_RETRY_S)
            except Exception as exc:
                error = exc
                break
        self._inbox.put(_Opened(request, error, session))
        self._wake.set()

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Async stream of outputs. Leaving the iteration early (or cancelling the task) aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        rid = self.submit(prompt_ids, params, sink, request_id, constraint)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid, "client cancelled the stream")

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        timeout: float = 600.0,
        constraints: Sequence[Constraint | None] | None = None,
    ) -> list[RequestOutput]:
        """Blocking helper: run every prompt to completion, return each final output in order."""
        done: list[Future[RequestOutput]] = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            fut: Future[RequestOutput] = Future()
            done.append(fut)
            self.submit(prompt, p, _finish_setter(fut), constraint=constraints[i] if constraints else None)
        return [f.result(timeout=timeout) for f in done]

    def abort(self, request_id: str, message: str = "aborted by client", cause: AbortCause = AbortCause.CLIENT) -> bool:
        """Record an abort; True if the request was in flight. Takes effect before any later commit (C7).

        Never waits: the abort is queued for the loop thread, which takes it in before its next plan and before
        committing any result (C7, C8), however long the step it is waiting for takes."""
        live = request_id in self._live
        if live:
            self._inbox.put(_Abort(request_id, message, cause))
            self._wake.set()
        return live

    def stats(self) -> SchedulerStats:
        """The scheduler's counters after its latest event (plan, commit, add, abort, release). Never waits."""
        return self._stats

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no request is live and no step is in flight (bounded)."""
        deadline = time.monotonic() + timeout
        while self._idle.wait(max(0.0, deadline - time.monotonic())):
            if not self._live:
                return True
            # The loop marked itself idle just as a submit claimed an id; it clears the mark at once.
            time.sleep(0.001)
        return False

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=60)
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self.runner.shutdown()
        if self._close_grammar is not None:
            self._close_grammar()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- validation

    def _validated_request(
        self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, with_text: bool = True
    ) -> Request:
        prompt = checked_prompt(prompt_ids, params, self.info, self.config)
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + next(self._seeds)
        decoder = self.tokenizer if with_text or params.stop else None
        checker = StopChecker(params, self.info.eos_token_ids, decoder)
        return Request(
            request_id=rid,
            prompt_ids=prompt,
            params=params,
            stop_checker=checker,
            seed=seed,
            queued_at=time.monotonic(),
        )

    # ---------------------------------------------------------------- the loop

    def _run_loop(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a bug in the loop: end every stream loudly instead of hanging clients
            log.exception("scheduler loop crashed")
            self._crashed(f"engine loop crashed: {exc!r}")

    def _crashed(self, message: str) -> None:
        self._stopping = True
        finish = Finish(FinishReason.ABORT, message=message, cause=AbortCause.INTERNAL)
        sinks, self._sinks = self._sinks, {}
        self._live.clear()
        for rid, sink in sinks.items():
            out = RequestOutput(rid, (), "", 0, 0, 0, finish=finish, output_ids=())
            self._timeline.output(out)
            sink(out)
        if self._flush is not None:
            self._flush()

    def _loop(self) -> None:
        inflight = self._inflight
        while not self._stopping:
            self._wake.clear()  # before draining: a submit after this point wakes the wait below
            self._drain_inbox()
            self._take_grammar_loss()
            if not inflight and (lost := self.runner.take_loss()) is not None:
                self._executor_lost(None, lost)  # lost while idle: handle it before planning anything new
            if not inflight and self._waiting_for_executor():
                continue
            if not self.config.grammar_overlap and any(e.constrained for p, _ in inflight for e in p.entries):
                # C4, early commit: the executor will not wait at the grammar fence, so a constrained result still
                # pending is committed before the next step is planned and launched (at launch none is pending).
                while inflight:
                    self._commit(*inflight.popleft())
            plan = self.scheduler.plan()
            if plan is not None:
                self._publish_stats()
                self._timeline.step_launched(plan)
                inflight.append((plan, self.runner.launch(plan)))
            # Overlap keeps the step just launched in flight while the one before it is committed.
            keep = 1 if self.config.overlap and plan is not None else 0
            committed = len(inflight) > keep
            while len(inflight) > keep:
                self._commit(*inflight.popleft())
            # A commit may leave work that could not be planned before it (a speculative step accepts fewer tokens
            # than the bound planned for it, so a request that looked complete needs another step): plan again first.
            if plan is None and not inflight and not committed:
                self._wait_for_work()
        while inflight:
            self._commit(*inflight.popleft())
        self._abort_all("engine shut down")

    def _commit(self, plan: StepPlan, future: Future[StepResult]) -> None:
        try:
            result = future.result()
        except ExecutorUnavailableError as exc:
            self._executor_lost(plan.step_id, str(exc))
            return
        except Exception as exc:  # the executor failed this step: end its requests, keep serving others
            log.exception("step %d failed", plan.step_id)
            self._deliver(self.scheduler.fail_step(plan.step_id, f"executor error: {exc}", AbortCause.INTERNAL))
            return
        self._drain_inbox()  # an abort recorded before this commit wins over its result (C7)
        # So does a grammar session's loss. A row without its mask may be the first sign of one: then ask the service.
        self._take_grammar_loss(verify=any(run.error is not None for run in result.runs))
        now = time.perf_counter()
        period, self._last_commit = (now - self._last_commit if self._last_commit is not None else None), now
        pending = self.scheduler.commit(result, period)
        outcome = self.scheduler.finish_commit(pending, self._commit_grammar(pending.grammar))
        self._timeline.step_committed(plan, result)
        self._deliver(outcome)

    def _commit_grammar(self, entries: list[CommitEntry]) -> list[GrammarCommitOutcome]:
        """The grammar service's half of a commit, between the scheduler's two phases (C1, C2). A failed call ends
        the constrained requests of this step (their grammar state is unknown now), never the loop."""
        if not entries:
            return []
        assert self.grammar is not None, "a constrained request reached an engine without a grammar service"
        try:
            return self.grammar.commit(entries)
        except Exception as exc:
            log.warning("grammar commit failed: %s", exc)
            return [GrammarCommitOutcome(None, None, f"the grammar service failed: {exc}") for _ in entries]

    def _executor_lost(self, step_id: int | None, reason: str) -> None:
        """The executor session ended: fail every step in flight, then every admitted request (their KV is gone).
        Queued requests wait for an executor to answer again (:meth:`_waiting_for_executor`)."""
        log.warning("executor unavailable (step %s): %s", step_id, reason)
        message = f"executor unavailable: {reason}"
        self._inflight.clear()
        outcome = self.scheduler.executor_lost(message)
        self._releases.clear()  # the lost session took its buffers with it
        self._executor_outage.lost()
        self._deliver(CommitOutcome(outputs=outcome.outputs, released_grammars=outcome.released_grammars))

    def _waiting_for_executor(self) -> bool:
        """While the executor is lost and requests wait, plan nothing until it answers (probed, bounded); end the
        queued requests whose outage timeout ran out. False when planning may go on."""
        if not self._executor_outage.down or not self.scheduler.stats().num_waiting:
            return False
        if self._executor_outage.back():
            log.info("the executor answers again: planning resumes")
            return False
        expiry = self._executor_outage.expiry()
        if expiry is not None:
            message = f"executor unavailable: it did not come back within {self.config.outage_timeout_s:g} s"
            self._deliver(self.scheduler.expire_queued(expiry, message, AbortCause.EXECUTOR))
        return True

    def _take_grammar_loss(self, verify: bool = False) -> None:
        """End every request whose grammar lived in a grammar session that ended (UNAVAILABLE); the others go on."""
        loss = self._grammar_sessions.take_loss(verify)
        if loss is None:
            return
        log.warning("grammar service lost (session %d): %s", loss.session, loss.reason)
        message = f"grammar service unavailable: {loss.reason}; this request's grammar state is gone"
        self._deliver(self.scheduler.grammar_lost(loss.session, message))

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, _Compiling):
                self._sinks[msg.request_id] = msg.sink
                self._opening[msg.request_id] = False
                continue
            if isinstance(msg, _Opened):
                self._opened(msg)
                continue
            if isinstance(msg, _Abort) and msg.request_id in self._opening:
                self._abort_opening(msg)
                continue
            if isinstance(msg, _Add):
                self._sinks[msg.request.request_id] = msg.sink
                outcome = self.scheduler.add(msg.request)
            else:
                outcome = self.scheduler.abort(msg.request_id, msg.message, msg.cause)
            self._deliver(outcome)

    def _abort_opening(self, msg: _Abort) -> None:
        """Abort while the grammar compiles: the stream ends now; the matcher is released once it exists."""
        if self._opening[msg.request_id]:
            return  # twice
        self._opening[msg.request_id] = True
        sink = self._sinks.pop(msg.request_id, None)
        out = RequestOutput(
            msg.request_id,
            (),
            "",
            0,
            0,
            0,
            finish=Finish(FinishReason.ABORT, message=msg.message, cause=msg.cause),
            output_ids=(),
        )
        self._timeline.output(out)
        if sink is not None:
            sink(out)
        if self._flush is not None:
            self._flush()

    def _opened(self, msg: _Opened) -> None:
        rid = msg.request.request_id
        aborted = self._opening.pop(rid)
        lost = msg.error is None and self._grammar_sessions.lost(msg.session)  # its session ended meanwhile
        if aborted:
            if msg.error is None and not lost and self.grammar is not None:
                self.grammar.release([rid])
            self._live.pop(rid, None)
            return
        if msg.error is not None or lost:
            finish = _open_failure(msg.error)
            out = RequestOutput(rid, (), "", 0, len(msg.request.prompt_ids), 0, finish=finish, output_ids=())
            self._deliver(CommitOutcome(outputs=[out]))
            return
        msg.request.grammar_session = msg.session
        self._deliver(self.scheduler.add(msg.request))

    def _publish_stats(self) -> None:
        self._stats = self.scheduler.stats()
        if self.config.check_invariants:
            self.scheduler.check_invariants()

    def _deliver(self, outcome: CommitOutcome) -> None:
        self._publish_stats()  # before any sink runs: a client told of a finish reads stats that include it
        if outcome.released_grammars and self.grammar is not None:
            try:
                self.grammar.release(outcome.released_grammars)
            except Exception as exc:  # the service is gone: so are its matchers
                log.warning("grammar release failed: %s", exc)
        if outcome.released_slots:
            for done in [f for f in self._releases if f.done()]:
                done.result()  # a failed release is a protocol bug: surface it
                self._releases.remove(done)
            self._releases.append(self.runner.release(outcome.released_slots))
        for out in outcome.outputs:
            self._timeline.output(out)
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
                self._live.pop(out.request_id, None)
            if sink is not None:
                sink(out)
        if self._flush is not None:
            self._flush()

    def _wait_for_work(self) -> None:
        self._last_commit = None  # the next step's period would count this wait
        if self.scheduler.idle and not self._live:
            for release in self._releases:
                release.result()  # buffers are back before anyone is told the engine is idle
            self._releases.clear()
            self._publish_stats()
            self._idle.set()
            # submit() claims its id before it clears the mark: a claim seen now came after the check above, and a
            # claim not seen yet clears the mark itself.
            if self._live:
                self._idle.clear()
        self._wake.wait(timeout=0.5)

    def _abort_all(self, message: str) -> None:
        for rid in tuple(self._live):
            self._inbox.put(_Abort(rid, message, AbortCause.SHUTDOWN))
        self._drain_inbox()


def checked_prompt(
    prompt_ids: Sequence[int], params: SamplingParams, info: ModelInfo, config: EngineConfig
) -> tuple[int, ...]:
    """The prompt as a tuple, once ``prompt_ids`` and ``params`` are known to fit ``info``'s model and ``config``'s
    KV pool; else :class:`InvalidRequestError` naming the field. Pure: a front end in another process runs the same
    check before anything is sent to the engine, so a bad request is refused there, before any resource is taken."""
    prompt = tuple(int(t) for t in prompt_ids)
    if not prompt:
        raise InvalidRequestError("input_ids", "must not be empty")
    vocab = info.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError("input_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
    params.validate(vocab)
    total = len(prompt) + params.max_new_tokens
    if total > info.max_context:
        raise InvalidRequestError(
            "max_new_tokens",
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} exceeds the "
            f"context length {info.max_context}",
        )
    need = pages_for(total - 1, config.page_size)
    if need > config.num_pages:
        raise InvalidRequestError(
            "max_new_tokens",
            f"the request needs {need} KV pages but the pool has {config.num_pages}; "
            "lower max_new_tokens or start the engine with more pages",
        )
    return prompt


def _in_process(
    config: EngineConfig, grammar: GrammarBackend | None
) -> tuple[StepRunner, GrammarBackend, Callable[[], None] | None]:
    """The executor side built in this process: the model, and a grammar registry unless one is given (then also
    how to close it). Imported here, not at the top, so that the scheduler side alone never loads the model or the
    grammar engine."""
    from engine.executor.runner import ModelRunner
    from engine.grammar.backend import LocalGrammar

    close = None
    if grammar is None:
        local = LocalGrammar(str(model_dir(config)))
        grammar, close = local, local.shutdown
    return ModelRunner.load(config, grammar), grammar, close


def _open_failure(error: Exception | None) -> Finish:
    """Why a grammar did not open: it does not compile (INVALID_GRAMMAR), the grammar service is unavailable or lost
    the session it was opened in (``error`` None: GRAMMAR_SERVICE), or another grammar failure (GRAMMAR)."""
    if error is None:
        message = "grammar service unavailable: the session this request's grammar was opened in ended"
        return Finish(FinishReason.ABORT, message=message, cause=AbortCause.GRAMMAR_SERVICE)
    if isinstance(error, GrammarUnavailableError):
        message = f"grammar service unavailable: {error}"
        return Finish(FinishReason.ABORT, message=message, cause=AbortCause.GRAMMAR_SERVICE)
    cause = AbortCause.INVALID_GRAMMAR if isinstance(error, InvalidRequestError) else AbortCause.GRAMMAR
    return Finish(FinishReason.ABORT, message=str(error), cause=cause)


def _finish_setter(fut: Future[RequestOutput]) -> OutputSink:
    def sink(out: RequestOutput) -> None:
        if out.finished and not fut.done():
            fut.set_result(out)

    return sink
