"""N-gram prompt lookup: drafts copied from the request's own history, no weights.

For each request the proposer finds the longest suffix of its tokens (prompt then outputs, the last one being the
pending token) of ``max_n`` down to ``min_n`` tokens that occurred earlier in the same tokens, and proposes the
tokens that followed that earlier occurrence. Repetitive output (code edits, quoting the prompt, lists, JSON keys)
is its home ground; elsewhere it simply finds nothing and the request decodes plainly.

Cost. A slot keeps an index of its history: every n-gram (``min_n <= n <= max_n``) mapped to the positions it ended
at, most recent last, at most ``max_occurrences`` per n-gram. A call indexes only the tokens appended since the
last one, so a step costs O(max_n) per new token plus one dictionary look-up per n and O(max_occurrences *
max_depth) to assemble a tree: flat in the history's length, never a scan over it.

Choices (where peers differ):

- Match window 2..4 by default. SGLang accepts 1..12 but merges matches from every request into one frequency
  trie; vLLM matches one n of 5 (its own comment calls the value arbitrary), which misses the short repeats of
  structured output. A single repeated token is weak evidence on its own (it proposes after every common token and
  every such draft costs verify compute), so the default starts at 2; ``min_n=1`` is allowed.
- Chain (``topk == 1``): the most recent occurrence of the longest matching suffix whose continuation has the full
  draft length; when every occurrence runs into the end of the history, the one with the longest continuation
  (the oldest). The most recent occurrence is the best predictor, but in a periodic history its continuation is
  cut short by the end, and a longer one from an earlier period costs nothing more to verify.
- Tree (``topk > 1``): the continuations of up to ``max_occurrences`` earlier occurrences merged into a trie: those
  of the longest matching suffix first, most recent first, then, while fewer than that, those of shorter suffixes.
  A node's weight is the number of occurrences passing through it, where one occurrence of a longer suffix
  outweighs any number of occurrences of shorter ones (longest match first, as for the chain; shorter suffixes
  only add branches); ties go to the most recent occurrence. Nodes are kept best first under the caps (``topk``
  children per node, ``max_nodes`` in all, ``max_depth``), and returned in breadth-first order, each node's
  children best first: the order the verify step tries them in.

Every drafted token is one that really followed an earlier occurrence in the history (a continuation stops at the
pending token, never beyond it), and one the request can emit there: a continuation ends before an eos or stop id
while the request's min_new_tokens bans them. Drafts are deterministic, so ``q`` is None: verification treats them
as one-hot.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from engine.executor.proposer import NO_DRAFT, Draft, DraftRequest
from engine.grammar_calls import DraftTree


@dataclass(frozen=True)
class NgramConfig:
    """Match window ``min_n..max_n`` tokens; ``max_occurrences``: the most past occurrences that feed one tree (and
    the most positions kept per n-gram in a slot's index)."""

    min_n: int = 2
    max_n: int = 4
    max_occurrences: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram window must satisfy 1 <= min_n <= max_n, got {self.min_n}..{self.max_n}")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {self.max_occurrences}")


class _SlotIndex:
    """Where each n-gram of one slot's history ended: positions ``[0, indexed)``, most recent last.

    The last token of the history (the pending one) is never indexed before it is looked up, so every position in
    the index is an *earlier* occurrence of the suffix being matched. ``head`` and ``tail`` (the first and the last
    ``max_n`` indexed tokens) tell cheaply whether a later history still extends the one indexed; a rewrite strictly
    between them goes unnoticed (the runner's histories only grow, and a reused slot is released first)."""

    __slots__ = ("ends", "head", "indexed", "tail")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.indexed = 0
        self.head: tuple[int, ...] = ()
        self.tail: tuple[int, ...] = ()

    def extends(self, tokens: Sequence[int]) -> bool:
        done = self.indexed
        return (
            len(tokens) > done
            and tuple(tokens[: len(self.head)]) == self.head
            and tuple(tokens[done - len(self.tail) : done]) == self.tail
        )

    def extend(self, tokens: Sequence[int], config: NgramConfig) -> None:
        """Index the n-grams ending at every position before the last token not indexed yet."""
        stop = len(tokens) - 1
        if self.indexed >= stop:
            return
        ends, cap, min_n, max_n = self.ends, config.max_occurrences, config.min_n, config.max_n
        for end in range(self.indexed, stop):
            window = tuple(tokens[max(0, end - max_n + 1) : end + 1])  # one copy; each n-gram is a suffix of it
            for n in range(min_n, len(window) + 1):
                key = window[-n:]
                # Tuples of ints, not lists: smaller, and the garbage collector stops tracking them, so a long
                # history's index does not lengthen every full collection of the executor's heap.
                positions = ends.get(key)
                if positions is None:
                    ends[key] = (end,)
                elif len(positions) < cap:
                    ends[key] = (*positions, end)
                else:
                    ends[key] = (*positions[1:], end)  # cap is small: O(cap)
        self.indexed = stop
        self.head = tuple(tokens[:max_n])
        self.tail = tuple(tokens[max(0, stop - max_n) : stop])


class NgramProposer:
    """Prompt-lookup drafts (the :class:`~engine.executor.proposer.Proposer` protocol), one index per slot."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        base = self.config.max_occurrences + 1  # > any count of one tier: the tiers compare lexicographically
        self._weights = {n: base ** (n - self.config.min_n) for n in range(self.config.min_n, self.config.max_n + 1)}
        self._slots: dict[int, _SlotIndex] = {}

    @property
    def num_slots(self) -> int:
        """Slots holding an index (what a leak check counts: zero once every request is released)."""
        return len(self._slots)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._propose(request) for request in requests]

    def accepted(self, slot: int, path: Sequence[int], seq_len: int) -> None:
        """Nothing to catch up on: the accepted tokens arrive in the slot's ``tokens`` at its next draft."""

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def _propose(self, request: DraftRequest) -> Draft:
        tokens = request.tokens
        index = self._slots.get(request.slot)
        if index is None or not index.extends(tokens):
            # A new request in this slot, or a history that is not a continuation of the one indexed (a slot
            # reused without release, a rewritten history): start over rather than draft from someone else's.
            index = self._slots[request.slot] = _SlotIndex()
        index.extend(tokens, self.config)
        length = min(request.max_depth, request.max_nodes)  # of a chain; the most a tree can be deep
        if length < 1 or request.topk < 1:
            return NO_DRAFT
        cut = _Cut.of(request)
        if request.topk == 1:
            return self._chain(tokens, index, length, cut)
        return self._tree(tokens, index, request, cut)

    def _chain(self, tokens: Sequence[int], index: _SlotIndex, length: int, cut: _Cut) -> Draft:
        found = self._longest_match(tokens, index)
        if found is None:
            return NO_DRAFT
        ends = found[1]
        # The most recent occurrence whose continuation is complete (ends <= last - length), else the oldest.
        j = bisect_right(ends, len(tokens) - 1 - length) - 1
        end = ends[j] if j >= 0 else ends[0]
        chain = cut(tokens[end + 1 : end + 1 + length])
        return Draft(DraftTree.chain(chain)) if chain else NO_DRAFT

    def _longest_match(self, tokens: Sequence[int], index: _SlotIndex) -> tuple[int, tuple[int, ...]] | None:
        """(n, end positions) of the longest suffix with an earlier occurrence, or None."""
        size = len(tokens)
        for n in range(min(self.config.max_n, size - 1), self.config.min_n - 1, -1):
            ends = index.ends.get(tuple(tokens[size - n :]))
            if ends:
                return n, ends
        return None

    def _occurrences(self, tokens: Sequence[int], index: _SlotIndex) -> list[tuple[int, int]]:
        """(end position, weight) of up to ``max_occurrences`` earlier occurrences, longest suffix first, most
        recent first within one suffix length; a position counts once, for its longest matching suffix."""
        found = self._longest_match(tokens, index)
        if found is None:
            return []
        size, cap = len(tokens), self.config.max_occurrences
        chosen: list[tuple[int, int]] = []
        seen: set[int] = set()
        for n in range(found[0], self.config.min_n - 1, -1):
            weight = self._weights[n]
            # Non-empty: an occurrence of a suffix is one of every shorter suffix. While fewer than `cap` are chosen,
            # every longer suffix's list was complete, so this one's `cap` most recent positions hold the most recent
            # new ones.
            for end in reversed(index.ends[tuple(tokens[size - n :])]):
                if end not in seen:
                    seen.add(end)
                    chosen.append((end, weight))
                    if len(chosen) == cap:
                        return chosen
        return chosen

    def _tree(self, tokens: Sequence[int], index: _SlotIndex, request: DraftRequest, cut: _Cut) -> Draft:
        occurrences = self._occurrences(tokens, index)
        if not occurrences:
            return NO_DRAFT
        trie = _Trie()
        for rank, (end, weight) in enumerate(occurrences):
            trie.add(cut(tokens[end + 1 : end + 1 + request.max_depth]), weight, rank)
        tree = trie.select(request.topk, request.max_nodes)
        return Draft(tree) if tree.tokens else NO_DRAFT


@dataclass(frozen=True)
class _Cut:
    """Ends a continuation before the first token the request cannot emit at its depth: eos and stop ids at the
    first ``depths`` depths, while min_new_tokens bans them (the verify would reject it and everything after)."""

    banned: tuple[int, ...]  # a few ids: a tuple's membership test is as quick as a set's, without building one
    depths: int

    @classmethod
    def of(cls, request: DraftRequest) -> _Cut:
        return cls(request.sampling.min_new_banned_ids, request.sampling.min_new_left())

    def __call__(self, path: Sequence[int]) -> Sequence[int]:
        for depth in range(min(self.depths, len(path))):
            if path[depth] in self.banned:
                return path[:depth]
        return path


class _Trie:
    """Continuations merged by common prefix; node 0 is the pending token (the root, not drafted)."""

    __slots__ = ("children", "parent", "rank", "token", "weight")

    def __init__(self) -> None:
        self.token = [-1]
        self.parent = [-1]
        self.weight = [0]
        self.rank = [0]  # the best (lowest) rank of the occurrences passing through
        self.children: list[dict[int, int]] = [{}]

    def add(self, path: Sequence[int], weight: int, rank: int) -> None:
        node = 0
        for token in path:
            child = self.children[node].get(token)
            if child is None:
                child = len(self.token)
                self.children[node][token] = child
                self.token.append(token)
                self.parent.append(node)
                self.weight.append(weight)
                self.rank.append(rank)  # occurrences arrive in rank order: the first one is the best
                self.children.append({})
            else:
                self.weight[child] += weight
            node = child

    def select(self, topk: int, max_nodes: int) -> DraftTree:
        """The best nodes under the caps, breadth first, children best first.

        Best first: highest weight, then lowest rank. A child never beats its parent (no more weight, no better
        rank), so popping candidates in that order keeps parents before children and each parent's children in
        order; a candidate whose parent already has ``topk`` children is dropped with its subtree."""
        weight, rank = self.weight, self.rank
        heap = [(-weight[c], rank[c], c) for c in self.children[0].values()]
        heapq.heapify(heap)
        kept: list[list[int]] = [[] for _ in self.token]  # per node: kept children, best first
        count = 0
        while heap and count < max_nodes:
            _, _, node = heapq.heappop(heap)
            siblings = kept[self.parent[node]]
            if len(siblings) == topk:
                continue
            siblings.append(node)
            count += 1
            for child in self.children[node].values():
                heapq.heappush(heap, (-weight[child], rank[child], child))
        tokens: list[int] = []
        parents: list[int] = []
        order = [(child, -1) for child in kept[0]]  # (trie node, its parent's index in the draft)
        for node, parent in order:  # grows while iterated: a breadth-first walk
            parents.append(parent)
            tokens.append(self.token[node])
            order.extend((child, len(tokens) - 1) for child in kept[node])
        return DraftTree(tuple(tokens), tuple(parents))
