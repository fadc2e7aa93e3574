"""A client of the grammar service (``ordinal.grammar.v1.Grammar``), blocking or asyncio, batched like the RPCs.

Each method takes engine values and returns engine values: masks come back as int32 ``[R, W]`` tensors in
xgrammar's layout, ready for the sampler. A per-entry refusal (a stale commit, a mask past its deadline, a
bad grammar) is a value in the result list, never an exception: one bad entry must not cost the others.
Only a failure of the whole call (the service is unreachable, the call's deadline passed) raises
``grpc.RpcError`` (:class:`GrammarStreamError` for the ``stream_*`` calls).

:class:`RemoteGrammar` is the engine's view of the service (a :class:`~engine.grammar.backend.GrammarBackend`):
the scheduler's engine opens, commits and releases through it, the executor's mask fetcher fills masks through
another one, both against the same service. The per-step calls travel on the ``Stream`` RPC (one stream for
commits and releases, one for masks): a unary call costs the service about three times a stream message's CPU.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc
import torch

from engine.constraint import Constraint
from engine.grammar_calls import (
    CommitEntry,
    CommitOutcome,
    GrammarProtocolError,
    GrammarTimeoutError,
    InvalidGrammarError,
    MaskEntry,
    MaskOutcome,
    MaskRefusals,
    Refusal,
)
from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc
from services.grammar import convert
from services.grpc_common import outbox_messages

log = logging.getLogger(__name__)

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)
DEFAULT_TIMEOUT_S = 30.0
STREAM_CLOSE_TIMEOUT_S = 2.0

OpenError = InvalidGrammarError | GrammarTimeoutError | GrammarProtocolError


@dataclass(frozen=True)
class OpenOutcome:
    """One entry of an Open: ``error`` is None when the grammar is open at ordinal 0.

    Otherwise it is the engine error the scheduler maps to the request's status: InvalidGrammarError (xgrammar's
    reason; INVALID_ARGUMENT), GrammarTimeoutError (compile deadline), GrammarProtocolError (ALREADY_OPEN, ...).
    """

    error: OpenError | None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class GrammarServiceState:
    """The service's counters and mask geometry."""

    num_open: int
    vocab_size: int
    words_per_row: int
    compile_cache_hits: int
    compile_cache_misses: int
    compile_cache_entries: int
    num_waiting: int


# ---------------------------------------------------------------- request building and reply reading


def open_request(entries: Sequence[tuple[str, Constraint]], deadline_s: float | None) -> pb.OpenRequest:
    return pb.OpenRequest(
        entries=[pb.OpenEntry(request_id=rid, constraint=convert.constraint_to_proto(c)) for rid, c in entries],
        deadline_ms=_ms(deadline_s),
    )


def fill_request(entries: Sequence[MaskEntry], deadline_s: float | None) -> pb.FillMasksRequest:
    return pb.FillMasksRequest(entries=[convert.mask_entry_to_proto(e) for e in entries], deadline_ms=_ms(deadline_s))


def open_outcomes(reply: pb.OpenReply, entries: Sequence[tuple[str, Constraint]]) -> list[OpenOutcome]:
    _check_count("Open", len(reply.results), len(entries))
    return [_open_outcome(result, constraint) for result, (_, constraint) in zip(reply.results, entries, strict=True)]


def _open_outcome(result: pb.OpenResult, constraint: Constraint) -> OpenOutcome:
    if result.code == pb.OK:
        return OpenOutcome(None)
    if result.code == pb.INVALID_ARGUMENT:
        return OpenOutcome(InvalidGrammarError(constraint.kind, result.message))
    if result.code == pb.DEADLINE_EXCEEDED:
        return OpenOutcome(GrammarTimeoutError(result.message))
    return OpenOutcome(GrammarProtocolError(convert.refusal_from_code(result.code, "Open"), result.message))


def commit_outcomes(reply: pb.CommitReply, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
    _check_count("Commit", len(reply.results), len(entries))
    return [convert.commit_outcome_from_proto(r, e.request_id) for r, e in zip(reply.results, entries, strict=True)]


def release_outcomes(reply: pb.ReleaseReply, request_ids: Sequence[str]) -> list[Refusal | None]:
    _check_count("Release", len(reply.codes), len(request_ids))
    return [None if code == pb.OK else convert.refusal_from_code(code, "Release") for code in reply.codes]


def service_state(reply: pb.GrammarState) -> GrammarServiceState:
    return GrammarServiceState(
        num_open=reply.num_open,
        vocab_size=reply.vocab_size,
        words_per_row=reply.words_per_row,
        compile_cache_hits=reply.compile_cache_hits,
        compile_cache_misses=reply.compile_cache_misses,
        compile_cache_entries=reply.compile_cache_entries,
        num_waiting=reply.num_waiting,
    )


def _ms(seconds: float | None) -> int:
    """0 (the server's default) for None; else at least 1 ms, since 0 would mean the default."""
    return 0 if seconds is None else max(1, round(seconds * 1000))


def _check_count(rpc: str, answered: int, asked: int) -> None:
    if answered != asked:
        raise GrammarProtocolError(Refusal.INTERNAL, f"{rpc} answered {answered} entries, {asked} were asked")


# ---------------------------------------------------------------- the per-step stream


class GrammarStreamError(RuntimeError):
    """A per-step stream failed: the service went away, broke the reply order or did not answer in time. The
    stream is dropped; the next call opens a new one."""


class _CallStream:
    """One open ``Stream`` call: each request goes out in call order and its reply comes back in the same order."""

    def __init__(self, stub: pb_grpc.GrammarStub) -> None:
        self._outbox: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[pb.StreamReply | GrammarStreamError] = queue.SimpleQueue()
        self._call = stub.Stream(outbox_messages(self._outbox))
        self._reader = threading.Thread(target=self._read, name="ordinal-grammar-stream", daemon=True)
        self._reader.start()

    def exchange(self, request: pb.StreamRequest, timeout_s: float) -> pb.StreamReply:
        """Send one request and wait for its reply (the caller sends one at a time)."""
        self._outbox.put(request)
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise GrammarStreamError(f"the grammar service did not answer within {timeout_s:.1f} s") from None
        if isinstance(reply, GrammarStreamError):
            raise reply
        if reply.WhichOneof("reply") != request.WhichOneof("call"):
            raise GrammarStreamError(f"a {request.WhichOneof('call')} was answered by {reply.WhichOneof('reply')}")
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
            error = GrammarStreamError(f"grammar stream failed: {_rpc_error(exc)}")
        self._outbox.put(None)  # ends the request iterator, whose thread would otherwise wait forever
        self._replies.put(error)


class _StreamSlot:
    """A stream for one caller's per-step calls: opened on first use, one exchange at a time, reopened after a
    failure (a failed or late exchange drops the stream, so a late reply can never answer a later request)."""

    def __init__(self, stub: pb_grpc.GrammarStub) -> None:
        self._stub = stub
        self._lock = threading.Lock()
        self._stream: _CallStream | None = None

    def exchange(self, request: pb.StreamRequest, timeout_s: float) -> pb.StreamReply:
        with self._lock:
            if self._stream is None:
                self._stream = _CallStream(self._stub)
            try:
                return self._stream.exchange(request, timeout_s)
            except GrammarStreamError:
                self._stream.close()
                self._stream = None
                raise

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None


# ---------------------------------------------------------------- clients


class GrammarClient:
    """Blocking client. ``timeout_s`` bounds every call; FillMasks and Open add their own deadline to it."""

    def __init__(self, target: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.GrammarStub(self._channel)
        self._timeout_s = timeout_s
        # Two streams, because a FillMasks waiting at its fence holds up its stream: commits (and releases) must
        # not queue behind it, or the mask would wait for a commit stuck behind itself.
        self._commit_stream = _StreamSlot(self._stub)
        self._mask_stream = _StreamSlot(self._stub)

    def __enter__(self) -> GrammarClient:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._commit_stream.close()
        self._mask_stream.close()
        self._channel.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel is connected (the service may still be starting); raises
        ``grpc.FutureTimeoutError`` after ``timeout_s``."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def open(self, entries: Sequence[tuple[str, Constraint]], deadline_s: float | None = None) -> list[OpenOutcome]:
        """Compile and open ``(request_id, constraint)`` pairs; ``deadline_s`` bounds the compiles (None: server's)."""
        reply = self._stub.Open(open_request(entries, deadline_s), timeout=self._timeout_s + (deadline_s or 0))
        return open_outcomes(reply, entries)

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        reply = self._stub.Commit(
            pb.CommitRequest(entries=[convert.commit_entry_to_proto(e) for e in entries]), timeout=self._timeout_s
        )
        return commit_outcomes(reply, entries)

    def fill_masks(self, entries: Sequence[MaskEntry], deadline_s: float | None = None) -> list[MaskOutcome]:
        """Fenced masks; ``deadline_s`` is how long an entry may wait for its commit (None: the server's default)."""
        reply = self._stub.FillMasks(fill_request(entries, deadline_s), timeout=self._timeout_s + (deadline_s or 0))
        return convert.decode_masks(reply, entries)

    def release(self, request_ids: Sequence[str]) -> list[Refusal | None]:
        reply = self._stub.Release(pb.ReleaseRequest(request_ids=list(request_ids)), timeout=self._timeout_s)
        return release_outcomes(reply, request_ids)

    def get_state(self) -> GrammarServiceState:
        return service_state(self._stub.GetState(pb.StateRequest(), timeout=self._timeout_s))

    # The per-step calls over the Stream RPC: the same answers as the unary calls above, for the cost of a stream
    # message. They raise GrammarStreamError (not grpc.RpcError) when the stream fails.

    def stream_commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        request = pb.StreamRequest(commit=pb.CommitRequest(entries=[convert.commit_entry_to_proto(e) for e in entries]))
        return commit_outcomes(self._commit_stream.exchange(request, self._timeout_s).commit, entries)

    def stream_fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float | None, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        """Fenced masks written straight into ``out`` [N, W] (entry i's rows from ``starts[i]``); the refusals."""
        request = pb.StreamRequest(fill_masks=fill_request(entries, deadline_s))
        reply = self._mask_stream.exchange(request, self._timeout_s + (deadline_s or 0)).fill_masks
        return convert.decode_masks_into(reply, entries, out, starts)

    def stream_release(self, request_ids: Sequence[str]) -> list[Refusal | None]:
        request = pb.StreamRequest(release=pb.ReleaseRequest(request_ids=list(request_ids)))
        return release_outcomes(self._commit_stream.exchange(request, self._timeout_s).release, request_ids)


class GrammarServiceError(RuntimeError):
    """The grammar service cannot be used: unreachable at start, or built for another vocabulary."""


class RemoteGrammar:
    """The grammar service as the engine's :class:`~engine.grammar.backend.GrammarBackend`, over a blocking client.

    Batched like the engine's calls: one Open per request (from the engine's compile threads), one Commit and one
    FillMasks per step. A failure of a whole call must cost only the constrained requests, never the engine loop:
    ``open`` raises (that request ends alone), ``fill_masks`` raises (the mask fetcher fails that step's
    constrained rows), ``commit`` answers every entry INTERNAL (each constrained request ends with a grammar
    abort) and ``release`` only logs (the grammars died with the service anyway).
    """

    def __init__(self, client: GrammarClient, open_deadline_s: float | None = None) -> None:
        """``open_deadline_s`` bounds each compile (None: the service's default)."""
        self._client = client
        self._open_deadline_s = open_deadline_s

    @classmethod
    def connect(
        cls,
        target: str,
        timeout_s: float = 60.0,
        vocab_size: int | None = None,
        open_deadline_s: float | None = None,
    ) -> RemoteGrammar:
        """Wait (at most ``timeout_s``) until the service at ``target`` answers. With ``vocab_size``, refuse a
        service whose masks would not cover exactly that many logits (another model's tokenizer)."""
        client = GrammarClient(target)
        try:
            client.wait_ready(timeout_s)
            state = client.get_state()
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            client.close()
            raise GrammarServiceError(f"grammar service at {target} did not answer within {timeout_s:.0f}s") from exc
        if vocab_size is not None and state.vocab_size != vocab_size:
            client.close()
            raise GrammarServiceError(
                f"grammar service at {target} masks a vocabulary of {state.vocab_size} tokens but the model has "
                f"{vocab_size}: start it with the same --model"
            )
        return cls(client, open_deadline_s)

    @property
    def client(self) -> GrammarClient:
        return self._client

    def open(self, request_id: str, constraint: Constraint) -> None:
        """Compile and open; raises the entry's error (InvalidGrammarError carries xgrammar's reason)."""
        (outcome,) = self._client.open([(request_id, constraint)], self._open_deadline_s)
        if outcome.error is not None:
            raise outcome.error

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        if not entries:
            return []
        try:
            return self._client.stream_commit(entries)
        except GrammarStreamError as exc:
            message = f"grammar service unavailable: {exc}"
            log.warning("grammar commit of %d entries failed: %s", len(entries), message)
            return [CommitOutcome(None, Refusal.INTERNAL, message) for _ in entries]

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        return self._client.stream_fill_masks_into(entries, deadline_s, out, starts)

    def release(self, request_ids: Sequence[str]) -> None:
        if not request_ids:
            return
        try:
            self._client.stream_release(request_ids)
        except GrammarStreamError as exc:
            log.warning("grammar release of %d ids failed: %s", len(request_ids), exc)

    @property
    def num_open(self) -> int:
        """Grammars open in the service (an RPC: every client of the service counts)."""
        return self._client.get_state().num_open

    def close(self) -> None:
        self._client.close()


def _rpc_error(exc: grpc.RpcError) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return f"{code.name if code is not None else 'error'}: {details}"
