"""Tests of the radix prefix cache, alone and together with the page allocator (stateful property test)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv.allocator import PageAllocator
from engine.kv.prefix_cache import RadixNode, RadixPrefixCache


def make_cache(num_pages: int = 32, page_size: int = 2) -> tuple[PageAllocator, RadixPrefixCache]:
    allocator = PageAllocator(num_pages)
    return allocator, RadixPrefixCache(page_size, allocator)


def cache_tokens(cache: RadixPrefixCache, allocator: PageAllocator, token_ids: Sequence[int]) -> list[int]:
    """Allocate pages for ``token_ids`` as a request would and insert them; returns its page table."""
    num_pages = -(-len(token_ids) // cache.page_size)
    pages = allocator.alloc(num_pages)
    allocator.free(cache.insert(token_ids, pages))
    return pages


# ---- match / insert ---------------------------------------------------------------------------------


def test_empty_cache_matches_nothing() -> None:
    _, cache = make_cache()
    result = cache.match([1, 2, 3, 4])
    assert (result.num_tokens, result.pages) == (0, ())
    cache.lock(result.node)  # locking the root is allowed and harmless
    cache.unlock(result.node)
    cache.check_invariants()


def test_match_is_page_aligned_and_does_not_lock() -> None:
    allocator, cache = make_cache(page_size=2)
    pages = cache_tokens(cache, allocator, [1, 2, 3, 4, 5, 6])
    result = cache.match([1, 2, 3, 4, 5])  # the 5 alone is half a page
    assert (result.num_tokens, result.pages) == (4, tuple(pages[:2]))
    assert cache.num_locked == 0
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).pages == tuple(pages)
    assert cache.match([1, 9]).num_tokens == 0
    cache.check_invariants()


def test_caller_keeps_one_token_by_matching_all_but_the_last() -> None:
    allocator, cache = make_cache(page_size=2)
    pages = cache_tokens(cache, allocator, [1, 2, 3, 4])
    prompt = [1, 2, 3, 4]
    result = cache.match(prompt[:-1])
    assert result.num_tokens == 2 < len(prompt)
    assert result.pages == (pages[0],)


def test_insert_returns_pages_beyond_the_aligned_part() -> None:
    allocator, cache = make_cache(page_size=4)
    pages = allocator.alloc(3)
    returned = cache.insert([7] * 10, pages)  # 2 full pages, the third holds 2 tokens
    assert returned == [pages[2]]
    assert cache.num_cached == 2
    assert cache.is_cached(pages[0]) and cache.is_cached(pages[1]) and not cache.is_cached(pages[2])
    cache.check_invariants()


def test_duplicate_insert_returns_every_page() -> None:
    allocator, cache = make_cache(page_size=2)
    first = cache_tokens(cache, allocator, [1, 2, 3, 4])
    second = allocator.alloc(2)
    assert cache.insert([1, 2, 3, 4], second) == second
    assert cache.match([1, 2, 3, 4]).pages == tuple(first)
    allocator.free(second)
    assert allocator.num_free + cache.num_cached == allocator.num_total
    cache.check_invariants()


def test_insert_of_own_matched_pages_takes_only_the_new_tail() -> None:
    allocator, cache = make_cache(page_size=2)
    prefix_pages = cache_tokens(cache, allocator, [1, 2, 3, 4])
    result = cache.match([1, 2, 3, 4, 5, 6, 7])
    cache.lock(result.node)
    tail = allocator.alloc(2)
    returned = cache.insert([1, 2, 3, 4, 5, 6, 7], [*result.pages, *tail])
    cache.unlock(result.node)
    assert returned == [tail[1]]  # the half-filled last page stays the caller's
    assert cache.match([1, 2, 3, 4, 5, 6]).pages == (*prefix_pages, tail[0])
    cache.check_invariants()


def test_insert_splits_an_edge_where_keys_diverge() -> None:
    allocator, cache = make_cache(page_size=2)
    a_pages = cache_tokens(cache, allocator, [1, 2, 3, 4, 5, 6])
    b_pages = allocator.alloc(3)
    returned = cache.insert([1, 2, 3, 4, 8, 8], b_pages)
    assert returned == b_pages[:2]  # the first two pages duplicate A's
    allocator.free(returned)
    assert cache.match([1, 2, 3, 4, 8, 8]).pages == (a_pages[0], a_pages[1], b_pages[2])
    assert cache.match([1, 2, 3, 4, 5, 6]).pages == tuple(a_pages)
    assert cache.num_cached == 4
    cache.check_invariants()


def test_match_splits_so_the_node_covers_exactly_the_match() -> None:
    allocator, cache = make_cache(page_size=2)
    pages = cache_tokens(cache, allocator, [1, 2, 3, 4, 5, 6, 7, 8])
    result = cache.match([1, 2, 3, 4, 9, 9])
    assert result.pages == tuple(pages[:2])
    cache.lock(result.node)
    assert cache.num_locked == 2
    assert cache.evict(10) == 2  # only the unmatched half of the edge could go
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).pages == tuple(pages[:2])
    assert allocator.is_free(pages[2]) and allocator.is_free(pages[3])
    cache.check_invariants()


def test_a_locked_handle_survives_a_split_above_it() -> None:
    allocator, cache = make_cache(page_size=2)
    cache_tokens(cache, allocator, [1, 2, 3, 4, 5, 6])
    held = cache.match([1, 2, 3, 4, 5, 6])
    cache.lock(held.node)
    cache.match([1, 2, 9, 9])  # splits the edge above the locked node
    cache.check_invariants()
    assert cache.num_locked == 3
    cache.unlock(held.node)
    assert (cache.num_locked, cache.num_evictable) == (0, 3)
    cache.check_invariants()


def test_insert_rejects_inconsistent_pages() -> None:
    allocator, cache = make_cache(page_size=2)
    cached = cache_tokens(cache, allocator, [1, 2])
    mine = allocator.alloc(2)
    with pytest.raises(ValueError, match="only 1 pages"):
        cache.insert([5, 6, 7, 8], mine[:1])
    with pytest.raises(ValueError, match="twice"):
        cache.insert([5, 6, 7, 8], [mine[0], mine[0]])
    with pytest.raises(ValueError, match="free in the allocator"):
        cache.insert([5, 6], [allocator.num_total - 1])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert([5, 6, 7, 8], [mine[0], cached[0]])
    assert cache.num_cached == 1
    cache.check_invariants()


# ---- lock / unlock / evict --------------------------------------------------------------------------


def test_lock_protects_from_evict_and_unlock_releases() -> None:
    allocator, cache = make_cache(page_size=2)
    pages = cache_tokens(cache, allocator, [1, 2, 3, 4])
    result = cache.match([1, 2, 3, 4])
    cache.lock(result.node)
    cache.lock(result.node)  # two requests share the prefix
    assert (cache.num_locked, cache.num_evictable) == (2, 0)
    assert cache.evict(2) == 0
    cache.unlock(result.node)
    assert cache.evict(2) == 0
    cache.unlock(result.node)
    assert (cache.num_locked, cache.num_evictable) == (0, 2)
    assert cache.evict(5) == 2
    assert all(allocator.is_free(p) for p in pages)
    assert cache.num_cached == 0
    cache.check_invariants()


def test_unlock_below_zero_raises() -> None:
    allocator, cache = make_cache(page_size=2)
    cache_tokens(cache, allocator, [1, 2])
    result = cache.match([1, 2])
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(result.node)
    cache.lock(result.node)
    cache.unlock(result.node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(result.node)
    cache.check_invariants()


def test_lock_of_an_evicted_node_raises() -> None:
    allocator, cache = make_cache(page_size=2)
    cache_tokens(cache, allocator, [1, 2])
    result = cache.match([1, 2])
    cache.evict(1)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(result.node)


def test_evict_takes_least_recently_used_leaves_first() -> None:
    allocator, cache = make_cache(page_size=2)
    old = cache_tokens(cache, allocator, [1, 1])
    mid = cache_tokens(cache, allocator, [2, 2])
    new = cache_tokens(cache, allocator, [3, 3])
    cache.match([1, 1])  # `old` becomes the most recently used
    assert cache.evict(1) == 1
    assert allocator.is_free(mid[0]) and not allocator.is_free(old[0])
    assert cache.evict(1) == 1
    assert allocator.is_free(new[0]) and not allocator.is_free(old[0])
    cache.check_invariants()


def test_evict_trims_a_leaf_from_its_tail_and_then_frees_parents() -> None:
    allocator, cache = make_cache(page_size=2)
    shared = cache_tokens(cache, allocator, [1, 2, 3, 4])
    branch = cache_tokens(cache, allocator, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.num_cached == 4
    assert cache.evict(1) == 1  # the deepest page goes first, its prefix stays usable
    assert allocator.is_free(branch[3])
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 6
    cache.check_invariants()
    assert cache.evict(10) == 3
    assert all(allocator.is_free(p) for p in shared + branch[2:3])
    assert cache.num_cached == 0
    cache.check_invariants()


def test_evict_negative_raises() -> None:
    _, cache = make_cache()
    with pytest.raises(ValueError):
        cache.evict(-1)


def test_heap_stays_bounded_under_repeated_matches() -> None:
    allocator, cache = make_cache(page_size=2)
    first = cache_tokens(cache, allocator, [1, 1])
    cache_tokens(cache, allocator, [2, 2])
    for _ in range(500):
        cache.match([1, 1])
    assert len(cache._heap) <= 2 * 3 + 64  # lazy entries are compacted, not left to pile up
    cache.check_invariants()
    assert cache.evict(1) == 1
    assert not allocator.is_free(first[0])  # LRU order survived the compactions


# ---- counters and the invariant checker --------------------------------------------------------------


def test_hit_and_query_token_counters() -> None:
    allocator, cache = make_cache(page_size=2)
    cache_tokens(cache, allocator, [1, 2, 3, 4])
    cache.match([1, 2, 3])
    cache.match([5, 6])
    cache.match([1, 2, 3, 4], record_stats=False)
    assert (cache.hit_tokens, cache.query_tokens) == (2, 5)


def test_check_invariants_detects_corruption() -> None:
    allocator, cache = make_cache(page_size=2)
    cache_tokens(cache, allocator, [1, 2, 3, 4])
    result = cache.match([1, 2, 3, 4])
    result.node.lock_ref = 1  # a lock that bypassed lock(): its ancestors and the counts miss it
    with pytest.raises(AssertionError, match="lock count"):
        cache.check_invariants()
    result.node.lock_ref = 0
    cache.check_invariants()
    allocator.free([result.pages[0]])  # a cached page freed behind the cache's back
    with pytest.raises(AssertionError, match="free in the allocator"):
        cache.check_invariants()


# ---- stateful property test: allocator + cache under simulated requests ------------------------------


@dataclass
class SimRequest:
    """A live simulated request: its tokens, the locked match, and its page table."""

    tokens: list[int]
    node: RadixNode
    matched: list[int]  # cached pages it holds locked
    private: list[int] = field(default_factory=list)  # pages it allocated itself

    @property
    def page_table(self) -> list[int]:
        return self.matched + self.private


# Requests often open with one of a few shared "system prompts" so that prefixes collide often.
SHARED_OPENINGS = [(), (0, 0, 0, 0), (1, 0, 1, 0, 1, 0), (0, 0, 0, 0, 1, 1, 1, 1)]
TOKENS = st.builds(
    lambda opening, tail: [*opening, *tail],
    st.sampled_from(SHARED_OPENINGS),
    st.lists(st.integers(0, 1), min_size=1, max_size=8),
)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests start (match + lock + alloc), decode (grow), finish (insert + free + unlock); evictions.

    The oracle: ``content`` (page -> the tokens its owner wrote into it) and ``model`` (page-aligned
    prefix -> the cached page holding its last page), kept from what the test itself did.
    """

    def __init__(self) -> None:
        super().__init__()
        self.page_size = 2
        self.allocator = PageAllocator(0)
        self.cache = RadixPrefixCache(self.page_size, self.allocator)
        self.live: dict[int, SimRequest] = {}
        self.next_id = 0
        self.content: dict[int, tuple[int, ...]] = {}
        self.model: dict[tuple[int, ...], int] = {}
        self.expected_hits = 0
        self.expected_queries = 0

    @initialize(page_size=st.sampled_from([2, 4]), num_pages=st.integers(6, 32))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixPrefixCache(page_size, self.allocator)

    # -- helpers --

    def chunk(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        return tuple(tokens[index * self.page_size : (index + 1) * self.page_size])

    def check_match(self, query: Sequence[int], num_tokens: int, pages: Sequence[int]) -> None:
        expected: list[int] = []
        while (len(expected) + 1) * self.page_size <= len(query):
            prefix = tuple(query[: (len(expected) + 1) * self.page_size])
            if prefix not in self.model:
                break
            expected.append(self.model[prefix])
        assert list(pages) == expected, "match is not the longest cached prefix"
        assert num_tokens == len(pages) * self.page_size
        for index, page in enumerate(pages):
            assert self.content[page] == self.chunk(query, index), f"page {page} holds other tokens"

    def match(self, query: Sequence[int]) -> tuple[int, tuple[int, ...], RadixNode]:
        result = self.cache.match(query)
        self.expected_queries += len(query)
        self.expected_hits += result.num_tokens
        self.check_match(query, result.num_tokens, result.pages)
        return result.num_tokens, result.pages, result.node

    def evict(self, num_pages: int) -> None:
        evictable = self.cache.num_evictable
        freed = self.cache.evict(num_pages)
        assert freed == min(num_pages, evictable)
        gone = [prefix for prefix, page in self.model.items() if self.allocator.is_free(page)]
        for prefix in gone:
            self.content.pop(self.model.pop(prefix))
        assert len(gone) == freed

    def make_room(self, num_pages: int) -> bool:
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.evict(short)
        return self.allocator.num_free >= num_pages

    def pick(self, index: int) -> int:
        return sorted(self.live)[index % len(self.live)]

    # -- rules --

    @rule(tokens=TOKENS)
    def start(self, tokens: list[int]) -> None:
        _, matched, node = self.match(tokens[:-1])  # keep >= 1 token to prefill
        self.cache.lock(node)
        need = -(-len(tokens) // self.page_size) - len(matched)
        if not self.make_room(need):
            self.cache.unlock(node)
            return
        request = SimRequest(tokens, node, list(matched), self.allocator.alloc(need))
        for index in range(len(matched), len(request.page_table)):
            self.content[request.page_table[index]] = self.chunk(tokens, index)
        self.live[self.next_id] = request
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99), new_tokens=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def decode(self, index: int, new_tokens: list[int]) -> None:
        request = self.live[self.pick(index)]
        tokens = request.tokens + new_tokens
        need = -(-len(tokens) // self.page_size) - len(request.page_table)
        if not self.make_room(need):
            return
        request.private += self.allocator.alloc(need)
        request.tokens = tokens
        for index_ in range(len(request.matched), len(request.page_table)):
            self.content[request.page_table[index_]] = self.chunk(tokens, index_)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99))
    def finish(self, index: int) -> None:
        request = self.live.pop(self.pick(index))
        num_aligned = len(request.tokens) // self.page_size
        expected_returned = []
        for position, page in enumerate(request.page_table[:num_aligned]):
            prefix = tuple(request.tokens[: (position + 1) * self.page_size])
            if prefix not in self.model:
                self.model[prefix] = page
            elif self.model[prefix] != page:
                expected_returned.append(page)
        expected_returned += request.page_table[num_aligned:]
        returned = self.cache.insert(request.tokens, request.page_table)
        assert returned == expected_returned
        self.allocator.free(returned)
        for page in returned:
            del self.content[page]
        self.cache.unlock(request.node)

    @rule(num_pages=st.integers(0, 8))
    def evict_pages(self, num_pages: int) -> None:
        self.evict(num_pages)

    @rule(tokens=TOKENS)
    def probe(self, tokens: list[int]) -> None:
        self.match(tokens)

    # -- invariants --

    @invariant()
    def pages_have_exactly_one_owner(self) -> None:
        private = [page for request in self.live.values() for page in request.private]
        private_set = set(private)
        assert len(private) == len(private_set), "a page is private to two requests"
        total = self.allocator.num_total
        assert self.allocator.num_free + len(private) + self.cache.num_cached == total
        for page in range(total):
            owners = (self.allocator.is_free(page), page in private_set, self.cache.is_cached(page))
            assert sum(owners) == 1, f"page {page} owners (free, private, cached) = {owners}"

    @invariant()
    def cache_matches_the_model(self) -> None:
        cache = self.cache
        assert cache.num_evictable + cache.num_locked == cache.num_cached
        assert len(self.model) == cache.num_cached
        locked = {page for request in self.live.values() for page in request.matched}
        assert cache.num_locked == len(locked)
        for prefix, page in self.model.items():
            assert cache.is_cached(page)
            assert len(prefix) == self.page_size or prefix[: -self.page_size] in self.model
            assert self.content[page] == prefix[-self.page_size :]
        assert (cache.hit_tokens, cache.query_tokens) == (self.expected_hits, self.expected_queries)
        cache.check_invariants()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, derandomize=True, deadline=None
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
