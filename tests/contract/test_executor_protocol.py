"""The executor's side of the scheduler <-> executor protocol, tested from outside.

A real executor (the embedded model, a real ModelRunner) is served in-process on a loopback port; each test
plays a scheduler by hand over real gRPC stubs, often a misbehaving one, and checks that the executor refuses
what breaks the contract (a StepError with code "protocol", no sample) and keeps serving what does not.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
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
from engine.executor.runner import ModelRunner
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from engine.step import NewRequest, SampledRun, StepEntry, StepPlan, StepResult, StepTiming
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from services.executor import convert
from services.executor.server import SERVICE_NAME
from services.remote_runner import RemoteRunner
from tests.support.servers import ExecutorThread

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


def _new(rid: str, slot: int, pages: tuple[int, ...], chunk: tuple[int, ...] = PROMPT, **params: Any) -> StepEntry:
    """A request's first entry: the whole prompt (or its first ``chunk``), with its first pages."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, **params)
    new = NewRequest(PROMPT, sampling, seed=0)
    return StepEntry(rid, slot, 0, input_ids=chunk, sample=len(chunk) == len(PROMPT), new_pages=pages, new=new)


def _decode(rid: str, slot: int, ordinal: int, pages: tuple[int, ...] = ()) -> StepEntry:
    """A decode of the token the slot produced last, building on the run at ``ordinal`` (plain decoding: the
    run is that one token, so the decode samples ordinal ``ordinal + 1``)."""
    return StepEntry(rid, slot, ordinal, input_ref=True, new_pages=pages)


def _runs(result: pb.StepResult) -> list[tuple[str, int, int]]:
    return [(r.request_id, r.ordinal, len(r.token_ids)) for r in convert.result_from_proto(result).runs]


def _state(stub: pb_grpc.ExecutorStub) -> pb.ExecutorState:
    return stub.GetState(pb.StateRequest(), timeout=5)


def _wait_session_closed(stub: pb_grpc.ExecutorStub) -> pb.ExecutorState:
    deadline = time.monotonic() + WAIT_S
    while (state := _state(stub)).session_open:
        assert time.monotonic() < deadline, "the session never ended"
        time.sleep(0.01)  # polling a state, not ordering events
    return state


# ---------------------------------------------------------------- refusals


def test_a_replayed_or_skipped_ordinal_is_refused_without_a_sample(peer: Peer) -> None:
    """C2 at the executor, for runs: a decode names the run it builds on, and only the slot's last one will do. A
    replay (the run before) and a gap (a run not produced) are refused; neither samples, records or writes
    anything, so the correct decode after them gets exactly the next ordinal.

    Fails if the check in `ModelRunner._input_run` (`if entry.ordinal != buf.run_start`) is weakened to accept an
    older run (`>`): the replay is then run and answers a run at ordinal 2 built on a stale input, its token recorded
    in the slot's sampling state as well. Checked once by weakening it."""
    peer.plan(1, _new("a", 0, (0, 1)))
    assert _runs(peer.result()) == [("a", 0, 1)]
    peer.plan(2, _decode("a", 0, 0))
    assert _runs(peer.result()) == [("a", 1, 1)]
    peer.plan(3, _decode("a", 0, 0))  # a replay: the last run began at ordinal 1
    err = peer.error()
    assert (err.step_id, err.code) == (3, "protocol") and "builds on the run at ordinal 0" in err.message
    peer.plan(4, _decode("a", 0, 2))  # a gap: no run began at ordinal 2 yet
    err = peer.error()
    assert (err.step_id, err.code) == (4, "protocol") and "last run began at ordinal 1" in err.message
    peer.plan(5, _decode("a", 0, 1))
    assert _runs(peer.result()) == [("a", 2, 1)]


def test_input_reference_before_any_sample_is_refused(peer: Peer) -> None:
    """Fails if `if buf.pending is None: raise ProtocolError(...)` in `ModelRunner._input_run` is removed: the
    reference then reaches the model as None and fails as "internal". Checked once by removing it."""
    peer.plan(1, _new("a", 0, (0, 1), chunk=PROMPT[:4]))  # a middle chunk: nothing sampled
    assert _runs(peer.result()) == []
    peer.plan(2, _decode("a", 0, 0))
    err = peer.error()
    assert (err.step_id, err.code) == (2, "protocol") and "input reference before any sample" in err.message


def test_chunks_must_continue_the_prompt_and_a_decode_must_reference_its_input(peer: Peer) -> None:
    """C10 at the executor: a chunk that repeats or skips part of the prompt is refused, so is a sampling flag
    on a middle chunk; once the slot has produced a token, literal input (a second prefill) is refused, since
    the pending token's KV would never be written. Fails if the continuation check in `ModelRunner._input_run` is
    removed (the replayed chunk then writes the prompt's first tokens at positions 4.. and samples; checked once)."""
    peer.plan(1, _new("a", 0, (0, 1), chunk=PROMPT[:4]))
    assert _runs(peer.result()) == []
    replayed = StepEntry("a", 0, 0, input_ids=PROMPT[:2], sample=True)  # positions 4-5 need PROMPT[4:6]
    peer.plan(2, replayed)
    err = peer.error()
    assert err.code == "protocol" and "not the prompt's continuation at position 4" in err.message
    peer.plan(3, StepEntry("a", 0, 0, input_ids=PROMPT[4:], sample=False))
    assert "only the chunk that ends the prompt samples" in peer.error().message
    peer.plan(4, StepEntry("a", 0, 0, input_ids=PROMPT[4:], sample=True))
    assert _runs(peer.result()) == [("a", 0, 1)]
    peer.plan(5, StepEntry("a", 0, 0, input_ids=PROMPT[4:], sample=True))
    assert "a decode must reference it" in peer.error().message


def test_entry_for_a_slot_held_by_another_request_is_refused(peer: Peer) -> None:
    """Fails if either slot check of the runner is removed (`if held is not None: raise` in `_register` for a new
    request, `if buf is None or buf.request_id != entry.request_id: raise` in `_resolve_entry` for a continuing
    one): "b" would then run on (or replace) the buffer of "a". Checked once for each by removing it."""
    peer.plan(1, _new("a", 0, (0, 1)))
    peer.result()
    peer.plan(2, _decode("b", 0, 0, (2, 3)))
    err = peer.error()
    assert (err.step_id, err.code) == (2, "protocol") and "does not hold request b" in err.message
    peer.plan(3, _new("b", 0, (2, 3)))
    err = peer.error()
    assert (err.step_id, err.code) == (3, "protocol") and "still holds request a" in err.message
    peer.plan(4, _decode("a", 0, 0))  # "a" is intact
    assert _runs(peer.result()) == [("a", 1, 1)]
    peer.plan(5, _decode("a", 0, 1), _new("c", 0, (4, 5)))
    assert "names a slot twice" in peer.error().message


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
    peer.plan(2, _new("a", 0, (0, 1), top_k=0))  # invalid sampling params
    assert "top_k" in peer.error().message
    peer.plan(3, StepEntry("a", 0, 0, input_ids=(1,), input_ref=True))
    assert "a decode's input is its reference alone" in peer.error().message
    peer.send(pb.SessionRequest())  # neither a plan nor a release
    assert peer.error().code == "protocol"
    # Refused by the slot's state: the new request is registered all the same (its scheduler releases its slot).
    peer.plan(4, _new("a", 0, (0,)))  # one page of 4 cannot hold 6 prompt tokens
    assert "1 pages do not cover positions [0, 6)" in peer.error().message
    peer.plan(5, replace(_new("b", 1, (2, 3)), num_draft=2))
    assert "no draft proposer" in peer.error().message
    peer.release(0, 1)
    assert list(peer.reply().released.slots) == [0, 1]
    peer.plan(6, _new("a", 0, (0, 1)))  # the session still works
    assert len(_runs(peer.result())) == 1


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
    peer.plan(2, _decode("a", 0, 0))  # the first one goes on
    assert _runs(peer.result()) == [("a", 1, 1)]


def test_kv_past_the_accepted_positions_is_never_read(embedded_model_dir: Path) -> None:
    """C11 at the executor: positions past a slot's accepted length may hold anything (KV of rejected drafts, a
    page's unused tail); no later step reads them. After every step of one run, every position of the slot's pages
    past its accepted length is overwritten with a large finite poison; the tokens and every logprob (top 5
    included) equal those of a clean run. Fails if a decode attends one position too far (`kv_lens` of the decode
    group one larger in `forward_batch._decode_group`: the poison then changes the logprobs; checked once)."""
    config = EngineConfig(model_path=str(embedded_model_dir), page_size=PAGE, num_pages=16)

    def run(poison: bool) -> list[tuple[tuple[int, ...], tuple[float, ...] | None, object]]:
        runner = ModelRunner.load(config)
        pages = (3, 7, 1)  # 12 positions, not in order
        seen = []
        try:
            plans = [StepPlan(1, (_new("a", 0, pages, logprobs=True, top_logprobs=5),))]
            plans += [StepPlan(2 + i, (_decode("a", 0, i),)) for i in range(4)]
            for plan in plans:
                (r,) = runner.launch(plan).result(WAIT_S).runs
                seen.append((r.token_ids, r.logprobs, r.top_logprobs))
                if poison:
                    accepted = runner._slots[0].seq_len
                    for layer in range(runner._kv.num_layers):
                        for pos in range(accepted, len(pages) * PAGE):
                            slot = pages[pos // PAGE] * PAGE + pos % PAGE
                            runner._kv.k(layer)[slot] = 1e4
                            runner._kv.v(layer)[slot] = -1e4
        finally:
            runner.shutdown()
        return seen

    assert run(poison=True) == run(poison=False)


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
        peer.plan(2, _decode("a", 0, 0))
        assert runner.launched.get(timeout=WAIT_S) == 1
        assert runner.launched.get(timeout=WAIT_S) == 2  # read and launched while step 1 is held
    finally:
        gate.set()
    first, second = peer.result(), peer.result()
    assert (first.step_id, second.step_id) == (1, 2)
    assert _runs(first) + _runs(second) == [("a", 0, 1), ("a", 1, 1)]
    peer.close()
    # the reference resolved to step 1's token: the same tokens as a scheduler that waits for each step
    one_by_one = Peer(stub)
    one_by_one.plan(1, _new("a", 0, (0, 1)))
    assert list(one_by_one.result().token_ids) == list(first.token_ids)
    one_by_one.plan(2, _decode("a", 0, 0))
    assert list(one_by_one.result().token_ids) == list(second.token_ids)
    one_by_one.close()


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_ended_session_drops_every_buffer(stub: pb_grpc.ExecutorStub, how: str) -> None:
    """A new session starts from nothing. Fails if `self._resets.append(self.runner.reset())` in
    `ExecutorServicer._end_session` is removed: the 2 buffers then outlive the session. Checked once by removing
    it."""
    peer = Peer(stub)
    peer.plan(1, _new("a", 0, (0, 1)), _new("b", 1, (2, 3)))
    assert len(_runs(peer.result())) == 2
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
        assert remote.launch(StepPlan(1, (_new("a", 0, (0, 1)),))).result(WAIT_S).runs[0].ordinal == 0
        with pytest.raises(ProtocolError, match="ordinal 2"):
            remote.launch(StepPlan(2, (_decode("a", 0, 2),))).result(WAIT_S)
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
    new = draw(st.none() | st.builds(NewRequest, st.lists(_u32, max_size=4).map(tuple), _params(), _i64, _u32))
    return StepEntry(
        request_id=draw(st.text(max_size=8)),
        slot=draw(_u32),
        ordinal=draw(_u32),
        input_ids=tuple(draw(st.lists(_u32, max_size=4))),
        input_ref=draw(st.booleans()),
        num_draft=draw(_u32),
        sample=draw(st.booleans()),
        new_pages=tuple(draw(st.lists(_u32, max_size=4))),
        new=new,
        constrained=draw(st.booleans()),
    )


@st.composite
def _runs_of(draw: st.DrawFn) -> SampledRun:
    tokens = tuple(draw(st.lists(_u32, max_size=3)))
    with_lp = draw(st.booleans())
    with_top = draw(st.booleans())
    return SampledRun(
        request_id=draw(st.text(max_size=8)),
        ordinal=draw(_u32),
        token_ids=tokens,
        num_drafted=draw(_u32),
        num_accepted=draw(_u32),
        logprobs=tuple(draw(_f) for _ in tokens) if with_lp else None,
        top_logprobs=tuple(tuple(draw(st.lists(st.tuples(_u32, _f), max_size=2))) for _ in tokens)
        if with_top
        else None,
        error=draw(st.none() | st.text(max_size=8)),
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**64 - 1), st.lists(_entries(), max_size=3))
def test_step_plan_round_trips_exactly(step_id: int, entries: list[StepEntry]) -> None:
    plan = StepPlan(step_id, tuple(entries))
    wire = pb.StepPlan.FromString(convert.plan_to_proto(plan).SerializeToString())
    assert convert.plan_from_proto(wire) == plan


_timings = st.builds(StepTiming, st.none() | _f, _f, _f, _f, _f)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**64 - 1), st.lists(_runs_of(), max_size=3), _timings)
def test_step_result_round_trips_exactly(step_id: int, runs: list[SampledRun], timing: StepTiming) -> None:
    result = StepResult(step_id, tuple(runs), timing)
    wire = pb.StepResult.FromString(convert.result_to_proto(result).SerializeToString())
    assert convert.result_from_proto(wire) == result


def test_unset_is_not_zero() -> None:
    """Presence survives: seed None vs 0, logprobs None vs none, no top logprobs vs empty ones, no `new`."""
    for seed in (None, 0):
        params = SamplingParams(seed=seed)
        assert convert.params_from_proto(convert.params_to_proto(params)).seed == seed
    for logprobs, top in ((None, None), ((), ())):
        result = StepResult(1, (SampledRun("r", 0, (), logprobs=logprobs, top_logprobs=top),))
        assert convert.result_from_proto(convert.result_to_proto(result)) == result
    plan = StepPlan(1, (replace(_new("a", 0, (0, 1)), new=None),))
    assert convert.plan_from_proto(convert.plan_to_proto(plan)).entries[0].new is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: m.slots.append(9),
        lambda m: m.ordinals.pop(),
        lambda m: m.input_ids.append(3),
        lambda m: m.page_counts.__setitem__(0, 5),
        lambda m: m.new.add(),
    ],
    ids=["extra slot", "missing ordinal", "input id without a count", "page counts off", "unflagged new request"],
)
def test_a_plan_whose_columns_disagree_is_refused(
    stub: pb_grpc.ExecutorStub, peer: Peer, damage: Callable[[pb.StepPlan], object]
) -> None:
    """The packed plan's columns must describe the same entries: any disagreement is a protocol error for that
    step, before anything of it runs, and the session goes on. Fails if a column check in `convert.plan_from_proto`
    is removed (zip would silently drop or misalign entries; checked once for the slots column)."""
    msg = convert.plan_to_proto(StepPlan(1, (_new("a", 0, (0, 1)), _new("b", 1, (2, 3)))))
    damage(msg)
    peer.send(pb.SessionRequest(plan=msg))
    err = peer.error()
    assert (err.step_id, err.code) == (1, "protocol") and err.message.startswith("step message: "), err.message
    assert _state(stub).buffers == 0
    peer.plan(2, _new("a", 0, (0, 1)))
    assert _runs(peer.result()) == [("a", 0, 1)]


def test_stop_strings_stay_with_the_scheduler_and_wide_seeds_keep_their_bits() -> None:
    params = SamplingParams(stop=("END",), no_stop_trim=True, seed=2**64 + 5)
    back = convert.params_from_proto(convert.params_to_proto(params))
    assert back == replace(params, stop=(), no_stop_trim=False, seed=5)
    assert convert.wrap_int64(2**64 - 1) == -1


def test_model_info_round_trips() -> None:
    info = ModelInfo("/m", 100, 2048, frozenset({2, 7}), None, 0, 16, 99)
    msg = pb.ModelInfo.FromString(convert.model_info_to_proto(info, "abc").SerializeToString())
    assert convert.model_info_from_proto(msg) == info and msg.instance_id == "abc"
