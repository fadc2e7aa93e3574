"""Stop checker: appends committed output tokens one by one and decides when a request finishes."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ProtocolError
from engine.finish import Finish, FinishReason
from engine.sampling_params import SamplingParams
from engine.scheduler.detokenizer import Decoder, IncrementalDetokenizer, JoinedText


@dataclass(frozen=True)
class StopUpdate:
    """Result of appending one token.

    ``text_delta`` is the new text to stream; ``finish`` is set on the last token; ``trim_tokens`` is how
    many trailing output ids the scheduler must drop because they lie entirely inside a trimmed stop string.
    """

    text_delta: str
    finish: Finish | None
    trim_tokens: int


_NO_TEXT = StopUpdate(text_delta="", finish=None, trim_tokens=0)  # immutable: shared by every token-only update


@dataclass(frozen=True)
class _StopMatch:
    stop: str
    start: int  # offset of the match in the whole output text
    end: int


class StopChecker:
    """Decides finishes for one request, in order: stop token, stop string, length.

    Rules for the n-th output token (n counts this one); stop rules apply only once ``n - 1 >=
    min_new_tokens``:

    - a token in ``stop_token_ids``, or an eos token without ``ignore_eos``, finishes with STOP and
      ``matched_token``; it stays in the output ids and its text streams only if the decoder shows it
      (special tokens with ``skip_special_tokens`` show nothing);
    - the earliest occurrence of any stop string in the output text (ties at the same start: the one listed
      first) finishes with STOP and ``matched_stop``; the text ends right before the match (right after it
      with ``no_stop_trim``) and ``trim_tokens`` counts the trailing tokens whose text starts at or after
      the match start (0 with ``no_stop_trim``). A token's text starts where the stable text stood before
      it, so a token whose bytes straddle the match start is kept and the kept ids may decode to slightly
      more text than was streamed;
    - otherwise ``n >= max_new_tokens`` finishes with LENGTH.

    Text that could still be the start of a stop string is held back until later tokens settle it; on a
    finish every held-back text that belongs to the output is released (a character left incomplete by a
    token or length finish is flushed as U+FFFD), so the concatenation of all deltas is the output text.
    Without a decoder the checker works on tokens only: deltas are empty and stop strings are ignored.
    Only the tail window that can hold a new match is searched, so each token costs O(longest stop).
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        decoder: Decoder | None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._params = params
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self._detok = IncrementalDetokenizer(decoder, skip_special_tokens) if decoder is not None else None
        self._stops = params.stop if decoder is not None else ()
        # A new match has at most longest-1 characters before the new text.
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1
        self._num_tokens = 0
        self._finished = False
        self._stable_len = 0  # length of all stable text so far
        self._emitted_len = 0  # length of text returned in deltas
        self._recent = ""  # suffix of the stable text: the held-back text plus the search tail
        self._recent_start = 0  # offset of _recent in the stable text
        self._token_ends: list[int] = []  # stable text length after each token
        self._text = JoinedText()

    @property
    def text(self) -> str:
        """The output text so far (the concatenation of all deltas)."""
        return self._text.text

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def append(self, token_id: int) -> StopUpdate:
        """Commit one output token and report its text and any finish."""
        if self._finished:
            raise ProtocolError("append after the request finished")
        self._num_tokens += 1
        stops_armed = self._num_tokens - 1 >= self._params.min_new_tokens
        token_stop = stops_armed and token_id in self._stop_ids
        last = token_stop or self._num_tokens >= self._params.max_new_tokens
        if self._detok is None and not last:
            # Tokens only (no decoder, hence no stop strings): no text moves. Once per stream per step.
            self._token_ends.append(0)
            return _NO_TEXT
        prev_len = self._add_text(self._new_text(token_id, last))
        self._token_ends.append(self._stable_len)
        if token_stop:
            return self._finish(Finish(FinishReason.STOP, matched_token=token_id), self._stable_len, 0)
        match = self._find_stop(prev_len) if stops_armed else None
        if match is not None:
            return self._finish_on_stop(match)
        if last:
            return self._finish(Finish(FinishReason.LENGTH), self._stable_len, 0)
        return StopUpdate(text_delta=self._release(self._stable_len - self._held_len()), finish=None, trim_tokens=0)

    # ---- text bookkeeping ----

    def _new_text(self, token_id: int, last: bool) -> str:
        if self._detok is None:
            return ""
        text = self._detok.push(token_id)
        # On the last token nothing can complete a held-back partial character any more.
        return text + self._detok.flush() if last else text

    def _add_text(self, text: str) -> int:
        prev_len = self._stable_len
        self._recent += text
        self._stable_len += len(text)
        return prev_len

    def _release(self, upto: int) -> str:
        """Return stable text from what was emitted up to ``upto`` and shrink the kept tail."""
        upto = max(upto, self._emitted_len)
        delta = self._recent[self._emitted_len - self._recent_start : upto - self._recent_start]
        self._emitted_len = upto
        self._text.append(delta)
        keep_from = min(self._emitted_len, self._stable_len - self._tail_len)
        if keep_from > self._recent_start:
            self._recent = self._recent[keep_from - self._recent_start :]
            self._recent_start = keep_from
        return delta

    # ---- stop strings ----

    def _find_stop(self, prev_len: int) -> _StopMatch | None:
        """Earliest stop string occurrence that ends in the text added since ``prev_len``."""
        best: _StopMatch | None = None
        for stop in self._stops:
            # A match ending in the new text starts at or after prev_len - len(stop) + 1.
            first = max(prev_len - len(stop) + 1, self._recent_start)
            at = self._recent.find(stop, first - self._recent_start)
            if at < 0:
                continue
            start = self._recent_start + at
            if best is None or start < best.start:
                best = _StopMatch(stop=stop, start=start, end=start + len(stop))
        return best

    def _held_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        held = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._recent)), held, -1):
                if self._recent.endswith(stop[:size]):
                    held = size
                    break
        return held

    def _finish_on_stop(self, match: _StopMatch) -> StopUpdate:
        finish = Finish(FinishReason.STOP, matched_stop=match.stop)
        if self._params.no_stop_trim:
            return self._finish(finish, match.end, 0)
        return self._finish(finish, match.start, self._tokens_from(match.start))

    def _tokens_from(self, offset: int) -> int:
        """How many trailing tokens have text starting at or after ``offset``."""
        count = 0
        for i in range(len(self._token_ends) - 1, -1, -1):
            start = self._token_ends[i - 1] if i > 0 else 0
            if start < offset:
                break
            count += 1
        return count

    def _finish(self, finish: Finish, text_end: int, trim_tokens: int) -> StopUpdate:
        self._finished = True
        return StopUpdate(text_delta=self._release(text_end), finish=finish, trim_tokens=trim_tokens)
