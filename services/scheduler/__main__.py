"""``python -m services.scheduler``: serve SGLang's gRPC API over the engine.

Without ``--executor`` the executor runs in this process (the model is loaded here); with ``--executor
HOST:PORT`` the scheduler drives a remote executor service. Prints ``SCHEDULER_READY port=<port>`` once
serving; SIGTERM or SIGINT stops it cleanly. ``--metrics-port`` serves Prometheus metrics (0 = off).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from engine.engine import Engine
from engine.runner import StepRunner
from services.launcher import DEFAULT_PORT, add_engine_args, engine_config
from services.metrics import SchedulerMetrics, serve_metrics
from services.scheduler.server import SchedulerServer


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
        "--served-model-name",
        default=None,
        help="model name clients see; default: ordinal-embedded-tiny for the embedded model, else the folder name",
    )
    parser.add_argument("--shutdown-grace", type=float, default=5.0, help="seconds in-flight RPCs get on stop")
    add_engine_args(parser)
    return parser


def _runner(args: argparse.Namespace) -> StepRunner | None:
    if args.executor is None:
        return None  # Engine builds the in-process ModelRunner
    from services.remote_runner import RemoteRunner  # lazily: only a remote setup needs the executor client

    runner: StepRunner = RemoteRunner.connect(args.executor, args.executor_timeout)
    return runner


async def _serve(engine: Engine, args: argparse.Namespace) -> None:
    server = SchedulerServer(engine, args.served_model_name, args.executor)
    port = await server.start(args.host, args.port)
    print(f"SCHEDULER_READY port={port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(args.shutdown_grace)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = SchedulerMetrics()
    engine = Engine(engine_config(args), _runner(args), observer=metrics)
    metrics.watch(engine.stats)
    metrics_server = serve_metrics(args.metrics_port, metrics.registry, host=args.host)
    try:
        asyncio.run(_serve(engine, args))
    finally:
        engine.shutdown()
        if metrics_server is not None:
            metrics_server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
