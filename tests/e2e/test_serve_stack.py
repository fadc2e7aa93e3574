"""``ordinal serve`` end to end: real processes (executor, scheduler, smg gateway) on free loopback ports.

Each test starts the launcher as a user would, waits for its ``ORDINAL_READY`` line, talks to what it started
(the scheduler's gRPC API through smg-grpc-proto stubs, or the gateway through the ``openai`` client), then ends
it: SIGTERM must stop every child cleanly; a killed executor must be reported and restarted on its port, the stack
serving again. No child may outlive the launcher.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.stack import EXIT_TIMEOUT, ServeStack, alive, free_ports, greedy_request, start_serve, wait_for

RPC_TIMEOUT = 60.0

pytestmark = pytest.mark.slow  # each test starts the whole stack: tens of seconds on a shared CPU


def start_stack(tmp_path: Path, model_dir: Path, *flags: str) -> ServeStack:
    # --grammar-port 0: the grammar service picks a free port, so concurrent runs never clash on the default.
    return start_serve(tmp_path / "launcher.stderr", model_dir, "--num-pages", "256", "--grammar-port", "0", *flags)


def assert_all_gone(pids: dict[str, int], timeout: float = 30.0) -> None:
    wait_for(lambda: not any(alive(p) for p in pids.values()), timeout, "no child outliving the launcher")


@pytest.fixture
def stacks() -> Iterator[list[ServeStack]]:
    """Stacks started by a test; whatever is still running at the end is stopped (never leak processes)."""
    started: list[ServeStack] = []
    yield started
    for stack in started:
        stack.stop()


def test_grpc_only_stack_serves_and_stops_on_sigterm(
    tmp_path: Path, embedded_model_dir: Path, stacks: list[ServeStack]
) -> None:
    port, executor_port = free_ports(2)
    flags = ["--no-gateway", "--port", str(port), "--executor-port", str(executor_port), "--metrics-port", "0"]
    stack = start_stack(tmp_path, embedded_model_dir, *flags)
    stacks.append(stack)
    assert stack.scheduler == f"127.0.0.1:{port}"
    assert stack.fields["executor"] == f"127.0.0.1:{executor_port}"
    assert set(stack.pids) == {"grammar", "executor", "scheduler"} and "gateway" not in stack.fields

    with grpc.insecure_channel(stack.scheduler) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.SglangSchedulerStub(channel)
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=RPC_TIMEOUT).healthy
        replies = list(stub.Generate(greedy_request(list(range(40, 60)), 6, request_id="e2e-1"), timeout=RPC_TIMEOUT))
    complete = replies[-1].complete
    assert replies[-1].WhichOneof("response") == "complete"
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", 20, 6)
    assert len(complete.output_ids) == 6

    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=EXIT_TIMEOUT) == 0, stack.stderr()[-4000:]
    assert_all_gone(stack.pids)
    err = stack.stderr()
    assert "scheduler stopped (exit code 0" in err and "executor stopped (exit code 0" in err
    assert err.index("scheduler stopped") < err.index("executor stopped"), "stopped in reverse start order"


def test_gateway_stack_chat_then_a_killed_executor_is_reported_and_restarted(
    tmp_path: Path, embedded_model_dir: Path, stacks: list[ServeStack]
) -> None:
    from openai import OpenAI

    port, executor_port, gateway_port = free_ports(3)
    flags = ["--port", str(port), "--executor-port", str(executor_port), "--gateway-port", str(gateway_port)]
    flags += ["--metrics-port", "0", "--served-model-name", "tiny-e2e"]
    stack = start_stack(tmp_path, embedded_model_dir, *flags)
    stacks.append(stack)
    base_url = f"http://127.0.0.1:{gateway_port}/v1"
    assert stack.gateway == base_url
    assert set(stack.pids) == {"grammar", "executor", "scheduler", "gateway"}

    client = OpenAI(base_url=base_url, api_key="unused", timeout=RPC_TIMEOUT, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-e2e"]
    reply = client.chat.completions.create(
        model="tiny-e2e", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0.0
    )
    assert reply.choices[0].message.content, reply
    assert reply.usage is not None and reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 8

    killed = stack.pids["executor"]
    os.kill(killed, signal.SIGKILL)
    restarted = stack.wait_line("ORDINAL_RESTARTED service=executor ", EXIT_TIMEOUT)
    pid = int(restarted.rsplit("pid=", 1)[1])
    assert pid != killed and alive(pid)
    err = stack.stderr()
    assert f"executor (pid {killed}) exited with exit code -9 (killed by SIGKILL)" in err, err[-4000:]
    assert "restarting executor in 0.5 s (exit 1 of at most 5 within 60 s)" in err
    assert f"--port {executor_port} " in err.rsplit("starting executor: ", 1)[1].splitlines()[0] + " "
    again = client.chat.completions.create(
        model="tiny-e2e", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0.0
    )
    assert again.choices[0].message.content == reply.choices[0].message.content, (again, reply)

    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=EXIT_TIMEOUT) == 0, stack.stderr()[-4000:]
    assert_all_gone({**stack.pids, "executor": pid})
