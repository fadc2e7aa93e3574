"""The "never slower" rule: how many draft positions each decode gets, from what speculation has measurably paid.

Two decisions, both from measurements the scheduler already receives:

* **Per batch** (the verify cost): for each batch-size class (decodes in the step, by powers of two) the policy
  keeps, for each draft depth it may use (0, 1, half the maximum, the maximum), an exponential average of the
  tokens the step committed per second of the executor's time on it (``StepTiming.done``: drafting, the verify
  forward, sampling). It plans the depth with the best average. Every depth is tried once per class, and the least
  recently tried one again every ``explore_every`` steps of the class, so a change in load or acceptance is seen.
  Depth 0 is plain decoding, so the rule converges on whichever is faster, at most one step in ``explore_every``
  spent on another choice. Host time the scheduler spends per step is left out: it is paid per step, and
  speculation makes fewer steps, so leaving it out only makes the rule more cautious.
* **Per request** (the acceptance): a request whose drafts keep failing (an exponential average of accepted draft
  tokens per verify below ``min_accepted``) stops drafting for a while (``pause`` steps, doubled on each relapse up
  to ``max_pause``), then tries again; any accepted run resets its pause.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SpeculativeConfig


@dataclass(frozen=True)
class SpecPolicyConfig:
    explore_every: int = 32
    smoothing: float = 0.2  # weight of the newest step in the averages
    min_accepted: float = 0.25  # accepted draft tokens per verify below which a request pauses drafting
    pause: int = 8
    max_pause: int = 256


@dataclass
class _Arm:
    rate: float = 0.0  # tokens per executor second
    tries: int = 0
    last_step: int = -1


@dataclass
class _Class:
    arms: dict[int, _Arm]
    steps: int = 0


@dataclass
class RequestSpec:
    """One request's drafting state: its acceptance average and, while paused, the step it may draft again."""

    accepted: float = 1.0  # optimistic: a new request drafts
    paused_until: int = 0
    pause: int = 0


@dataclass
class SpecPolicy:
    """Chooses draft depths; the scheduler tells it what each step committed and how long the executor took."""

    spec: SpeculativeConfig
    config: SpecPolicyConfig = SpecPolicyConfig()
    _classes: dict[int, _Class] = field(default_factory=dict)
    _step: int = 0

    @property
    def depths(self) -> tuple[int, ...]:
        top = self.spec.draft_nodes
        return tuple(sorted({0, min(1, top), top // 2, top}))

    def batch_depth(self, num_decodes: int) -> int:
        """The draft depth for a step with ``num_decodes`` decodes."""
        top = self.spec.draft_nodes
        if not self.spec.adaptive or top == 0 or num_decodes == 0:
            return top
        cls = self._class(num_decodes)
        cls.steps += 1
        untried = [d for d, arm in cls.arms.items() if arm.tries == 0]
        if untried:
            return untried[0]
        if cls.steps % self.config.explore_every == 0:
            return min(cls.arms, key=lambda d: cls.arms[d].last_step)
        return max(cls.arms, key=lambda d: (cls.arms[d].rate, -d))

    def request_depth(self, req: RequestSpec, batch_depth: int) -> int:
        if not self.spec.adaptive:
            return batch_depth
        return 0 if self._step < req.paused_until else batch_depth

    def observe_step(self, num_decodes: int, depth: int, tokens: int, seconds: float) -> None:
        """A committed step with ``num_decodes`` decodes planned at ``depth`` gave ``tokens`` in ``seconds``."""
        self._step += 1
        if not self.spec.adaptive or num_decodes == 0 or seconds <= 0.0:
            return
        arm = self._class(num_decodes).arms.get(depth)
        if arm is None:
            return
        rate = tokens / seconds
        arm.rate = rate if arm.tries == 0 else arm.rate + self.config.smoothing * (rate - arm.rate)
        arm.tries += 1
        arm.last_step = self._step

    def observe_request(self, req: RequestSpec, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        req.accepted += self.config.smoothing * (accepted - req.accepted)
        if accepted:
            req.pause = 0
        if req.accepted < self.config.min_accepted:
            req.pause = min(max(req.pause * 2, self.config.pause), self.config.max_pause)
            req.paused_until = self._step + req.pause
            req.accepted = self.config.min_accepted  # a fresh start when the pause ends

    def _class(self, num_decodes: int) -> _Class:
        key = num_decodes.bit_length()
        cls = self._classes.get(key)
        if cls is None:
            cls = self._classes[key] = _Class({d: _Arm() for d in self.depths})
        return cls
