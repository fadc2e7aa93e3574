"""``python -m services.scheduler``: serve SGLang's gRPC API over the engine.

Without ``--executor`` the executor runs in this process (the model is loaded here); with ``--executor
HOST:PORT`` the scheduler drives a remote executor service. Prints ``SCHEDULER_READY port=<port>`` once
serving; SIGTERM or SIGINT stops it cleanly. ``--metrics-port`` serves Prometheus metrics (0 = off).

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

from engine.config import EngineConfig
from engine.constraint import JsonSchemaMode
from engine.grammar_calls import GrammarBackend
from engine.model.folder import model_dir, model_vocab_size
from engine.scheduler.engine import Engine
from engine.step import StepRunner
from services import event_loop
from services.flags import DEFAULT_PORT, add_engine_args, add_json_schema_args, engine_config, json_schema_mode
from services.grammar_client import GrammarServiceError, RemoteGrammar
from services.metrics import serve_metrics
from services.scheduler.metrics import SchedulerMetrics
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
    add_engine_args(parser)
    add_json_schema_args(parser)  # for the in-process grammar registry; a grammar service has its own
    return parser


def _runner(args: argparse.Namespace) -> StepRunner | None:
    if args.executor is None:
        return None  # Engine builds the in-process ModelRunner
    from services.remote_runner import RemoteRunner  # lazily: only a remote setup needs the executor client

    runner: StepRunner = RemoteRunner.connect(args.executor, args.executor_timeout)
    return runner


def _grammar(
    args: argparse.Namespace, config: EngineConfig, runner: StepRunner | None, metrics: SchedulerMetrics
) -> GrammarBackend | None:
    """The grammar service of ``--grammar``, checked to mask exactly the model's vocabulary; without it an
    in-process registry when the model is loaded here too, else None (constraints refused)."""
    if args.grammar is None:
        if runner is not None:
            return None
        # Lazily: a scheduler with a remote executor and grammar service never loads the grammar engine.
        from engine.grammar import CompilerConfig, IntegerRange
        from engine.grammar.backend import LocalGrammar
        from services.grammar.metrics import GrammarMetrics

        compiler = CompilerConfig(
            json_schema_mode=JsonSchemaMode(json_schema_mode(args)),
            json_integer_range=IntegerRange(args.json_integer_range),
            json_max_whitespace=args.json_whitespace,
        )
        return LocalGrammar(str(model_dir(config)), config=compiler, observer=GrammarMetrics(metrics.registry))
    vocab = runner.info.vocab_size if runner is not None else model_vocab_size(model_dir(config))
    try:
        return RemoteGrammar.connect(args.grammar, args.grammar_timeout, vocab_size=vocab)
    except GrammarServiceError as exc:
        raise SystemExit(f"scheduler: {exc}") from None


async def _serve(engine: Engine, args: argparse.Namespace) -> None:
    server = SchedulerServer(engine, args.served_model_name, args.executor, args.grammar)
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
    config = engine_config(args)
    runner = _runner(args)
    grammar = _grammar(args, config, runner, metrics)
    engine = Engine(config, runner, observer=metrics, grammar=grammar)
    metrics.watch(engine.stats)
    metrics_server = serve_metrics(args.metrics_port, metrics.registry, host=args.host)
    try:
        event_loop.run(_serve(engine, args))
    finally:
        engine.shutdown()
        if isinstance(grammar, RemoteGrammar):
            grammar.close()
        if metrics_server is not None:
            metrics_server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
