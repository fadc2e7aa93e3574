"""The scheduler service when its executor dies: a real gRPC client sees it, in bounded time, and recovers.

The executor runs as a child process (so it can be SIGKILLed: no goodbye on the wire); the scheduler's gRPC
server runs in this process around an Engine over ``RemoteRunner``. A client streaming a long request when the
executor is killed gets status UNAVAILABLE (what smg retries), not a hang and not a normal end; health then
says so on both APIs; a request sent while the executor is down waits for it (within the outage timeout). Once an
executor is back on the same address the service is healthy again, the waiting request runs, greedy outputs equal
those from before the kill (the prefix cache pointing at the lost KV was dropped) and nothing is left held on either
side. (A request whose outage timeout runs out first ends UNAVAILABLE: tests/contract/test_scheduler_api.py.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.scheduler.engine import Engine
from protos import executor_pb2, executor_pb2_grpc
from services.remote_runner import RemoteRunner
from services.scheduler.servicer import SERVICE_NAME
from tests.e2e.stack import ExecutorProcess, greedy_request, read_until_unavailable, wait_for, wait_for_idle_load
from tests.support.servers import ThreadedServer

PAGE_SIZE = 8
NUM_PAGES = 512
WAIT_S = 60.0  # RPC deadlines and process starts: generous, only hit when something is broken
END_BOUND_S = 15.0  # how long an RPC may take to end once the executor is gone
HEALTH_BOUND_S = 15.0  # the grpc.health.v1 monitor refreshes every 2 s and the probe waits at most 1 s
LONG = 2000  # far more tokens than are generated before the kill
PROMPT = [101, 7, 256, 33, 1400, 9, 88, 512, 3, 64, 700, 21]
SHORT = 8


class Scheduler:
    """The stubs a client of the scheduler service uses."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.api = pb_grpc.SglangSchedulerStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def greedy(self, ids: list[int], rid: str) -> list[int]:
        (reply,) = list(self.api.Generate(greedy_request(ids, SHORT, rid), timeout=WAIT_S))
        assert reply.complete.finish_reason == "length", reply
        return list(reply.complete.output_ids)

    def healthy(self) -> bool:
        return bool(self.api.HealthCheck(pb.HealthCheckRequest(), timeout=WAIT_S).healthy)

    def health_v1(self) -> set[int]:
        """grpc.health.v1 statuses of the server ("") and of SglangScheduler."""
        check = self.health.Check
        return {check(health_pb2.HealthCheckRequest(service=s), timeout=WAIT_S).status for s in ("", SERVICE_NAME)}


@pytest.fixture
def executors() -> Iterator[list[ExecutorProcess]]:
    """Executor processes a test starts (append); any still running at the end is killed."""
    started: list[ExecutorProcess] = []
    yield started
    for proc in started:
        proc.kill()


def _executor_buffers(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        state = executor_pb2_grpc.ExecutorStub(channel).GetState(executor_pb2.StateRequest(), timeout=WAIT_S)
    return int(state.buffers)


def _queued(api: pb_grpc.SglangSchedulerStub) -> int:
    return int(api.GetLoads(pb.GetLoadsRequest(), timeout=WAIT_S).loads[0].num_waiting_reqs)


def test_executor_killed_mid_stream_then_restarted(
    embedded_model_dir: Path, tmp_path: Path, executors: list[ExecutorProcess]
) -> None:
    log = tmp_path / "executor.log"
    first = ExecutorProcess(embedded_model_dir, PAGE_SIZE, NUM_PAGES, 0, log)
    executors.append(first)
    config = EngineConfig(
        model_path=str(embedded_model_dir),
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_running=8,
        chunk_size=64,
        outage_timeout_s=WAIT_S,
    )
    with (
        Engine(config, RemoteRunner.connect(first.target, timeout=WAIT_S)) as engine,
        ThreadedServer(engine, executor=first.target) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.start()}") as channel,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        scheduler = Scheduler(channel)
        assert scheduler.healthy() and scheduler.health_v1() == {health_pb2.HealthCheckResponse.SERVING}
        expected = scheduler.greedy(PROMPT, "before")  # also leaves PROMPT in the prefix cache

        # A long stream is running when the executor is killed: the stream fails, it does not hang.
        call = scheduler.api.Generate(greedy_request(PROMPT[:5], LONG, "long", stream=True), timeout=WAIT_S)
        for _ in range(3):
            assert next(call).HasField("chunk")
        killed_at = time.monotonic()
        first.kill()
        details = read_until_unavailable(call, killed_at, END_BOUND_S)
        assert "executor unavailable" in details, details

        # Both health APIs report the loss.
        wait_for(lambda: not scheduler.healthy(), HEALTH_BOUND_S, "HealthCheck healthy=false")
        not_serving = {health_pb2.HealthCheckResponse.NOT_SERVING}
        wait_for(lambda: scheduler.health_v1() == not_serving, HEALTH_BOUND_S, "grpc.health.v1 NOT_SERVING")

        # A request sent while the executor is down waits for it, queued, holding nothing.
        waiting = pool.submit(lambda: list(scheduler.api.Generate(greedy_request(PROMPT, SHORT, "w"), timeout=WAIT_S)))
        wait_for(lambda: _queued(scheduler.api) == 1, END_BOUND_S, "the request sent while down queued")
        time.sleep(1.0)  # several probes of the lost executor: still queued, not failed
        assert not waiting.done() and _queued(scheduler.api) == 1

        # An executor back on the same address: healthy again, the waiting request runs, same greedy output.
        second = ExecutorProcess(embedded_model_dir, PAGE_SIZE, NUM_PAGES, first.port, log)
        executors.append(second)
        (reply,) = waiting.result(WAIT_S)
        assert reply.complete.finish_reason == "length" and list(reply.complete.output_ids) == expected, reply
        wait_for(scheduler.healthy, HEALTH_BOUND_S, "HealthCheck healthy=true after the restart")
        serving = {health_pb2.HealthCheckResponse.SERVING}
        wait_for(lambda: scheduler.health_v1() == serving, HEALTH_BOUND_S, "grpc.health.v1 SERVING again")
        assert scheduler.greedy(PROMPT, "after") == expected
        load = wait_for_idle_load(scheduler.api, END_BOUND_S)
        assert load.token_usage == 0.0, load
        assert engine.wait_idle(WAIT_S)
        stats = engine.stats()
        assert stats.free_pages + stats.evictable_pages == stats.total_pages and stats.reserved_pages == 0, stats
        assert _executor_buffers(second.target) == 0
    assert second.terminate() == 0  # the restarted executor still stops cleanly
