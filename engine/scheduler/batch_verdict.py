"""Whether a large batch drafts, judged by measured steps.

At a large batch the spec rule's model (spec_policy) extrapolates: its verify cost is fitted mostly on plain steps
(a drafting step's rows priced as requests), its draft cost on steps where four requests explore (a forward's cost
taken as a request's), and its acceptance leans on an engine-wide record that fades during plain stretches. At 32
streams on a 2-core host it modelled a full-depth step at 46 ms for 88 tokens, where one measured 24 ms for 142
(docs/speculative.md, eighteenth session). It also costs 0.26 ms of scheduler CPU a step at 32 requests.

The verdict does not extrapolate. Per batch regime (the batch's size to the nearest power of two), it keeps what a
step costs a request, measured: a plain step's, and a steady whole-batch draft's at the full depth (one whose drafts
read a token or so each first: a switch's catch-up is not the steady cost); and, engine-wide, the tokens a full-depth
verify keeps, a step's verifies averaged as one sample. Drafting's rate over plain's is then

    ratio = tokens per verify · plain cost / (draft cost + switch)

where ``switch`` is, while the batch decodes plainly, the catch-up its drafts would read first (the draft model's
cost per token, times each request's catch-up spread over the steps it has left: spec_policy's ``_switch_share``),
per request.

The tokens per verify are those the batch is expected to keep over the rest of its requests' lives (life_tokens),
from the tokens verifies kept at each output position (buckets that double: [0, 16), [16, 32), [32, 64), ...). A
request's acceptance moves along its output: on the bench's fresh prompts at 32 streams a verify kept 2.7 tokens over
a request's first 16 outputs and 4.2-5.7 later. A probe is taken where the catch-up is cheap, at a new batch's first
steps, so the tokens it measured itself were the batch's weakest phase: it read 1.0-1.2 on eight of eleven new
batches, where drafting their whole lives won 7-17% (docs/speculative.md, twentieth session). Judged over the batch's
life, the probe's own verifies weigh only its requests' first outputs. Before any position is measured, the tokens
measured lately stand in.

A batch starts drafting only on a probe's measure: the whole batch drafts at the full depth until ``probe_measures``
steady steps are measured, then decodes plainly for ``pair_measures`` steps, and both costs and the tokens are taken
afresh from those steps. Paired, because a step's cost moves with its requests' lengths (at 32 streams here, plain
steps of one batch went from 6 ms to 9 ms as it wrote its 96 tokens), so a draft measured on a new batch against a
plain cost measured at the end of the last one read a loss of 14% as a win of 30%. The batch drafts where the probe's
ratio exceeds ``enter`` and goes on while it exceeds ``stay``. Both leave a margin for what a step's cost does not
hold: a whole batch's drafts beside a prefill (steps that carry prefill chunks measure nothing; at 32 streams such a
step with the batch drafting cost five plain ones) and a batch whose requests end at different steps. While plain, a
few requests draft now and then (the rule's exploring steps, after gaps that double per regime): their verifies
keep the tokens current, and where they promise drafting pays, the batch probes again (at most once per
``promise_gap`` steps), never drafting on their word alone.

A probe pays its drafts' catch-up whole, and where plain then wins its few steps win none of it back, so a probe is
taken only where the catch-up is cheap (at most ``probe_catch_up`` plain steps: typically a batch of new requests,
whose drafts read only their prompts) and no request is waiting or prefilling. Until a regime is probed the model
decides. Its costs belong to the machine and the batch size more than to the prompts; they are probed again while
plain wins only after ``refresh`` steps (the gap doubling) and only where a cost off by a third could change the
verdict (a ratio of at least ``refresh_floor``): a first measure taken cold, or on a machine since less loaded.

The verdict weighs plain against the full depth only: where a shallower draft alone would pay at a large batch, it
decodes plainly (the model, which weighs every depth, decides below ``from_requests`` and before a probe).
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_right
from collections.abc import Callable, Sequence
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
    draft_weight: float = 0.2  # weight of a new steady step in a regime's measured drafting cost
    plain_weight: float = 0.2  # of a new plain step in its plain cost
    accept_weight: float = 0.2  # of a step's full-depth verifies in the measured tokens per verify
    spike: float = 1.3  # a step's cost counts at most this multiple of its measure (an interruption only adds time)
    enter: float = 1.1  # drafting's rate over plain's above which a plain batch starts drafting (after a probe)
    stay: float = 1.0  # and below which a drafting batch stops
    promise_gap: int = 64  # the fewest steps between two probes where the explorations promise drafting pays
    refresh: int = 256  # steps after which a regime's draft cost, unmeasured since (plain won), is probed again
    max_refresh: int = 4096  # that gap doubles with each probe up to this
    refresh_floor: float = 0.75  # the ratio from which a refresh could change the verdict
    probe_measures: int = 3  # steady drafting steps a probe measures
    pair_measures: int = 2  # plain steps measured right after it, at the same lengths
    probe_steps: int = 6  # the most steps a probe drafts for (a step with a prefill measures nothing)
    probe_catch_up: float = 2.0  # a probe only where its drafts' catch-up costs at most this many plain steps
    steady_catch_up: float = 1.5  # catch-up tokens per drafting request up to which a drafting step is steady
    explore_every: int = 16  # the first gap between explorations of a plain regime
    max_explore_every: int = 256  # the gap doubles after each up to this
    life_horizon: int = 256  # the most output tokens ahead of a request its remaining life is judged over
    position_least: int = 16  # verifies at an output position's bucket from which its measure counts


@dataclass(frozen=True)
class PlannedBatch:
    """A pure decode step as the scheduler planned it: its decodes, how many of them were given draft positions, and
    the deepest. Planned, not as drafted: an n-gram lookup that finds no match drafts nothing for a request given
    positions, and the step is still the whole-batch draft the verdict weighs."""

    requests: int = 0
    drafting: int = 0
    depth: int = 0


def regime(requests: int) -> int:
    """The batch regime of ``requests`` decodes: the nearest power of two (3-5, 6-11, 12-22, 23-45, ...), so that a
    batch of a round size that gains or loses a few requests stays in one."""
    return round(math.log2(max(requests, 1)))


class _Measure:
    """A measured quantity (a step's cost in seconds a request, the tokens a verify keeps): from the samples since it
    was last started afresh, then a moving average (a step's cost drifts with its requests' lengths and the host's
    load, the tokens with the prompts).

    A cost (``spike`` set) is measured robustly: a host's interruptions only ever add time, and at 32 streams one
    drafting step in seven to ten took 1.3-2x its neighbours (docs/speculative.md, twenty-second session). Its fresh
    samples give their lower median (a probe's three drafting steps their median, its two plain steps the lower), and
    a later sample counts at most ``spike`` times the measure. Left to the mean, one step among a probe's three that
    took twice its time raised the drafting cost by a third: a probe at 1.3x plain's rate read 0.98x. The tokens are
    not clipped: a verify keeps anything from 1 to the depth's."""

    def __init__(self, weight: float, spike: float | None = None) -> None:
        self.weight = weight
        self.spike = spike
        self.value: float | None = None
        self.samples = 0
        self._fresh: list[float] = []  # a cost's samples since the restart, up to 1 / weight of them

    def add(self, sample: float) -> None:
        self.samples += 1
        old = self.value
        if self.spike is not None and self.samples <= 1.0 / self.weight:
            self._fresh.append(sample)
            self.value = statistics.median_low(self._fresh)
            return
        if old is None:
            self.value = sample
            return
        if self.spike is not None:
            sample = min(sample, self.spike * old)
        self.value = old + max(self.weight, 1.0 / self.samples) * (sample - old)

    def restart(self) -> None:
        """The next sample starts the measure afresh (kept till then)."""
        self.samples = 0
        self._fresh.clear()


# A request's output position buckets for the tokens a verify keeps: [0, 16), [16, 32), [32, 64), ... doubling.
POSITION_EDGES: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)


class _ByPosition:
    """Tokens a full-depth verify keeps, by the verified request's output position (the tokens it had written), in
    buckets that double (POSITION_EDGES). A request's acceptance moves along its output: on the bench's prompts at 32
    streams a verify kept 2.7 tokens over a request's first 16 outputs and 5.6 from its 32nd on (fresh prompts), 2.0
    and 3.9 (repeating ones).

    A bucket's measure is its tokens over its verifies, both sums fading by ``1 - weight`` with each step that adds to
    them: a step's weight is its verifies there, not one sample whatever their number. The requests that reach a
    position first are those whose drafts were accepted most, so in a batch whose requests began together a later
    bucket's first verifies are the batch's best: taken a step each as a whole sample, three fast requests past their
    64th output set the bucket's value for a batch of 32 (on the repeating prompts the life read 5.1 tokens a verify
    where the batch's verifies kept 3.2). Weighed by their verifies, the slower requests that follow weigh as they
    cost: the bucket's tokens over its verifies is what a request's remaining outputs there cost in verifies. A
    bucket counts from ``least`` verifies."""

    def __init__(self, weight: float, least: int) -> None:
        self._keep = 1.0 - weight
        self._least = least
        self._sums = [[0.0, 0.0, 0] for _ in range(len(POSITION_EDGES) + 1)]  # per bucket: tokens, verifies, seen
        self._step = [[0.0, 0.0] for _ in self._sums]  # per bucket: the committing step's tokens, verifies

    def add(self, position: int, tokens: float) -> None:
        here = self._step[bisect_right(POSITION_EDGES, position)]
        here[0] += tokens
        here[1] += 1.0

    def close_step(self) -> None:
        for sums, here in zip(self._sums, self._step, strict=True):
            if here[1]:
                sums[0] = self._keep * sums[0] + here[0]
                sums[1] = self._keep * sums[1] + here[1]
                sums[2] += int(here[1])
                here[0] = here[1] = 0.0

    def values(self) -> list[float] | None:
        """Tokens a verify keeps in each bucket, one not measured yet (fewer than ``least`` verifies) taking its
        nearest measured neighbour's value (None: none measured)."""
        known = [(i, t / v) for i, (t, v, seen) in enumerate(self._sums) if seen >= self._least]
        if not known:
            return None
        return [min(known, key=lambda k: abs(k[0] - i))[1] for i in range(len(self._sums))]

    @staticmethod
    def up_to(values: list[float]) -> Callable[[int], float]:
        """The verifies the outputs before a position are expected to take at ``values``: each bucket's whole share
        summed once, so that a request's remaining life costs two lookups (a plan prices every decode's)."""
        whole = [0.0]  # the verifies before each bucket's lower edge
        for i, upper in enumerate(POSITION_EDGES):
            whole.append(whole[-1] + (upper - (POSITION_EDGES[i - 1] if i else 0)) / values[i])

        def before(position: int) -> float:
            bucket = bisect_right(POSITION_EDGES, position)
            lower = POSITION_EDGES[bucket - 1] if bucket else 0
            return whole[bucket] + (position - lower) / values[bucket]

        return before


@dataclass
class _Regime:
    """One batch regime's measured costs, in seconds a request, and its current verdict."""

    plain: _Measure
    draft: _Measure
    refresh: int  # the gap after which the draft cost is probed again while plain wins (doubling)
    explore_gap: int  # the gap to the exploration after the next (doubling)
    measured: int = 0  # the step of the last steady draft measured
    probed: int = -(10**9)  # the step the last probe began
    probe_until: int = -1  # a probe ends at this step at the latest
    measures_left: int = 0  # steady drafting steps the probe under way has still to measure (0: none under way)
    pairs_left: int = 0  # plain steps it has still to measure, right after it
    judge_probe: bool = False  # a probe and its plain steps are measured: the next verdict is theirs
    drafting: bool = False
    next_explore: int = 0  # the step of the next exploration while plain


@dataclass
class BatchVerdict:
    """Measured costs per batch regime and the tokens a full-depth verify keeps; judges a large batch's step."""

    config: VerdictConfig = VerdictConfig()
    _regimes: dict[int, _Regime] = field(default_factory=dict)
    _tokens: _Measure = field(init=False)  # tokens a full-depth verify keeps (accepted drafts and the sampled one)
    _by_position: _ByPosition = field(init=False)  # the same, by the verified request's output position
    _ratio: float = 0.0  # the last judged ratio
    _step_tokens: float = 0.0  # the committing step's full-depth verifies: their tokens
    _step_verifies: int = 0  # and their count

    def __post_init__(self) -> None:
        self._tokens = _Measure(self.config.accept_weight)
        self._by_position = _ByPosition(self.config.accept_weight, self.config.position_least)

    @property
    def tokens(self) -> float:
        """Tokens a full-depth verify keeps, as measured (1 before any)."""
        return 1.0 if self._tokens.value is None else self._tokens.value

    @property
    def ratio(self) -> float:
        """Drafting's rate over plain's as last judged (0: not judged)."""
        return self._ratio

    def life_tokens(self, spans: Sequence[tuple[int, int]]) -> float | None:
        """Tokens a full-depth verify is expected to keep over the rest of a batch whose requests have each written
        ``spans[i][0]`` tokens and may write ``spans[i][1]`` more (at most ``life_horizon``): the batch's tokens over
        the verifies they would take, by the measure per output position (None: none measured). A whole-batch draft
        pays or not over the batch's life, not over its next few steps: a batch measured where its requests begin
        reads their weakest phase."""
        values = self._by_position.values()
        if values is None:
            return None
        before = _ByPosition.up_to(values)
        tokens = verifies = 0.0
        for start, left in spans:
            count = min(max(left, 1), self.config.life_horizon)
            tokens, verifies = tokens + count, verifies + before(start + count) - before(start)
        return tokens / verifies if verifies else None

    def judge(
        self, requests: int, step: int, catch_up: float, switch: float, quiet: bool = True, life: float | None = None
    ) -> Verdict | None:
        """The verdict for a step of ``requests`` decodes at ``step``, whose drafts would first read ``catch_up``
        seconds of tokens they missed, ``switch`` seconds a step once spread over the steps the batch has left, and
        whose verifies are expected to keep ``life`` tokens each over the batch's remaining life (life_tokens; None:
        the tokens measured lately, whatever the positions); None where the model decides: a batch under
        ``from_requests``, or one whose drafting cost is not measured yet and cannot be now."""
        if requests < self.config.from_requests:
            return None
        here = self._regime(requests)
        if here.measures_left and step < here.probe_until:
            return Verdict.PROBE
        here.measures_left = 0
        if here.pairs_left:
            return Verdict.PLAIN  # the probe's plain steps, measured at its lengths
        # A probe pays its catch-up whole (its few steps win none of it back where plain then wins): only where that
        # is cheap, as at a batch of new requests whose drafts read only their prompts.
        # And only in a pure decode step: a prefill chunk in it (other requests being admitted) measures nothing, and a
        # whole batch's drafts beside a prefill made such a step cost five plain steps at 32 streams.
        plain_cost = here.plain.value
        cheap = quiet and plain_cost is not None and catch_up <= self.config.probe_catch_up * plain_cost * requests
        if here.draft.value is None:
            return self._probe(here, step) if cheap else None
        tokens = self._tokens.value if life is None else life  # both fed by the same verifies: life implies a value
        if here.plain.value is None or tokens is None:
            return None
        after_probe, here.judge_probe = here.judge_probe, False
        behind = 0.0 if here.drafting or after_probe else switch / requests
        self._ratio = tokens * here.plain.value / (here.draft.value + behind)
        if here.drafting:
            drafting = self._ratio > self.config.stay
        elif after_probe:
            drafting = self._ratio > self.config.enter
        else:
            # Plain: a batch starts drafting only on a probe's direct measure (its own tokens and costs, and plain's
            # at the same lengths), never on a few explorers' verifies against costs measured at other lengths. A
            # probe where those promise drafting pays, or now and then where a cost off by a third could change the
            # verdict.
            drafting = False
            promising = self._ratio > self.config.enter and step - here.probed >= self.config.promise_gap
            stale = step - here.measured >= here.refresh and self._ratio >= self.config.refresh_floor
            if cheap and (promising or stale):
                if stale:
                    here.refresh = min(2 * here.refresh, self.config.max_refresh)
                return self._probe(here, step)
        if drafting != here.drafting:  # a new course: explorations start again at the shortest gap, after it
            here.drafting, here.explore_gap = drafting, self.config.explore_every
            here.next_explore = step + here.explore_gap
        if drafting:
            return Verdict.DRAFT
        return self._explore(here, step)

    def _probe(self, here: _Regime, step: int) -> Verdict:
        """The whole batch drafts for ``probe_measures`` steady steps, then decodes plainly for ``pair_measures``:
        both costs measured afresh at the batch's lengths now."""
        here.probed, here.probe_until = step, step + self.config.probe_steps
        here.measures_left, here.pairs_left = self.config.probe_measures, 0
        here.draft.restart()
        self._tokens.restart()  # the probe's own verifies, the whole batch's
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
        key = regime(requests)
        here = self._regimes.get(key)
        if here is None:
            config = self.config
            here = self._regimes[key] = _Regime(
                _Measure(config.plain_weight, config.spike),
                _Measure(config.draft_weight, config.spike),
                config.refresh,
                config.explore_every,
            )
        return here

    def observe_step(self, batch: PlannedBatch, full_depth: int, seconds: float, catch_up: int, step: int) -> None:
        """A committed pure decode step planned as ``batch`` (the full depth being ``full_depth``), whose drafting
        requests read ``catch_up`` tokens first, that took ``seconds``."""
        self.close_step()
        requests = batch.requests
        if requests < self.config.from_requests or seconds <= 0.0:
            return
        here = self._regime(requests)
        if not batch.drafting:
            if here.pairs_left:
                if here.pairs_left == self.config.pair_measures:
                    here.plain.restart()
                here.pairs_left -= 1
                here.judge_probe = not here.pairs_left
            here.plain.add(seconds / requests)
            return
        whole = batch.depth == full_depth and 4 * batch.drafting >= 3 * requests  # paused requests aside
        if whole and catch_up <= self.config.steady_catch_up * batch.drafting:
            here.draft.add(seconds / requests)
            here.measured = step
            if here.measures_left:
                here.measures_left -= 1
                here.pairs_left = 0 if here.measures_left else self.config.pair_measures

    def observe_verify(self, accepted: int, position: int = 0) -> None:
        """A verified full-depth draft that kept ``accepted`` of its tokens (in the step committing now), for a request
        that had written ``position`` tokens."""
        self._step_tokens += 1.0 + accepted
        self._step_verifies += 1
        self._by_position.add(position, 1.0 + accepted)

    def close_step(self) -> None:
        """The committing step's verifies are all in: their mean joins the tokens per verify, a step's weight
        whatever its size (an exploring step's four verifies and a whole batch's 32 alike)."""
        if self._step_verifies:
            self._tokens.add(self._step_tokens / self._step_verifies)
        self._step_tokens, self._step_verifies = 0.0, 0
        self._by_position.close_step()
