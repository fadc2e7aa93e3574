"""The scheduler: admission, step planning and the single commit step.

Admission policy: **reservation**. A request is admitted only when the pool can promise it every page it
could ever need (prompt + max_new_tokens), counting free pages and evictable prefix-cache pages, minus what
is already promised to admitted requests. Pages are then allocated lazily as prefill and decode reach them,
and an allocation can never fail mid-flight, so a running request is never retracted or corrupted under
memory pressure; a request that does not fit waits in FIFO order.

Ordering rules enforced here (DESIGN.md section 3):
- C1: :meth:`Scheduler.commit` is the only place where a request's output and KV watermark move, once per
  step result, in step order.
- C2: every plan entry names the ordinal it samples at; a result naming another ordinal is refused.
- C6/C7: a result for a request whose finish is decided or pending is dropped whole.
- C8: a request with a pending finish is never planned into a new step.
- C9: pages and the slot of a finishing request are released only once no in-flight step names it.
- C10: middle-chunk samples do not exist (nothing is sampled); chunk k+1 is planned only after chunk k's
  step retired.
- C11: only KV below the committed watermark enters the prefix cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import ProtocolError
from engine.grammar.backend import GrammarBackend
from engine.grammar.registry import CommitEntry
from engine.kv.allocator import PageAllocator
from engine.kv.prefix_cache import RadixNode, RadixPrefixCache
from engine.kv.slots import SlotTable
from engine.request import Request, RequestOutput, RequestState, TokenLogprob
from engine.step import NewRequest, SampledToken, StepEntry, StepPlan, StepResult
from engine.stop import AbortCause, Finish, FinishReason, StopUpdate


@dataclass
class CommitOutcome:
    """What a scheduler event produced: outputs to stream, executor slots whose buffers may be freed."""

    outputs: list[RequestOutput] = field(default_factory=list)
    released_slots: list[int] = field(default_factory=list)

    def extend(self, other: CommitOutcome) -> None:
        self.outputs.extend(other.outputs)
        self.released_slots.extend(other.released_slots)


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


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    """Plans steps and commits their results. Not thread-safe: one loop thread drives it."""

    def __init__(self, config: EngineConfig, grammar: GrammarBackend | None = None) -> None:
        self._config = config
        self._grammar = grammar
        self._grammar_releases: list[str] = []
        self._page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages)
        self.cache = RadixPrefixCache(config.page_size, self.allocator) if config.prefix_cache else None
        self.slots = SlotTable(config.max_running)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._inflight: deque[StepPlan] = deque()
        self._next_step_id = 1
        self._reserved = 0
        self._prefill_tokens = 0
        self._cached_prompt_tokens = 0
        self._kv_lost = False  # set while requests are released after the executor lost its KV

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
        entries: list[StepEntry] = []
        budget = self._config.chunk_size
        for req in self._running:
            entry, used = self._plan_running(req, budget)
            if entry is not None:
                entries.append(entry)
                budget -= used
        while budget > 0 and self._waiting and self._admit(self._waiting[0]):
            req = self._waiting.popleft()
            entry, used = self._plan_chunk(req, budget)
            entries.append(entry)
            budget -= used
        if not entries:
            return None
        plan = StepPlan(self._next_step_id, tuple(entries))
        self._next_step_id += 1
        for entry in entries:
            self._requests[entry.request_id].inflight_steps += 1
        self._inflight.append(plan)
        return plan

    def _plan_running(self, req: Request, budget: int) -> tuple[StepEntry | None, int]:
        if req.finishing:
            return None, 0  # C8: a pending finish is never planned into a new step.
        if req.state is RequestState.PREFILLING:
            if req.inflight_steps or budget <= 0:
                return None, 0  # C10: chunk k+1 only after chunk k's step retired.
            return self._plan_chunk(req, budget)
        if req.planned_output >= req.params.max_new_tokens:
            return None, 0  # its last token is in flight; the commit finishes it by length.
        return self._plan_decode(req), 0

    def _plan_decode(self, req: Request) -> StepEntry:
        assert req.slot is not None
        # The input is the newest output token; it sits at position prompt + planned_output - 1.
        start = req.num_prompt + req.planned_output - 1
        self._grow(req, start + 1)
        unknown = req.planned_output > len(req.output_ids)
        entry = StepEntry(
            request_id=req.request_id,
            slot=req.slot,
            ordinal=req.planned_output,
            start_pos=start,
            input_ids=() if unknown else (req.output_ids[-1],),
            input_ref=unknown,
            page_table=tuple(req.pages),
            sample=True,
            constrained=req.constraint is not None,
        )
        req.planned_output += 1
        return entry

    def _plan_chunk(self, req: Request, budget: int) -> tuple[StepEntry, int]:
        assert req.slot is not None
        n = min(req.num_prompt - req.prefill_pos, budget)
        start = req.prefill_pos
        final = start + n == req.num_prompt
        self._grow(req, start + n)
        entry = StepEntry(
            request_id=req.request_id,
            slot=req.slot,
            ordinal=0,
            start_pos=start,
            input_ids=req.prompt_ids[start : start + n],
            input_ref=False,
            page_table=tuple(req.pages),
            sample=final,
            constrained=final and req.constraint is not None,
            new=None if req.sent_new else NewRequest(req.prompt_ids, req.params, req.seed),
        )
        req.sent_new = True
        req.prefill_pos += n
        self._prefill_tokens += n
        if final:
            req.transition(RequestState.DECODING)
            req.planned_output = 1
        return entry, n

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

    def commit(self, result: StepResult) -> CommitOutcome:
        """The single commit step: the only place where output and the KV watermark move (C1)."""
        if not self._inflight or self._inflight[0].step_id != result.step_id:
            oldest = self._inflight[0].step_id if self._inflight else None
            raise ProtocolError(f"result for step {result.step_id} out of order: oldest in flight is {oldest}")
        plan = self._inflight.popleft()
        outcome = CommitOutcome()
        live: list[tuple[Request, SampledToken]] = []
        for entry, sample in _pair(plan, result):
            req = self._requests[entry.request_id]
            req.inflight_steps -= 1
            if req.finishing:
                continue  # C6, C7: nothing of this result reaches output, grammar, watermark or stream.
            req.kv_committed = entry.end_pos
            if sample is None:
                continue
            if sample.error is not None:  # the executor could not sample this row (no fenced mask): end it alone
                outcome.extend(self._finish_now(req, _grammar_abort(sample.error)))
                continue
            live.append((req, sample))
        refused = self._commit_grammar(live)
        for req, sample in live:
            if req.request_id in refused:
                outcome.extend(self._finish_now(req, refused[req.request_id]))  # C13: only this request ends
            else:
                outcome.outputs.append(self._append(req, sample))
        outcome.extend(self._release_retired(plan))
        self._flush_grammar_releases()
        return outcome

    def _commit_grammar(self, live: list[tuple[Request, SampledToken]]) -> dict[str, Finish]:
        """Commit this step's tokens of constrained requests to their grammars, in one batched call (C1, C2).

        Returns the requests whose token the grammar refused, with the abort that ends them (C13). A request whose
        grammar terminated keeps its token and is finished by :meth:`_append` (C6)."""
        constrained = [(req, sample) for req, sample in live if req.constraint is not None]
        if not constrained or self._grammar is None:
            return {}
        entries = [CommitEntry(req.request_id, len(req.output_ids), (s.token_id,)) for req, s in constrained]
        refused: dict[str, Finish] = {}
        for (req, sample), got in zip(constrained, self._grammar.commit(entries), strict=True):
            if got.result is None:
                code = got.refusal.value if got.refusal is not None else "error"
                refused[req.request_id] = _grammar_abort(f"grammar commit refused ({code}): {got.message}")
            elif got.result.rejected_token is not None:
                refused[req.request_id] = _grammar_abort(_rejection(req, sample.token_id, got.result.violation))
            elif got.result.terminated:
                req.grammar_terminated = True
        return refused

    def fail_step(self, step_id: int, message: str, cause: AbortCause = AbortCause.EXECUTOR) -> CommitOutcome:
        """The executor could not run ``step_id``: every request it named ends with an abort saying why."""
        if not self._inflight or self._inflight[0].step_id != step_id:
            raise ProtocolError(f"failed step {step_id} is not the oldest in flight")
        plan = self._inflight.popleft()
        outcome = CommitOutcome()
        for entry in plan.entries:
            req = self._requests[entry.request_id]
            req.inflight_steps -= 1
            if not req.finishing:
                outcome.extend(self._finish_now(req, Finish(FinishReason.ABORT, message=message, cause=cause)))
        outcome.extend(self._release_retired(plan))
        return outcome

    def executor_lost(self, message: str) -> CommitOutcome:
        """The executor's session ended and with it every KV page and per-request buffer it held.

        Every step in flight fails and every admitted request ends with an abort caused by the executor (queued
        ones hold nothing of the executor's and stay queued). Nothing enters
        the prefix cache and everything cached is dropped, since the KV behind it is gone. Released slots are
        not reported: the executor has no buffers left to free.
        """
        outputs: list[RequestOutput] = []
        finish = Finish(FinishReason.ABORT, message=message, cause=AbortCause.EXECUTOR)
        self._kv_lost = True
        try:
            while self._inflight:
                outputs.extend(self.fail_step(self._inflight[0].step_id, message).outputs)
            for req in list(self._requests.values()):
                # A queued request holds nothing of the executor's: it waits and runs on the next session.
                if req.state is not RequestState.QUEUED and not req.finishing:
                    outputs.extend(self._finish_now(req, finish).outputs)
        finally:
            self._kv_lost = False
        if self.cache is not None:
            self.cache.evict(self.cache.num_evictable)
        return CommitOutcome(outputs=outputs)

    def _append(self, req: Request, sample: SampledToken) -> RequestOutput:
        if sample.ordinal != len(req.output_ids):
            raise ProtocolError(
                f"request {req.request_id}: result at ordinal {sample.ordinal}, committed {len(req.output_ids)}"
            )
        req.output_ids.append(sample.token_id)
        update = req.stop_checker.append(sample.token_id)
        if update.finish is None and req.grammar_terminated:
            # C6: the grammar is complete; nothing after this token may be kept.
            update = StopUpdate(update.text_delta, Finish(FinishReason.STOP, matched_token=sample.token_id), 0)
        logprobs: tuple[TokenLogprob, ...] = ()
        if (req.params.logprobs or req.params.top_logprobs) and sample.logprob is not None:
            logprobs = (TokenLogprob(sample.token_id, sample.logprob, sample.top_logprobs or ()),)
        if update.finish is None:
            return self._output(req, (sample.token_id,), update.text_delta, logprobs)
        if update.trim_tokens:
            del req.output_ids[-update.trim_tokens :]
        self._decide_finish(req, update.finish)
        return self._output(req, (sample.token_id,), update.text_delta, logprobs)

    # ---------------------------------------------------------------- finish and release (C9)

    def _decide_finish(self, req: Request, finish: Finish) -> None:
        req.finish = finish
        req.transition(RequestState.FINISHING)
        if req.constraint is not None:
            # Released at once, not after the in-flight step retires: a mask request of that step waiting at the
            # fence for a commit that will never come is then refused at once instead of stalling the step (C3).
            self._grammar_releases.append(req.request_id)

    def _flush_grammar_releases(self) -> None:
        if self._grammar_releases and self._grammar is not None:
            self._grammar.release(self._grammar_releases)
        self._grammar_releases = []

    def _finish_now(self, req: Request, finish: Finish) -> CommitOutcome:
        self._decide_finish(req, finish)
        self._flush_grammar_releases()
        outcome = CommitOutcome(outputs=[self._output(req, (), "", ())])
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
        )

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
        )


def _pair(plan: StepPlan, result: StepResult) -> Iterator[tuple[StepEntry, SampledToken | None]]:
    """Match each plan entry with its sample (sampling entries only, in plan order)."""
    samples = iter(result.samples)
    for entry in plan.entries:
        if not entry.sample:
            yield entry, None
            continue
        sample = next(samples, None)
        if sample is None or sample.request_id != entry.request_id or sample.ordinal != entry.ordinal:
            raise ProtocolError(f"step {plan.step_id}: result does not match the plan at {entry.request_id}")
        yield entry, sample
    if next(samples, None) is not None:
        raise ProtocolError(f"step {plan.step_id}: result has more samples than the plan")


def _rejection(req: Request, token: int, violation: str | None) -> str:
    """Why the grammar refused ``token`` (C13): the token itself, or (checked JSON-schema mode) the output it completes
    violating the schema, in the grammar side's words (keyword, places, value); and which constraint it was."""
    named = req.constraint.describe() if req.constraint is not None else "unknown"
    position = len(req.output_ids)
    if violation is not None:
        return f"{violation} (output position {position}, constraint: {named})"
    return f"the grammar refused token {token} at output position {position} (constraint: {named})"


def _grammar_abort(message: str) -> Finish:
    return Finish(FinishReason.ABORT, message=message, cause=AbortCause.GRAMMAR)
