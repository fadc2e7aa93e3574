"""The shipped weights are the ones the training script wrote, and the script still trains them the same way.

The full training runs for hours (scripts/train-embedded, never in CI); these tests hold the pieces it leaves behind
to it: each shipped file's sha256 is the one its spec names and its training log recorded, the corpus generator
still writes the corpus the log describes (size and sha256), and the first optimiser steps of both recipes, and of
the draft's tuning on the target's continuations, give the losses the committed logs recorded (fresh processes, one
thread, as the recipe says).
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
DRAFT_BASE = REPO / "training" / "weights" / "ordinal-embedded-draft-base.safetensors"  # the corpus stage's draft


def _log(role: str) -> dict[str, Any]:
    return dict(json.loads((LOGS / f"{role}.json").read_text(encoding="utf-8")))


def test_the_shipped_files_are_the_ones_training_wrote() -> None:
    """The target is its training run's; the draft is the tuning run's (training/self_distill.py), which started from
    the corpus run's draft (kept in training/weights/) and distilled the shipped target."""
    target, draft, tune = _log("target"), _log("draft"), _log("draft-tune")
    assert file_sha256(EmbeddedSpec().weights_path) == EmbeddedSpec().weights_sha256 == target["weights_sha256"]
    assert file_sha256(DRAFT_SPEC.weights_path) == DRAFT_SPEC.weights_sha256 == tune["weights_sha256"]
    assert file_sha256(DRAFT_BASE) == draft["weights_sha256"] == tune["base_sha256"]
    assert tune["teacher_sha256"] == target["weights_sha256"]


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


@pytest.mark.slow
def test_the_tuning_reproduces_its_first_sequences_and_steps(tmp_path: Path) -> None:
    """``python -m training.self_distill --stop-after 3`` in a fresh process generates the logged run's first batch
    of target continuations (its sha256) and gives its first three losses; fails if the prompts, the generation, the
    step order or the loss changed since the shipped draft was tuned."""
    argv = [sys.executable, "-m", "training.self_distill", "--out", str(tmp_path), "--stop-after", str(FIRST_STEPS)]
    argv += ["--teacher", str(EmbeddedSpec().weights_path), "--base", str(DRAFT_BASE)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    logged = _log("draft-tune")
    assert got["first_batch_sha256"] == logged["first_batch_sha256"]
    assert got["losses"] == pytest.approx(logged["losses"][:FIRST_STEPS], rel=1e-4)


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
