"""What crosses the scheduler/executor boundary: step plans and step results.

These values are the in-process form of the executor protocol; the services map them to protos unchanged.
Vocabulary (DESIGN.md section 3): a request's *ordinal* is the number of its output tokens committed; a
*step* is one forward launched by the scheduler, ids strictly increasing.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """Sent with a request's first entry: what the executor needs to set up its per-request buffer."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class StepEntry:
    """One request's part of a step.

    ``ordinal`` is the number of output tokens that precede the token this entry samples (C2): the token
    comes out at output index ``ordinal``. Under overlap it counts the token of the step still in flight.
    ``input_ref`` means the single input token is the one this slot sampled last, which the scheduler does
    not know yet: the executor resolves it from its own per-request buffer, with no round trip.
    ``sample`` is False for a middle chunk of a chunked prefill: nothing is sampled (C10). ``constrained``: the
    executor samples under the grammar mask fenced at ``ordinal`` (C3), fetched while the forward runs (C4).
    """

    request_id: str
    slot: int
    ordinal: int
    start_pos: int
    input_ids: tuple[int, ...]
    input_ref: bool
    page_table: tuple[int, ...]
    sample: bool
    new: NewRequest | None = None
    constrained: bool = False

    @property
    def num_tokens(self) -> int:
        return 1 if self.input_ref else len(self.input_ids)

    @property
    def end_pos(self) -> int:
        """Positions [0, end_pos) hold KV once this entry's forward completes."""
        return self.start_pos + self.num_tokens


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    entries: tuple[StepEntry, ...]

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


@dataclass(frozen=True)
class SampledToken:
    """One sampled token of a step result, naming the ordinal it was sampled at.

    ``error`` is set (and ``token_id`` meaningless) when the executor could not sample this row, e.g. its fenced
    grammar mask did not arrive (C3): the scheduler ends that request, the others go on."""

    request_id: str
    ordinal: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepResult:
    step_id: int
    samples: tuple[SampledToken, ...]
    forward_seconds: float = 0.0
