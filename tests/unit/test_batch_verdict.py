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


def _measured(tokens: float, plain: float = PLAIN, draft: float = DRAFT, batch: int = BATCH) -> BatchVerdict:
    """A verdict that has measured one plain step and one steady whole-batch draft of ``batch`` decodes, and verifies
    keeping ``tokens`` on average (accepted drafts and the sampled one)."""
    verdict = BatchVerdict()
    _plain(verdict, batch, plain * batch, 0)
    _whole(verdict, batch, draft * batch, batch, 1)
    _verifies(verdict, tokens)
    return verdict


def _verifies(verdict: BatchVerdict, tokens: float, n: int = 400) -> None:
    """``n`` full-depth verifies whose tokens average ``tokens``: accepted counts spread evenly around its mean."""
    low = int(tokens - 1.0)
    share = tokens - 1.0 - low  # of the verifies, those keeping one more
    for i in range(n):
        verdict.observe_verify(low + (1 if (i * share) % 1.0 + share >= 1.0 else 0))


def test_regimes_group_batches_by_the_nearest_power_of_two() -> None:
    """A batch that gains or loses a few requests stays in one regime: 23-45 together (32), 12-22 (16)."""
    assert {regime(n) for n in range(23, 46)} == {5}
    assert {regime(n) for n in range(12, 23)} == {4}


def test_a_large_batch_drafts_where_its_measured_steps_are_faster() -> None:
    """Drafting at 32 streams costs four plain steps here: with 4.6 tokens a verify the batch drafts (1.15x plain's
    rate), with 3.6 it decodes plainly (0.9x). Fails if the verdict ignores the measured tokens or costs."""
    assert _measured(4.6).judge(BATCH, 10, 0.0, 0.0) is Verdict.DRAFT
    assert _measured(3.6).judge(BATCH, 10, 0.0, 0.0) in (Verdict.PLAIN, Verdict.EXPLORE)
    slower_draft = _measured(4.6, draft=1.0e-3)  # the same tokens where a draft costs five plain steps: 0.92x
    assert slower_draft.judge(BATCH, 10, 0.0, 0.0) is not Verdict.DRAFT


def test_a_small_batch_is_left_to_the_model() -> None:
    """Under ``from_requests`` (5) the spec rule's model decides (None), whatever was measured."""
    verdict = _measured(5.0, batch=4)
    assert verdict.judge(4, 10, 0.0, 0.0) is None
    assert verdict.judge(BATCH, 10, 0.0, 0.0) is None  # nothing measured at 32 yet, and its probe would cost


def test_near_the_break_even_a_batch_keeps_its_course() -> None:
    """A plain batch starts drafting above ``enter`` (1.05x), a drafting one stops only below ``stay`` (1.0x): at
    1.02x each keeps what it does, so noise near the break-even does not flip it (each switch re-reads what the drafts
    missed). Fails with one threshold for both (checked: with ``stay`` at ``enter``, the drafting batch stops at
    1.02x)."""
    verdict = _measured(4.4)  # 1.1x
    assert verdict.judge(BATCH, 10, 0.0, 0.0) is Verdict.DRAFT
    _verifies(verdict, 4.08)  # 1.02x
    assert verdict.judge(BATCH, 11, 0.0, 0.0) is Verdict.DRAFT
    _verifies(verdict, 3.92)  # 0.98x
    assert verdict.judge(BATCH, 12, 0.0, 0.0) is not Verdict.DRAFT
    _verifies(verdict, 4.08)  # 1.02x again: plain stays plain
    assert verdict.judge(BATCH, 13, 0.0, 0.0) is not Verdict.DRAFT


def test_a_switch_is_charged_to_a_plain_batch_only() -> None:
    """At 1.1x plain's rate at the steady state, a plain batch whose drafts would first read 3 ms of catch-up a step
    (amortised over the steps it has left: their end is near) stays plain (0.98x with it); a batch already drafting
    reads no such catch-up and drafts on. Fails if the switch is not charged (checked: the plain batch drafts)."""
    plain = _measured(4.4)
    assert plain.judge(BATCH, 10, 0.0, 3e-3) is not Verdict.DRAFT
    drafting = _measured(4.4)
    assert drafting.judge(BATCH, 10, 0.0, 0.0) is Verdict.DRAFT
    assert drafting.judge(BATCH, 11, 0.0, 3e-3) is Verdict.DRAFT


def test_an_unmeasured_regime_is_probed_only_where_its_catch_up_is_cheap() -> None:
    """Plain measured at 32, a whole-batch draft not. A probe pays its drafts' catch-up whole (where plain then wins,
    its few steps win none of it back): where that costs at most ``probe_catch_up`` (2) plain steps (a batch of new
    requests, whose drafts read only their prompts) the whole batch drafts for up to ``probe_steps`` steps to measure
    it; where it would cost more (drafts far behind), the model decides. Fails if the catch-up is not checked
    (checked: PROBE at three plain steps' catch-up)."""
    verdict = BatchVerdict(VerdictConfig(probe_steps=3))
    _plain(verdict, BATCH, PLAIN * BATCH, 0)
    plain_step = PLAIN * BATCH
    assert verdict.judge(BATCH, 1, 3 * plain_step, 0.1 * plain_step) is None
    assert [verdict.judge(BATCH, s, 1.5 * plain_step, 0.05 * plain_step) for s in (2, 3, 4)] == [Verdict.PROBE] * 3
    assert verdict.judge(BATCH, 5, 3 * plain_step, 0.1 * plain_step) is None  # it measured nothing: not at this price


def test_a_probe_measures_steady_steps_not_a_switch() -> None:
    """The first step of a probe reads each draft's catch-up (here 40 tokens a request, 10 ms more): not a steady
    step's cost, and the probe goes on; it ends once ``probe_measures`` (3) steady steps (a token a request) are
    measured. Fails if the switch's step is measured (checked: the draft cost then reads 0.95 ms a request, 0.92x
    plain's rate, and 4.4 tokens a verify, 1.1x at the steady state, decode plainly)."""
    verdict = BatchVerdict()
    _plain(verdict, BATCH, PLAIN * BATCH, 0)
    assert verdict.judge(BATCH, 1, 0.0, 0.0) is Verdict.PROBE
    _whole(verdict, BATCH, DRAFT * BATCH + 10e-3, 40 * BATCH, 2)
    for step in (2, 3, 4):
        assert verdict.judge(BATCH, step, 0.0, 0.0) is Verdict.PROBE
        _whole(verdict, BATCH, DRAFT * BATCH, BATCH, step + 1)
    _verifies(verdict, 4.4)
    assert verdict.judge(BATCH, 5, 0.0, 0.0) is Verdict.DRAFT


def test_a_plain_regime_explores_at_doubling_gaps_of_its_own() -> None:
    """A regime that decodes plainly explores (a few requests draft) after gaps that double from ``explore_every``
    (16) to ``max_explore_every`` (256), each exploration there costing most of a plain step; a smaller regime judged
    in between (a batch's tail, where drafting pays) keeps its own verdict. Fails if the gap does not grow (checked: a
    fixed period of 16 explores 63 times in these 1,000 steps, not 7)."""
    verdict = _measured(3.0)
    _plain(verdict, 8, PLAIN * 8, 0)
    _whole(verdict, 8, 0.3e-3 * 8, 8, 0)  # at 8, drafting pays (2.2x)
    explored = []
    for step in range(10, 1010):
        if verdict.judge(BATCH, step, 0.0, 0.0) is Verdict.EXPLORE:
            explored.append(step)
        assert verdict.judge(8, step, 0.0, 0.0) is Verdict.DRAFT
    gaps = [b - a for a, b in itertools.pairwise(explored)]
    assert gaps == [16, 32, 64, 128, 256, 256], gaps


def test_a_regime_plain_for_long_is_probed_again_where_it_could_change_its_course() -> None:
    """A draft cost measured once (a cold start's, a machine since less loaded) is probed again, where the switch is
    cheap, after ``refresh`` (256) steps of plain decoding, then after gaps that double, but only where its steady
    ratio is within reach of the break-even (``refresh_floor``, 0.75x): a draft a third cheaper than measured could
    then pay. Far below (0.5x), no refresh. Fails without the refresh (checked: no probe), or without the floor
    (checked: the 0.5x regime probes at step 256). Gaps count from the last measurement."""
    near = BatchVerdict()
    _plain(near, BATCH, PLAIN * BATCH, 0)
    _whole(near, BATCH, DRAFT * BATCH, BATCH, 0)
    _verifies(near, 3.4)  # 0.85x
    probes = [s for s in range(1, 1200) if near.judge(BATCH, s, 0.0, 0.0) is Verdict.PROBE]
    starts = [s for s in probes if s - 1 not in probes]
    assert starts == [256, 512, 1024], probes  # the probes measured nothing: each gap counts from the measurement
    far = BatchVerdict()
    _plain(far, BATCH, PLAIN * BATCH, 0)
    _whole(far, BATCH, DRAFT * BATCH, BATCH, 0)
    _verifies(far, 2.0)  # 0.5x
    assert not [s for s in range(1, 1200) if far.judge(BATCH, s, 0.0, 0.0) is Verdict.PROBE]


def test_the_tokens_a_verify_keeps_follow_the_verifies() -> None:
    verdict = BatchVerdict()
    assert verdict.tokens == 1.0
    _verifies(verdict, 4.4)
    assert verdict.tokens == pytest.approx(4.4, abs=0.1)
