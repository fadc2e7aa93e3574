"""Which draft proposer an executor runs, from its speculative configuration."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig, SpecAlgorithm
from engine.executor.draft_model import DraftModelProposer
from engine.executor.ngram import NgramConfig, NgramProposer
from engine.executor.proposer import Proposer
from engine.model_info import ModelInfo


def load_proposer(config: EngineConfig, info: ModelInfo, device: torch.device) -> Proposer | None:
    """The proposer ``config.speculative`` names (None when speculation is off); a draft model is loaded here."""
    spec = config.speculative
    if spec.algorithm is SpecAlgorithm.NONE:
        return None
    if spec.algorithm is SpecAlgorithm.DRAFT:
        return DraftModelProposer.load(draft_dir(config), config, info)
    return NgramProposer(NgramConfig())


def draft_dir(config: EngineConfig) -> Path:
    """The draft checkpoint: the configured one, else the embedded draft when the target is the embedded model."""
    path = config.speculative.draft_model_path
    if path:
        return Path(path)
    raise ValueError(
        "speculative algorithm 'draft' needs a draft model: pass --speculative-draft-model-path (a checkpoint "
        "sharing the target's tokenizer)"
    )
