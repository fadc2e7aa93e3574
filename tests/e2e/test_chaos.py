"""Chaos under the launcher: each service of ``ordinal serve`` SIGKILLed once, at a random moment, under load.

One stack (``--no-gateway``, overlap on, four request slots) serves a load of mixed streams through the public gRPC
API: constrained (a regex) and unconstrained, more than the slots, so that some run and some wait in the queue. While
they stream, the grammar service, then the executor, then the scheduler is SIGKILLed, each once, after a random
delay (seeded). The launcher restarts it on its port. For each kill:

- the requests that failed are only those that needed the dead service, each UNAVAILABLE with the documented message
  (grammar: the constrained ones, "grammar service unavailable"; executor: the ones it was running, "executor
  unavailable", while queued ones wait and finish; scheduler: every stream it carried, the connection gone); every
  other request ends normally with all its tokens;
- the stack serves again (a probe that needs the dead service succeeds) within a bound, measured;
- every pool, slot, buffer and matcher is back at its baseline on every service: the scheduler's KV pages, slots,
  reservations and steps, the executor's per-request buffers, the grammar service's matchers, fenced waits and
  sessions (one: the scheduler's);
- greedy outputs of later requests, constrained and not, equal those of the fault-free start.

A table of the kills is printed: service, requests in flight, failed by status, unaffected, recovery seconds, leaks.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from protos import executor_pb2, executor_pb2_grpc, grammar_pb2, grammar_pb2_grpc
from tests.e2e.stack import ServeStack, free_port_block, prometheus_samples, start_serve, wait_for
from tests.helpers import random_prompts, smg_request

pytestmark = pytest.mark.slow  # one stack, three kills and restarts: about a minute on two cores

SEED = 18
SLOTS = 4
STREAMS = 6  # three constrained, three not: two more than the slots, so two wait in the queue
LONG = 200  # tokens per stream: the ones running are still streaming when the kill comes
SHORT = 10  # tokens per probe
REGEX = "[a-z ]+"  # never ends by itself: with min_new_tokens the stop token is banned, so a request ends by length
KILL_DELAY_S = (0.0, 0.6)  # after every slot streams
RPC_S = 120.0
RECOVERY_BOUND_S = 60.0
END_BOUND_S = 60.0
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
MESSAGES = {
    "grammar": "grammar service unavailable",
    "executor": "executor unavailable",
}


@dataclass
class Stream:
    """One request of the load and how it ended: a finish reason, or the status it failed with."""

    rid: str
    prompt: list[int]
    constrained: bool
    first_chunk: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0
    outcome: str = ""  # the finish reason, or the status code's name
    details: str = ""
    ended_at: float = float("inf")  # monotonic

    def request(self) -> pb.GenerateRequest:
        fields = {"regex": REGEX} if self.constrained else {}
        return smg_request(self.prompt, self.rid, True, max_new_tokens=LONG, min_new_tokens=LONG, **fields)

    def run(self, stub: pb_grpc.SglangSchedulerStub) -> None:
        try:
            for reply in stub.Generate(self.request(), timeout=RPC_S):
                if reply.HasField("chunk"):
                    self.tokens += len(reply.chunk.token_ids)
                    self.first_chunk.set()
                else:
                    self.outcome = reply.complete.finish_reason
        except grpc.RpcError as exc:
            self.outcome = exc.code().name if isinstance(exc, grpc.Call) else "error"
            self.details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        self.ended_at = time.monotonic()


@dataclass
class Kill:
    """One row of the table."""

    service: str
    in_flight: int
    failed: Counter[str]
    unaffected: int
    recovery_s: float
    leaks: list[str]


class Chaos:
    """The stack under test and how to reach each service's state."""

    def __init__(self, stack: ServeStack, metrics_url: str) -> None:
        self.stack = stack
        self.metrics_url = metrics_url

    def channel(self) -> grpc.Channel:
        """A new channel to the scheduler (one that was restarted is reached at once, with no backoff left over)."""
        return grpc.insecure_channel(self.stack.scheduler, options=CHANNEL_OPTIONS)

    def greedy(self, prompt: list[int], constrained: bool, rid: str) -> list[int]:
        """A short greedy request; retried while the stack answers UNAVAILABLE (a service still coming back)."""
        fields = {"regex": REGEX} if constrained else {}
        request = smg_request(prompt, rid, False, max_new_tokens=SHORT, min_new_tokens=SHORT, **fields)
        deadline = time.monotonic() + RECOVERY_BOUND_S
        while True:
            with self.channel() as channel:
                try:
                    (reply,) = list(pb_grpc.SglangSchedulerStub(channel).Generate(request, timeout=RPC_S))
                    assert reply.complete.finish_reason == "length", reply
                    return list(reply.complete.output_ids)
                except grpc.RpcError as exc:
                    if exc.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        raise
            time.sleep(0.2)

    def leaks(self) -> list[str]:
        """Every counter of every service that is not at its baseline (empty: nothing leaked)."""
        found: list[str] = []
        m = prometheus_samples(self.metrics_url)
        expect = {
            "ordinal_requests_running": 0.0,
            "ordinal_requests_waiting": 0.0,
            'ordinal_kv_pages{state="used"}': 0.0,
            'ordinal_kv_pages{state="reserved"}': 0.0,
            "ordinal_request_slots_free": float(SLOTS),
            "ordinal_steps_in_flight": 0.0,
        }
        found += [f"scheduler {k}={m.get(k)}" for k, v in expect.items() if m.get(k) != v]
        with grpc.insecure_channel(self.stack.fields["executor"]) as ch:
            executor = executor_pb2_grpc.ExecutorStub(ch).GetState(executor_pb2.StateRequest(), timeout=RPC_S)
        if executor.buffers != 0 or not executor.session_open:
            found.append(f"executor buffers={executor.buffers} session_open={executor.session_open}")
        with grpc.insecure_channel(self.stack.fields["grammar"]) as ch:
            grammar = grammar_pb2_grpc.GrammarStub(ch).GetState(grammar_pb2.StateRequest(), timeout=RPC_S)
        if (grammar.num_open, grammar.num_waiting, grammar.num_sessions) != (0, 0, 1):
            found.append(
                f"grammar open={grammar.num_open} waiting={grammar.num_waiting} sessions={grammar.num_sessions}"
            )
        return found

    def settled(self) -> list[str]:
        """The leaks once the stack is idle (bounded: releases and the executor's buffer drops are asynchronous)."""
        last: list[list[str]] = [[]]

        def clean() -> bool:
            last[0] = self.leaks()
            return not last[0]

        with contextlib.suppress(AssertionError):  # what is left is reported, and asserted empty by the test
            wait_for(clean, END_BOUND_S, "every service back at its baseline")
        return last[0]


@pytest.fixture(scope="module")
def chaos(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    metrics = free_port_block(4)  # scheduler, executor, gateway (unused), grammar
    flags = ["--no-gateway", "--port", "0", "--executor-port", "0", "--grammar-port", "0"]
    flags += ["--metrics-port", str(metrics), "--max-running", str(SLOTS), "--num-pages", "512"]
    flags += ["--outage-timeout", str(RECOVERY_BOUND_S)]
    stack = start_serve(tmp_path_factory.mktemp("chaos") / "serve.stderr", embedded_model_dir, *flags)
    try:
        yield Chaos(stack, f"http://127.0.0.1:{metrics}/metrics")
    finally:
        code = stack.stop()
    assert code == 0, stack.stderr()[-4000:]


def _load(prompts: list[list[int]], round_: str) -> list[Stream]:
    return [Stream(f"{round_}-{i}", prompts[i], constrained=i % 2 == 0) for i in range(STREAMS)]


def _kill_under_load(chaos: Chaos, service: str, rng: random.Random, prompts: list[list[int]]) -> Kill:
    streams = _load(prompts, service)
    with chaos.channel() as channel, ThreadPoolExecutor(max_workers=STREAMS) as pool:
        stub = pb_grpc.SglangSchedulerStub(channel)
        futures = [pool.submit(s.run, stub) for s in streams]
        wait_for(lambda: sum(s.first_chunk.is_set() for s in streams) >= SLOTS, END_BOUND_S, "every slot streaming")
        time.sleep(rng.uniform(*KILL_DELAY_S))
        pid = chaos.stack.pids[service]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        in_flight = sum(s.ended_at > killed for s in streams)
        probe = prompts[-1]
        chaos.greedy(probe, constrained=service == "grammar", rid=f"{service}-probe")
        recovery = time.monotonic() - killed
        _, pending = wait(futures, timeout=END_BOUND_S)
        assert not pending, [s for s in streams if not s.outcome]
    restarted = chaos.stack.wait_line(f"ORDINAL_RESTARTED service={service} ", RECOVERY_BOUND_S)
    chaos.stack.fields[f"{service}_pid"] = restarted.rsplit("pid=", 1)[1]
    _check_outcomes(service, [s for s in streams if s.ended_at > killed])
    failed = Counter(s.outcome for s in streams if s.outcome not in ("length", "stop"))
    unaffected = sum(s.outcome == "length" for s in streams)
    return Kill(service, in_flight, failed, unaffected, recovery, chaos.settled())


def _check_outcomes(service: str, streams: list[Stream]) -> None:
    """Of the streams in flight at the kill, only those that needed the dead service failed, UNAVAILABLE with the
    documented message; every other one ended by length with every token."""
    for s in streams:
        needed = service == "scheduler" or (service == "grammar" and s.constrained) or service == "executor"
        if s.outcome == "length":
            assert s.tokens == LONG, s
            if service == "grammar":
                assert not s.constrained, f"{s.rid}: its grammar died with the service, yet it finished"
            continue
        assert needed and s.outcome == "UNAVAILABLE", s
        if service in MESSAGES:
            assert s.details.startswith(MESSAGES[service]), s
    if service == "grammar":
        assert all(s.outcome == "UNAVAILABLE" for s in streams if s.constrained)
    if service == "executor":
        # The requests it was running are lost; those still waiting for a slot survive and finish afterwards.
        assert any(s.outcome == "UNAVAILABLE" for s in streams) and any(s.outcome == "length" for s in streams)
    if service == "scheduler":
        assert all(s.outcome == "UNAVAILABLE" for s in streams)


def _table(kills: list[Kill]) -> str:
    columns = ("service killed", "in flight", "failed (by status)", "unaffected", "recovery s", "leaks")
    head = "{:<15}{:>10}  {:<22}{:>11}{:>12}{:>7}".format(*columns)
    rows = [head, "-" * len(head)]
    for k in kills:
        failed = ", ".join(f"{code} {n}" for code, n in sorted(k.failed.items())) or "none"
        rows.append(
            f"{k.service:<15}{k.in_flight:>10}  {failed:<22}{k.unaffected:>11}{k.recovery_s:>12.1f}{len(k.leaks):>7}"
        )
    return "\n".join(rows)


def test_each_service_killed_under_load_costs_only_its_requests_and_leaks_nothing(
    chaos: Chaos, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(SEED)
    prompts = random_prompts(STREAMS, 8, 24, 2000, seed=SEED)
    reference = {c: chaos.greedy(prompts[0], constrained=c, rid=f"reference-{c}") for c in (False, True)}
    assert chaos.settled() == []
    kills: list[Kill] = []
    for service in ("grammar", "executor", "scheduler"):
        kill = _kill_under_load(chaos, service, rng, prompts)
        kills.append(kill)
        after = {c: chaos.greedy(prompts[0], constrained=c, rid=f"after-{service}-{c}") for c in (False, True)}
        assert after == reference, f"greedy outputs after the {service} kill differ from the fault-free ones"
    with capsys.disabled():  # the table belongs in every log, not only a failing one
        print(f"\nchaos (seed {SEED}, {STREAMS} streams of {LONG} tokens, {SLOTS} slots, overlap on):\n{_table(kills)}")
    assert [k.leaks for k in kills] == [[], [], []]
    assert all(k.recovery_s < RECOVERY_BOUND_S for k in kills)
