"""Page allocator: which KV page ids are free. Bookkeeping only; the page tensors live elsewhere."""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """Fewer free pages than requested; the caller may evict cached pages and retry."""


class PageAllocator:
    """Hands out KV page ids ``0 .. num_pages - 1``.

    ``alloc`` always returns the lowest free ids in ascending order, so a run is reproducible from its
    inputs alone (tests and replays depend on that). Freeing a page that is not allocated raises
    ``ValueError``: a double free means two owners believed they held the page, which would silently
    corrupt another request's KV, so it must be loud.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_total = num_pages
        # A min-heap makes "lowest free first" O(log N) per page; the flags answer is_free in O(1).
        self._free_heap: list[int] = list(range(num_pages))
        self._is_free: list[bool] = [True] * num_pages

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        return self._num_total - len(self._free_heap)

    def is_free(self, page: int) -> bool:
        """Whether ``page`` is free; raises ValueError if it is not a page id of this allocator."""
        self._check_range(page)
        return self._is_free[page]

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages (lowest ids first); all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_heap):
            raise OutOfPagesError(f"requested {n} pages, only {len(self._free_heap)} free")
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the free pool; all or nothing (nothing is freed if any page is invalid)."""
        batch = list(pages)
        seen: set[int] = set()
        for page in batch:
            self._check_range(page)
            if self._is_free[page] or page in seen:
                raise ValueError(f"double free of page {page}")
            seen.add(page)
        for page in batch:
            self._is_free[page] = True
            heapq.heappush(self._free_heap, page)

    def _check_range(self, page: int) -> None:
        if not 0 <= page < self._num_total:
            raise ValueError(f"page {page} is out of range [0, {self._num_total})")
