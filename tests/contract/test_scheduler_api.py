"""The scheduler's public API contract (SglangScheduler from smg-grpc-proto), over real gRPC on loopback.

Bad input is refused with INVALID_ARGUMENT naming the proto field, before anything is allocated: the engine's
stats (steps run, pages, slots, prefill tokens) are exactly what they were. Missing features answer
UNIMPLEMENTED; a lost executor answers UNAVAILABLE. The info RPCs, GetTokenizer, grpc.health.v1 and reflection
report what the engine really has.

Each assertion fails when its enforcement is removed: e.g. dropping the ``sp.n < 1`` check in
``convert._num_samples`` lets n=0 through (an OK stream with no Complete), and dropping the zero-means-off
mapping of top_k turns an unset top_k into an INVALID_ARGUMENT.
"""

from __future__ import annotations

import hashlib
import io
import math
import time
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from engine.scheduler.engine import Engine
from services.scheduler.servicer import SERVICE_NAME
from services.scheduler.tokenizer_zip import tokenizer_chunks
from tests.e2e.stack import wait_for
from tests.helpers import serve_scheduler, smg_params, smg_request
from tests.support.runners import LosableRunner

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(embedded_model_dir), page_size=8, num_pages=128, max_running=8, chunk_size=64)


@pytest.fixture(scope="module")
def engine(config: EngineConfig) -> Iterator[Engine]:
    with Engine(config) as e:
        yield e


@pytest.fixture(scope="module")
def channel(engine: Engine) -> Iterator[grpc.Channel]:
    with serve_scheduler(engine) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(channel)


def _params(**fields: Any) -> pb.SamplingParams:
    return smg_params(**{"max_new_tokens": 4, **fields})


def _request(ids: list[int], rid: str = "", stream: bool = False, **fields: Any) -> pb.GenerateRequest:
    return smg_request(ids, rid, stream, **{"max_new_tokens": 4, **fields})


def _error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _collect(stub: pb_grpc.SglangSchedulerStub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=TIMEOUT))


# ------------------------------------------------------------------------------------------ bad input


def _bad(field: str, **fields: Any) -> tuple[str, pb.GenerateRequest]:
    return field, _request([5, 6, 7], **fields)


_BAD_REQUESTS: dict[str, tuple[str, pb.GenerateRequest]] = {
    "empty-input": ("tokenized.input_ids", _request([])),
    "text-only": (
        "tokenized.input_ids",
        pb.GenerateRequest(tokenized=pb.TokenizedInput(original_text="hello"), sampling_params=_params()),
    ),
    "token-outside-vocab": ("tokenized.input_ids", _request([5, 2048, 6])),
    "beyond-context": _bad("sampling_params.max_new_tokens", max_new_tokens=4094),
    "beyond-KV-pool": _bad("sampling_params.max_new_tokens", max_new_tokens=2000),
    "prompt-fills-pool-no-max_new_tokens": (
        "tokenized.input_ids",
        pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=[7] * 1100),
            sampling_params=pb.SamplingParams(temperature=0, top_p=1, top_k=-1, repetition_penalty=1, n=1),
        ),
    ),
    "NaN-temperature": _bad("sampling_params.temperature", temperature=math.nan),
    "negative-temperature": _bad("sampling_params.temperature", temperature=-0.5),
    "top_p-above-1": _bad("sampling_params.top_p", top_p=1.5),
    "top_p-zero": _bad("sampling_params.top_p", top_p=0.0),
    "top_k-below--1": _bad("sampling_params.top_k", top_k=-2),
    "n-zero": _bad("sampling_params.n", n=0),
    "n-above-slots": _bad("sampling_params.n", n=9),
    "repetition_penalty-zero": _bad("sampling_params.repetition_penalty", repetition_penalty=0.0),
    "min-above-max": _bad("sampling_params.min_new_tokens", min_new_tokens=9, max_new_tokens=4),
    "logit_bias-key": _bad("sampling_params.logit_bias", logit_bias={"abc": 1.0}),
    "stop-token-outside-vocab": _bad("sampling_params.stop_token_ids", stop_token_ids=[4096]),
    "too-many-top-logprobs": (
        "top_logprobs_num",
        pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=[5, 6]),
            sampling_params=_params(),
            return_logprob=True,
            top_logprobs_num=21,
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field_with_nothing_allocated(
    case: str, engine: Engine, stub: pb_grpc.SglangSchedulerStub
) -> None:
    field, request = _BAD_REQUESTS[case]
    assert engine.wait_idle(TIMEOUT)
    before, loads_before = engine.stats(), stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT).loads[0]
    for stream in (False, True):
        request.stream = stream
        err = _error(lambda: _collect(stub, request))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (case, err)
        assert (err.details() or "").startswith(f"{field}:"), (case, err.details())
    assert engine.stats() == before
    assert stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT).loads[0] == loads_before


def test_unset_top_k_means_off_and_absent_params_mean_defaults(stub: pb_grpc.SglangSchedulerStub) -> None:
    """proto3 reads an unset top_k as 0 and an absent sampling_params as all zeros: neither is refused."""
    (done,) = _collect(stub, _request([5, 6, 7], top_k=0))
    assert done.complete.finish_reason in ("length", "stop") and done.complete.completion_tokens >= 1
    bare = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]))
    responses = list(stub.Generate(bare, timeout=TIMEOUT))
    assert responses[-1].HasField("complete")


def test_duplicate_request_id_in_flight_is_refused(engine: Engine, stub: pb_grpc.SglangSchedulerStub) -> None:
    first = stub.Generate(_request([9, 8, 7], rid="dup", stream=True, max_new_tokens=900, ignore_eos=True))
    assert next(first).HasField("chunk")  # "dup" is running now
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT).loads[0]
    assert loads.num_running_reqs == 1 and loads.num_used_tokens > 0
    err = _error(lambda: _collect(stub, _request([1, 2], rid="dup")))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and (err.details() or "").startswith("request_id:")
    assert stub.Abort(pb.AbortRequest(request_id="dup"), timeout=TIMEOUT).success
    rest = list(first)
    assert rest[-1].complete.finish_reason == "abort"
    assert engine.wait_idle(TIMEOUT)


def test_abort_of_unknown_id_is_not_an_error(stub: pb_grpc.SglangSchedulerStub) -> None:
    answer = stub.Abort(pb.AbortRequest(request_id="never-sent", reason="test"), timeout=TIMEOUT)
    assert not answer.success and "never-sent" in answer.message


# ------------------------------------------------------------------------------------------ constraints and the rest


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        ({"json_schema": "{not json"}, "sampling_params.json_schema"),
        ({"regex": "("}, "sampling_params.regex"),
    ],
)
def test_invalid_grammar_is_refused_before_anything_runs(
    constraint: dict[str, Any], field: str, engine: Engine, stub: pb_grpc.SglangSchedulerStub
) -> None:
    assert engine.wait_idle(TIMEOUT)
    before = engine.stats()
    err = _error(lambda: _collect(stub, _request([5, 6], **constraint)))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.details() or "") and "invalid grammar" in (err.details() or "")
    assert engine.wait_idle(TIMEOUT)
    assert engine.stats() == before  # no step ran: nothing was prefilled or allocated


def test_other_rpcs_are_unimplemented(stub: pb_grpc.SglangSchedulerStub) -> None:
    calls: list[Callable[[], object]] = [
        lambda: stub.Embed(pb.EmbedRequest(), timeout=TIMEOUT),
        lambda: stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT),
        lambda: list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT)),
        lambda: stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=TIMEOUT),
    ]
    for call in calls:
        err = _error(call)
        assert err.code() is grpc.StatusCode.UNIMPLEMENTED and "not implemented" in (err.details() or "")


# ------------------------------------------------------------------------------------------ info RPCs


def test_model_info(engine: Engine, stub: pb_grpc.SglangSchedulerStub, embedded_model_dir: Path) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.served_model_name == "ordinal-embedded-tiny"
    assert info.vocab_size == engine.info.vocab_size
    assert info.max_context_length == engine.info.max_context
    assert set(info.eos_token_ids) == set(engine.info.eos_token_ids)
    assert (info.bos_token_id, info.pad_token_id) == (engine.info.bos_token_id, engine.info.pad_token_id)
    assert info.tokenizer_path == info.model_path == str(embedded_model_dir)
    assert info.is_generation and info.model_type == "llama" and list(info.architectures) == ["LlamaForCausalLM"]


def test_server_info(engine: Engine, stub: pb_grpc.SglangSchedulerStub, config: EngineConfig) -> None:
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
    args = info.server_args
    assert args["page_size"] == config.page_size and args["num_pages"] == config.num_pages
    assert args["chunked_prefill_size"] == config.chunk_size
    assert args["max_running_requests"] == config.max_running
    assert args["disable_overlap_schedule"] is (not config.overlap)
    assert args["served_model_name"] == "ordinal-embedded-tiny"
    assert info.max_total_num_tokens == config.num_pages * config.page_size
    assert info.server_type == "grpc" and info.sglang_version.startswith("ordinal")
    assert info.uptime_seconds >= 0


def test_loads(engine: Engine, stub: pb_grpc.SglangSchedulerStub, config: EngineConfig) -> None:
    assert engine.wait_idle(TIMEOUT)
    answer = stub.GetLoads(pb.GetLoadsRequest(include=["core", "memory", "queues", "disagg"]), timeout=TIMEOUT)
    (load,) = answer.loads
    stats = engine.stats()
    assert answer.dp_rank_count == 1 and load.dp_rank == 0
    assert (load.num_running_reqs, load.num_waiting_reqs) == (0, 0)
    assert load.num_used_tokens == stats.used_pages * config.page_size
    assert load.max_total_num_tokens == config.num_pages * config.page_size
    assert load.max_running_requests == config.max_running
    assert load.HasField("memory") and load.memory.token_capacity == load.max_total_num_tokens
    assert load.HasField("queues") and load.HasField("disaggregation") and load.disaggregation.mode == "null"
    core_only = stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=TIMEOUT).loads[0]
    assert not core_only.HasField("memory") and not core_only.HasField("queues")


def test_tokenizer_zip_unpacks_and_its_sha256_checks(
    stub: pb_grpc.SglangSchedulerStub, embedded_model_dir: Path
) -> None:
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT))
    assert chunks and all(not c.sha256 for c in chunks[:-1]) and chunks[-1].sha256
    data = b"".join(c.data for c in chunks)
    assert hashlib.sha256(data).hexdigest() == chunks[-1].sha256
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
        for name in names:
            assert archive.read(name) == (embedded_model_dir / name).read_bytes()


def test_tokenizer_chunks_carry_the_digest_on_the_last_chunk_only() -> None:
    data = bytes(range(256)) * 5
    chunks = list(tokenizer_chunks(data, chunk_bytes=300))
    assert len(chunks) == 5 and b"".join(c.data for c in chunks) == data
    assert [bool(c.sha256) for c in chunks] == [False] * 4 + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------ health and reflection


def test_health_and_grpc_health_v1_serving(stub: pb_grpc.SglangSchedulerStub, channel: grpc.Channel) -> None:
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel: grpc.Channel) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


# ------------------------------------------------------------------------------------------ executor loss


def test_executor_loss_ends_the_stream_unavailable_and_health_says_so(config: EngineConfig) -> None:
    runner = LosableRunner(ModelRunner.load(config))
    with Engine(config, runner) as engine, serve_scheduler(engine) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(
            _request([3, 4, 5], rid="lost", stream=True, max_new_tokens=900, ignore_eos=True), timeout=TIMEOUT
        )
        assert next(call).HasField("chunk")
        runner.lost = True
        err = _error(lambda: list(call))
        assert err.code() is grpc.StatusCode.UNAVAILABLE and "executor" in (err.details() or "")
        assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy
        _wait_health(ch, SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert engine.wait_idle(TIMEOUT)


def test_requests_wait_for_a_lost_executor_until_their_outage_timeout(config: EngineConfig) -> None:
    """While the executor is lost nothing is planned: a request sent then waits, queued, and ends UNAVAILABLE once it
    has waited the outage timeout (1 s here); one sent once the executor answers again runs, and one sent while it is
    down runs too if it comes back in time. Fails if the loop plans while the executor is down (the request fails at
    once, at its first launch) or never expires a waiting request (the RPC hangs to its deadline)."""
    runner = LosableRunner(ModelRunner.load(config))
    with Engine(replace(config, outage_timeout_s=1.0), runner) as engine, serve_scheduler(engine) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(_request([3, 4, 5], "lost", True, max_new_tokens=900, ignore_eos=True), timeout=TIMEOUT)
        assert next(call).HasField("chunk")
        runner.lost = True
        assert _error(lambda: list(call)).code() is grpc.StatusCode.UNAVAILABLE

        sent = time.monotonic()
        err = _error(lambda: _collect(stub, _request([3, 4, 5], "late")))
        waited = time.monotonic() - sent
        assert err.code() is grpc.StatusCode.UNAVAILABLE, err
        assert "did not come back within 1 s" in (err.details() or ""), err.details()
        assert 1.0 <= waited < TIMEOUT / 2, waited

        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(_collect, stub, _request([3, 4, 5], "in-time"))
            wait_for(lambda: engine.stats().num_waiting == 1, TIMEOUT, "the request sent while down queued")
            runner.come_back()
            assert waiting.result(TIMEOUT)[-1].complete.finish_reason == "length"
        assert _collect(stub, _request([3, 4, 5], "back"))[-1].complete.finish_reason == "length"
        assert engine.wait_idle(TIMEOUT)


def _wait_health(channel: grpc.Channel, service: str, want: int) -> None:
    """grpc.health.v1 follows the executor within the monitor's refresh period: poll it, bounded."""
    health = health_pb2_grpc.HealthStub(channel)

    def reached() -> bool:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status == want

    wait_for(reached, TIMEOUT, f"{service!r} reaching status {want}")
