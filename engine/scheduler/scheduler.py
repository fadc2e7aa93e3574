"""The scheduler: admission, step planning and the single commit step.

Admission policy: **reservation**. A request is admitted only when the pool can promise it every page it
could ever need (prompt + max_new_tokens), counting free pages and evictable prefix-cache pages, minus what
is already promised to admitted requests. Pages are then allocated lazily as prefill and decode reach them,
and an allocation can never fail mid-flight, so a running request is never retracted or corrupted under
memory pressure; a request that does not fit waits in FIFO order.

Ordering rules enforced here (DESIGN.md section 3):
- C1: :meth:`Scheduler.commit` (with :meth:`Scheduler.finish_commit`) is the only place where a request's output
  and KV watermark move, once per step result, in step order.
- C2: every plan entry names the ordinal it builds on; a result whose run does not begin at the request's
  committed count is refused.
- C6: a run is cut at the first token that finishes the request (a stop token or string, the length, the
  grammar's end); nothing after it reaches output, grammar, watermark or stream.
- C7: a result for a request whose finish is decided or pending is dropped whole.
- C8: a request with a pending finish is never planned into a new step.
- C9: pages and the slot of a finishing request are released only once no in-flight step names it.
- C10: middle-chunk samples do not exist (nothing is sampled); chunk k+1 is planned only after chunk k's
  step retired.
- C11: only KV below the committed watermark enters the prefix cache.

The scheduler is pure bookkeeping: it calls no service. A commit has two phases around the grammar service's
commit, which the caller makes: :meth:`Scheduler.commit` checks a result and cuts its runs at their finish
(returning the grammar entries to commit, C1, C2), :meth:`Scheduler.finish_commit` applies what the grammar
accepted (C6, C13). Grammar matchers to release come back in every outcome.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from engine.config import EngineConfig
from engine.errors import ProtocolError
from engine.finish import AbortCause, Finish, FinishReason
from engine.grammar_calls import CommitEntry, Refusal, is_service_unavailable
from engine.grammar_calls import CommitOutcome as GrammarCommitOutcome
from engine.kv.allocator import PageAllocator
from engine.kv.prefix_cache import RadixNode, RadixPrefixCache
from engine.kv.slots import SlotTable
from engine.scheduler.batch_verdict import PlannedBatch
from engine.scheduler.request import Request, RequestOutput, RequestState, SpecCounts, TokenLogprob
from engine.scheduler.spec_policy import SpecPolicy
from engine.step import NewRequest, SampledRun, StepEntry, StepPlan, StepResult


@dataclass
class CommitOutcome:
    """What a scheduler event produced: outputs to stream, executor slots whose buffers may be freed, grammar
    matchers to release (at once: a mask request of a step still in flight is then refused instead of waiting
    at the fence for a commit that will never come, C3)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    released_slots: list[int] = field(default_factory=list)
    released_grammars: list[str] = field(default_factory=list)

    def extend(self, other: CommitOutcome) -> None:
        self.outputs.extend(other.outputs)
        self.released_slots.extend(other.released_slots)
        self.released_grammars.extend(other.released_grammars)


@dataclass(frozen=True)
class _Inflight:
    """A launched step as the scheduler planned it: per entry, the output tokens it may produce and, for a
    prefill chunk, the end of the positions it writes."""

    plan: StepPlan
    planned: tuple[int, ...]
    chunk_ends: tuple[int, ...]
    catch_up: int = 0  # tokens the drafting requests' draft model had to read before drafting (SpecPolicy)


@dataclass
class _Cut:
    """One live run after the stop checks (phase 1 of a commit), before the grammar has seen it."""

    req: Request
    run: SampledRun
    kept: tuple[int, ...]  # the run up to and including the token that finishes the request, if one does
    deltas: list[str]  # text each kept token added
    finish: Finish | None
    trim_tokens: int  # output ids a matched stop string removes from the end


@dataclass
class PendingCommit:
    """Phase 1 of a commit (:meth:`Scheduler.commit`): what the grammar service must commit before
    :meth:`Scheduler.finish_commit` can decide the rest. ``grammar`` is one batched call (C1, C2)."""

    grammar: list[CommitEntry]
    outcome: CommitOutcome
    _inflight: _Inflight
    _cuts: list[_Cut]


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    total_pages: int
    free_pages: int
    evictable_pages: int
    used_pages: int
    reserved_pages: int
    total_slots: int
    free_slots: int
    inflight_steps: int
    prefill_tokens: int
    cached_prompt_tokens: int
    steps: int
    spec: SpecCounts = field(default_factory=lambda: SpecCounts())


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    """Plans steps and commits their results. Not thread-safe: one loop thread drives it."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages)
        self.cache = RadixPrefixCache(config.page_size, self.allocator) if config.prefix_cache else None
        self.slots = SlotTable(config.max_running)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._inflight: deque[_Inflight] = deque()
        self._next_step_id = 1
        self._reserved = 0
        self._prefill_tokens = 0
        self._cached_prompt_tokens = 0
        self._kv_lost = False  # set while requests are released after the executor lost its KV
        self._draft_nodes = config.speculative.draft_nodes
        self._spec = SpecCounts()
        self._policy = SpecPolicy(config.speculative)
        self._depth = 0  # the draft depth of the step being planned

    # ---------------------------------------------------------------- intake

    def add(self, req: Request) -> CommitOutcome:
        """Queue a validated request. A request with max_new_tokens 0 finishes at once, owning nothing."""
        if req.request_id in self._requests:
            raise ProtocolError(f"request {req.request_id} is already in the scheduler")
        self._requests[req.request_id] = req
        if req.params.max_new_tokens == 0:
            return self._finish_now(req, Finish(FinishReason.LENGTH))
        self._waiting.append(req)
        return CommitOutcome()

    def abort(
        self, request_id: str, message: str = "aborted by client", cause: AbortCause = AbortCause.CLIENT
    ) -> CommitOutcome:
        """Record an abort (a pending finish). From here no result of this request is committed (C7) and it is
        planned into no new step (C8); its resources go once no in-flight step names it (C9). Unknown or
        already finishing ids are a no-op."""
        req = self._requests.get(request_id)
        if req is None or req.finishing:
            return CommitOutcome()
        if req.state is RequestState.QUEUED:
            self._waiting.remove(req)
        return self._finish_now(req, Finish(FinishReason.ABORT, message=message, cause=cause))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def idle(self) -> bool:
        return not self._requests and not self._inflight

    # ---------------------------------------------------------------- planning

    def plan(self) -> StepPlan | None:
        """Plan the next step from current bookkeeping, or None when nothing can run now."""
        planned: list[tuple[StepEntry, int, int]] = []  # entry, output tokens it may produce, chunk end
        budget = self._config.chunk_size
        if self._draft_nodes:
            decodes = [r for r in self._running if r.state is RequestState.DECODING and not r.finishing]
            for r in decodes:
                r.drafting.length = r.num_prompt + len(r.output_ids)
                r.drafting.left = r.params.max_new_tokens - r.planned_output
                r.drafting.written = len(r.output_ids)
            quiet = not self._waiting and len(decodes) == len(self._running)
            self._depth = self._policy.batch_depth([r.drafting for r in decodes], quiet)
        for req in self._running:
            item, used = self._plan_running(req, budget)
            if item is not None:
                planned.append(item)
                budget -= used
        while budget > 0 and self._waiting and self._admit(self._waiting[0]):
            req = self._waiting.popleft()
            item, used = self._plan_chunk(req, budget)
            planned.append(item)
            budget -= used
        if not planned:
            return None
        plan = StepPlan(self._next_step_id, tuple(entry for entry, _, _ in planned))
        self._next_step_id += 1
        for entry, tokens, _ in planned:
            req = self._requests[entry.request_id]
            req.inflight_steps += 1
            req.inflight_output += tokens
        self._inflight.append(
            _Inflight(
                plan,
                tuple(tokens for _, tokens, _ in planned),
                tuple(end for _, _, end in planned),
                self._policy.take_catch_up() if self._draft_nodes else 0,
            )
        )
        return plan

    def _plan_running(self, req: Request, budget: int) -> tuple[tuple[StepEntry, int, int] | None, int]:
        if req.finishing:
            return None, 0  # C8: a pending finish is never planned into a new step.
        if req.state is RequestState.PREFILLING:
            if req.inflight_steps or budget <= 0:
                return None, 0  # C10: chunk k+1 only after chunk k's step retired.
            return self._plan_chunk(req, budget)
        remaining = req.params.max_new_tokens - req.planned_output
        if remaining <= 0:
            return None, 0  # its last token is in flight; the commit finishes it by length.
        drafts = min(self._drafts_for(req), remaining - 1)  # a run never outgrows max_new_tokens
        return (self._plan_decode(req, drafts), 1 + drafts, 0), 0

    def _drafts_for(self, req: Request) -> int:
        """Draft positions for ``req``'s next decode: the step's depth, unless the request's drafts do not pay."""
        return self._policy.request_depth(req.drafting, self._depth) if self._depth else 0

    def _plan_decode(self, req: Request, drafts: int) -> StepEntry:
        assert req.slot is not None
        # The input is the newest output token (under overlap the in-flight step is still producing it): it sits
        # at position prompt + planned_output - 1 at the latest, and the step writes it and its draft positions.
        self._grow(req, req.num_prompt + req.planned_output + drafts)
        # The run that ends with that token: the in-flight step's (it begins at the committed count, since the
        # step before it has been committed), or the last committed one.
        builds_on = len(req.output_ids) if req.inflight_steps else req.last_run_start
        return StepEntry(
            request_id=req.request_id,
            slot=req.slot,
            ordinal=builds_on,
            input_ref=True,
            num_draft=drafts,
            new_pages=self._new_pages(req),
            constrained=req.constraint is not None,
        )

    def _plan_chunk(self, req: Request, budget: int) -> tuple[tuple[StepEntry, int, int], int]:
        assert req.slot is not None
        n = min(req.num_prompt - req.prefill_pos, budget)
        start = req.prefill_pos
        final = start + n == req.num_prompt
        self._grow(req, start + n)
        new = None if req.sent_new else NewRequest(req.prompt_ids, req.params, req.seed, cached_len=req.cached_tokens)
        entry = StepEntry(
            request_id=req.request_id,
            slot=req.slot,
            ordinal=0,
            input_ids=req.prompt_ids[start : start + n],
            sample=final,
            new_pages=self._new_pages(req),
            new=new,
            constrained=final and req.constraint is not None,
        )
        req.sent_new = True
        req.prefill_pos += n
        self._prefill_tokens += n
        if final:
            req.transition(RequestState.DECODING)
        return (entry, int(final), start + n), n

    def _new_pages(self, req: Request) -> tuple[int, ...]:
        """The pages the executor has not been sent yet (the persistent batch: each page travels once)."""
        if req.sent_pages == len(req.pages):
            return ()  # most decodes: the page they write was sent before
        pages = tuple(req.pages[req.sent_pages :])
        req.sent_pages = len(req.pages)
        return pages

    def _admit(self, req: Request) -> bool:
        """Reserve every page ``req`` can need, or leave everything as it was and return False."""
        if self.slots.num_free == 0:
            return False
        matched_pages: tuple[int, ...] = ()
        node: RadixNode | None = None
        if self.cache is not None:
            # Keep at least one prompt token to prefill: its logits give the first output token.
            match = self.cache.match(req.prompt_ids[:-1], record_stats=not req.prefix_counted)
            req.prefix_counted = True  # a request that waits is matched again next step: count it once
            matched_pages, node = match.pages, match.node
            self.cache.lock(node)
        need = pages_for(req.num_prompt + req.params.max_new_tokens - 1, self._page_size) - len(matched_pages)
        if need > self._available_pages():
            if self.cache is not None and node is not None:
                self.cache.unlock(node)
            return False
        req.slot = self.slots.acquire()
        req.pages = list(matched_pages)
        req.cached_pages = len(matched_pages)
        req.cached_tokens = len(matched_pages) * self._page_size
        req.cache_node = node
        req.prefill_pos = req.cached_tokens
        req.kv_committed = req.cached_tokens
        req.reserved_pages = need
        self._reserved += need
        self._cached_prompt_tokens += req.cached_tokens
        req.transition(RequestState.PREFILLING)
        self._running.append(req)
        return True

    def _available_pages(self) -> int:
        evictable = self.cache.num_evictable if self.cache is not None else 0
        return self.allocator.num_free + evictable - self._reserved

    def _grow(self, req: Request, num_tokens: int) -> None:
        """Allocate pages (from the request's reservation) so that positions [0, num_tokens) have a page."""
        n = pages_for(num_tokens, self._page_size) - len(req.pages)
        if n <= 0:
            return
        if n > req.reserved_pages:
            raise ProtocolError(f"request {req.request_id} outgrew its reservation")
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        req.pages.extend(self.allocator.alloc(n))
        req.reserved_pages -= n
        self._reserved -= n

    # ---------------------------------------------------------------- commit (C1)

    def commit(self, result: StepResult, period_s: float | None = None) -> PendingCommit:
        """Phase 1 of the single commit step (C1): check ``result`` against its plan and cut each run at the token
        that finishes its request. Returns the grammar entries to commit; :meth:`finish_commit` does the rest.

        ``period_s``: wall seconds since the commit before it, when the loop did not wait idle in between (None
        otherwise): what the step really cost the engine's throughput, the host's work included."""
        if not self._inflight or self._inflight[0].plan.step_id != result.step_id:
            oldest = self._inflight[0].plan.step_id if self._inflight else None
            raise ProtocolError(f"result for step {result.step_id} out of order: oldest in flight is {oldest}")
        inflight = self._inflight.popleft()
        outcome = CommitOutcome()
        cuts: list[_Cut] = []
        for entry, planned, chunk_end, run in _pair(inflight, result):
            req = self._requests[entry.request_id]
            req.inflight_steps -= 1
            req.inflight_output -= planned
            if req.finishing:
                continue  # C6, C7: nothing of this result reaches output, grammar, watermark or stream.
            if run is None:
                req.kv_committed = chunk_end  # a middle chunk: its KV is written, nothing was sampled
                continue
            if run.error is not None:  # the executor could not sample this row (no fenced mask): end it alone
                outcome.extend(self._finish_now(req, _row_failure(run.error)))
                continue
            if run.ordinal != len(req.output_ids):
                raise ProtocolError(
                    f"request {req.request_id}: run at ordinal {run.ordinal}, committed {len(req.output_ids)} (C2)"
                )
            req.spec.add(run.num_drafted, run.num_accepted)
            self._spec.add(run.num_drafted, run.num_accepted)
            self._policy.observe_request(req.drafting, run.num_drafted, run.num_accepted, entry.num_draft)
            cuts.append(_cut(req, run))
        self._observe_spec(inflight, result, period_s)
        grammar = [
            CommitEntry(c.req.request_id, len(c.req.output_ids), c.kept) for c in cuts if c.req.constraint is not None
        ]
        return PendingCommit(grammar, outcome, inflight, cuts)

    def _observe_spec(self, inflight: _Inflight, result: StepResult, period_s: float | None) -> None:
        """What the step's depth paid: only pure decode steps say it (a prefill chunk's cost is not the depth's).

        The cost is the step's period when known, else the executor's time: where the host is the bottleneck
        (many streams, few cores) a draft's cost to throughput is the scheduler's work on its tokens as much as the
        verify's, and the executor's time alone made drafting look free there."""
        if not self._draft_nodes:
            return
        if any(e.is_prefill for e in inflight.plan.entries):
            self._policy.tick()
            return
        forward_tokens = sum(1 + run.num_drafted for run in result.runs)
        drafted = sum(1 for run in result.runs if run.num_drafted)
        # The draft's depth as it ran (its forwards), not as planned: a draft model ends its drafts where it is unsure.
        depth = max((run.num_drafted for run in result.runs), default=0)
        timing = result.timing
        seconds = max(timing.done, period_s) if period_s is not None else timing.done
        entries = inflight.plan.entries
        planned = PlannedBatch(
            len(entries), sum(1 for e in entries if e.num_draft), max((e.num_draft for e in entries), default=0)
        )
        self._policy.observe_step(
            forward_tokens, depth, drafted, seconds, timing.draft_seconds, inflight.catch_up, planned
        )

    def finish_commit(self, pending: PendingCommit, grammar: Sequence[GrammarCommitOutcome]) -> CommitOutcome:
        """Phase 2: ``grammar`` answers ``pending.grammar`` in order. A run the grammar ended early is cut there
        (C6); a token it refused ends that request alone, with an abort naming the grammar (C13)."""
        if len(grammar) != len(pending.grammar):
            raise ProtocolError(f"{len(pending.grammar)} grammar commits, {len(grammar)} answers")
        answers = iter(grammar)
        outcome = pending.outcome
        for cut in pending._cuts:
            if cut.req.constraint is not None:
                _apply_grammar(cut, next(answers))
            outcome.extend(self._append(cut))
        outcome.extend(self._release_retired(pending._inflight.plan))
        return outcome

    def _append(self, cut: _Cut) -> CommitOutcome:
        req, kept = cut.req, cut.kept
        committed = len(req.output_ids)
        req.output_ids.extend(kept)
        req.last_run_start = committed
        # C11: the step wrote KV up to its input, which precedes the run's last kept token.
        req.kv_committed = max(req.kv_committed, req.num_prompt + committed + len(kept) - 1)
        logprobs = _logprobs(req, cut.run, len(kept))
        text = "".join(cut.deltas[: len(kept)])
        if cut.finish is None:
            return CommitOutcome(outputs=[self._output(req, kept, text, logprobs)])
        if cut.trim_tokens:
            del req.output_ids[-cut.trim_tokens :]
        outcome = self._finish_now(req, cut.finish, kept, text, logprobs)
        return outcome

    def fail_step(self, step_id: int, message: str, cause: AbortCause = AbortCause.EXECUTOR) -> CommitOutcome:
        """The executor could not run ``step_id``: every request it named ends with an abort saying why."""
        if not self._inflight or self._inflight[0].plan.step_id != step_id:
            raise ProtocolError(f"failed step {step_id} is not the oldest in flight")
        inflight = self._inflight.popleft()
        plan = inflight.plan
        outcome = CommitOutcome()
        for entry, planned in zip(plan.entries, inflight.planned, strict=True):
            req = self._requests[entry.request_id]
            req.inflight_steps -= 1
            req.inflight_output -= planned
            if not req.finishing:
                outcome.extend(self._finish_now(req, Finish(FinishReason.ABORT, message=message, cause=cause)))
        outcome.extend(self._release_retired(plan))
        return outcome

    def executor_lost(self, message: str) -> CommitOutcome:
        """The executor's session ended and with it every KV page and per-request buffer it held.

        Every step in flight fails and every admitted request ends with an abort caused by the executor (queued
        ones hold nothing of the executor's and stay queued). Nothing enters
        the prefix cache and everything cached is dropped, since the KV behind it is gone. Released slots are
        not reported: the executor has no buffers left to free. Their grammars are (they live in the grammar service).
        """
        lost = CommitOutcome()
        finish = Finish(FinishReason.ABORT, message=message, cause=AbortCause.EXECUTOR)
        self._kv_lost = True
        try:
            while self._inflight:
                lost.extend(self.fail_step(self._inflight[0].plan.step_id, message))
            for req in list(self._requests.values()):
                # A queued request holds nothing of the executor's: it waits and runs on the next session.
                if req.state is not RequestState.QUEUED and not req.finishing:
                    lost.extend(self._finish_now(req, finish))
        finally:
            self._kv_lost = False
        if self.cache is not None:
            self.cache.evict(self.cache.num_evictable)
        # Their grammars live in the grammar service, not in the executor: they are released as for any finish.
        return CommitOutcome(outputs=lost.outputs, released_grammars=lost.released_grammars)

    def grammar_lost(self, session: int, message: str) -> CommitOutcome:
        """The grammar service lost every grammar of its sessions up to ``session``: each request whose grammar lived
        in one ends with an abort caused by the grammar service (queued or running; the others go on). Its slot and
        pages go as for any finish (C9); no grammar is reported for release, since they are gone with the session."""
        outcome = CommitOutcome()
        for req in list(self._requests.values()):
            if req.constraint is not None and 0 < req.grammar_session <= session:
                outcome.extend(self.abort(req.request_id, message, AbortCause.GRAMMAR_SERVICE))
        outcome.released_grammars.clear()
        return outcome

    def expire_queued(self, queued_before: float, message: str, cause: AbortCause) -> CommitOutcome:
        """End every queued request submitted before ``queued_before`` (monotonic seconds) with an abort: it waited
        as long as it may for a lost service. Queued requests hold nothing, so they go at once."""
        outcome = CommitOutcome()
        for req in [r for r in self._waiting if r.queued_at < queued_before]:
            outcome.extend(self.abort(req.request_id, message, cause))
        return outcome

    # ---------------------------------------------------------------- finish and release (C9)

    def _finish_now(
        self,
        req: Request,
        finish: Finish,
        new_ids: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> CommitOutcome:
        """Decide ``req``'s finish; its last output carries ``new_ids``. Its grammar is released at once, not after
        the in-flight step retires: a mask request of that step waiting at the fence for a commit that will never
        come is then refused at once instead of stalling the step (C3)."""
        req.finish = finish
        req.transition(RequestState.FINISHING)
        outcome = CommitOutcome(outputs=[self._output(req, new_ids, text, logprobs)])
        if req.constraint is not None:
            outcome.released_grammars.append(req.request_id)
        if req.inflight_steps == 0:
            outcome.released_slots.extend(self._release(req))
        return outcome

    def _release_retired(self, plan: StepPlan) -> CommitOutcome:
        outcome = CommitOutcome()
        for entry in plan.entries:
            req = self._requests.get(entry.request_id)
            if req is not None and req.state is RequestState.FINISHING and req.inflight_steps == 0:
                outcome.released_slots.extend(self._release(req))
        return outcome

    def _release(self, req: Request) -> list[int]:
        """Return everything ``req`` holds. Only called once no in-flight step names it (C9)."""
        assert req.inflight_steps == 0
        self._return_pages(req)
        self._reserved -= req.reserved_pages
        req.reserved_pages = 0
        released: list[int] = []
        if req.slot is not None:
            self.slots.release(req.slot)
            released.append(req.slot)
            self._running.remove(req)
        req.transition(RequestState.RELEASED)
        del self._requests[req.request_id]
        return released

    def _return_pages(self, req: Request) -> None:
        own = req.pages[req.cached_pages :]
        if self.cache is None:
            self.allocator.free(own)
            req.pages = []
            return
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        if self._kv_lost:
            self.allocator.free(req.pages[req.cached_pages :])
            req.pages = []
            return
        # C11: only KV below the committed watermark enters the prefix cache.
        tokens = (*req.prompt_ids, *req.output_ids)[: req.kv_committed]
        cached = set(req.pages[: req.cached_pages])
        not_taken = self.cache.insert(tokens, req.pages)
        self.allocator.free(p for p in not_taken if p not in cached)
        req.pages = []

    # ---------------------------------------------------------------- reporting

    def _output(
        self, req: Request, new_ids: tuple[int, ...], text: str, logprobs: tuple[TokenLogprob, ...]
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text_delta=text,
            num_output_tokens=len(req.output_ids),
            num_prompt_tokens=req.num_prompt,
            num_cached_tokens=req.cached_tokens,
            logprobs=logprobs,
            finish=req.finish,
            output_ids=tuple(req.output_ids) if req.finish is not None else None,
            spec_draft_tokens=req.spec.draft_tokens,
            spec_accepted_tokens=req.spec.accepted_tokens,
            spec_verify_steps=req.spec.verify_steps,
        )

    def check_invariants(self) -> None:
        """Raise :class:`ProtocolError` unless the page accounting and the prefix cache are consistent."""
        s = self.stats()
        if s.free_pages + s.evictable_pages + s.used_pages != s.total_pages:
            raise ProtocolError(f"KV accounting: free + evictable + used != total ({s})")
        if not 0 <= s.reserved_pages <= s.free_pages + s.evictable_pages:
            raise ProtocolError(f"KV accounting: reservations exceed what the pool can give ({s})")
        if s.free_slots + s.num_running != s.total_slots:
            raise ProtocolError(f"slots: free + running != total ({s})")
        if self.cache is not None:
            self.cache.check_invariants()

    def stats(self) -> SchedulerStats:
        evictable = self.cache.num_evictable if self.cache is not None else 0
        free = self.allocator.num_free
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            total_pages=self.allocator.num_total,
            free_pages=free,
            evictable_pages=evictable,
            used_pages=self.allocator.num_total - free - evictable,
            reserved_pages=self._reserved,
            total_slots=self.slots.num_total,
            free_slots=self.slots.num_free,
            inflight_steps=len(self._inflight),
            prefill_tokens=self._prefill_tokens,
            cached_prompt_tokens=self._cached_prompt_tokens,
            steps=self._next_step_id - 1,
            spec=replace(self._spec),  # a copy: a snapshot does not move
        )


def _pair(inflight: _Inflight, result: StepResult) -> Iterator[tuple[StepEntry, int, int, SampledRun | None]]:
    """Match each plan entry with its run (sampling entries only, in plan order)."""
    plan = inflight.plan
    runs = iter(result.runs)
    for entry, planned, chunk_end in zip(plan.entries, inflight.planned, inflight.chunk_ends, strict=True):
        if not entry.sample:
            yield entry, planned, chunk_end, None
            continue
        run = next(runs, None)
        if run is None or run.request_id != entry.request_id:
            raise ProtocolError(f"step {plan.step_id}: result does not match the plan at {entry.request_id}")
        if run.error is None and not 1 <= len(run.token_ids) <= planned:
            raise ProtocolError(
                f"step {plan.step_id}: {entry.request_id} produced {len(run.token_ids)} tokens, the plan allowed "
                f"1 to {planned}"
            )
        yield entry, planned, chunk_end, run
    if next(runs, None) is not None:
        raise ProtocolError(f"step {plan.step_id}: result has more runs than the plan has sampling entries")


def _cut(req: Request, run: SampledRun) -> _Cut:
    """Feed the run to the stop checker token by token and keep it up to the token that finishes the request."""
    deltas: list[str] = []
    for i, token in enumerate(run.token_ids):
        update = req.stop_checker.append(token)
        deltas.append(update.text_delta)
        if update.finish is not None:
            return _Cut(req, run, run.token_ids[: i + 1], deltas, update.finish, update.trim_tokens)
    return _Cut(req, run, run.token_ids, deltas, None, 0)


def _apply_grammar(cut: _Cut, answer: GrammarCommitOutcome) -> None:
    """Cut a constrained run where its grammar stopped taking it (C6) or make it end the request (C13)."""
    req = cut.req
    if answer.result is None:
        code = answer.refusal.value if answer.refusal is not None else "error"
        cut.kept, cut.finish = (), _grammar_abort(f"grammar commit refused ({code}): {answer.message}")
        if answer.refusal is Refusal.UNAVAILABLE:  # the service, not this request's grammar: UNAVAILABLE
            cut.finish = Finish(FinishReason.ABORT, message=answer.message, cause=AbortCause.GRAMMAR_SERVICE)
        cut.trim_tokens = 0
        return
    accepted = answer.result.accepted
    if answer.result.rejected_token is not None:
        cut.kept, cut.trim_tokens = cut.kept[:accepted], 0
        cut.finish = _grammar_abort(
            _rejection(req, answer.result.rejected_token, len(req.output_ids) + accepted, answer.result.violation)
        )
    elif answer.result.terminated:
        req.grammar_terminated = True
        if accepted < len(cut.kept) or cut.finish is None:
            # C6: the grammar is complete; nothing after its last token may be kept.
            cut.kept, cut.trim_tokens = cut.kept[:accepted], 0
            cut.finish = Finish(FinishReason.STOP, matched_token=cut.kept[-1])


def _logprobs(req: Request, run: SampledRun, count: int) -> tuple[TokenLogprob, ...]:
    if not (req.params.logprobs or req.params.top_logprobs) or run.logprobs is None:
        return ()
    tops = run.top_logprobs or ((),) * len(run.token_ids)
    return tuple(
        TokenLogprob(token, lp, top) for token, lp, top in zip(run.token_ids[:count], run.logprobs, tops, strict=False)
    )


def _rejection(req: Request, token: int, position: int, violation: str | None) -> str:
    """Why the grammar refused ``token`` at output ``position`` (C13): the token itself, or (checked JSON-schema mode)
    the output it completes violating the schema, in the grammar side's words (keyword, places, value); and which
    constraint it was."""
    named = req.constraint.describe() if req.constraint is not None else "unknown"
    if violation is not None:
        return f"{violation} (output position {position}, constraint: {named})"
    return f"the grammar refused token {token} at output position {position} (constraint: {named})"


def _row_failure(error: str) -> Finish:
    """A row the executor could not sample: the grammar service failing is UNAVAILABLE for the client (worth a
    retry), a refusal of this request's mask ends it naming the grammar (C3, C13)."""
    if is_service_unavailable(error):
        return Finish(FinishReason.ABORT, message=error, cause=AbortCause.GRAMMAR_SERVICE)
    return _grammar_abort(error)


def _grammar_abort(message: str) -> Finish:
    return Finish(FinishReason.ABORT, message=message, cause=AbortCause.GRAMMAR)
