"""The shipped weights are the ones the training script wrote, and the script still trains them the same way.

The full training runs for hours (scripts/train-embedded, never in CI); these tests hold the pieces it leaves behind
to it: each shipped file's sha256 is the one its spec names and its training log recorded, the corpus generator
still writes the corpus the log describes (size and sha256), and the first optimiser steps of both recipes give
the losses the committed logs recorded (fresh processes, one thread, as the recipe says).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.model.embedded import DRAFT_SPEC, EmbeddedSpec, file_sha256
from engine.model.tokenizer import Tokenizer
from training.corpus import Corpus

REPO = Path(__file__).resolve().parents[2]
LOGS = REPO / "training" / "logs"
FIRST_STEPS = 3
MAX_SHIPPED_BYTES = 20 * 1024 * 1024
SPECS = {"target": EmbeddedSpec(), "draft": DRAFT_SPEC}


def _log(role: str) -> dict[str, Any]:
    return dict(json.loads((LOGS / f"{role}.json").read_text(encoding="utf-8")))


@pytest.mark.parametrize("role", sorted(SPECS))
def test_the_shipped_file_is_the_one_training_wrote(role: str) -> None:
    spec = SPECS[role]
    assert file_sha256(spec.weights_path) == spec.weights_sha256 == _log(role)["weights_sha256"]


def test_target_and_draft_fit_the_size_budget() -> None:
    assert sum(spec.weights_path.stat().st_size for spec in SPECS.values()) <= MAX_SHIPPED_BYTES


def test_the_generator_writes_the_corpus_the_models_were_trained_on(embedded_model_dir: Path) -> None:
    recorded = _log("target")["corpus"]
    data = Corpus(Tokenizer.from_dir(embedded_model_dir)).text().encode("utf-8")
    assert len(data) == recorded["bytes"] >= 1_000_000
    assert hashlib.sha256(data).hexdigest() == recorded["sha256"]
    assert _log("draft")["corpus"] == recorded


@pytest.mark.slow
@pytest.mark.parametrize("role", sorted(SPECS))
def test_the_script_reproduces_the_first_optimiser_steps(role: str, tmp_path: Path) -> None:
    """``python -m training.train ROLE --stop-after 3`` in a fresh process gives the losses of the logged run's
    first three steps (same initialisation, same batches, same updates); fails if the recipe, the corpus, the data
    order or the model's initialisation changed since the shipped weights were trained."""
    argv = [sys.executable, "-m", "training.train", role, "--out", str(tmp_path), "--stop-after", str(FIRST_STEPS)]
    if role == "draft":
        argv += ["--teacher", str(EmbeddedSpec().weights_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = json.loads(done.stdout.strip().splitlines()[-1])["losses"]
    assert losses == pytest.approx(_log(role)["losses"][:FIRST_STEPS], rel=1e-4)


def test_serving_never_imports_the_training_code() -> None:
    """The services and the engine run without ``training`` (it is not installed with the package)."""
    code = (
        "import sys, engine.scheduler.engine, engine.executor.runner, engine.model.embedded, services.launcher, "
        "services.scheduler.__main__, services.executor.__main__, services.grammar.__main__\n"
        "print(sorted(m for m in sys.modules if m == 'training' or m.startswith('training.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
