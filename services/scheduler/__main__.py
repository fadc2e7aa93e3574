"""``python -m services.scheduler``: serve SGLang's gRPC API over the engine.

Without ``--executor`` the executor runs in this process (the model is loaded here); with ``--executor
HOST:PORT`` the scheduler drives a remote executor service. Prints ``SCHEDULER_READY port=<port>`` once
serving; SIGTERM or SIGINT stops it cleanly. ``--metrics-port`` serves Prometheus metrics (0 = off).

Two processes by default (``--engine-process on``): this one is the front end (the public gRPC API; it writes every
stream's chunks), and it starts the engine's loop in a child process (services/scheduler/engine_process.py) that
sends it one message per commit, so that the per-stream gRPC writes (tens of microseconds of CPU each) never take CPU
from the step loop. ``--engine-process off`` runs both in this one process. The child lives and dies with this one.

Constrained decoding: ``--grammar HOST:PORT`` opens, commits and releases every constrained request's grammar in
that grammar service (a remote executor must be started with the same one). Without it an in-process executor
gets an in-process grammar registry (JSON schemas read as ``--json-schema`` says, its metrics on the scheduler's
port); a remote executor without a grammar service cannot serve constraints, and constrained requests are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from services import event_loop
from services.flags import DEFAULT_PORT, add_engine_args, add_json_schema_args
from services.scheduler.engine_parts import build_engine
from services.scheduler.engine_proxy import EngineProcess, EngineProcessError
from services.scheduler.server import SchedulerServer
from services.scheduler.servicer import ServedEngine

ENGINE_START_MARGIN_S = 300.0  # beyond the executor's and grammar service's timeouts: loading a model in process


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description="Serve SGLang's SglangScheduler gRPC API (what the smg gateway talks to).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind; 0 picks a free one")
    parser.add_argument("--executor", default=None, metavar="HOST:PORT", help="remote executor; default: in-process")
    parser.add_argument("--executor-timeout", type=float, default=60.0, help="seconds to wait for the executor")
    parser.add_argument(
        "--grammar",
        default=None,
        metavar="HOST:PORT",
        help="grammar service for constrained requests; default: in-process with an in-process executor, none "
        "(constraints refused) with a remote one",
    )
    parser.add_argument(
        "--grammar-timeout", type=float, default=60.0, help="seconds to wait for the grammar service at start"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients see; default: ordinal-embedded-tiny for the embedded model, else the folder name",
    )
    parser.add_argument("--shutdown-grace", type=float, default=5.0, help="seconds in-flight RPCs get on stop")
    parser.add_argument(
        "--engine-process",
        choices=("on", "off"),
        default="on",
        help="run the engine's loop in its own process, apart from the gRPC front end that writes the streams "
        "(off: one process)",
    )
    add_engine_args(parser)
    add_json_schema_args(parser)  # for the in-process grammar registry; a grammar service has its own
    return parser


async def _serve(engine: ServedEngine, args: argparse.Namespace, lost: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM or SIGINT, or until ``lost`` is set (the engine process is gone)."""
    server = SchedulerServer(engine, args.served_model_name, args.executor, args.grammar)
    port = await server.start(args.host, args.port)
    print(f"SCHEDULER_READY port={port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.create_task(stop.wait())] + ([asyncio.create_task(lost.wait())] if lost is not None else [])
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await server.stop(args.shutdown_grace)


async def _serve_front_end(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """The front end of a two-process scheduler: start the engine process, serve, stop it. 1 if it was lost."""
    start_timeout = args.executor_timeout + args.grammar_timeout + ENGINE_START_MARGIN_S
    try:
        engine = await EngineProcess.start(argv, start_timeout)
    except EngineProcessError as exc:
        print(f"scheduler: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        await _serve(engine, args, engine.lost)
    finally:
        await engine.close()
    return 1 if engine.lost.is_set() else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.engine_process == "on":
        return event_loop.run(_serve_front_end(args, argv))
    parts = build_engine(args)
    try:
        event_loop.run(_serve(parts.engine, args))
    finally:
        parts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
