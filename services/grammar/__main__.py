"""``python -m services.grammar``: load the model's tokenizer, serve grammars, print ``GRAMMAR_READY port=<port>``.

The launcher waits for that line on stdout. SIGTERM or SIGINT stops the server (open grammars are dropped with
it), then the compiler. ``--json-schema`` chooses how JSON schemas are served when a request does not say and
``--json-whitespace`` how much whitespace a JSON grammar allows between tokens; ``--metrics-port`` serves
Prometheus metrics (JSON-schema keywords by enforcer, violations; 0 = off).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.constraint import JsonSchemaMode
from engine.grammar import CompilerConfig, ConstraintCompiler, EnforcementObserver, IntegerRange
from engine.model.embedded import ensure_embedded_model
from services import event_loop
from services.flags import add_json_schema_args, json_schema_mode
from services.grammar.metrics import GrammarMetrics
from services.grammar.server import GrammarServiceConfig, start_grammar
from services.metrics import serve_metrics

READY_LINE = "GRAMMAR_READY port={port}"


def build_parser() -> argparse.ArgumentParser:
    defaults = GrammarServiceConfig()
    parser = argparse.ArgumentParser(
        prog="python -m services.grammar",
        description="ordinal grammar service: compiled grammars and one versioned matcher per constrained request.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 picks a free one")
    parser.add_argument("--model", default=None, help="HF model folder (tokenizer + config.json); default: embedded")
    parser.add_argument("--cache-dir", default=None, help="where the embedded default model is built")
    parser.add_argument("--compile-workers", type=int, default=CompilerConfig().workers, help="concurrent compiles")
    parser.add_argument("--workers", type=int, default=defaults.workers, help="threads for commits and masks")
    parser.add_argument(
        "--fence-deadline-ms",
        type=int,
        default=int(defaults.fence_deadline_s * 1000),
        help="how long a mask waits for its commit when a request leaves deadline_ms unset",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port at /metrics (0 = off)"
    )
    add_json_schema_args(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level")
    return parser


def model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    return ensure_embedded_model(Path(args.cache_dir) if args.cache_dir else None)


async def serve(
    compiler: ConstraintCompiler,
    host: str,
    port: int,
    config: GrammarServiceConfig,
    observer: EnforcementObserver | None = None,
) -> None:
    server = await start_grammar(compiler, host, port, config, observer)
    print(READY_LINE.format(port=server.port), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mode = JsonSchemaMode(json_schema_mode(args))
    compiler_config = CompilerConfig(
        workers=args.compile_workers,
        json_schema_mode=mode,
        json_integer_range=IntegerRange(args.json_integer_range),
        json_max_whitespace=args.json_whitespace,
    )
    compiler = ConstraintCompiler.from_model_dir(model_dir(args), compiler_config)
    config = GrammarServiceConfig(fence_deadline_s=args.fence_deadline_ms / 1000.0, workers=args.workers)
    metrics = GrammarMetrics()
    metrics_server = serve_metrics(args.metrics_port, metrics.registry, host=args.host)
    try:
        event_loop.run(serve(compiler, args.host, args.port, config, metrics))
    finally:
        compiler.shutdown()
        if metrics_server is not None:
            metrics_server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
