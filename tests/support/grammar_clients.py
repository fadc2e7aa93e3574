"""An asyncio client of the grammar service, for tests that drive concurrent calls on one event loop."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import grpc

from engine.constraint import Constraint
from engine.grammar_calls import CommitEntry, CommitOutcome, MaskEntry, MaskOutcome, Refusal
from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc
from services.grammar import convert
from services.grammar_client import (
    CHANNEL_OPTIONS,
    DEFAULT_TIMEOUT_S,
    GrammarServiceState,
    OpenOutcome,
    commit_outcomes,
    fill_request,
    open_outcomes,
    open_request,
    release_outcomes,
    service_state,
)


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
        reply = await self._stub.Open(open_request(entries, deadline_s), timeout=self._timeout_s + (deadline_s or 0))
        return open_outcomes(reply, entries)

    async def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        reply = await self._stub.Commit(
            pb.CommitRequest(entries=[convert.commit_entry_to_proto(e) for e in entries]), timeout=self._timeout_s
        )
        return commit_outcomes(reply, entries)

    async def fill_masks(self, entries: Sequence[MaskEntry], deadline_s: float | None = None) -> list[MaskOutcome]:
        request = fill_request(entries, deadline_s)
        reply = await self._stub.FillMasks(request, timeout=self._timeout_s + (deadline_s or 0))
        return convert.decode_masks(reply, entries)

    async def release(self, request_ids: Sequence[str]) -> list[Refusal | None]:
        reply = await self._stub.Release(pb.ReleaseRequest(request_ids=list(request_ids)), timeout=self._timeout_s)
        return release_outcomes(reply, request_ids)

    async def get_state(self) -> GrammarServiceState:
        return service_state(await self._stub.GetState(pb.StateRequest(), timeout=self._timeout_s))
