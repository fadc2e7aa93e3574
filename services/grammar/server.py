"""The grammar service: one :class:`~engine.grammar.GrammarRegistry` served as ``ordinal.grammar.v1.Grammar``.

Compiles run on the compiler's own pool, so a slow compile never delays a step's commits or masks. Commits and
releases run on the event loop itself: they are bounded (an xgrammar ``accept_token`` per committed token,
microseconds each; a release waits at most for one mask batch holding the matcher) and a waiting mask needs them
next, so a thread hop would only add CPU and latency on the step's critical path. Mask computation runs on a small
thread pool. A fenced mask request that must wait for a
commit holds no thread: it awaits a loop-side signal that the registry raises after every commit and release,
then polls again (C3); a poll that finds every entry still behind is a few dict lookups and stays on the loop.

``Stream`` carries the same per-step calls as long-lived streams (one per caller): each message is answered in
order exactly like its unary twin, for the cost of a stream message instead of a whole unary call.

``Session`` is a scheduler's hold on the grammars it opens: the call stays open while the scheduler lives, and when
it ends (the scheduler stopped, died, or its connection was lost: keepalive finds a peer that vanished) every grammar
opened in that session is released (C9 across a scheduler's death). Stopping the service ends every session first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from engine.errors import InvalidRequestError
from engine.grammar import CompiledConstraint, ConstraintCompiler, EnforcementObserver, GrammarRegistry, MaskFence
from engine.grammar_calls import (
    GrammarProtocolError,
    InvalidGrammarError,
    MaskEntry,
    MaskRefusals,
    Refusal,
    mask_buffer,
)
from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc
from services.grammar import convert
from services.grpc_common import SERVICE_SERVER_OPTIONS, StartedServer, start_serving

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Grammar"].full_name
SERVER_OPTIONS = SERVICE_SERVER_OPTIONS
# Answer this much before the caller's own gRPC deadline, so that a fence timeout arrives as per-entry
# BEHIND_DEADLINE codes rather than as a DEADLINE_EXCEEDED of the whole call.
_REPLY_MARGIN_S = 0.05

T = TypeVar("T")


@dataclass(frozen=True)
class GrammarServiceConfig:
    """Deadlines (defaults for an unset ``deadline_ms`` and caps) and the xgrammar thread pool size."""

    compile_deadline_s: float = 30.0
    max_compile_deadline_s: float = 300.0
    fence_deadline_s: float = 5.0
    max_fence_deadline_s: float = 60.0
    workers: int = 4

    def __post_init__(self) -> None:
        if min(self.compile_deadline_s, self.fence_deadline_s) <= 0 or self.workers < 1:
            raise ValueError("deadlines must be > 0 and workers >= 1")


class ChangeSignal:
    """A loop-side counter of registry changes: a fence reads it, polls, then waits for it to move.

    Reading before the poll and waiting for "moved since" means a commit that lands during the poll is never
    missed. :meth:`notify_threadsafe` is what the registry calls, from whichever thread committed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._generation = 0
        self._moved = asyncio.Event()

    @property
    def generation(self) -> int:
        return self._generation

    def notify_threadsafe(self) -> None:
        self._loop.call_soon_threadsafe(self._bump)

    def _bump(self) -> None:
        self._generation += 1
        self._moved.set()
        self._moved = asyncio.Event()  # waiters hold the set one; later waiters get a fresh one

    async def wait_past(self, seen: int, timeout_s: float) -> None:
        """Return once the generation differs from ``seen``, or after ``timeout_s``."""
        if self._generation != seen:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._moved.wait(), timeout=max(0.0, timeout_s))


class GrammarServicer(pb_grpc.GrammarServicer):
    """Translates the grammar protocol to registry calls; every per-entry refusal becomes that entry's code."""

    def __init__(
        self, compiler: ConstraintCompiler, config: GrammarServiceConfig, observer: EnforcementObserver | None = None
    ) -> None:
        self._config = config
        self._signal = ChangeSignal(asyncio.get_running_loop())
        self.registry = GrammarRegistry(compiler, on_change=self._signal.notify_threadsafe, observer=observer)
        self._pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="grammar")
        self.instance_id = uuid.uuid4().hex
        self._stopping = asyncio.Event()  # set first when the service stops: every Session call then ends

    def end_sessions(self) -> None:
        """Answer every Session call's end (the service is stopping), so that no call waits for a grace period."""
        self._stopping.set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---------------------------------------------------------------- Open

    async def Open(self, request: pb.OpenRequest, context: grpc.aio.ServicerContext) -> pb.OpenReply:
        timeout_s = _deadline_s(
            request.deadline_ms, self._config.compile_deadline_s, self._config.max_compile_deadline_s, context
        )
        results: list[pb.OpenResult | None] = [None] * len(request.entries)
        compiles: dict[int, asyncio.Future[CompiledConstraint]] = {}
        claimed: set[str] = set()  # ids opened earlier in this batch
        for i, entry in enumerate(request.entries):
            try:
                constraint = convert.constraint_from_proto(entry.constraint)
                self.registry.check_can_open(entry.request_id, request.session)
                if entry.request_id in claimed:
                    raise GrammarProtocolError(Refusal.ALREADY_OPEN, f"{entry.request_id}: twice in one Open batch")
            except (InvalidRequestError, GrammarProtocolError) as refused:
                results[i] = _open_error(refused)
                continue
            claimed.add(entry.request_id)
            compiles[i] = asyncio.wrap_future(self.registry.compiler.submit(constraint))
            # If this call gives up (deadline, cancellation), the compile still ends somewhere: read its outcome
            # then, so that asyncio does not log it as never retrieved.
            compiles[i].add_done_callback(_consume)
        if compiles:
            await asyncio.wait(compiles.values(), timeout=timeout_s)
        attach: dict[int, CompiledConstraint] = {}
        for i, future in compiles.items():
            if not future.done():  # not cancelled: the compile goes on and lands in the cache
                results[i] = pb.OpenResult(
                    code=pb.DEADLINE_EXCEEDED, message=f"compile did not finish within {timeout_s:.3f}s"
                )
            elif future.cancelled():
                results[i] = pb.OpenResult(code=pb.INTERNAL, message="compile cancelled: the service is stopping")
            elif (error := future.exception()) is not None:
                results[i] = _open_error(error)
            else:
                attach[i] = future.result()
        if attach:
            for i, result in (await self._run(self._attach, request, attach)).items():
                results[i] = result
        return pb.OpenReply(results=[r if r is not None else pb.OpenResult(code=pb.INTERNAL) for r in results])

    def _attach(self, request: pb.OpenRequest, compiled: dict[int, CompiledConstraint]) -> dict[int, pb.OpenResult]:
        answers: dict[int, pb.OpenResult] = {}
        for i, grammar in compiled.items():
            try:
                self.registry.attach(request.entries[i].request_id, grammar, request.session)
                answers[i] = pb.OpenResult(code=pb.OK)
            except Exception as error:
                answers[i] = _open_error(error)
        return answers

    # ---------------------------------------------------------------- Commit

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitReply:
        return self._commit(request)

    def _commit(self, request: pb.CommitRequest) -> pb.CommitReply:
        entries = [convert.commit_entry_from_proto(e) for e in request.entries]
        outcomes = self.registry.commit(entries)  # bounded (microseconds a token): no thread hop on the critical path
        return pb.CommitReply(results=[convert.commit_outcome_to_proto(o) for o in outcomes])

    # ---------------------------------------------------------------- FillMasks

    async def FillMasks(self, request: pb.FillMasksRequest, context: grpc.aio.ServicerContext) -> pb.FillMasksReply:
        return await self._fill_masks(request, context)

    async def _fill_masks(self, request: pb.FillMasksRequest, context: grpc.aio.ServicerContext) -> pb.FillMasksReply:
        timeout_s = _deadline_s(
            request.deadline_ms, self._config.fence_deadline_s, self._config.max_fence_deadline_s, context
        )
        answers: list[convert.MaskAnswer | None] = [None] * len(request.entries)
        valid: list[tuple[int, MaskEntry]] = []
        for i, message in enumerate(request.entries):
            try:
                valid.append((i, convert.mask_entry_from_proto(message)))
            except GrammarProtocolError as refused:  # a malformed draft tree fails its entry only
                answers[i] = (refused.code, f"{message.request_id}: {refused}")
        entries = [entry for _, entry in valid]
        # The fence writes every mask into one reply buffer, which is packed straight from there.
        out, starts = mask_buffer(entries, self.registry.compiler.words_per_row)
        refusals = await self._fence(entries, timeout_s, out, starts)
        for (i, _), answer in zip(valid, convert.mask_answers(entries, starts, refusals), strict=True):
            answers[i] = answer
        done = [a if a is not None else (Refusal.INTERNAL, "unanswered") for a in answers]
        return convert.encode_masks(out, done)  # vectorised: cheap on the loop

    async def _fence(
        self, entries: list[MaskEntry], timeout_s: float, out: torch.Tensor, starts: list[int]
    ) -> MaskRefusals:
        """C3 on the loop: poll on the pool, and between polls await the next commit or release, never a thread."""
        with MaskFence(self.registry, entries, timeout_s, out, starts) as fence:
            while True:
                seen = self._signal.generation  # before the poll: a commit during the poll ends the wait at once
                # Only a poll with masks to compute goes to the pool; one that finds every entry still behind costs
                # a few dict lookups and stays on the loop.
                done = await self._run(fence.poll) if fence.ready() else fence.poll()
                if done or fence.remaining_s() <= 0:
                    return fence.refusals()
                await self._signal.wait_past(seen, fence.remaining_s())

    # ---------------------------------------------------------------- Release / GetState

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseReply:
        return self._release(request)

    def _release(self, request: pb.ReleaseRequest) -> pb.ReleaseReply:
        # On the loop, like a commit: at worst it waits for one mask batch in progress on the same matcher.
        refusals = self.registry.release(list(request.request_ids))
        return pb.ReleaseReply(codes=[pb.OK if r is None else convert.REFUSAL_CODES[r] for r in refusals])

    # ---------------------------------------------------------------- Stream

    async def Stream(
        self, request_iterator: AsyncIterator[pb.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamReply]:
        """The per-step calls on one stream: each message answered in order, exactly like its unary twin."""
        async for request in request_iterator:
            call = request.WhichOneof("call")
            if call == "commit":
                yield pb.StreamReply(commit=self._commit(request.commit))
            elif call == "fill_masks":
                yield pb.StreamReply(fill_masks=await self._fill_masks(request.fill_masks, context))
            elif call == "release":
                yield pb.StreamReply(release=self._release(request.release))
            else:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "a Stream message must carry one of commit, fill_masks, release"
                )

    # ---------------------------------------------------------------- Session

    async def Session(
        self, request: pb.SessionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionGrant]:
        """Hold a scheduler's session until the call ends, then release every grammar it owns (C9)."""
        session = request.session
        try:
            self.registry.hold_session(session)
        except GrammarProtocolError as refused:
            code = (
                grpc.StatusCode.ALREADY_EXISTS
                if refused.code is Refusal.ALREADY_OPEN
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(refused))
        log.info("session %s held", session)
        how = "the service is stopping"
        try:
            vocab = self.registry.compiler.vocab_size
            yield pb.SessionGrant(session=session, instance_id=self.instance_id, vocab_size=vocab)
            await self._stopping.wait()
        except asyncio.CancelledError:
            how = "its call ended"  # the scheduler closed it, died, or its connection was lost
            raise
        finally:
            released = self.registry.end_session(session)
            log.info("session %s ended (%s): %d grammars released", session, how, len(released))

    async def GetState(self, request: pb.StateRequest, context: grpc.aio.ServicerContext) -> pb.GrammarState:
        compiler = self.registry.compiler
        stats = compiler.stats()
        return pb.GrammarState(
            num_open=self.registry.num_open,
            vocab_size=compiler.vocab_size,
            words_per_row=compiler.words_per_row,
            compile_cache_hits=stats.hits,
            compile_cache_misses=stats.misses,
            compile_cache_entries=stats.entries,
            num_waiting=self.registry.num_waiting,
            num_sessions=self.registry.num_sessions,
            instance_id=self.instance_id,
            session_held=bool(request.session) and self.registry.session_held(request.session),
        )


def _deadline_s(requested_ms: int, default_s: float, cap_s: float, context: grpc.aio.ServicerContext) -> float:
    """The wait allowed: the request's (0 = default), capped, and ending before the call's own deadline."""
    wait_s = min(requested_ms / 1000.0 if requested_ms > 0 else default_s, cap_s)
    remaining = context.time_remaining()
    if remaining is not None:
        wait_s = min(wait_s, remaining - _REPLY_MARGIN_S)
    return max(0.0, wait_s)


def _open_error(error: BaseException) -> pb.OpenResult:
    if isinstance(error, InvalidGrammarError):  # xgrammar's own reason, for the person who wrote the grammar
        return pb.OpenResult(code=pb.INVALID_ARGUMENT, message=error.reason)
    if isinstance(error, InvalidRequestError):
        return pb.OpenResult(code=pb.INVALID_ARGUMENT, message=str(error))
    if isinstance(error, GrammarProtocolError):
        return pb.OpenResult(code=convert.REFUSAL_CODES[error.code], message=str(error))
    log.error("grammar open failed unexpectedly", exc_info=error)
    return pb.OpenResult(code=pb.INTERNAL, message=f"{type(error).__name__}: {error}")


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieve a compile's outcome so that asyncio does not log an abandoned one as never retrieved."""
    if not future.cancelled():
        future.exception()


# ---------------------------------------------------------------- serving


class GrammarServer(StartedServer):
    """A started grammar server. Stopping also closes the servicer's xgrammar pool."""

    def __init__(self, server: grpc.aio.Server, port: int, servicer: GrammarServicer, health: Any) -> None:
        super().__init__(server, port, health)
        self.servicer = servicer

    async def stop(self, grace: float = 2.0) -> None:
        self.servicer.end_sessions()  # a Session call never ends on its own: end them, or stopping waits the grace
        await super().stop(grace)
        self.servicer.close()


async def start_grammar(
    compiler: ConstraintCompiler,
    host: str = "127.0.0.1",
    port: int = 0,
    config: GrammarServiceConfig = GrammarServiceConfig(),
    observer: EnforcementObserver | None = None,
) -> GrammarServer:
    """Serve grammars compiled by ``compiler`` on ``host:port`` (0 picks a free port) until stopped. ``observer``
    is told how each JSON schema is enforced and of each violation (metrics)."""
    servicer = GrammarServicer(compiler, config, observer)
    server, bound, health = await start_serving(
        lambda s: pb_grpc.add_GrammarServicer_to_server(servicer, s), SERVICE_NAME, host, port, SERVER_OPTIONS
    )
    return GrammarServer(server, bound, servicer, health)
