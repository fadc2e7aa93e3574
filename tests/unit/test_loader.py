"""Checkpoint loading: every way a model folder can be wrong is a CheckpointError that names the culprit."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.errors import CheckpointError
from engine.kv.pool import KVPool
from engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.loader import load_model
from tests.support.models import single_thread  # noqa: F401  (an autouse fixture)

TINY: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 100,
}
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid, untied tiny Llama checkpoint written by transformers."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("template")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(path)
    return path


@pytest.fixture
def folder(template: Path, tmp_path: Path) -> Path:
    """A private copy of the template that a test may break."""
    return Path(shutil.copytree(template, tmp_path / "model"))


def edit_config(folder: Path, change: Callable[[dict[str, Any]], object]) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})


def load_error(folder: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(folder, torch.float32, "cpu")
    return str(info.value)


def test_valid_template_loads(folder: Path) -> None:
    model, config = load_model(folder, torch.float32, "cpu")
    assert config.architecture == "LlamaForCausalLM" and not config.tie_word_embeddings
    want = load_file(folder / WEIGHTS)
    assert set(want) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_missing_config_json(folder: Path) -> None:
    (folder / "config.json").unlink()
    message = load_error(folder)
    assert "config.json" in message and str(folder) in message


def test_unparsable_config_json(folder: Path) -> None:
    (folder / "config.json").write_text("{not json")
    assert str(folder / "config.json") in load_error(folder)


def test_unsupported_architecture_is_named_with_supported_list(folder: Path) -> None:
    edit_config(folder, lambda cfg: cfg.update(architectures=["GPT2LMHeadModel"]))
    message = load_error(folder)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_named(folder: Path) -> None:
    edit_config(folder, lambda cfg: cfg.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))
    message = load_error(folder)
    assert "'yarn'" in message and "config.json" in message


def test_no_weights(folder: Path) -> None:
    (folder / WEIGHTS).unlink()
    message = load_error(folder)
    assert "safetensors" in message and str(folder) in message


def test_pytorch_bin_only_says_safetensors_is_required(folder: Path) -> None:
    torch.save(load_file(folder / WEIGHTS), folder / "pytorch_model.bin")
    (folder / WEIGHTS).unlink()
    message = load_error(folder)
    assert "pytorch_model.bin" in message and "only safetensors" in message


def test_missing_shard_is_named(template: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(template)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    message = load_error(tmp_path)
    assert shard in message and "model.safetensors.index.json" in message


def test_shape_mismatch_names_file_tensor_and_both_shapes(folder: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    edit_weights(folder, lambda t: t.update({name: torch.zeros(65, 32)}))
    message = load_error(folder)
    assert WEIGHTS in message and name in message
    assert "[65, 32]" in message and "[64, 32]" in message


def test_missing_tensor_is_named(folder: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    edit_weights(folder, lambda t: t.pop(name))
    assert name in load_error(folder)


def test_untied_checkpoint_without_lm_head_is_missing_a_tensor(folder: Path) -> None:
    edit_weights(folder, lambda t: t.pop("lm_head.weight"))
    assert "lm_head.weight" in load_error(folder)


def test_unexpected_tensor_is_named(folder: Path) -> None:
    name = "model.layers.0.self_attn.q_proj.bias"
    edit_weights(folder, lambda t: t.update({name: torch.zeros(32)}))
    message = load_error(folder)
    assert name in message and WEIGHTS in message


def test_rotary_inv_freq_is_ignored(folder: Path) -> None:
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    edit_weights(folder, lambda t: t.update({name: torch.ones(4)}))
    load_model(folder, torch.float32, "cpu")


def test_tied_embeddings_without_lm_head_share_the_embedding(folder: Path) -> None:
    edit_config(folder, lambda cfg: cfg.update(tie_word_embeddings=True))
    edit_weights(folder, lambda t: t.pop("lm_head.weight"))
    model, config = load_model(folder, torch.float32, "cpu")
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, load_file(folder / WEIGHTS)["model.embed_tokens.weight"])
    kv = KVPool(config.num_layers, 4, 4, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    batch = ForwardBatch.build([SeqInput([1, 2, 3], 0, [2], LogitsMode.LAST)], 4, "cpu")
    assert torch.isfinite(model(batch, kv)).all()


def test_tied_embeddings_ignore_a_saved_lm_head(folder: Path) -> None:
    edit_config(folder, lambda cfg: cfg.update(tie_word_embeddings=True))
    model, _ = load_model(folder, torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_corrupt_safetensors_is_named(folder: Path) -> None:
    (folder / WEIGHTS).write_bytes(b"\x00garbage")
    assert str(folder / WEIGHTS) in load_error(folder)


def test_bfloat16_checkpoint_is_cast_to_requested_dtype(folder: Path) -> None:
    edit_weights(folder, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    model, _ = load_model(folder, torch.float32, "cpu")
    assert all(p.dtype == torch.float32 for p in model.parameters())


# --- config normalisation ------------------------------------------------------------------------------


def hf_dict(arch: str, **extra: Any) -> dict[str, Any]:
    base = {
        "architectures": [arch],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    return {**base, **extra}


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_rope_parameters_and_legacy_rope_scaling_agree() -> None:
    v5 = ModelConfig.from_hf(
        hf_dict("LlamaForCausalLM", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3})
    )
    legacy = ModelConfig.from_hf(hf_dict("LlamaForCausalLM", rope_theta=5e5, rope_scaling={"type": "llama3", **LLAMA3}))
    assert v5 == legacy
    assert v5.rope_theta == 5e5
    assert v5.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_default_rope_in_both_forms() -> None:
    v5 = ModelConfig.from_hf(hf_dict("MistralForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    legacy = ModelConfig.from_hf(hf_dict("MistralForCausalLM", rope_theta=1e6, rope_scaling=None))
    assert v5 == legacy and v5.rope_scaling is None and v5.rope_theta == 1e6


def test_legacy_unsupported_rope_scaling_is_named() -> None:
    with pytest.raises(CheckpointError, match="'linear'"):
        ModelConfig.from_hf(hf_dict("LlamaForCausalLM", rope_scaling={"type": "linear", "factor": 2.0}))


def test_family_specific_fields() -> None:
    qwen2 = ModelConfig.from_hf(hf_dict("Qwen2ForCausalLM", sliding_window=32, use_sliding_window=False))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.sliding_window) == (True, False, False, None)
    qwen3 = ModelConfig.from_hf(hf_dict("Qwen3ForCausalLM", head_dim=32, attention_bias=True))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.qkv_bias, qwen3.o_bias) == (True, 32, True, True)
    llama = ModelConfig.from_hf(hf_dict("LlamaForCausalLM", attention_bias=True, eos_token_id=[5, 7]))
    assert (llama.qkv_bias, llama.o_bias, llama.head_dim, llama.eos_token_ids) == (True, True, 16, (5, 7))
    mistral = ModelConfig.from_hf(hf_dict("MistralForCausalLM", sliding_window=16, torch_dtype="bfloat16"))
    assert mistral.sliding_layers == (True, True, True) and mistral.layer_window(2) == 16
    assert (mistral.qkv_bias, mistral.torch_dtype, mistral.eos_token_ids) == (False, "bfloat16", ())


def test_qwen2_sliding_window_applies_from_max_window_layers() -> None:
    cfg = ModelConfig.from_hf(
        hf_dict("Qwen2ForCausalLM", sliding_window=32, use_sliding_window=True, max_window_layers=1)
    )
    assert cfg.sliding_window == 32 and cfg.sliding_layers == (False, True, True)
    assert cfg.layer_window(0) is None and cfg.layer_window(1) == 32


def test_missing_required_key_is_named() -> None:
    raw = hf_dict("LlamaForCausalLM")
    del raw["intermediate_size"]
    with pytest.raises(CheckpointError, match="intermediate_size"):
        ModelConfig.from_hf(raw)
