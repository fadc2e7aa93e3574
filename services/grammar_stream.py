"""The grammar service's per-step ``Stream`` RPC as a blocking, pipelined call: requests out in order, each reply
taken by its own request (services/grammar_client.py's stream calls, and the executor's mask relay process).

Only grpc and the protos: the mask relay's process imports this without torch (it starts in a fifth of the time).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import grpc

from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc
from services.grpc_common import outbox_messages

STREAM_CLOSE_TIMEOUT_S = 2.0


class GrammarStreamError(RuntimeError):
    """A per-step stream failed: the service went away, broke the reply order or did not answer in time. The
    stream is dropped; the next call opens a new one."""


class _CallStream:
    """One open ``Stream`` call: each request goes out in call order and its reply comes back in the same order.

    A request may be sent and its reply taken later (:meth:`send`, :meth:`receive`): the executor sends a step's
    mask request before its forward and takes the answer after it, with no thread of its own waiting for it.
    Replies are taken in the order their requests were sent; the reply of a request nobody takes (its step
    failed) is dropped when a later one is taken."""

    def __init__(self, stub: pb_grpc.GrammarStub, wait_for_ready: bool) -> None:
        self._outbox: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[pb.StreamReply | GrammarStreamError] = queue.SimpleQueue()
        self._send_lock = threading.Lock()  # the outbox order is the numbering order
        self._receive_lock = threading.Lock()
        self._sent = 0  # requests sent
        self._taken = 0  # replies read off the queue (taken or dropped)
        self._error: GrammarStreamError | None = None  # once the stream failed, every later receive says so
        self._call = stub.Stream(outbox_messages(self._outbox), wait_for_ready=wait_for_ready)
        self._reader = threading.Thread(target=self._read, name="ordinal-grammar-stream", daemon=True)
        self._reader.start()

    def send(self, request: pb.StreamRequest) -> int:
        """Send ``request`` now; the number to :meth:`receive` its reply with."""
        with self._send_lock:
            number = self._sent
            self._sent += 1
            self._outbox.put(request)
        return number

    def receive(self, number: int, call: str, deadline: float, timeout_s: float) -> pb.StreamReply:
        """The reply to request ``number`` (a ``call`` request), waiting until ``deadline`` (time.monotonic, the
        request's send time plus ``timeout_s``)."""
        with self._receive_lock:
            if number < self._taken:
                raise GrammarStreamError(f"the reply to request {number} was dropped: a later one was taken first")
            while True:
                if self._error is not None:
                    raise self._error
                try:
                    reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise GrammarStreamError(f"the grammar service did not answer within {timeout_s:.1f} s") from None
                if isinstance(reply, GrammarStreamError):
                    self._error = reply
                    raise reply
                self._taken += 1
                if self._taken - 1 == number:
                    break
        if reply.WhichOneof("reply") != call:
            raise GrammarStreamError(f"a {call} was answered by {reply.WhichOneof('reply')}")
        return reply

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()
        self._reader.join(STREAM_CLOSE_TIMEOUT_S)

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            error = GrammarStreamError("the grammar service ended the stream")
        except grpc.RpcError as exc:
            error = GrammarStreamError(f"grammar stream failed: {rpc_error(exc)}")
        self._outbox.put(None)  # ends the request iterator, whose thread would otherwise wait forever
        self._replies.put(error)


class StreamSlot:
    """A stream for one caller's per-step calls: opened on first use, reopened after a failure (a failed or late
    reply drops the stream, so a late reply can never answer a later request).

    Exchanges are serialized (any thread may call them). A request sent with :meth:`send` is received by its
    sender later, outside the slot's lock: a slot serves either such split requests of one thread (the executor's
    masks) or exchanges, never both at once, since an exchange would take and drop a pending split reply.

    ``wait_for_ready``: a new stream waits for its channel to connect (bounded by each request's reply deadline)
    instead of failing at once while the channel is between reconnect attempts. The executor's mask streams use it
    (:func:`mask_stream_slot`): their channel may still be in its reconnect backoff from an outage when the scheduler,
    on its own channel, has already reached the restarted service and sends constrained work again."""

    def __init__(self, stub: pb_grpc.GrammarStub, wait_for_ready: bool = False) -> None:
        self._stub = stub
        self._wait_for_ready = wait_for_ready
        self._lock = threading.RLock()  # re-entered by an exchange whose receive fails and drops the stream
        self._stream: _CallStream | None = None

    def exchange(self, request: pb.StreamRequest, timeout_s: float) -> pb.StreamReply:
        """Send one request and wait (at most ``timeout_s``) for its reply, one exchange at a time."""
        with self._lock:
            return self.send(request, timeout_s).receive()

    def send(self, request: pb.StreamRequest, timeout_s: float) -> SentRequest:
        """Send ``request`` now; its reply, due within ``timeout_s`` from now, is taken from what this returns."""
        with self._lock:
            if self._stream is None:
                self._stream = _CallStream(self._stub, self._wait_for_ready)
            stream = self._stream
            number = stream.send(request)
        call = str(request.WhichOneof("call"))
        return SentRequest(self, stream, number, call, time.monotonic() + timeout_s, timeout_s)

    def drop(self, stream: _CallStream) -> None:
        """``stream`` failed: close it, and open a new one on the next send unless that happened already."""
        with self._lock:
            if self._stream is stream:
                self._stream = None
        stream.close()

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None


def mask_stream_slot(stub: pb_grpc.GrammarStub) -> StreamSlot:
    """The slot for the executor's mask requests (in process or in the mask relay): its streams wait for a
    reconnecting channel within the mask's deadline (see :class:`StreamSlot`)."""
    return StreamSlot(stub, wait_for_ready=True)


@dataclass(frozen=True)
class SentRequest:
    """A request sent on a slot's stream whose reply has not been taken."""

    slot: StreamSlot
    stream: _CallStream
    number: int
    call: str
    deadline: float  # time.monotonic
    timeout_s: float

    def receive(self) -> pb.StreamReply:
        try:
            return self.stream.receive(self.number, self.call, self.deadline, self.timeout_s)
        except GrammarStreamError:
            self.slot.drop(self.stream)
            raise


def rpc_error(exc: grpc.RpcError) -> str:
    """A failed call's status code and details, for a message."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return f"{code.name if code is not None else 'error'}: {details}"
