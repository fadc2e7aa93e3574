"""The services on private event loops in background threads, for tests that need a real server in their process.

Each is the shipped server (real gRPC on a loopback port), only started on a thread of its own instead of as the
service's process; the caller keeps owning what it passes in (the engine, the runner, the compiler).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from engine.executor.runner import ModelRunner
from engine.grammar import ConstraintCompiler, EnforcementObserver, GrammarRegistry
from engine.scheduler.engine import Engine
from services.executor.server import start_executor
from services.grammar.server import GrammarServiceConfig, start_grammar
from services.scheduler.server import SchedulerServer
from services.scheduler.servicer import ServicerOptions

_T = TypeVar("_T")


class ThreadedServer:
    """A :class:`SchedulerServer` on its own event loop thread, for tests and for embedding in sync code."""

    def __init__(
        self,
        engine: Engine,
        served_model_name: str | None = None,
        executor: str | None = None,
        grammar: str | None = None,
        options: ServicerOptions | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scheduler-grpc", daemon=True)
        self._engine = engine
        self._name = served_model_name
        self._executor = executor
        self._grammar = grammar
        self._options = options
        self.server: SchedulerServer | None = None
        self.port = 0

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> int:
        self._thread.start()
        self.server = self._call(self._create(), timeout)
        self.port = self._call(self.server.start(host, port), timeout)
        return self.port

    async def _create(self) -> SchedulerServer:
        # Built on the server's loop: grpc.aio and the health servicer bind to the loop they are created on.
        return SchedulerServer(self._engine, self._name, self._executor, self._grammar, self._options)

    def stop(self, grace: float | None = 1.0, timeout: float = 30.0) -> None:
        if not self._thread.is_alive():
            return
        if self.server is not None:
            self._call(self.server.stop(grace), timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ExecutorThread:
    """An executor served from a private event loop on a background thread (in-process setups and tests).

    The caller keeps owning ``runner`` (and shuts it down after :meth:`stop`)."""

    def __init__(self, runner: ModelRunner, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> None:
        self._timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ordinal-executor-grpc", daemon=True)
        self._thread.start()
        start = asyncio.run_coroutine_threadsafe(start_executor(runner, host, port), self._loop)
        self.server = start.result(timeout)
        self.port = self.server.port

    def stop(self, grace: float = 1.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(self._timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self._timeout)
        if not self._thread.is_alive():
            self._loop.close()


class GrammarThread:
    """A grammar service on a private event loop in a background thread (in-process setups and tests).

    The caller keeps owning ``compiler`` (and shuts it down after :meth:`stop`).
    """

    def __init__(
        self,
        compiler: ConstraintCompiler,
        host: str = "127.0.0.1",
        port: int = 0,
        config: GrammarServiceConfig | None = None,
        timeout: float = 30.0,
        observer: EnforcementObserver | None = None,
    ) -> None:
        self._timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ordinal-grammar-grpc", daemon=True)
        self._thread.start()
        started = start_grammar(compiler, host, port, config or GrammarServiceConfig(), observer)
        start = asyncio.run_coroutine_threadsafe(started, self._loop)
        self.server = start.result(timeout)
        self.port = self.server.port

    @property
    def registry(self) -> GrammarRegistry:
        return self.server.servicer.registry

    def freeze(self, timeout: float = 30.0) -> threading.Event:
        """Block the service's event loop until the returned event is set (at most ``timeout``): the service then
        answers nothing, as a stopped process or a stalled host, while its connections stay open."""
        thaw = threading.Event()
        self._loop.call_soon_threadsafe(thaw.wait, timeout)
        return thaw

    def stop(self, grace: float = 1.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(self._timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self._timeout)
        if not self._thread.is_alive():
            self._loop.close()
