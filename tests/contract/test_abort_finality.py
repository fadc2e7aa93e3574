"""Abort is final the moment it answers: through the scheduler's public gRPC API, no token of a request reaches its
stream once ``Abort`` has answered, whatever the engine is doing and in whatever order the two RPCs arrive.

``Generate`` and ``Abort`` travel on separate HTTP/2 streams, so the server must order them itself:

- an ``Abort`` for an id not (yet) in flight leaves a bounded tombstone, and a ``Generate`` with that id then ends
  at once with finish reason abort, before anything is allocated or any step runs;
- once ``Abort`` answers success, the stream carries nothing of the engine's outputs, not even tokens committed
  before the abort reached the engine and still waiting to be written; its Complete (finish reason abort) counts
  exactly the tokens the stream carried and is written before the answer;
- ``Abort``, ``HealthCheck``, ``GetLoads`` and ``GetServerInfo`` answer promptly while the engine loop is stuck
  waiting for the executor (a step result held at the gate) or for the grammar service (a commit that does not
  return): nothing on the service's event loop waits for the engine.

The moment between "the engine committed outputs" and "the stream wrote them" is held open by the servicer's
``before_write`` hook, so the race is a state the test waits for, not a timing.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.executor.runner import ModelRunner
from engine.grammar.backend import LocalGrammar
from engine.scheduler.engine import Engine
from engine.scheduler.tombstones import TombstoneBounds
from services.scheduler.servicer import ServicerOptions
from tests.contract.gated_stack import (
    WAIT_S,
    EngineEvents,
    GrammarProbe,
    WritePause,
    assert_back_to,
    baseline,
    gated_engine,
)
from tests.helpers import assert_engine_baseline, smg_request
from tests.support.gate import decode
from tests.support.servers import ExecutorThread, ThreadedServer

PAGE = 8
PROMPT = [(37 * i) % 1900 + 20 for i in range(24)]
SCHEMA = Constraint(
    ConstraintKind.JSON_SCHEMA,
    '{"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name"]}',
)
PROMPT_RPC_S = 2.0  # "promptly": every RPC below must answer within this deadline
_STREAMED = re.compile(r"after (\d+) streamed tokens")


@pytest.fixture(scope="module")
def config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(embedded_model_dir), page_size=PAGE, num_pages=128, max_running=4, chunk_size=32)


@pytest.fixture(scope="module")
def events() -> EngineEvents:
    return EngineEvents()


@pytest.fixture(scope="module")
def engine(config: EngineConfig, events: EngineEvents) -> Iterator[Engine]:
    with Engine(config, observer=events) as e:
        yield e


def _served(engine: Engine, **options: object) -> ThreadedServer:
    return ThreadedServer(engine, options=ServicerOptions(**options))  # type: ignore[arg-type]


def _stub(server: ThreadedServer) -> tuple[grpc.Channel, pb_grpc.SglangSchedulerStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}")
    return channel, pb_grpc.SglangSchedulerStub(channel)


def _request(rid: str, max_new: int, stream: bool = True, **fields: object) -> pb.GenerateRequest:
    return smg_request(PROMPT, rid, stream, max_new_tokens=max_new, ignore_eos=True, **fields)


def _streamed(reply: pb.AbortResponse) -> int:
    """How many tokens the stream had carried when the abort answered (the answer says so)."""
    found = _STREAMED.search(reply.message)
    assert reply.success and found, reply
    return int(found.group(1))


# ---------------------------------------------------------------------------------------------------- tombstones


def test_an_abort_that_arrives_before_its_request_ends_the_request_at_once(engine: Engine) -> None:
    """The abort of an id nobody sent yet answers success false (nothing is in flight) and is remembered: the
    Generate that follows with that id ends at once, one Complete per sample with finish reason abort and no token,
    and the engine never sees it (its stats, steps and prefill tokens included, are unchanged). The tombstone is
    consumed: the same id sent again runs, and a late abort of it answers "already finished".

    Fails if `self._tombstones.pop(spec.request_id)` in `SchedulerServicer.Generate` is removed: the request then
    streams its tokens and ends with "length" (checked once by removing it)."""
    assert engine.wait_idle(WAIT_S)
    with _served(engine) as server:
        channel, stub = _stub(server)
        with channel:
            before = engine.stats()
            early = stub.Abort(pb.AbortRequest(request_id="early", reason="client left"), timeout=WAIT_S)
            assert not early.success and "remembered" in early.message, early
            responses = list(stub.Generate(_request("early", 8, n=2), timeout=WAIT_S))
            assert [r.WhichOneof("response") for r in responses] == ["complete", "complete"], responses
            for index, response in enumerate(responses):
                done = response.complete
                assert (done.finish_reason, done.completion_tokens, list(done.output_ids)) == ("abort", 0, [])
                assert (done.index, done.prompt_tokens) == (index, len(PROMPT)), done
            assert engine.stats() == before  # nothing admitted, allocated or run
            again = list(stub.Generate(_request("early", 3, stream=False), timeout=WAIT_S))
            assert again[-1].complete.finish_reason == "length" and again[-1].complete.completion_tokens == 3
            late = stub.Abort(pb.AbortRequest(request_id="early"), timeout=WAIT_S)
            assert not late.success and "already finished (length)" in late.message, late
    assert_engine_baseline(engine, WAIT_S)


def test_a_flood_of_aborts_for_unknown_ids_keeps_only_the_newest_tombstones(engine: Engine) -> None:
    """Aborts for 1000 ids that never arrive leave exactly the bound's 64 tombstones: the newest still ends its
    Generate at once, the oldest was forgotten and its Generate runs.

    Fails if the count bound in `Tombstones.add` is removed (1000 tombstones are kept; checked once)."""
    bounds = TombstoneBounds(max_entries=64, ttl_s=60.0)
    with _served(engine, tombstones=bounds) as server:
        channel, stub = _stub(server)
        with channel:
            for i in range(1000):
                stub.Abort(pb.AbortRequest(request_id=f"flood-{i}"), timeout=WAIT_S)
            assert server.server is not None and server.server.servicer.num_tombstones == 64
            newest = list(stub.Generate(_request("flood-999", 4), timeout=WAIT_S))
            assert [r.complete.finish_reason for r in newest] == ["abort"], newest
            oldest = list(stub.Generate(_request("flood-0", 4), timeout=WAIT_S))
            assert oldest[-1].complete.finish_reason == "length", oldest
    assert_engine_baseline(engine, WAIT_S)


# ---------------------------------------------------------------------------------------------------- the stream side


def test_tokens_committed_but_not_yet_written_are_dropped_once_the_abort_answers(
    engine: Engine, events: EngineEvents
) -> None:
    """The stream's writes pause after its first chunk while the engine commits three more tokens; then the Abort
    answers (success, one token streamed). Released, the stream carries only its Complete: finish reason abort,
    one token, the one it streamed. Nothing the engine committed after that chunk reaches the client.

    Fails if the abort check in `SchedulerServicer._may_write` is removed (the held chunks are written after the
    Abort answered: the stream carries four tokens; checked once by removing it)."""
    pause = WritePause("held", after=1)
    with _served(engine, before_write=pause) as server:
        channel, stub = _stub(server)
        with channel:
            call = stub.Generate(_request("held", 32), timeout=WAIT_S)
            first = next(call)
            assert first.HasField("chunk") and len(first.chunk.token_ids) == 1
            assert pause.paused.wait(WAIT_S)
            events.wait_tokens("held", 4)  # committed by the engine, waiting to be written
            reply = stub.Abort(pb.AbortRequest(request_id="held", reason="test"), timeout=PROMPT_RPC_S)
            assert _streamed(reply) == 1
            pause.release()
            rest = list(call)
            assert [r.WhichOneof("response") for r in rest] == ["complete"], rest
            done = rest[0].complete
            assert done.finish_reason == "abort" and done.completion_tokens == 1, done
            assert list(done.output_ids) == list(first.chunk.token_ids), done
    assert_engine_baseline(engine, WAIT_S)


def test_an_abort_racing_a_decided_finish_wins_and_says_so(engine: Engine, events: EngineEvents) -> None:
    """The engine finished the request by length (every token committed) while its stream was still writing the
    first chunk. An Abort answered now wins: success, one token streamed, and the stream ends with finish reason
    abort after that one token, so that a client can trust the answer. A second Abort then answers "already
    finished (abort)".

    Fails if the abort check in `SchedulerServicer._may_write` is removed (the stream then delivers the remaining
    tokens and a Complete with "length" after the Abort answered success; checked once)."""
    pause = WritePause("racing", after=1)
    with _served(engine, before_write=pause) as server:
        channel, stub = _stub(server)
        with channel:
            call = stub.Generate(_request("racing", 4), timeout=WAIT_S)
            first = next(call)
            assert pause.paused.wait(WAIT_S)
            events.wait_finished("racing")
            reply = stub.Abort(pb.AbortRequest(request_id="racing"), timeout=PROMPT_RPC_S)
            assert _streamed(reply) == 1
            pause.release()
            rest = list(call)
            assert [(r.complete.finish_reason, r.complete.completion_tokens) for r in rest] == [("abort", 1)], rest
            assert list(rest[0].complete.output_ids) == list(first.chunk.token_ids)
            again = stub.Abort(pb.AbortRequest(request_id="racing"), timeout=PROMPT_RPC_S)
            assert not again.success and "already finished (abort)" in again.message, again
    assert_engine_baseline(engine, WAIT_S)


# ---------------------------------------------------------------------------------------------------- a wedged engine


@pytest.fixture(scope="module")
def local_grammar(embedded_model_dir: Path) -> Iterator[LocalGrammar]:
    grammar = LocalGrammar(str(embedded_model_dir))
    yield grammar
    grammar.shutdown()


@pytest.fixture(scope="module")
def executor(config: EngineConfig, local_grammar: LocalGrammar) -> Iterator[str]:
    runner = ModelRunner.load(replace(config, grammar_wait_s=WAIT_S), local_grammar)
    server = ExecutorThread(runner)
    yield f"127.0.0.1:{server.port}"
    server.stop()
    runner.shutdown()


@pytest.mark.parametrize("wedge", ["executor step held", "grammar commit held"])
def test_abort_health_and_loads_answer_while_the_engine_waits(
    wedge: str, config: EngineConfig, executor: str, local_grammar: LocalGrammar
) -> None:
    """The engine loop is stuck: waiting for a step result the gate holds (a slow or wedged executor), or inside a
    grammar commit that does not return (a wedged grammar service). Meanwhile the scheduler's event loop answers
    Abort (success; the constrained stream already ended with finish reason abort), HealthCheck, GetLoads and
    GetServerInfo, each within its deadline. Released, the engine drops the aborted request's result (C7) and
    gives everything back (C9).

    The "grammar commit held" case fails when the service's event loop takes a lock the engine loop holds across
    the grammar commit (as `Engine.abort` and `Engine.stats` did before they became lock-free: every RPC here then
    ends DEADLINE_EXCEEDED; checked once on the earlier code)."""
    probe = GrammarProbe(local_grammar)
    with gated_engine(executor, config, grammar=probe) as (engine, gate), _served(engine) as server:
        channel, stub = _stub(server)
        with channel:
            base = baseline(engine, gate)
            if wedge == "executor step held":
                gate.hold_results(decode("r", 3))
            call = stub.Generate(
                smg_request(PROMPT, "r", True, max_new_tokens=24, ignore_eos=True, json_schema=SCHEMA.text),
                timeout=WAIT_S,
            )
            first = next(call)
            assert first.HasField("chunk")
            if wedge == "executor step held":
                gate.wait_for_result_held(decode("r", 3))
            else:
                probe.hold_commits()
                assert probe.committing.wait(WAIT_S), "no grammar commit came"
            started = time.monotonic()
            reply = stub.Abort(pb.AbortRequest(request_id="r"), timeout=PROMPT_RPC_S)
            health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=PROMPT_RPC_S)
            std = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=PROMPT_RPC_S)
            loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=PROMPT_RPC_S)
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=PROMPT_RPC_S)
            answered = time.monotonic() - started
            assert health.healthy and std.status == health_pb2.HealthCheckResponse.SERVING, (health, std)
            assert loads.loads[0].num_running_reqs == 1 and info.server_args, (loads, info)
            # What the stream still holds for the client was written before the answer: chunks, then the Complete.
            rest = list(call)
            kinds = [r.WhichOneof("response") for r in rest]
            assert kinds == ["chunk"] * (len(rest) - 1) + ["complete"], rest
            tokens = [t for r in (first, *rest[:-1]) for t in r.chunk.token_ids]
            done = rest[-1].complete
            assert done.finish_reason == "abort" and len(tokens) == done.completion_tokens == _streamed(reply), rest
            probe.proceed_commits.set()
            gate.release_all()
            assert_back_to(base, engine, gate)
    assert answered < 4 * PROMPT_RPC_S, answered
