"""The grammar engine (engine/grammar): compiler, versioned matcher and registry with its fence.

Real xgrammar over the embedded model's tokenizer; no service. Each test names the contract it covers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
from engine.grammar import (
    CompiledConstraint,
    CompilerConfig,
    ConstraintCompiler,
    GrammarRegistry,
    MaskFence,
    MatcherState,
    VersionedMatcher,
)
from engine.grammar.json_schema_compiler import DEFAULT_JSON_MAX_WHITESPACE
from engine.grammar.matcher import TokenCalls, fill_mask_rows
from engine.grammar_calls import (
    CommitEntry,
    CommitResult,
    DraftTree,
    GrammarProtocolError,
    GrammarTimeoutError,
    InvalidGrammarError,
    MaskEntry,
    MaskOutcome,
    Refusal,
)
from engine.model.tokenizer import Tokenizer

SCHEMA = '{"type":"object","properties":{"name":{"type":"string"},"n":{"type":"integer"}},"required":["name","n"]}'
VALID_JSON = '{"name": "ab", "n": 12}'
WAIT_S = 10.0


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(embedded_model_dir)


@pytest.fixture(scope="module")
def schema(compiler: ConstraintCompiler) -> CompiledConstraint:
    return compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA), WAIT_S)


@pytest.fixture(scope="module")
def eos(tokenizer: Tokenizer) -> int:
    return min(tokenizer.eos_token_ids)


@pytest.fixture
def registry(compiler: ConstraintCompiler) -> GrammarRegistry:
    return GrammarRegistry(compiler)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def mask_at(matcher: VersionedMatcher, ordinal: int) -> torch.Tensor:
    row = torch.empty(matcher.words_per_row, dtype=torch.int32)  # [W]
    matcher.fill_mask(ordinal, row)
    return row


def fill_in_thread(registry: GrammarRegistry, entries: list[MaskEntry]) -> tuple[threading.Thread, list[MaskOutcome]]:
    """Run a fenced mask request on its own thread; its outcomes land in the returned list."""
    answers: list[MaskOutcome] = []
    thread = threading.Thread(target=lambda: answers.extend(registry.fill_masks(entries, WAIT_S)))
    thread.start()
    return thread, answers


def refusal_of(call: object) -> Refusal:
    assert isinstance(call, GrammarProtocolError), call
    return call.code


def refused(fn: object, *args: object) -> GrammarProtocolError:
    with pytest.raises(GrammarProtocolError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value


# ---------------------------------------------------------------- compile


def test_json_schema_accepts_valid_json_token_by_token(
    schema: CompiledConstraint, tokenizer: Tokenizer, eos: int
) -> None:
    matcher = VersionedMatcher(schema)
    tokens = ids(tokenizer, VALID_JSON)
    for ordinal, token in enumerate(tokens):
        assert allowed(mask_at(matcher, ordinal), token), f"mask at {ordinal} forbids the valid token {token}"
        assert not allowed(mask_at(matcher, ordinal), eos), "eos allowed before the object is complete"
        assert matcher.commit(ordinal, [token]) == CommitResult(1, False, None, ordinal + 1)
    final = mask_at(matcher, len(tokens))
    assert allowed(final, eos)
    assert matcher.commit(len(tokens), [eos]) == CommitResult(1, True, None, len(tokens) + 1)
    assert matcher.state is MatcherState.TERMINATED


def test_refused_token_is_reported_and_finishes_the_matcher(schema: CompiledConstraint, tokenizer: Tokenizer) -> None:
    """C13: the first refused token is named, the ones before it count, nothing after it is fed."""
    matcher = VersionedMatcher(schema)
    opening = ids(tokenizer, '{"')
    bad = ids(tokenizer, "x")[0]  # `{"x` cannot start a key of this schema
    result = matcher.commit(0, [*opening, bad, *opening])
    assert result == CommitResult(len(opening), False, bad, len(opening))
    assert matcher.state is MatcherState.REJECTED
    assert refused(matcher.commit, len(opening), opening).code is Refusal.REJECTED
    assert refused(mask_at, matcher, len(opening)).code is Refusal.REJECTED


def test_out_of_vocabulary_token_is_a_rejection_not_a_crash(schema: CompiledConstraint) -> None:
    matcher = VersionedMatcher(schema)
    assert matcher.commit(0, [schema.vocab_size + 5]).rejected_token == schema.vocab_size + 5
    assert VersionedMatcher(schema).commit(0, [-1]).rejected_token == -1


def test_termination_stops_feeding(schema: CompiledConstraint, tokenizer: Tokenizer, eos: int) -> None:
    """C6: tokens after the stop token are reported as not accepted and never fed; no mask exists after it."""
    matcher = VersionedMatcher(schema)
    tokens = ids(tokenizer, VALID_JSON)
    trailing = ids(tokenizer, " trailing")
    result = matcher.commit(0, [*tokens, eos, *trailing])
    assert result == CommitResult(len(tokens) + 1, True, None, len(tokens) + 1)
    # A commit at the terminated ordinal is answered without feeding anything.
    assert matcher.commit(result.new_ordinal, trailing) == CommitResult(0, True, None, result.new_ordinal)
    assert refused(mask_at, matcher, result.new_ordinal).code is Refusal.TERMINATED


def test_tokens_are_fed_holding_the_gil_and_xgrammar_keeps_its_own_setting(
    schema: CompiledConstraint, tokenizer: Tokenizer
) -> None:
    """Feeding a token is a call of a microsecond or two: releasing the GIL around it hands the GIL to the forward and
    back once per token (TokenCalls has the measurement). Fails if :meth:`TokenCalls.holding_gil` stops clearing
    ``release_gil`` on its own wrappers (the first asserts), or clears it on xgrammar's function objects instead,
    which every other xgrammar call in the process shares (the last one)."""
    methods = xgr.base._core.GrammarMatcher.__tvm_ffi_type_info__.methods
    before = {m.name: m.func.release_gil for m in methods}
    calls = TokenCalls.holding_gil()
    assert calls.accept_token.release_gil is False
    assert calls.is_terminated.release_gil is False
    matcher = VersionedMatcher(schema, calls=calls)
    tokens = ids(tokenizer, VALID_JSON)
    assert matcher.commit(0, tokens) == CommitResult(len(tokens), False, None, len(tokens))
    assert {m.name: m.func.release_gil for m in methods} == before


def test_commit_from_wrong_ordinal_is_refused(schema: CompiledConstraint, tokenizer: Tokenizer) -> None:
    """C2: a replay (stale or duplicate commit) and a gap are refused and change nothing."""
    matcher = VersionedMatcher(schema)
    tokens = ids(tokenizer, VALID_JSON)
    assert matcher.commit(0, tokens[:2]).new_ordinal == 2
    before = mask_at(matcher, 2)
    duplicate = refused(matcher.commit, 0, tokens[:2])
    assert duplicate.code is Refusal.STALE_ORDINAL and "replay" in str(duplicate)
    assert refused(matcher.commit, 1, tokens[1:3]).code is Refusal.STALE_ORDINAL
    gap = refused(matcher.commit, 3, tokens[3:4])
    assert gap.code is Refusal.FUTURE_ORDINAL and "gap" in str(gap)
    assert matcher.ordinal == 2
    assert torch.equal(mask_at(matcher, 2), before)
    assert matcher.commit(2, tokens[2:3]).new_ordinal == 3


def test_mask_at_wrong_ordinal_is_refused(schema: CompiledConstraint, tokenizer: Tokenizer) -> None:
    """C3 at the matcher: only the current ordinal is answered; past is AHEAD, future is BEHIND."""
    matcher = VersionedMatcher(schema)
    matcher.commit(0, ids(tokenizer, VALID_JSON)[:2])
    assert refused(mask_at, matcher, 1).code is Refusal.AHEAD
    assert refused(mask_at, matcher, 3).code is Refusal.BEHIND
    out = torch.empty(matcher.words_per_row + 1, dtype=torch.int32)
    assert refused(matcher.fill_mask, 2, out).code is Refusal.INVALID_ARGUMENT  # wrong buffer shape
    matcher.release()
    assert refused(mask_at, matcher, 2).code is Refusal.RELEASED
    assert refused(matcher.commit, 2, [1]).code is Refusal.RELEASED


def test_draft_tree_masks_match_a_real_walk_and_leave_state_unchanged(
    schema: CompiledConstraint, tokenizer: Tokenizer, eos: int
) -> None:
    """C5: every row equals the mask after committing that node's path; the committed state is untouched."""
    tokens = ids(tokenizer, VALID_JSON)
    matcher = VersionedMatcher(schema)
    matcher.commit(0, tokens[:3])
    before = mask_at(matcher, 3)
    bad = ids(tokenizer, "x")[0]
    # node 0..2: the valid continuation; node 3: a refused sibling of node 0; node 4: under the refused node.
    tree = DraftTree(tokens=(tokens[3], tokens[4], tokens[5], bad, tokens[4]), parents=(-1, 0, 1, -1, 3))
    out = torch.empty((tree.num_rows, matcher.words_per_row), dtype=torch.int32)  # [6, W]
    full = matcher.fill_draft_masks(3, tree, out)
    assert full == (False,) * tree.num_rows
    assert torch.equal(out[0], before)
    for depth in range(3):  # rows 1..3: the masks after committing tokens[3 .. 3+depth]
        walk = VersionedMatcher(schema)
        walk.commit(0, tokens[: 4 + depth])
        assert torch.equal(out[depth + 1], mask_at(walk, 4 + depth)), f"row {depth + 1}"
    assert not out[4].any() and not out[5].any(), "a refused node and its subtree allow nothing"
    assert matcher.ordinal == 3 and torch.equal(mask_at(matcher, 3), before)
    assert matcher.commit(3, tokens[3:]).new_ordinal == len(tokens)
    # A draft through the stop token: the committed state stays live even though the draft terminates.
    ending = DraftTree.chain([eos, tokens[0]])
    rows = torch.empty((ending.num_rows, matcher.words_per_row), dtype=torch.int32)
    matcher.fill_draft_masks(len(tokens), ending, rows)
    assert allowed(rows[0], eos) and not rows[1].any() and not rows[2].any()
    assert matcher.state is MatcherState.ACTIVE
    assert matcher.commit(len(tokens), [eos]).terminated


def test_draft_tree_shapes_are_validated(schema: CompiledConstraint) -> None:
    with pytest.raises(GrammarProtocolError, match="own ancestor"):
        DraftTree(tokens=(1, 2), parents=(1, 0))
    with pytest.raises(GrammarProtocolError, match="parents must be"):
        DraftTree(tokens=(1,), parents=(3,))
    links = DraftTree.from_links(tokens=[99, 5, 6, 7], next_token=[1, 3, -1, -1], next_sibling=[-1, 2, -1, -1])
    assert links == DraftTree(tokens=(5, 6, 7), parents=(-1, -1, 0))
    with pytest.raises(GrammarProtocolError, match="reached twice"):
        DraftTree.from_links(tokens=[0, 5, 6], next_token=[1, 1, -1], next_sibling=[-1, 2, 1])
    with pytest.raises(GrammarProtocolError, match="not reachable"):
        DraftTree.from_links(tokens=[0, 5, 6], next_token=[1, -1, -1], next_sibling=[-1, -1, -1])
    matcher = VersionedMatcher(schema)
    too_big = DraftTree.chain([schema.vocab_size])
    out = torch.empty((2, matcher.words_per_row), dtype=torch.int32)
    assert refused(matcher.fill_draft_masks, 0, too_big, out).code is Refusal.INVALID_ARGUMENT


# ---------------------------------------------------------------- registry and fence


class ObservedRegistry(GrammarRegistry):
    """The real registry; ``fence_waiting`` is set once a fenced entry has been found behind and is waiting."""

    def __init__(self, compiler: ConstraintCompiler) -> None:
        super().__init__(compiler)
        self.fence_waiting = threading.Event()

    def wait_for_change(self, seen_generation: int, timeout_s: float) -> bool:
        self.fence_waiting.set()
        return super().wait_for_change(seen_generation, timeout_s)


def test_registry_refuses_duplicate_open_and_forgets_released(registry: GrammarRegistry, tokenizer: Tokenizer) -> None:
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    registry.open("a", constraint, WAIT_S)
    assert refusal_of(_raised(registry.open, "a", constraint, WAIT_S)) is Refusal.ALREADY_OPEN
    assert refusal_of(_raised(registry.open, "", constraint, WAIT_S)) is Refusal.INVALID_ARGUMENT
    assert registry.num_open == 1
    assert registry.release(["a", "a", "nobody"]) == [None, Refusal.RELEASED, Refusal.UNKNOWN]
    assert registry.num_open == 0
    [late] = registry.commit([CommitEntry("a", 0, tuple(ids(tokenizer, "{")))])
    assert late.refusal is Refusal.RELEASED
    [mask] = registry.poll_masks([MaskEntry("a", 0)])
    assert mask.refusal is Refusal.RELEASED


def test_fence_waits_and_is_released_by_a_commit_from_another_thread(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    """C3: a mask for ordinal 2 while the grammar is at 0 waits, and the commit reaching 2 answers it."""
    registry = ObservedRegistry(compiler)
    matcher = registry.open("r", Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA), WAIT_S)
    tokens = ids(tokenizer, VALID_JSON)
    started = time.monotonic()
    waiter, answers = fill_in_thread(registry, [MaskEntry("r", 2)])
    assert registry.fence_waiting.wait(WAIT_S), "the fence never waited"
    assert registry.num_waiting == 1
    [commit] = registry.commit([CommitEntry("r", 0, tuple(tokens[:2]))])
    assert commit.result is not None and commit.result.new_ordinal == 2
    waiter.join(WAIT_S)
    assert time.monotonic() - started < WAIT_S / 2, "the commit did not wake the fence"
    [outcome] = answers
    assert outcome.rows is not None, outcome
    assert torch.equal(outcome.rows.words[0], mask_at(matcher, 2))
    assert registry.num_waiting == 0


def test_a_commit_fills_the_rows_of_a_fence_waiting_for_it(registry: GrammarRegistry, tokenizer: Tokenizer) -> None:
    """C3/C4, delayed sampling: the commit that lets a waiting fence's entry through fills that entry's row itself,
    at exactly the ordinal the entry names, so the fence's own thread finds nothing left to compute. A fence that
    has answered is closed: a later commit writes nothing into its buffer, which its owner may be sampling from.
    (Without ``GrammarRegistry._complete_fences`` the rows are still zero right after the commits; without the
    ``_closed`` check in ``MaskFence.complete`` the answered fence's row is overwritten.)"""
    tokens = ids(tokenizer, VALID_JSON)
    schema = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    reference = VersionedMatcher(registry.compiler.compile(schema, WAIT_S))
    reference.commit(0, tokens[:2])
    expected = mask_at(reference, 2)  # [W]
    for rid in ("a", "b", "late"):
        registry.open(rid, schema, WAIT_S)
    words = registry.compiler.words_per_row
    out = torch.zeros((2, words), dtype=torch.int32)  # [2, W]
    closed_out = torch.zeros((1, words), dtype=torch.int32)  # [1, W]
    with MaskFence(registry, [MaskEntry("late", 2)], 0.0, closed_out, [0]) as answered:
        assert not answered.poll()
        assert answered.refusals()[0][0] is Refusal.BEHIND_DEADLINE
        with MaskFence(registry, [MaskEntry("a", 2), MaskEntry("b", 2)], WAIT_S, out, [0, 1]) as fence:
            assert not fence.poll() and registry.num_waiting == 3
            registry.commit([CommitEntry("a", 0, tuple(tokens[:2])), CommitEntry("late", 0, tuple(tokens[:2]))])
            assert not closed_out.any(), "a commit wrote into a fence that had already answered"
            assert torch.equal(out[0], expected) and not out[1].any()
            assert registry.num_waiting == 2  # "b" waits; the answered fence still counts "late" until it exits
            registry.commit([CommitEntry("b", 0, tuple(tokens[:1]))])
            assert not out[1].any()  # "b" is at ordinal 1: still behind, nothing written
            registry.commit([CommitEntry("b", 1, tuple(tokens[1:2]))])
            assert torch.equal(out[1], expected)
            assert not fence.ready() and fence.poll() and fence.refusals() == {}
        assert not closed_out.any()
    assert registry.num_waiting == 0


def test_a_fence_opened_before_the_commit_is_answered_by_it_and_a_closed_one_is_forgotten(
    registry: GrammarRegistry, tokenizer: Tokenizer
) -> None:
    """C3/C4, the in-process executor's path: ``start_masks`` opens the fence before the forward and computes nothing;
    the commit fills the row; ``result`` answers without waiting and closes the fence. A fence given up with
    ``close`` (its step failed) is forgotten by the registry and never written again. (Without ``fence.open()`` in
    ``FencedMasks`` the commit does not fill the row; without ``fence.close()`` in ``result`` or ``close`` the
    registry keeps the fence, and later commits keep polling it.)"""
    tokens = ids(tokenizer, VALID_JSON)
    schema = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    reference = VersionedMatcher(registry.compiler.compile(schema, WAIT_S))
    reference.commit(0, tokens[:1])
    expected = mask_at(reference, 1)  # [W]
    for rid in ("a", "b"):
        registry.open(rid, schema, WAIT_S)
    out = torch.zeros((2, registry.compiler.words_per_row), dtype=torch.int32)  # [2, W]
    fenced = registry.start_masks([MaskEntry("a", 1)], WAIT_S, out, [0])
    given_up = registry.start_masks([MaskEntry("b", 1)], WAIT_S, out, [1])
    assert not out.any() and fenced.written_after_s is None
    given_up.close()
    registry.commit([CommitEntry("a", 0, tuple(tokens[:1])), CommitEntry("b", 0, tuple(tokens[:1]))])
    assert torch.equal(out[0], expected), "the commit did not fill the open fence's row"
    assert not out[1].any(), "a commit wrote into a fence that was closed unanswered"
    assert fenced.written_after_s is not None
    assert fenced.result() == {}
    assert registry.num_waiting == 0 and not registry._fences


def test_fence_deadline_expires_cleanly_and_other_entries_are_answered(
    registry: GrammarRegistry, tokenizer: Tokenizer
) -> None:
    """C3: behind past the deadline → BEHIND_DEADLINE for that entry only, answered at the deadline (not ten
    times later: fails if `MaskFence`'s deadline is made ten times longer, checked once); the matcher is unchanged."""
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    registry.open("late", constraint, WAIT_S)
    registry.open("ready", constraint, WAIT_S)
    started = time.monotonic()
    late, ready = registry.fill_masks([MaskEntry("late", 3), MaskEntry("ready", 0)], 0.2)
    # The deadline bounds the wait both ways: a fence that waited ten times longer would stall a step that long.
    assert 0.2 <= time.monotonic() - started < 0.2 * 5
    assert late.refusal is Refusal.BEHIND_DEADLINE and "ordinal 3" in late.message and "200 ms" in late.message
    assert ready.rows is not None and ready.rows.words.shape == (1, registry.compiler.words_per_row)
    assert registry.num_waiting == 0
    [commit] = registry.commit([CommitEntry("late", 0, tuple(ids(tokenizer, "{")))])
    assert commit.result is not None


def test_fence_ends_at_once_when_the_ordinal_can_never_come(
    compiler: ConstraintCompiler, tokenizer: Tokenizer, eos: int
) -> None:
    """A release or a termination while a mask waits answers it immediately, not at the deadline."""
    registry = ObservedRegistry(compiler)
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    tokens = ids(tokenizer, VALID_JSON)
    for finish, expected in (("release", Refusal.RELEASED), ("terminate", Refusal.TERMINATED)):
        registry.fence_waiting = threading.Event()
        registry.open(finish, constraint, WAIT_S)
        started = time.monotonic()
        waiter, answers = fill_in_thread(registry, [MaskEntry(finish, 99)])
        assert registry.fence_waiting.wait(WAIT_S)
        if finish == "release":
            registry.release([finish])
        else:
            registry.commit([CommitEntry(finish, 0, (*tokens, eos))])
        waiter.join(WAIT_S)
        assert time.monotonic() - started < WAIT_S / 2
        [outcome] = answers
        assert outcome.refusal is expected, outcome


def test_a_batch_of_masks_equals_the_rows_one_by_one_and_refusals_stay_per_entry(
    registry: GrammarRegistry, compiler: ConstraintCompiler, tokenizer: Tokenizer, eos: int
) -> None:
    """C3 in the batched path: one poll over matchers at different points of two grammars answers every ready
    entry with exactly the mask its own matcher gives alone, and every other entry with its own refusal (behind,
    ahead, terminated, released, unknown, the same id twice), whatever sits next to it in the batch."""
    tokens = ids(tokenizer, VALID_JSON)
    schema = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    array = Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "array", "items": {"type": "integer"}}')
    array_tokens = ids(tokenizer, "[1, 22, 333]")
    for k in range(len(tokens)):
        registry.open(f"s{k}", schema, WAIT_S)
        registry.commit([CommitEntry(f"s{k}", 0, tuple(tokens[:k]))])
    for k in range(len(array_tokens)):
        registry.open(f"a{k}", array, WAIT_S)
        registry.commit([CommitEntry(f"a{k}", 0, tuple(array_tokens[:k]))])
    for rid in ("behind", "ahead", "done", "gone"):
        registry.open(rid, schema, WAIT_S)
    registry.commit([CommitEntry("ahead", 0, tuple(tokens[:2])), CommitEntry("done", 0, (*tokens, eos))])
    registry.release(["gone"])
    ready = [MaskEntry(f"s{k}", k) for k in range(len(tokens))] + [
        MaskEntry(f"a{k}", k) for k in range(len(array_tokens))
    ]
    odd = [
        MaskEntry("behind", 1),
        MaskEntry("ahead", 1),
        MaskEntry("done", len(tokens) + 1),
        MaskEntry("gone", 0),
        MaskEntry("nobody", 0),
    ]
    entries = [e for pair in zip(ready, odd + [None] * len(ready), strict=False) for e in pair if e is not None]
    entries.append(MaskEntry("s1", 1))  # the same id twice in one batch: answered twice, no deadlock
    outcomes = registry.poll_masks(entries)
    expected = {
        "behind": Refusal.BEHIND,
        "ahead": Refusal.AHEAD,
        "done": Refusal.TERMINATED,
        "gone": Refusal.RELEASED,
        "nobody": Refusal.UNKNOWN,
    }
    for entry, outcome in zip(entries, outcomes, strict=True):
        if entry.request_id in expected:
            assert outcome.rows is None and outcome.refusal is expected[entry.request_id], (entry, outcome)
            continue
        assert outcome.rows is not None, (entry, outcome)
        constraint, feed = (schema, tokens) if entry.request_id.startswith("s") else (array, array_tokens)
        alone = VersionedMatcher(compiler.compile(constraint, WAIT_S))  # a matcher of its own, same tokens
        alone.commit(0, feed[: entry.ordinal])
        row = mask_at(alone, entry.ordinal)  # [W]
        assert torch.equal(outcome.rows.words[0], row), entry
        assert outcome.rows.full == (bool((row == -1).all()),)


def test_batched_masks_are_never_from_another_version_while_commits_race(
    registry: GrammarRegistry, tokenizer: Tokenizer
) -> None:
    """C3 under a real race: one thread commits a valid JSON token by token into 8 matchers while another polls
    masks at the ordinal it last read. Every mask answered equals the reference mask at the ordinal it names:
    the matcher's lock is held from the ordinal check to the fill, so a commit never lands in between (without
    ``fill_mask_rows``' lock acquisition, masks of the next version come back for the ordinal asked)."""
    tokens = ids(tokenizer, VALID_JSON)
    schema = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    reference = VersionedMatcher(registry.compiler.compile(schema, WAIT_S))
    expected = []
    for k, token in enumerate(tokens):
        expected.append(mask_at(reference, k))
        reference.commit(k, [token])
    expected.append(mask_at(reference, len(tokens)))  # the poller may also ask after the last commit
    rids = [f"race{i}" for i in range(8)]
    for rid in rids:
        registry.open(rid, schema, WAIT_S)
    stop = threading.Event()
    seen: list[tuple[int, MaskOutcome]] = []
    polled = threading.Condition()
    polls = [0]  # finished polls

    def poll() -> None:
        while not stop.is_set():
            ordinal = min(registry._lookup(rid).ordinal for rid in rids)
            for outcome in registry.poll_masks([MaskEntry(rid, ordinal) for rid in rids]):
                seen.append((ordinal, outcome))
            with polled:
                polls[0] += 1
                polled.notify_all()

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for k, token in enumerate(tokens):
            # Two more polls finished since the last commit: a whole one saw ordinal k; this commit then races the
            # poll in progress.
            with polled:
                target = polls[0] + 2
                assert polled.wait_for(lambda t=target: polls[0] >= t, timeout=WAIT_S)
            registry.commit([CommitEntry(rid, k, (token,)) for rid in rids])
    finally:
        stop.set()
        poller.join(WAIT_S)
    answered = [(ordinal, o) for ordinal, o in seen if o.rows is not None]
    assert answered, "the poller never got a mask"
    for ordinal, outcome in answered:
        assert outcome.rows is not None and torch.equal(outcome.rows.words[0], expected[ordinal]), ordinal
    assert {ordinal for ordinal, _ in answered} >= set(range(len(tokens)))  # every version was asked and answered
    assert all(o.refusal in (None, Refusal.AHEAD, Refusal.TERMINATED) for _, o in seen)


class ContendedLock:
    """A matcher's lock that says when an acquire had to wait because someone else held it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        self.contended.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_commit_cannot_land_between_a_batched_masks_check_and_its_fill(
    schema: CompiledConstraint, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C3, the race given a hook: `fill_mask_rows` checks each matcher's ordinal, then xgrammar fills the rows. The
    test starts a commit on another thread exactly between the two (inside xgrammar's batch fill, patched) and waits
    until that commit has either finished or is waiting for the matcher's lock. The mask must be the one at the
    ordinal asked, the commit going through only after the fill.

    Fails deterministically if `fill_mask_rows` does not hold the matchers' locks from the check to the fill
    (checked once by removing the acquire/release loops): the commit then finishes first and the row comes back
    from the next version."""
    tokens = ids(tokenizer, VALID_JSON)
    k = 3
    reference = VersionedMatcher(schema)
    reference.commit(0, tokens[:k])
    expected = mask_at(reference, k)
    matcher = VersionedMatcher(schema)
    matcher.commit(0, tokens[:k])
    lock = ContendedLock()
    matcher._lock = lock  # type: ignore[assignment]
    committed = threading.Event()

    def commit_next() -> None:
        matcher.commit(k, [tokens[k]])
        committed.set()

    real = xgr.BatchGrammarMatcher

    class RacingFill(real):  # type: ignore[misc, valid-type]
        def batch_fill_next_token_bitmask(self, *args: object, **kwargs: object) -> object:
            racer.start()
            deadline = time.monotonic() + WAIT_S
            while not (lock.contended.is_set() or committed.is_set()):  # polling a state, bounded
                assert time.monotonic() < deadline, "the racing commit neither waited for the lock nor finished"
                time.sleep(0.001)
            return super().batch_fill_next_token_bitmask(*args, **kwargs)

    racer = threading.Thread(target=commit_next)
    monkeypatch.setattr(xgr, "BatchGrammarMatcher", RacingFill)
    out = torch.zeros((1, matcher.words_per_row), dtype=torch.int32)  # [1, W]
    assert fill_mask_rows([(matcher, k)], out) == [None]
    racer.join(WAIT_S)
    assert committed.is_set() and matcher.ordinal == k + 1
    assert torch.equal(out[0], expected), "the row is not the mask at the ordinal asked"


# ---------------------------------------------------------------- compiler


def test_compile_cache_hit(compiler: ConstraintCompiler) -> None:
    constraint = Constraint(ConstraintKind.REGEX, r"[a-c]{2,4}")
    before = compiler.stats()
    first = compiler.compile(constraint, WAIT_S)
    second = compiler.compile(Constraint(ConstraintKind.REGEX, r"[a-c]{2,4}"), WAIT_S)
    assert second is first
    after = compiler.stats()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    compiler.compile(Constraint(ConstraintKind.REGEX, r"[a-c]{2,5}"), WAIT_S)
    assert compiler.stats().misses == after.misses + 1


@pytest.mark.parametrize(
    ("kind", "text", "reason"),
    [
        (ConstraintKind.JSON_SCHEMA, '{"type": "foo"}', 'Unsupported type "foo"'),
        (ConstraintKind.JSON_SCHEMA, "{not json", "Failed to parse JSON"),
        (ConstraintKind.REGEX, "((a)", "parenthesis is not closed"),
        (ConstraintKind.EBNF, "root ::= undefined_rule", 'Rule "undefined_rule" is not defined'),
        (ConstraintKind.STRUCTURAL_TAG, '{"no": "format"}', "must have a format field"),
    ],
)
def test_invalid_grammar_raises_with_xgrammars_reason(
    compiler: ConstraintCompiler, kind: ConstraintKind, text: str, reason: str
) -> None:
    for _ in range(2):  # the second time from the cache, with the same reason
        with pytest.raises(InvalidGrammarError) as info:
            compiler.compile(Constraint(kind, text), WAIT_S)
        assert reason in info.value.reason
        assert not info.value.reason.startswith("["), "xgrammar's log header leaked into the reason"
        assert info.value.field == f"constraint.{kind.value}"


def test_compile_deadline(compiler: ConstraintCompiler) -> None:
    """A compile past its deadline raises GrammarTimeoutError; it goes on and the next ask gets the result."""
    big = ",".join(f'"k{i}":{{"type":"array","items":{{"type":"number"}}}}' for i in range(60))
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, f'{{"type":"object","properties":{{{big}}}}}')
    with pytest.raises(GrammarTimeoutError):
        compiler.compile(constraint, 0.0)
    assert compiler.compile(constraint, WAIT_S).constraint == constraint


ANSWER_SCHEMA = '{"type":"object","properties":{"answer":{"type":"string"}},"required":["answer"]}'
JSON_OBJECT = '{"type":"object"}'  # what smg sends for response_format json_object


def _accepts(compiled: CompiledConstraint, text: str) -> bool:
    return bool(xgr.GrammarMatcher(compiled.grammar).accept_string(text))


@pytest.mark.parametrize("mode", list(JsonSchemaMode), ids=[m.value for m in JsonSchemaMode])
def test_json_whitespace_between_tokens_is_bounded(compiler: ConstraintCompiler, mode: JsonSchemaMode) -> None:
    """Seed 000's schema and json_object, in every mode: at most DEFAULT_JSON_MAX_WHITESPACE whitespace characters
    in a row between tokens, so the grammar forces the next token instead of letting "{" and newlines run to
    max_tokens. Fails if JsonSchemaCompiler stops passing max_whitespace_cnt to xgrammar."""
    bound = DEFAULT_JSON_MAX_WHITESPACE
    for text in (ANSWER_SCHEMA, JSON_OBJECT):
        compiled = compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, text, mode), WAIT_S)
        assert _accepts(compiled, '{"answer": "yes"}')
        spaces = " " * (bound + 1)  # inside a string, spaces are content: not bounded
        assert _accepts(compiled, "{" + "\n" + " " * (bound - 1) + f'"answer" : "a{spaces}b"' + " " * bound + "}")
        assert not _accepts(compiled, "{" + "\n" * (bound + 1)), text
        assert not _accepts(compiled, '{"answer":' + " " * (bound + 1)), text


def test_unbounded_json_whitespace_is_a_config_choice(embedded_model_dir: Path) -> None:
    """CompilerConfig(json_max_whitespace=None) (--json-whitespace unbounded) compiles xgrammar's own default."""
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir, CompilerConfig(json_max_whitespace=None))
    try:
        compiled = compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, ANSWER_SCHEMA), WAIT_S)
        assert _accepts(compiled, "{" + "\n" * 300 + '"answer": "yes"}')
    finally:
        compiler.shutdown()
    with pytest.raises(ValueError, match="json_max_whitespace"):
        CompilerConfig(json_max_whitespace=0)


def test_constraint_from_public_field() -> None:
    assert Constraint.from_public_field("ebnf_grammar", 'root ::= "a"').kind is ConstraintKind.EBNF
    with pytest.raises(ValueError, match="unknown constraint"):
        Constraint.from_public_field("grammar", "x")
    with pytest.raises(ValueError, match="empty"):
        Constraint(ConstraintKind.REGEX, "")


def _raised(fn: object, *args: object) -> BaseException:
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as error:
        return error
    raise AssertionError("no exception raised")
