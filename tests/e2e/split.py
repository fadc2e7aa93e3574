"""A split stack in one process for end-to-end tests: an executor service and a scheduler service over gRPC on
loopback, both using a grammar service, the engine between them. Every wait is bounded by ``TIMEOUT``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from engine.scheduler.engine import Engine
from services.grammar_client import RemoteGrammar
from services.mask_relay import MaskRelay, RelayConfig
from services.remote_runner import RemoteRunner
from tests.support.servers import ExecutorThread, ThreadedServer

TIMEOUT = 60.0


@dataclass
class Stack:
    """One split stack's public stub, its engine, and where its grammar service and executor listen."""

    stub: pb_grpc.SglangSchedulerStub
    engine: Engine
    grammar: str
    executor: str
    target: str  # the scheduler's address, for a grpc.aio channel of the test's own


@contextmanager
def split_stack(
    config: EngineConfig, grammar: str, executor_grammar: str | None = None, relay: bool = False
) -> Iterator[Stack]:
    """Executor and scheduler over gRPC, both on the grammar service ``grammar`` (the executor on
    ``executor_grammar`` instead when given; with ``relay`` through a mask relay, ``--grammar-mask-relay on``)."""
    vocab = load_vocab_size(config)
    masks = RemoteGrammar.connect(executor_grammar or grammar, TIMEOUT, vocab_size=vocab, holds_session=False)
    relayed = MaskRelay.start(RelayConfig(executor_grammar or grammar)) if relay else None
    runner = ModelRunner.load(config, relayed if relayed is not None else masks)
    executor = ExecutorThread(runner)
    target = f"127.0.0.1:{executor.port}"
    commits = RemoteGrammar.connect(grammar, TIMEOUT, vocab_size=vocab)
    engine = Engine(config, RemoteRunner.connect(target, timeout=TIMEOUT), grammar=commits)
    server = ThreadedServer(engine, executor=target, grammar=grammar)
    try:
        port = server.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Stack(pb_grpc.SglangSchedulerStub(channel), engine, grammar, target, f"127.0.0.1:{port}")
    finally:
        server.stop()
        engine.shutdown()
        commits.close()
        executor.stop()
        runner.shutdown()
        if relayed is not None:
            relayed.close()
        masks.close()


def load_vocab_size(config: EngineConfig) -> int:
    return int(json.loads(Path(str(config.model_path), "config.json").read_text())["vocab_size"])
