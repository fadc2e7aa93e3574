"""The grpc.aio floor under bench/host_overhead.py: server CPU per streamed message with no engine at all.

A bare ``SglangScheduler.Generate`` servicer (the real SGLang proto, grpc.aio, loopback) streams one one-token chunk
per stream per step to N concurrent streams read by a client in another process, on the event loop the services
run on (uvloop: services/event_loop.py). A driver thread posts each step's
tokens into the streams' queues with one ``call_soon_threadsafe`` (as the scheduler's mailbox does) at a fixed step
period long enough for every stream to keep up, so every token is its own message. Printed per N: the server
process's CPU per step and per message. This is what the scheduler's relay costs before any engine work: at 128
caught-up streams it is most of issue 14's 3 ms budget.

    .venv/bin/python bench/stream_floor.py [--streams 8 32 128] [--steps 250] [--period-ms 8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import threading
import time
from multiprocessing.queues import Queue
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import event_loop

WARMUP_STEPS = 30


class _Streams(pb_grpc.SglangSchedulerServicer):
    def __init__(self) -> None:
        self.queues: list[asyncio.Queue[int | None]] = []

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.queues.append(queue)
        sent = 0
        while (token := await queue.get()) is not None:
            sent += 1
            response = pb.GenerateResponse(request_id=request.request_id)
            response.chunk.token_ids.append(token)
            response.chunk.completion_tokens = sent
            await context.write(response)


def _serve(out: Queue[object], streams: int, steps: int, period_s: float) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        servicer = _Streams()
        server = grpc.aio.server()
        pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
        out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        while len(servicer.queues) < streams:
            await asyncio.sleep(0.01)

        def post(token: int | None) -> None:
            for queue in servicer.queues:
                queue.put_nowait(token)

        def drive() -> None:
            cpu = 0.0
            for step in range(steps + WARMUP_STEPS):
                if step == WARMUP_STEPS:
                    cpu = time.process_time()
                loop.call_soon_threadsafe(post, step)
                time.sleep(period_s)
            out.put((time.process_time() - cpu) / steps)
            loop.call_soon_threadsafe(post, None)

        driver = threading.Thread(target=drive)
        driver.start()
        while driver.is_alive():
            await asyncio.sleep(0.05)
        await server.stop(1.0)

    event_loop.run(main())  # the loop the scheduler service runs on


def _read(port: int, streams: int) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)

            async def one(i: int) -> None:
                async for _ in stub.Generate(pb.GenerateRequest(request_id=f"floor-{i}"), timeout=600):
                    pass

            await asyncio.gather(*(one(i) for i in range(streams)))

    asyncio.run(main())


def measure(streams: int, steps: int, period_s: float) -> float:
    """Server CPU seconds per step at ``streams`` caught-up streams."""
    out: Queue[object] = mp.Queue()
    server = mp.Process(target=_serve, args=(out, streams, steps, period_s))
    server.start()
    port = out.get(timeout=60)
    assert isinstance(port, int)
    client = mp.Process(target=_read, args=(port, streams))
    client.start()
    cpu = out.get(timeout=600)
    assert isinstance(cpu, float)
    client.join(60)
    server.join(60)
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--period-ms", type=float, default=8.0, help="step period (every stream must keep up)")
    args = parser.parse_args()
    rows = [(n, measure(n, args.steps, args.period_ms / 1e3)) for n in args.streams]
    print(f"{'streams':>8}{'server ms/step':>16}{'us/message':>12}")
    for n, cpu in rows:
        print(f"{n:>8}{cpu * 1e3:>16.2f}{cpu * 1e6 / n:>12.1f}")


if __name__ == "__main__":
    main()
