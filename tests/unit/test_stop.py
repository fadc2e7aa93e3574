"""StopChecker and IncrementalDetokenizer against a real (tiny, trained in the fixture) byte-level BPE."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.errors import ProtocolError
from engine.finish import Finish, FinishReason
from engine.sampling_params import SamplingParams
from engine.scheduler.detokenizer import IncrementalDetokenizer
from engine.scheduler.stop import StopChecker, StopUpdate

END = "<|end|>"
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "please STOP here and then stop again. The end is near; hello there!",
]


class TinyDecoder:
    """Adapter from a `tokenizers.Tokenizer` to the engine's Decoder protocol; counts decoded ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.largest_window = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.largest_window = max(self.largest_window, len(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[END, "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


@pytest.fixture()
def decoder(tokenizer: Tokenizer) -> TinyDecoder:
    return TinyDecoder(tokenizer)


@pytest.fixture()
def eos(tokenizer: Tokenizer) -> int:
    eos_id = tokenizer.token_to_id(END)
    assert eos_id is not None
    return int(eos_id)


def tokens(tokenizer: Tokenizer, *pieces: str) -> list[int]:
    """Ids for text pieces that are each exactly one token, so tests control the token boundaries."""
    ids = []
    for piece in pieces:
        encoded = tokenizer.encode(piece).ids
        assert len(encoded) == 1, f"{piece!r} is {len(encoded)} tokens"
        ids.extend(encoded)
    return ids


def feed(checker: StopChecker, ids: Sequence[int]) -> list[StopUpdate]:
    """Append ids until a finish; return every update."""
    updates = []
    for token_id in ids:
        update = checker.append(token_id)
        updates.append(update)
        if update.finish is not None:
            break
    return updates


def checker_for(decoder: TinyDecoder, eos: int, **params: Any) -> StopChecker:
    return StopChecker(SamplingParams(**params), frozenset({eos}), decoder)


# ---- token rules ----


def test_eos_stops_and_is_not_streamed(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    checker = checker_for(decoder, eos, max_new_tokens=10)
    updates = feed(checker, [*tokens(tokenizer, "hello", " world"), eos, *tokens(tokenizer, "!")])
    assert len(updates) == 3
    assert [u.finish for u in updates[:2]] == [None, None]
    assert updates[2] == StopUpdate(text_delta="", finish=Finish(FinishReason.STOP, matched_token=eos), trim_tokens=0)
    assert checker.text == "hello world"


def test_ignore_eos_continues_until_length(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    checker = checker_for(decoder, eos, max_new_tokens=3, ignore_eos=True)
    updates = feed(checker, [*tokens(tokenizer, "hello"), eos, *tokens(tokenizer, " world")])
    assert [u.finish for u in updates] == [None, None, Finish(FinishReason.LENGTH)]
    assert checker.text == "hello world"


def test_stop_token_ids_stop_and_visible_token_text_streams(
    tokenizer: Tokenizer, decoder: TinyDecoder, eos: int
) -> None:
    (bang,) = tokens(tokenizer, "!")
    checker = checker_for(decoder, eos, max_new_tokens=10, stop_token_ids=(bang,))
    updates = feed(checker, [*tokens(tokenizer, "hello", "!", " world")])
    assert len(updates) == 2
    assert updates[1].finish == Finish(FinishReason.STOP, matched_token=bang)
    assert updates[1].trim_tokens == 0
    assert checker.text == "hello!"


def test_min_new_tokens_delays_token_stops(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    checker = checker_for(decoder, eos, max_new_tokens=10, min_new_tokens=3)
    hello, world = tokens(tokenizer, "hello", " world")
    updates = feed(checker, [hello, eos, world, eos])
    # eos as the 2nd token (n - 1 = 1 < 3) is an ordinary token; as the 4th (n - 1 = 3) it stops.
    assert [u.finish for u in updates] == [None, None, None, Finish(FinishReason.STOP, matched_token=eos)]


def test_max_new_tokens_gives_length(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    checker = checker_for(decoder, eos, max_new_tokens=2)
    updates = feed(checker, tokens(tokenizer, "hello", " world", "!"))
    assert [u.finish for u in updates] == [None, Finish(FinishReason.LENGTH)]
    assert checker.num_tokens == 2


def test_append_after_finish_is_refused(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    checker = checker_for(decoder, eos, max_new_tokens=1)
    checker.append(eos)
    with pytest.raises(ProtocolError):
        checker.append(eos)


def test_token_only_mode_without_decoder(tokenizer: Tokenizer, eos: int) -> None:
    checker = StopChecker(SamplingParams(max_new_tokens=3, stop=("world",)), frozenset({eos}), None)
    updates = feed(checker, tokens(tokenizer, "hello", " world", "!"))
    assert [u.text_delta for u in updates] == ["", "", ""]
    assert updates[-1].finish == Finish(FinishReason.LENGTH)


# ---- stop strings ----


def test_stop_string_spanning_two_tokens_trimmed(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokens(tokenizer, "hello", " ", "ST", "OP", " world")
    checker = checker_for(decoder, eos, stop=("STOP",))
    updates = feed(checker, ids)
    assert len(updates) == 4
    assert updates[-1].finish == Finish(FinishReason.STOP, matched_stop="STOP")
    assert updates[-1].trim_tokens == 2
    assert checker.text == "hello "
    assert "".join(u.text_delta for u in updates) == decoder.decode(ids[: 4 - 2])


def test_stop_string_spanning_two_tokens_no_stop_trim(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokens(tokenizer, "hello", " ", "ST", "OP", " world")
    checker = checker_for(decoder, eos, stop=("STOP",), no_stop_trim=True)
    updates = feed(checker, ids)
    assert updates[-1].finish == Finish(FinishReason.STOP, matched_stop="STOP")
    assert updates[-1].trim_tokens == 0
    assert checker.text == "hello STOP"


def test_stop_string_spanning_three_tokens(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokens(tokenizer, "hello", " ", "x", "y", "z", "!")
    trimmed = feed(checker_for(decoder, eos, stop=("xyz",)), ids)
    assert (trimmed[-1].finish, trimmed[-1].trim_tokens) == (Finish(FinishReason.STOP, matched_stop="xyz"), 3)
    assert "".join(u.text_delta for u in trimmed) == "hello "
    kept = feed(checker_for(decoder, eos, stop=("xyz",), no_stop_trim=True), ids)
    assert (kept[-1].finish, kept[-1].trim_tokens) == (Finish(FinishReason.STOP, matched_stop="xyz"), 0)
    assert "".join(u.text_delta for u in kept) == "hello xyz"


def test_stop_string_inside_a_token_keeps_the_straddling_token(
    tokenizer: Tokenizer, decoder: TinyDecoder, eos: int
) -> None:
    ids = tokens(tokenizer, "hello", " ", "x")
    updates = feed(checker_for(decoder, eos, stop=("lo x",)), ids)
    # "hello" starts before the match so it stays; " " and "x" lie entirely after the match start.
    assert (updates[-1].trim_tokens, "".join(u.text_delta for u in updates)) == (2, "hel")


def test_multibyte_stop_string_spans_its_byte_tokens(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokenizer.encode("a日本語").ids
    assert len(ids) == 10  # "a" + three bytes per character: byte-level BPE splits each character
    updates = feed(checker_for(decoder, eos, stop=("本",)), ids)
    assert len(updates) == 7
    assert updates[-1].finish == Finish(FinishReason.STOP, matched_stop="本")
    assert updates[-1].trim_tokens == 3
    assert "".join(u.text_delta for u in updates) == "a日" == decoder.decode(ids[: 7 - 3])


def test_partial_stop_prefix_is_held_then_released(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokens(tokenizer, "hello", " ", "x", "y", "!", " world")
    checker = checker_for(decoder, eos, max_new_tokens=6, stop=("xyz",))
    updates = feed(checker, ids)
    assert [u.text_delta for u in updates] == ["hello", " ", "", "", "xy!", " world"]
    assert updates[-1].finish == Finish(FinishReason.LENGTH)
    assert checker.text == "hello xy! world"


def test_held_prefix_is_released_on_finish(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokens(tokenizer, "hello", " ", "x", "y")
    updates = feed(checker_for(decoder, eos, max_new_tokens=4, stop=("xyz",)), ids)
    assert [u.text_delta for u in updates] == ["hello", " ", "", "xy"]
    assert updates[-1].finish == Finish(FinishReason.LENGTH)


def test_earliest_stop_string_wins(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokens(tokenizer, "hello", " world", "!")
    for stops in (("world", "lo w"), ("lo w", "world")):
        updates = feed(checker_for(decoder, eos, stop=stops), ids)
        assert updates[-1].finish == Finish(FinishReason.STOP, matched_stop="lo w")
        assert "".join(u.text_delta for u in updates) == "hel"
        assert updates[-1].trim_tokens == 1


def test_stop_string_before_min_new_tokens_is_ignored(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokens(tokenizer, "x", "hello", "x", "!")
    updates = feed(checker_for(decoder, eos, min_new_tokens=2, stop=("x",)), ids)
    assert len(updates) == 3
    assert updates[-1].finish == Finish(FinishReason.STOP, matched_stop="x")
    assert (updates[-1].trim_tokens, "".join(u.text_delta for u in updates)) == (1, "xhello")


def test_long_output_searches_only_the_tail(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokenizer.encode(" ".join(CORPUS) * 20).ids
    checker = checker_for(decoder, eos, max_new_tokens=len(ids) + 5, stop=("zebra", "STOP!"))
    updates = feed(checker, ids)
    assert decoder.largest_window <= 8  # O(window) decoding, not O(output)
    assert all(u.finish is None for u in updates)
    assert checker.text == decoder.decode(ids)


# ---- text integrity ----


MULTIBYTE = "héllo 日本語 🙂 naïve — ok"


def test_multibyte_characters_never_stream_replacement_chars(
    tokenizer: Tokenizer, decoder: TinyDecoder, eos: int
) -> None:
    ids = tokenizer.encode(MULTIBYTE).ids
    assert len(ids) > len(MULTIBYTE)  # characters really are split across tokens
    updates = feed(checker_for(decoder, eos, max_new_tokens=len(ids)), ids)
    assert all("\ufffd" not in u.text_delta for u in updates)
    assert "".join(u.text_delta for u in updates) == MULTIBYTE


def test_deltas_concatenate_to_decoded_kept_output(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = [*tokenizer.encode(MULTIBYTE + " hello world").ids, eos]
    # Stop strings that start on a token boundary (" world" is one token, the space is its own token
    # before "日"), so the kept ids decode to exactly the streamed text.
    for stops in ((), (" world",), ("日本", "🙂"), (" hello",)):
        checker = checker_for(decoder, eos, max_new_tokens=100, stop=stops)
        updates = feed(checker, ids)
        assert updates[-1].finish is not None
        kept = ids[: len(updates) - updates[-1].trim_tokens]
        joined = "".join(u.text_delta for u in updates)
        assert joined == checker.text == decoder.decode(kept), stops
        assert "\ufffd" not in joined


def test_length_finish_mid_character_flushes_replacement(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    ids = tokenizer.encode("a日").ids
    updates = feed(checker_for(decoder, eos, max_new_tokens=3), ids)
    assert [u.text_delta for u in updates] == ["a", "", "\ufffd"]


# ---- incremental detokenizer on its own ----


def test_detokenizer_holds_incomplete_utf8_and_flushes(tokenizer: Tokenizer, decoder: TinyDecoder) -> None:
    detok = IncrementalDetokenizer(decoder)
    ids = tokenizer.encode("a🙂").ids
    assert len(ids) == 5
    assert [detok.push(t) for t in ids] == ["a", "", "", "", "🙂"]
    assert detok.flush() == ""
    assert detok.text == "a🙂"


def test_detokenizer_shows_special_tokens_when_asked(tokenizer: Tokenizer, decoder: TinyDecoder, eos: int) -> None:
    shown = IncrementalDetokenizer(decoder, skip_special_tokens=False)
    hidden = IncrementalDetokenizer(decoder, skip_special_tokens=True)
    ids = [*tokens(tokenizer, "hello"), eos, *tokens(tokenizer, " world")]
    assert "".join(shown.push(t) for t in ids) == "hello<|end|> world"
    assert "".join(hidden.push(t) for t in ids) == "hello world"


def test_match_completed_before_min_new_tokens_does_not_fire_later(
    tokenizer: Tokenizer, decoder: TinyDecoder, eos: int
) -> None:
    # "x" completes while stops are not armed; it still sits in the search tail kept for "abcd" afterwards.
    ids = tokens(tokenizer, "x", "!", " world")
    updates = feed(checker_for(decoder, eos, max_new_tokens=3, min_new_tokens=1, stop=("x", "abcd")), ids)
    assert [u.finish for u in updates] == [None, None, Finish(FinishReason.LENGTH)]
    assert "".join(u.text_delta for u in updates) == "x! world"
