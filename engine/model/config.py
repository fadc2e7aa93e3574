"""The model's shape and numerics, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)

# Used only when a config.json names no architecture, as some hand-written ones do.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}

# transformers' own defaults for keys a config.json may omit (Qwen3Config defaults head_dim to 128
# rather than deriving it, so we must too, or we would build a different model than HF does).
_DEFAULT_ROPE_THETA = 10000.0
_QWEN_MAX_WINDOW_LAYERS = 28
_QWEN3_HEAD_DIM = 128


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (``rope_type: llama3``), the only scaling supported."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build a Llama-family decoder, normalised across config.json dialects.

    ``sliding_window`` is the window of the layers flagged in ``sliding_layers`` (None when no layer
    slides). A query at position q then sees keys at positions q - sliding_window + 1 .. q.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None when it attends to the whole context."""
        return self.sliding_window if self.sliding_layers[layer] else None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``; every problem is a CheckpointError naming the file."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: missing config.json in model folder {path}")
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{config_path}: cannot read config: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object at top level")
        try:
            return cls.from_hf(raw)
        except CheckpointError as exc:
            raise CheckpointError(f"{config_path}: {exc}") from exc

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Normalise a parsed HF config dict (transformers 4.x or 5.x layout)."""
        arch = _architecture(cfg)
        num_layers = _int(cfg, "num_hidden_layers")
        num_heads = _int(cfg, "num_attention_heads")
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise CheckpointError(
                f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            )
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise CheckpointError(f"hidden_act {hidden_act!r} is not supported (only silu)")
        max_pos = _int(cfg, "max_position_embeddings")
        rope_theta, rope_scaling = _rope(cfg, max_pos)
        window, sliding_layers = _sliding(cfg, arch, num_layers)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=_int(cfg, "hidden_size"),
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_head_dim(cfg, arch, num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never an o_proj bias; Mistral has none.
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias and arch != "MistralForCausalLM",
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            sliding_layers=sliding_layers,
            bos_token_id=_optional_int(cfg.get("bos_token_id")),
            eos_token_ids=_token_ids(cfg.get("eos_token_id")),
            torch_dtype=_dtype_name(cfg.get("torch_dtype", cfg.get("dtype"))),
        )


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        arch = str(archs[0])
    elif cfg.get("model_type") in _ARCH_BY_MODEL_TYPE:
        arch = _ARCH_BY_MODEL_TYPE[str(cfg["model_type"])]
    else:
        arch = f"<none; model_type {cfg.get('model_type')!r}>"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _optional_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    # Some tools write "torch.bfloat16"; keep only the bare name.
    return str(value).removeprefix("torch.")


def _head_dim(cfg: Mapping[str, Any], arch: str, num_heads: int) -> int:
    head_dim = cfg.get("head_dim")
    if head_dim:
        return int(head_dim)
    if arch == "Qwen3ForCausalLM":
        return _QWEN3_HEAD_DIM
    hidden = _int(cfg, "hidden_size")
    if hidden % num_heads != 0:
        raise CheckpointError(f"hidden_size {hidden} is not divisible by num_attention_heads {num_heads}")
    return hidden // num_heads


def _rope(cfg: Mapping[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    """Accept transformers 5 ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"rope parameters must be an object, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise CheckpointError("per-layer-type rope parameters are not supported")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA)))
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"rope scaling type {rope_type!r} is not supported (supported: default, llama3)")
    try:
        scaling = RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_pos)),
        )
    except KeyError as exc:
        raise CheckpointError(f"llama3 rope scaling is missing {exc.args[0]!r}") from exc
    return theta, scaling


def _sliding(cfg: Mapping[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """Which layers use a sliding window, following transformers' rules for each family."""
    no_window: tuple[int | None, tuple[bool, ...]] = (None, (False,) * num_layers)
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window")
        return (None, no_window[1]) if window is None else (int(window), (True,) * num_layers)
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not cfg.get("use_sliding_window"):
        return no_window
    window = cfg.get("sliding_window")
    if window is None:
        return no_window
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = int(cfg.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS))
        flags = tuple(i >= first for i in range(num_layers))
    else:
        if len(layer_types) != num_layers:
            raise CheckpointError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        flags = tuple(t == "sliding_attention" for t in layer_types)
    return (int(window), flags) if any(flags) else no_window
