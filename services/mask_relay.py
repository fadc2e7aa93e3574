"""The executor's mask exchange run by a helper process of its own (``--grammar-mask-relay``).

Why: on a CPU host the executor is pinned to its core, and whatever runs there lengthens the step. One step's mask
exchange over gRPC Python costs that core 0.7-1 ms (gRPC's request-iterator thread, the stream's reader thread and
their GIL hand-offs beside the forward: bench/mask_exchange.py), of which the executor's own part (build the request,
decode the reply) is about a third. The relay holds the same per-step ``Stream`` to the grammar service in a child
process on the other cores; the executor writes each serialized request to it over a Unix socket before the forward
and reads the serialized reply back after it: no thread of the executor's, one send and one receive a step.

Nothing about the masks changes: the executor builds the same request (the entries at their fenced ordinals, C3),
the service answers it as any (C5), and the executor decodes and checks the reply as it would the stream's. Order:
the relay sends requests on its one stream in the order they arrive and answers each under its number; a request's
reply is taken only by it, one nobody takes (its step failed) is dropped by the next receive, and when a reply is
late, lost or malformed the relay is dropped (killed) and the next request starts a new one, so a late reply can
never answer a later request, as with the stream itself (services/grammar_stream.py). The relay's own side, its
frames and its loop: services/mask_relay_process.py.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.grammar_calls import MaskEntry, MaskRefusals
from protos import grammar_pb2 as pb
from services.flags import cpus_text
from services.grammar import convert
from services.grammar_client import GrammarStreamError, mask_stream_request
from services.mask_relay_process import STOP_TIMEOUT_S, Frame, FrameReader, send_frame

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0  # a relay that has not started by then will not
RELAY_MARGIN_S = 1.0


@dataclass(frozen=True)
class RelayConfig:
    """Where the relay's requests go and where it runs: ``cpus`` None leaves it on the executor's own."""

    target: str
    cpus: frozenset[int] | None = None


def relay_cpus() -> frozenset[int] | None:
    """The cores this process's parent may use and it may not: where a pinned executor's relay runs. The parent
    (``ordinal serve``, a bench, a shell) gave the executor cores of its own out of its own; the relay goes to the
    rest, where the parent's other services run. None when there are none: the executor was not pinned apart (the
    whole stack under one ``taskset``, say, where a relay would only add a process to the same cores), or the parent
    is not visible (a container's first process)."""
    parent = os.getppid()
    if parent <= 0:
        return None
    try:
        theirs = os.sched_getaffinity(parent)
    except OSError:
        return None
    others = frozenset(theirs) - frozenset(os.sched_getaffinity(0))
    return others or None


def wants_relay(setting: str, device: str) -> bool:
    """``--grammar-mask-relay``: on, off, or auto (on for a CPU executor pinned apart from the process that started
    it, the relay then on that process's other cores: :func:`relay_cpus`; a CUDA executor's host threads are not its
    critical path)."""
    if setting == "auto":
        return torch.device(device).type == "cpu" and relay_cpus() is not None
    return setting == "on"


# ---------------------------------------------------------------- the executor's side


class MaskRelay:
    """A :class:`~engine.grammar_calls.MaskSource` and ``FencingBackend`` whose exchanges run in the relay process.

    Used from one thread at a time (the runner's); a lock keeps a second caller from interleaving frames anyway."""

    computes_meanwhile = True  # FencingBackend: the rows are computed elsewhere while the caller runs its forward

    def __init__(self, config: RelayConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._frames: FrameReader | None = None
        self._sent = 0  # requests numbered so far (over every relay process: numbers never repeat)
        self._taken = 0  # every request below this number has had its reply taken or dropped

    @classmethod
    def start(cls, config: RelayConfig) -> MaskRelay:
        """A relay started and ready; raises GrammarStreamError when it cannot be."""
        relay = cls(config)
        with relay._lock:
            relay._ensure_started()
        return relay

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        return self.start_masks(entries, deadline_s, out, starts).result()

    def start_masks(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> RelayedMasks:
        """The request goes to the relay now; the returned wait's ``result`` takes its reply (after the forward)."""
        request, wait_s = mask_stream_request(entries, deadline_s)
        payload = request.SerializeToString()
        with self._lock:
            try:
                sock = self._ensure_started()
            except GrammarStreamError as exc:
                return RelayedMasks(self, -1, 0.0, entries, out, starts, failed=str(exc))
            number = self._sent
            self._sent += 1
            # The relay's own stream answers a reply that is late as failed by ``wait_s`` after it got the request;
            # the executor waits a little longer, counted from before the send, so that such an answer (the relay
            # healthy, the service late) comes first and does not cost the relay itself.
            deadline = time.monotonic() + wait_s + RELAY_MARGIN_S
            try:
                send_frame(sock, number, Frame.REQUEST, payload, wait_s)
            except OSError as exc:
                failed = self._drop(f"the mask relay could not take a request ({exc})")
                return RelayedMasks(self, number, 0.0, entries, out, starts, failed=str(failed))
        return RelayedMasks(self, number, deadline, entries, out, starts)

    def receive(self, number: int, deadline: float) -> pb.StreamReply:
        """The reply to request ``number``, waiting until ``deadline``; replies to earlier requests nobody took are
        dropped. Raises GrammarStreamError (and drops the relay) when it cannot be had."""
        with self._lock:
            if number < self._taken:
                raise GrammarStreamError(
                    f"the reply to mask request {number} is gone (a later one was taken first, or the relay restarted)"
                )
            frames = self._frames
            if frames is None:
                raise GrammarStreamError("the mask relay was dropped: this request's reply is lost")
            while True:
                try:
                    got, kind, payload, _ = frames.read(deadline)
                except TimeoutError:
                    raise self._drop("the mask relay did not answer in time") from None
                except (EOFError, OSError) as exc:
                    raise self._drop(f"the mask relay exited ({exc or 'end of stream'})") from None
                if got > number or kind not in (Frame.REPLY, Frame.FAILED):
                    raise self._drop(f"the mask relay answered {kind.name} {got} while {number} was awaited")
                self._taken = got + 1
                if got == number:
                    break
        if kind is Frame.FAILED:
            raise GrammarStreamError(payload.decode())
        return pb.StreamReply.FromString(payload)

    @property
    def pid(self) -> int | None:
        """The relay process's pid while one runs (it execs in place of the parent_death wrapper: the same pid)."""
        process = self._process
        return process.pid if process is not None else None

    def close(self) -> None:
        with self._lock:
            self._stop()

    # ------------------------------------------------------------ the process

    def _ensure_started(self) -> socket.socket:
        """The relay's socket, starting a relay process first when none runs (lock held)."""
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "services.mask_relay_process", "--grammar", self._config.target, "--fd",
               str(theirs.fileno())]  # fmt: skip
        if self._config.cpus is not None:
            cmd += ["--cpus", cpus_text(self._config.cpus)]
        # Started through parent_death: the relay dies with the executor, even by SIGKILL.
        wrapped = [sys.executable, "-m", "services.parent_death", str(os.getpid()), *cmd]
        try:
            self._process = subprocess.Popen(
                wrapped, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
            )
        except OSError as exc:
            ours.close()
            raise GrammarStreamError(f"the mask relay could not be started ({exc})") from None
        finally:
            theirs.close()
        # Blocking: every receive has a deadline of its own, and a send cannot block for long, since a relay that
        # stops reading is dropped at the first reply it misses, long before its socket's buffer fills with requests.
        self._sock, self._frames = ours, FrameReader(ours)
        try:
            _, kind, _, _ = self._frames.read(time.monotonic() + READY_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError) as exc:
            raise self._drop(f"the mask relay did not start ({type(exc).__name__})") from None
        if kind is not Frame.READY:
            raise self._drop(f"the mask relay began with {kind.name}")
        self._taken = self._sent  # nothing sent before this relay can be answered by it
        return ours

    def _drop(self, reason: str) -> GrammarStreamError:
        """Stop the relay (lock held); the next request starts a new one. The error to raise."""
        log.warning("mask relay dropped: %s", reason)
        self._stop(graceful=False)  # a relay that failed once is not trusted to exit by itself
        return GrammarStreamError(reason)

    def _stop(self, graceful: bool = True) -> None:
        sock, self._sock, self._frames = self._sock, None, None
        process, self._process = self._process, None
        if sock is not None:
            sock.close()  # a healthy relay reads the end of its stream and exits
        if process is not None:
            if not graceful:
                process.kill()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)
        self._taken = self._sent


class RelayedMasks:
    """A mask request handed to the relay (a :class:`~engine.grammar_calls.MaskWait`): :meth:`result` takes its
    reply and writes the rows into the step's bitmask on the caller's thread, checked as the stream's are."""

    def __init__(
        self,
        relay: MaskRelay,
        number: int,
        deadline: float,
        entries: Sequence[MaskEntry],
        out: torch.Tensor,
        starts: Sequence[int],
        failed: str | None = None,
    ) -> None:
        self._relay = relay
        self._number = number
        self._deadline = deadline
        self._entries = entries
        self._out = out
        self._starts = starts
        self._failed = failed

    @property
    def deadline(self) -> float:
        """When (time.monotonic) the executor stops waiting for this reply and drops the relay."""
        return self._deadline

    def result(self) -> MaskRefusals:
        if self._failed is not None:
            raise GrammarStreamError(self._failed)
        reply = self._relay.receive(self._number, self._deadline)
        if reply.WhichOneof("reply") != "fill_masks":
            raise GrammarStreamError(f"a fill_masks was answered by {reply.WhichOneof('reply')}")
        return convert.decode_masks_into(reply.fill_masks, self._entries, self._out, self._starts)

    def close(self) -> None:
        """Nothing to stop: the reply nobody takes is dropped by the next receive."""
