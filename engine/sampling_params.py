"""Per-request sampling parameters: one frozen value, validated before admission."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.errors import InvalidRequestError

# SGLang's default when a client gives no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token and when to stop.

    temperature 0 (or top_k 1) means greedy. top_k -1 disables top-k. logit_bias is a tuple of
    (token id, bias) pairs so that the value stays hashable; build it from a dict with
    :meth:`with_logit_bias`. ``stop`` strings are matched across token boundaries on the
    detokenized output; the output is trimmed before the match unless ``no_stop_trim``.
    ``logprobs`` returns the chosen token's log-probability under the model's raw distribution
    (before penalties, bias and temperature), and ``top_logprobs`` the k most likely tokens there.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @staticmethod
    def logit_bias_from(bias: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in bias.items()))

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`InvalidRequestError` naming the first bad field; never allocates."""
        _check(self.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        _check(self.min_new_tokens >= 0, "min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        _check(
            self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}",
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            f"must be a finite number >= 0, got {self.temperature}",
        )
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(math.isfinite(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        for token_id, bias in self.logit_bias:
            _check(0 <= token_id < vocab_size, "logit_bias", f"token id {token_id} is outside [0, {vocab_size})")
            _check(math.isfinite(bias), "logit_bias", f"bias for token {token_id} must be finite, got {bias}")
        for token_id in self.stop_token_ids:
            _check(
                0 <= token_id < vocab_size,
                "stop_token_ids",
                f"token id {token_id} is outside [0, {vocab_size})",
            )
        _check(all(self.stop), "stop", "stop strings must be non-empty")
        _check(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
        )


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field, message)
