"""Request slot table: which per-request executor buffer rows are taken."""

from __future__ import annotations

import heapq


class SlotTable:
    """Hands out request slots ``0 .. num_slots - 1``, lowest free slot first.

    A slot indexes per-request executor buffers (page-table row, sampling state). Lowest-first keeps the
    occupied rows dense at the front, and makes slot assignment reproducible. Releasing a slot that is
    not held raises ``ValueError``: two requests sharing a row would read each other's state.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self._num_total = num_slots
        self._free_heap: list[int] = list(range(num_slots))
        self._in_use: set[int] = set()

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    def in_use(self) -> frozenset[int]:
        """The slots currently held (a snapshot)."""
        return frozenset(self._in_use)

    def acquire(self) -> int:
        """Take the lowest free slot; raises RuntimeError when every slot is held."""
        if not self._free_heap:
            raise RuntimeError(f"all {self._num_total} request slots are in use")
        slot = heapq.heappop(self._free_heap)
        self._in_use.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give ``slot`` back; raises ValueError if it is out of range or not held."""
        if not 0 <= slot < self._num_total:
            raise ValueError(f"slot {slot} is out of range [0, {self._num_total})")
        if slot not in self._in_use:
            raise ValueError(f"double release of slot {slot}")
        self._in_use.remove(slot)
        heapq.heappush(self._free_heap, slot)
