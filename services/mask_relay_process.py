"""The mask relay's process (``python -m services.mask_relay_process``, started by the executor's MaskRelay,
services/mask_relay.py): it holds the executor's per-step mask stream to the grammar service, on cores of its own.

Frames on the executor's Unix socket: a header (the request's number, the frame's kind, the payload's length, and
for a request the time its reply may take) and the payload, a serialized ``StreamRequest`` or ``StreamReply``.
Requests go out on the stream in the order they arrive, replies come back in that order under their numbers.
Only grpc and the protos are imported here, not torch: the relay starts in a fraction of a second.

    python -m services.mask_relay_process --grammar HOST:PORT --fd N [--cpus 0,1]
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from enum import IntEnum

import grpc

from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc
from services.grammar_stream import GrammarStreamError, SentRequest, StreamSlot, mask_stream_slot
from services.grpc_common import SERVICE_CHANNEL_OPTIONS

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
_HEADER = struct.Struct("<QBId")  # number, kind, payload length, the reply's time limit (requests only)
_RECV_BYTES = 1 << 18


class Frame(IntEnum):
    """What a frame on the relay's socket carries."""

    READY = 0  # relay -> executor, once: its client is up
    REQUEST = 1  # executor -> relay: a serialized pb.StreamRequest (fill_masks)
    REPLY = 2  # relay -> executor: the serialized pb.StreamReply to the request of the same number
    FAILED = 3  # relay -> executor: that request's stream failed; the payload says why (utf-8)


def send_frame(sock: socket.socket, number: int, kind: Frame, payload: bytes, wait_s: float = 0.0) -> None:
    sock.sendall(_HEADER.pack(number, kind, len(payload), wait_s) + payload)


class FrameReader:
    """Frames off a socket through one buffer: a frame that has arrived whole costs one ``recv``, where reading its
    header and payload apart, each behind a readiness poll, cost the executor's core 0.1 ms a step right after the
    forward."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def read(self, deadline: float | None = None) -> tuple[int, Frame, bytes, float]:
        """The next frame; raises EOFError at the end of the stream, TimeoutError past ``deadline`` (monotonic)."""
        while (frame := self._take()) is None:
            self._fill(deadline)
        return frame

    def _take(self) -> tuple[int, Frame, bytes, float] | None:
        buffer = self._buffer
        if len(buffer) < _HEADER.size:
            return None
        number, kind, size, wait_s = _HEADER.unpack_from(buffer)
        end = _HEADER.size + size
        if len(buffer) < end:
            return None
        payload = bytes(buffer[_HEADER.size : end])
        del buffer[:end]
        return number, Frame(kind), payload, wait_s

    def _fill(self, deadline: float | None) -> None:
        try:
            chunk = self._sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)  # what has arrived, without waiting
        except BlockingIOError:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([self._sock], [], [], remaining)[0]:
                    raise TimeoutError from None
            chunk = self._sock.recv(_RECV_BYTES)
        if not chunk:
            raise EOFError
        self._buffer += chunk


def _answer(sock: socket.socket, sent: queue.SimpleQueue[tuple[int, SentRequest | str] | None]) -> None:
    """Take each request's reply in order and write it back (the relay's answering thread)."""
    while (item := sent.get()) is not None:
        number, request = item
        if isinstance(request, str):
            send_frame(sock, number, Frame.FAILED, request.encode())
            continue
        try:
            reply = request.receive()
        except GrammarStreamError as exc:
            send_frame(sock, number, Frame.FAILED, str(exc).encode())
            continue
        send_frame(sock, number, Frame.REPLY, reply.SerializeToString())


def relay(sock: socket.socket, stream: StreamSlot) -> None:
    """Forward requests from ``sock`` to the grammar service's mask stream until the executor closes it."""
    sent: queue.SimpleQueue[tuple[int, SentRequest | str] | None] = queue.SimpleQueue()
    answering = threading.Thread(target=_answer, args=(sock, sent), name="ordinal-mask-relay", daemon=True)
    answering.start()
    send_frame(sock, 0, Frame.READY, b"")
    frames = FrameReader(sock)
    try:
        while True:
            number, kind, payload, wait_s = frames.read()
            if kind is not Frame.REQUEST:
                raise RuntimeError(f"the executor sent {kind.name}")
            try:
                request = pb.StreamRequest.FromString(payload)
                sent.put((number, stream.send(request, wait_s)))
            except Exception as exc:  # a request the relay cannot send fails alone, answered in its turn
                sent.put((number, f"the mask relay could not send request {number}: {exc}"))
    except (EOFError, ConnectionError):
        pass  # the executor closed its end (or exited): done
    finally:
        sent.put(None)
        answering.join(STOP_TIMEOUT_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.mask_relay_process", description=__doc__.split("\n")[0])
    parser.add_argument("--grammar", required=True, metavar="HOST:PORT")
    parser.add_argument("--fd", type=int, required=True, help="the socket inherited from the executor")
    parser.add_argument("--cpus", default="", help="cores to run on (default: the executor's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cpus:
        try:  # before the client's threads start: they inherit it
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        except OSError as exc:  # e.g. a container's cpuset without those cores: run where the executor does
            log.warning("mask relay: cannot run on cores %s (%s); staying on the executor's", args.cpus, exc)
    sock = socket.socket(fileno=args.fd)
    channel = grpc.insecure_channel(args.grammar, options=SERVICE_CHANNEL_OPTIONS)
    stream = mask_stream_slot(pb_grpc.GrammarStub(channel))
    try:
        relay(sock, stream)
    finally:
        stream.close()
        channel.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
