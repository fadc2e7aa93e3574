"""Radix prefix cache: lets a new request reuse the KV pages of earlier requests with the same token prefix.

Bookkeeping only (page ids); the page tensors live elsewhere. Sharing is page-granular: a page is shared
only when all ``page_size`` tokens it holds match, so tree edges always hold a whole number of pages.

Page ownership, the contract with the caller (the scheduler):

* ``match`` neither locks nor transfers anything. Its pages stay owned by the cache. To use them a caller
  must ``lock(match.node)`` right away, before any ``insert`` or ``evict`` (an unlocked match may be
  evicted or trimmed by either), and ``unlock`` it exactly once when the request ends.
* Pages a caller allocates itself are private to it. ``insert(token_ids, pages)`` hands the cache the
  pages it stores; the returned list is every page of ``pages`` it did *not* take, which stays owned by
  the caller (typically the caller frees them). Pages of ``pages`` that already are the cached page for
  their position (the locked matched prefix) are neither taken again nor returned.
* ``evict`` frees unlocked cached pages back to the allocator.

So at every point: allocator free + pages privately owned by requests + ``num_cached`` == total pages,
and ``num_evictable + num_locked == num_cached``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv.allocator import PageAllocator


class RadixNode:
    """A node of the radix tree; opaque to callers, who only pass it back to ``lock``/``unlock``.

    The node owns the edge from its parent: ``key`` (a multiple of page_size tokens) and the pages that
    hold them. ``lock_ref`` counts the locks on this node or any descendant, so a locked path stays
    locked up to the root. A node removed from the tree has ``parent is None`` (like the root).
    """

    __slots__ = ("children", "key", "last_access", "lock_ref", "pages", "parent")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None, last_access: int) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        # Keyed by the child's first page of tokens: siblings always differ in it, else they would share
        # a whole page and be merged into one edge.
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = last_access


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached page-aligned prefix of a query: its length, its pages, and the node to lock."""

    num_tokens: int
    pages: tuple[int, ...]
    node: RadixNode


class RadixPrefixCache:
    """Page-granular radix tree from token-id prefixes to the KV pages holding them, with LRU eviction.

    See the module docstring for who owns which page. Recency uses a logical clock (one tick per
    ``match``/``insert``), not wall time, so eviction order is deterministic. Evictable leaves sit in a
    lazy min-heap keyed by recency; stale entries are skipped when popped and the heap is rebuilt when
    stale entries dominate it.
    """

    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._page_size = page_size
        self._allocator = allocator
        self._root = RadixNode((), [], None, 0)
        self._clock = 0
        self._heap_seq = 0  # tie-break among equal recency: first pushed, first evicted
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._num_nodes = 1
        self._cached: set[int] = set()
        self._num_locked = 0
        self._hit_tokens = 0
        self._query_tokens = 0

    # ---- counters -------------------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_cached(self) -> int:
        """Pages owned by the cache, locked or not."""
        return len(self._cached)

    @property
    def num_locked(self) -> int:
        """Cached pages on a path some live request has locked."""
        return self._num_locked

    @property
    def num_evictable(self) -> int:
        """Cached pages no request holds; every one of them can be freed by ``evict``."""
        return len(self._cached) - self._num_locked

    @property
    def hit_tokens(self) -> int:
        """Sum of ``PrefixMatch.num_tokens`` over the matches that recorded stats."""
        return self._hit_tokens

    @property
    def query_tokens(self) -> int:
        """Sum of ``len(token_ids)`` over the matches that recorded stats (hit rate = hit / query)."""
        return self._query_tokens

    def is_cached(self, page: int) -> bool:
        """Whether the cache owns ``page``."""
        return page in self._cached

    # ---- lookup ---------------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], *, record_stats: bool = True) -> PrefixMatch:
        """Longest cached prefix of ``token_ids`` made of whole pages; never locks.

        Only the first ``len(token_ids) // page_size`` pages can match, so a caller caps the match by
        passing a shorter sequence. Contract: a request must keep at least one token to prefill (its
        logits come from that forward pass), so the scheduler passes ``token_ids[:-1]``. Marks the
        matched path as just used. If the match ends inside an edge, the edge is split there so that
        ``node`` covers exactly the matched pages. ``record_stats=False`` keeps a re-check of a request
        already counted (say, a retried admission) out of the hit-rate counters.
        """
        page_size = self._page_size
        num_query_pages = len(token_ids) // page_size
        key = tuple(token_ids[: num_query_pages * page_size])
        clock = self._tick()
        node, pos, pages = self._root, 0, []
        node.last_access = clock
        while pos < len(key):
            child = node.children.get(key[pos : pos + page_size])
            if child is None:
                break
            num_same = self._num_same_pages(child.key, key, pos)
            if num_same < len(child.pages):
                child = self._split(child, num_same)
            child.last_access = clock
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        self._push_if_evictable(node)
        if record_stats:
            self._query_tokens += len(token_ids)
            self._hit_tokens += pos
        return PrefixMatch(num_tokens=pos, pages=tuple(pages), node=node)

    # ---- locking --------------------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect the pages from the root to ``node`` from eviction (one reference per call)."""
        self._check_attached(node)
        current: RadixNode | None = node
        while current is not None:
            if current.lock_ref == 0:
                self._num_locked += len(current.pages)
            current.lock_ref += 1
            current = current.parent

    def unlock(self, node: RadixNode) -> None:
        """Drop one reference taken by ``lock``; raises ValueError if ``node`` holds none."""
        self._check_attached(node)
        if node.lock_ref <= 0:
            raise ValueError("unlock of a prefix-cache node that is not locked")
        current: RadixNode | None = node
        while current is not None:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self._num_locked -= len(current.pages)
            current = current.parent
        self._push_if_evictable(node)

    # ---- insertion ------------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Store the page-aligned prefix of ``token_ids``; returns the pages of ``pages`` not taken.

        ``pages[i]`` holds tokens ``[i * page_size, (i + 1) * page_size)``; the first
        ``len(token_ids) // page_size`` of them are the aligned part. The cache takes ownership of the
        aligned pages whose prefix was not cached yet. It returns, in order, the caller's pages that
        duplicate an already cached prefix plus every page beyond the aligned part (e.g. a partly filled
        last page); the caller still owns those and must free or keep them. A page of ``pages`` that is
        already the cached page for its own position is neither taken nor returned. Raises ValueError,
        taking no page, if ``pages`` repeats a page, holds a free page, or holds a page cached elsewhere.
        """
        page_size = self._page_size
        num_aligned = len(token_ids) // page_size
        if len(pages) < num_aligned:
            raise ValueError(f"{num_aligned} full pages of tokens but only {len(pages)} pages given")
        own_pages = list(pages)
        self._check_insert_pages(own_pages)
        key = tuple(token_ids[: num_aligned * page_size])
        clock = self._tick()
        node, index, rejected = self._root, 0, []
        node.last_access = clock
        while index < num_aligned:
            child = node.children.get(key[index * page_size : (index + 1) * page_size])
            if child is None:
                break
            num_same = self._num_same_pages(child.key, key, index * page_size)
            if num_same < len(child.pages):
                child = self._split(child, num_same)
            for own, cached in zip(own_pages[index : index + num_same], child.pages, strict=True):
                if own != cached:
                    rejected.append(own)
            child.last_access = clock
            index += num_same
            node = child
        new_pages = own_pages[index:num_aligned]
        returned = rejected + own_pages[num_aligned:]
        self._check_not_cached(new_pages + returned)
        if new_pages:
            node = self._add_leaf(node, key[index * page_size :], new_pages, clock)
        self._push_if_evictable(node)
        return returned

    # ---- eviction -------------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unlocked cached pages, least recently used leaves first.

        A leaf is trimmed from its tail when only part of it is needed, so exactly ``num_pages`` are
        freed unless fewer are evictable. Returns the number of pages freed.
        """
        if num_pages < 0:
            raise ValueError(f"cannot evict a negative number of pages ({num_pages})")
        freed: list[int] = []
        while len(freed) < num_pages and self._heap:
            access, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node) or node.last_access != access:
                continue  # stale entry: the node was used, locked, grew children or left the tree
            wanted = num_pages - len(freed)
            if wanted < len(node.pages):
                freed.extend(self._trim_tail(node, wanted))
                self._push_if_evictable(node)
            else:
                freed.extend(node.pages)
                self._remove_leaf(node)
        self._cached.difference_update(freed)
        self._allocator.free(freed)
        return len(freed)

    # ---- self-check -----------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken internal invariant, if any (O(tree size))."""
        seen_pages: set[int] = set()
        num_nodes, num_locked = 0, 0
        heap_entries = {(id(node), access) for access, _, node in self._heap}
        stack = [self._root]
        _require(self._root.parent is None and not self._root.pages, "root must be parentless and empty")
        while stack:
            node = stack.pop()
            num_nodes += 1
            self._check_node(node, heap_entries)
            if node.lock_ref > 0:
                num_locked += len(node.pages)
            for page in node.pages:
                _require(page not in seen_pages, f"page {page} is held by two nodes")
                _require(not self._allocator.is_free(page), f"cached page {page} is free in the allocator")
                seen_pages.add(page)
            stack.extend(node.children.values())
        _require(seen_pages == self._cached, "cached-page set differs from the pages in the tree")
        _require(num_nodes == self._num_nodes, f"node count {self._num_nodes} != {num_nodes} in tree")
        _require(num_locked == self._num_locked, f"locked pages {self._num_locked} != {num_locked} counted")
        _require(self._num_locked <= len(self._cached), "more locked pages than cached pages")
        _require(self.num_evictable + self.num_locked == self.num_cached, "evictable + locked != cached")
        _require(0 <= self._hit_tokens <= self._query_tokens, "hit tokens outside [0, query tokens]")

    def _check_node(self, node: RadixNode, heap_entries: set[tuple[int, int]]) -> None:
        page_size = self._page_size
        _require(node.lock_ref >= 0, f"negative lock count {node.lock_ref}")
        _require(len(node.key) == len(node.pages) * page_size, "edge key is not pages * page_size tokens")
        child_locks = 0
        for first, child in node.children.items():
            _require(child.parent is node, "child does not point back to its parent")
            _require(len(child.pages) >= 1, "non-root node without pages")
            _require(first == child.key[:page_size], "child is filed under the wrong first page")
            _require(child.last_access <= node.last_access, "child used more recently than its parent")
            child_locks += child.lock_ref
        _require(node.lock_ref >= child_locks, "lock count below the sum of its children's")
        if node is not self._root and self._is_evictable_leaf(node):
            _require((id(node), node.last_access) in heap_entries, "evictable leaf missing from the heap")

    # ---- internals ------------------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _num_same_pages(self, edge_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Whole pages on which ``edge_key`` and ``key[pos:]`` agree; the first is known to agree."""
        page_size = self._page_size
        limit = min(len(edge_key), len(key) - pos) // page_size
        num_same = 1
        while num_same < limit:
            start = num_same * page_size
            if edge_key[start : start + page_size] != key[pos + start : pos + start + page_size]:
                break
            num_same += 1
        return num_same

    def _split(self, child: RadixNode, num_pages: int) -> RadixNode:
        """Cut ``child``'s edge after ``num_pages`` pages; returns the new upper node.

        ``child`` keeps the lower part, so handles to it (possibly locked) still mean the same path. The
        upper node inherits the lock count and recency: every lock and use through ``child`` went
        through the upper part as well.
        """
        parent = child.parent
        assert parent is not None  # only attached, non-root nodes are split
        cut = num_pages * self._page_size
        upper = RadixNode(child.key[:cut], child.pages[:num_pages], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        child.key, child.pages, child.parent = child.key[cut:], child.pages[num_pages:], upper
        upper.children[child.key[: self._page_size]] = child
        parent.children[upper.key[: self._page_size]] = upper
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: RadixNode, key: tuple[int, ...], pages: list[int], clock: int) -> RadixNode:
        leaf = RadixNode(key, pages, parent, clock)
        parent.children[key[: self._page_size]] = leaf
        self._cached.update(pages)
        self._num_nodes += 1
        return leaf

    def _trim_tail(self, leaf: RadixNode, num_pages: int) -> list[int]:
        cut = leaf.pages[-num_pages:]
        del leaf.pages[-num_pages:]
        leaf.key = leaf.key[: len(leaf.pages) * self._page_size]
        return cut

    def _remove_leaf(self, leaf: RadixNode) -> None:
        parent = leaf.parent
        assert parent is not None  # the heap only yields attached, non-root leaves
        del parent.children[leaf.key[: self._page_size]]
        leaf.parent = None
        self._num_nodes -= 1
        self._push_if_evictable(parent)

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push_if_evictable(self, node: RadixNode) -> None:
        if not self._is_evictable_leaf(node):
            return
        self._heap_seq += 1
        heapq.heappush(self._heap, (node.last_access, self._heap_seq, node))
        # Stale entries pile up as leaves get reused; rebuilding once they outnumber the nodes keeps the
        # heap O(tree size) at amortized O(1) cost per push.
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        # Keep only live entries, one per leaf, in their original push order so tie-breaks don't change.
        live: dict[int, tuple[int, int, RadixNode]] = {}
        for entry in sorted(self._heap, key=lambda e: e[1]):
            access, _, node = entry
            if self._is_evictable_leaf(node) and node.last_access == access:
                live.setdefault(id(node), entry)
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self._root and node.parent is None:
            raise ValueError("prefix-cache node was evicted (lock a match before any insert or evict)")

    def _check_insert_pages(self, pages: list[int]) -> None:
        if len(set(pages)) != len(pages):
            raise ValueError(f"insert got a page twice: {pages}")
        for page in pages:
            if self._allocator.is_free(page):
                raise ValueError(f"insert got page {page}, which is free in the allocator")

    def _check_not_cached(self, pages: list[int]) -> None:
        for page in pages:
            if page in self._cached:
                raise ValueError(f"page {page} is already cached for another position")


def _require(condition: bool, message: str) -> None:
    # Not `assert`: invariant checks must still run under `python -O`.
    if not condition:
        raise AssertionError(message)
