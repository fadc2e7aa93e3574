"""Tiny models with random weights for tests that are about the forward's plumbing, not about a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from engine.model.config import ModelConfig


def tiny_llama(**overrides: Any) -> ModelConfig:
    """A 2-layer Llama with GQA (4 query heads, 2 KV heads of 8 dims), overridable field by field (HF names)."""
    fields: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
    )
    return ModelConfig.from_hf(LlamaConfig(**{**fields, **overrides}).to_dict())


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """Import into a test module of tiny tensors: on a shared machine intra-op threads only add spin-wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
