"""The embedded default model: a tiny Llama checkpoint generated locally, byte-identical on every run.

With no model argument the engine serves this model. It needs no download: the tokenizer is a
byte-level BPE trained on a built-in text (:mod:`engine.model.embedded_corpus`) and the weights are
normal draws from a seeded ``torch.Generator``. The result is an ordinary Hugging Face checkpoint folder,
so `transformers` and the `smg` gateway can load it like any other.

Token choices (documented here because several files must agree):

* ``<|begin_of_text|>`` is the BOS; the tokenizer's post-processor prepends it when
  ``add_special_tokens=True``. The chat template does not emit it, so a rendered chat prompt encoded
  without special tokens has no BOS, and one encoded with them has exactly one.
* ``tokenizer_config.json`` names ``<|im_end|>`` as ``eos_token``: the default model is served for chat,
  where an assistant turn ends with ``<|im_end|>``, and clients that read only tokenizer_config (HF
  ``generate``, gateways) then stop at the end of the turn. ``<|end_of_text|>`` stays an end token
  through the ``eos_token_id`` lists of ``generation_config.json`` and ``config.json``.
* ``<|pad|>`` is the pad token; it is never produced by the template.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.errors import CheckpointError
from engine.model.embedded_corpus import training_texts

EMBEDDED_MODEL_NAME = "ordinal-embedded-tiny"

# Bump whenever build_embedded_model writes different bytes for the same spec (file layout, config keys,
# init order, the chat template), so that caches built by older code are never reused.
FORMAT_VERSION = 2

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# ChatML, with tools in the Hermes / Qwen2.5 manner: tool signatures listed in the system turn inside
# <tools></tools>, an assistant's calls as <tool_call> blocks (content may be null), tool results as a user turn of
# <tool_response> blocks. Kept to plain Jinja (no Python-only methods; output only through {{ }}, so trim_blocks and
# lstrip_blocks change nothing) so that minijinja in the smg gateway renders it exactly as jinja2 does; smg passes
# `tools` as the request's tool definitions and an assistant's `arguments` as an object, transformers as given (a
# JSON string from OpenAI clients is written out as it is, an object through tojson: both give the same text).
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' and messages[0]['content'] %}"
    "{{ messages[0]['content'] + '\\n\\n' }}"
    "{% endif %}"
    "{{ 'You can call these tools:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    '{{ \'\\n</tools>\\nTo call a tool, answer with <tool_call>\\n{"name": <name>, "arguments": <arguments>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_BYTE_ALPHABET_SIZE = 256


@dataclass(frozen=True)
class EmbeddedSpec:
    """Everything that determines the embedded model's bytes (together with the corpus and FORMAT_VERSION).

    ``vocab_size_target`` counts the 256 byte tokens, the learned merges and the special tokens; the real
    size can come out smaller if the corpus runs out of merges, and config.json always records the real one.
    """

    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    vocab_size_target: int = 2048
    weight_seed: int = 0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size_target <= _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size_target must leave room for merges beyond bytes and special tokens")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def cache_key(self) -> str:
        """A short hash of the spec, the corpus and the format version: equal keys mean equal bytes."""
        corpus_hash = hashlib.sha256("\x00".join(training_texts()).encode("utf-8")).hexdigest()
        payload = {"corpus": corpus_hash, "format": FORMAT_VERSION, "spec": dataclasses.asdict(self)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()[:12]

    def folder_name(self) -> str:
        return f"{EMBEDDED_MODEL_NAME}-v{FORMAT_VERSION}-{self.cache_key()}"


def default_cache_dir() -> Path:
    """``$ORDINAL_CACHE_DIR`` if set, else ``~/.cache/ordinal``."""
    configured = os.environ.get("ORDINAL_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "ordinal"


def ensure_embedded_model(cache_dir: Path | None = None, spec: EmbeddedSpec = EmbeddedSpec()) -> Path:
    """Return the cached embedded model folder, building it on first use.

    The build goes into a temporary folder beside the final one and is renamed into place, so a reader
    never sees a half-written folder; if another process wins the rename race, its (identical) folder is
    used and ours is discarded.
    """
    root = cache_dir if cache_dir is not None else default_cache_dir()
    final = root / spec.folder_name()
    if final.is_dir():
        _check_complete(final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".building", dir=root))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the published model is public data
    try:
        build_embedded_model(staging, spec)
        _publish(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


def build_embedded_model(dest: Path, spec: EmbeddedSpec = EmbeddedSpec()) -> None:
    """Write the embedded checkpoint (see MODEL_FILES) into ``dest``, creating it if needed."""
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec)
    (dest / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    token_ids = {token: _required_id(tokenizer, token) for token in SPECIAL_TOKENS}
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    _write_json(dest / "tokenizer_config.json", _tokenizer_config(spec, token_ids))
    _write_json(dest / "generation_config.json", _generation_config(token_ids))
    _write_json(dest / "config.json", _model_config(spec, vocab_size, token_ids))
    save_file(_init_weights(spec, vocab_size), str(dest / "model.safetensors"), metadata={"format": "pt"})


def _publish(staging: Path, final: Path) -> None:
    try:
        os.rename(staging, final)
    except OSError:
        # rename(2) refuses to replace a non-empty directory: another process published first.
        if not final.is_dir():
            raise
        _check_complete(final)


def _check_complete(folder: Path) -> None:
    missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder}: cached embedded model lacks {', '.join(missing)}; delete the folder")


def _train_tokenizer(spec: EmbeddedSpec) -> Tokenizer:
    """Byte-level BPE on the built-in corpus. The trainer breaks count ties by pair id and the byte
    alphabet is seeded in a fixed order, so the result does not depend on hash seeds or thread count."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size_target - len(SPECIAL_TOKENS),
        # Frequency 1 lets a few KB of text fill the vocabulary; quality is irrelevant for random weights.
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(list(training_texts()), trainer=trainer)
    # Added after training so that the special tokens take the last ids, as in Llama checkpoints.
    tokenizer.add_special_tokens([_special(token) for token in SPECIAL_TOKENS])
    bos_id = _required_id(tokenizer, BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _special(token: str) -> AddedToken:
    return AddedToken(token, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def _required_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"special token {token!r} missing from the trained tokenizer")
    return int(token_id)


def _tokenizer_config(spec: EmbeddedSpec, token_ids: dict[str, int]) -> dict[str, Any]:
    added_tokens_decoder = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in sorted(token_ids.items(), key=lambda item: item[1])
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        # Off so that HF decode returns exactly what the byte-level decoder produces, like ours.
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": spec.max_position_embeddings,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _eos_ids(token_ids: dict[str, int]) -> list[int]:
    return sorted({token_ids[END_OF_TEXT_TOKEN], token_ids[IM_END_TOKEN]})


def _generation_config(token_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": _eos_ids(token_ids),
        "pad_token_id": token_ids[PAD_TOKEN],
    }


def _model_config(spec: EmbeddedSpec, vocab_size: int, token_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": _eos_ids(token_ids),
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "pad_token_id": token_ids[PAD_TOKEN],
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _weight_shapes(spec: EmbeddedSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF LlamaForCausalLM state dict (no biases), by its HF name."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab_size, hidden),
    }
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_out, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_out, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_out, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_out)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def _init_weights(spec: EmbeddedSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    """Norms are ones; every other tensor is N(0, init_std) drawn in sorted-name order from one seeded
    generator, so each tensor's values depend only on the spec, never on dict or hash ordering."""
    generator = torch.Generator(device="cpu").manual_seed(spec.weight_seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in sorted(_weight_shapes(spec, vocab_size).items()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.float32)  # [H]
        else:
            weights[name] = torch.normal(0.0, spec.init_std, size=shape, generator=generator)  # [out, in]
    return weights


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
