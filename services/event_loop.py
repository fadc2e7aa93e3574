"""The event loop every ordinal service runs on: uvloop where it is installed (a main dependency on Linux).

Why: the scheduler writes one gRPC message per caught-up stream per step, and most of a grpc.aio write that is not
the socket's own syscall is the event loop's bookkeeping (a task step to resume the writer, a future per write, the
completion poller's callback). uvloop does that bookkeeping in C: back to back on this machine, the scheduler's CPU per
decode step at 128 streams (bench/host_overhead.py) read 6.10 and 5.97 ms on asyncio's loop, 5.78 and 5.00 on
uvloop (docs/architecture.md "Host overhead"). The asyncio loop remains the fallback where uvloop is not available
(it has no Windows build), with the same behaviour.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new event loop (uvloop's when importable), as :func:`asyncio.run` does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
