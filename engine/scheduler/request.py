"""A request's lifecycle as an explicit state machine, and what the engine streams back for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.constraint import Constraint
from engine.finish import Finish
from engine.kv.prefix_cache import RadixNode
from engine.sampling_params import SamplingParams
from engine.scheduler.spec_policy import RequestSpec
from engine.scheduler.stop import StopChecker


class RequestState(enum.Enum):
    """Where a request is. FINISHING: its finish is decided (or pending, for an abort) but a step that
    names it may still be in flight, so its pages and slot are kept until that step retires (C9)."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHING = "finishing"
    RELEASED = "released"


_LEGAL: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.PREFILLING, RequestState.FINISHING}),
    RequestState.PREFILLING: frozenset({RequestState.DECODING, RequestState.FINISHING}),
    RequestState.DECODING: frozenset({RequestState.FINISHING}),
    RequestState.FINISHING: frozenset({RequestState.RELEASED}),
    RequestState.RELEASED: frozenset(),
}


class IllegalTransitionError(RuntimeError):
    pass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SpecCounts:
    """Speculative decoding so far: verify steps, draft tokens proposed, draft tokens accepted."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.verify_steps += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted

    @property
    def accept_rate(self) -> float:
        """Accepted draft tokens per draft token (0 before any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens per verify step: accepted drafts plus the sampled one (0 before any)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


# Not frozen, and never mutated: built per request per step on the hot path, where a frozen dataclass's __init__
# (one object.__setattr__ per field) costs five times as much. Slots keep it small.
@dataclass(slots=True)
class RequestOutput:
    """One increment of a request's stream. The last one carries ``finish`` and the final ``output_ids``
    (after stop-string trimming); earlier ones carry only what the commit step just added."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    num_output_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    finish: Finish | None = None
    output_ids: tuple[int, ...] | None = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0

    @property
    def finished(self) -> bool:
        return self.finish is not None


@dataclass(eq=False)
class Request:
    """Scheduler-side record of one request. Only the scheduler's commit step changes ``output_ids`` (C1).

    Counters, all in tokens:
    - ``prefill_pos``: prompt tokens planned into steps so far (KV written or being written).
    - ``inflight_output``: output tokens the steps in flight may still produce (an upper bound: a step with
      draft positions may accept fewer), so ``planned_output`` = committed + that bound.
    - ``kv_committed``: the KV watermark: positions [0, kv_committed) were written by retired steps whose
      results were committed (C11: only these may enter the prefix cache).
    - ``last_run_start``: the ordinal at which the request's last committed run began (what a decode planned
      while no step of it is in flight builds on, C2); ``sent_pages``: pages the executor has been sent.

    ``queued_at`` (monotonic seconds) is when it was submitted; ``grammar_session`` the grammar backend's session its
    grammar lives in (it ends with that session, see engine/scheduler/outages.py).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_checker: StopChecker
    seed: int
    constraint: Constraint | None = None
    state: RequestState = RequestState.QUEUED
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    cached_pages: int = 0
    cached_tokens: int = 0
    cache_node: RadixNode | None = None
    reserved_pages: int = 0
    prefill_pos: int = 0
    inflight_output: int = 0
    kv_committed: int = 0
    last_run_start: int = 0
    inflight_steps: int = 0
    sent_new: bool = False
    sent_pages: int = 0
    prefix_counted: bool = False
    grammar_terminated: bool = False
    grammar_session: int = 0
    queued_at: float = 0.0
    finish: Finish | None = None
    spec: SpecCounts = field(default_factory=lambda: SpecCounts())
    drafting: RequestSpec = field(default_factory=lambda: RequestSpec())

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def planned_output(self) -> int:
        """Output tokens committed or possibly being produced by the steps in flight (an upper bound)."""
        return len(self.output_ids) + self.inflight_output

    def transition(self, to: RequestState) -> None:
        if to not in _LEGAL[self.state]:
            raise IllegalTransitionError(f"request {self.request_id}: {self.state.value} -> {to.value} is not legal")
        self.state = to

    @property
    def finishing(self) -> bool:
        """A finish is decided or pending: nothing more is planned (C8) or committed (C6, C7)."""
        return self.finish is not None
