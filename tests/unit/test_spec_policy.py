"""The "never slower" rule (engine/scheduler/spec_policy.py) on measured step rates and acceptances."""

from __future__ import annotations

from engine.config import SpecAlgorithm, SpeculativeConfig
from engine.scheduler.spec_policy import RequestSpec, SpecPolicy, SpecPolicyConfig

SPEC = SpeculativeConfig(SpecAlgorithm.DRAFT, num_steps=4)


def _drive(policy: SpecPolicy, decodes: int, rate_of: dict[int, float], steps: int) -> list[int]:
    """Run ``steps`` steps where depth d commits ``rate_of[d]`` tokens per second; the depths chosen."""
    chosen = []
    for _ in range(steps):
        depth = policy.batch_depth(decodes)
        chosen.append(depth)
        policy.observe_step(decodes, depth, tokens=int(rate_of[depth]), seconds=1.0)
    return chosen


def test_the_batch_depth_converges_on_the_fastest_and_keeps_exploring() -> None:
    """Each depth is tried once, then the fastest is planned, the others tried again once per explore_every steps."""
    policy = SpecPolicy(SPEC, SpecPolicyConfig(explore_every=16))
    assert policy.depths == (0, 1, 2, 4)
    chosen = _drive(policy, 8, {0: 100, 1: 150, 2: 180, 4: 120}, 64)
    assert sorted(chosen[:4]) == [0, 1, 2, 4]
    assert chosen[4:].count(2) >= 56 and set(chosen[4:]) <= {0, 1, 2, 4}


def test_when_speculation_does_not_pay_the_batch_decodes_plainly() -> None:
    """A large batch where every verify costs more than it gains: the rule settles on depth 0 (never slower)."""
    policy = SpecPolicy(SPEC, SpecPolicyConfig(explore_every=32))
    chosen = _drive(policy, 32, {0: 1000, 1: 900, 2: 800, 4: 600}, 96)
    assert chosen[4:].count(0) >= 88


def test_batch_size_classes_are_measured_apart() -> None:
    policy = SpecPolicy(SPEC)
    _drive(policy, 1, {0: 100, 1: 150, 2: 200, 4: 300}, 20)
    _drive(policy, 32, {0: 1000, 1: 900, 2: 800, 4: 600}, 20)
    assert policy.batch_depth(1) == 4 and policy.batch_depth(32) == 0


def test_a_request_whose_drafts_fail_pauses_then_tries_again() -> None:
    """Accepted tokens per verify averaging below min_accepted pause the request's drafting for `pause` steps,
    doubled on a relapse; an accepted draft resets the pause."""
    policy = SpecPolicy(SPEC, SpecPolicyConfig(min_accepted=0.5, pause=4, smoothing=0.5))
    req = RequestSpec()
    policy.observe_request(req, drafted=4, accepted=0)  # 1.0 -> 0.5: not below
    assert policy.request_depth(req, 4) == 4
    policy.observe_request(req, drafted=4, accepted=0)  # 0.25: paused for 4 steps
    assert policy.request_depth(req, 4) == 0
    for _ in range(4):
        policy.observe_step(0, 0, 0, 0.0)  # steps go by
    assert policy.request_depth(req, 4) == 4
    policy.observe_request(req, drafted=4, accepted=0)  # relapse: paused for 8
    for _ in range(7):
        policy.observe_step(0, 0, 0, 0.0)
    assert policy.request_depth(req, 4) == 0
    policy.observe_step(0, 0, 0, 0.0)
    policy.observe_request(req, drafted=4, accepted=3)
    assert req.pause == 0 and policy.request_depth(req, 4) == 4


def test_adaptive_off_always_drafts_the_full_depth() -> None:
    policy = SpecPolicy(SpeculativeConfig(SpecAlgorithm.NGRAM, num_steps=3, adaptive=False))
    assert _drive(policy, 8, {0: 1000, 1: 1, 3: 1}, 10) == [3] * 10
