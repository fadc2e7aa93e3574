"""Helpers for end-to-end tests that run the services as real processes on loopback.

``start_serve`` runs ``ordinal serve`` (the launcher) as a user would and reads its ``ORDINAL_READY`` line;
``ExecutorProcess`` and ``GrammarProcess`` run one service alone, so a test can SIGKILL and restart it. Every wait
is bounded; ``wait_for`` is the one polling loop, and ``wait_for_idle_load`` polls the scheduler's ``GetLoads``
until nothing runs, waits or holds KV.
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
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.helpers import smg_request

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 240.0  # several processes import torch on a shared CPU
EXIT_TIMEOUT = 90.0
POLL_S = 0.05

_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------------------- ports


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


def free_port_block(n: int, attempts: int = 50) -> int:
    """The first of ``n`` consecutive free loopback ports (``ordinal serve --metrics-port`` uses base..base+2)."""
    for _ in range(attempts):
        base = free_ports(1)[0]
        if base + n - 1 > 65535:
            continue
        socks = [socket.socket() for _ in range(n)]
        try:
            for offset, s in enumerate(socks):
                s.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue  # one of the neighbours is taken: try another base
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found in {attempts} attempts")


# ---------------------------------------------------------------------------------------------------- waiting


def wait_for(check: Callable[[], _T], timeout: float, what: str) -> _T:
    """Poll ``check`` until it returns something truthy (returned); fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            last = "" if isinstance(value, bool) else f" (last value: {value!r})"
            raise AssertionError(f"not within {timeout:.0f} s: {what}{last}")
        time.sleep(POLL_S)


def wait_for_idle_load(stub: pb_grpc.SglangSchedulerStub, timeout: float) -> pb.SchedulerLoad:
    """Poll ``GetLoads`` until no request runs or waits and no KV is in use; returns that load.

    ``num_used_tokens`` counts the pages requests hold (in tokens). Prefix-cache pages no request holds are
    evictable and count as free, as in SGLang, so a cached prompt does not keep this above zero."""
    last: list[pb.SchedulerLoad] = []

    def idle() -> bool:
        load = stub.GetLoads(pb.GetLoadsRequest(include=["all"]), timeout=min(timeout, 10.0)).loads[0]
        last[:] = [load]
        return (load.num_running_reqs, load.num_waiting_reqs, load.num_used_tokens) == (0, 0, 0)

    try:
        wait_for(idle, timeout, "the scheduler back at baseline (nothing running, waiting or holding KV)")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nlast load: {last[0] if last else None}") from None
    return last[0]


def greedy_request(
    ids: list[int], max_new_tokens: int, request_id: str = "", stream: bool = False, ignore_eos: bool = True
) -> pb.GenerateRequest:
    """A greedy ``GenerateRequest`` with every sampling field set explicitly, as smg sends them."""
    return smg_request(ids, request_id, stream, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)


def read_until_unavailable(call: Iterator[pb.GenerateResponse], started: float, bound_s: float) -> str:
    """Read a ``Generate`` stream to its end: it must fail with UNAVAILABLE within ``bound_s`` of ``started``, after
    chunks only (never a Complete: the request did not end, it was lost). Returns the status details."""
    try:
        for reply in call:
            assert reply.HasField("chunk"), reply
    except grpc.RpcError as error:
        took = time.monotonic() - started
        assert isinstance(error, grpc.Call)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.code(), error.details())
        assert took < bound_s, f"the RPC took {took:.1f} s to end after the service went away"
        return str(error.details())
    raise AssertionError("the stream ended normally: it should have failed with UNAVAILABLE")


def prometheus_samples(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The samples of a Prometheus text page, keyed by ``name{labels}`` as written."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


# ---------------------------------------------------------------------------------------------------- processes


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def _pump(stream: IO[str], lines: queue.SimpleQueue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _read_ready_line(lines: queue.SimpleQueue[str | None], prefix: str, timeout: float) -> str | None:
    """The first line starting with ``prefix``; None if the stream ended or ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is None:
            return None
        if line.startswith(prefix):
            return line.strip()


@dataclass
class ServeStack:
    """A running ``ordinal serve``, what its READY line said, and its later stdout lines (``ORDINAL_RESTARTED``)."""

    proc: subprocess.Popen[str]
    stderr_path: Path
    fields: dict[str, str]
    stdout: queue.SimpleQueue[str | None]

    def wait_line(self, prefix: str, timeout: float) -> str:
        """The next stdout line starting with ``prefix`` (bounded: fails the test after ``timeout``)."""
        line = _read_ready_line(self.stdout, prefix, timeout)
        if line is None:
            raise AssertionError(f"no {prefix!r} line within {timeout:.0f} s; stderr:\n{self.stderr()[-4000:]}")
        return line

    @property
    def pids(self) -> dict[str, int]:
        return {k.removesuffix("_pid"): int(v) for k, v in self.fields.items() if k.endswith("_pid")}

    @property
    def scheduler(self) -> str:
        return self.fields["scheduler"]

    @property
    def gateway(self) -> str:
        return self.fields["gateway"]

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> int | None:
        """SIGTERM the launcher (it stops its children in order); kill whatever is left after a bounded wait.

        Returns the launcher's exit code, or None when it had to be killed."""
        code: int | None = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=EXIT_TIMEOUT)
        else:
            code = self.proc.returncode
        for pid in self.pids.values():
            if alive(pid):  # never expected: the launcher stops its children, and they die with it
                os.kill(pid, signal.SIGKILL)
        return code


def start_serve(log_path: Path, model_dir: Path, *flags: str, ready_timeout: float = READY_TIMEOUT) -> ServeStack:
    """Run ``python -m services.launcher serve --model model_dir *flags`` and wait for ``ORDINAL_READY``.

    Its stderr (every service's log, prefixed) goes to ``log_path``; a failed start fails the test with its tail.
    """
    cmd = [sys.executable, "-m", "services.launcher", "serve", "--model", str(model_dir), *flags]
    with log_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    assert proc.stdout is not None
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    line = _read_ready_line(lines, "ORDINAL_READY ", ready_timeout)
    if line is None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=EXIT_TIMEOUT)
        tail = log_path.read_text(errors="replace")[-4000:]
        raise AssertionError(f"ordinal serve not ready (exit code {proc.returncode}); stderr:\n{tail}")
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    return ServeStack(proc, log_path, fields, lines)


@contextmanager
def gateway_stack(
    log_dir: Path, model_dir: Path, served_model_name: str, metrics_port: int
) -> Iterator[tuple[ServeStack, grpc.Channel]]:
    """``ordinal serve`` with every service and the gateway on free ports, serving ``served_model_name`` (512 KV pages;
    metrics from ``metrics_port`` on), and a channel to its scheduler. On exit the launcher must stop cleanly."""
    flags = ["--port", "0", "--executor-port", "0", "--grammar-port", "0", "--gateway-port", "0"]
    flags += ["--metrics-port", str(metrics_port), "--served-model-name", served_model_name, "--num-pages", "512"]
    stack = start_serve(log_dir / "serve.stderr", model_dir, *flags)
    try:
        with grpc.insecure_channel(stack.scheduler) as channel:
            yield stack, channel
    finally:
        code = stack.stop()
    assert code == 0, stack.stderr()[-4000:]


class ServiceProcess:
    """``python -m services.<name>`` as a child process; ready once it prints ``<NAME>_READY port=N``.

    ``port`` 0 lets it pick one; pass an earlier instance's port to restart it at the same address."""

    def __init__(self, name: str, args: list[str], port: int, log_path: Path, timeout: float = 120.0) -> None:
        self.log_path = log_path
        with log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}", *args, "--port", str(port), "--metrics-port", "0"],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        assert self.proc.stdout is not None
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        prefix = f"{name.upper()}_READY port="
        line = _read_ready_line(lines, prefix, timeout)
        if line is None:
            self.kill()
            tail = log_path.read_text(errors="replace")[-4000:]
            raise AssertionError(f"the {name} process did not get ready; its log:\n{tail}")
        self.port = int(line.split("=", 1)[1])

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when the machine or the process dies."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(EXIT_TIMEOUT)

    def terminate(self) -> int:
        """SIGTERM and the exit code; killed if it does not stop within the exit timeout."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise


class ExecutorProcess(ServiceProcess):
    """The executor service as a child process (see :class:`ServiceProcess`)."""

    def __init__(
        self, model_dir: Path, page_size: int, num_pages: int, port: int, log_path: Path, timeout: float = 120.0
    ) -> None:
        args = ["--model", str(model_dir), "--page-size", str(page_size), "--num-pages", str(num_pages)]
        super().__init__("executor", args, port, log_path, timeout)


class GrammarProcess(ServiceProcess):
    """The grammar service as a child process (see :class:`ServiceProcess`)."""

    def __init__(self, model_dir: Path, port: int, log_path: Path, timeout: float = 120.0) -> None:
        super().__init__("grammar", ["--model", str(model_dir)], port, log_path, timeout)
