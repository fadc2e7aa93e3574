"""The process supervisor of ``ordinal serve``: it starts the services as children, watches them, restarts one that
exits unexpectedly, and stops them.

Children run in their own process groups and die with the launcher (a parent-death signal where Linux offers one,
services/parent_death.py). SIGINT/SIGTERM stop everything in reverse start order; a second signal kills at once.
Once the stack is up, a child that exits without being asked to is reported (exit code, last lines) and started
again with the same command line after an exponential backoff (:class:`RestartPolicy`); a service that keeps dying
(more exits within a minute than the policy allows) stops everything, and the launcher exits non-zero.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

from services.probes import grpc_health_status, listed_models

READY_LINE = re.compile(r"^(?P<service>[A-Z]+)_READY port=(?P<port>\d+)\s*$")
TAIL_LINES = 40


@dataclass(frozen=True)
class RestartPolicy:
    """How a service that exits unexpectedly is restarted.

    The k-th exit of a service within ``window_s`` seconds is followed by a restart after ``initial_backoff_s`` x
    2^(k-1) seconds (at most ``max_backoff_s``), so a service that dies at once is not restarted in a tight loop and
    one that died once, long ago, comes back fast. More than ``max_restarts`` exits within the window: the service is
    given up on. ``max_restarts`` 0 never restarts (the first exit stops everything)."""

    max_restarts: int = 5
    window_s: float = 60.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(f"restart policy out of range: {self}")


class RestartHistory:
    """One service's exits within the policy's window (monotonic seconds), and what the next one means."""

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._exits: deque[float] = deque()

    @property
    def recent(self) -> int:
        """Exits within the window as of the last one recorded."""
        return len(self._exits)

    def record_exit(self, now: float) -> float | None:
        """Note an exit at ``now``: the seconds to wait before restarting, or None when the cap is passed."""
        while self._exits and self._exits[0] <= now - self._policy.window_s:
            self._exits.popleft()
        self._exits.append(now)
        if len(self._exits) > self._policy.max_restarts:
            return None
        return min(self._policy.max_backoff_s, self._policy.initial_backoff_s * 2 ** (len(self._exits) - 1))


def say(message: str) -> None:
    print(f"ordinal: {message}", file=sys.stderr, flush=True)


@dataclass
class StopSignal:
    """Set by SIGINT/SIGTERM. A second signal while stopping asks for ``force`` (kill without waiting)."""

    requested: threading.Event = field(default_factory=threading.Event)
    force: threading.Event = field(default_factory=threading.Event)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            self.force.set()
        self.requested.set()


def install_stop_handlers() -> StopSignal:
    stop = StopSignal()
    signal.signal(signal.SIGINT, stop.handle)
    signal.signal(signal.SIGTERM, stop.handle)
    return stop


class StopRequestedError(Exception):
    """A stop signal arrived while services were starting."""


class ServiceFailedError(Exception):
    """A service died or did not become ready; the message says which and why."""


# ---------------------------------------------------------------------------------------------------- children


def _said_ready(child: Child) -> bool:
    return child.ready.is_set()


@dataclass
class Child:
    """One service process: its command line, its output tails and, once it said so, its READY port.

    ``argv`` is what a restart runs (the launcher pins a port the first instance chose); ``is_ready`` says whether a
    restarted instance serves again (by default: it printed its READY line)."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[str]
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    stdout_tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ready_port: int | None = None
    ready_service: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    readers: list[threading.Thread] = field(default_factory=list)
    is_ready: Callable[[Child], bool] = _said_ready
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        """The exit code once the process has ended (negative: killed by that signal), else None."""
        return self.proc.poll()

    def death_report(self) -> str:
        code = self.exited()
        how = f"exit code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how += f" (killed by {signal.Signals(-code).name})"
        tail = list(self.stderr_tail) or list(self.stdout_tail)
        lines = [f"{self.name} (pid {self.pid}) exited with {how}"]
        if tail:
            lines.append(f"last lines of {self.name}'s output:")
            lines += [f"  | {line}" for line in tail]
        return "\n".join(lines)


class Supervisor:
    """Starts services in order, waits for each to be ready, watches them, and stops them in reverse order.

    Every child runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which then stops the
    children in order) and, on Linux, is sent SIGTERM if the launcher itself dies without cleaning up.
    """

    POLL_S = 0.1

    def __init__(self, stop: StopSignal, stop_timeout: float) -> None:
        self._stop = stop
        self._stop_timeout = stop_timeout
        self._children: list[Child] = []
        self._out_lock = threading.Lock()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def launch(self, name: str, argv: Sequence[str], is_ready: Callable[[Child], bool] = _said_ready) -> Child:
        """Start a child in its own session, with readers forwarding its output; stopped in reverse order.
        ``is_ready`` tells a restarted instance that serves again (default: its READY line)."""
        if self._stop.requested.is_set():
            raise StopRequestedError
        child = self._spawn(name, argv, is_ready)
        self._children.append(child)
        return child

    def _spawn(self, name: str, argv: Sequence[str], is_ready: Callable[[Child], bool]) -> Child:
        say(f"starting {name}: {' '.join(argv)}")
        proc = subprocess.Popen(
            [*_dies_with_us(), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        child = Child(name, list(argv), proc, is_ready=is_ready)
        assert proc.stdout is not None and proc.stderr is not None
        for stream, tail, watch in ((proc.stdout, child.stdout_tail, True), (proc.stderr, child.stderr_tail, False)):
            reader = threading.Thread(
                target=self._pump, args=(child, stream, tail, watch), name=f"ordinal-{name}-out", daemon=True
            )
            reader.start()
            child.readers.append(reader)
        return child

    def _pump(self, child: Child, stream: IO[str], tail: deque[str], watch_ready: bool) -> None:
        """Forward a child's output to our stderr, prefixed with its name; keep the last lines; spot READY."""
        for raw in stream:
            line = raw.rstrip("\n")
            tail.append(line)
            if watch_ready and not child.ready.is_set():
                match = READY_LINE.match(line)
                if match:
                    child.ready_service, child.ready_port = match["service"], int(match["port"])
                    child.ready.set()
            with self._out_lock:
                sys.stderr.write(f"{child.name:>9} | {line}\n")
                sys.stderr.flush()

    # ------------------------------------------------------------ readiness (every wait bounded)

    def _waiting(self, child: Child, timeout: float, what: str) -> Iterator[None]:
        """Yield every POLL_S until the caller is satisfied; raise if the child dies, a stop arrives or time is up."""
        deadline = time.monotonic() + timeout
        while True:
            if self._stop.requested.is_set():
                raise StopRequestedError
            if child.exited() is not None:
                self._drain(child)
                raise ServiceFailedError(f"{child.name} failed while starting: {child.death_report()}")
            if time.monotonic() > deadline:
                raise ServiceFailedError(f"{child.name} was not ready after {timeout:.0f} s: no {what}")
            yield
            self._stop.requested.wait(self.POLL_S)

    def wait_ready_line(self, child: Child, service: str, timeout: float) -> int:
        for _ in self._waiting(child, timeout, f"{service}_READY line on its stdout"):
            if child.ready.is_set():
                if child.ready_service != service or child.ready_port is None:
                    raise ServiceFailedError(f"{child.name} announced {child.ready_service}_READY, not {service}")
                return child.ready_port
        raise AssertionError("unreachable")

    def wait_grpc_serving(self, child: Child, target: str, timeout: float) -> None:
        for _ in self._waiting(child, timeout, f"SERVING from grpc.health.v1 at {target}"):
            if grpc_health_status(target, timeout=2.0) == "SERVING":
                return

    def wait_gateway_models(self, child: Child, base_url: str, timeout: float) -> str:
        """Poll ``GET /v1/models`` until the gateway lists a model (its workers are registered); return its id."""
        for _ in self._waiting(child, timeout, f"model listed at {base_url}/models"):
            model_ids = listed_models(f"{base_url}/models")
            if model_ids:
                return model_ids[0]
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ running and stopping

    def pids(self) -> dict[str, int]:
        return {c.name: c.pid for c in self._children}

    def supervise(
        self,
        policy: RestartPolicy,
        startup_timeout: float,
        on_ready: Callable[[Child], None] | None = None,
    ) -> int:
        """Watch the children until a stop signal (0) or until one keeps dying (1, everything is then to be stopped).

        A child that exits is reported (exit code, last lines) and, as the policy says, started again with the same
        command line after a backoff, in its place in the stop order. A restarted child that does not get ready
        within ``startup_timeout`` is killed, which counts as another exit. ``on_ready`` is told of each restarted
        child that serves again."""
        histories = {child.name: RestartHistory(policy) for child in self._children}
        due: dict[str, float] = {}  # name -> when its restart is due
        starting: set[str] = set()  # restarted, not ready yet
        while not self._stop.requested.wait(self.POLL_S * 2):
            now = time.monotonic()
            for i, child in enumerate(self._children):
                if child.name in due:
                    if now >= due[child.name]:
                        del due[child.name]
                        self._children[i] = self._spawn(child.name, child.argv, child.is_ready)
                        starting.add(child.name)
                elif child.exited() is not None:
                    starting.discard(child.name)
                    self._drain(child)
                    say(child.death_report())
                    delay = histories[child.name].record_exit(now)
                    if delay is None:
                        say(_giving_up(child.name, policy))
                        return 1
                    say(f"restarting {child.name} in {delay:.1f} s ({_exits(histories[child.name], policy)})")
                    due[child.name] = now + delay
                elif child.name in starting:
                    self._watch_restart(child, starting, startup_timeout, on_ready)
        return 0

    def _watch_restart(
        self,
        child: Child,
        starting: set[str],
        startup_timeout: float,
        on_ready: Callable[[Child], None] | None,
    ) -> None:
        took = time.monotonic() - child.started_at
        if child.is_ready(child):
            starting.discard(child.name)
            say(f"{child.name} is back (pid {child.pid}), ready {took:.1f} s after its restart")
            if on_ready is not None:
                on_ready(child)
        elif took > startup_timeout:
            say(f"{child.name} (pid {child.pid}) was not ready {startup_timeout:.0f} s after its restart: killing it")
            _signal_group(child.proc, signal.SIGKILL)  # its exit counts against the restart cap

    def stop_all(self) -> None:
        """SIGTERM each live child's process group in reverse start order; SIGKILL after the stop timeout."""
        for child in reversed(self._children):
            if child.exited() is None:
                self._stop_one(child)
            self._drain(child)

    def _stop_one(self, child: Child) -> None:
        started = time.monotonic()
        _signal_group(child.proc, signal.SIGTERM)
        deadline = started + self._stop_timeout
        while child.proc.poll() is None and time.monotonic() < deadline and not self._stop.force.is_set():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=self.POLL_S)
        if child.proc.poll() is None:
            say(f"{child.name} is still running {time.monotonic() - started:.1f} s after SIGTERM: killing it")
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait(timeout=self._stop_timeout)
        say(f"{child.name} stopped (exit code {child.proc.returncode}, {time.monotonic() - started:.1f} s)")

    @staticmethod
    def _drain(child: Child) -> None:
        """Let the readers forward what the child wrote before it exited (bounded: the pipes are closing)."""
        for reader in child.readers:
            reader.join(timeout=2.0)


def _exits(history: RestartHistory, policy: RestartPolicy) -> str:
    return f"exit {history.recent} of at most {policy.max_restarts} within {policy.window_s:.0f} s"


def _giving_up(name: str, policy: RestartPolicy) -> str:
    if policy.max_restarts == 0:
        return f"{name} exited and restarts are off: stopping the other services"
    return (
        f"{name} exited more than {policy.max_restarts} times within {policy.window_s:.0f} s: giving up on it, "
        "stopping the other services"
    )


def _signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    if proc.poll() is None:  # never signal a reaped pid: its group id may belong to someone else by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _dies_with_us() -> list[str]:
    """The command prefix that has a child die with the launcher (services/parent_death.py: the parent-death signal
    set in the child itself, never in a pre-exec hook of this threaded process). It is tied to the thread that starts
    the child: every child is started from the launcher's main thread, which lives as long as the launcher."""
    return [sys.executable, "-m", "services.parent_death", str(os.getpid())]
