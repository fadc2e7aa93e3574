"""What the scheduler needs to know about the executor's model and KV pool: facts the executor reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """What the scheduler needs to know about the executor's model (the executor reports it)."""

    model_path: str
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    pad_token_id: int | None
    page_size: int
    num_pages: int
