"""The engine split in two: the scheduler (Engine) drives a real executor service over gRPC.

Same outputs as the in-process engine, nothing leaked on either side, and an executor that dies mid-run
ends every request it held with an executor abort (no hang), after which a restarted executor serves again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from engine.finish import AbortCause, FinishReason
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from engine.scheduler.request import RequestOutput
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from services.remote_runner import RemoteRunner
from tests.e2e.stack import ExecutorProcess, wait_for
from tests.helpers import assert_engine_baseline, length_outputs, random_prompts
from tests.support.servers import ExecutorThread

WAIT_S = 60.0

Workload = tuple[list[list[int]], list[SamplingParams], list[list[int]]]


@pytest.fixture(scope="module")
def config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(embedded_model_dir), page_size=8, num_pages=256, max_running=16, chunk_size=32)


@pytest.fixture(scope="module")
def workload(config: EngineConfig) -> Workload:
    """16 greedy requests of mixed lengths (about half longer than the chunk size) and their in-process outputs."""
    prompts = random_prompts(16, 3, 90, 2000, seed=7)
    params = [SamplingParams(temperature=0.0, max_new_tokens=4 + (i * 5) % 13, ignore_eos=True) for i in range(16)]
    with Engine(config) as local:
        expected = _outputs(local, prompts, params)
    return prompts, params, expected


@pytest.fixture(scope="module")
def runner(config: EngineConfig) -> Iterator[ModelRunner]:
    loaded = ModelRunner.load(config)
    yield loaded
    loaded.shutdown()


@pytest.fixture(scope="module")
def executor(runner: ModelRunner) -> Iterator[str]:
    server = ExecutorThread(runner)
    yield f"127.0.0.1:{server.port}"
    server.stop()


def _outputs(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return length_outputs(engine, prompts, params, timeout=WAIT_S)


def _executor_buffers(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return int(pb_grpc.ExecutorStub(channel).GetState(pb.StateRequest(), timeout=5).buffers)


def _assert_baseline(engine: Engine, target: str) -> None:
    assert_engine_baseline(engine, WAIT_S)
    assert _executor_buffers(target) == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_split_engine_matches_in_process(
    config: EngineConfig, workload: Workload, executor: str, overlap: bool
) -> None:
    prompts, params, expected = workload
    with Engine(replace(config, overlap=overlap), RemoteRunner.connect(executor, timeout=WAIT_S)) as engine:
        assert _outputs(engine, prompts, params) == expected
        _assert_baseline(engine, executor)
        assert engine.runner.healthy()


def test_executor_restarted_while_idle(config: EngineConfig, workload: Workload, runner: ModelRunner) -> None:
    """A loss nobody was waiting on still reaches the scheduler: its prefix cache points at KV that is gone.

    The engine asks the runner for an unreported loss before planning (`Engine._loop`, `take_loss`), so the
    first request after the restart runs on the new executor with correct outputs and no prefix hit from the
    dropped cache. Without that check it would be planned on the lost session and aborted (checked once by
    removing the `take_loss` call: the first request then ends with an executor abort).
    """
    prompts, params, expected = workload
    server = ExecutorThread(runner)
    target = f"127.0.0.1:{server.port}"
    try:
        remote = RemoteRunner.connect(target, timeout=WAIT_S)
        with Engine(config, remote) as engine:
            assert _outputs(engine, prompts[:4], params[:4]) == expected[:4]
            assert engine.stats().evictable_pages > 0  # the prompts are cached
            server.stop()
            wait_for(lambda: remote.session_lost, WAIT_S, "the remote runner noticing the lost session")
            server = ExecutorThread(runner, port=int(target.rsplit(":", 1)[1]))
            (first,) = engine.generate_batch(prompts[:1], params[:1], timeout=WAIT_S)
            assert first.finish is not None and first.finish.cause is None, first
            assert list(first.output_ids or ()) == expected[0]
            assert first.num_cached_tokens == 0  # the cache was dropped with the lost KV
            assert _outputs(engine, prompts, params) == expected
            _assert_baseline(engine, target)
    finally:
        server.stop()


def _executor_process(config: EngineConfig, port: int, log_path: Path) -> ExecutorProcess:
    """``python -m services.executor`` serving ``config``'s model and KV pool as a child process."""
    assert config.model_path is not None
    return ExecutorProcess(Path(config.model_path), config.page_size, config.num_pages, port, log_path)


def test_executor_killed_mid_run_then_restarted(config: EngineConfig, workload: Workload, tmp_path: Path) -> None:
    prompts, params, expected = workload
    first = _executor_process(config, 0, tmp_path / "executor.log")
    second: ExecutorProcess | None = None
    try:
        remote = RemoteRunner.connect(first.target, timeout=WAIT_S)
        with Engine(config, remote) as engine:
            started = threading.Event()
            finals = [_submit_long(engine, prompts[i], started) for i in range(3)]
            assert started.wait(WAIT_S)  # tokens are flowing: the requests are in flight
            killed_at = time.monotonic()
            first.kill()
            outs = [f.result(timeout=WAIT_S) for f in finals]
            assert time.monotonic() - killed_at < 15.0
            for out in outs:
                assert out.finish is not None and out.finish.reason is FinishReason.ABORT, out
                assert out.finish.cause is AbortCause.EXECUTOR and "executor unavailable" in (out.finish.message or "")
            assert not remote.healthy()
            s = engine.stats()
            assert s.free_pages == s.total_pages and s.reserved_pages == 0 and s.free_slots == s.total_slots, s

            old_instance = remote.instance_id
            second = _executor_process(config, first.port, tmp_path / "executor.log")  # the same address
            wait_for(remote.healthy, 10.0, "the runner healthy again")  # reconnect backoff is at most a second
            assert _outputs(engine, prompts, params) == expected  # the lost prefix cache was not reused
            assert remote.instance_id != old_instance
            _assert_baseline(engine, second.target)
        assert second.terminate() == 0  # SIGTERM stops it cleanly
        second = None
    finally:
        for proc in (first, second):
            if proc is not None and proc.proc.poll() is None:
                proc.kill()


def _submit_long(engine: Engine, prompt: list[int], started: threading.Event) -> Future[RequestOutput]:
    """A request far longer than the test waits for; ``started`` is set on its first token."""
    final: Future[RequestOutput] = Future()

    def sink(out: RequestOutput) -> None:
        if out.new_token_ids:
            started.set()
        if out.finished:
            final.set_result(out)

    engine.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=500, ignore_eos=True), sink)
    return final
