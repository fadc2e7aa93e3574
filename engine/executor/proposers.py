"""Which draft proposer an executor runs, from its speculative configuration."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig, SpecAlgorithm
from engine.executor.draft_model import DraftModelProposer
from engine.executor.masks import DraftMasks
from engine.executor.ngram import NgramConfig, NgramProposer
from engine.executor.proposer import Proposer
from engine.model.embedded import EmbeddedSpec, ensure_embedded_draft_model
from engine.model_info import ModelInfo


def load_proposer(
    config: EngineConfig, info: ModelInfo, device: torch.device, masks: DraftMasks | None = None
) -> Proposer | None:
    """The proposer ``config.speculative`` names (None when speculation is off); a draft model is loaded here.
    ``masks``: where a draft model gets the grammar masks it drafts constrained requests under (None: it drafts them
    unmasked); the n-gram proposer's drafts are lookups, which only the verify masks."""
    spec = config.speculative
    if spec.algorithm is SpecAlgorithm.NONE:
        return None
    if spec.algorithm is SpecAlgorithm.DRAFT:
        return DraftModelProposer.load(draft_dir(config), config, info, masks, spec.draft_min_prob)
    return NgramProposer(NgramConfig())


def draft_dir(config: EngineConfig) -> Path:
    """The draft checkpoint: the configured one, else the embedded draft when the target is the embedded model.

    The embedded target is ``model_path`` None or the embedded folder itself (``ordinal serve`` resolves the default
    and passes its folder on); its draft, trained to agree with it (docs/embedded-model.md), is built beside it on
    first use. Any other target needs its draft named: a draft must share the target's tokenizer, which nothing here
    can guess."""
    path = config.speculative.draft_model_path
    if path:
        return Path(path)
    if config.model_path is None:
        return ensure_embedded_draft_model(Path(config.cache_dir) if config.cache_dir else None)
    target = Path(config.model_path)
    if target.name == EmbeddedSpec().folder_name():
        return ensure_embedded_draft_model(target.parent)
    raise ValueError(
        f"speculative algorithm 'draft' needs a draft model for {target}: pass --speculative-draft-model-path (a "
        "checkpoint sharing the target's tokenizer); only the embedded default model has a default draft"
    )
