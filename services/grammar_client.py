"""A client of the grammar service (``ordinal.grammar.v1.Grammar``), blocking or asyncio, batched like the RPCs.

Each method takes engine values and returns engine values: masks come back as int32 ``[R, W]`` tensors in
xgrammar's layout, ready for the sampler. A per-entry refusal (a stale commit, a mask past its deadline, a
bad grammar) is a value in the result list, never an exception: one bad entry must not cost the others.
Only a failure of the whole call (the service is unreachable, the call's deadline passed) raises
``grpc.RpcError``.

:class:`RemoteGrammar` is the engine's view of the service (a :class:`~engine.grammar.backend.GrammarBackend`):
the scheduler's engine opens, commits and releases through it, the executor's mask fetcher fills masks through
another one, both against the same service.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc
import torch

from engine.grammar import (
    CommitEntry,
    CommitOutcome,
    Constraint,
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

log = logging.getLogger(__name__)

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)
DEFAULT_TIMEOUT_S = 30.0

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


def _open_request(entries: Sequence[tuple[str, Constraint]], deadline_s: float | None) -> pb.OpenRequest:
    return pb.OpenRequest(
        entries=[pb.OpenEntry(request_id=rid, constraint=convert.constraint_to_proto(c)) for rid, c in entries],
        deadline_ms=_ms(deadline_s),
    )


def _fill_request(entries: Sequence[MaskEntry], deadline_s: float | None) -> pb.FillMasksRequest:
    return pb.FillMasksRequest(entries=[convert.mask_entry_to_proto(e) for e in entries], deadline_ms=_ms(deadline_s))


def _open_outcomes(reply: pb.OpenReply, entries: Sequence[tuple[str, Constraint]]) -> list[OpenOutcome]:
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


def _commit_outcomes(reply: pb.CommitReply, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
    _check_count("Commit", len(reply.results), len(entries))
    return [convert.commit_outcome_from_proto(r, e.request_id) for r, e in zip(reply.results, entries, strict=True)]


def _release_outcomes(reply: pb.ReleaseReply, request_ids: Sequence[str]) -> list[Refusal | None]:
    _check_count("Release", len(reply.codes), len(request_ids))
    return [None if code == pb.OK else convert.refusal_from_code(code, "Release") for code in reply.codes]


def _state(reply: pb.GrammarState) -> GrammarServiceState:
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


# ---------------------------------------------------------------- clients


class GrammarClient:
    """Blocking client. ``timeout_s`` bounds every call; FillMasks and Open add their own deadline to it."""

    def __init__(self, target: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.GrammarStub(self._channel)
        self._timeout_s = timeout_s

    def __enter__(self) -> GrammarClient:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel is connected (the service may still be starting); raises
        ``grpc.FutureTimeoutError`` after ``timeout_s``."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def open(self, entries: Sequence[tuple[str, Constraint]], deadline_s: float | None = None) -> list[OpenOutcome]:
        """Compile and open ``(request_id, constraint)`` pairs; ``deadline_s`` bounds the compiles (None: server's)."""
        reply = self._stub.Open(_open_request(entries, deadline_s), timeout=self._timeout_s + (deadline_s or 0))
        return _open_outcomes(reply, entries)

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        reply = self._stub.Commit(
            pb.CommitRequest(entries=[convert.commit_entry_to_proto(e) for e in entries]), timeout=self._timeout_s
        )
        return _commit_outcomes(reply, entries)

    def fill_masks(self, entries: Sequence[MaskEntry], deadline_s: float | None = None) -> list[MaskOutcome]:
        """Fenced masks; ``deadline_s`` is how long an entry may wait for its commit (None: the server's default)."""
        reply = self._stub.FillMasks(_fill_request(entries, deadline_s), timeout=self._timeout_s + (deadline_s or 0))
        return convert.decode_masks(reply, entries)

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float | None, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        """Fenced masks written straight into ``out`` [N, W] (entry i's rows from ``starts[i]``); the refusals."""
        reply = self._stub.FillMasks(_fill_request(entries, deadline_s), timeout=self._timeout_s + (deadline_s or 0))
        return convert.decode_masks_into(reply, entries, out, starts)

    def release(self, request_ids: Sequence[str]) -> list[Refusal | None]:
        reply = self._stub.Release(pb.ReleaseRequest(request_ids=list(request_ids)), timeout=self._timeout_s)
        return _release_outcomes(reply, request_ids)

    def get_state(self) -> GrammarServiceState:
        return _state(self._stub.GetState(pb.StateRequest(), timeout=self._timeout_s))


class AsyncGrammarClient:
    """The asyncio twin of :class:`GrammarClient` (``grpc.aio``); create and use it on one event loop."""

    def __init__(self, target: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.GrammarStub(self._channel)
        self._timeout_s = timeout_s

    async def __aenter__(self) -> AsyncGrammarClient:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def open(
        self, entries: Sequence[tuple[str, Constraint]], deadline_s: float | None = None
    ) -> list[OpenOutcome]:
        reply = await self._stub.Open(_open_request(entries, deadline_s), timeout=self._timeout_s + (deadline_s or 0))
        return _open_outcomes(reply, entries)

    async def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        reply = await self._stub.Commit(
            pb.CommitRequest(entries=[convert.commit_entry_to_proto(e) for e in entries]), timeout=self._timeout_s
        )
        return _commit_outcomes(reply, entries)

    async def fill_masks(self, entries: Sequence[MaskEntry], deadline_s: float | None = None) -> list[MaskOutcome]:
        request = _fill_request(entries, deadline_s)
        reply = await self._stub.FillMasks(request, timeout=self._timeout_s + (deadline_s or 0))
        return convert.decode_masks(reply, entries)

    async def release(self, request_ids: Sequence[str]) -> list[Refusal | None]:
        reply = await self._stub.Release(pb.ReleaseRequest(request_ids=list(request_ids)), timeout=self._timeout_s)
        return _release_outcomes(reply, request_ids)

    async def get_state(self) -> GrammarServiceState:
        return _state(await self._stub.GetState(pb.StateRequest(), timeout=self._timeout_s))


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
            return self._client.commit(entries)
        except grpc.RpcError as exc:
            message = f"grammar service unavailable: {_rpc_error(exc)}"
            log.warning("grammar commit of %d entries failed: %s", len(entries), message)
            return [CommitOutcome(None, Refusal.INTERNAL, message) for _ in entries]

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        return self._client.fill_masks_into(entries, deadline_s, out, starts)

    def release(self, request_ids: Sequence[str]) -> None:
        if not request_ids:
            return
        try:
            self._client.release(request_ids)
        except grpc.RpcError as exc:
            log.warning("grammar release of %d ids failed: %s", len(request_ids), _rpc_error(exc))

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
