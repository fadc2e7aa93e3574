"""``python -m services.executor``: load the model, serve it, print ``EXECUTOR_READY port=<port>`` when serving.

The launcher waits for that line on stdout. SIGTERM or SIGINT stops the server (the open session ends and
its buffers are dropped), then the runner. ``--metrics-port`` serves Prometheus metrics (0 = off).

``--grammar HOST:PORT`` names the grammar service the constrained rows' fenced masks come from (the scheduler
must use the same one); without it a step with a constrained entry is refused. ``--grammar-overlap off`` (shared
with the scheduler) makes the executor take masks without waiting at the fence: the scheduler then commits every
token before launching a step that needs it. ``--grammar-mask-relay`` runs the mask exchange in a helper process
(services/mask_relay.py), by default when this executor runs on CPU pinned to some of the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from engine.model.folder import model_dir, model_vocab_size
from services import event_loop
from services.executor.metrics import ExecutorMetrics
from services.executor.server import start_executor
from services.flags import add_engine_args, engine_config
from services.grammar_client import GrammarServiceError, GrammarStreamError, RemoteGrammar
from services.mask_relay import MaskRelay, RelayConfig, relay_cpus, wants_relay
from services.metrics import serve_metrics

READY_LINE = "EXECUTOR_READY port={port}"


def build_parser() -> argparse.ArgumentParser:
    # "resolve": the shared engine flags may grow a flag defined here too (e.g. --cache-dir); ours then wins.
    parser = argparse.ArgumentParser(
        prog="python -m services.executor",
        description="ordinal executor: model weights, KV pool, forward and sampling, served over gRPC.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        conflict_handler="resolve",
    )
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 picks a free one")
    parser.add_argument("--cache-dir", default=None, help="where the embedded default model is built")
    parser.add_argument(
        "--grammar",
        default=None,
        metavar="HOST:PORT",
        help="the grammar service constrained requests take their masks from (default: none, constrained steps "
        "are refused)",
    )
    parser.add_argument(
        "--grammar-timeout", type=float, default=60.0, help="seconds to wait for the grammar service at start"
    )
    return parser


def executor_config(args: argparse.Namespace) -> EngineConfig:
    return replace(engine_config(args), cache_dir=args.cache_dir)


async def serve(runner: ModelRunner, host: str, port: int, metrics: ExecutorMetrics | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the ready line: a stop right after it is clean too
        loop.add_signal_handler(sig, stop.set)
    executor = await start_executor(runner, host, port, metrics)
    print(READY_LINE.format(port=executor.port), flush=True)
    await stop.wait()
    await executor.stop(grace=2.0)


def connect_grammar(args: argparse.Namespace, config: EngineConfig) -> RemoteGrammar | None:
    """The grammar service of ``--grammar``, checked to mask exactly the model's vocabulary (config.json's
    ``vocab_size``, the lm_head width); None without the flag."""
    if args.grammar is None:
        return None
    try:
        vocab = model_vocab_size(model_dir(config))
        # The executor only reads masks: the grammars belong to the scheduler's session, not to it.
        return RemoteGrammar.connect(args.grammar, args.grammar_timeout, vocab_size=vocab, holds_session=False)
    except GrammarServiceError as exc:
        raise SystemExit(f"executor: {exc}") from None


def start_relay(args: argparse.Namespace, config: EngineConfig) -> MaskRelay | None:
    """The mask relay of ``--grammar-mask-relay`` (on the cores this process is not pinned to), or None."""
    if not wants_relay(args.grammar_mask_relay, config.device):
        return None
    try:
        return MaskRelay.start(RelayConfig(args.grammar, relay_cpus()))
    except GrammarStreamError as exc:
        raise SystemExit(f"executor: {exc}") from None


def cpu_threads(requested: int, device: str) -> int | None:
    """The torch CPU threads for ``--cpu-threads``: as asked, else (0) on a CPU device the cores this process may
    run on but one, at least one; None keeps torch's default (a CUDA device, whose host threads barely compute).

    Why not torch's default (every core) on CPU: its OpenMP workers spin between the forward's many small ops, and a
    spinning worker takes the core the scheduler's loop and the gRPC streams need. On two cores with the scheduler
    beside it, bench/spec.py's plain decoding ran at 146 tok/s with two threads and 285 with one."""
    if requested < 0:
        raise SystemExit(f"executor: --cpu-threads must be >= 0, got {requested}")
    if requested:
        return requested
    if torch.device(device).type != "cpu":
        return None
    return max(1, len(os.sched_getaffinity(0)) - 1)


def pin(cores: frozenset[int] | None) -> None:
    """``--executor-cpus``: this process on ``cores``, before any thread of its starts (they all inherit it)."""
    if cores is None:
        return
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:
        raise SystemExit(f"executor: cannot run on cores {sorted(cores)} ({exc.strerror})") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pin(args.executor_cpus)
    config = executor_config(args)
    threads = cpu_threads(args.cpu_threads, config.device)
    if threads is not None:
        torch.set_num_threads(threads)
    grammar = connect_grammar(args, config)
    relay = start_relay(args, config) if grammar is not None else None
    runner = ModelRunner.load(config, relay if relay is not None else grammar)
    metrics = ExecutorMetrics()
    metrics.watch_buffers(lambda: runner.num_buffers)
    metrics_server = serve_metrics(args.metrics_port, metrics.registry, host=args.host)
    try:
        event_loop.run(serve(runner, args.host, args.port, metrics))
    finally:
        runner.shutdown()
        if relay is not None:
            relay.close()
        if grammar is not None:
            grammar.close()
        if metrics_server is not None:
            metrics_server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
