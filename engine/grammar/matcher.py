"""One constrained request's grammar state, versioned by its ordinal (contracts C2, C3, C5, C6, C13).

A :class:`VersionedMatcher` wraps one xgrammar ``GrammarMatcher`` and counts the tokens committed to it: its
*ordinal*. Every call names the ordinal it is about, and the matcher refuses any call about another one, so a
replayed or skipped commit and a mask for the wrong version are caught where they happen instead of
surfacing steps later as "tokens not accepted" (a stale mask let the sampler pick a token the grammar refuses).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import tvm_ffi
import xgrammar as xgr

from engine.constraint import Constraint
from engine.grammar.compiler import CompiledConstraint
from engine.grammar.output_checker import OutputChecker
from engine.grammar.violation import Violation
from engine.grammar_calls import CommitResult, DraftTree, GrammarProtocolError, Refusal, invalid_argument, words_per_row


class MatcherState(enum.Enum):
    """Where a matcher is in its life. Only ACTIVE accepts tokens and answers masks."""

    ACTIVE = "active"
    TERMINATED = "terminated"  # accepted a stop token: the output is complete
    REJECTED = "rejected"  # refused a committed token: the request must end with a grammar abort (C13)
    RELEASED = "released"


@dataclass(frozen=True)
class TokenCalls:
    """xgrammar's per-token matcher calls, made with the GIL held. Each takes the matcher's FFI handle first.

    xgrammar's methods go through tvm_ffi, which releases the GIL around every call. For a call of a microsecond or
    two that is a loss whenever another thread wants the GIL, as the forward does between its ops: each release
    hands the GIL over, and each return waits for it to come back. Feeding a step's tokens cost two such handoffs per
    row, and the forward running beside it paid for them. In paired serving runs (the bench/grammar.py workload, 32
    streams) the constrained forward's extra time over the unconstrained one was 8-15% with the release and 7-10%
    without (3 runs of 4). A whole batch of masks is a long call: it keeps releasing the GIL, so that the forward can
    run meanwhile (holding the GIL there too measured worse).
    """

    accept_token: tvm_ffi.Function  # (handle, token, debug_print) -> accepted
    is_terminated: tvm_ffi.Function  # (handle) -> accepted a stop token that ends the grammar

    @classmethod
    def holding_gil(cls) -> TokenCalls:
        info = xgr.base._core.GrammarMatcher.__tvm_ffi_type_info__  # type: ignore[attr-defined]  # tvm_ffi reflection
        methods = {method.name: method.func for method in info.methods}
        return cls(_holding_gil(methods["accept_token"]), _holding_gil(methods["is_terminated"]))


def _holding_gil(func: tvm_ffi.Function) -> tvm_ffi.Function:
    """A wrapper of our own around ``func`` that keeps the GIL during the call (xgrammar's own keeps releasing it)."""
    own = tvm_ffi.convert([func])[0]  # a new Python wrapper of the same native function
    own.release_gil = False
    return own


class VersionedMatcher:
    """The grammar state of one constrained request at its ordinal (the number of tokens committed to it).

    Contracts enforced here:

    * C2: :meth:`commit` must start from the current ordinal; a replay (older) or gap (newer) is refused.
    * C3: :meth:`fill_mask` / :meth:`fill_draft_masks` answer only for the current ordinal; another one is
      refused (the registry's fence turns "not reached yet" into a bounded wait).
    * C5: draft-tree masks are computed by a traversal that rolls back every token it tries.
    * C6: tokens after the one that terminates the grammar are reported as not accepted and never fed.
    * C13: a refused token finishes the matcher; the result names it, the caller aborts the request. In checked
      mode a token the grammar accepts but whose output violates the JSON schema (:class:`OutputChecker`: a value
      that closed, or the whole output at the stop token) is refused the same way, with the violation.

    A lock serialises commit, masks and release, so a mask is never computed from a half-applied commit.
    """

    def __init__(self, compiled: CompiledConstraint, name: str = "", calls: TokenCalls | None = None) -> None:
        """``calls``: how tokens are fed (the registry shares one for all its matchers; None builds one)."""
        self._compiled = compiled
        # Created with terminate_without_stop_token False (the default): only accepting a stop token terminates it.
        self._matcher = xgr.GrammarMatcher(compiled.grammar, terminate_without_stop_token=False)
        self._stop_tokens = frozenset(self._matcher.stop_token_ids)
        self._handle = self._matcher._handle  # the native matcher, for the per-token calls
        self._calls = calls if calls is not None else TokenCalls.holding_gil()
        self._name = name or "matcher"
        self._vocab_size = compiled.vocab_size
        self._lock = threading.Lock()
        self._ordinal = 0
        self._state = MatcherState.ACTIVE
        self._rejected: tuple[int, int] | None = None  # (token, ordinal) of the refusal, for messages
        self._checker = OutputChecker(compiled.check) if compiled.check is not None else None
        self._violation: Violation | None = None

    @property
    def constraint(self) -> Constraint:
        return self._compiled.constraint

    @property
    def ordinal(self) -> int:
        return self._ordinal

    @property
    def state(self) -> MatcherState:
        return self._state

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def violation(self) -> Violation | None:
        """Checked mode: the violation of the JSON schema the matcher refused a token for, if any."""
        return self._violation

    @property
    def words_per_row(self) -> int:
        return words_per_row(self._vocab_size)

    def is_behind(self, at_ordinal: int) -> bool:
        """Active and not at ``at_ordinal`` yet: a mask for it must wait. Read without the lock (advisory only)."""
        return self._state is MatcherState.ACTIVE and self._ordinal < at_ordinal

    def commit(self, from_ordinal: int, tokens: Sequence[int]) -> CommitResult:
        """Feed ``tokens``, the output committed after ordinal ``from_ordinal``, one by one.

        Feeding stops at the first token that terminates the grammar (later ones are not accepted, C6) or that
        the grammar refuses (``rejected_token``; the matcher is finished, C13). A terminated matcher answers a
        commit at its ordinal with nothing accepted. Raises :class:`GrammarProtocolError` if ``from_ordinal``
        is not the current ordinal, or the matcher is released or has refused a token before.
        """
        with self._lock:
            if from_ordinal != self._ordinal or self._state is not MatcherState.ACTIVE:
                self._check_commit(from_ordinal)  # not the common case: refused, or a terminated matcher
            return self._feed(tokens)

    def fill_mask(self, at_ordinal: int, out_row: torch.Tensor) -> bool:
        """Write the allowed next tokens at ``at_ordinal`` into ``out_row`` (int32 CPU [W], xgrammar layout).

        Returns True when the row allows every token (all bits set). Raises :class:`GrammarProtocolError` unless
        the matcher is ACTIVE at exactly ``at_ordinal`` (code BEHIND when it has not reached it yet).
        """
        _check_buffer(out_row, (self.words_per_row,))
        with self._lock:
            self._check_mask(at_ordinal)
            need_apply = self._matcher.fill_next_token_bitmask(out_row)
        if not need_apply:  # xgrammar's own "everything allowed": make the row say so bit for bit
            out_row.fill_(-1)
            return True
        return bool((out_row == -1).all())

    def fill_draft_masks(self, at_ordinal: int, tree: DraftTree, out: torch.Tensor) -> tuple[bool, ...]:
        """Masks for every node of ``tree`` over the state at ``at_ordinal``, into ``out`` [tree.num_rows, W].

        Row 0 is the mask at ``at_ordinal``; row i + 1 the mask after the path to node i. A node the grammar
        refuses after its path, and everything under it, gets an all-zero row (no continuation exists), as
        does a node after a stop token. The committed state is left exactly as it was (C5). Returns, per row,
        whether it allows every token. Refuses like :meth:`fill_mask`.
        """
        _check_buffer(out, (tree.num_rows, self.words_per_row))
        bad = next((t for t in tree.tokens if t >= self._vocab_size), None)
        if bad is not None:
            raise invalid_argument(f"{self._name}: draft token {bad} is outside the vocabulary [0, {self._vocab_size})")
        next_token, next_sibling, tokens = tree.links()  # [N+1] each
        with self._lock:
            self._check_mask(at_ordinal)
            out.zero_()  # rows of nodes the traversal never reaches stay "nothing allowed"
            self._matcher.traverse_draft_tree(next_token, next_sibling, tokens, out)
        full_rows = (out == -1).all(dim=1)  # [R]
        return tuple(bool(full) for full in full_rows.tolist())

    def release(self) -> None:
        """Finish the matcher for good: every later call is refused with RELEASED."""
        with self._lock:
            self._state = MatcherState.RELEASED

    # ---------------------------------------------------------------- internals

    def _check_commit(self, from_ordinal: int) -> None:
        here = self._ordinal
        if (
            from_ordinal == here
            and self._state is not MatcherState.RELEASED
            and self._state is not MatcherState.REJECTED
        ):
            return  # at the ordinal of a terminated matcher: answered with nothing fed (commit checks ACTIVE inline)
        if self._state is MatcherState.RELEASED:
            raise GrammarProtocolError(Refusal.RELEASED, f"{self._name}: commit after release")
        if from_ordinal < here:
            raise GrammarProtocolError(
                Refusal.STALE_ORDINAL,
                f"{self._name}: commit from ordinal {from_ordinal} refused, the grammar is at ordinal {here} "
                f"(tokens {from_ordinal}..{here - 1} were already committed: a replay)",
            )
        if from_ordinal > here:
            raise GrammarProtocolError(
                Refusal.FUTURE_ORDINAL,
                f"{self._name}: commit from ordinal {from_ordinal} refused, the grammar is at ordinal {here} "
                f"(tokens {here}..{from_ordinal - 1} were never committed: a gap)",
            )
        if self._state is MatcherState.REJECTED:
            raise GrammarProtocolError(Refusal.REJECTED, f"{self._name}: {self._rejection()}; it accepts nothing more")

    def _feed(self, tokens: Sequence[int]) -> CommitResult:
        accepted = 0
        rejected: int | None = None
        handle, accept, is_terminated = self._handle, self._calls.accept_token, self._calls.is_terminated
        checker = self._checker
        if self._state is MatcherState.ACTIVE:
            for token in tokens:
                if not (0 <= token < self._vocab_size and accept(handle, token, False)):
                    rejected = self._reject(token, self._ordinal + accepted, None)
                    break
                if token in self._stop_tokens:
                    if is_terminated(handle):
                        violation = checker.finish() if checker is not None else None
                        if violation is not None:  # the stop token would end an output that breaks the schema
                            rejected = self._reject(token, self._ordinal + accepted, violation)
                            break
                        accepted += 1
                        self._state = MatcherState.TERMINATED
                        break  # C6: whatever follows the stop token is not fed
                elif checker is not None:
                    violation = checker.feed(token)
                    if violation is not None:
                        rejected = self._reject(token, self._ordinal + accepted, violation)
                        break
                accepted += 1
        self._ordinal += accepted
        violation_text = self._violation.describe() if self._violation is not None and rejected is not None else None
        return CommitResult(accepted, self._state is MatcherState.TERMINATED, rejected, self._ordinal, violation_text)

    def _reject(self, token: int, ordinal: int, violation: Violation | None) -> int:
        """Finish the matcher on a refused token (C13); returns the token."""
        self._state = MatcherState.REJECTED
        self._rejected = (int(token), ordinal)
        self._violation = violation
        return int(token)

    def _check_mask(self, at_ordinal: int) -> None:
        refusal = self._mask_refusal(at_ordinal)
        if refusal is not None:
            raise GrammarProtocolError(*refusal)

    def _mask_refusal(self, at_ordinal: int) -> tuple[Refusal, str] | None:
        """Why no mask at ``at_ordinal`` can be computed now (code and message), or None. The caller holds the lock.

        Returned, not raised: with overlap most mask requests arrive before their commit, and a batch answers
        BEHIND for many rows every step.
        """
        here = self._ordinal
        if self._state is MatcherState.RELEASED:
            return Refusal.RELEASED, f"{self._name}: mask requested after release"
        if here > at_ordinal:
            return (
                Refusal.AHEAD,
                f"{self._name}: mask for ordinal {at_ordinal} refused, the grammar is already at ordinal {here}",
            )
        # Finished matchers never move again: waiting for a later ordinal would only burn the deadline.
        if self._state is MatcherState.REJECTED:
            return Refusal.REJECTED, f"{self._name}: {self._rejection()}; no mask exists"
        if self._state is MatcherState.TERMINATED:
            return Refusal.TERMINATED, f"{self._name}: the grammar terminated at ordinal {here}; no next token exists"
        if here < at_ordinal:
            return (
                Refusal.BEHIND,
                f"{self._name}: mask for ordinal {at_ordinal} requested, the grammar is at ordinal {here} "
                "(the commit reaching it has not arrived)",
            )
        return None

    def _rejection(self) -> str:
        token, ordinal = self._rejected if self._rejected is not None else (-1, -1)
        if self._violation is not None:
            return f"token {token} at ordinal {ordinal} was refused: {self._violation.describe()}"
        return f"the grammar refused token {token} at ordinal {ordinal}"


def fill_mask_rows(
    requests: Sequence[tuple[VersionedMatcher, int]], out: torch.Tensor, rows: Sequence[int] | None = None
) -> list[tuple[Refusal, str] | None]:
    """Row ``rows[i]`` of ``out`` [N, W] gets the mask of ``requests[i]`` = (matcher, ordinal), all in one call.

    The batched form of :meth:`VersionedMatcher.fill_mask`, for the registry's per-step batches: one xgrammar
    call fills every row, straight into the caller's buffer (the executor's step bitmask, the service's reply
    buffer), instead of a Python round per row. ``rows`` defaults to 0..len(requests)-1. Each answer is None
    (row filled) or the refusal (code, message) of that request, its row untouched. C3 holds as in the single
    form: every matcher's lock is held from the ordinal check until its row is filled, so a commit cannot slip in
    between. Locks are taken in one global order (by ``id``), so two batches naming the same matchers cannot
    deadlock. The matchers must share one vocabulary (one registry's do).
    """
    if not requests:
        return []
    targets = list(range(len(requests))) if rows is None else list(rows)
    _check_rows(out, requests[0][0].words_per_row, targets, len(requests))
    held = sorted({id(m): m for m, _ in requests}.values(), key=id)  # a request id twice in a batch: one lock
    for matcher in held:
        matcher._lock.acquire()
    try:
        # The common case (active, at the ordinal asked) is decided inline; anything else says why it is refused.
        answers = [
            None if m._ordinal == ordinal and m._state is MatcherState.ACTIVE else m._mask_refusal(ordinal)
            for m, ordinal in requests
        ]
        ready = [i for i, answer in enumerate(answers) if answer is None]
        if ready:
            # One thread: the forward this overlaps with already uses the cores, and xgrammar's pool costs more
            # than it saves at a few dozen rows.
            filler = xgr.BatchGrammarMatcher(max_threads=1)
            matchers = [requests[i][0]._matcher for i in ready]
            filler.batch_fill_next_token_bitmask(matchers, out, [targets[i] for i in ready])
    finally:
        for matcher in held:
            matcher._lock.release()
    return answers


def _check_buffer(out: torch.Tensor, shape: tuple[int, ...]) -> None:
    if out.dtype != torch.int32 or out.device.type != "cpu" or tuple(out.shape) != shape or not out.is_contiguous():
        raise invalid_argument(
            f"mask buffer must be a contiguous int32 CPU tensor of shape {list(shape)}, "
            f"got {out.dtype} {out.device} {list(out.shape)}"
        )


def _check_rows(out: torch.Tensor, width: int, rows: Sequence[int], expected: int) -> None:
    """``out`` is a mask buffer [N, width] and ``rows`` names ``expected`` distinct rows of it."""
    _check_buffer(out, (out.shape[0] if out.dim() == 2 else -1, width))
    if len(rows) != expected or len(set(rows)) != len(rows) or min(rows) < 0 or max(rows) >= out.shape[0]:
        raise invalid_argument(f"mask rows {list(rows)} must be {expected} distinct rows of a buffer of {out.shape[0]}")
