"""A gRPC client of SglangScheduler against the embedded model: what it receives equals what the engine makes.

Real server on loopback, real stubs from smg-grpc-proto, the real engine behind it. Aborts and cancellations
must leave the engine at its baseline: no request running, no KV page held, no slot taken.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from tests.e2e.stack import wait_for_idle_load
from tests.helpers import assert_engine_baseline, serve_scheduler, smg_request

TIMEOUT = 30.0
# max_new_tokens of requests that are aborted or cancelled long before they end. A request that was not stopped
# would run LONG steps, so counting steps tells "stopped" from "finished anyway" whatever the machine's speed.
LONG = 2000


@pytest.fixture(scope="module")
def engine(embedded_model_dir: Path) -> Iterator[Engine]:
    config = EngineConfig(model_path=str(embedded_model_dir), page_size=8, num_pages=512, max_running=8, chunk_size=64)
    with Engine(config) as e:
        yield e


@pytest.fixture(scope="module")
def stub(engine: Engine) -> Iterator[pb_grpc.SglangSchedulerStub]:
    with serve_scheduler(engine) as channel:
        yield pb_grpc.SglangSchedulerStub(channel)


def _request(ids: list[int], rid: str = "", stream: bool = False, **fields: Any) -> pb.GenerateRequest:
    logprobs = fields.pop("top_logprobs_num", None)
    request = smg_request(ids, rid, stream, **{"ignore_eos": True, **fields})
    if logprobs is not None:
        request.return_logprob = True
        request.top_logprobs_num = logprobs
    return request


def _split(responses: list[pb.GenerateResponse]) -> tuple[list[pb.GenerateStreamChunk], list[pb.GenerateComplete]]:
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    completes = [r.complete for r in responses if r.HasField("complete")]
    return chunks, completes


def _assert_baseline(engine: Engine, stub: pb_grpc.SglangSchedulerStub, steps_before: int) -> None:
    """Bounded wait until GetLoads shows nothing running or held, then check the engine's own accounting and
    that the long request stopped early instead of running to its end."""
    wait_for_idle_load(stub, TIMEOUT)
    assert_engine_baseline(engine, TIMEOUT)
    assert engine.stats().steps - steps_before < LONG // 2, "the request was not stopped"


def test_streaming_greedy_equals_the_in_process_engine(engine: Engine, stub: pb_grpc.SglangSchedulerStub) -> None:
    prompt = [11, 57, 300, 42, 901, 17]
    (expected,) = engine.generate_batch([prompt], [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)])
    responses = list(stub.Generate(_request(prompt, stream=True, max_new_tokens=12), timeout=TIMEOUT))
    chunks, (complete,) = _split(responses)
    assert responses[-1].HasField("complete")
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == list(complete.output_ids) == list(expected.output_ids or ())
    assert [c.completion_tokens for c in chunks] == list(range(1, 13))
    assert all(c.prompt_tokens == len(prompt) for c in chunks)
    assert (complete.finish_reason, complete.completion_tokens, complete.prompt_tokens) == ("length", 12, 6)


def test_non_streaming_equals_streaming(stub: pb_grpc.SglangSchedulerStub) -> None:
    prompt = [23, 5, 88, 1200, 7]
    streamed = list(stub.Generate(_request(prompt, stream=True, max_new_tokens=10), timeout=TIMEOUT))
    whole = list(stub.Generate(_request(prompt, max_new_tokens=10), timeout=TIMEOUT))
    assert len(whole) == 1 and whole[0].HasField("complete")
    assert whole[0].complete.output_ids == streamed[-1].complete.output_ids
    assert [t for c in _split(streamed)[0] for t in c.token_ids] == list(whole[0].complete.output_ids)


def test_stop_token_reports_the_matched_token(stub: pb_grpc.SglangSchedulerStub) -> None:
    prompt = [31, 32, 33, 34]
    (free,) = list(stub.Generate(_request(prompt, max_new_tokens=8), timeout=TIMEOUT))
    stop_at = free.complete.output_ids[3]
    first = list(free.complete.output_ids).index(stop_at)
    (stopped,) = list(stub.Generate(_request(prompt, max_new_tokens=8, stop_token_ids=[stop_at]), timeout=TIMEOUT))
    assert stopped.complete.finish_reason == "stop"
    assert stopped.complete.WhichOneof("matched_stop") == "matched_token_id"
    assert stopped.complete.matched_token_id == stop_at
    assert list(stopped.complete.output_ids) == list(free.complete.output_ids)[: first + 1]


@pytest.mark.parametrize("stream", [False, True])
def test_n2_gives_a_complete_per_index(stream: bool, stub: pb_grpc.SglangSchedulerStub) -> None:
    request = _request([40, 41, 42], rid=f"n2-{stream}", stream=stream, max_new_tokens=6, n=2, temperature=1.0)
    responses = list(stub.Generate(request, timeout=TIMEOUT))
    chunks, completes = _split(responses)
    assert sorted(c.index for c in completes) == [0, 1]
    assert all(c.finish_reason == "length" and len(c.output_ids) == 6 for c in completes)
    assert all(r.request_id == f"n2-{stream}" for r in responses)
    if stream:
        for index in (0, 1):
            complete = next(c for c in completes if c.index == index)
            tokens = [t for c in chunks if c.index == index for t in c.token_ids]
            assert tokens == list(complete.output_ids)
    else:
        assert not chunks


def test_logprobs_with_top_logprobs(stub: pb_grpc.SglangSchedulerStub) -> None:
    request = _request([60, 61, 62, 63], stream=True, max_new_tokens=5, top_logprobs_num=3)
    chunks, (complete,) = _split(list(stub.Generate(request, timeout=TIMEOUT)))
    for chunk in chunks:
        lp = chunk.output_logprobs
        assert list(lp.token_ids) == list(chunk.token_ids) and len(lp.token_logprobs) == 1
        (top,) = lp.top_logprobs
        assert len(top.values) == len(top.token_ids) == 3
        # Greedy: the chosen token is the most likely one.
        assert top.token_ids[0] == chunk.token_ids[0] and abs(top.values[0] - lp.token_logprobs[0]) < 1e-5
        assert all(v <= 0.0 for v in top.values) and list(top.values) == sorted(top.values, reverse=True)
    total = complete.output_logprobs
    assert list(total.token_ids) == list(complete.output_ids)
    assert list(total.token_logprobs) == [c.output_logprobs.token_logprobs[0] for c in chunks]
    assert len(total.top_logprobs) == 5


def test_abort_mid_stream_ends_with_an_abort_complete(engine: Engine, stub: pb_grpc.SglangSchedulerStub) -> None:
    steps = engine.stats().steps
    call = stub.Generate(_request([70, 71, 72], rid="to-abort", stream=True, max_new_tokens=LONG), timeout=TIMEOUT)
    assert next(call).HasField("chunk")
    answer = stub.Abort(pb.AbortRequest(request_id="to-abort", reason="Stream dropped"), timeout=TIMEOUT)
    assert answer.success
    rest = list(call)  # the stream ends by itself after the Complete
    assert rest and rest[-1].HasField("complete") and all(r.HasField("chunk") for r in rest[:-1])
    complete = rest[-1].complete
    assert complete.finish_reason == "abort" and complete.completion_tokens < LONG
    _assert_baseline(engine, stub, steps)


def test_abort_of_n2_request_aborts_every_sample(engine: Engine, stub: pb_grpc.SglangSchedulerStub) -> None:
    steps = engine.stats().steps
    request = _request([80, 81], rid="n2-abort", stream=True, max_new_tokens=LONG, n=2, temperature=1.0)
    call = stub.Generate(request, timeout=TIMEOUT)
    assert next(call).HasField("chunk")
    assert stub.Abort(pb.AbortRequest(request_id="n2-abort"), timeout=TIMEOUT).success
    _, completes = _split(list(call))
    assert sorted(c.index for c in completes) == [0, 1]
    assert all(c.finish_reason == "abort" for c in completes)
    _assert_baseline(engine, stub, steps)


def test_cancelled_stream_leaves_nothing_running(engine: Engine, stub: pb_grpc.SglangSchedulerStub) -> None:
    steps = engine.stats().steps
    call = stub.Generate(_request([90, 91, 92], rid="to-cancel", stream=True, max_new_tokens=LONG), timeout=TIMEOUT)
    assert next(call).HasField("chunk")
    assert stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT).loads[0].num_running_reqs == 1
    call.cancel()
    _assert_baseline(engine, stub, steps)
    # The id is free again: the servicer forgot the cancelled request.
    (again,) = list(stub.Generate(_request([90, 91], rid="to-cancel", max_new_tokens=2), timeout=TIMEOUT))
    assert again.complete.finish_reason == "length"
