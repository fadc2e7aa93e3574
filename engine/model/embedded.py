"""The embedded default model and its draft: tiny Llama checkpoints shipped with the package, byte-identical everywhere.

With no model argument the engine serves the embedded model. It needs no download: the tokenizer is a
byte-level BPE trained on a built-in text (:mod:`engine.model.embedded_corpus`) when the folder is built, and the
weights are files shipped in ``engine/model/weights/`` (trained once, on CPU, by ``scripts/train-embedded`` on a
corpus the project generates; docs/embedded-model.md is the model card). The folder built here is an ordinary
Hugging Face checkpoint, so `transformers` and the `smg` gateway load it like any other. The draft model (same
tokenizer, one small layer stack) is the default draft for speculative decoding: :func:`ensure_embedded_draft_model`.

The weights were trained against exactly this tokenizer and chat template: changing either (the corpus text, the
BPE settings, the special tokens, the template) invalidates them, and the spec's hash check refuses a shipped file
whose bytes differ from the ones the spec names.

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

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.errors import CheckpointError
from engine.model.embedded_corpus import training_texts

EMBEDDED_MODEL_NAME = "ordinal-embedded-tiny"
EMBEDDED_DRAFT_NAME = "ordinal-embedded-draft"

# Bump whenever build_embedded_model writes different bytes for the same spec (file layout, config keys), so that
# caches built by older code are never reused. The spec, the tokenizer's text and the chat template are hashed
# into the folder name as well.
FORMAT_VERSION = 2

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

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

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHTS_FILE = "model.safetensors"
MODEL_FILES = ("config.json", "generation_config.json", WEIGHTS_FILE, *TOKENIZER_FILES)

_BYTE_ALPHABET_SIZE = 256
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class EmbeddedSpec:
    """Everything that determines an embedded model folder's bytes (with the tokenizer text, the chat template
    and FORMAT_VERSION): its name, its shape, and the shipped weights file with the sha256 its bytes must have.

    ``vocab_size_target`` counts the 256 byte tokens, the learned merges and the special tokens; the real
    size can come out smaller if the corpus runs out of merges, and config.json always records the real one.
    The default is the served model; :data:`DRAFT_SPEC` is its draft.
    """

    name: str = EMBEDDED_MODEL_NAME
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    vocab_size_target: int = 2048
    init_std: float = 0.02  # the initializer_range training started from (config.json records it)
    weights_file: str = "ordinal-embedded-tiny.safetensors"
    weights_sha256: str = "e5f389e2d08d6a7f8f34a9f3102eb1122bcd6dce9b03898fa2dd98dc14d67f62"
    torch_dtype: str = "bfloat16"  # the dtype of the shipped tensors

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

    @property
    def weights_path(self) -> Path:
        return WEIGHTS_DIR / self.weights_file

    def cache_key(self) -> str:
        """A short hash of the spec (the weights' sha256 included), the tokenizer's text, the chat template and
        the format version: equal keys mean equal bytes."""
        corpus_hash = hashlib.sha256("\x00".join(training_texts()).encode("utf-8")).hexdigest()
        template_hash = hashlib.sha256(CHAT_TEMPLATE.encode("utf-8")).hexdigest()
        payload = {
            "corpus": corpus_hash,
            "format": FORMAT_VERSION,
            "spec": dataclasses.asdict(self),
            "template": template_hash,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()[:12]

    def folder_name(self) -> str:
        return f"{self.name}-v{FORMAT_VERSION}-{self.cache_key()}"


# The draft for speculative decoding: the target's tokenizer and family, two layers at a quarter of the width.
DRAFT_SPEC = EmbeddedSpec(
    name=EMBEDDED_DRAFT_NAME,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    weights_file="ordinal-embedded-draft.safetensors",
    weights_sha256="174f9d776333c307f3e4ce1264cb881988f4eca53f2ae37a1812701803e8b3df",
)


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


def ensure_embedded_draft_model(cache_dir: Path | None = None) -> Path:
    """The embedded draft model's folder (see :data:`DRAFT_SPEC`), built on first use like the target's."""
    return ensure_embedded_model(cache_dir, DRAFT_SPEC)


def build_embedded_model(dest: Path, spec: EmbeddedSpec = EmbeddedSpec()) -> None:
    """Write the embedded checkpoint (see MODEL_FILES) into ``dest``, creating it if needed.

    The shipped weights are checked against ``spec.weights_sha256`` before anything is written, so a damaged or
    swapped file never becomes a cached model."""
    source = spec.weights_path
    _check_shipped_weights(source, spec.weights_sha256)
    write_embedded_configs(dest, spec)
    shutil.copyfile(source, dest / WEIGHTS_FILE)


def write_embedded_configs(dest: Path, spec: EmbeddedSpec = EmbeddedSpec()) -> None:
    """Write everything of the checkpoint but its weights: the tokenizer files, config.json and
    generation_config.json. The training script builds its model from exactly these files."""
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec)
    (dest / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    token_ids = {token: _required_id(tokenizer, token) for token in SPECIAL_TOKENS}
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    _write_json(dest / "tokenizer_config.json", _tokenizer_config(spec, token_ids))
    _write_json(dest / "generation_config.json", _generation_config(token_ids))
    _write_json(dest / "config.json", _model_config(spec, vocab_size, token_ids))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_shipped_weights(path: Path, expected_sha256: str) -> None:
    if not path.is_file():
        raise CheckpointError(
            f"{path}: the embedded model's weights are missing from the installed package; reinstall ordinal "
            "(they ship as package data) or pass --model PATH"
        )
    actual = file_sha256(path)
    if actual != expected_sha256:
        raise CheckpointError(
            f"{path}: sha256 {actual} is not the {expected_sha256} this version of ordinal ships; the file is "
            "damaged or from another version (reinstall ordinal, or retrain with scripts/train-embedded and "
            "update EmbeddedSpec)"
        )


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
        # Frequency 1 lets a few KB of text fill the vocabulary. Kept as it was when the weights were trained: the
        # weights are only valid with this exact vocabulary.
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
        "torch_dtype": spec.torch_dtype,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
