"""Shared fixtures. Everything runs on CPU, offline, with fixed seeds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from engine.grammar import ConstraintCompiler


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (on a device: bash scripts/gpu-check)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, built once per test session into a private cache."""
    from engine.model.embedded import ensure_embedded_model

    return ensure_embedded_model(tmp_path_factory.mktemp("ordinal-cache"))


@pytest.fixture(scope="module")
def compiler(embedded_model_dir: Path) -> Iterator[ConstraintCompiler]:
    """A constraint compiler over the embedded model's tokenizer (xgrammar), one per test module."""
    from engine.grammar import ConstraintCompiler

    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir)
    yield compiler
    compiler.shutdown()
