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

The scheduler's grammars live in a session it holds (:class:`~services.grammar_session.HeldSession`): when the
session ends, on either side, the grammars are gone, so a restarted service or a dead scheduler leaves nothing
behind and nothing the scheduler believes open is missing unnoticed (see :class:`RemoteGrammar`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc
import torch

from engine.constraint import Constraint
from engine.grammar_calls import (
    CommitEntry,
    CommitOutcome,
    GrammarLoss,
    GrammarProtocolError,
    GrammarTimeoutError,
    GrammarUnavailableError,
    InvalidGrammarError,
    MaskEntry,
    MaskOutcome,
    MaskRefusals,
    MaskWait,
    Refusal,
)
from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc
from services.grammar import convert
from services.grammar_session import HeldSession
from services.grammar_stream import GrammarStreamError, SentRequest, StreamSlot, mask_stream_slot, rpc_error
from services.grpc_common import SERVICE_CHANNEL_OPTIONS

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = SERVICE_CHANNEL_OPTIONS
DEFAULT_TIMEOUT_S = 30.0
# A mask call waits for its reply at most this long past its fence deadline (the service answers at the deadline): a
# mask of a service that stopped answering fails then, never later.
MASK_REPLY_MARGIN_S = 2.0
SESSION_TIMEOUT_S = 2.0  # how long to wait for a session's grant (a service that is down refuses at once)
VERIFY_TIMEOUT_S = 2.0  # how long the check that the session still holds may take

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
    num_sessions: int = 0
    instance_id: str = ""
    session_held: bool = False


# ---------------------------------------------------------------- request building and reply reading


def open_request(
    entries: Sequence[tuple[str, Constraint]], deadline_s: float | None, session: str = ""
) -> pb.OpenRequest:
    return pb.OpenRequest(
        entries=[pb.OpenEntry(request_id=rid, constraint=convert.constraint_to_proto(c)) for rid, c in entries],
        deadline_ms=_ms(deadline_s),
        session=session,
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
        num_sessions=reply.num_sessions,
        instance_id=reply.instance_id,
        session_held=reply.session_held,
    )


def mask_stream_request(
    entries: Sequence[MaskEntry], deadline_s: float | None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[pb.StreamRequest, float]:
    """A FillMasks stream request, and how long its reply may take: the fence's deadline (None: the service's
    default, bounded by ``timeout_s``) plus a margin."""
    wait_s = (deadline_s if deadline_s is not None else timeout_s) + MASK_REPLY_MARGIN_S
    return pb.StreamRequest(fill_masks=fill_request(entries, deadline_s)), wait_s


def _ms(seconds: float | None) -> int:
    """0 (the server's default) for None; else at least 1 ms, since 0 would mean the default."""
    return 0 if seconds is None else max(1, round(seconds * 1000))


def _check_count(rpc: str, answered: int, asked: int) -> None:
    if answered != asked:
        raise GrammarProtocolError(Refusal.INTERNAL, f"{rpc} answered {answered} entries, {asked} were asked")


class StreamedMasks:
    """A mask request sent on the stream (a :class:`~engine.grammar_calls.MaskWait`): :meth:`result` takes its
    reply and writes the rows into the step's bitmask on the caller's thread."""

    def __init__(self, sent: SentRequest, entries: Sequence[MaskEntry], out: torch.Tensor, starts: Sequence[int]):
        self._sent = sent
        self._entries = entries
        self._out = out
        self._starts = starts

    def result(self) -> MaskRefusals:
        return convert.decode_masks_into(self._sent.receive().fill_masks, self._entries, self._out, self._starts)

    def close(self) -> None:
        """Nothing to stop: the service answers by the deadline, and a reply nobody takes is dropped by the next."""


# ---------------------------------------------------------------- clients


class GrammarClient:
    """Blocking client. ``timeout_s`` bounds every call; FillMasks and Open add their own deadline to it.
    ``options``: the channel's (tests give a long reconnect backoff to hold a channel between attempts)."""

    def __init__(
        self, target: str, timeout_s: float = DEFAULT_TIMEOUT_S, options: Sequence[tuple[str, int]] = CHANNEL_OPTIONS
    ) -> None:
        self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.GrammarStub(self._channel)
        self._timeout_s = timeout_s
        # Two streams, because a FillMasks waiting at its fence holds up its stream: commits (and releases) must
        # not queue behind it, or the mask would wait for a commit stuck behind itself.
        self._commit_stream = StreamSlot(self._stub)
        self._mask_stream = mask_stream_slot(self._stub)

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

    def open(
        self, entries: Sequence[tuple[str, Constraint]], deadline_s: float | None = None, session: str = ""
    ) -> list[OpenOutcome]:
        """Compile and open ``(request_id, constraint)`` pairs in ``session`` (empty: none); ``deadline_s`` bounds the
        compiles (None: the server's)."""
        request = open_request(entries, deadline_s, session)
        return open_outcomes(self._stub.Open(request, timeout=self._timeout_s + (deadline_s or 0)), entries)

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

    def get_state(self, session: str = "", timeout_s: float | None = None) -> GrammarServiceState:
        """The service's counters; with ``session``, also whether it holds that session."""
        reply = self._stub.GetState(pb.StateRequest(session=session), timeout=timeout_s or self._timeout_s)
        return service_state(reply)

    def hold_session(self, number: int, on_end: Callable[[HeldSession, str], None]) -> HeldSession:
        """Open a new session (not waiting for its grant: see :meth:`HeldSession.wait_granted`)."""
        return HeldSession(self._stub, number, on_end)

    def reset_commit_stream(self) -> None:
        """Drop the commit stream: the next commit or release opens a new one (a new session must not inherit the
        failure of a stream to a service that is gone)."""
        self._commit_stream.close()

    # The per-step calls over the Stream RPC: the same answers as the unary calls above, for the cost of a stream
    # message. They raise GrammarStreamError (not grpc.RpcError) when the stream fails.

    def stream_commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        request = pb.StreamRequest(commit=pb.CommitRequest(entries=[convert.commit_entry_to_proto(e) for e in entries]))
        return commit_outcomes(self._commit_stream.exchange(request, self._timeout_s).commit, entries)

    def stream_fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float | None, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        """Fenced masks written straight into ``out`` [N, W] (entry i's rows from ``starts[i]``); the refusals."""
        reply = self._mask_stream.exchange(*self._mask_request(entries, deadline_s)).fill_masks
        return convert.decode_masks_into(reply, entries, out, starts)

    def stream_start_masks(
        self, entries: Sequence[MaskEntry], deadline_s: float | None, out: torch.Tensor, starts: Sequence[int]
    ) -> StreamedMasks:
        """:meth:`stream_fill_masks_into` in two halves: the request goes out now, the reply is taken (and written
        into ``out``) by the returned wait's ``result``, on the thread that sent it."""
        return StreamedMasks(self._mask_stream.send(*self._mask_request(entries, deadline_s)), entries, out, starts)

    def stream_send_masks(self, request: pb.StreamRequest, wait_s: float) -> SentRequest:
        """A FillMasks stream request built elsewhere (:func:`mask_stream_request`: the executor's mask relay)
        sent now on the mask stream; its reply is taken from what this returns, within ``wait_s``."""
        return self._mask_stream.send(request, wait_s)

    def _mask_request(self, entries: Sequence[MaskEntry], deadline_s: float | None) -> tuple[pb.StreamRequest, float]:
        return mask_stream_request(entries, deadline_s, self._timeout_s)

    def stream_release(self, request_ids: Sequence[str]) -> list[Refusal | None]:
        request = pb.StreamRequest(release=pb.ReleaseRequest(request_ids=list(request_ids)))
        return release_outcomes(self._commit_stream.exchange(request, self._timeout_s).release, request_ids)


class RemoteGrammar:
    """The grammar service as the engine's :class:`~engine.grammar.backend.GrammarBackend`, over a blocking client.

    Batched like the engine's calls: one Open per request (from the engine's compile threads), one Commit and one
    FillMasks per step. A failure of a whole call must cost only the constrained requests, never the engine loop:
    ``open`` raises (that request ends alone, or waits: GrammarUnavailableError), ``fill_masks`` raises (the mask
    fetcher fails that step's constrained rows), ``commit`` answers every entry UNAVAILABLE, ``release`` only logs.

    With ``holds_session`` (the scheduler's client) every grammar is opened in a session this client holds. The
    session ends when its call ends (the service died, restarted or became unreachable) or when a commit or release
    on it fails (the grammars' states are unknown then; cancelling the call has the service release them): each end
    is a :class:`GrammarLoss` for :meth:`take_loss`, and the next open holds a new session. The executor's client
    only reads masks and holds none.
    """

    def __init__(
        self,
        client: GrammarClient,
        target: str = "",
        open_deadline_s: float | None = None,
        holds_session: bool = True,
        vocab_size: int | None = None,
    ) -> None:
        """``open_deadline_s`` bounds each compile (None: the service's default); ``vocab_size``: the model's, which
        every service instance a session is held with must mask."""
        self._client = client
        self._target = target
        self._open_deadline_s = open_deadline_s
        self._holds_session = holds_session
        self._vocab_size = vocab_size
        self._session_lock = threading.Lock()  # one session at a time, replaced only under this lock
        self._session: HeldSession | None = None
        self._sessions_held = 0
        self._loss_lock = threading.Lock()
        self._lost: GrammarLoss | None = None  # the newest session that ended
        self._taken = 0  # the newest session loss take_loss reported

    @classmethod
    def connect(
        cls,
        target: str,
        timeout_s: float = 60.0,
        vocab_size: int | None = None,
        open_deadline_s: float | None = None,
        holds_session: bool = True,
    ) -> RemoteGrammar:
        """Wait (at most ``timeout_s``) until the service at ``target`` answers, and hold a session with it when
        ``holds_session``. With ``vocab_size``, refuse a service whose masks would not cover exactly that many
        logits (another model's tokenizer)."""
        client = GrammarClient(target)
        try:
            client.wait_ready(timeout_s)
            state = client.get_state()
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            client.close()
            raise GrammarServiceError(f"grammar service at {target} did not answer within {timeout_s:.0f}s") from exc
        if vocab_size is not None and state.vocab_size != vocab_size:
            client.close()
            raise GrammarServiceError(_vocab_mismatch(target, state.vocab_size, vocab_size))
        grammar = cls(client, target, open_deadline_s, holds_session, vocab_size)
        if holds_session:
            try:
                grammar._current_session()
            except GrammarUnavailableError as exc:
                grammar.close()
                raise GrammarServiceError(str(exc)) from exc
        return grammar

    @property
    def client(self) -> GrammarClient:
        return self._client

    @property
    def session(self) -> tuple[int, str] | None:
        """The session held now, as (number, id); None when there is none (not yet, ended, or a client holding none)."""
        held = self._session
        return (held.number, held.session_id) if held is not None and held.alive else None

    def open(self, request_id: str, constraint: Constraint) -> int:
        """Compile and open in the current session (holding a new one if the last ended); its number. Raises the
        entry's error (InvalidGrammarError carries xgrammar's reason), or GrammarUnavailableError."""
        session, number = ("", 0)
        if self._holds_session:
            held = self._current_session()
            session, number = held.session_id, held.number
        try:
            (outcome,) = self._client.open([(request_id, constraint)], self._open_deadline_s, session)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise GrammarUnavailableError(f"the Open to {self._target} failed ({rpc_error(exc)})") from exc
            raise GrammarProtocolError(Refusal.INTERNAL, f"grammar Open failed: {rpc_error(exc)}") from exc
        error = outcome.error
        if isinstance(error, GrammarProtocolError) and error.code is Refusal.NO_SESSION:
            raise GrammarUnavailableError(f"the grammar service at {self._target} refused the open: {error}")
        if error is not None:
            raise error
        return number

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        """One step's commits. A failed call answers every entry UNAVAILABLE and ends the session. An entry refused
        RELEASED or UNKNOWN (the scheduler commits only grammars it has not released) has the session checked: when
        the service no longer holds it (a new instance behind the address), such entries are answered UNAVAILABLE
        too and the session ends, so those requests end as lost to the service, not as refused by their grammar."""
        if not entries:
            return []
        try:
            outcomes = self._client.stream_commit(entries)
        except GrammarStreamError as exc:
            message = f"grammar service unavailable: a commit to {self._target} failed ({exc})"
            log.warning("grammar commit of %d entries failed: %s", len(entries), message)
            self._end_current(f"a commit failed ({exc})")
            return [CommitOutcome(None, Refusal.UNAVAILABLE, message) for _ in entries]
        if not any(o.refusal in _GONE for o in outcomes) or not self._holds_session:
            return outcomes
        lost = self._verify_session()
        if lost is None:
            return outcomes
        message = f"grammar service unavailable: {lost}; this request's grammar state is gone"
        return [CommitOutcome(None, Refusal.UNAVAILABLE, message) if o.refusal in _GONE else o for o in outcomes]

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        return self._client.stream_fill_masks_into(entries, deadline_s, out, starts)

    computes_meanwhile = True  # FencingBackend: the service computes the rows in its own process

    def start_masks(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskWait:
        """The mask request goes out now, from the caller's thread; the service computes the rows (waiting at its
        fence) while the caller runs its forward, and the wait's ``result`` takes the reply."""
        return self._client.stream_start_masks(entries, deadline_s, out, starts)

    def release(self, request_ids: Sequence[str]) -> None:
        if not request_ids:
            return
        try:
            self._client.stream_release(request_ids)
        except GrammarStreamError as exc:
            log.warning("grammar release of %d ids failed: %s", len(request_ids), exc)
            self._end_current(f"a release failed ({exc})")  # the service releases them with the session

    @property
    def num_open(self) -> int:
        """Grammars open in the service (an RPC: every client of the service counts)."""
        return self._client.get_state().num_open

    def take_loss(self, verify: bool = False) -> GrammarLoss | None:
        if verify:
            self._verify_session()
        with self._loss_lock:
            lost = self._lost
            if lost is None or lost.session <= self._taken:
                return None
            self._taken = lost.session
            return lost

    def unavailable(self) -> str | None:
        try:
            if self._holds_session:
                self._current_session()
            else:
                self._client.get_state(timeout_s=VERIFY_TIMEOUT_S)
        except GrammarUnavailableError as exc:
            return str(exc)
        except grpc.RpcError as exc:
            return f"the grammar service at {self._target} does not answer ({rpc_error(exc)})"
        return None

    def close(self) -> None:
        with self._session_lock:
            held, self._session = self._session, None
        if held is not None:
            held.close()
        self._client.close()

    # ---------------------------------------------------------------- sessions

    def _current_session(self) -> HeldSession:
        """The session held now, or a new one (bounded: a service that is down refuses at once)."""
        with self._session_lock:
            held = self._session
            if held is not None and held.alive:
                return held
            self._sessions_held += 1
            fresh = self._client.hold_session(self._sessions_held, self._session_ended)
            grant = fresh.wait_granted(SESSION_TIMEOUT_S)
            if grant is None:
                raise GrammarUnavailableError(
                    f"the grammar service at {self._target} is unavailable: {fresh.end_reason}"
                )
            if self._vocab_size is not None and grant.vocab_size != self._vocab_size:
                fresh.close()
                raise GrammarUnavailableError(_vocab_mismatch(self._target, grant.vocab_size, self._vocab_size))
            self._client.reset_commit_stream()  # a stream of the session before must not answer for this one
            self._session = fresh
        log.info(
            "grammar session %d held with the service at %s (instance %s)",
            fresh.number,
            self._target,
            grant.instance_id,
        )
        return fresh

    def _session_ended(self, held: HeldSession, reason: str) -> None:
        """A session ended (from its watching thread, or here): a loss for the engine to take, recorded once."""
        with self._loss_lock:
            if self._lost is not None and self._lost.session >= held.number:
                return
            self._lost = GrammarLoss(
                held.number, f"the session with the grammar service at {self._target} ended: {reason}"
            )
        log.warning("grammar session %d lost: %s", held.number, reason)

    def _end_current(self, reason: str) -> None:
        """End the session held now: recorded as lost, and its call cancelled (the service releases its grammars)."""
        held = self._session
        if held is not None and held.alive:
            self._session_ended(held, reason)
            held.cancel()

    def _verify_session(self) -> str | None:
        """Ask the service whether it still holds the current session; end it when not (or when it does not answer),
        and say why. None: it holds (or no session is held here, and there is nothing to check).

        The session's call usually reports a dead service first, but not always before the executor's masks or a
        commit do: this turns "a grammar is missing" into a definite answer."""
        held = self._session
        if held is None or not held.alive:
            return None
        try:
            state = self._client.get_state(session=held.session_id, timeout_s=VERIFY_TIMEOUT_S)
        except grpc.RpcError as exc:
            reason = f"the service does not answer ({rpc_error(exc)})"
        else:
            if state.session_held:
                return None
            reason = f"the service (instance {state.instance_id}) does not hold it: it restarted"
        self._end_current(reason)
        return f"the session with the grammar service at {self._target} ended: {reason}"


class GrammarServiceError(RuntimeError):
    """The grammar service cannot be used: unreachable at start, or built for another vocabulary."""


_GONE = (Refusal.RELEASED, Refusal.UNKNOWN)  # a committed grammar the service does not have (any more)


def _vocab_mismatch(target: str, served: int, model: int) -> str:
    return (
        f"grammar service at {target} masks a vocabulary of {served} tokens but the model has {model}: start it "
        "with the same --model"
    )
