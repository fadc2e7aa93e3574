"""Every open matcher of a grammar service, and the fence that keeps masks fresh (contract C3).

The registry maps request ids to :class:`VersionedMatcher` objects and answers batches: one commit batch per
step from the scheduler, one mask batch per step from the executor. The two arrive independently, and with
overlap the executor usually asks for step N+1's masks before the scheduler has committed step N. The
**fence** makes that safe: a mask for ordinal v of a matcher that is still behind v waits for the commit
that brings it there, up to a deadline, and then fails that entry cleanly. A matcher already past v, or
released, is refused at once. No answer is ever computed from another version.

The fence is one :class:`MaskFence` driven by a waiting loop: :meth:`GrammarRegistry.fill_masks` waits on a
condition variable (in-process callers); the grammar service waits on the loop instead, woken through
``on_change``, so that a waiting request holds no thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial

import torch

from engine.constraint import Constraint
from engine.grammar.compiler import CompiledConstraint, ConstraintCompiler
from engine.grammar.enforcement import EnforcementObserver, LoggingObserver
from engine.grammar.matcher import TokenCalls, VersionedMatcher, fill_mask_rows
from engine.grammar.sessions import NO_SESSION, SessionTable
from engine.grammar_calls import (
    CommitEntry,
    CommitOutcome,
    GrammarProtocolError,
    MaskEntry,
    MaskOutcome,
    MaskRefusals,
    Refusal,
    mask_buffer,
    mask_outcomes,
)

log = logging.getLogger(__name__)

# Released ids remembered so that a late call is answered RELEASED rather than UNKNOWN; bounded (C9: nothing
# per request may outlive the service's baseline by more than this fixed-size memory).
DEFAULT_RELEASED_MEMORY = 65536


class GrammarRegistry:
    """All open matchers of one grammar service, keyed by request id.

    Thread-safe. ``on_change`` (if given) is called after every commit batch and release, from the thread that
    made the change, so that an asyncio fence can wake up; it must not block. ``observer`` (if given) is told, besides
    the log, how each JSON-schema request's schema is enforced and of each violation checked mode finds.
    """

    def __init__(
        self,
        compiler: ConstraintCompiler,
        *,
        released_memory: int = DEFAULT_RELEASED_MEMORY,
        on_change: Callable[[], None] | None = None,
        observer: EnforcementObserver | None = None,
    ) -> None:
        self._compiler = compiler
        self._released_memory = released_memory
        self._on_change = on_change
        self._observers: list[EnforcementObserver] = [LoggingObserver(), *([] if observer is None else [observer])]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0  # bumped by every commit batch and release; fences wait for it to move
        self._open: dict[str, VersionedMatcher] = {}
        self._waiting = 0  # mask entries now waiting at a fence for their commit
        self._fences: set[MaskFence] = set()  # fences in progress: a commit fills the entries it lets through
        self._released: OrderedDict[str, None] = OrderedDict()
        self._sessions = SessionTable()  # which scheduler session owns which grammar (C9 across a scheduler's death)
        self._token_calls = TokenCalls.holding_gil()

    @property
    def compiler(self) -> ConstraintCompiler:
        return self._compiler

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._open)

    @property
    def num_waiting(self) -> int:
        """Mask entries now waiting at a fence for the commit that reaches their ordinal."""
        with self._lock:
            return self._waiting

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    # ---------------------------------------------------------------- sessions

    def hold_session(self, session: str) -> None:
        """Start a scheduler's session: grammars opened in it are released with it (:meth:`end_session`)."""
        with self._lock:
            self._sessions.hold(session)

    def session_held(self, session: str) -> bool:
        with self._lock:
            return self._sessions.held(session)

    def end_session(self, session: str) -> list[str]:
        """End ``session`` and release every grammar it owns (its scheduler is gone); the ids released."""
        with self._lock:
            owned = self._sessions.end(session)
        self.release(owned)
        return owned

    # ---------------------------------------------------------------- open

    def check_can_open(self, request_id: str, session: str = NO_SESSION) -> None:
        """Refuse an id before compiling for it: empty (INVALID_ARGUMENT), open already (ALREADY_OPEN), or in a session
        that is not held (NO_SESSION)."""
        if not request_id:
            raise GrammarProtocolError(Refusal.INVALID_ARGUMENT, "request_id must not be empty")
        with self._lock:
            self._sessions.check_held(session)
            if request_id in self._open:
                raise GrammarProtocolError(Refusal.ALREADY_OPEN, f"{request_id}: a grammar is already open")

    def open(
        self, request_id: str, constraint: Constraint, timeout_s: float, session: str = NO_SESSION
    ) -> VersionedMatcher:
        """Compile ``constraint`` (cached, at most ``timeout_s``) and open a matcher at ordinal 0 under the id, owned
        by ``session`` (released with it; the empty id: by an explicit release only).

        Raises InvalidGrammarError, GrammarTimeoutError, or GrammarProtocolError (empty or duplicate id, a session
        that is not held).
        """
        self.check_can_open(request_id, session)
        return self.attach(request_id, self._compiler.compile(constraint, timeout_s), session)

    def attach(self, request_id: str, compiled: CompiledConstraint, session: str = NO_SESSION) -> VersionedMatcher:
        """Open a matcher for an already compiled constraint, owned by ``session``. The id and the session are checked
        again, under the lock that :meth:`end_session` takes: opens may race, and a session may end while its
        grammar compiles (its matcher is then never opened, so nothing outlives the session)."""
        self.check_can_open(request_id, session)
        matcher = VersionedMatcher(compiled, name=f"grammar of {request_id}", calls=self._token_calls)
        with self._lock:
            if request_id in self._open:
                raise GrammarProtocolError(Refusal.ALREADY_OPEN, f"{request_id}: a grammar is already open")
            self._sessions.own(session, request_id)
            self._open[request_id] = matcher
            self._released.pop(request_id, None)  # the id names a new grammar now
        if compiled.enforcement is not None:
            enforcement = compiled.enforcement
            self._tell(lambda observer: observer.schema_opened(request_id, enforcement))
        return matcher

    # ---------------------------------------------------------------- commit

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        """Apply one step's commits; each entry is answered on its own, a bad one never spoils the others. Then fill
        the rows of waiting fences that these commits let through (:meth:`_complete_fences`)."""
        try:
            found = self._lookup_many([entry.request_id for entry in entries])
            outcomes = [self._commit_one(entry, matcher) for entry, matcher in zip(entries, found, strict=True)]
            self._complete_fences({entry.request_id for entry in entries})
            return outcomes
        finally:
            self._bump()

    def _commit_one(self, entry: CommitEntry, matcher: VersionedMatcher | tuple[Refusal, str]) -> CommitOutcome:
        if not isinstance(matcher, VersionedMatcher):
            return CommitOutcome(None, *matcher)
        try:
            result = matcher.commit(entry.from_ordinal, entry.tokens)
            violation = matcher.violation
            if result.violation is not None and violation is not None:
                self._tell(lambda observer: observer.schema_violated(entry.request_id, violation))
            return CommitOutcome(result)
        except GrammarProtocolError as refused:
            return CommitOutcome(None, refused.code, str(refused))
        except Exception as error:  # xgrammar failed: report it on this entry only
            return CommitOutcome(None, Refusal.INTERNAL, f"{entry.request_id}: {type(error).__name__}: {error}")

    def _complete_fences(self, request_ids: set[str]) -> None:
        """Answer, in every fence in progress, the entries of ``request_ids`` that a commit just let through.

        With delayed sampling the executor's fence is usually waiting when the scheduler's commit arrives: its rows
        are filled here, by the committing thread, right after the commit, and the fence's own thread wakes to find
        nothing left to compute. The masks no longer wait for that thread to be scheduled on cores the forward is
        using (in bench/grammar.py runs the fill call's p50, fence wait included, was 2.4-3.0 ms against 3.0-3.3 ms
        before; throughput did not move beyond the noise).
        C3 holds as in any poll: each row is filled under its matcher's lock at exactly the ordinal it names.
        """
        with self._lock:
            fences = list(self._fences)
        for fence in fences:
            fence.complete(request_ids)

    # ---------------------------------------------------------------- masks

    def poll_masks(self, entries: Sequence[MaskEntry]) -> list[MaskOutcome]:
        """Answer each entry from the state it names, without waiting: BEHIND where the matcher is not there yet."""
        out, starts = mask_buffer(entries, self._compiler.words_per_row)  # [N, W]
        answers = self.poll_masks_into(entries, out, starts)
        refusals = {i: answer for i, answer in enumerate(answers) if answer is not None}
        return mask_outcomes(entries, out, starts, refusals)

    def poll_masks_into(
        self, entries: Sequence[MaskEntry], out: torch.Tensor, starts: Sequence[int]
    ) -> list[tuple[Refusal, str] | None]:
        """Write each entry's rows into ``out`` [N, W] from row ``starts[i]``, without waiting.

        Per entry None (rows written) or its refusal, BEHIND where the matcher is not there yet. Single-row entries
        are filled together by one xgrammar call (:func:`fill_mask_rows`) straight into ``out``; draft entries one
        by one. Every entry is still answered on its own: a refused one leaves its rows untouched.
        """
        answers: list[tuple[Refusal, str] | None] = [None] * len(entries)
        singles: list[tuple[int, VersionedMatcher]] = []
        found = self._lookup_many([entry.request_id for entry in entries])
        for i, (entry, matcher) in enumerate(zip(entries, found, strict=True)):
            if not isinstance(matcher, VersionedMatcher):
                answers[i] = matcher
            elif entry.draft is None:
                singles.append((i, matcher))
            else:
                rows = out[starts[i] : starts[i] + entry.num_rows]  # [R, W] view: the tree's rows
                answers[i] = _answered(entry, partial(matcher.fill_draft_masks, entry.ordinal, entry.draft, rows))
        if singles:
            for (i, _), answer in zip(singles, self._fill_singles(entries, singles, out, starts), strict=True):
                answers[i] = answer
        return answers

    def behind(self, entries: Sequence[MaskEntry]) -> list[bool]:
        """Per entry: its matcher is open and active but has not reached the entry's ordinal yet.

        Cheap (no xgrammar, no message) and only advisory: the fence uses it to skip polling entries that could
        only answer BEHIND. It reads ordinals without the matchers' locks; a commit landing right after the read
        has bumped the generation the fence waits on, so the fence polls again at once and nothing is missed.
        """
        with self._lock:
            matchers = [self._open.get(entry.request_id) for entry in entries]
        return [m is not None and m.is_behind(e.ordinal) for m, e in zip(matchers, entries, strict=True)]

    def wait_message(self, entry: MaskEntry) -> str:
        """What a mask entry is waiting for, for the message of a fence that gave up on it."""
        with self._lock:
            matcher = self._open.get(entry.request_id)
        here = "released" if matcher is None else f"at ordinal {matcher.ordinal}"
        return (
            f"grammar of {entry.request_id}: mask for ordinal {entry.ordinal} requested, the grammar is {here} "
            "(the commit reaching it has not arrived)"
        )

    def fill_masks(self, entries: Sequence[MaskEntry], timeout_s: float) -> list[MaskOutcome]:
        """Fenced masks (C3) as per-entry outcomes (each entry's rows in a fresh buffer)."""
        out, starts = mask_buffer(entries, self._compiler.words_per_row)  # [N, W]
        return mask_outcomes(entries, out, starts, self.fill_masks_into(entries, timeout_s, out, starts))

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], timeout_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        """Fenced masks (C3) written into ``out`` [N, W], entry i's rows from row ``starts[i]``.

        Entries whose matcher is behind wait for its commit, at most ``timeout_s``. Returns the refused entries (an
        entry still behind at the deadline: BEHIND_DEADLINE); every other entry's rows were written. The caller
        owns ``out`` (the executor passes its step bitmask, so masks land where the sampler reads them).
        """
        return self.start_masks(entries, timeout_s, out, starts).result()

    def start_masks(
        self, entries: Sequence[MaskEntry], timeout_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> FencedMasks:
        """:meth:`fill_masks_into` in two halves: the fence opens now, :meth:`FencedMasks.result` answers it later.

        Nothing is computed here. While the fence is open, each commit that lets one of its entries through fills
        that entry's rows itself (:meth:`_complete_fences`). An in-process executor opens the fence before its
        forward and, with delayed sampling, finds the rows written when the forward is done: no thread of its own
        waits at the fence. The deadline counts from now.
        """
        return FencedMasks(self, MaskFence(self, entries, timeout_s, out, starts))

    def wait_for_change(self, seen_generation: int, timeout_s: float) -> bool:
        """Block until a commit or release happened after ``seen_generation`` was read, or the timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._generation != seen_generation, timeout=max(0.0, timeout_s))

    def _fill_singles(
        self,
        entries: Sequence[MaskEntry],
        singles: list[tuple[int, VersionedMatcher]],
        out: torch.Tensor,
        starts: Sequence[int],
    ) -> list[tuple[Refusal, str] | None]:
        try:
            return fill_mask_rows([(m, entries[i].ordinal) for i, m in singles], out, [starts[i] for i, _ in singles])
        except Exception:  # xgrammar failed on some row: find which, answering each entry on its own
            return [_answered(entries[i], partial(m.fill_mask, entries[i].ordinal, out[starts[i]])) for i, m in singles]

    # ---------------------------------------------------------------- release

    def release(self, request_ids: Sequence[str]) -> list[Refusal | None]:
        """Release matchers; per id None (released now), RELEASED (already) or UNKNOWN. Wakes waiting fences."""
        try:
            return [self._release_one(request_id) for request_id in request_ids]
        finally:
            self._bump()

    def _release_one(self, request_id: str) -> Refusal | None:
        with self._lock:
            matcher = self._open.pop(request_id, None)
            if matcher is None:
                return Refusal.RELEASED if request_id in self._released else Refusal.UNKNOWN
            self._sessions.disown(request_id)
            self._released[request_id] = None
            while len(self._released) > self._released_memory:
                self._released.popitem(last=False)
        matcher.release()  # a commit or mask already holding the matcher finishes first, later ones are refused
        return None

    # ---------------------------------------------------------------- internals

    def _tell(self, event: Callable[[EnforcementObserver], None]) -> None:
        """Report to every observer; one that fails is logged, never allowed to fail the grammar call."""
        for observer in self._observers:
            try:
                event(observer)
            except Exception:
                log.exception("grammar observer %r failed", observer)

    def _lookup(self, request_id: str) -> VersionedMatcher:
        with self._lock:
            matcher = self._open.get(request_id)
            if matcher is not None:
                return matcher
            if request_id in self._released:
                raise GrammarProtocolError(Refusal.RELEASED, f"{request_id}: the grammar was released")
        raise GrammarProtocolError(Refusal.UNKNOWN, f"{request_id}: no grammar is open under this id")

    def _lookup_many(self, request_ids: Sequence[str]) -> list[VersionedMatcher | tuple[Refusal, str]]:
        """Each id's matcher, or the refusal for an id with none; one lock round for the whole batch."""
        with self._lock:
            found = [self._open.get(request_id) for request_id in request_ids]
        return [m if m is not None else self._missing(rid) for m, rid in zip(found, request_ids, strict=True)]

    def _missing(self, request_id: str) -> tuple[Refusal, str]:
        try:
            self._lookup(request_id)
        except GrammarProtocolError as refused:
            return refused.code, str(refused)
        return Refusal.INTERNAL, f"{request_id}: opened while its batch was read; ask again"

    def _add_fence(self, fence: MaskFence) -> None:
        with self._lock:
            self._fences.add(fence)

    def _remove_fence(self, fence: MaskFence) -> None:
        with self._lock:
            self._fences.discard(fence)

    def _count_waiting(self, delta: int) -> None:
        with self._lock:
            self._waiting += delta

    def _bump(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()
        if self._on_change is not None:
            self._on_change()


def _answered(entry: MaskEntry, compute: Callable[[], object]) -> tuple[Refusal, str] | None:
    """None once ``compute`` wrote the entry's rows; a refusal or an xgrammar failure is this entry's answer only."""
    try:
        compute()
        return None
    except GrammarProtocolError as refused:
        return refused.code, str(refused)
    except Exception as error:
        return Refusal.INTERNAL, f"{entry.request_id}: {type(error).__name__}: {error}"


class FencedMasks:
    """A mask batch whose fence is open (:meth:`GrammarRegistry.start_masks`); answered once, by :meth:`result`.

    :meth:`close` closes it unanswered (the step that wanted the masks failed): a fence left open would be polled by
    every later commit and would keep writing into a buffer nobody reads.
    """

    def __init__(self, registry: GrammarRegistry, fence: MaskFence) -> None:
        self._registry = registry
        self._fence = fence
        fence.open()

    def result(self) -> MaskRefusals:
        """Wait until no entry is behind or the deadline passed; the refused entries (the others were written)."""
        fence, registry = self._fence, self._registry
        try:
            while True:
                seen = registry.generation  # read before polling, so a commit during the poll is never missed
                if fence.poll() or fence.remaining_s() <= 0:
                    return fence.refusals()
                registry.wait_for_change(seen, fence.remaining_s())
        finally:
            fence.close()

    def close(self) -> None:
        self._fence.close()

    @property
    def written_after_s(self) -> float | None:
        """Seconds from the fence's opening until every entry was answered (None while one is still waiting)."""
        return self._fence.answered_after_s


class MaskFence:
    """One fenced mask batch in progress (C3): polled until no entry is behind or the deadline passes.

    Masks are written into the caller's buffer ``out`` [N, W] (entry i's rows from row ``starts[i]``) as entries
    become ready. Whoever drives the fence decides how to wait between polls (a condition variable, an asyncio
    event); it only re-polls the entries that are still behind, and turns those left at the deadline into
    BEHIND_DEADLINE. Use it as a context manager: while it is open, a commit that lets entries through fills them
    itself (:meth:`complete`), and entries behind count in :attr:`GrammarRegistry.num_waiting`. Once
    :meth:`refusals` answered or the fence exited, nothing writes into ``out`` any more.
    """

    def __init__(
        self,
        registry: GrammarRegistry,
        entries: Sequence[MaskEntry],
        timeout_s: float,
        out: torch.Tensor,
        starts: Sequence[int],
    ) -> None:
        if len(starts) != len(entries):
            raise ValueError(f"{len(entries)} mask entries but {len(starts)} start rows")
        self._registry = registry
        self._entries = list(entries)
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._out = out
        self._starts = list(starts)
        self._refusals: MaskRefusals = {}
        self._pending = list(range(len(self._entries)))
        self._counted = 0  # how many of this fence's entries the registry counts as waiting
        # Polls come from the fence's driver and from commits (GrammarRegistry._complete_fences); once the fence is
        # closed nothing writes into ``out`` any more: its owner may be sampling from it.
        self._lock = threading.Lock()
        self._closed = False
        self._created = time.monotonic()
        self._answered_after_s: float | None = None if self._pending else 0.0

    def __enter__(self) -> MaskFence:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Register with the registry: from now on its commits fill this fence's entries (:meth:`complete`)."""
        self._registry._add_fence(self)

    def close(self) -> None:
        """Nothing writes into ``out`` any more, and the registry forgets the fence. Closing twice is harmless."""
        with self._lock:
            self._closed = True
            self._set_counted(0)
        self._registry._remove_fence(self)

    @property
    def answered_after_s(self) -> float | None:
        """Seconds from the fence's creation until no entry was pending any more; None while one is."""
        return self._answered_after_s

    def poll(self) -> bool:
        """Answer every pending entry that is not behind any more; True when none is left behind.

        Entries still behind are seen by a cheap check (:meth:`GrammarRegistry.behind`) and not polled: with
        overlap most of a step's mask requests arrive before their commit, and computing nothing for them keeps
        the fence's cost at one real poll per commit.
        """
        with self._lock:
            if not self._closed:
                self._poll(self._pending)
            return not self._pending

    def complete(self, request_ids: set[str]) -> None:
        """Poll only the pending entries of ``request_ids``: those a commit just moved (called by the commit)."""
        with self._lock:
            if not self._closed:
                self._poll([i for i in self._pending if self._entries[i].request_id in request_ids])

    def _poll(self, candidates: list[int]) -> None:
        behind = self._registry.behind([self._entries[i] for i in candidates])
        ready = [i for i, late in zip(candidates, behind, strict=True) if not late]
        if ready:
            self._answer(ready)
        self._set_counted(len(self._pending))

    def _answer(self, ready: list[int]) -> None:
        entries = [self._entries[i] for i in ready]
        answers = self._registry.poll_masks_into(entries, self._out, [self._starts[i] for i in ready])
        answered: set[int] = set()
        for i, answer in zip(ready, answers, strict=True):
            if answer is not None and answer[0] is Refusal.BEHIND:
                # Ordinals only grow and finished states never return to ACTIVE, so a polled entry is BEHIND only
                # if its id was released and opened anew in between; it stays pending like the others.
                continue
            answered.add(i)
            if answer is not None:
                self._refusals[i] = answer
        self._pending = [i for i in self._pending if i not in answered]
        if not self._pending and self._answered_after_s is None:
            self._answered_after_s = time.monotonic() - self._created

    def ready(self) -> bool:
        """Cheaply: would :meth:`poll` have anything to compute now? (A driver may skip a costly poll hop.)"""
        return not all(self._registry.behind([self._entries[i] for i in self._pending]))

    def remaining_s(self) -> float:
        return self._deadline - time.monotonic()

    def refusals(self) -> MaskRefusals:
        """The refused entries by index; entries still behind fail with BEHIND_DEADLINE. The others were written.

        The answer is final: the fence closes, and no later commit writes into ``out``."""
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        refusals = dict(self._refusals)
        for i in pending:
            refusals[i] = (
                Refusal.BEHIND_DEADLINE,
                f"{self._registry.wait_message(self._entries[i])}; no such commit came within the fence deadline of "
                f"{self._timeout_s * 1000:.0f} ms",
            )
        return refusals

    def _set_counted(self, waiting: int) -> None:
        if waiting != self._counted:
            self._registry._count_waiting(waiting - self._counted)
            self._counted = waiting
