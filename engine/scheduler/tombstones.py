"""A bounded, expiring record of request ids: aborts that arrived before their request, and requests that ended.

``Generate`` and ``Abort`` are separate RPCs on separate HTTP/2 streams, so a server can see a request's abort before
the request itself (a gateway aborts the moment its own client disconnects, which can be milliseconds after it sent
the request). A tombstone remembers such an abort so that the request, when it arrives, ends at once with finish
reason abort instead of running to its end. The same structure remembers recently ended requests, so that a late
abort can answer "already finished" rather than leave a tombstone for an id that will never come again.

Both are bounded twice: an entry expires ``ttl_s`` after it was recorded, and past ``max_entries`` the oldest goes
first, so a flood of aborts for random ids costs at most ``max_entries`` entries of memory. Entries are kept in the
order they were recorded, which with one TTL is also the order they expire: both bounds cost O(1) amortised.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TombstoneBounds:
    """How many ids are remembered at most, and for how long (seconds)."""

    max_entries: int = 16384
    ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.ttl_s <= 0:
            raise ValueError(f"tombstone bounds must be positive, got {self}")


class Tombstones:
    """Ids with a note each (a reason, a finish), forgotten after ``bounds.ttl_s`` or when ``bounds.max_entries``
    newer ones were recorded. Not thread-safe: one event loop owns it."""

    def __init__(self, bounds: TombstoneBounds | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds if bounds is not None else TombstoneBounds()
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expires at, note)

    def add(self, key: str, note: str) -> None:
        """Remember ``key`` (again: its TTL restarts) and drop what is expired or beyond the count bound."""
        now = self._clock()
        self._entries.pop(key, None)
        self._entries[key] = (now + self.bounds.ttl_s, note)
        self._expire(now)
        while len(self._entries) > self.bounds.max_entries:
            self._entries.popitem(last=False)

    def get(self, key: str) -> str | None:
        """The note of ``key`` if it is remembered and not expired."""
        self._expire(self._clock())
        entry = self._entries.get(key)
        return entry[1] if entry is not None else None

    def pop(self, key: str) -> str | None:
        """Like :meth:`get`, and forget ``key``."""
        self._expire(self._clock())
        entry = self._entries.pop(key, None)
        return entry[1] if entry is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            _, (expires, _) = next(iter(entries.items()))
            if expires > now:
                return
            entries.popitem(last=False)
