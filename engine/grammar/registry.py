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

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.grammar.compiler import CompiledConstraint, ConstraintCompiler
from engine.grammar.constraint import Constraint
from engine.grammar.matcher import (
    CommitResult,
    DraftTree,
    GrammarProtocolError,
    Refusal,
    VersionedMatcher,
    fill_mask_rows,
)

# Released ids remembered so that a late call is answered RELEASED rather than UNKNOWN; bounded (C9: nothing
# per request may outlive the service's baseline by more than this fixed-size memory).
DEFAULT_RELEASED_MEMORY = 65536


@dataclass(frozen=True)
class CommitEntry:
    """Tokens committed for one request in one step, starting from ordinal ``from_ordinal``."""

    request_id: str
    from_ordinal: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class CommitOutcome:
    """Either ``result`` (the commit happened) or ``refusal`` with a message (nothing changed)."""

    result: CommitResult | None
    refusal: Refusal | None = None
    message: str = ""


@dataclass(frozen=True)
class MaskEntry:
    """A mask request: one row at ``ordinal``, or the rows of ``draft`` over the state at ``ordinal``."""

    request_id: str
    ordinal: int
    draft: DraftTree | None = None

    @property
    def num_rows(self) -> int:
        return 1 if self.draft is None else self.draft.num_rows


@dataclass(frozen=True)
class MaskRows:
    """Computed masks of one entry: ``words`` in xgrammar layout, and which rows allow every token."""

    words: torch.Tensor  # [R, W] int32: bit j of word i set <=> token 32*i + j allowed
    full: tuple[bool, ...]  # per row: every bit set


@dataclass(frozen=True)
class MaskOutcome:
    """Either ``rows`` or ``refusal`` with a message. BEHIND is transient: the fence keeps waiting on it."""

    rows: MaskRows | None
    refusal: Refusal | None = None
    message: str = ""


class GrammarRegistry:
    """All open matchers of one grammar service, keyed by request id.

    Thread-safe. ``on_change`` (if given) is called after every commit batch and release, from the thread that
    made the change, so that an asyncio fence can wake up; it must not block.
    """

    def __init__(
        self,
        compiler: ConstraintCompiler,
        *,
        released_memory: int = DEFAULT_RELEASED_MEMORY,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._compiler = compiler
        self._released_memory = released_memory
        self._on_change = on_change
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0  # bumped by every commit batch and release; fences wait for it to move
        self._open: dict[str, VersionedMatcher] = {}
        self._waiting = 0  # mask entries now waiting at a fence for their commit
        self._released: OrderedDict[str, None] = OrderedDict()

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

    # ---------------------------------------------------------------- open

    def check_can_open(self, request_id: str) -> None:
        """Refuse an id before compiling for it: empty (INVALID_ARGUMENT) or open already (ALREADY_OPEN)."""
        if not request_id:
            raise GrammarProtocolError(Refusal.INVALID_ARGUMENT, "request_id must not be empty")
        with self._lock:
            if request_id in self._open:
                raise GrammarProtocolError(Refusal.ALREADY_OPEN, f"{request_id}: a grammar is already open")

    def open(self, request_id: str, constraint: Constraint, timeout_s: float) -> VersionedMatcher:
        """Compile ``constraint`` (cached, at most ``timeout_s``) and open a matcher at ordinal 0 under the id.

        Raises InvalidGrammarError, GrammarTimeoutError, or GrammarProtocolError (empty or duplicate id).
        """
        self.check_can_open(request_id)
        return self.attach(request_id, self._compiler.compile(constraint, timeout_s))

    def attach(self, request_id: str, compiled: CompiledConstraint) -> VersionedMatcher:
        """Open a matcher for an already compiled constraint (the id is checked again: opens may race)."""
        self.check_can_open(request_id)
        matcher = VersionedMatcher(compiled, name=f"grammar of {request_id}")
        with self._lock:
            if request_id in self._open:
                raise GrammarProtocolError(Refusal.ALREADY_OPEN, f"{request_id}: a grammar is already open")
            self._open[request_id] = matcher
            self._released.pop(request_id, None)  # the id names a new grammar now
        return matcher

    # ---------------------------------------------------------------- commit

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        """Apply one step's commits; each entry is answered on its own, a bad one never spoils the others."""
        try:
            return [self._commit_one(entry) for entry in entries]
        finally:
            self._bump()

    def _commit_one(self, entry: CommitEntry) -> CommitOutcome:
        try:
            return CommitOutcome(self._lookup(entry.request_id).commit(entry.from_ordinal, entry.tokens))
        except GrammarProtocolError as refused:
            return CommitOutcome(None, refused.code, str(refused))
        except Exception as error:  # xgrammar failed: report it on this entry only
            return CommitOutcome(None, Refusal.INTERNAL, f"{entry.request_id}: {type(error).__name__}: {error}")

    # ---------------------------------------------------------------- masks

    def poll_masks(self, entries: Sequence[MaskEntry]) -> list[MaskOutcome]:
        """Answer each entry from the state it names, without waiting: BEHIND where the matcher is not there yet.

        Single-row entries are filled together by one xgrammar call (:func:`fill_mask_rows`) into one buffer;
        draft entries one by one. Every entry is still answered on its own.
        """
        outcomes: list[MaskOutcome | None] = [None] * len(entries)
        singles: list[tuple[int, VersionedMatcher]] = []
        for i, entry in enumerate(entries):
            try:
                matcher = self._lookup(entry.request_id)
            except GrammarProtocolError as refused:
                outcomes[i] = MaskOutcome(None, refused.code, str(refused))
                continue
            if entry.draft is None:
                singles.append((i, matcher))
            else:
                outcomes[i] = self._draft_one(entry, matcher)
        if singles:
            for (i, _), outcome in zip(singles, self._fill_singles(entries, singles), strict=True):
                outcomes[i] = outcome
        return [o if o is not None else MaskOutcome(None, Refusal.INTERNAL, "not answered") for o in outcomes]

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
        """Fenced masks (C3): entries whose matcher is behind wait for its commit, at most ``timeout_s``."""
        with MaskFence(self, entries, timeout_s) as fence:
            while True:
                seen = self.generation  # read before polling, so a commit during the poll is never missed
                if fence.poll() or fence.remaining_s() <= 0:
                    return fence.outcomes()
                self.wait_for_change(seen, fence.remaining_s())

    def wait_for_change(self, seen_generation: int, timeout_s: float) -> bool:
        """Block until a commit or release happened after ``seen_generation`` was read, or the timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._generation != seen_generation, timeout=max(0.0, timeout_s))

    def _fill_singles(
        self, entries: Sequence[MaskEntry], singles: list[tuple[int, VersionedMatcher]]
    ) -> list[MaskOutcome]:
        words = torch.zeros((len(singles), self._compiler.words_per_row), dtype=torch.int32)  # [S, W]
        try:
            answers = fill_mask_rows([(matcher, entries[i].ordinal) for i, matcher in singles], words)
        except Exception:  # xgrammar failed on some row: find which, answering each entry on its own
            return [self._mask_one(entries[i], matcher) for i, matcher in singles]
        full = (words == -1).all(dim=1).tolist()  # [S]: rows that allow every token travel as a flag
        rows = words.split(1)  # S views [1, W], made in one call
        return [
            MaskOutcome(MaskRows(row, (row_full,))) if answer is None else MaskOutcome(None, *answer)
            for row, row_full, answer in zip(rows, full, answers, strict=True)
        ]

    def _mask_one(self, entry: MaskEntry, matcher: VersionedMatcher) -> MaskOutcome:
        def one_row() -> MaskRows:
            words = torch.empty((1, matcher.words_per_row), dtype=torch.int32)  # [1, W]
            return MaskRows(words, (matcher.fill_mask(entry.ordinal, words[0]),))

        return _answered(entry, one_row)

    def _draft_one(self, entry: MaskEntry, matcher: VersionedMatcher) -> MaskOutcome:
        def tree_rows() -> MaskRows:
            assert entry.draft is not None
            words = torch.empty((entry.num_rows, matcher.words_per_row), dtype=torch.int32)  # [R, W]
            return MaskRows(words, matcher.fill_draft_masks(entry.ordinal, entry.draft, words))

        return _answered(entry, tree_rows)

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
            self._released[request_id] = None
            while len(self._released) > self._released_memory:
                self._released.popitem(last=False)
        matcher.release()  # a commit or mask already holding the matcher finishes first, later ones are refused
        return None

    # ---------------------------------------------------------------- internals

    def _lookup(self, request_id: str) -> VersionedMatcher:
        with self._lock:
            matcher = self._open.get(request_id)
            if matcher is not None:
                return matcher
            if request_id in self._released:
                raise GrammarProtocolError(Refusal.RELEASED, f"{request_id}: the grammar was released")
        raise GrammarProtocolError(Refusal.UNKNOWN, f"{request_id}: no grammar is open under this id")

    def _count_waiting(self, delta: int) -> None:
        with self._lock:
            self._waiting += delta

    def _bump(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()
        if self._on_change is not None:
            self._on_change()


def _answered(entry: MaskEntry, compute: Callable[[], MaskRows]) -> MaskOutcome:
    """``compute``'s rows as the entry's answer; a refusal or an xgrammar failure is the answer of this entry only."""
    try:
        return MaskOutcome(compute())
    except GrammarProtocolError as refused:
        return MaskOutcome(None, refused.code, str(refused))
    except Exception as error:
        return MaskOutcome(None, Refusal.INTERNAL, f"{entry.request_id}: {type(error).__name__}: {error}")


class MaskFence:
    """One fenced mask batch in progress (C3): polled until no entry is behind or the deadline passes.

    Whoever drives it decides how to wait between polls (a condition variable, an asyncio event); it only
    re-polls the entries that are still behind, and turns those left at the deadline into BEHIND_DEADLINE.
    Use it as a context manager: entries behind count in :attr:`GrammarRegistry.num_waiting` until it exits.
    """

    def __init__(self, registry: GrammarRegistry, entries: Sequence[MaskEntry], timeout_s: float) -> None:
        self._registry = registry
        self._entries = list(entries)
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._outcomes: list[MaskOutcome | None] = [None] * len(self._entries)
        self._pending = list(range(len(self._entries)))
        self._counted = 0  # how many of this fence's entries the registry counts as waiting

    def __enter__(self) -> MaskFence:
        return self

    def __exit__(self, *exc: object) -> None:
        self._set_counted(0)

    def poll(self) -> bool:
        """Answer every pending entry that is not behind any more; True when none is left behind.

        Entries still behind are seen by a cheap check (:meth:`GrammarRegistry.behind`) and not polled: with
        overlap most of a step's mask requests arrive before their commit, and computing nothing for them keeps
        the fence's cost at one real poll per commit.
        """
        behind = self._registry.behind([self._entries[i] for i in self._pending])
        ready = [i for i, late in zip(self._pending, behind, strict=True) if not late]
        if ready:
            answers = self._registry.poll_masks([self._entries[i] for i in ready])
            for i, outcome in zip(ready, answers, strict=True):
                self._outcomes[i] = outcome
        # Ordinals only grow and finished states never return to ACTIVE, so a polled entry is BEHIND only if its id
        # was released and opened anew in between; it stays pending like the others.
        self._pending = [i for i in self._pending if self._outcomes[i] is None or self._is_behind(i)]
        self._set_counted(len(self._pending))
        return not self._pending

    def ready(self) -> bool:
        """Cheaply: would :meth:`poll` have anything to compute now? (A driver may skip a costly poll hop.)"""
        return not all(self._registry.behind([self._entries[i] for i in self._pending]))

    def remaining_s(self) -> float:
        return self._deadline - time.monotonic()

    def outcomes(self) -> list[MaskOutcome]:
        """The answers, in entry order; entries still behind fail with BEHIND_DEADLINE."""
        return [self._final(entry, outcome) for entry, outcome in zip(self._entries, self._outcomes, strict=True)]

    def _set_counted(self, waiting: int) -> None:
        if waiting != self._counted:
            self._registry._count_waiting(waiting - self._counted)
            self._counted = waiting

    def _is_behind(self, i: int) -> bool:
        outcome = self._outcomes[i]
        return outcome is not None and outcome.refusal is Refusal.BEHIND

    def _final(self, entry: MaskEntry, outcome: MaskOutcome | None) -> MaskOutcome:
        if outcome is not None and outcome.refusal is not Refusal.BEHIND:
            return outcome
        return MaskOutcome(
            None,
            Refusal.BEHIND_DEADLINE,
            f"{self._registry.wait_message(entry)}; no such commit came within the fence deadline of "
            f"{self._timeout_s * 1000:.0f} ms",
        )
