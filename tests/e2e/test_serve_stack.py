"""``ordinal serve`` end to end: real processes (executor, scheduler, smg gateway) on free loopback ports.

Each test starts the launcher as a user would, waits for its ``ORDINAL_READY`` line, talks to what it started
(the scheduler's gRPC API through smg-grpc-proto stubs, or the gateway through the ``openai`` client), then ends
it: SIGTERM must stop every child cleanly; a killed executor must be reported and make the launcher exit non-zero.
No child may outlive the launcher.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 240.0  # three processes load torch on a shared CPU
EXIT_TIMEOUT = 90.0
RPC_TIMEOUT = 60.0

pytestmark = pytest.mark.slow  # each test starts the whole stack: tens of seconds on a shared CPU


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held together while picked, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Stack:
    """A running ``ordinal serve`` and what its READY line said."""

    proc: subprocess.Popen[str]
    stderr_path: Path
    fields: dict[str, str]

    @property
    def pids(self) -> dict[str, int]:
        return {k.removesuffix("_pid"): int(v) for k, v in self.fields.items() if k.endswith("_pid")}

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        return self.proc.wait(timeout=timeout)


def start_stack(tmp_path: Path, model_dir: Path, *flags: str) -> Stack:
    stderr_path = tmp_path / "launcher.stderr"
    cmd = [sys.executable, "-m", "services.launcher", "serve", "--model", str(model_dir), "--num-pages", "256"]
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(
            [*cmd, *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            _kill_group(proc)
            pytest.fail(f"no ORDINAL_READY within {READY_TIMEOUT:.0f} s; stderr:\n{stderr_path.read_text()[-4000:]}")
        if line is None:
            proc.wait(timeout=EXIT_TIMEOUT)
            pytest.fail(f"launcher exited ({proc.returncode}) before ready; stderr:\n{stderr_path.read_text()[-4000:]}")
        if line.startswith("ORDINAL_READY "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            return Stack(proc, stderr_path, fields)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=EXIT_TIMEOUT)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()


def assert_all_gone(pids: dict[str, int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.1)
    assert not [name for name, pid in pids.items() if alive(pid)], "children outlived the launcher"


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    """Stacks started by a test; whatever is still running at the end is killed (never leak processes)."""
    started: list[Stack] = []
    yield started
    for stack in started:
        _kill_group(stack.proc)
        for pid in stack.pids.values():
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


def _greedy_request(ids: list[int], n: int) -> pb.GenerateRequest:
    params = pb.SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, max_new_tokens=n, ignore_eos=True
    )
    return pb.GenerateRequest(request_id="e2e-1", tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=params)


def test_grpc_only_stack_serves_and_stops_on_sigterm(
    tmp_path: Path, embedded_model_dir: Path, stacks: list[Stack]
) -> None:
    port, executor_port = free_ports(2)
    flags = ["--no-gateway", "--port", str(port), "--executor-port", str(executor_port), "--metrics-port", "0"]
    stack = start_stack(tmp_path, embedded_model_dir, *flags)
    stacks.append(stack)
    assert stack.fields["scheduler"] == f"127.0.0.1:{port}"
    assert stack.fields["executor"] == f"127.0.0.1:{executor_port}"
    assert set(stack.pids) == {"executor", "scheduler"} and "gateway" not in stack.fields

    with grpc.insecure_channel(stack.fields["scheduler"]) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.SglangSchedulerStub(channel)
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=RPC_TIMEOUT).healthy
        replies = list(stub.Generate(_greedy_request(list(range(40, 60)), 6), timeout=RPC_TIMEOUT))
    complete = replies[-1].complete
    assert replies[-1].WhichOneof("response") == "complete"
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", 20, 6)
    assert len(complete.output_ids) == 6

    stack.proc.send_signal(signal.SIGTERM)
    assert stack.wait() == 0, stack.stderr()[-4000:]
    assert_all_gone(stack.pids)
    err = stack.stderr()
    assert "scheduler stopped (exit code 0" in err and "executor stopped (exit code 0" in err
    assert err.index("scheduler stopped") < err.index("executor stopped"), "stopped in reverse start order"


def test_gateway_stack_chat_then_executor_death_is_reported(
    tmp_path: Path, embedded_model_dir: Path, stacks: list[Stack]
) -> None:
    from openai import OpenAI

    port, executor_port, gateway_port = free_ports(3)
    flags = ["--port", str(port), "--executor-port", str(executor_port), "--gateway-port", str(gateway_port)]
    flags += ["--metrics-port", "0", "--served-model-name", "tiny-e2e"]
    stack = start_stack(tmp_path, embedded_model_dir, *flags)
    stacks.append(stack)
    base_url = f"http://127.0.0.1:{gateway_port}/v1"
    assert stack.fields["gateway"] == base_url
    assert set(stack.pids) == {"executor", "scheduler", "gateway"}

    client = OpenAI(base_url=base_url, api_key="unused", timeout=RPC_TIMEOUT, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-e2e"]
    reply = client.chat.completions.create(
        model="tiny-e2e", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0.0
    )
    assert reply.choices[0].message.content, reply
    assert reply.usage is not None and reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 8

    os.kill(stack.pids["executor"], signal.SIGKILL)
    code = stack.wait()
    assert code != 0
    err = stack.stderr()
    assert f"executor (pid {stack.pids['executor']}) exited with exit code -9 (killed by SIGKILL)" in err, err[-4000:]
    assert "stopping the other services" in err
    assert_all_gone(stack.pids)
