"""What one constrained step's mask exchange costs the executor's core, by the way it travels to the grammar service.

The executor asks the grammar service for a step's masks before the forward and takes them after it (C4); on a CPU
host every thread of the executor's process shares the executor's core, so whatever the exchange costs there, on any
thread, lengthens the step. This bench measures it outside the engine, side by side in one run: this process pinned
to one core stands for the executor (a forward's stand-in of small matmuls, bound by Python dispatch like the tiny
model's), a real grammar service on the other core answers a real regex's chain-draft masks (one entry, four draft
tokens, at the committed ordinal: answered at once), in five ways:

    none     no masks: the forward alone
    stream   the executor's own path: MaskFetcher over RemoteGrammar, the sync per-step Stream (request handed to
             gRPC's request-iterator thread, the reply read by the client's reader thread, taken after the forward)
    unary    a FillMasks call per step (grpc's future API: no threads of ours, the call's own deadline)
    aio      the Stream on an asyncio loop of its own thread (as if on the executor server's loop), the runner
             handing each request to it and waiting on a future for the reply
    relay    the executor's path with ``--grammar-mask-relay on``: MaskFetcher over services/mask_relay.py, the
             stream held by a helper process on the other core, the request and the reply passed over a Unix socket

Printed per way, p50 over the measured steps: the time to send the request, the forward, the wait for the masks
after it, the step, the process's CPU per step (every thread), the part of it not on the runner's thread, and the
step's CPU beyond ``none``. The modes run in turn in rounds, so the machine's drift spreads over them alike. The
CPU columns are what the exchange costs; where the helper threads' part of it lands (in the send, or in the forward)
depends on when the runner's thread first lets go of the GIL after the send.

    .venv/bin/python bench/mask_exchange.py [--steps 100] [--rounds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import torch

from bench.load import Cores, spawned_grammar
from bench.spec import GRAMMAR_REGEX
from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.executor.masks import MaskFetcher, MaskRequest
from engine.grammar_calls import DraftTree, MaskEntry, MaskRefusals
from engine.model.folder import model_dir
from engine.model.tokenizer import Tokenizer
from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc
from services.grammar import convert
from services.grammar_client import RemoteGrammar, fill_request
from services.mask_relay import MaskRelay, RelayConfig, relay_cpus

REQUEST_ID = "bench"
DRAFT_TOKENS = 4
WAIT_S = 5.0  # the fence's deadline (never reached: the entry is asked at its committed ordinal)


@dataclass(frozen=True)
class Sample:
    """One step, in seconds."""

    send: float
    forward: float
    wait: float
    step: float
    cpu: float  # the process's, every thread
    runner_cpu: float  # the runner's thread's


Waiter = Callable[[], None]  # takes the step's masks (raises if they were refused)
Sender = Callable[[], Waiter]  # sends the step's request


class AioStream:
    """The per-step Stream on an asyncio loop in a thread of its own; replies answer the requests in order."""

    def __init__(self, address: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-aio", daemon=True)
        self._thread.start()
        self._waiting: list[Future[pb.StreamReply]] = []
        self._outbox: asyncio.Queue[pb.StreamRequest] | None = None
        asyncio.run_coroutine_threadsafe(self._open(address), self._loop).result(timeout=30)

    async def _open(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        outbox: asyncio.Queue[pb.StreamRequest] = asyncio.Queue()
        self._outbox = outbox

        async def requests() -> AsyncIterator[pb.StreamRequest]:
            while True:
                yield await outbox.get()

        call = pb_grpc.GrammarStub(self._channel).Stream(requests())
        self._reader = asyncio.ensure_future(self._read(call))

    async def _read(self, call: AsyncIterator[pb.StreamReply]) -> None:
        async for reply in call:
            self._waiting.pop(0).set_result(reply)

    def send(self, request: pb.StreamRequest) -> Future[pb.StreamReply]:
        future: Future[pb.StreamReply] = Future()

        def put() -> None:
            assert self._outbox is not None
            self._waiting.append(future)
            self._outbox.put_nowait(request)

        self._loop.call_soon_threadsafe(put)
        return future

    def close(self) -> None:
        async def stop() -> None:
            self._reader.cancel()
            await self._channel.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def forward_stand_in(size: int = 64, ops: int = 300) -> Callable[[], torch.Tensor]:
    """A forward's stand-in: ``ops`` small matmuls, each a dispatch through torch like a tiny model's layers."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=generator)  # [S, S]
    w = torch.randn(size, size, generator=generator) / size**0.5  # [S, S]

    def forward() -> torch.Tensor:
        y = x
        for _ in range(ops):
            y = torch.tanh(y @ w)  # [S, S]
        return y

    return forward


def senders(
    address: str, draft: tuple[int, ...], vocab_size: int
) -> tuple[dict[str, Sender | None], Callable[[], None]]:
    """Each way's sender (None: no masks), and a function that closes what they opened. Each writes the masks into
    a step bitmask of its own, as the executor's fetcher does."""
    remote = RemoteGrammar.connect(address, holds_session=False)
    fetcher = MaskFetcher(remote, vocab_size, WAIT_S)
    relay = MaskRelay.start(RelayConfig(address, relay_cpus()))
    relayed = MaskFetcher(relay, vocab_size, WAIT_S)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GrammarStub(channel)
    aio = AioStream(address)
    entries = [MaskEntry(REQUEST_ID, 0, DraftTree.chain(draft))]
    cpu = torch.device("cpu")
    words = -(-vocab_size // 32)

    def bitmask() -> torch.Tensor:
        return torch.full((len(draft) + 1, words), -1, dtype=torch.int32)  # [R, W]

    def fetched(masks: MaskFetcher) -> Sender:
        def send() -> Waiter:
            with torch.inference_mode():
                pending = masks.start([MaskRequest(0, REQUEST_ID, 0, DraftTree.chain(draft))], len(draft) + 1)
            assert pending is not None
            return lambda: _checked(pending.result(cpu).errors)

        return send

    def unary() -> Waiter:
        out = bitmask()
        call = stub.FillMasks.future(fill_request(entries, WAIT_S), timeout=WAIT_S + 2)
        return lambda: _checked(convert.decode_masks_into(call.result(), entries, out, [0]))

    def aio_stream() -> Waiter:
        out = bitmask()
        reply = aio.send(pb.StreamRequest(fill_masks=fill_request(entries, WAIT_S)))
        return lambda: _checked(convert.decode_masks_into(reply.result(WAIT_S + 2).fill_masks, entries, out, [0]))

    def close() -> None:
        relayed.shutdown()
        relay.close()
        aio.close()
        channel.close()
        fetcher.shutdown()
        remote.close()

    ways: dict[str, Sender | None] = {"none": None, "stream": fetched(fetcher), "unary": unary, "aio": aio_stream}
    return {**ways, "relay": fetched(relayed)}, close


def _checked(refusals: MaskRefusals | dict[int, str]) -> None:
    if refusals:
        raise RuntimeError(f"the masks were refused: {refusals}")


def measure(send: Sender | None, forward: Callable[[], torch.Tensor], steps: int) -> list[Sample]:
    samples = []
    for _ in range(steps):
        cpu, runner_cpu, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        wait = send() if send is not None else None
        t1 = time.perf_counter()
        forward()
        t2 = time.perf_counter()
        if wait is not None:
            wait()
        t3 = time.perf_counter()
        samples.append(
            Sample(t1 - t0, t2 - t1, t3 - t2, t3 - t0, time.process_time() - cpu, time.thread_time() - runner_cpu)
        )
    return samples


def print_table(rounds: list[dict[str, list[Sample]]]) -> None:
    """p50s over every measured step; ``extra``: the median over the rounds of the way's mean CPU per step less
    ``none``'s in the same round (the machine drifts between rounds more than the exchange costs)."""

    def p50(name: str, field: str) -> float:
        return statistics.median(getattr(s, field) for r in rounds for s in r[name]) * 1e3

    def mean(samples: list[Sample], field: str) -> float:
        return statistics.fmean(getattr(s, field) for s in samples) * 1e3

    print(f"{'way':<8}{'send':>8}{'forward':>9}{'wait':>8}{'step':>8}{'CPU':>8}{'others':>8}{'extra':>8}  (ms)")
    for name in rounds[0]:
        cpu = statistics.median(mean(r[name], "cpu") for r in rounds)
        others = statistics.median(mean(r[name], "cpu") - mean(r[name], "runner_cpu") for r in rounds)
        extra = statistics.median(mean(r[name], "cpu") - mean(r["none"], "cpu") for r in rounds)
        print(
            f"{name:<8}{p50(name, 'send'):>8.3f}{p50(name, 'forward'):>9.3f}{p50(name, 'wait'):>8.3f}"
            f"{p50(name, 'step'):>8.3f}{cpu:>8.3f}{others:>8.3f}{extra:>+8.3f}"
        )
    print(
        "send, forward, wait, step: p50 over the steps; CPU (the process's, per step), others (not on the runner's "
        "thread), extra (CPU beyond none in the same round): medians over the rounds"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="steps per way and round")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cores = Cores.split()
    model = model_dir(EngineConfig())
    tokenizer = Tokenizer.from_dir(model)
    draft = tuple(tokenizer.encode(" the cat sat on the mat and the dog")[:DRAFT_TOKENS])
    with spawned_grammar(model, cores.rest if cores is not None else None) as address:
        if cores is not None:
            os.sched_setaffinity(0, cores.executor)  # before any client thread starts: they all inherit it
            print(cores.describe().replace("executor", "this process (the executor)"))
        torch.set_num_threads(1)
        opener = RemoteGrammar.connect(address)  # the scheduler's part: the grammar the masks are asked of
        opener.open(REQUEST_ID, Constraint(ConstraintKind.REGEX, GRAMMAR_REGEX))
        vocab_size = opener.client.get_state().vocab_size
        ways, close = senders(address, draft, vocab_size)
        forward = forward_stand_in()
        try:
            for send in ways.values():  # warm-up
                measure(send, forward, 30)
            rounds = [
                {name: measure(send, forward, args.steps) for name, send in ways.items()} for _ in range(args.rounds)
            ]
        finally:
            close()
            opener.close()
    print_table(rounds)


if __name__ == "__main__":
    main()
