"""Embedded default model and its draft: byte-identical builds from the shipped weights, the on-disk cache, the
hash check of the shipped files, and loading with transformers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.model import embedded
from engine.model.embedded import (
    DRAFT_SPEC,
    EMBEDDED_DRAFT_NAME,
    EMBEDDED_MODEL_NAME,
    FORMAT_VERSION,
    MODEL_FILES,
    EmbeddedSpec,
    build_embedded_model,
    default_cache_dir,
    ensure_embedded_draft_model,
    ensure_embedded_model,
    file_sha256,
)
from engine.model.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]

# Run by fresh interpreters: build into argv[1], then race for the shared cache argv[2].
_CHILD_SCRIPT = """
import sys
from pathlib import Path
from engine.model.embedded import build_embedded_model, ensure_embedded_model
build_embedded_model(Path(sys.argv[1]))
print(ensure_embedded_model(Path(sys.argv[2])))
"""

_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": 'Say {"ok": true} 😀'},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "again"},
]


_WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "A <city> & 'more'"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": _WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
_CALL_ARGS = {"city": "Zürich", "unit": "c"}
# user -> assistant tool call (content null) -> tool result -> assistant answer, as an OpenAI client sends it back.
_TOOL_CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "ARGS"}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."},
]


def _tool_chat(arguments: object) -> list[dict[str, Any]]:
    chat = json.loads(json.dumps(_TOOL_CHAT))
    chat[2]["tool_calls"][0]["function"]["arguments"] = arguments
    return chat


def _digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("embedded")
    build_embedded_model(folder)
    return folder


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[str], Path]:
    """Two fresh interpreters with different hash seeds, started together: their own builds, the cache
    paths each was given, and the shared cache folder they raced for."""
    root = tmp_path_factory.mktemp("children")
    cache = root / "cache"
    outs = [root / "a", root / "b"]
    procs = []
    for seed, out in zip(("1", "2"), outs, strict=True):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD_SCRIPT, str(out), str(cache)],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    paths = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        paths.append(stdout.strip())
    return outs, paths, cache


def test_writes_exactly_the_checkpoint_files(model_dir: Path) -> None:
    assert sorted(path.name for path in model_dir.iterdir()) == sorted(MODEL_FILES)


def test_two_builds_are_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    build_embedded_model(tmp_path / "again")
    assert _digests(tmp_path / "again") == _digests(model_dir)


def test_fresh_interpreters_build_identical_bytes(
    model_dir: Path, children: tuple[list[Path], list[str], Path]
) -> None:
    outs, _, _ = children
    for out in outs:
        assert _digests(out) == _digests(model_dir)


def test_concurrent_ensure_publishes_one_complete_folder(
    model_dir: Path, children: tuple[list[Path], list[str], Path]
) -> None:
    _, paths, cache = children
    assert paths[0] == paths[1]
    published = Path(paths[0])
    assert published.parent == cache
    # Only the published folder remains: the loser's staging folder was removed.
    assert list(cache.iterdir()) == [published]
    assert _digests(published) == _digests(model_dir)


def test_the_draft_is_another_folder_with_the_same_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    draft = ensure_embedded_draft_model(tmp_path)
    assert draft.name == DRAFT_SPEC.folder_name() != EmbeddedSpec().folder_name()
    assert draft.name.startswith(f"{EMBEDDED_DRAFT_NAME}-v{FORMAT_VERSION}-")
    mine, theirs = _digests(draft), _digests(model_dir)
    assert mine["model.safetensors"] == file_sha256(DRAFT_SPEC.weights_path) != theirs["model.safetensors"]
    assert mine["tokenizer.json"] == theirs["tokenizer.json"]
    assert mine["tokenizer_config.json"] == theirs["tokenizer_config.json"]
    config = json.loads((draft / "config.json").read_text(encoding="utf-8"))
    assert (config["num_hidden_layers"], config["hidden_size"]) == (
        DRAFT_SPEC.num_hidden_layers,
        DRAFT_SPEC.hidden_size,
    )
    assert config["vocab_size"] == json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"]


def test_the_folder_name_covers_the_weights_hash() -> None:
    """A retrained file (another sha256) gets another cache folder: a stale cache is never reused."""
    other = dataclasses.replace(EmbeddedSpec(), weights_sha256="0" * 64)
    assert other.folder_name() != EmbeddedSpec().folder_name()


@pytest.mark.parametrize("spec", [EmbeddedSpec(), DRAFT_SPEC], ids=["target", "draft"])
def test_a_shipped_file_that_is_not_the_named_one_is_refused(spec: EmbeddedSpec, tmp_path: Path) -> None:
    """The build checks the shipped weights' sha256 before writing anything: fails if _check_shipped_weights is
    skipped (a damaged or swapped file would become the cached model)."""
    wrong = dataclasses.replace(spec, weights_sha256="0" * 64)
    with pytest.raises(CheckpointError, match="sha256"):
        ensure_embedded_model(tmp_path, wrong)
    assert list(tmp_path.iterdir()) == []  # no folder published, no staging left
    missing = dataclasses.replace(spec, weights_file="absent.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        ensure_embedded_model(tmp_path, missing)


def test_ensure_builds_once_then_reuses(tmp_path: Path, model_dir: Path) -> None:
    first = ensure_embedded_model(tmp_path)
    assert first.parent == tmp_path
    assert first.name == EmbeddedSpec().folder_name()
    assert first.name.startswith(f"{EMBEDDED_MODEL_NAME}-v{FORMAT_VERSION}-")
    assert _digests(first) == _digests(model_dir)
    stamps = {path.name: path.stat().st_mtime_ns for path in first.iterdir()}
    inode = first.stat().st_ino

    second = ensure_embedded_model(tmp_path)
    assert second == first
    assert second.stat().st_ino == inode
    assert {path.name: path.stat().st_mtime_ns for path in second.iterdir()} == stamps
    assert list(tmp_path.iterdir()) == [first]


def test_ensure_that_loses_the_race_uses_the_winner(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    final = tmp_path / EmbeddedSpec().folder_name()
    real_build = embedded.build_embedded_model

    def build_while_a_competitor_publishes(dest: Path, spec: EmbeddedSpec) -> None:
        real_build(dest, spec)
        real_build(final, spec)  # another process renames its folder into place first

    monkeypatch.setattr(embedded, "build_embedded_model", build_while_a_competitor_publishes)
    assert ensure_embedded_model(tmp_path) == final
    assert list(tmp_path.iterdir()) == [final]
    assert _digests(final) == _digests(model_dir)


def test_incomplete_cached_folder_is_reported(tmp_path: Path) -> None:
    folder = ensure_embedded_model(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        ensure_embedded_model(tmp_path)


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORDINAL_CACHE_DIR", str(tmp_path / "custom"))
    assert default_cache_dir() == tmp_path / "custom"
    monkeypatch.delenv("ORDINAL_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "ordinal"


def test_ensure_uses_env_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORDINAL_CACHE_DIR", str(tmp_path))
    assert ensure_embedded_model().parent == tmp_path


def test_config_matches_spec_and_tokenizer(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    tok = Tokenizer.from_dir(model_dir)
    spec = EmbeddedSpec()
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == tok.vocab_size == spec.vocab_size_target
    assert (config["hidden_size"], config["intermediate_size"]) == (spec.hidden_size, spec.intermediate_size)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert config["tie_word_embeddings"] is False
    assert config["bos_token_id"] == tok.bos_token_id
    assert set(config["eos_token_id"]) == tok.eos_token_ids
    assert list(config) == sorted(config)


def test_corpus_gives_merges_for_words_and_json(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    for piece in ['":', '",', " the", "content", " return"]:
        assert len(tok.encode(piece)) == 1, piece


@pytest.mark.parametrize("spec", [EmbeddedSpec(), DRAFT_SPEC], ids=["target", "draft"])
def test_the_weights_are_the_shipped_trained_file(spec: EmbeddedSpec, tmp_path: Path) -> None:
    folder = ensure_embedded_model(tmp_path, spec)
    assert file_sha256(folder / "model.safetensors") == file_sha256(spec.weights_path) == spec.weights_sha256
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        names = set(handle.keys())
        embed = handle.get_tensor("model.embed_tokens.weight")  # [V, H]
        head = handle.get_tensor("lm_head.weight")  # [V, H]
        norm = handle.get_tensor("model.layers.0.input_layernorm.weight")  # [H]
        gate = handle.get_tensor(f"model.layers.{spec.num_hidden_layers - 1}.mlp.gate_proj.weight")  # [I, H]
    assert len(names) == 3 + 9 * spec.num_hidden_layers
    assert embed.dtype == torch.bfloat16 and json.loads((folder / "config.json").read_text())["torch_dtype"] == (
        "bfloat16"
    )
    assert not torch.equal(embed, head)  # untied
    assert not torch.equal(norm, torch.ones(spec.hidden_size))  # trained, not the initialisation
    assert gate.shape == (spec.intermediate_size, spec.hidden_size)
    assert torch.isfinite(gate.float()).all()


def test_loads_with_transformers(model_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.vocab_size == Tokenizer.from_dir(model_dir).vocab_size
    assert config.num_key_value_heads == 4
    assert config.tie_word_embeddings is False

    loaded = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    model, info = cast(tuple[Any, dict[str, Any]], loaded)
    # Every tensor came from the file: nothing was missing (and silently re-initialised) or left over.
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        assert torch.equal(model.lm_head.weight.detach().float(), handle.get_tensor("lm_head.weight").float())
    tok = Tokenizer.from_dir(model_dir)
    ids = torch.tensor([tok.encode("hello world, this is a test", add_special_tokens=True)])  # [1, T]
    with torch.no_grad():
        logits = model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], tok.vocab_size)
    assert torch.isfinite(logits).all()


def test_hf_tokenizer_agrees_with_ours(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(model_dir)
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert len(hf) == ours.vocab_size
    assert hf.eos_token_id in ours.eos_token_ids
    assert (hf.bos_token_id, hf.pad_token_id) == (ours.bos_token_id, ours.pad_token_id)
    for text in ["hello world", "<|im_start|>user\nhi<|im_end|>", 'Café {"a": 1} 😀']:
        for special in (False, True):
            assert hf.encode(text, add_special_tokens=special) == ours.encode(text, add_special_tokens=special)
        ids = ours.encode(text)
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True)
    for prompt in (True, False):
        hf_text = hf.apply_chat_template(_CHAT, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(_CHAT, add_generation_prompt=prompt) == hf_text


def test_tool_conversations_render_in_the_hermes_format(model_dir: Path) -> None:
    """Tools in the system turn, a call as a <tool_call> block, the result as a user turn of <tool_response>: the
    same text from transformers and from our renderer, whether the call's arguments come as the JSON string an
    OpenAI client sends or as the object smg passes (tests/e2e/test_embedded_quality.py checks smg's rendering)."""
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(model_dir)
    hf = AutoTokenizer.from_pretrained(model_dir)
    as_object = _tool_chat(_CALL_ARGS)
    as_string = _tool_chat(json.dumps(_CALL_ARGS, ensure_ascii=False))
    text = ours.apply_chat_template(as_object, tools=_TOOLS)
    assert text == ours.apply_chat_template(as_string, tools=_TOOLS)
    assert text == hf.apply_chat_template(as_object, tools=_TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == hf.apply_chat_template(as_string, tools=_TOOLS, tokenize=False, add_generation_prompt=True)
    system, user, call, result, answer, prompt = text.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and "\n<tools>\n" in system
    assert f"\n{json.dumps(_TOOLS[0], ensure_ascii=False)}\n" in system  # json.dumps spacing, "<" and "'" kept
    assert user == "<|im_start|>user\nWeather in Zürich?"
    assert call == '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' + (
        json.dumps(_CALL_ARGS, ensure_ascii=False) + "}\n</tool_call>"
    )
    assert result == '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>'
    assert answer == "<|im_start|>assistant\nIt is 21 degrees."
    assert prompt == "<|im_start|>assistant\n"
    # Without tools the template is plain ChatML, as before.
    assert ours.apply_chat_template(_CHAT[:2]) == (
        '<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay {"ok": true} 😀<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
