"""The scheduler's client for the executor service: a :class:`~engine.step.StepRunner` over gRPC.

``launch`` and ``release`` only enqueue a message on the session stream and return a future; a reader thread
resolves the futures in send order from the reply stream, so the scheduler loop never blocks on the network
(except for a bounded reconnect, see below).

When the session breaks (executor killed, network lost), every pending launch fails with
:class:`ExecutorUnavailableError` and the Engine aborts everything: the executor's KV and buffers are gone.
Pending and later releases succeed instead, since the buffers they would free no longer exist (and a failed
release is a protocol bug to the Engine). The runner reconnects only after the caller has *seen* the loss,
i.e. ``result()`` of a launch future raised it. Until then every launch fails at once: a plan built before the
scheduler learned of the loss may name requests whose buffers died with the session, or new requests the
scheduler is about to abort without releasing, and it must not reach a new session. The first launch after
that reconnects (new channel, new session; a changed ``instance_id`` is fine, a changed model or pool is not),
failing fast when the executor is still down.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc

from engine.errors import ExecutorUnavailableError, ProtocolError
from engine.model_info import ModelInfo
from engine.step import StepPlan, StepResult
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from services.executor import convert
from services.executor.convert import SESSION_METADATA_KEY
from services.grpc_common import SERVICE_CHANNEL_OPTIONS, outbox_messages

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = SERVICE_CHANNEL_OPTIONS  # a restarted executor is reached within a second
HEALTH_TIMEOUT_S = 1.0
CLOSE_TIMEOUT_S = 5.0


class _StepFuture(Future[StepResult]):
    """A launch future that tells its runner when the caller saw it fail because the session was lost."""

    def __init__(self, on_loss_seen: Callable[[int], None]) -> None:
        super().__init__()
        self._on_loss_seen = on_loss_seen
        self._loss = 0

    def fail_lost(self, error: ExecutorUnavailableError, loss: int) -> None:
        self._loss = loss
        self.set_exception(error)

    def result(self, timeout: float | None = None) -> StepResult:
        try:
            return super().result(timeout)
        except ExecutorUnavailableError:
            self._on_loss_seen(self._loss)
            raise


@dataclass(frozen=True)
class _Pending:
    """A sent message awaiting its reply: a step (``step_id`` > 0) or a release (``step_id`` 0)."""

    step_id: int
    future: Future[Any]

    def settle(self, reply: pb.SessionReply) -> None:
        kind = reply.WhichOneof("kind")
        if self.future.done():
            return  # the caller cancelled it; the reply still kept the stream in order
        if kind == "error":
            self.future.set_exception(_step_error(reply.error))
        elif kind == "result" and self.step_id and reply.result.step_id == self.step_id:
            self.future.set_result(convert.result_from_proto(reply.result))
        elif kind == "released" and not self.step_id:
            self.future.set_result(None)
        else:
            raise ProtocolError(f"executor answered {kind} where the reply to {self._what} was due")

    def fail(self, error: ExecutorUnavailableError, loss: int) -> None:
        if self.future.done():
            return
        if isinstance(self.future, _StepFuture):
            self.future.fail_lost(error, loss)
        else:
            self.future.set_result(None)  # a release: the lost session took every buffer with it

    @property
    def _what(self) -> str:
        return f"step {self.step_id}" if self.step_id else "a release"


def _step_error(error: pb.StepError) -> Exception:
    if error.code == "protocol":
        return ProtocolError(error.message)
    return RuntimeError(f"executor error ({error.code}): {error.message}")


class _Session:
    """One open Session stream. Messages go out in call order; replies settle the pending futures in that order."""

    def __init__(self, stub: pb_grpc.ExecutorStub, on_lost: Callable[[str], int]) -> None:
        self._on_lost = on_lost
        self._outbox: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self._lost: tuple[str, int] | None = None  # why, and the runner's loss number
        self._accepted = threading.Event()
        self._answered = threading.Event()  # accepted or refused
        self._closing = False
        self._call = stub.Session(outbox_messages(self._outbox))
        self._reader = threading.Thread(target=self._read, name="ordinal-executor-replies", daemon=True)
        self._reader.start()

    @property
    def lost(self) -> bool:
        return self._lost is not None

    @property
    def lost_reason(self) -> str | None:
        return self._lost[0] if self._lost is not None else None

    def wait_accepted(self, timeout: float) -> None:
        if not self._answered.wait(timeout):
            self._closing = True
            self._call.cancel()
            self._reader.join(CLOSE_TIMEOUT_S)
            raise ExecutorUnavailableError(f"the executor did not open a session within {timeout:.1f} s")
        if not self._accepted.is_set():
            raise ExecutorUnavailableError(self._lost[0] if self._lost else "the executor refused the session")

    def send(self, msg: pb.SessionRequest, pending: _Pending) -> None:
        with self._lock:
            lost = self._lost
            if lost is None:
                self._pending.append(pending)
                self._outbox.put(msg)
        if lost is not None:
            pending.fail(ExecutorUnavailableError(lost[0]), lost[1])

    def close(self) -> None:
        """Half-close, let the executor answer what was sent, then stop (bounded)."""
        self._closing = True
        self._outbox.put(None)
        self._reader.join(CLOSE_TIMEOUT_S)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(CLOSE_TIMEOUT_S)

    def _read(self) -> None:
        try:
            metadata = dict(self._call.initial_metadata() or ())
            if SESSION_METADATA_KEY in metadata:
                self._accepted.set()
                self._answered.set()
            for reply in self._call:
                self._settle_next(reply)
            reason = "the executor ended the session"
        except grpc.RpcError as exc:
            reason = f"executor session failed: {exc.code().name}: {exc.details()}"
        except ProtocolError as exc:  # replies out of order: nothing on this stream can be trusted any more
            self._call.cancel()
            reason = f"executor broke the session's reply order: {exc}"
        except Exception as exc:  # a bug here must not leave futures pending forever
            log.exception("executor session reader failed")
            self._call.cancel()
            reason = f"executor session reader failed: {exc!r}"
        if self._closing:
            reason = "the executor session was closed"
        self._fail_all(reason)
        self._answered.set()

    def _settle_next(self, reply: pb.SessionReply) -> None:
        with self._lock:
            pending = self._pending.popleft() if self._pending else None
        if pending is None:
            raise ProtocolError("a reply arrived with nothing pending")
        pending.settle(reply)

    def _fail_all(self, reason: str) -> None:
        loss = self._on_lost(reason) if self._accepted.is_set() and not self._closing else 0
        with self._lock:
            self._lost = (reason, loss)
            pending = list(self._pending)
            self._pending.clear()
        self._outbox.put(None)  # ends the request iterator, whose thread would otherwise wait forever
        error = ExecutorUnavailableError(reason)
        for item in pending:
            item.fail(error, loss)


class _Connection:
    """A channel to one executor instance, its model facts and its open session."""

    def __init__(self, target: str, timeout: float, on_lost: Callable[[str], int], wait_for_ready: bool) -> None:
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.ExecutorStub(self.channel)
        try:
            msg = self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready)
            self.info = convert.model_info_from_proto(msg)
            self.instance_id: str = msg.instance_id
            self.session = _Session(self.stub, on_lost)
            self.session.wait_accepted(timeout)
        except grpc.RpcError as exc:
            self.channel.close()
            raise ExecutorUnavailableError(f"executor at {target}: {exc.code().name}: {exc.details()}") from exc
        except ExecutorUnavailableError:
            self.channel.close()
            raise

    def close(self) -> None:
        self.session.close()
        self.channel.close()


class RemoteRunner:
    """The executor service as a :class:`~engine.step.StepRunner`: steps travel over one Session stream.

    Build it with :meth:`connect`. ``launch`` and ``release`` are called from one thread (the scheduler
    loop); ``healthy`` from any thread.
    """

    def __init__(self, target: str, timeout: float = 10.0, reconnect_timeout: float = 2.0) -> None:
        self.target = target
        self._reconnect_timeout = reconnect_timeout
        self._lock = threading.Lock()  # guards replacing the connection
        self._loss_lock = threading.Lock()  # guards the loss counters (taken by reader threads too)
        self._losses = 0  # sessions lost so far
        self._seen = 0  # the latest loss the caller has seen through a launch future
        self._closed = False
        # At start the executor may still be loading: wait for it. A reconnect fails fast when it is down.
        self._conn = _Connection(target, timeout, self._session_lost, wait_for_ready=True)
        self.info: ModelInfo = self._conn.info

    @classmethod
    def connect(cls, target: str, timeout: float = 10.0, reconnect_timeout: float = 2.0) -> RemoteRunner:
        """Wait up to ``timeout`` seconds for the executor at ``target`` (host:port) and open the session.

        Raises :class:`ExecutorUnavailableError` when it does not answer or refuses the session."""
        return cls(target, timeout, reconnect_timeout)

    @property
    def instance_id(self) -> str:
        """The executor process this runner is connected to (changes when it restarts)."""
        return self._conn.instance_id

    # ---------------------------------------------------------------- StepRunner

    def launch(self, plan: StepPlan) -> Future[StepResult]:
        future = _StepFuture(self._loss_seen)
        try:
            msg = pb.SessionRequest(plan=convert.plan_to_proto(plan))
        except (ValueError, TypeError) as exc:
            future.set_exception(ProtocolError(f"step {plan.step_id} cannot be encoded: {exc}"))
            return future
        session, failure = self._session_for_launch()
        if session is None:
            assert failure is not None
            future.fail_lost(*failure)
            return future
        session.send(msg, _Pending(plan.step_id, future))
        return future

    def release(self, slots: Sequence[int]) -> Future[None]:
        future: Future[None] = Future()
        self._conn.session.send(pb.SessionRequest(release=pb.Release(slots=slots)), _Pending(0, future))
        return future

    def healthy(self) -> bool:
        """True when the executor answers GetState within a second (riding out the channel's reconnect backoff)."""
        try:
            self._conn.stub.GetState(pb.StateRequest(), timeout=HEALTH_TIMEOUT_S, wait_for_ready=True)
        except grpc.RpcError:
            return False
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()

    # ---------------------------------------------------------------- loss and reconnect

    @property
    def session_lost(self) -> bool:
        """True once the current session has ended (until a launch reconnects)."""
        return self._conn.session.lost

    def take_loss(self) -> str | None:
        """Why the session was lost, if no launch future has reported that loss yet; marks it seen.

        The engine asks this before planning while nothing is in flight, so a loss that happened while it was
        idle is handled (every request aborted, the prefix cache dropped) before a new request is planned,
        instead of costing that request its first step."""
        with self._loss_lock:
            if self._seen >= self._losses:
                return None
            self._seen = self._losses
        lost = self._conn.session.lost_reason
        return lost or "the executor session was lost"

    def _session_lost(self, reason: str) -> int:
        log.warning("executor session lost: %s", reason)
        with self._loss_lock:
            self._losses += 1
            return self._losses

    def _loss_seen(self, loss: int) -> None:
        with self._loss_lock:
            self._seen = max(self._seen, loss)

    def _session_for_launch(self) -> tuple[_Session | None, tuple[ExecutorUnavailableError, int] | None]:
        """The open session, a new one if the caller has seen the last loss, else why there is none."""
        with self._lock:
            with self._loss_lock:
                losses, seen = self._losses, self._seen
            if self._closed:
                return None, (ExecutorUnavailableError("the remote runner is shut down"), losses)
            if not self._conn.session.lost:
                return self._conn.session, None
            if seen < losses:
                reason = (
                    f"the executor session at {self.target} was lost; the next step after that is handled reconnects"
                )
                return None, (ExecutorUnavailableError(reason), losses)
            try:
                self._reconnect()
            except ExecutorUnavailableError as exc:
                return None, (exc, losses)
            return self._conn.session, None

    def _reconnect(self) -> None:
        """Replace the lost connection (lock held), bounded by the reconnect timeout."""
        conn = _Connection(self.target, self._reconnect_timeout, self._session_lost, wait_for_ready=False)
        if conn.info != self.info:
            conn.close()
            raise ExecutorUnavailableError(
                f"the executor at {self.target} restarted with another model or KV pool ({conn.info}; was "
                f"{self.info}): restart the scheduler with matching flags"
            )
        old, self._conn = self._conn, conn
        old.close()
        log.info("executor session reopened on instance %s", conn.instance_id)
