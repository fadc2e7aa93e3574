"""Whether a large batch drafts, judged by measured steps.

At a large batch the spec rule's model (spec_policy) extrapolates: its verify cost is fitted mostly on plain steps
(a drafting step's rows priced as requests), its draft cost on steps where four requests explore (a forward's cost
taken as a request's), and its acceptance leans on an engine-wide record that fades during plain stretches. At 32
streams on a 2-core host it modelled a full-depth step at 46 ms for 88 tokens, where one measured 24 ms for 142
(docs/speculative.md, eighteenth session). It also costs: 0.26 ms of scheduler CPU a step at 32 requests, 4% of a
plain step there.

The verdict does not extrapolate. Per batch regime (the batch's size to the nearest power of two), it keeps what a
step costs a request, measured: a plain step's, and a steady whole-batch draft's at the full depth (one whose drafts
read a token or so each first: a switch's catch-up is not the steady cost). With the tokens a full-depth verify
keeps (measured on every such verify, whichever requests drafted), drafting's rate over plain's is

    ratio = tokens per verify · plain cost / (draft cost + switch)

where ``switch`` is, while the batch decodes plainly, the catch-up its drafts would read first (the draft model's
cost per token, times each request's catch-up spread over the steps it has left: spec_policy's ``_switch_share``),
per request. The batch drafts while the ratio exceeds ``stay``, and starts only above ``enter``: the two apart so
that noise near the break-even does not flip it back and forth, each switch re-reading what its drafts missed.
While plain, a few requests draft now and then (the rule's exploring step, after gaps that double per regime), and
their verifies keep the tokens per verify current.

The draft cost is measured by a probe: the whole batch drafts at the full depth until ``probe_measures`` steady steps
are measured. A probe pays its drafts' catch-up whole, and where plain then wins its few steps win none of it back,
so a probe is taken only where the catch-up is cheap (at most ``probe_catch_up`` plain steps): typically a batch of
new requests, whose drafts read only their prompts. Until then the model decides. The cost a probe measures belongs
to the machine and the batch size, not to the prompts, so it is kept; it is probed again (``refresh`` steps on, the
gap doubling) only while plain wins and only where a cost off by a third could change the verdict (a steady ratio
of at least ``refresh_floor``): a first measure taken cold, or on a machine since less loaded, is corrected there.

The verdict weighs plain against the full depth only: where a shallower draft alone would pay at a large batch, it
decodes plainly (the model, which weighs every depth, decides below ``from_requests`` and before a probe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class Verdict(Enum):
    """What the measured steps say a large batch should do this step."""

    PLAIN = "plain"  # decode plainly
    EXPLORE = "explore"  # decode plainly but for a few requests, which draft: what drafting keeps, measured cheaply
    DRAFT = "draft"  # the whole batch drafts at the full depth (plain probes as the rule schedules them)
    PROBE = "probe"  # the whole batch drafts at the full depth to measure what that costs here


@dataclass(frozen=True)
class VerdictConfig:
    from_requests: int = 5  # the smallest batch judged by measure (below, the spec rule's model decides)
    cost_weight: float = 0.2  # weight of a new step in a regime's measured cost
    accept_weight: float = 0.05  # weight of a new full-depth verify in the measured tokens per verify
    enter: float = 1.05  # drafting's rate over plain's above which a plain batch starts drafting
    stay: float = 1.0  # and below which a drafting batch stops
    refresh: int = 256  # steps after which a regime's draft cost, unmeasured since (plain won), is probed again
    max_refresh: int = 4096  # that gap doubles with each probe up to this
    refresh_floor: float = 0.75  # the steady ratio from which a refresh could change the verdict
    probe_measures: int = 3  # steady steps a probe measures
    probe_steps: int = 6  # the most steps a probe drafts for (a step with a prefill measures nothing)
    probe_catch_up: float = 2.0  # a probe only where its drafts' catch-up costs at most this many plain steps
    steady_catch_up: float = 1.5  # catch-up tokens per drafting request up to which a drafting step is steady
    explore_every: int = 16  # the first gap between explorations of a plain regime
    max_explore_every: int = 256  # the gap doubles after each up to this


@dataclass(frozen=True)
class PlannedBatch:
    """A pure decode step as the scheduler planned it: its decodes, how many of them were given draft positions, and
    the deepest. Planned, not as drafted: an n-gram lookup that finds no match drafts nothing for a request given
    positions, and the step is still the whole-batch draft the verdict weighs."""

    requests: int = 0
    drafting: int = 0
    depth: int = 0


def regime(requests: int) -> int:
    """The batch regime of ``requests`` decodes: the nearest power of two (5, 6-11, 12-22, 23-45, ...), so that a
    batch of a round size that gains or loses a few requests stays in one."""
    return round(math.log2(max(requests, 1)))


@dataclass
class _Regime:
    """One batch regime's measured costs, in seconds a request, and its current verdict."""

    plain: float | None = None
    draft: float | None = None
    measured: int = 0  # the step of the last steady draft measured
    probe_until: int = -1  # a probe ends at this step at the latest
    measures_left: int = 0  # steady steps the probe under way has still to measure (0: none under way)
    refresh: int = 0  # the gap after which the draft cost is probed again while plain wins (doubling)
    drafting: bool = False
    explore_gap: int = 0  # the gap to the exploration after the next (doubling)
    next_explore: int = 0  # the step of the next exploration while plain


def _mean(old: float | None, sample: float, weight: float) -> float:
    return sample if old is None else old + weight * (sample - old)


@dataclass
class BatchVerdict:
    """Measured costs per batch regime and the tokens a full-depth verify keeps; judges a large batch's step."""

    config: VerdictConfig = VerdictConfig()
    _regimes: dict[int, _Regime] = field(default_factory=dict)
    _tokens: float | None = None  # tokens a full-depth verify keeps (accepted drafts and the sampled one)
    _ratio: float = 0.0  # the last judged ratio

    @property
    def tokens(self) -> float:
        """Tokens a full-depth verify keeps, as measured (1 before any)."""
        return 1.0 if self._tokens is None else self._tokens

    @property
    def ratio(self) -> float:
        """Drafting's rate over plain's as last judged (0: not judged)."""
        return self._ratio

    def judge(self, requests: int, step: int, catch_up: float, switch: float) -> Verdict | None:
        """The verdict for a step of ``requests`` decodes at ``step``, whose drafts would first read ``catch_up``
        seconds of tokens they missed, ``switch`` seconds a step once spread over the steps the batch has left; None
        where the model decides: a batch under ``from_requests``, or one whose drafting cost is not measured yet and
        cannot be now."""
        if requests < self.config.from_requests:
            return None
        here = self._regime(requests)
        if here.measures_left and step < here.probe_until:
            return Verdict.PROBE
        here.measures_left = 0
        # A probe pays its catch-up whole (its few steps win none of it back where plain then wins): only where that
        # is cheap, as at a batch of new requests whose drafts read only their prompts.
        cheap = here.plain is not None and catch_up <= self.config.probe_catch_up * here.plain * requests
        if here.draft is None:
            return self._probe(here, step) if cheap else None
        if here.plain is None or self._tokens is None:
            return None
        # A refresh where a draft cost off by a third could change the verdict, and only while plain wins: a drafting
        # batch measures its cost on every step.
        near = self._tokens * here.plain / here.draft >= self.config.refresh_floor
        if not here.drafting and step - here.measured >= here.refresh and cheap and near:
            here.refresh = min(2 * here.refresh, self.config.max_refresh)
            return self._probe(here, step)
        self._ratio = self._tokens * here.plain / (here.draft + (0.0 if here.drafting else switch / requests))
        drafting = self._ratio > (self.config.stay if here.drafting else self.config.enter)
        if drafting != here.drafting:  # a new course: explorations start again at the shortest gap, after it
            here.drafting, here.explore_gap = drafting, self.config.explore_every
            here.next_explore = step + here.explore_gap
        if drafting:
            return Verdict.DRAFT
        return self._explore(here, step)

    def _probe(self, here: _Regime, step: int) -> Verdict:
        here.probe_until, here.measures_left = step + self.config.probe_steps, self.config.probe_measures
        return Verdict.PROBE

    def _explore(self, here: _Regime, step: int) -> Verdict:
        """While a regime decodes plainly: an exploring step once per gap, the gap doubling up to
        ``max_explore_every``. Kept per regime: a batch's tail, a few requests that draft, does not make the large
        batch explore again at the shortest gap (each exploration there costs most of a plain step)."""
        if step < here.next_explore:
            return Verdict.PLAIN
        here.next_explore = step + here.explore_gap
        here.explore_gap = min(2 * here.explore_gap, self.config.max_explore_every)
        return Verdict.EXPLORE

    def _regime(self, requests: int) -> _Regime:
        here = self._regimes.get(regime(requests))
        if here is None:
            config = self.config
            here = self._regimes[regime(requests)] = _Regime(explore_gap=config.explore_every, refresh=config.refresh)
        return here

    def observe_step(self, batch: PlannedBatch, full_depth: int, seconds: float, catch_up: int, step: int) -> None:
        """A committed pure decode step planned as ``batch`` (the full depth being ``full_depth``), whose drafting
        requests read ``catch_up`` tokens first, that took ``seconds``."""
        requests = batch.requests
        if requests < self.config.from_requests or seconds <= 0.0:
            return
        here = self._regime(requests)
        if not batch.drafting:
            here.plain = _mean(here.plain, seconds / requests, self.config.cost_weight)
            return
        whole = batch.depth == full_depth and 4 * batch.drafting >= 3 * requests  # paused requests aside
        if whole and catch_up <= self.config.steady_catch_up * batch.drafting:
            # A probe's first steady step starts the measure afresh: what it refreshes was measured long ago.
            first = here.measures_left == self.config.probe_measures
            here.draft = _mean(None if first else here.draft, seconds / requests, self.config.cost_weight)
            here.measured = step
            here.measures_left = max(here.measures_left - 1, 0)

    def observe_verify(self, accepted: int) -> None:
        """A verified full-depth draft that kept ``accepted`` of its tokens."""
        self._tokens = _mean(self._tokens, 1.0 + accepted, self.config.accept_weight)
