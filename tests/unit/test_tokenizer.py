"""Tokenizer wrapper: round trips, special tokens, end-of-sequence ids and chat templates.

The tokenizer under test is the real embedded one (built into a temporary folder); the eos tests copy
its tokenizer.json into folders whose config files say different things.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import CheckpointError, InvalidRequestError
from engine.model.embedded import (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_embedded_model,
)
from engine.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("embedded")
    build_embedded_model(folder)
    return folder


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _folder_with(tmp_path: Path, model_dir: Path, **files: dict[str, Any]) -> Path:
    """A checkpoint folder holding the embedded tokenizer.json and the given JSON files (name → object)."""
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    for stem, content in files.items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(content), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        '{"role": "user", "content": "x = [1, 2, 3]"}\n\tdef f():\n    return None\n',
        "Café naïve résumé Zürich São Paulo",
        "emoji 😀👍🏽🚀 and CJK 東京 and Greek Ελλάδα",
        "  leading and trailing spaces  \n\n",
        "",
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= token_id < tok.vocab_size for token_id in ids)
    assert tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    # Byte-level BPE covers every byte, so any string (no special-token markup) survives the trip.
    assert tok.decode(tok.encode(text)) == text


def test_multibyte_characters_split_into_byte_tokens(tok: Tokenizer) -> None:
    # A rare 4-byte emoji has no merges: it must become several byte tokens that still decode exactly.
    ids = tok.encode("🦩")
    assert len(ids) > 1
    assert tok.decode(ids) == "🦩"


def test_special_tokens_encode_as_single_ids(tok: Tokenizer) -> None:
    for token in SPECIAL_TOKENS:
        ids = tok.encode(token)
        assert len(ids) == 1
        assert ids[0] == tok.token_to_id(token)
        assert ids[0] in tok.special_token_ids
    assert tok.special_token_ids == frozenset(tok.token_to_id(token) for token in SPECIAL_TOKENS)


def test_skip_special_tokens(tok: Tokenizer) -> None:
    text = f"{IM_START_TOKEN}user\nhi there{IM_END_TOKEN}\n{END_OF_TEXT_TOKEN}"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi there\n"


def test_add_special_tokens_prepends_bos(tok: Tokenizer) -> None:
    plain = tok.encode("hello")
    with_bos = tok.encode("hello", add_special_tokens=True)
    assert tok.bos_token_id is not None
    assert with_bos == [tok.bos_token_id, *plain]


def test_vocab_size_counts_added_tokens(tok: Tokenizer) -> None:
    top = max(tok.special_token_ids)
    assert tok.vocab_size == top + 1
    assert tok.vocab_size == 2048


def test_embedded_named_ids(tok: Tokenizer, model_dir: Path) -> None:
    assert tok.path == model_dir
    assert tok.bos_token_id == tok.token_to_id(BOS_TOKEN)
    assert tok.pad_token_id == tok.token_to_id(PAD_TOKEN)
    assert tok.eos_token_ids == {tok.token_to_id(IM_END_TOKEN), tok.token_to_id(END_OF_TEXT_TOKEN)}


def test_eos_ids_are_the_union_of_all_sources(tmp_path: Path, model_dir: Path) -> None:
    folder = _folder_with(
        tmp_path,
        model_dir,
        tokenizer_config={"eos_token": {"content": IM_END_TOKEN, "special": True}},
        generation_config={"eos_token_id": [7, 8]},
        config={"eos_token_id": 9},
    )
    tok = Tokenizer.from_dir(folder)
    assert tok.eos_token_ids == frozenset({tok.token_to_id(IM_END_TOKEN), 7, 8, 9})


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"generation_config": {"eos_token_id": 5}}, {5}),
        ({"config": {"eos_token_id": [3, 4]}}, {3, 4}),
        ({"tokenizer_config": {"eos_token": END_OF_TEXT_TOKEN}}, {2044}),
        ({}, set()),
    ],
)
def test_eos_ids_from_single_source(
    tmp_path: Path, model_dir: Path, files: dict[str, dict[str, Any]], expected: set[int]
) -> None:
    tok = Tokenizer.from_dir(_folder_with(tmp_path, model_dir, **files))
    assert tok.eos_token_ids == frozenset(expected)


def test_bos_and_pad_fall_back_to_config_ids(tmp_path: Path, model_dir: Path) -> None:
    folder = _folder_with(
        tmp_path,
        model_dir,
        generation_config={"bos_token_id": 11},
        config={"bos_token_id": 12, "pad_token_id": 13},
    )
    tok = Tokenizer.from_dir(folder)
    assert tok.bos_token_id == 11  # generation_config is consulted before config.json
    assert tok.pad_token_id == 13
    assert tok.chat_template is None


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_config_is_a_checkpoint_error(tmp_path: Path, model_dir: Path) -> None:
    folder = _folder_with(tmp_path, model_dir)
    (folder / "generation_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        Tokenizer.from_dir(folder)


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == rendered.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_no_chat_template_is_a_clear_error(tmp_path: Path, model_dir: Path) -> None:
    tok = Tokenizer.from_dir(_folder_with(tmp_path, model_dir))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_from_jinja_file_and_named_list(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "a").mkdir()
    jinja_dir = _folder_with(tmp_path / "a", model_dir)
    (jinja_dir / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}", encoding="utf-8")
    (jinja_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS_TOKEN}), encoding="utf-8")
    assert Tokenizer.from_dir(jinja_dir).apply_chat_template([{"role": "user", "content": "x"}]) == f"{BOS_TOKEN}x"

    (tmp_path / "b").mkdir()
    listed = _folder_with(
        tmp_path / "b",
        model_dir,
        tokenizer_config={
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
        },
    )
    assert Tokenizer.from_dir(listed).apply_chat_template([]) == "D"


def test_template_helpers_match_transformers(tmp_path: Path, model_dir: Path) -> None:
    template = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    tok = Tokenizer.from_dir(_folder_with(tmp_path, model_dir, tokenizer_config={"chat_template": template}))
    # Not HTML-escaped, not ASCII-escaped, and trim_blocks drops the newline after the block tags.
    assert tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}]) == (
        '{"role": "user", "content": "<b>é</b>"}\n'
    )


def test_template_raise_exception_is_an_invalid_request(tmp_path: Path, model_dir: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    tok = Tokenizer.from_dir(_folder_with(tmp_path, model_dir, tokenizer_config={"chat_template": template}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first must be user") as caught:
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert caught.value.field == "messages"


def test_template_sandbox_blocks_attribute_escape(tmp_path: Path, model_dir: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_dir(_folder_with(tmp_path, model_dir, tokenizer_config={"chat_template": template}))
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
