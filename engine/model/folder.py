"""Which model folder an engine serves, and the facts read straight from it (no weights loaded)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.model.embedded import ensure_embedded_model


def model_dir(config: EngineConfig) -> Path:
    """The model folder ``config`` names: its ``model_path``, or the embedded default (built on first use)."""
    if config.model_path:
        return Path(config.model_path)
    return ensure_embedded_model(Path(config.cache_dir) if config.cache_dir else None)


def model_vocab_size(model_dir: Path) -> int:
    """The model's vocabulary size (the lm_head width, config.json ``vocab_size``): masks cover every logit."""
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_file}: cannot be read: {error}") from error
    # Multimodal checkpoints nest the language model's config.
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab = config.get("vocab_size", text_config.get("vocab_size"))
    if not isinstance(vocab, int) or vocab <= 0:
        raise CheckpointError(f"{config_file}: no positive integer vocab_size")
    return vocab
