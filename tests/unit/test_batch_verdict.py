"""The measured verdict on a large batch's drafting (engine/scheduler/batch_verdict.py): costs per batch regime from
committed steps, the tokens a full-depth verify keeps, and the choice, probe and exploration they make.

Each test reports steps as the scheduler would (decodes, drafting requests, whether at the full depth, seconds, the
catch-up tokens read first) and asks for the verdict of the next step."""

from __future__ import annotations

import itertools

import pytest

from engine.scheduler.batch_verdict import BatchVerdict, PlannedBatch, Verdict, VerdictConfig, regime

BATCH = 32
PLAIN = 0.2e-3  # seconds a request of a plain step at 32 streams (6.4 ms a step)
DRAFT = 0.8e-3  # of a steady full-depth drafting step (25.6 ms a step): drafting pays above 4 tokens a verify


DEPTH = 4  # the full depth


def _plain(verdict: BatchVerdict, requests: int, seconds: float, step: int) -> None:
    """A committed plain step of ``requests`` decodes."""
    verdict.observe_step(PlannedBatch(requests), DEPTH, seconds, 0, step)


def _whole(verdict: BatchVerdict, requests: int, seconds: float, catch_up: int, step: int) -> None:
    """A committed step where every decode drafted the full depth, their drafts reading ``catch_up`` tokens first."""
    verdict.observe_step(PlannedBatch(requests, requests, DEPTH), DEPTH, seconds, catch_up, step)


def _verifies(verdict: BatchVerdict, tokens: float, steps: int = 20, position: int = 0) -> None:
    """``steps`` steps of 32 full-depth verifies whose tokens average ``tokens``: accepted counts spread evenly around
    its mean, for requests that had written ``position`` tokens."""
    low = int(tokens - 1.0)
    share = tokens - 1.0 - low  # of the verifies, those keeping one more
    for i in range(steps * BATCH):
        verdict.observe_verify(low + (1 if (i * share) % 1.0 + share >= 1.0 else 0), position)
        if i % BATCH == BATCH - 1:
            verdict.close_step()


def _probed(
    tokens: float,
    plain: float = PLAIN,
    draft: float = DRAFT,
    batch: int = BATCH,
    verdict: BatchVerdict | None = None,
    position: int = 0,
    drafts: tuple[float, float, float] = (1.0, 1.0, 1.0),
    pairs: tuple[float, float] = (1.0, 1.0),
) -> BatchVerdict:
    """A verdict (``verdict``, or a new one) that measured a plain step of ``batch`` decodes, then probed: three steady
    whole-batch drafts whose verifies (at output ``position``) kept ``tokens`` on average, then two plain steps at the
    same lengths. Its next verdict is the probe's. ``drafts`` and ``pairs``: each of those steps' time as a multiple
    of its cost (an interrupted step took longer)."""
    verdict = BatchVerdict() if verdict is None else verdict
    _plain(verdict, batch, plain * batch, 0)
    assert verdict.judge(batch, 1, 0.0, 0.0) is Verdict.PROBE
    for step, slower in zip((1, 2, 3), drafts, strict=True):
        _verifies(verdict, tokens, steps=1, position=position)
        _whole(verdict, batch, slower * draft * batch, batch, step)
    for step, slower in zip((4, 5), pairs, strict=True):
        assert verdict.judge(batch, step, 0.0, 0.0) is Verdict.PLAIN
        _plain(verdict, batch, slower * plain * batch, step)
    return verdict


def test_regimes_group_batches_by_the_nearest_power_of_two() -> None:
    """A batch that gains or loses a few requests stays in one regime: 23-45 together (32), 12-22 (16)."""
    assert {regime(n) for n in range(23, 46)} == {5}
    assert {regime(n) for n in range(12, 23)} == {4}


def test_a_large_batch_drafts_where_a_probe_measures_drafting_faster() -> None:
    """Drafting at 32 streams costs four plain steps here (the break-even: 4 tokens a verify). A probe that measures
    5.2 tokens a verify (1.3x plain's rate, over ``enter``, 1.1x) has the batch draft; 4.2 (1.05x) does not: the step's
    measure misses what a batch's drafts cost beside its prefills and at its ragged end, and ``enter`` leaves room for
    it. Nor does 5.2 where a draft costs five plain steps (1.04x). Fails if the verdict ignores the measured tokens
    (checked: with the tokens taken as 5, the 4.2 probe drafts)."""
    assert _probed(5.2).judge(BATCH, 6, 0.0, 0.0) is Verdict.DRAFT
    assert _probed(4.2).judge(BATCH, 6, 0.0, 0.0) in (Verdict.PLAIN, Verdict.EXPLORE)
    assert _probed(5.2, draft=1.0e-3).judge(BATCH, 6, 0.0, 0.0) in (Verdict.PLAIN, Verdict.EXPLORE)


def test_a_small_batch_is_left_to_the_model() -> None:
    """Under ``from_requests`` (5) the spec rule's model decides (None), whatever was measured; so does a large batch
    before its drafts were measured where a probe would cost."""
    verdict = BatchVerdict()
    for step in range(3):
        _plain(verdict, 4, PLAIN * 4, step)
        _whole(verdict, 4, DRAFT * 4, 4, step)
    _verifies(verdict, 5.2)
    assert verdict.judge(4, 10, 0.0, 0.0) is None
    assert verdict.judge(BATCH, 10, 0.0, 0.0) is None  # nothing measured at 32


def test_near_the_break_even_a_batch_keeps_its_course() -> None:
    """A batch starts drafting above ``enter`` (1.1x) and stops only below ``stay`` (1.0x): at 1.05x each keeps what
    it does, so noise near the margin does not flip it (each switch re-reads what the drafts missed). Fails with one
    threshold for both (checked: with ``stay`` at ``enter``, the drafting batch stops at 1.05x)."""
    verdict = _probed(4.8)  # 1.2x
    assert verdict.judge(BATCH, 6, 0.0, 0.0) is Verdict.DRAFT
    _verifies(verdict, 4.2)  # 1.05x
    assert verdict.judge(BATCH, 7, 0.0, 0.0) is Verdict.DRAFT
    _verifies(verdict, 3.8)  # 0.95x
    assert verdict.judge(BATCH, 8, 0.0, 0.0) is not Verdict.DRAFT
    _verifies(verdict, 4.2)  # 1.05x again: the plain batch stays plain, and probes nothing
    assert verdict.judge(BATCH, 9, 0.0, 0.0) in (Verdict.PLAIN, Verdict.EXPLORE)


def test_a_plain_batch_starts_drafting_only_on_a_probes_measure() -> None:
    """After a probe said plain (4.2 tokens a verify, 1.05x), its explorations' few verifies read 5.2 (1.3x): that is
    a promise, not a measure (four requests' verifies, against costs measured at other lengths). The batch probes
    again where that is cheap, ``promise_gap`` (64) steps after the last probe, and drafts only if the probe agrees;
    where its drafts would first read 5 ms of catch-up a step (amortised: the batch's end is near), the promise is
    1.09x and it does not probe. Fails if the batch drafts on the explorers' verifies (checked: DRAFT at step 7)."""
    verdict = _probed(4.2)
    assert verdict.judge(BATCH, 6, 0.0, 0.0) in (Verdict.PLAIN, Verdict.EXPLORE)
    _verifies(verdict, 5.2)
    assert verdict.judge(BATCH, 7, 0.0, 0.0) in (Verdict.PLAIN, Verdict.EXPLORE)  # within promise_gap of the probe
    assert verdict.judge(BATCH, 70, 0.0, 5e-3) in (Verdict.PLAIN, Verdict.EXPLORE)
    assert verdict.judge(BATCH, 71, 0.0, 0.0) is Verdict.PROBE


def test_an_unmeasured_regime_is_probed_only_where_its_catch_up_is_cheap_and_nothing_prefills() -> None:
    """Plain measured at 32, a whole-batch draft not. A probe pays its drafts' catch-up whole (where plain then wins,
    its few steps win none of it back): where that costs at most ``probe_catch_up`` (2) plain steps (a batch of new
    requests, whose drafts read only their prompts) the whole batch drafts for up to ``probe_steps`` steps to measure
    it; where it would cost more (drafts far behind), or while other requests prefill beside it (such a step measures
    nothing, and its drafts beside a prefill cost the most), the model decides. Fails if the catch-up or the prefill
    is not checked (checked: PROBE at three plain steps' catch-up; PROBE beside a prefill)."""
    verdict = BatchVerdict(VerdictConfig(probe_steps=3))
    _plain(verdict, BATCH, PLAIN * BATCH, 0)
    plain_step = PLAIN * BATCH
    assert verdict.judge(BATCH, 1, 3 * plain_step, 0.1 * plain_step) is None
    assert verdict.judge(BATCH, 1, 1.5 * plain_step, 0.05 * plain_step, quiet=False) is None
    assert [verdict.judge(BATCH, s, 1.5 * plain_step, 0.05 * plain_step) for s in (2, 3, 4)] == [Verdict.PROBE] * 3
    assert verdict.judge(BATCH, 5, 3 * plain_step, 0.1 * plain_step) is None  # it measured nothing: not at this price


def test_a_probe_measures_steady_steps_not_a_switch() -> None:
    """The first step of a probe reads each draft's catch-up (here 40 tokens a request, 10 ms more): not a steady
    step's cost, and the probe goes on; it ends once ``probe_measures`` (3) steady steps (a token a request) are
    measured, and its plain steps follow. Fails if the switch's step is measured (checked: the draft cost then reads
    0.88 ms a request, and 5.2 tokens a verify, 1.3x at the steady state, read 1.18x and decode plainly)."""
    verdict = BatchVerdict()
    _plain(verdict, BATCH, PLAIN * BATCH, 0)
    assert verdict.judge(BATCH, 1, 0.0, 0.0) is Verdict.PROBE
    _whole(verdict, BATCH, DRAFT * BATCH + 10e-3, 40 * BATCH, 2)
    for step in (2, 3, 4):
        assert verdict.judge(BATCH, step, 0.0, 0.0) is Verdict.PROBE
        _verifies(verdict, 5.2, steps=1)
        _whole(verdict, BATCH, DRAFT * BATCH, BATCH, step + 1)
    for step in (5, 6):
        assert verdict.judge(BATCH, step, 0.0, 0.0) is Verdict.PLAIN  # the plain steps that pair the probe
        _plain(verdict, BATCH, PLAIN * BATCH, step)
    assert verdict.judge(BATCH, 7, 0.0, 0.0) is Verdict.DRAFT


def test_a_probe_is_paired_with_plain_steps_at_its_lengths() -> None:
    """A step's cost grows with its requests' lengths (at 32 streams on this host, plain steps of one batch went from
    6 ms to 9 ms as it wrote its 96 tokens). Plain's cost was last measured at the end of a batch (0.3 ms a request),
    the probe measures a new batch's drafts (0.8 ms): its plain steps measure plain's afresh at the same lengths (0.15
    ms), and the verdict judges by those: 4 tokens a verify are 0.75x plain's rate there, not the 1.5x the old plain
    cost made them. Fails without the paired steps (checked: DRAFT right after the probe), or where they only join the
    old measure instead of starting it afresh (checked: 1.23x, DRAFT)."""
    verdict = BatchVerdict()
    for _ in range(10):
        _plain(verdict, BATCH, 0.3e-3 * BATCH, 0)
    assert verdict.judge(BATCH, 1, 0.0, 0.0) is Verdict.PROBE
    for step in (1, 2, 3):
        _verifies(verdict, 4.0, steps=1)
        _whole(verdict, BATCH, DRAFT * BATCH, BATCH, step)
    for step in (4, 5):
        assert verdict.judge(BATCH, step, 0.0, 0.0) is Verdict.PLAIN
        _plain(verdict, BATCH, 0.15e-3 * BATCH, step)
    assert verdict.judge(BATCH, 6, 0.0, 0.0) is not Verdict.DRAFT


def test_an_interrupted_step_does_not_decide_a_probe() -> None:
    """A host's interruption only adds time: at 32 streams one drafting step in seven to ten took 1.3-2x its
    neighbours. A probe whose three drafting steps took 1, 1 and 2 times their cost measures the median: 5.2 tokens a
    verify still read 1.3x and draft (their mean, 1.33 times the cost, read 0.98x). Its two plain steps at 1 and 1.5
    times their cost measure the lower: 4.2 tokens a verify read 1.05x and do not draft (their mean read 1.31x).
    Fails if the fresh samples' mean is taken (checked: the first probe decodes plainly and the second drafts)."""
    assert _probed(5.2, drafts=(1.0, 1.0, 2.0)).judge(BATCH, 6, 0.0, 0.0) is Verdict.DRAFT
    assert _probed(4.2, pairs=(1.0, 1.5)).judge(BATCH, 6, 0.0, 0.0) is not Verdict.DRAFT


def test_a_drafting_batch_is_not_stopped_by_one_interrupted_step() -> None:
    """Past its first samples a cost is a moving average, and a step counts at most ``spike`` (1.3) times the
    measure: a drafting batch at 1.3x (5.2 tokens a verify) whose step took three times its cost goes on drafting
    (the step counted in full would put the cost 40% up and the ratio at 0.93x, under ``stay``; clipped, it is 6% up
    and the ratio 1.23x). Fails without the clip (checked: PLAIN or EXPLORE after the interrupted step)."""
    verdict = _probed(5.2)
    for step in (6, 7):  # the drafting measure's fourth and fifth samples: its fresh samples are all in
        assert verdict.judge(BATCH, step, 0.0, 0.0) is Verdict.DRAFT
        _verifies(verdict, 5.2, steps=1)
        _whole(verdict, BATCH, DRAFT * BATCH, BATCH, step)
    _whole(verdict, BATCH, 3 * DRAFT * BATCH, BATCH, 8)
    assert verdict.judge(BATCH, 9, 0.0, 0.0) is Verdict.DRAFT
    assert verdict.ratio > 1.2


def test_a_plain_regime_explores_at_doubling_gaps_of_its_own() -> None:
    """A regime that decodes plainly explores (a few requests draft) after gaps that double from ``explore_every``
    (16) to ``max_explore_every`` (256), each exploration there costing most of a plain step; a smaller regime judged
    in between (a batch's tail, where drafting pays) keeps its own verdict. Fails if the gap does not grow (checked: a
    fixed period of 16 explores 63 times in these 1,000 steps, not 7)."""
    verdict = _probed(3.0)
    _plain(verdict, 8, PLAIN * 8, 6)
    assert verdict.judge(8, 7, 0.0, 0.0) is Verdict.PROBE
    for step in (7, 8, 9):
        _whole(verdict, 8, 0.3e-3 * 8, 8, step)  # at 8, a draft costs 1.5 plain steps: 3 tokens a verify are 2x
    for step in (10, 11):
        assert verdict.judge(8, step, 0.0, 0.0) is Verdict.PLAIN
        _plain(verdict, 8, PLAIN * 8, step)
    explored = []
    for step in range(12, 1012):
        if verdict.judge(BATCH, step, 0.0, 0.0) is Verdict.EXPLORE:
            explored.append(step)
        assert verdict.judge(8, step, 0.0, 0.0) is Verdict.DRAFT
    gaps = [b - a for a, b in itertools.pairwise(explored)]
    assert gaps == [16, 32, 64, 128, 256, 256], gaps


def test_a_regime_plain_for_long_is_probed_again_where_it_could_change_its_course() -> None:
    """A draft cost measured once (a cold start's, a machine since less loaded) is probed again, where the switch is
    cheap, after ``refresh`` (256) steps of plain decoding, then after gaps that double, but only where its ratio is
    within reach of the break-even (``refresh_floor``, 0.75x): a draft a third cheaper than measured could then pay.
    Far below (0.5x), no refresh. Fails without the refresh (checked: no probe), or without the floor (checked: the
    0.5x regime probes at step 256). Gaps count from the last measurement."""
    near = _probed(3.4)  # 0.85x
    probes = [s for s in range(6, 1200) if near.judge(BATCH, s, 0.0, 0.0) is Verdict.PROBE]
    starts = [s for s in probes if s - 1 not in probes]
    assert starts == [256 + 3, 512 + 3, 1024 + 3], probes  # its probes measured nothing: each from the last measure
    far = _probed(2.0)  # 0.5x
    assert not [s for s in range(6, 1200) if far.judge(BATCH, s, 0.0, 0.0) is Verdict.PROBE]


def test_the_tokens_a_verify_keeps_follow_the_verifies() -> None:
    verdict = BatchVerdict()
    assert verdict.tokens == 1.0
    _verifies(verdict, 4.4)
    assert verdict.tokens == pytest.approx(4.4, abs=0.1)


def _at(verdict: BatchVerdict, position: int, tokens: int, steps: int = 1, verifies: int = BATCH) -> None:
    """``steps`` steps of ``verifies`` full-depth verifies that each kept ``tokens``, for requests that had written
    ``position`` tokens."""
    for _ in range(steps):
        for _ in range(verifies):
            verdict.observe_verify(tokens - 1, position)
        verdict.close_step()


def test_a_batchs_remaining_life_weighs_each_output_position_by_its_own_measure() -> None:
    """Verifies kept 2 tokens over their requests' first 16 outputs and 6 later on. A request at its start with 96
    tokens to write then expects 96 tokens over 16 / 2 + 80 / 6 verifies (4.5 a verify); one at 48 with 48 to write,
    6; a budget of 1,000 is judged over ``life_horizon`` (256) tokens only (5.33); a position not measured yet takes
    its nearest measured neighbour's value; nothing measured, no estimate. Fails if the positions are not told apart
    (checked: 4.0 for all, the mean of the two measures)."""
    verdict = BatchVerdict()
    assert verdict.life_tokens([(0, 96)]) is None
    _at(verdict, 3, 2)
    _at(verdict, 20, 6)
    assert verdict.life_tokens([(0, 96)]) == pytest.approx(96 / (16 / 2 + 80 / 6))
    assert verdict.life_tokens([(48, 48)]) == pytest.approx(6.0)
    assert verdict.life_tokens([(0, 1000)]) == pytest.approx(256 / (16 / 2 + 240 / 6))
    assert verdict.life_tokens([(0, 96), (48, 48)]) == pytest.approx(144 / (16 / 2 + 80 / 6 + 48 / 6))


def test_a_later_position_is_weighed_by_its_verifies_not_by_the_requests_that_reach_it_first() -> None:
    """In a batch whose requests began together, the first to reach a later output are those whose drafts were
    accepted most. Here, past the 64th output: a step where three fast requests kept 7 tokens a verify, then one where
    the other 29 kept 3. A request's remaining outputs there cost verifies at the bucket's tokens over its verifies,
    3.3 (the fast step fading by 0.8), not the 5.0 the record read when each step's mean was a sample of a moving
    average. Fails if each step's verifies count as one sample whatever their number (checked: 4.8, the sums fading
    as here)."""
    verdict = BatchVerdict()
    _at(verdict, 70, 7, verifies=3)
    _at(verdict, 70, 3, verifies=29)
    assert verdict.life_tokens([(70, 20)]) == pytest.approx((0.8 * 21 + 87) / (0.8 * 3 + 29))


def test_a_position_counts_only_from_enough_verifies() -> None:
    """Three fast requests' verifies past the 64th output (7 tokens each, fewer than ``position_least``) do not set
    that position's measure: its outputs take the nearest counted one's (2 tokens, the first 16 outputs) until 16
    verifies are in. Fails if a bucket counts from its first verify (checked: 7.0)."""
    verdict = BatchVerdict()
    _at(verdict, 3, 2, verifies=32)
    for _ in range(5):
        _at(verdict, 70, 7, verifies=3)
    assert verdict.life_tokens([(70, 20)]) == pytest.approx(2.0)
    _at(verdict, 70, 7, verifies=3)
    assert verdict.life_tokens([(70, 20)]) == pytest.approx(7.0)


def _probed_at_start(later: int) -> BatchVerdict:
    """A verdict whose verifies kept ``later`` tokens past their requests' 16th output (an earlier batch drafted
    there), then probed a new batch at its start: three steady whole-batch drafts whose verifies (at output 3) kept
    2.8 tokens, and its two plain steps."""
    verdict = BatchVerdict()
    _at(verdict, 20, later, steps=5)
    _at(verdict, 40, later, steps=5)
    return _probed(2.8, verdict=verdict, position=3)


def test_a_probe_at_a_batchs_start_is_judged_over_the_batchs_life() -> None:
    """A request's first outputs are where a draft agrees least with its target (on the bench's fresh prompts at 32
    streams a verify kept 2.7 tokens over the first 16, 5.6 from the 32nd on), and a probe is taken where the catch-up
    is cheap: at a new batch's start. Its 2.8 tokens a verify are 0.7x plain's rate (a draft costs four plain steps);
    over the batch's 93 outputs to come, with 6 tokens a verify measured past the 16th, the batch expects 5.2 (1.3x):
    it drafts. Where the later outputs kept 4, the life expects 3.8 (0.94x): plain. Fails if the verdict judges the
    probe by its own verifies alone (checked: plain at 6)."""
    spans = [(3, 93)] * BATCH
    good = _probed_at_start(6)
    assert good.judge(BATCH, 6, 0.0, 0.0, life=good.life_tokens(spans)) is Verdict.DRAFT
    poor = _probed_at_start(4)
    assert poor.judge(BATCH, 6, 0.0, 0.0, life=poor.life_tokens(spans)) in (Verdict.PLAIN, Verdict.EXPLORE)
