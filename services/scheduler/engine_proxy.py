"""The scheduler's front end's view of its engine process: the surface of :class:`~engine.scheduler.engine.Engine`
that the servicer uses (submit, abort, stats, the model facts, the health probes), over the engine link.

Event loop only (the front end's), but for the probes, which the servicer calls from worker threads. Nothing here
waits for the engine: ``submit`` and ``abort`` queue a message and return, as ``Engine.submit`` and ``Engine.abort``
do; ``stats`` is the snapshot the engine sent last (with the outputs it describes, so a client told of a finish
reads stats that include it). ``submit`` runs the engine's own admission check (``checked_prompt``) first, so a bad
request is refused here with the engine's message before anything is sent.

If the engine process exits, every request in flight ends at once (finish reason abort, cause EXECUTOR: the
servicer answers UNAVAILABLE naming the engine process), later submits are refused, and :attr:`lost` is set so that
the front end stops too (a scheduler without its engine serves nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import Future

from engine.config import EngineConfig
from engine.constraint import Constraint
from engine.errors import InvalidRequestError
from engine.finish import AbortCause, Finish, FinishReason
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import OutputSink, checked_prompt
from engine.scheduler.request import RequestOutput
from engine.scheduler.scheduler import SchedulerStats
from services.scheduler import engine_link as link

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 15.0  # longer than the executor's and the grammar service's own bounded probes


class EngineProcessError(Exception):
    """The engine process did not start (it exited before it was ready, or took too long)."""


class EngineProcess:
    """A running engine process and the link to it. Build with :meth:`start`; stop with :meth:`close`."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ready: link.Ready,
    ) -> None:
        self._proc = proc
        self._reader = reader
        self._writer = writer
        self.info: ModelInfo = ready.info
        self.config: EngineConfig = ready.config
        self._stats: SchedulerStats = ready.stats
        self._sinks: dict[str, OutputSink] = {}  # engine ids submitted and not finished
        self._loop = asyncio.get_running_loop()
        self._probe_ids = itertools.count()
        self._probes: dict[int, Future[link.ProbeAnswer]] = {}
        self.runner = _ExecutorProbe(self)
        self.grammar: _GrammarProbe | None = _GrammarProbe(self) if ready.has_grammar else None
        self.lost = asyncio.Event()
        self._lost_reason: str | None = None
        self._closing = False
        self._read_task = asyncio.create_task(self._read(), name="engine-link")

    @classmethod
    async def start(cls, argv: Sequence[str], timeout: float) -> EngineProcess:
        """Start ``python -m services.scheduler.engine_process`` with the scheduler's flags ``argv`` and wait (at
        most ``timeout`` seconds) until its engine is up."""
        mine, theirs = socket.socketpair()
        command = [
            sys.executable, "-m", "services.parent_death", str(os.getpid()),
            sys.executable, "-m", "services.scheduler.engine_process", "--link-fd", str(theirs.fileno()), *argv,
        ]  # fmt: skip
        proc = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
        theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=mine)
        try:
            ready = await asyncio.wait_for(_read_message(reader), timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.close()
            code = await _stopped(proc, 5.0)
            why = "did not get ready in time" if isinstance(exc, TimeoutError) else f"exited with code {code}"
            raise EngineProcessError(f"the scheduler's engine process {why} (its log above says why)") from None
        if not isinstance(ready, link.Ready):
            raise EngineProcessError(f"the engine process sent {type(ready).__name__} before Ready")
        return cls(proc, reader, writer, ready)

    @property
    def pid(self) -> int:
        return self._proc.pid

    # ------------------------------------------------------------------------------------ Engine's surface

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: OutputSink,
        request_id: str | None = None,
        constraint: Constraint | None = None,
        with_text: bool = True,
    ) -> str:
        """As ``Engine.submit``: validated here, then queued in the engine process."""
        if self._lost_reason is not None or self._closing:
            raise RuntimeError(f"the engine is shut down ({self._lost_reason or 'the scheduler is stopping'})")
        if constraint is not None and self.grammar is None:
            raise InvalidRequestError("constraint", "this engine was started without a grammar service")
        if request_id is None:
            raise ValueError("the engine process needs the caller's request id")
        prompt = checked_prompt(prompt_ids, params, self.info, self.config)
        if request_id in self._sinks:
            raise InvalidRequestError("request_id", f"a request with id {request_id!r} is already in flight")
        self._sinks[request_id] = sink
        self._writer.write(link.frame(link.Submit(request_id, prompt, params, constraint, with_text)))
        return request_id

    def abort(self, request_id: str, message: str = "aborted by client", cause: AbortCause = AbortCause.CLIENT) -> bool:
        """As ``Engine.abort``: True if the request was in flight; the engine takes it before its next commit."""
        live = request_id in self._sinks
        if live and self._lost_reason is None:
            self._writer.write(link.frame(link.Abort(request_id, message, cause)))
        return live

    def stats(self) -> SchedulerStats:
        return self._stats

    # ------------------------------------------------------------------------------------ lifetime

    async def close(self, timeout: float = 60.0) -> int | None:
        """Tell the engine to shut down (its requests end first) and wait for its exit; kill it past ``timeout``."""
        self._closing = True
        if self._lost_reason is None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._writer.write(link.frame(link.Shutdown()))
                await self._writer.drain()
        code = await _stopped(self._proc, timeout)
        self._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._read_task
        self._writer.close()
        return code

    # ------------------------------------------------------------------------------------ the link

    def probe(self, kind: link.ProbeKind) -> bool | str | None:
        """Ask the engine process (from a worker thread: this waits, at most ``PROBE_TIMEOUT_S``)."""
        if self._lost_reason is not None:
            raise RuntimeError(self._lost_reason)
        probe_id = next(self._probe_ids)
        answer: Future[link.ProbeAnswer] = Future()
        self._probes[probe_id] = answer
        try:
            self._loop.call_soon_threadsafe(self._writer.write, link.frame(link.Probe(probe_id, kind)))
            result = answer.result(timeout=PROBE_TIMEOUT_S)
        finally:
            self._probes.pop(probe_id, None)
        if result.error is not None:
            raise RuntimeError(result.error)
        return result.value

    async def _read(self) -> None:
        try:
            while True:
                message = await _read_message(self._reader)
                if isinstance(message, link.Outputs):
                    self._deliver(message)
                elif isinstance(message, link.ProbeAnswer):
                    answer = self._probes.get(message.probe_id)
                    if answer is not None and not answer.done():
                        answer.set_result(message)
                else:
                    raise TypeError(f"unexpected message on the engine link: {type(message).__name__}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        code = await _stopped(self._proc, 5.0)
        self._engine_lost(f"the scheduler's engine process exited (code {code})")

    def _deliver(self, message: link.Outputs) -> None:
        if message.stats is not None:
            self._stats = message.stats  # before any sink runs, as the engine publishes them
        sinks = self._sinks
        for out in message.outputs():
            sink = sinks.pop(out.request_id, None) if out.finished else sinks.get(out.request_id)
            if sink is not None:
                sink(out)

    def _engine_lost(self, reason: str) -> None:
        if self._closing:
            return  # a shutdown we asked for
        log.error("%s: ending every request in flight", reason)
        self._lost_reason = reason
        finish = Finish(FinishReason.ABORT, message=f"{reason}; restart the scheduler", cause=AbortCause.EXECUTOR)
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink(RequestOutput(rid, (), "", 0, 0, 0, finish=finish, output_ids=()))
        for answer in self._probes.values():
            if not answer.done():
                answer.set_result(link.ProbeAnswer(-1, None, error=reason))
        self.lost.set()


class _ExecutorProbe:
    """``engine.runner`` as the servicer uses it: only ``healthy()``."""

    def __init__(self, engine: EngineProcess) -> None:
        self._engine = engine

    def healthy(self) -> bool:
        return bool(self._engine.probe(link.ProbeKind.EXECUTOR_HEALTHY))


class _GrammarProbe:
    """``engine.grammar`` as the servicer uses it: only ``unavailable()``."""

    def __init__(self, engine: EngineProcess) -> None:
        self._engine = engine

    def unavailable(self) -> str | None:
        value = self._engine.probe(link.ProbeKind.GRAMMAR_UNAVAILABLE)
        return None if value is None else str(value)


async def _read_message(reader: asyncio.StreamReader) -> link.ToEngine | link.FromEngine:
    header = await reader.readexactly(link.HEADER_BYTES)
    return link.decode(await reader.readexactly(link.length_of(header)))


async def _stopped(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The process's exit code once it exits; killed past ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)
    except TimeoutError:
        proc.kill()
        return await asyncio.to_thread(proc.wait)
