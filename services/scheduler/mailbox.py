"""Hand-offs from the engine's loop thread to the service's event loop, batched: one wake-up per burst.

The engine calls each request's sink once per output, on its own thread. Waking the event loop for each of them
(``call_soon_threadsafe``: a write to the loop's self-pipe, then a callback) costs several microseconds per token
per stream; a commit of a 128-stream step produces 128 outputs at once. The :class:`Mailbox` queues them and
schedules one drain for the whole burst, which puts every output into its RPC's :class:`Inbox` on the event loop,
in the order posted. An inbox hands its reader everything delivered since it last looked, in one piece.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Generic, TypeVar

_T = TypeVar("_T")


class Inbox(Generic[_T]):
    """What one RPC has been delivered and not read yet. Event loop only."""

    def __init__(self) -> None:
        self._items: list[_T] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: _T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take_all(self) -> list[_T]:
        """Every item delivered since the last call, waiting for the first one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class Mailbox:
    """Posts items from any thread to the inboxes of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._posted: deque[tuple[Inbox[object], object]] = deque()  # append/popleft are thread-safe
        self._scheduled = False

    def post(self, inbox: Inbox[_T], item: _T) -> None:
        self._posted.append((inbox, item))  # type: ignore[arg-type]
        if self._scheduled:
            return  # a drain is due and will take this item: the flag is cleared before the drain reads
        self._scheduled = True
        # A closed event loop raises RuntimeError: the server is gone and nobody reads these streams any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self._scheduled = False  # first: an item posted from now on schedules the next drain or is taken by this one
        posted = self._posted
        while posted:
            inbox, item = posted.popleft()
            inbox.put(item)
