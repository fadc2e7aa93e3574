"""``python -m services.scheduler.engine_process --link-fd FD [scheduler flags]``: the scheduler's engine process.

Started by the scheduler's front end (services/scheduler/__main__.py), never by hand. It builds the engine exactly as
a one-process scheduler does (the remote executor or the model in process, the grammar service, Prometheus metrics
on ``--metrics-port``), reads :mod:`services.scheduler.engine_link` messages from the socket ``FD`` and sends back
one :class:`Outputs` message per burst of the engine's outputs (a commit's), which the front end fans out to the
streams. Submits, aborts and probes are taken in the order the front end sent them: an abort sent after a submit
reaches the engine after it, and the engine's own ordering (C7) does the rest.

It lives as long as the front end: it exits when told to (:class:`Shutdown`), when the link closes, and when the
front end dies (the parent-death signal, services/parent_death.py). A SIGTERM to the whole process group (the
supervisor's stop) is left to the front end, which drains its streams first and then sends :class:`Shutdown`; SIGINT
(a terminal's Ctrl-C, also sent to the group) likewise.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

from engine.errors import InvalidRequestError
from engine.finish import AbortCause, Finish, FinishReason
from engine.scheduler.engine import Engine
from engine.scheduler.request import RequestOutput
from engine.scheduler.scheduler import SchedulerStats
from services.scheduler import engine_link as link
from services.scheduler.__main__ import build_parser as scheduler_parser
from services.scheduler.engine_parts import build_engine

log = logging.getLogger(__name__)


class _FrontEndGone(Exception):
    """SIGTERM after the front end died (the parent-death signal): stop at once."""


class EngineHost:
    """One engine behind one link: runs the front end's messages against it and sends its outputs back in bursts."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()  # the loop thread (outputs), the reader (refusals), probe threads
        self._held: list[RequestOutput] = []  # the engine loop thread's alone
        self._sent_stats: SchedulerStats | None = None
        self._engine: Engine | None = None
        self._probes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ordinal-engine-probe")

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        self._sent_stats = engine.stats()
        has_grammar = engine.grammar is not None
        self._send(link.Ready(engine.info, engine.config, has_grammar, self._sent_stats))

    def sink(self, out: RequestOutput) -> None:
        """Every request's sink (engine loop thread): held until the burst's :meth:`flush`."""
        self._held.append(out)

    def flush(self) -> None:
        """The engine's flush hook (engine loop thread): the burst's outputs and changed stats, as one message."""
        engine = self._engine
        if engine is None:
            return
        stats = engine.stats()
        changed = stats if stats != self._sent_stats else None
        if not self._held and changed is None:
            return
        held, self._held = self._held, []
        self._sent_stats = stats
        self._send(link.Outputs.of(held, changed))

    def serve(self) -> None:
        """Run the front end's messages until it says to stop or the link closes."""
        while True:
            message = link.receive(self._sock)
            if message is None or isinstance(message, link.Shutdown):
                return
            self._handle(message)

    def close(self) -> None:
        self._probes.shutdown(wait=False, cancel_futures=True)

    def _handle(self, message: link.ToEngine | link.FromEngine) -> None:
        engine = self._engine
        assert engine is not None, "a message before the engine was attached"
        if isinstance(message, link.Submit):
            self._submit(engine, message)
        elif isinstance(message, link.Abort):
            engine.abort(message.request_id, message.message, message.cause)
        elif isinstance(message, link.Probe):
            self._probes.submit(self._answer, engine, message)
        else:
            raise TypeError(f"unexpected message on the engine link: {type(message).__name__}")

    def _submit(self, engine: Engine, message: link.Submit) -> None:
        try:
            engine.submit(
                message.prompt_ids,
                message.params,
                self.sink,
                message.request_id,
                constraint=message.constraint,
                with_text=message.with_text,
            )
        except (InvalidRequestError, RuntimeError) as exc:
            # The front end ran the same checks: only a shutdown (or a check that drifted) gets here. The request
            # never entered the engine, so its one output is this finish.
            finish = Finish(
                FinishReason.ABORT, message=f"the engine refused the request: {exc}", cause=AbortCause.INTERNAL
            )
            out = RequestOutput(message.request_id, (), "", 0, len(message.prompt_ids), 0, finish=finish, output_ids=())
            self._send(link.Outputs.of((out,), None))

    def _answer(self, engine: Engine, probe: link.Probe) -> None:
        value: bool | str | None
        try:
            if probe.kind is link.ProbeKind.EXECUTOR_HEALTHY:
                value = engine.runner.healthy()
            elif engine.grammar is None:
                value = "no grammar service"
            else:
                value = engine.grammar.unavailable()
        except Exception as exc:  # a failed probe is an answer, not a crash
            self._send(link.ProbeAnswer(probe.probe_id, None, error=str(exc)))
            return
        self._send(link.ProbeAnswer(probe.probe_id, value))

    def _send(self, message: link.FromEngine) -> None:
        data = link.frame(message)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:  # the front end is gone; the reader sees the link close and stops
                log.debug("engine link send failed: %s", exc)


def build_parser() -> argparse.ArgumentParser:
    parser = scheduler_parser()  # the same flags as the front end
    parser.prog = "python -m services.scheduler.engine_process"
    parser.add_argument("--link-fd", type=int, required=True, help="the socket to the front end (inherited)")
    return parser


def _signals(front_end: int) -> None:
    """Leave SIGINT and SIGTERM to the front end while it lives; after its death SIGTERM stops this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(signum: int, frame: FrameType | None) -> None:
        if os.getppid() != front_end:
            raise _FrontEndGone

    signal.signal(signal.SIGTERM, on_term)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _signals(os.getppid())
    sock = socket.socket(fileno=args.link_fd)
    host = EngineHost(sock)
    parts = build_engine(args, flush=host.flush)
    try:
        host.attach(parts.engine)
        host.serve()
    except _FrontEndGone:
        log.info("the scheduler's front end is gone: the engine process stops")
    finally:
        parts.close()
        host.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
