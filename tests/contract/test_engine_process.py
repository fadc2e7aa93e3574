"""The scheduler as two processes (its default): the gRPC front end and the engine process behind it.

The executor and the scheduler run as child processes, exactly as ``ordinal serve`` starts them; clients use real
gRPC. What the split must not change: a bad request is refused at the front end with the engine's own message; an
Abort ends the stream at once and reaches the engine, whose KV and slots come back; health probes reach the
executor through the engine process. What the split adds: the engine process lost mid-stream ends every stream with
UNAVAILABLE naming it, in bounded time, and the front end exits non-zero (a scheduler without its engine serves
nothing); the front end lost takes the engine process with it. And the link itself: one message per commit burst,
whatever the number of outputs in it (services/scheduler/engine_process.py ``EngineHost``).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.finish import AbortCause, Finish, FinishReason
from engine.scheduler.request import RequestOutput
from services.scheduler import engine_link as link
from services.scheduler.engine_process import EngineHost
from tests.e2e.stack import (
    ExecutorProcess,
    ServiceProcess,
    alive,
    greedy_request,
    read_until_unavailable,
    wait_for,
    wait_for_idle_load,
)

PAGE_SIZE = 16
NUM_PAGES = 512
WAIT_S = 60.0
END_BOUND_S = 15.0  # how long a stream may take to end once the engine process is gone
LONG = 2000  # far more tokens than are generated before the test acts (two fit the pool at once)
PROMPT = [101, 7, 256, 33, 1400, 9, 88, 512]


class _Stack:
    def __init__(self, model: Path, tmp: Path) -> None:
        pool = ["--page-size", str(PAGE_SIZE), "--num-pages", str(NUM_PAGES)]
        self.executor = ExecutorProcess(model, PAGE_SIZE, NUM_PAGES, 0, tmp / "executor.log")
        args = ["--model", str(model), "--executor", self.executor.target, *pool, "--engine-process", "on"]
        self.scheduler = ServiceProcess("scheduler", args, 0, tmp / "scheduler.log")
        self.channel = grpc.insecure_channel(self.scheduler.target)
        self.api = pb_grpc.SglangSchedulerStub(self.channel)

    @property
    def engine_pid(self) -> int:
        pid = self.scheduler.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert len(children) == 1, f"the scheduler should run one engine process, it runs {children}"
        return int(children[0])

    def close(self) -> None:
        self.channel.close()
        self.scheduler.kill()
        self.executor.kill()


@pytest.fixture
def stack(embedded_model_dir: Path, tmp_path: Path) -> Iterator[_Stack]:
    built = _Stack(embedded_model_dir, tmp_path)
    yield built
    built.close()


def _stream(api: pb_grpc.SglangSchedulerStub, rid: str) -> Iterator[pb.GenerateResponse]:
    call: Iterator[pb.GenerateResponse] = api.Generate(greedy_request(PROMPT, LONG, rid, stream=True), timeout=WAIT_S)
    return call


def test_a_bad_request_is_refused_at_the_front_end_with_the_engines_message(stack: _Stack) -> None:
    """The front end runs the engine's own admission check (``checked_prompt``) before anything is sent.

    Fails if ``EngineProcess.submit`` stops checking: the engine process refuses the request instead, and the stream
    ends with a Complete (finish reason abort) rather than INVALID_ARGUMENT naming the field."""
    request = greedy_request([5, 10**6], 4, "bad-token")
    with pytest.raises(grpc.RpcError) as refused:
        list(stack.api.Generate(request, timeout=WAIT_S))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input_ids" in refused.value.details() and "outside the vocabulary" in refused.value.details()
    healthy = stack.api.HealthCheck(pb.HealthCheckRequest(), timeout=WAIT_S)
    assert healthy.healthy and "executor answers" in healthy.message  # the probe went through the engine process


def test_an_abort_ends_the_stream_and_reaches_the_engine(stack: _Stack) -> None:
    """An Abort RPC on another connection ends a stream in flight, and the engine process lets the request go.

    Fails if ``EngineProcess.abort`` stops sending the abort to the engine process: the stream still ends (the front
    end's relay stops), but the engine decodes the request on to its 2000 tokens, so the load does not come back to
    baseline within the bound."""
    stream = _stream(stack.api, "abort-me")
    received = 0
    for reply in stream:
        received += len(reply.chunk.token_ids)
        if received >= 4:
            break
    with grpc.insecure_channel(stack.scheduler.target) as other:
        answer = pb_grpc.SglangSchedulerStub(other).Abort(pb.AbortRequest(request_id="abort-me"), timeout=WAIT_S)
    assert answer.success, answer.message
    rest = list(stream)
    assert rest and rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
    assert all(r.HasField("complete") or r.HasField("chunk") for r in rest)
    wait_for_idle_load(stack.api, 10.0)


def test_the_engine_process_lost_ends_every_stream_with_unavailable(stack: _Stack) -> None:
    """SIGKILL the engine process while two streams decode: both end with UNAVAILABLE naming the engine process,
    within the bound, and the front end exits with code 1.

    Fails if ``EngineProcess._engine_lost`` stops ending the streams: they wait for outputs that never come and end
    only at their deadline (DEADLINE_EXCEEDED after 60 s); fails if the front end stops watching ``lost``: it keeps
    serving (and never exits)."""
    streams = [_stream(stack.api, f"lost-{i}") for i in range(2)]
    for stream in streams:
        assert next(stream).HasField("chunk")
    engine = stack.engine_pid
    os.kill(engine, signal.SIGKILL)
    started = time.monotonic()
    for stream in streams:
        details = read_until_unavailable(stream, started, END_BOUND_S)
        assert "engine process exited" in details, details
    assert stack.scheduler.proc.wait(END_BOUND_S) == 1


def test_the_front_end_lost_takes_the_engine_process_with_it(stack: _Stack) -> None:
    """SIGKILL the front end (no goodbye on the link): the engine process exits within the bound.

    Two ways out, each enough alone: ``EngineHost.serve`` returns when the link closes (the kernel closes a dead
    process's socket), and the parent-death signal (services/parent_death.py) stops an engine process that is not
    reading its link. Fails when both are removed (checked: the engine process goes on running, nobody to serve);
    removing either one alone leaves the other to pass it."""
    engine = stack.engine_pid
    stack.scheduler.kill()
    wait_for(lambda: not alive(engine), END_BOUND_S, "the engine process to exit after its front end died")


class _Stats:
    """An engine's ``stats()`` for the host's burst test: the only part of the engine the flush reads."""

    def __init__(self) -> None:
        self.value = 0

    def stats(self) -> int:
        return self.value


def test_one_message_per_burst_whatever_its_outputs() -> None:
    """The engine host sends the outputs of one burst (the engine's flush hook runs after each commit) as one
    message, in order, with the stats only when they changed, and nothing for a burst that changed nothing.

    Fails if ``EngineHost.sink`` sends each output itself (three messages for the first burst), or if ``flush``
    stops skipping empty bursts (a message per idle flush)."""
    mine, theirs = socket.socketpair()
    host = EngineHost(theirs)
    engine = _Stats()
    host._engine = engine  # type: ignore[assignment]  # attach() would also send Ready, which this test is not about
    host._sent_stats = engine.stats()  # type: ignore[assignment]  # the stats' type is not what this is about
    finish = Finish(FinishReason.ABORT, message="x", cause=AbortCause.CLIENT)
    outs = [RequestOutput(f"r{i}", (i,), "", 1, 3, 0) for i in range(3)] + [
        RequestOutput("r0", (), "", 1, 3, 0, finish=finish, output_ids=(0,))
    ]
    for out in outs:
        host.sink(out)
    host.flush()
    host.flush()  # nothing held, stats unchanged: nothing sent
    engine.value = 1
    host.flush()  # stats changed: sent alone
    theirs.close()
    messages = []
    while (message := link.receive(mine)) is not None:
        messages.append(message)
    mine.close()
    host.close()
    assert len(messages) == 2, messages
    first, second = messages
    assert isinstance(first, link.Outputs) and first.outputs() == outs and first.stats is None
    assert isinstance(second, link.Outputs) and second.outputs() == [] and second.stats == 1
