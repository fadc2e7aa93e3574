"""The in-process engine on the embedded model: the same outputs whatever the batching, and nothing leaked.

Each test compares real generations (real forward, paged KV, sampler) between two ways of running them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from engine.finish import FinishReason
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from tests.helpers import assert_engine_baseline, length_outputs, random_prompts


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _alone(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [length_outputs(engine, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]


def _assert_baseline(engine: Engine) -> None:
    assert_engine_baseline(engine, 60)
    assert isinstance(engine.runner, ModelRunner) and engine.runner.num_buffers == 0
    if engine.scheduler.cache is not None:
        engine.scheduler.cache.check_invariants()


@pytest.fixture(scope="module")
def base_config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(embedded_model_dir), page_size=8, num_pages=1024, max_running=64, chunk_size=64)


@pytest.fixture(scope="module")
def engine(base_config: EngineConfig) -> Iterator[Engine]:
    with Engine(base_config) as e:
        yield e


@pytest.fixture(scope="module")
def batch32(engine: Engine) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    """32 prompts of mixed lengths (some longer than the chunk size), their params and solo outputs."""
    prompts = random_prompts(32, 3, 150, engine.info.vocab_size, seed=1)
    params = [_greedy(4 + (i * 7) % 21) for i in range(32)]
    return prompts, params, _alone(engine, prompts, params)


def test_batch_of_32_matches_alone(engine: Engine, batch32: tuple) -> None:
    prompts, params, alone = batch32
    assert length_outputs(engine, prompts, params) == alone
    _assert_baseline(engine)


@pytest.mark.parametrize(
    "change",
    [
        {"overlap": False},
        {"chunk_size": 4096},
        {"prefix_cache": False},
        {"chunk_size": 7, "page_size": 4},
    ],
    ids=["overlap-off", "unchunked", "prefix-cache-off", "chunks-of-7"],
)
def test_variants_match(base_config: EngineConfig, batch32: tuple, change: dict) -> None:
    prompts, params, alone = batch32
    with Engine(replace(base_config, **change)) as other:
        assert length_outputs(other, prompts, params) == alone
        _assert_baseline(other)


def test_seeded_sampling_same_whatever_the_batch(engine: Engine) -> None:
    prompts = random_prompts(12, 5, 40, engine.info.vocab_size, seed=2)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_new_tokens=12, ignore_eos=True)
        for i in range(12)
    ]
    alone = _alone(engine, prompts, params)
    together = length_outputs(engine, prompts, params)
    reversed_batch = length_outputs(engine, prompts[::-1], params[::-1])[::-1]
    assert together == alone == reversed_batch
    # and it is really sampling: different seeds give different continuations for the same prompt
    other = length_outputs(engine, [prompts[0]] * 2, [replace(params[0], seed=7), replace(params[0], seed=8)])
    assert other[0] != other[1]


def test_shared_prefix_prefills_only_new_tokens(engine: Engine) -> None:
    _assert_baseline(engine)
    rng = random.Random(3)
    prefix = [rng.randrange(10, engine.info.vocab_size) for _ in range(64)]
    first = [*prefix, 11, 12, 13]
    second = [*prefix, 21, 22, 23, 24, 25]
    before = engine.stats().prefill_tokens
    length_outputs(engine, [first], [_greedy(4)])
    middle = engine.stats().prefill_tokens
    out = engine.generate_batch([second], [_greedy(4)])[0]
    after = engine.stats().prefill_tokens
    assert middle - before == len(first)
    assert out.num_cached_tokens == 64
    assert after - middle == len(second) - 64  # only the 5 new tokens were prefilled


def test_64_requests_through_a_pool_for_8(base_config: EngineConfig, engine: Engine) -> None:
    prompts = random_prompts(64, 20, 60, engine.info.vocab_size, seed=4)
    params = [_greedy(8 + i % 9) for i in range(64)]
    alone = _alone(engine, prompts, params)
    # each request needs at most ceil((60 + 16) / 8) = 10 pages: 80 pages fit about 8 at once
    small = replace(base_config, num_pages=80, page_size=8)
    with Engine(small) as tight:
        assert length_outputs(tight, prompts, params) == alone
        _assert_baseline(tight)


@pytest.mark.asyncio
async def test_async_stream_and_abort(engine: Engine) -> None:
    """Engine.generate as an async iterator: a whole stream, then one aborted after three tokens."""
    prompt = random_prompts(1, 10, 10, engine.info.vocab_size, seed=5)[0]
    streamed: list[int] = []
    async for out in engine.generate(prompt, _greedy(10)):
        streamed.extend(out.new_token_ids)
        final = out
    assert final.finish is not None and final.output_ids is not None
    assert streamed == list(final.output_ids) and len(streamed) == 10
    got: list[int] = []
    reason = None
    async for out in engine.generate(prompt, _greedy(1000)):
        got.extend(out.new_token_ids)
        if len(got) >= 3 and out.finish is None:
            engine.abort(out.request_id)
        if out.finish is not None:
            reason = out.finish.reason
    assert reason is FinishReason.ABORT
    _assert_baseline(engine)
