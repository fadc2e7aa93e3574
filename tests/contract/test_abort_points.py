"""Abort at every point of a request's life (contracts C6-C10), with the real engine over a step gate.

    Engine ──RemoteRunner──▶ StepGate ──▶ executor service ──▶ ModelRunner (embedded model)

Each test first waits for an exact state (a step launched, its result held at the gate, tokens streamed), then
aborts, then lets the gate go, and checks: the finish reason (abort, or the normal finish when the abort came after
the commit; each test says which), zero tokens streamed after the abort won, the request named by no step planned
after the abort was recorded (C8, read from the gate's record of every plan), the executor's buffer freed only after
the last step naming the request went back (C9, from the gate's trace), and after the drain free KV pages, slots,
reservations, executor buffers (GetState) and open matchers back at their baseline (C9).

Each docstring names the enforcement whose removal makes the test fail; each was checked once by removing it on a
throwaway copy of the repository and running the test there.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as spb_grpc

from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.executor.runner import ModelRunner
from engine.finish import FinishReason
from engine.grammar.backend import LocalGrammar
from engine.scheduler.engine import Engine
from engine.scheduler.request import RequestOutput
from protos import executor_pb2 as epb
from protos import executor_pb2_grpc as epb_grpc
from services.remote_runner import RemoteRunner
from tests.contract.gated_stack import (
    WAIT_S,
    EngineEvents,
    GrammarProbe,
    Stream,
    WatchedEngine,
    assert_abort_honoured,
    assert_back_to,
    assert_not_planned_after,
    assert_one_tick_lag,
    assert_watermark,
    baseline,
    gated_engine,
    greedy,
    mark_abort,
    solo_outputs,
    steps_naming,
    submit,
)
from tests.e2e.stack import greedy_request
from tests.support.gate import decode, entries_of, final_chunk, middle_chunk
from tests.support.servers import ExecutorThread, ThreadedServer

PAGE = 4
CHUNK = 8
_rng = random.Random(4)
LONG = tuple(_rng.randrange(10, 2000) for _ in range(20))  # three chunks: 8 + 8 + 4 tokens
SHORT = {name: tuple(_rng.randrange(10, 2000) for _ in range(4)) for name in ("a", "b", "p", "q", "r")}
MAX_NEW = 8
SCHEMA = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "string", "maxLength": 40}))


@pytest.fixture(scope="module")
def config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_path=str(embedded_model_dir),
        page_size=PAGE,
        num_pages=128,
        max_running=4,
        chunk_size=CHUNK,
        check_invariants=True,
    )


@pytest.fixture(scope="module")
def local_grammar(embedded_model_dir: Path) -> Iterator[LocalGrammar]:
    """The grammar registry shared by the scheduler side (commits, releases) and the executor (fenced masks)."""
    grammar = LocalGrammar(str(embedded_model_dir))
    yield grammar
    grammar.shutdown()


@pytest.fixture(scope="module")
def executor(config: EngineConfig, local_grammar: LocalGrammar) -> Iterator[str]:
    # The executor may wait at the grammar fence as long as a test may hold the result its mask depends on.
    runner = ModelRunner.load(replace(config, grammar_wait_s=WAIT_S), local_grammar)
    server = ExecutorThread(runner)
    yield f"127.0.0.1:{server.port}"
    server.stop()
    runner.shutdown()


@pytest.fixture(scope="module")
def solo(config: EngineConfig, executor: str) -> dict[str, list[int]]:
    """Every prompt's greedy output when it runs alone (MAX_NEW tokens), on the same split stack."""
    prompts = {"long": LONG, **SHORT}
    with gated_engine(executor, config) as (engine, _):
        outs = solo_outputs(engine, list(prompts.values()), [greedy(MAX_NEW)] * len(prompts))
    return dict(zip(prompts, outs, strict=True))


# ---------------------------------------------------------------------------------------------------- queued


def test_abort_while_queued(config: EngineConfig, executor: str, solo: dict[str, list[int]]) -> None:
    """One slot, held by "a": "b" waits in the queue (it was refused admission at least once) and is aborted there.
    It ends with an abort and no token, is never planned into any step, and "a" is untouched.

    Fails if `self._waiting.remove(req)` in `Scheduler.abort` (the QUEUED branch) is removed: "b" then stays in the
    waiting queue after its abort finish, so the drained engine still counts a waiting request (checked once by
    removing it; left alone, the loop would admit the released request and crash on its illegal transition)."""
    with gated_engine(executor, replace(config, max_running=1)) as (engine, gate):
        base = baseline(engine, gate)
        gate.hold_results(decode("a"))
        a = submit(engine, "a", SHORT["a"], greedy(MAX_NEW))
        held = gate.wait_for_result_held(decode("a"))
        b = submit(engine, "b", SHORT["b"], greedy(MAX_NEW))
        gate.release_next_result()
        # The loop took "b" in, committed, and planned the step after without it (no slot): "b" is queued.
        gate.wait_for_launch(held.step_id + 2)
        assert engine.stats().num_waiting == 1
        mark = mark_abort(engine, gate, "b")
        assert mark.live
        gate.release_next_result()  # the loop drains its inbox (the abort) before this commit
        b.assert_aborted(0)
        gate.release_all()
        assert a.wait_final().output_ids == tuple(solo["a"])
        assert steps_naming(gate, "b") == []
        assert_abort_honoured(mark, b, engine, gate)
        assert_back_to(base, engine, gate)


# ---------------------------------------------------------------------------------------------------- grammar


def test_abort_while_its_grammar_compiles(config: EngineConfig, executor: str, local_grammar: LocalGrammar) -> None:
    """A constrained request aborted while its grammar compiles (off the loop, held by the test) ends at once with
    an abort and no token; the matcher the compile opens afterwards is released, and no step ever names it.

    Fails if `self.grammar.release([rid])` in `Engine._opened` (the aborted-while-compiling branch) is removed:
    the matcher stays open after the drain (checked once by removing it: open matchers 1, baseline 0)."""
    grammar = GrammarProbe(local_grammar, hold_open=True)
    with gated_engine(executor, config, grammar=grammar) as (engine, gate):
        base = baseline(engine, gate)
        r = submit(engine, "r", SHORT["r"], greedy(MAX_NEW), constraint=SCHEMA)
        assert grammar.opening.wait(WAIT_S)
        mark = mark_abort(engine, gate, "r")
        assert mark.live
        r.assert_aborted(0)  # the stream ends now, before the compile does
        grammar.proceed.set()
        assert_back_to(base, engine, gate)
        assert gate.launched_steps() == []
        assert_abort_honoured(mark, r, engine, gate)


def test_abort_of_a_constrained_request_mid_decode(
    config: EngineConfig, executor: str, local_grammar: LocalGrammar
) -> None:
    """A constrained request (its rows sampled under fenced masks at the executor) aborted with two tokens streamed
    and the step sampling the third in flight: the abort wins, its grammar saw exactly the two committed tokens
    (one commit per step, from ordinals 0 and 1; nothing of the dropped results), and its matcher is released.

    Fails if `self._grammar_releases.append(req.request_id)` in `Scheduler._decide_finish` is removed: the matcher
    stays open after the drain (checked once by removing it: open matchers 1, baseline 0)."""
    grammar = GrammarProbe(local_grammar)
    with gated_engine(executor, config, grammar=grammar) as (engine, gate):
        base = baseline(engine, gate)
        gate.hold_results(decode("r", 2))
        r = submit(engine, "r", SHORT["r"], greedy(24), constraint=SCHEMA)
        gate.wait_for_result_held(decode("r", 2))
        tokens = r.wait_tokens(2)
        assert all(e.constrained for _, e in entries_of(gate.launched_steps(), "r") if e.sample)
        mark = mark_abort(engine, gate, "r")
        gate.release_next_result()
        r.assert_aborted(2)
        assert_abort_honoured(mark, r, engine, gate)
        assert grammar.committed("r") == [(0, (tokens[0],)), (1, (tokens[1],))]
        assert_one_tick_lag(engine, gate, "r")
        assert_back_to(base, engine, gate)


# ---------------------------------------------------------------------------------------------------- chunked prefill


def test_abort_between_two_middle_chunks(config: EngineConfig, executor: str) -> None:
    """Aborted while its first middle chunk runs (its result held): the second chunk is never planned (C10: chunk
    k+1 only after chunk k retired; the abort takes effect at that planning point), the chunk in flight drains, and
    only then are pages, slot and executor buffer released (C9).

    Fails if the `req.inflight_steps == 0` condition in `Scheduler._finish_now` is removed: the abort then releases
    pages and slot while the chunk is in flight, the assertion in `Scheduler._release` stops the loop and the stream
    ends with an internal abort instead of the client's (checked once by removing it)."""
    with gated_engine(executor, config) as (engine, gate):
        base = baseline(engine, gate)
        gate.hold_results(middle_chunk("r"))
        r = submit(engine, "r", LONG, greedy(MAX_NEW))
        held = gate.wait_for_result_held(middle_chunk("r"))
        assert steps_naming(gate, "r") == [held.step_id]
        mark = mark_abort(engine, gate, "r")
        gate.release_next_result()
        r.assert_aborted(0)
        assert_abort_honoured(mark, r, engine, gate)
        assert steps_naming(gate, "r") == [held.step_id]
        assert_one_tick_lag(engine, gate, "r")
        assert_back_to(base, engine, gate)


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "constrained"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_abort_after_the_final_chunk_launched_before_its_result_is_committed(
    config: EngineConfig, executor: str, local_grammar: LocalGrammar, overlap: bool, constrained: bool
) -> None:
    """Seed 004's window. The test first waits for exactly this state: the prompt went through chunked prefill,
    both middle chunks retired, the final chunk was launched and its result (the first token) is held at the gate,
    nothing was streamed. Under overlap the first decode step was already planned right behind the final chunk, with
    a reference input (a plan made before the abort is legal). Then the abort, then the result is released.

    The abort wins (C7): finish reason abort, no token appended or streamed, the KV watermark stays at the middle
    chunks (only their 16 tokens enter the prefix cache, C11), and for a constrained request (its first token
    sampled under the fenced mask) nothing reaches its grammar and its matcher is released. No step planned after
    the abort names the request (C8): with overlap exactly the one decode planned before it, whose result is
    dropped too.

    Seed 004's two boundaries, one place each in the scheduler:
    1. commit: `if req.finishing: continue` in `Scheduler.commit` drops the whole result, before the watermark,
       output or grammar move; the engine drains its inbox (`self._drain_inbox()` in `Engine._commit`) before
       every commit so that an abort issued before the result arrived is recorded first. Removing the drop makes
       both modes fail on the watermark: the dropped chunk's KV enters the prefix cache (5 pages, not 4; the
       stream looks clean only because the abort's final output went out first). Removing the drain makes both
       fail with one token streamed, then the abort: seed 004's symptom (checked once for each, both modes).
    2. admission: `if req.finishing: return None, 0` in `Scheduler._plan_running`. Removing it makes the overlap
       variant fail: the request is planned into further decode steps after its abort (checked once). Without
       overlap no step is in flight after the dropped commit, so the request is released at that commit and never
       reaches planning."""
    grammar = GrammarProbe(local_grammar)
    with gated_engine(executor, replace(config, overlap=overlap), grammar=grammar) as (engine, gate):
        base = baseline(engine, gate)
        gate.hold_results(final_chunk("r"))
        r = submit(engine, "r", LONG, greedy(MAX_NEW), constraint=SCHEMA if constrained else None)
        held = gate.wait_for_result_held(final_chunk("r"))
        entry = held.entry("r")
        assert entry is not None and entry.constrained == constrained
        middles = [s.step_id for s in gate.returned_steps() if middle_chunk("r")(s)]
        assert len(middles) == 2 and steps_naming(gate, "r")[:3] == [*middles, held.step_id]
        expected_steps = [*middles, held.step_id]
        if overlap:
            first_decode = gate.wait_for_launch(decode("r", 1))
            assert first_decode.step_id == held.step_id + 1
            expected_steps.append(first_decode.step_id)
        assert r.outputs == []  # Req.output_ids is empty; the result is pending
        mark = mark_abort(engine, gate, "r")
        gate.release_next_result()
        r.assert_aborted(0)
        assert_abort_honoured(mark, r, engine, gate)
        assert steps_naming(gate, "r") == expected_steps
        assert_one_tick_lag(engine, gate, "r")
        assert engine.wait_idle(WAIT_S)
        assert engine.stats().evictable_pages == 16 // PAGE  # the watermark stayed at the middle chunks (C11)
        assert grammar.committed("r") == []
        assert_back_to(base, engine, gate)  # includes open matchers


# ---------------------------------------------------------------------------------------------------- decoding


def test_abort_while_a_decode_step_is_in_flight(
    config: EngineConfig, executor: str, solo: dict[str, list[int]]
) -> None:
    """Four tokens streamed, the step sampling the fifth in flight (its result held): the abort wins; the stream
    ends with those four tokens (a prefix of the solo output) and an abort, the steps in flight drain first, and
    the KV watermark stays below the dropped token (the held step would complete the prompt's second page).

    Fails if `if req.finishing: continue` in `Scheduler.commit` is removed: the dropped results move the watermark
    and their KV enters the prefix cache (2 pages instead of 1; checked once by removing it)."""
    with gated_engine(executor, config) as (engine, gate):
        base = baseline(engine, gate)
        gate.hold_results(decode("r", 4))
        r = submit(engine, "r", SHORT["r"], greedy(MAX_NEW))
        gate.wait_for_result_held(decode("r", 4))
        assert r.wait_tokens(4) == solo["r"][:4]
        mark = mark_abort(engine, gate, "r")
        gate.release_next_result()
        r.assert_aborted(4)
        assert r.tokens == solo["r"][:4]
        assert_abort_honoured(mark, r, engine, gate)
        assert_one_tick_lag(engine, gate, "r")
        assert_watermark(engine, len(SHORT["r"]), 4, PAGE)
        assert_back_to(base, engine, gate)


def test_abort_racing_the_last_token_wins_before_its_commit(
    config: EngineConfig, executor: str, solo: dict[str, list[int]]
) -> None:
    """The step that samples the last token (the one whose commit would finish the request by length) is in flight
    with its result held when the abort comes: the abort wins, never both. The stream ends with an abort after
    MAX_NEW - 1 tokens, not with a length finish.

    Fails if `self._drain_inbox()` in `Engine._commit` is removed: the last token is committed first, the request
    finishes by length, and the abort is then a no-op (checked once by removing it)."""
    with gated_engine(executor, config) as (engine, gate):
        base = baseline(engine, gate)
        gate.hold_results(decode("r", MAX_NEW - 1))
        r = submit(engine, "r", SHORT["r"], greedy(MAX_NEW))
        gate.wait_for_result_held(decode("r", MAX_NEW - 1))
        r.wait_tokens(MAX_NEW - 1)
        mark = mark_abort(engine, gate, "r")
        gate.release_next_result()
        r.assert_aborted(MAX_NEW - 1)
        assert r.tokens == solo["r"][: MAX_NEW - 1]
        assert_abort_honoured(mark, r, engine, gate)
        assert_one_tick_lag(engine, gate, "r")
        assert_back_to(base, engine, gate)


def test_abort_after_the_finish_is_decided_before_it_is_delivered_is_a_no_op(
    config: EngineConfig, executor: str, solo: dict[str, list[int]]
) -> None:
    """ "q" and "r" decode in lockstep; "r" stops on a stop token at output index STOP_AT while its next decode step
    is in flight (held at the gate). The abort of "r" is issued from "q"'s sink during the very commit that decided
    "r"'s finish, before "r"'s final output is delivered: the abort is accepted (the request is still live) but
    comes after the commit, so it is a no-op. "r" ends once, with its stop finish; it keeps its slot until the step
    in flight retires (C9); "q" and "p" go on unharmed.

    Fails if `or req.finishing` in `Scheduler.abort` is removed: the late abort then finishes "r" a second time, the
    loop crashes on the illegal transition and "p" and "q" end with an internal abort (checked once by removing
    it)."""
    stop_at = next(i for i in range(1, MAX_NEW - 1) if solo["r"][i] not in solo["r"][:i])
    late_abort: list[bool] = []
    with gated_engine(executor, config) as (engine, gate):
        base = baseline(engine, gate)

        def abort_r_with_q(out: RequestOutput) -> None:
            if out.num_output_tokens == stop_at + 1 and not late_abort:
                late_abort.append(engine.abort("r"))

        # "p" keeps the loop busy so that "q" and "r" are taken in by one inbox drain and planned into one step.
        gate.hold_results(decode("p", 1))
        gate.hold_results(decode("r", stop_at + 1))
        p = submit(engine, "p", SHORT["p"], greedy(MAX_NEW))
        held = gate.wait_for_result_held(decode("p", 1))
        gate.wait_for_launch(held.step_id + 1)  # past that plan: the loop drains next only once the result is let go
        q = Stream("q", on_output=abort_r_with_q)
        engine.submit(SHORT["q"], greedy(MAX_NEW), q.sink, "q")
        r = submit(engine, "r", SHORT["r"], greedy(MAX_NEW, stop_token_ids=(solo["r"][stop_at],)))
        gate.release_next_result()
        gate.wait_for_result_held(decode("r", stop_at + 1))
        final = r.wait_final()
        assert late_abort == [True]  # the abort came while "r" was live, after its finish was decided
        assert final.finish is not None and final.finish.reason is FinishReason.STOP, final
        assert r.tokens == solo["r"][: stop_at + 1] and final.output_ids == tuple(r.tokens)
        s = engine.stats()
        assert s.free_slots == s.total_slots - 3, s  # "r" keeps its slot while a step naming it is in flight
        gate.release_all()
        assert q.wait_final().output_ids == tuple(solo["q"])
        assert p.wait_final().output_ids == tuple(solo["p"])
        assert_one_tick_lag(engine, gate, "r")
        assert_back_to(base, engine, gate)


def test_abort_twice_and_abort_of_an_unknown_id(
    config: EngineConfig, executor: str, solo: dict[str, list[int]]
) -> None:
    """Two aborts of one request, both recorded while a step naming it is in flight: one abort finish, the second
    a no-op. An unknown id, and an id that already finished, are no-ops that change nothing.

    Fails if `or req.finishing` in `Scheduler.abort` is removed: the second abort finishes "r" again and the loop
    crashes on the illegal FINISHING -> FINISHING transition; the engine never drains and the bystander "q" ends
    with an internal abort (checked once by removing it)."""
    with gated_engine(executor, config) as (engine, gate):
        base = baseline(engine, gate)
        gate.hold_results(decode("r", 2))
        q = submit(engine, "q", SHORT["q"], greedy(MAX_NEW))
        r = submit(engine, "r", SHORT["r"], greedy(MAX_NEW))
        gate.wait_for_result_held(decode("r", 2))
        r.wait_tokens(2)
        first = mark_abort(engine, gate, "r")
        second = mark_abort(engine, gate, "r")
        assert first.live and second.live  # neither is recorded yet: the loop waits for the held result
        assert not engine.abort("no-such-request")
        gate.release_all()
        r.assert_aborted(2)
        assert_abort_honoured(first, r, engine, gate)
        assert q.wait_final().output_ids == tuple(solo["q"])
        assert_back_to(base, engine, gate)
        steps = engine.stats().steps
        assert not engine.abort("r") and not engine.abort("q")  # finished: no-ops
        assert engine.wait_idle(WAIT_S) and engine.stats().steps == steps
        assert_back_to(base, engine, gate)


# ---------------------------------------------------------------------------------------------------- scheduler service


def _stub(port: int) -> tuple[grpc.Channel, spb_grpc.SglangSchedulerStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, spb_grpc.SglangSchedulerStub(channel)


def read_tokens(call: Iterator[spb.GenerateResponse], count: int) -> list[int]:
    """Read chunks until ``count`` tokens have arrived: a stream that fell behind gets several tokens per chunk."""
    tokens: list[int] = []
    while len(tokens) < count:
        tokens += next(call).chunk.token_ids
    assert len(tokens) == count, tokens  # the step after them is held
    return tokens


def test_client_cancelling_the_stream_aborts_the_request(
    config: EngineConfig, executor: str, solo: dict[str, list[int]]
) -> None:
    """Through the scheduler's gRPC service: the client reads three chunks and cancels the RPC while the step
    sampling the fourth token is in flight (held). The service aborts the engine request: it ends with an abort
    after three tokens, no later step names it, and everything is released.

    Fails if the abort of unfinished samples in the `finally` of `SchedulerServicer.Generate` is removed: nobody
    aborts the request and the test times out waiting for the abort call (checked once by removing it)."""
    observer = EngineEvents()
    with (
        gated_engine(executor, config, observer=observer, engine_type=WatchedEngine) as (engine, gate),
        ThreadedServer(engine) as server,
    ):
        assert isinstance(engine, WatchedEngine)
        channel, stub = _stub(server.start())
        with channel:
            base = baseline(engine, gate)
            gate.hold_results(decode("c", 3))
            call = stub.Generate(greedy_request(list(SHORT["r"]), MAX_NEW, request_id="c", stream=True), timeout=WAIT_S)
            assert read_tokens(call, 3) == solo["r"][:3]
            gate.wait_for_result_held(decode("c", 3))
            call.cancel()
            assert engine.wait_abort_call("c")
            last_planned = engine.stats().steps
            gate.release_next_result()
            finished = observer.wait_finished("c")
            assert finished.reason is FinishReason.ABORT and finished.num_output_tokens == 3, finished
            assert_not_planned_after(engine, gate, "c", last_planned)
            assert_one_tick_lag(engine, gate, "c")
            assert_back_to(base, engine, gate)


def test_abort_rpc_ends_the_open_stream_with_an_abort(
    config: EngineConfig, executor: str, solo: dict[str, list[int]]
) -> None:
    """smg's `Abort` RPC, the stream left open: the stream ends with a Complete whose finish reason is "abort",
    carrying the four tokens streamed before it and no chunk after it; the held fifth token never moves the KV
    watermark. An Abort for an unknown id (then remembered as a tombstone), or for a finished one, says so (success
    false) and changes nothing in the engine.

    Fails if the `self._engine.abort(engine_id, reason)` call in `SchedulerServicer.Abort` is removed (the stream
    then completes with "length" and eight tokens), or if `if req.finishing: continue` in `Scheduler.commit` is
    (the dropped results' KV then enters the prefix cache: 2 pages, not 1). Checked once for each."""
    with gated_engine(executor, config) as (engine, gate), ThreadedServer(engine) as server:
        channel, stub = _stub(server.start())
        with channel:
            base = baseline(engine, gate)
            assert not stub.Abort(spb.AbortRequest(request_id="nobody"), timeout=WAIT_S).success
            gate.hold_results(decode("a", 4))
            call = stub.Generate(greedy_request(list(SHORT["a"]), MAX_NEW, request_id="a", stream=True), timeout=WAIT_S)
            streamed = read_tokens(call, 4)
            gate.wait_for_result_held(decode("a", 4))
            assert stub.Abort(spb.AbortRequest(request_id="a", reason="test abort"), timeout=WAIT_S).success
            last_planned = engine.stats().steps
            gate.release_next_result()
            rest = list(call)
            assert [r.WhichOneof("response") for r in rest] == ["complete"], rest
            complete = rest[0].complete
            assert streamed == solo["a"][:4]
            assert complete.finish_reason == "abort" and list(complete.output_ids) == streamed, complete
            assert_not_planned_after(engine, gate, "a", last_planned)
            assert_one_tick_lag(engine, gate, "a")
            assert_watermark(engine, len(SHORT["a"]), 4, PAGE)
            assert_back_to(base, engine, gate)
            assert not stub.Abort(spb.AbortRequest(request_id="a"), timeout=WAIT_S).success  # finished: no-op


# ---------------------------------------------------------------------------------------------------- the gate itself


def test_the_gate_is_transparent(config: EngineConfig, executor: str, solo: dict[str, list[int]]) -> None:
    """The gate changes nothing it does not hold: outputs through it equal outputs straight from the executor,
    model info and state are the executor's, and a second session is refused exactly as the executor refuses it
    (FAILED_PRECONDITION), so the tests above observe the real protocol."""
    with Engine(config, RemoteRunner.connect(executor, timeout=WAIT_S)) as direct:
        straight = solo_outputs(direct, [LONG, SHORT["q"]], [greedy(MAX_NEW)] * 2)
    assert straight == [solo["long"], solo["q"]]
    with gated_engine(executor, config) as (engine, gate), grpc.insecure_channel(gate.target) as channel:
        stub = epb_grpc.ExecutorStub(channel)
        with grpc.insecure_channel(executor) as ex:
            assert stub.GetModelInfo(epb.ModelInfoRequest(), timeout=WAIT_S) == epb_grpc.ExecutorStub(ex).GetModelInfo(
                epb.ModelInfoRequest(), timeout=WAIT_S
            )
        assert stub.GetState(epb.StateRequest(), timeout=WAIT_S).session_open
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Session(iter(()), timeout=WAIT_S))
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert solo_outputs(engine, [LONG], [greedy(MAX_NEW)]) == [solo["long"]]
        assert [e.kind for e in gate.trace()][:2] == ["plan", "result"]
