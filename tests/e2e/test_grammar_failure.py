"""The split services when the grammar service dies: only constrained requests notice, in bounded time, and they
work again once it is back.

The grammar service runs as a child process, so it can be SIGKILLed (no goodbye on the wire); the executor and the
scheduler are servers in this process (``split_stack``), and the client speaks only the public API. A constrained
stream running at the kill ends UNAVAILABLE naming the grammar service, while an unconstrained stream beside it runs
to its end undisturbed; HealthCheck stays healthy and says what is degraded; a constrained request sent while the
service is down waits for it (the outage timeout), then fails UNAVAILABLE. A new instance on the same port (its
matchers gone) serves constrained requests again with the same greedy output, and nothing is left held anywhere:
no matcher, no executor buffer, no KV page or slot.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from engine.config import EngineConfig
from protos import executor_pb2, executor_pb2_grpc
from services.grammar_client import GrammarClient
from tests.e2e.split import Stack, split_stack
from tests.e2e.stack import GrammarProcess, read_until_unavailable, wait_for, wait_for_idle_load
from tests.helpers import assert_engine_baseline, smg_request

WAIT_S = 60.0
END_BOUND_S = 15.0  # how long a constrained RPC may take to end once the grammar service is gone
OUTAGE_S = 3.0  # how long a new constrained request waits for the grammar service
PROMPT = [101, 7, 256, 33, 1400, 9, 88, 512, 3, 64, 700, 21]
REGEX = "[a-z ]+"  # never ends by itself: with min_new_tokens the stop token is banned, so a request ends by length
LONG = 400
SHORT = 8


def _request(rid: str, n: int, constrained: bool, stream: bool = False) -> pb.GenerateRequest:
    fields = {"regex": REGEX} if constrained else {}
    return smg_request(PROMPT, rid, stream, max_new_tokens=n, min_new_tokens=n, **fields)


def _greedy(s: Stack, rid: str, constrained: bool) -> list[int]:
    (reply,) = list(s.stub.Generate(_request(rid, SHORT, constrained), timeout=WAIT_S))
    assert reply.complete.finish_reason == "length", reply
    return list(reply.complete.output_ids)


def _health(s: Stack) -> pb.HealthCheckResponse:
    return s.stub.HealthCheck(pb.HealthCheckRequest(), timeout=WAIT_S)


def _executor_buffers(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        state = executor_pb2_grpc.ExecutorStub(channel).GetState(executor_pb2.StateRequest(), timeout=WAIT_S)
    return int(state.buffers)


@pytest.mark.slow
def test_grammar_service_killed_mid_stream_then_restarted(embedded_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "grammar.log"
    first = GrammarProcess(embedded_model_dir, 0, log)
    processes = [first]
    config = EngineConfig(
        model_path=str(embedded_model_dir),
        page_size=8,
        num_pages=512,
        max_running=8,
        chunk_size=64,
        outage_timeout_s=OUTAGE_S,
    )
    try:
        with split_stack(config, first.target) as s:
            expected = _greedy(s, "before", constrained=True)
            health = _health(s)
            assert health.healthy and "grammar service answers" in health.message, health

            constrained = s.stub.Generate(_request("constrained", LONG, True, stream=True), timeout=WAIT_S)
            free = s.stub.Generate(_request("free", LONG, False, stream=True), timeout=WAIT_S)
            assert next(constrained).HasField("chunk") and next(free).HasField("chunk")
            killed = time.monotonic()
            first.kill()
            details = read_until_unavailable(constrained, killed, END_BOUND_S)
            assert details.startswith("grammar service unavailable"), details

            health = _health(s)
            assert health.healthy and "degraded: constrained requests fail with UNAVAILABLE" in health.message, health

            sent = time.monotonic()
            with pytest.raises(grpc.RpcError) as late:
                list(s.stub.Generate(_request("while-down", SHORT, True), timeout=WAIT_S))
            waited = time.monotonic() - sent
            assert late.value.code() is grpc.StatusCode.UNAVAILABLE, late.value
            assert (late.value.details() or "").startswith("grammar service unavailable"), late.value.details()
            assert OUTAGE_S - 0.5 <= waited < OUTAGE_S + END_BOUND_S, waited

            # The unconstrained stream never noticed: every token, then its Complete.
            rest = list(free)
            assert rest[-1].complete.finish_reason == "length" and rest[-1].complete.completion_tokens == LONG

            second = GrammarProcess(embedded_model_dir, first.port, log)
            processes.append(second)
            assert _greedy(s, "after", constrained=True) == expected
            wait_for(lambda: "grammar service answers" in _health(s).message, END_BOUND_S, "HealthCheck not degraded")

            wait_for_idle_load(s.stub, END_BOUND_S)
            assert_engine_baseline(s.engine, WAIT_S)
            assert _executor_buffers(s.executor) == 0
            with GrammarClient(second.target) as client:
                state = client.get_state()
            assert (state.num_open, state.num_waiting, state.num_sessions) == (0, 0, 1), state
    finally:
        for process in processes:
            process.kill()
