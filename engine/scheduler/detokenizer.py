"""Incremental detokenizer: turns output token ids into stable text, one token at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# What byte-level decoders produce for an incomplete UTF-8 sequence at the end of the ids.
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """Anything that decodes token ids to text (a Hugging Face tokenizer fits)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class JoinedText:
    """Text built from appended pieces, joined only when read and only once per change (no O(n^2) rejoining
    when a stream reads the text after every token)."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._joined = ""
        self._joined_count = 0

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)

    @property
    def text(self) -> str:
        if self._joined_count != len(self._pieces):
            self._joined = "".join(self._pieces)
            self._joined_count = len(self._pieces)
        return self._joined


class IncrementalDetokenizer:
    """Decodes one token at a time, returning only text that later tokens cannot change.

    Uses the prefix/read offset technique: each push decodes only the window ``ids[prefix_offset:]`` and
    compares it with the decoding of ``ids[prefix_offset:read_offset]`` (text already returned). Keeping a
    few already-returned tokens as context lets decoders that strip a word's leading space at the start of
    a sequence (SentencePiece) decode the new tokens as they would in the full sequence. While the window
    ends in U+FFFD (a multi-byte character split across tokens, as byte-level BPE produces) its text is
    held back. Cost per push is O(window), not O(output). Tokens that decode to nothing (skipped special
    tokens) widen the window until the next token with text.
    """

    def __init__(self, decoder: Decoder, skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = JoinedText()

    @property
    def text(self) -> str:
        """All stable text returned so far."""
        return self._text.text

    def push(self, token_id: int) -> str:
        """Add one token; return the newly stable text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(window_text[len(prefix_text) :])

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text, window_text = self._decode_window()
        return self._advance(window_text[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        return prefix, window

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text.append(delta)
        return delta
