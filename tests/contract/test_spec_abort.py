"""Aborts against speculative steps (C7, C9), on the split stack with a step gate, speculation on.

    Engine ──RemoteRunner──▶ StepGate ──▶ executor service ──▶ ModelRunner (embedded model, drafts from itself)

The target drafts for itself (every draft accepted: each verify returns a run of five tokens), so which tokens a
held verify carries is known. The abort comes while a verify's result is held at the gate: the run it carries is
never streamed (C7), the draft and verify pages the request took come back, its executor buffer and its draft
model's per-slot state go (C9).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import EngineConfig, SpecAlgorithm, SpeculativeConfig
from engine.executor.runner import ModelRunner
from tests.contract.gated_stack import (
    WAIT_S,
    assert_abort_honoured,
    assert_back_to,
    assert_one_tick_lag,
    baseline,
    gated_engine,
    greedy,
    mark_abort,
    solo_outputs,
    submit,
)
from tests.support.gate import decode, entries_of
from tests.support.servers import ExecutorThread

PAGE = 4
STEPS = 4
PROMPT = tuple(random.Random(8).randrange(10, 2000) for _ in range(6))
MAX_NEW = 24


@pytest.fixture(scope="module")
def config(embedded_model_dir: Path) -> EngineConfig:
    spec = SpeculativeConfig(
        SpecAlgorithm.DRAFT, draft_model_path=str(embedded_model_dir), num_steps=STEPS, adaptive=False, draft_min_prob=0
    )
    return EngineConfig(
        model_path=str(embedded_model_dir),
        page_size=PAGE,
        num_pages=64,
        max_running=4,
        chunk_size=16,
        speculative=spec,
        check_invariants=True,
    )


@pytest.fixture(scope="module")
def runner(config: EngineConfig) -> Iterator[ModelRunner]:
    runner = ModelRunner.load(replace(config, grammar_wait_s=WAIT_S))
    yield runner
    runner.shutdown()


@pytest.fixture(scope="module")
def executor(runner: ModelRunner) -> Iterator[str]:
    server = ExecutorThread(runner)
    yield f"127.0.0.1:{server.port}"
    server.stop()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_abort_while_a_verify_step_is_in_flight_drops_its_run_and_frees_its_pages(
    config: EngineConfig, executor: str, runner: ModelRunner, overlap: bool
) -> None:
    """The first verify's run (tokens 1-5) streamed, the second verify's result held: the abort wins, the stream
    ends with six tokens (a prefix of the request's output alone), and after the drain every page, slot, buffer
    and draft state is back. Fails if `if req.finishing: continue` in `Scheduler.commit` is removed (the held run's
    tokens are streamed after the abort) or if `ModelRunner._release` stops telling the proposer (its per-slot
    draft state outlives the request)."""
    cfg = replace(config, overlap=overlap)
    with gated_engine(executor, cfg) as (engine, gate):
        (solo,) = solo_outputs(engine, [PROMPT], [greedy(MAX_NEW)])
        base = baseline(engine, gate)
        gate.hold_results(decode("r", 2))  # the verify after the first: it builds on the run at ordinal 1
        r = submit(engine, "r", PROMPT, greedy(MAX_NEW))
        gate.wait_for_result_held(decode("r", 2))
        assert r.wait_tokens(1 + 1 + STEPS) == solo[: 2 + STEPS]
        held = [e for _, e in entries_of(gate.launched_steps(), "r") if e.input_ref]
        assert held and all(e.num_draft == STEPS for e in held)  # the steps in flight verify drafts
        mark = mark_abort(engine, gate, "r")
        gate.release_all()
        r.assert_aborted(2 + STEPS)
        assert r.tokens == solo[: 2 + STEPS]
        assert_abort_honoured(mark, r, engine, gate)
        assert_one_tick_lag(engine, gate, "r")
        assert_back_to(base, engine, gate)
        assert runner.proposer_slots == 0
