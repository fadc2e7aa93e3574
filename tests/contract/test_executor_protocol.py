"""The executor's side of the scheduler <-> executor protocol, tested from outside.

A real executor (the embedded model, a real ModelRunner) is served in-process on a loopback port; each test
plays a scheduler by hand over real gRPC stubs, often a misbehaving one, and checks that the executor refuses
what breaks the contract (a StepError with code "protocol", no sample) and keeps serving what does not.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.errors import ExecutorUnavailableError, ProtocolError
from engine.runner import ModelInfo, ModelRunner
from engine.sampling_params import SamplingParams
from engine.step import NewRequest, SampledToken, StepEntry, StepPlan, StepResult
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from services.executor import convert
from services.executor.server import SERVICE_NAME, ExecutorThread
from services.remote_runner import RemoteRunner

PAGE = 4
PROMPT = (11, 12, 13, 14, 15, 16)  # 6 tokens: pages 2 cover positions [0, 8)
WAIT_S = 30.0


class GatedRunner(ModelRunner):
    """The real runner plus a gate a test can close in front of a step, and a record of launch calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gates: dict[int, threading.Event] = {}
        self.launched: queue.SimpleQueue[int] = queue.SimpleQueue()

    def launch(self, plan: StepPlan) -> Future[StepResult]:
        self.launched.put(plan.step_id)
        return super().launch(plan)

    def execute(self, plan: StepPlan) -> StepResult:
        gate = self.gates.pop(plan.step_id, None)
        if gate is not None and not gate.wait(WAIT_S):
            raise TimeoutError(f"gate of step {plan.step_id} never opened")
        return super().execute(plan)


@pytest.fixture(scope="module")
def runner(embedded_model_dir: Path) -> Iterator[GatedRunner]:
    config = EngineConfig(model_path=str(embedded_model_dir), page_size=PAGE, num_pages=64)
    gated = GatedRunner.load(config)
    assert isinstance(gated, GatedRunner)
    yield gated
    gated.shutdown()


@pytest.fixture(scope="module")
def target(runner: GatedRunner) -> Iterator[str]:
    server = ExecutorThread(runner)
    yield f"127.0.0.1:{server.port}"
    server.stop()


@pytest.fixture
def stub(target: str) -> Iterator[pb_grpc.ExecutorStub]:
    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.ExecutorStub(channel)


class Peer:
    """A scheduler played by hand: one Session stream; every read is bounded by the call's deadline."""

    def __init__(self, stub: pb_grpc.ExecutorStub) -> None:
        self._outbox: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self.call = stub.Session(iter(self._outbox.get, None), timeout=WAIT_S)

    def plan(self, step_id: int, *entries: StepEntry) -> None:
        self._outbox.put(pb.SessionRequest(plan=convert.plan_to_proto(StepPlan(step_id, entries))))

    def release(self, *slots: int) -> None:
        self._outbox.put(pb.SessionRequest(release=pb.Release(slots=slots)))

    def send(self, msg: pb.SessionRequest) -> None:
        self._outbox.put(msg)

    def reply(self) -> pb.SessionReply:
        return next(self.call)

    def result(self) -> pb.StepResult:
        reply = self.reply()
        assert reply.WhichOneof("kind") == "result", reply
        return reply.result

    def error(self) -> pb.StepError:
        reply = self.reply()
        assert reply.WhichOneof("kind") == "error", reply
        return reply.error

    def close(self) -> None:
        """Half-close and read to the end: the executor has ended the session when this returns."""
        self._outbox.put(None)
        assert list(self.call) == []


@pytest.fixture
def peer(stub: pb_grpc.ExecutorStub) -> Iterator[Peer]:
    p = Peer(stub)
    yield p
    p.close()


def _new(rid: str, slot: int, pages: tuple[int, ...], sample: bool = True, **params: Any) -> StepEntry:
    """A request's first entry: the whole prompt."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, **params)
    new = NewRequest(PROMPT, sampling, seed=0)
    return StepEntry(rid, slot, 0, 0, PROMPT, False, pages, sample, new)


def _decode(rid: str, slot: int, ordinal: int, pages: tuple[int, ...], token: int | None = None) -> StepEntry:
    """A decode entry after ``ordinal`` samples: its input is ``token``, or a reference to the last sample."""
    ids = () if token is None else (token,)
    return StepEntry(rid, slot, ordinal, len(PROMPT) + ordinal - 1, ids, token is None, pages, True)


def _state(stub: pb_grpc.ExecutorStub) -> pb.ExecutorState:
    return stub.GetState(pb.StateRequest(), timeout=5)


def _wait_session_closed(stub: pb_grpc.ExecutorStub) -> pb.ExecutorState:
    deadline = time.monotonic() + WAIT_S
    while (state := _state(stub)).session_open:
        assert time.monotonic() < deadline, "the session never ended"
        time.sleep(0.01)  # polling a state, not ordering events
    return state


# ---------------------------------------------------------------- refusals


def test_wrong_ordinal_is_refused_without_a_sample(peer: Peer) -> None:
    """C2 at the executor. Fails if the ordinal check in `ModelRunner._sample` (`if buf.sampling.num_output !=
    entry.ordinal: raise ProtocolError`) is removed: step 2 then answers a sample at ordinal 2. Checked once by
    removing it."""
    peer.plan(1, _new("a", 0, (0, 1)))
    assert [(s.request_id, s.ordinal) for s in peer.result().samples] == [("a", 0)]
    peer.plan(2, _decode("a", 0, 2, (0, 1)))  # the executor has sampled 1 token: ordinal 1 is due
    err = peer.error()
    assert (err.step_id, err.code) == (2, "protocol") and "ordinal 2" in err.message
    # the refused step sampled nothing: ordinal 1 is still the one due, and the session goes on
    peer.plan(3, _decode("a", 0, 1, (0, 1)))
    assert [(s.request_id, s.ordinal) for s in peer.result().samples] == [("a", 1)]


def test_input_reference_before_any_sample_is_refused(peer: Peer) -> None:
    """Fails if `if buf.last_token is None: raise ProtocolError(...)` in `ModelRunner._seq_input` is removed:
    the reference then reaches the model as None and fails as "internal". Checked once by removing it."""
    peer.plan(1, _new("a", 0, (0, 1), sample=False))  # a middle chunk: nothing sampled
    assert list(peer.result().samples) == []
    peer.plan(2, _decode("a", 0, 0, (0, 1)))
    err = peer.error()
    assert (err.step_id, err.code) == (2, "protocol") and "input reference before any sample" in err.message


def test_entry_for_a_slot_held_by_another_request_is_refused(peer: Peer) -> None:
    """Fails if either check of `ModelRunner._buffer_for` is removed (`if buf is not None: raise` for a new
    request, `if buf is None or buf.request_id != entry.request_id: raise` for a continuing one): "b" would then
    run on (or replace) the buffer of "a". Checked once for each by removing it."""
    peer.plan(1, _new("a", 0, (0, 1)))
    token = peer.result().samples[0].token_id
    peer.plan(2, _decode("b", 0, 1, (2, 3), token))
    err = peer.error()
    assert (err.step_id, err.code) == (2, "protocol") and "does not hold request b" in err.message
    peer.plan(3, _new("b", 0, (2, 3)))
    err = peer.error()
    assert (err.step_id, err.code) == (3, "protocol") and "still holds request a" in err.message
    peer.plan(4, _decode("a", 0, 1, (0, 1)))  # "a" is intact
    assert [(s.request_id, s.ordinal) for s in peer.result().samples] == [("a", 1)]


def test_release_of_an_empty_slot_is_refused(peer: Peer) -> None:
    """Fails if `raise ProtocolError(f"release of slot {slot}, ...")` in `ModelRunner._release` is removed:
    the release is then answered as done. Checked once by removing it."""
    peer.release(5)
    err = peer.error()
    assert (err.step_id, err.code) == (0, "protocol") and "slot 5" in err.message
    peer.plan(1, _new("a", 3, (0, 1)))
    peer.result()
    peer.release(3)
    assert list(peer.reply().released.slots) == [3]
    peer.release(3)  # twice
    assert peer.error().code == "protocol"


def test_malformed_values_are_refused_before_the_model(peer: Peer) -> None:
    """Fails if the page check of `_check_plan` in services/executor/server.py is removed: the page id then
    reaches the KV pool and fails as "internal". Checked once by removing it."""
    peer.plan(1, _new("a", 0, (0, 10_000)))
    err = peer.error()
    assert (err.step_id, err.code) == (1, "protocol") and "page 10000" in err.message
    peer.plan(2, _new("a", 0, (0,)))  # one page of 4 cannot hold 6 prompt tokens
    assert peer.error().code == "protocol"
    peer.plan(3, _new("a", 0, (0, 1), top_k=0))  # invalid sampling params
    assert "top_k" in peer.error().message
    peer.send(pb.SessionRequest())  # neither a plan nor a release
    assert peer.error().code == "protocol"
    peer.plan(4, _new("a", 0, (0, 1)))  # the session still works
    assert len(peer.result().samples) == 1


def test_second_concurrent_session_is_refused(stub: pb_grpc.ExecutorStub, target: str, peer: Peer) -> None:
    """One executor serves one scheduler. Fails if `if self._session_open: await context.abort(...)` in
    `ExecutorServicer.Session` is removed: the second session is then served. Checked once by removing it."""
    peer.plan(1, _new("a", 0, (0, 1)))
    peer.result()  # the first session is open
    second = Peer(stub)
    second.plan(1, _new("b", 1, (2, 3)))
    with pytest.raises(grpc.RpcError) as refused:
        second.reply()
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "another scheduler session" in (refused.value.details() or "")
    with pytest.raises(ExecutorUnavailableError, match="another scheduler session"):
        RemoteRunner.connect(target, timeout=5)
    peer.plan(2, _decode("a", 0, 1, (0, 1)))  # the first one goes on
    assert peer.result().samples[0].ordinal == 1


# ---------------------------------------------------------------- ordering and session lifetime


def test_pipelined_steps_run_back_to_back_and_answer_in_order(
    runner: GatedRunner, stub: pb_grpc.ExecutorStub, peer: Peer
) -> None:
    """The overlap across the process boundary: step 2 (whose input is a reference to step 1's sample) is
    launched while step 1 still runs, and both answer in order. Fails (no second launch while step 1 is held)
    if `Session` answers each message before reading the next, e.g. with `await asyncio.wrap_future(...)` on the
    launched future inside `_read`. Checked once by adding that line."""
    runner.launched = queue.SimpleQueue()
    gate = threading.Event()
    runner.gates[1] = gate
    try:
        peer.plan(1, _new("a", 0, (0, 1)))
        peer.plan(2, _decode("a", 0, 1, (0, 1)))
        assert runner.launched.get(timeout=WAIT_S) == 1
        assert runner.launched.get(timeout=WAIT_S) == 2  # read and launched while step 1 is held
    finally:
        gate.set()
    first, second = peer.result(), peer.result()
    assert (first.step_id, second.step_id) == (1, 2)
    assert [s.ordinal for s in (*first.samples, *second.samples)] == [0, 1]
    peer.close()
    # the reference resolved to step 1's token: the same as a scheduler that sends that token explicitly
    explicit = Peer(stub)
    explicit.plan(1, _new("a", 0, (0, 1)))
    token = explicit.result().samples[0].token_id
    assert token == first.samples[0].token_id
    explicit.plan(2, _decode("a", 0, 1, (0, 1), token))
    assert explicit.result().samples[0].token_id == second.samples[0].token_id
    explicit.close()


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_ended_session_drops_every_buffer(stub: pb_grpc.ExecutorStub, how: str) -> None:
    """A new session starts from nothing. Fails if `self._resets.append(self.runner.reset())` in
    `ExecutorServicer._end_session` is removed: the 2 buffers then outlive the session. Checked once by removing
    it."""
    peer = Peer(stub)
    peer.plan(1, _new("a", 0, (0, 1)), _new("b", 1, (2, 3)))
    assert len(peer.result().samples) == 2
    assert _state(stub).buffers == 2 and _state(stub).session_open
    if how == "close":
        peer.close()
    else:
        peer.call.cancel()  # the scheduler vanished
    state = _wait_session_closed(stub)
    assert state.buffers == 0


def test_health_reflection_and_model_info(runner: GatedRunner, stub: pb_grpc.ExecutorStub, target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert convert.model_info_from_proto(info) == runner.info and info.instance_id


# ---------------------------------------------------------------- the client's view


def test_remote_runner_maps_step_errors(target: str) -> None:
    """StepError "protocol" raises ProtocolError from the future; the session stays usable."""
    remote = RemoteRunner.connect(target, timeout=5)
    try:
        assert remote.launch(StepPlan(1, (_new("a", 0, (0, 1)),))).result(WAIT_S).samples[0].ordinal == 0
        with pytest.raises(ProtocolError, match="ordinal 2"):
            remote.launch(StepPlan(2, (_decode("a", 0, 2, (0, 1)),))).result(WAIT_S)
        with pytest.raises(ProtocolError, match="slot 9"):
            remote.release([9]).result(WAIT_S)
        assert remote.release([0]).result(WAIT_S) is None
        assert remote.healthy()
    finally:
        remote.shutdown()


# ---------------------------------------------------------------- wire format: exact round trips

_u32 = st.integers(0, 2**32 - 1)
_i64 = st.integers(-(2**63), 2**63 - 1)
_f = st.floats(allow_nan=False, width=64)


@st.composite
def _params(draw: st.DrawFn) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=draw(_u32),
        min_new_tokens=draw(_u32),
        temperature=draw(_f),
        top_k=draw(st.integers(-(2**31), 2**31 - 1)),
        top_p=draw(_f),
        min_p=draw(_f),
        frequency_penalty=draw(_f),
        presence_penalty=draw(_f),
        repetition_penalty=draw(_f),
        logit_bias=tuple(draw(st.lists(st.tuples(_u32, _f), max_size=3))),
        seed=draw(st.none() | _i64),
        stop_token_ids=tuple(draw(st.lists(_u32, max_size=3))),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.booleans()),
        top_logprobs=draw(_u32),
    )


@st.composite
def _entries(draw: st.DrawFn) -> StepEntry:
    new = draw(st.none() | st.builds(NewRequest, st.lists(_u32, max_size=4).map(tuple), _params(), _i64))
    return StepEntry(
        request_id=draw(st.text(max_size=8)),
        slot=draw(_u32),
        ordinal=draw(_u32),
        start_pos=draw(_u32),
        input_ids=tuple(draw(st.lists(_u32, max_size=4))),
        input_ref=draw(st.booleans()),
        page_table=tuple(draw(st.lists(_u32, max_size=4))),
        sample=draw(st.booleans()),
        new=new,
    )


_samples = st.builds(
    SampledToken,
    st.text(max_size=8),
    _u32,
    _u32,
    st.none() | _f,
    st.none() | st.lists(st.tuples(_u32, _f), max_size=3).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**64 - 1), st.lists(_entries(), max_size=3))
def test_step_plan_round_trips_exactly(step_id: int, entries: list[StepEntry]) -> None:
    plan = StepPlan(step_id, tuple(entries))
    wire = pb.StepPlan.FromString(convert.plan_to_proto(plan).SerializeToString())
    assert convert.plan_from_proto(wire) == plan


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**64 - 1), st.lists(_samples, max_size=3), _f)
def test_step_result_round_trips_exactly(step_id: int, samples: list[SampledToken], seconds: float) -> None:
    result = StepResult(step_id, tuple(samples), seconds)
    wire = pb.StepResult.FromString(convert.result_to_proto(result).SerializeToString())
    assert convert.result_from_proto(wire) == result


def test_unset_is_not_zero() -> None:
    """Presence survives: seed None vs 0, logprob None vs 0.0, no top logprobs vs an empty list, no `new`."""
    for seed in (None, 0):
        params = SamplingParams(seed=seed)
        assert convert.params_from_proto(convert.params_to_proto(params)).seed == seed
    for logprob, top in ((None, None), (0.0, ())):
        sample = SampledToken("r", 0, 1, logprob, top)
        assert convert.sample_from_proto(convert.sample_to_proto(sample)) == sample
    entry = replace(_new("a", 0, (0, 1)), new=None)
    assert convert.entry_from_proto(convert.entry_to_proto(entry)).new is None


def test_stop_strings_stay_with_the_scheduler_and_wide_seeds_keep_their_bits() -> None:
    params = SamplingParams(stop=("END",), no_stop_trim=True, seed=2**64 + 5)
    back = convert.params_from_proto(convert.params_to_proto(params))
    assert back == replace(params, stop=(), no_stop_trim=False, seed=5)
    assert convert.wrap_int64(2**64 - 1) == -1


def test_model_info_round_trips() -> None:
    info = ModelInfo("/m", 100, 2048, frozenset({2, 7}), None, 0, 16, 99)
    msg = pb.ModelInfo.FromString(convert.model_info_to_proto(info, "abc").SerializeToString())
    assert convert.model_info_from_proto(msg) == info and msg.instance_id == "abc"
