"""What crosses the scheduler/executor boundary: step plans and step results (the step protocol, v2).

These values are the in-process form of the executor protocol; the services map them to protos unchanged.
Vocabulary (DESIGN.md section 3): a request's *ordinal* is the number of its output tokens committed; a
*step* is one forward launched by the scheduler, ids strictly increasing.

A step carries **runs** of tokens. Each entry's input is a run: literal prompt ids (a prefill chunk), or a
reference to the token the slot produced last (a decode), plus room for draft tokens the executor proposes
itself. A sampling entry's result is a run too: every token the step produced for the request, in ordinal
order (accepted draft tokens, then the one sampled after them). Plain decoding is the run of length one; there
is no other code path.

Positions are the executor's: it keeps each slot's sequence length (the KV positions that hold accepted
tokens) and writes a run right after it, so a plan never has to know how many tokens the step before it
accepted. The executor keeps each live request's page table too (a persistent batch): an entry carries only
the pages appended since the request's previous entry, and a request's sampling parameters travel once, in
its first entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """Sent with a request's first entry: what the executor needs to set up its per-request buffer.

    ``cached_len``: positions ``[0, cached_len)`` already hold this prompt's KV (a prefix-cache hit), in the
    pages the entry carries first; the request's first run starts right after them."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    cached_len: int = 0


# Not frozen, and never mutated: built per request per step on the hot path, where a frozen dataclass's __init__
# (one object.__setattr__ per field) costs five times as much. Slots keep it small.
@dataclass(slots=True)
class StepEntry:
    """One request's part of a step.

    Input run: the slot's pending token when ``input_ref`` (the last token it produced, whose KV no step has
    written yet), then the literal ``input_ids``, then ``num_draft`` positions for draft tokens the executor's
    proposer fills. A decode is ``input_ref`` alone (the scheduler may not know that token yet: under overlap
    the step that produces it is still running); a prefill chunk is literal prompt ids. The executor writes the
    run's KV right after the slot's accepted positions.

    ``ordinal`` (C2) is the ordinal the entry builds on: for a decode, the ordinal of the first token of the run
    whose last token is the pending input (under overlap, the run of the step still in flight, which begins at
    the count the scheduler has committed); for a prefill chunk, 0. The executor refuses any other value. The
    ordinals of the tokens a step produces are the executor's to assign and come back in the result.

    ``sample`` is False for a middle chunk of a chunked prefill: nothing is sampled (C10). ``constrained``: the
    executor samples under the grammar masks fenced at the request's ordinal (C3), fetched while the forward
    runs (C4). ``new_pages``: pages appended to the request's page table since its previous entry (its first
    pages on the first entry); with the pages sent before they cover every position the run writes.
    """

    request_id: str
    slot: int
    ordinal: int
    input_ids: tuple[int, ...] = ()
    input_ref: bool = False
    num_draft: int = 0
    sample: bool = True
    new_pages: tuple[int, ...] = ()
    new: NewRequest | None = None
    constrained: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens this entry feeds to the forward (the pending token counts one)."""
        return int(self.input_ref) + len(self.input_ids) + self.num_draft

    @property
    def is_prefill(self) -> bool:
        return not self.input_ref


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    entries: tuple[StepEntry, ...]

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


# Not frozen, and never mutated: built per request per step on the hot path, where a frozen dataclass's __init__
# (one object.__setattr__ per field) costs five times as much. Slots keep it small.
@dataclass(slots=True)
class SampledRun:
    """The tokens one sampling entry produced, the first at ``ordinal``, the next at ``ordinal + 1``, ...

    ``num_drafted`` draft tokens were verified and ``num_accepted`` of them accepted: ``token_ids`` holds the
    accepted ones, then the token sampled after them (``len(token_ids) == num_accepted + 1``). ``logprobs`` and
    ``top_logprobs`` have one item per token when computed.

    ``error`` is set (and ``token_ids`` empty) when the executor could not sample this row, e.g. its fenced
    grammar mask did not arrive (C3): the scheduler ends that request, the others go on."""

    request_id: str
    ordinal: int
    token_ids: tuple[int, ...]
    num_drafted: int = 0
    num_accepted: int = 0
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    error: str | None = None

    @property
    def end_ordinal(self) -> int:
        """The ordinal after the run's last token."""
        return self.ordinal + len(self.token_ids)


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went on the executor, in seconds since the step began there.

    ``masks_started`` is when the step asked for its fenced grammar masks (None: no constrained row). With
    delayed sampling it comes before ``forward_started``: the wait at the fence overlaps the forward (C4).
    ``masks_ready`` is when those masks were in hand, after ``forward_done``: what sampling waited for them past the
    forward is :attr:`mask_wait_seconds` (the grammar's share of the step's critical path).
    ``forward_cpu`` is the CPU time of the thread that ran the forward, from its start to ``forward_done``.
    ``draft_seconds``: how long the speculative proposer took, before the forward."""

    masks_started: float | None = None
    forward_started: float = 0.0
    forward_done: float = 0.0
    done: float = 0.0
    forward_cpu: float = 0.0
    draft_seconds: float = 0.0
    masks_ready: float | None = None

    @property
    def forward_seconds(self) -> float:
        return self.forward_done - self.forward_started

    @property
    def mask_wait_seconds(self) -> float | None:
        """How long sampling waited for the masks after the forward (None: no constrained row)."""
        return None if self.masks_ready is None else self.masks_ready - self.forward_done


@dataclass(frozen=True)
class StepResult:
    step_id: int
    runs: tuple[SampledRun, ...]
    timing: StepTiming = StepTiming()


class StepRunner(Protocol):
    """The executor as the scheduler's loop sees it: in process (:class:`ModelRunner`) or over gRPC.

    Steps run in launch order; a release is queued behind every step launched before it (C9)."""

    info: ModelInfo

    def launch(self, plan: StepPlan) -> Future[StepResult]: ...

    def release(self, slots: Sequence[int]) -> Future[None]: ...

    def shutdown(self) -> None: ...

    def healthy(self) -> bool:
        """True when the executor answers now (bounded wait)."""
        ...

    def take_loss(self) -> str | None:
        """Why the executor lost its state (KV, buffers) if no launched step has reported it yet; else None."""
        ...
