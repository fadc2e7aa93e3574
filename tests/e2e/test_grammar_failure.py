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
from engine.constraint import Constraint, ConstraintKind
from engine.executor.runner import ModelRunner
from engine.finish import AbortCause
from engine.grammar import ConstraintCompiler, GrammarRegistry
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from protos import executor_pb2, executor_pb2_grpc
from services.grammar_client import GrammarClient, RemoteGrammar
from services.remote_runner import RemoteRunner
from tests.e2e.split import Stack, split_stack
from tests.e2e.stack import GrammarProcess, read_until_unavailable, wait_for, wait_for_idle_load
from tests.helpers import assert_engine_baseline, smg_request
from tests.support.grammar_doubles import DelegatingGrammar
from tests.support.servers import ExecutorThread, GrammarThread

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


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_path=str(model_dir), page_size=8, num_pages=512, max_running=8, chunk_size=64, outage_timeout_s=OUTAGE_S
    )


@pytest.mark.slow
@pytest.mark.parametrize("relay", [False, True], ids=["stream", "relay"])
def test_grammar_service_killed_mid_stream_then_restarted(
    embedded_model_dir: Path, tmp_path: Path, relay: bool
) -> None:
    """The module's story; with ``relay`` the executor's masks go through its mask relay process, whose stream to
    the dead service fails (the step's masks are unavailable, the request ends UNAVAILABLE) and is opened anew to
    the next instance."""
    log = tmp_path / "grammar.log"
    first = GrammarProcess(embedded_model_dir, 0, log)
    processes = [first]
    config = _config(embedded_model_dir)
    try:
        with split_stack(config, first.target, relay=relay) as s:
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


def test_a_service_that_lost_the_session_while_a_stream_runs_ends_it_unavailable(embedded_model_dir: Path) -> None:
    """The service no longer holds the scheduler's session (as a new instance behind the same address would), while
    the session's call stays open and reports nothing: it is ended here in the service's registry. Whichever comes
    first, the commit refused RELEASED or the executor's mask refused RELEASED, the scheduler asks the service whether
    it holds the session, and ends every request of that session UNAVAILABLE naming the grammar service; then it
    holds a new session, in which constrained requests work again. Fails only if both checks are removed (the check
    on a refused commit in RemoteGrammar.commit, the one on a missing mask in Engine._commit): the stream then ends
    with a grammar abort (finish reason "abort"); the test below isolates the second."""
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir)
    served = GrammarThread(compiler)
    try:
        with split_stack(_config(embedded_model_dir), f"127.0.0.1:{served.port}") as s:
            expected = _greedy(s, "before", constrained=True)
            assert isinstance(s.engine.grammar, RemoteGrammar)
            held = s.engine.grammar.session
            assert held is not None and held[0] == 1
            stream = s.stub.Generate(_request("forgotten", LONG, True, stream=True), timeout=WAIT_S)
            assert next(stream).HasField("chunk")
            forgot = time.monotonic()
            assert served.registry.end_session(held[1]) == ["forgotten"]
            details = read_until_unavailable(stream, forgot, END_BOUND_S)
            assert details.startswith("grammar service unavailable") and "does not hold it" in details, details
            assert _greedy(s, "after", constrained=True) == expected
            again = s.engine.grammar.session
            assert again is not None and again[0] > held[0], again
            wait_for_idle_load(s.stub, END_BOUND_S)
            assert_engine_baseline(s.engine, WAIT_S)
            assert served.registry.num_open == 0 and served.registry.num_sessions == 1
    finally:
        served.stop()
        compiler.shutdown()


class ForgetAfterOpen(DelegatingGrammar[RemoteGrammar]):
    """The scheduler's grammar backend (a real RemoteGrammar), except that right after an open the service forgets
    the session it was opened in: the request's first step then finds its grammar gone before any commit of it."""

    def __init__(self, inner: RemoteGrammar, registry: GrammarRegistry) -> None:
        super().__init__(inner)
        self.registry = registry

    def open(self, request_id: str, constraint: Constraint) -> int:
        number = self.inner.open(request_id, constraint)
        held = self.inner.session
        assert held is not None and held[0] == number
        self.registry.end_session(held[1])
        return number


def test_a_missing_mask_from_a_service_that_lost_the_session_ends_the_request_unavailable(
    embedded_model_dir: Path,
) -> None:
    """The executor's report comes first: the request's first mask is refused (its grammar is gone with the session)
    before any commit of it, while the session's call reports nothing. The engine asks the service whether it holds
    the session before committing that step, and ends the request UNAVAILABLE, naming the grammar service. Fails if
    that check in Engine._commit (`self._take_grammar_loss(verify=...)`) is removed: the request then ends with a
    grammar abort, "grammar mask refused (released)"."""
    config = _config(embedded_model_dir)
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir)
    served = GrammarThread(compiler)
    target = f"127.0.0.1:{served.port}"
    vocab = compiler.vocab_size
    masks = RemoteGrammar.connect(target, WAIT_S, vocab_size=vocab, holds_session=False)
    commits = RemoteGrammar.connect(target, WAIT_S, vocab_size=vocab)
    runner = ModelRunner.load(config, masks)
    executor = ExecutorThread(runner)
    remote = RemoteRunner.connect(f"127.0.0.1:{executor.port}", timeout=WAIT_S)
    try:
        with Engine(config, remote, grammar=ForgetAfterOpen(commits, served.registry)) as engine:
            params = SamplingParams(temperature=0.0, max_new_tokens=SHORT, min_new_tokens=SHORT)
            (out,) = engine.generate_batch([PROMPT], [params], WAIT_S, [Constraint(ConstraintKind.REGEX, REGEX)])
            assert out.finish is not None and out.finish.cause is AbortCause.GRAMMAR_SERVICE, out.finish
            assert "does not hold it" in (out.finish.message or ""), out.finish
            assert_engine_baseline(engine, WAIT_S)
    finally:
        executor.stop()
        runner.shutdown()
        commits.close()
        masks.close()
        served.stop()
        compiler.shutdown()
