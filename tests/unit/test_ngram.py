"""The n-gram (prompt lookup) proposer: what it drafts, under which caps, and that its incremental index answers
exactly what a scan over the whole history answers (the brute-force reference below is the specification)."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

import pytest

from engine.executor.ngram import NgramConfig, NgramProposer
from engine.executor.proposer import NO_DRAFT, Draft, DraftRequest
from engine.executor.sampler import SamplingState
from engine.grammar_calls import DraftTree
from engine.sampling_params import SamplingParams

VOCAB = 16
SAMPLING = SamplingState(SamplingParams(), (), frozenset(), VOCAB, "cpu", 0)


def request(
    tokens: Sequence[int], *, slot: int = 0, max_nodes: int = 8, max_depth: int = 8, topk: int = 1
) -> DraftRequest:
    return DraftRequest(slot, tokens, len(tokens) - 1, (), max_nodes, max_depth, topk, SAMPLING)


def draft(tokens: Sequence[int], config: NgramConfig | None = None, **caps: int) -> Draft:
    (out,) = NgramProposer(config).propose([request(tokens, **caps)])
    return out


# --- the specification: a scan over the whole history --------------------------------------------------------------


def occurrences(tokens: Sequence[int], n: int) -> list[int]:
    """Every position an earlier copy of the last n tokens ended at, oldest first."""
    size = len(tokens)
    suffix = list(tokens[size - n :])
    return [end for end in range(n - 1, size - 1) if list(tokens[end - n + 1 : end + 1]) == suffix]


def reference(tokens: Sequence[int], config: NgramConfig, max_nodes: int, max_depth: int, topk: int) -> DraftTree:
    cap = config.max_occurrences
    windows = range(min(config.max_n, len(tokens) - 1), config.min_n - 1, -1)
    longest = next((n for n in windows if occurrences(tokens, n)), None)
    if longest is None or min(max_nodes, max_depth) < 1 or topk < 1:
        return DraftTree((), ())
    if topk == 1:
        length = min(max_nodes, max_depth)
        recent = occurrences(tokens, longest)[-cap:]
        complete = [end for end in recent if len(tokens) - 1 - end >= length]
        end = complete[-1] if complete else recent[0]
        return DraftTree.chain(tokens[end + 1 : end + 1 + length])
    chosen: list[tuple[int, int]] = []  # (end, weight): longest suffix first, most recent first
    for n in range(longest, config.min_n - 1, -1):
        for end in reversed(occurrences(tokens, n)):
            if len(chosen) < cap and end not in [e for e, _ in chosen]:
                chosen.append((end, (cap + 1) ** (n - config.min_n)))
    stats: dict[tuple[int, ...], list[int]] = {}  # every prefix of a continuation: [weight, best rank]
    for rank, (end, weight) in enumerate(chosen):
        continuation = tuple(tokens[end + 1 : end + 1 + max_depth])
        for d in range(1, len(continuation) + 1):
            stats.setdefault(continuation[:d], [0, rank])[0] += weight
    selected: list[tuple[int, ...]] = []
    while len(selected) < max_nodes:
        eligible = [
            p
            for p in stats
            if p not in selected
            and (len(p) == 1 or p[:-1] in selected)
            and sum(1 for s in selected if s[:-1] == p[:-1]) < topk
        ]
        if not eligible:
            break
        selected.append(min(eligible, key=lambda p: (-stats[p][0], stats[p][1])))

    def kids(parent: tuple[int, ...]) -> list[tuple[int, ...]]:
        ours = [p for p in selected if len(p) == len(parent) + 1 and p[:-1] == parent]
        return sorted(ours, key=lambda p: (-stats[p][0], stats[p][1]))

    order = [(p, -1) for p in kids(())]
    for i, (p, _) in enumerate(order):  # breadth first
        order.extend((child, i) for child in kids(p))
    return DraftTree(tuple(p[-1] for p, _ in order), tuple(parent for _, parent in order))


def check_tree(tree: DraftTree, max_nodes: int, max_depth: int, topk: int) -> None:
    """Parents before children, and every cap respected."""
    depth: list[int] = []
    children = [0] * (len(tree.tokens) + 1)
    for i, parent in enumerate(tree.parents):
        assert parent < i
        depth.append(1 if parent == -1 else depth[parent] + 1)
        children[parent + 1] += 1
    assert len(tree.tokens) <= max_nodes
    assert max(depth, default=0) <= max_depth
    assert max(children) <= topk


# --- chains -------------------------------------------------------------------------------------------------------


def test_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    # [1 2] ended at 2 (then 9 7); the unigram [2] ended more recently at 5 (then 8).
    tokens = [5, 1, 2, 9, 7, 2, 8, 3, 1, 2]
    assert draft(tokens, NgramConfig(min_n=1, max_n=3), max_depth=2).tree == DraftTree.chain([9, 7])
    # Without the bigram in the window the unigram's most recent occurrence is what remains.
    assert draft(tokens, NgramConfig(min_n=1, max_n=1), max_depth=2).tree == DraftTree.chain([8, 3])


def test_most_recent_occurrence_wins() -> None:
    tokens = [1, 2, 7, 1, 2, 8, 0, 1, 2]
    out = draft(tokens, max_depth=2)
    assert out.tree == DraftTree.chain([8, 0])
    assert out.q is None


def test_continuation_stops_at_the_pending_token() -> None:
    # The only earlier [3 4] is followed by 5 3 4, the last 4 being the pending token: nothing beyond it.
    assert draft([3, 4, 5, 3, 4], max_depth=8).tree == DraftTree.chain([5, 3, 4])


def test_short_continuations_fall_back_to_the_oldest_occurrence() -> None:
    tokens = [1, 2, 1, 2, 1, 2]
    config = NgramConfig(min_n=2, max_n=2)
    # [1 2] ended at 1 and 3; for 2 tokens the most recent one (3) has enough: 1 2.
    assert draft(tokens, config, max_depth=2).tree == DraftTree.chain([1, 2])
    # For 5 tokens both run into the end; the oldest has the longer continuation: 1 2 1 2.
    assert draft(tokens, config, max_depth=5).tree == DraftTree.chain([1, 2, 1, 2])


@pytest.mark.parametrize(("max_nodes", "max_depth", "expected"), [(3, 8, 3), (8, 2, 2), (1, 1, 1), (20, 20, 10)])
def test_chain_length_is_capped_by_nodes_and_depth(max_nodes: int, max_depth: int, expected: int) -> None:
    tokens = [*range(10), 0, 1]  # [0 1] recurs; 2..9 and 0 1 follow it: 10 tokens up to the pending one
    out = draft(tokens, max_nodes=max_nodes, max_depth=max_depth, topk=1)
    assert out.is_chain
    assert out.tree.tokens == tuple(tokens[2 : 2 + expected])


def test_no_match_gives_no_draft() -> None:
    assert draft([1, 2, 3, 4, 5]) is NO_DRAFT  # nothing recurs
    assert draft([1, 2, 3, 1]) is NO_DRAFT  # only a unigram recurs, below min_n = 2
    assert draft([1, 2, 3, 1], NgramConfig(min_n=1)).tree == DraftTree.chain([2, 3, 1])
    assert draft([]) is NO_DRAFT
    assert draft([7]) is NO_DRAFT
    assert draft([7, 7], NgramConfig(min_n=1)).tree == DraftTree.chain([7])


def test_no_room_gives_no_draft() -> None:
    tokens = [1, 2, 3, 1, 2]
    assert draft(tokens, max_nodes=0) is NO_DRAFT
    assert draft(tokens, max_depth=0) is NO_DRAFT
    assert draft(tokens, topk=0) is NO_DRAFT


# --- trees --------------------------------------------------------------------------------------------------------


def test_tree_children_ordered_by_count_then_recency() -> None:
    # After [1 2]: 7 twice, 8 once and most recently: the count wins.
    tokens = [1, 2, 7, 0, 1, 2, 7, 0, 1, 2, 8, 0, 1, 2]
    out = draft(tokens, max_depth=1, topk=4)
    assert out.tree == DraftTree((7, 8), (-1, -1))
    # One each: the most recent first.
    assert draft([1, 2, 7, 1, 2, 8, 1, 2], max_depth=1, topk=4).tree == DraftTree((8, 7), (-1, -1))


def test_diverging_occurrences_branch() -> None:
    # Both copies of [1 2] continue with 5, then 6 (older) or 9 (more recent).
    tokens = [1, 2, 5, 6, 0, 1, 2, 5, 9, 0, 1, 2]
    out = draft(tokens, max_depth=3, topk=2)
    assert out.tree == DraftTree((5, 9, 6, 0, 0), (-1, 0, 0, 1, 2))
    assert not out.is_chain
    assert out.q is None
    # The same history with topk 1 is the most recent occurrence's chain.
    assert draft(tokens, max_depth=3, topk=1).tree == DraftTree.chain([5, 9, 0])


def test_tree_caps_topk_depth_and_nodes() -> None:
    # [1 2] followed by 3, 4, 5 and 6 (each once, 6 most recent), each then by 0 0.
    tokens = [1, 2, 3, 0, 0, 1, 2, 4, 0, 0, 1, 2, 5, 0, 0, 1, 2, 6, 0, 0, 1, 2]
    assert draft(tokens, max_depth=1, topk=2).tree == DraftTree((6, 5), (-1, -1))
    assert draft(tokens, max_depth=2, max_nodes=3, topk=4).tree == DraftTree((6, 5, 0), (-1, -1, 0))
    full = draft(tokens, max_depth=3, max_nodes=64, topk=4).tree
    assert full.tokens == (6, 5, 4, 3, 0, 0, 0, 0, 0, 0, 0, 0)
    check_tree(full, 64, 3, 4)
    for max_nodes, max_depth, topk in [(5, 3, 2), (2, 8, 3), (7, 2, 3)]:
        check_tree(draft(tokens, max_nodes=max_nodes, max_depth=max_depth, topk=topk).tree, max_nodes, max_depth, topk)


def test_chain_looks_at_most_max_occurrences_back() -> None:
    # [0] ended at 0..8; only the 3 most recent (6, 7, 8) are kept, all too close to the end for 20 tokens: the
    # oldest kept one (6) drafts what follows it, not position 0 of a list the index no longer has.
    out = draft([0] * 10, NgramConfig(min_n=1, max_n=1, max_occurrences=3), max_depth=20)
    assert out.tree == DraftTree.chain([0, 0, 0])


def test_tree_merges_at_most_max_occurrences() -> None:
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2, 7, 1, 2]
    out = draft(tokens, NgramConfig(max_occurrences=3), max_depth=1, topk=8)
    assert out.tree == DraftTree((7, 6, 5), (-1, -1, -1))


def test_a_longer_suffix_outweighs_more_frequent_shorter_ones() -> None:
    # [3 2] once (then 9); the unigram [2] also at 4 and 7 (then 8 both times): 9 first, 8 adds a branch.
    tokens = [3, 2, 9, 5, 2, 8, 6, 2, 8, 3, 2]
    out = draft(tokens, NgramConfig(min_n=1, max_n=2), max_depth=1, topk=4)
    assert out.tree == DraftTree((9, 8), (-1, -1))
    # Without the fallback window the tree has only the bigram's continuation.
    assert draft(tokens, NgramConfig(min_n=2, max_n=2), max_depth=1, topk=4).tree == DraftTree((9,), (-1,))


# --- the index: incremental, per slot -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config", [NgramConfig(), NgramConfig(min_n=1, max_n=3, max_occurrences=3)], ids=["default", "min1-cap3"]
)
def test_incremental_index_matches_the_full_scan(config: NgramConfig) -> None:
    """Several hundred steps of two slots growing by 1-4 tokens (and now and then a new request in a slot) drafted
    in one batch: every draft equals the brute-force scan over the whole history. Fails if the index misses appended
    tokens, indexes the pending token as an earlier occurrence, or keeps a released slot's history."""
    rng = random.Random(1234)
    proposer = NgramProposer(config)
    histories: list[list[int]] = [[rng.randrange(3)], [rng.randrange(4)]]
    compared = drafted = 0
    for _ in range(300):
        for slot, history in enumerate(histories):
            if rng.random() < 0.01:
                proposer.release(slot)
                history.clear()
            history.extend(rng.randrange(3 + slot) for _ in range(rng.randint(1, 4)))
        caps = [(rng.randint(1, 8), rng.randint(1, 6), rng.randint(1, 3)) for _ in histories]
        batch = [
            request(history, slot=slot, max_nodes=n, max_depth=d, topk=k)
            for slot, (history, (n, d, k)) in enumerate(zip(histories, caps, strict=True))
        ]
        for history, (n, d, k), out in zip(histories, caps, proposer.propose(batch), strict=True):
            expected = reference(history, config, n, d, k)
            assert out.tree == expected, (history, n, d, k)
            check_tree(out.tree, n, d, k)
            compared += 1
            drafted += out.num_nodes > 0
    assert drafted > compared // 2  # the small vocabularies make matches common: the comparison is not vacuous


def test_released_slot_starts_over() -> None:
    """Fails if ``release`` keeps the slot's index (it would hold a finished request's history forever)."""
    proposer = NgramProposer()
    assert proposer.propose([request([1, 2, 3, 4, 1, 2])])[0].tree == DraftTree.chain([3, 4, 1, 2])
    assert proposer.num_slots == 1
    proposer.release(0)
    proposer.release(5)  # never used: nothing to forget, no error
    assert proposer.num_slots == 0
    # The new request's history has no earlier [1 2]: the old request's index must not answer for it.
    assert proposer.propose([request([5, 6, 7, 8, 9, 0, 1, 2])]) == [NO_DRAFT]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # same head, different tail: the old [5 6] would propose 0 0 0
        ([1, 2, 3, 4, 5, 6, 1, 2, 7], [1, 2, 3, 4, 0, 0, 0, 0, 0, 5, 6]),
        # different head, same length and tail
        ([5, 6, 9, 1, 2, 3], [7, 8, 9, 1, 2, 3]),
        # shorter than what was indexed
        ([5, 6, 1, 2, 9, 9, 9], [3, 5, 6]),
    ],
)
def test_a_history_that_is_not_an_extension_is_reindexed(first: list[int], second: list[int]) -> None:
    """A slot whose tokens stop extending what was indexed (reused without a release) drafts from its own history
    only. Fails if the head/tail check in ``_SlotIndex.extends`` is removed."""
    proposer = NgramProposer()
    proposer.propose([request(first)])
    config = proposer.config
    expected = reference(second, config, 8, 8, 1)
    assert proposer.propose([request(second)])[0].tree == expected
    assert expected == DraftTree((), ())


def test_slots_are_independent() -> None:
    proposer = NgramProposer()
    a, b = [1, 2, 3, 1, 2], [4, 5, 6, 4, 5]
    out = proposer.propose([request(a, slot=0), request(b, slot=3)])
    assert [d.tree for d in out] == [DraftTree.chain([3, 1, 2]), DraftTree.chain([6, 4, 5])]
    a.extend([3, 1, 2])
    proposer.release(3)
    assert proposer.propose([request(a, slot=0)])[0].tree == DraftTree.chain([3, 1, 2])


@pytest.mark.parametrize(
    ("bad", "message"),
    [({"min_n": 0}, "1 <= min_n <= max_n"), ({"min_n": 3, "max_n": 2}, "got 3..2"), ({"max_occurrences": 0}, ">= 1")],
)
def test_config_is_checked(bad: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        NgramConfig(**bad)


def test_a_continuation_ends_before_what_min_new_tokens_bans() -> None:
    """A request short of its min_new_tokens cannot emit eos (here 15) or its stop ids (14): the n-gram draft ends
    before one at the depths still under the ban, and keeps it past them. The history: [1 2] was followed by
    3 15 4 14 5. Fails if the cut is removed (the chain would hold 15 at depth 2, the verify rejecting it and all after
    it) or applied past the ban's depths."""
    history = [1, 2, 3, 15, 4, 14, 5, 0, 1, 2]

    def banned_for(outputs_left: int, topk: int = 1, tokens: Sequence[int] = history) -> DraftTree:
        params = SamplingParams(min_new_tokens=outputs_left + 3, stop_token_ids=(14,))
        state = SamplingState(params, (), frozenset({15}), VOCAB, "cpu", 0)
        for _ in range(3):
            state.record(0)  # three outputs so far: outputs_left more are banned from ending
        r = DraftRequest(0, tokens, len(tokens) - 1, (), 8, 8, topk, state)
        (out,) = NgramProposer().propose([r])
        return out.tree

    assert banned_for(0) == DraftTree.chain([3, 15, 4, 14, 5, 0, 1, 2])  # min_new_tokens reached: nothing banned
    assert banned_for(1) == DraftTree.chain([3, 15, 4, 14, 5, 0, 1, 2])  # only depth 1 is banned: 3 is allowed
    assert banned_for(2) == DraftTree.chain([3])  # 15 at depth 2 is banned
    assert banned_for(5) == DraftTree.chain([3])
    assert banned_for(2, topk=2) == DraftTree.chain([3])  # trees too
    assert banned_for(1_000).tokens == (3,)
    stop_later = [1, 2, 3, 4, 14, 5, 0, 1, 2]  # the stop id at depth 3
    assert banned_for(3, tokens=stop_later) == DraftTree.chain([3, 4])
    assert banned_for(2, tokens=stop_later) == DraftTree.chain([3, 4, 14, 5, 0, 1, 2])
