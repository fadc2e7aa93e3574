"""What a scheduler's engine is built from: the step runner, the grammar backend, the metrics, and their teardown.

One builder for both scheduler modes: the one-process scheduler (services/scheduler/__main__.py) and the engine
process of the two-process one (services/scheduler/engine_process.py) build the same engine from the same flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.constraint import JsonSchemaMode
from engine.grammar_calls import GrammarBackend
from engine.model.folder import model_dir, model_vocab_size
from engine.scheduler.engine import Engine
from engine.step import StepRunner
from services.flags import engine_config, json_schema_mode
from services.grammar_client import GrammarServiceError, RemoteGrammar
from services.metrics import MetricsServer, serve_metrics
from services.scheduler.metrics import SchedulerMetrics


@dataclass(frozen=True, slots=True)
class EngineParts:
    """An engine and what it owns beside it; ``close`` stops them all, the engine first."""

    engine: Engine
    grammar: GrammarBackend | None
    metrics_server: MetricsServer | None

    def close(self) -> None:
        self.engine.shutdown()
        if isinstance(self.grammar, RemoteGrammar):  # an in-process registry goes with the engine
            self.grammar.close()
        if self.metrics_server is not None:
            self.metrics_server.close()


def build_engine(args: argparse.Namespace, flush: Callable[[], None] | None = None) -> EngineParts:
    """The engine the scheduler's flags describe, its metrics served on ``--metrics-port``."""
    metrics = SchedulerMetrics()
    config = engine_config(args)
    runner = step_runner(args)
    grammar = grammar_backend(args, config, runner, metrics)
    engine = Engine(config, runner, observer=metrics, grammar=grammar, flush=flush)
    metrics.watch(engine.stats)
    return EngineParts(engine, grammar, serve_metrics(args.metrics_port, metrics.registry, host=args.host))


def step_runner(args: argparse.Namespace) -> StepRunner | None:
    if args.executor is None:
        return None  # Engine builds the in-process ModelRunner
    from services.remote_runner import RemoteRunner  # lazily: only a remote setup needs the executor client

    runner: StepRunner = RemoteRunner.connect(args.executor, args.executor_timeout)
    return runner


def grammar_backend(
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
