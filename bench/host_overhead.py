"""Host overhead per decode step: CPU time the scheduler and executor processes spend per step, beside the forward.

On a GPU a decode step of an 8B model takes 5-20 ms, and every millisecond of host CPU per step beyond that leaves
the GPU idle. This bench makes the forward almost free (a tiny checkpoint: hidden 64, 2 layers, the embedded
tokenizer) so that what remains is the engine's own cost: the scheduler's planning, commit, streaming and gRPC, the
executor's protocol decoding, batch building, sampling and result encoding.

It starts the executor and the scheduler as their own processes (loopback gRPC, one torch thread), drives N
concurrent greedy streams (long outputs, ignore_eos) from this process, waits until every stream is decoding, and
reads each process's CPU time (/proc/<pid>/stat) and the executor's step count and forward CPU time (GetState)
over a window of steps. Printed per N (8, 32, 128 by default), in one run:

    streams  steps  scheduler ms/step  us/request  executor ms/step  forward ms/step  rest ms/step  step ms
    msgs/step  tokens/msg

(step ms: wall time per step over the window, to within the 50 ms the window is sampled at; msgs/step and
tokens/msg: the stream chunks the clients received per step and the tokens each carried: a stream that falls behind
gets several tokens in one chunk. A scheduler whose CPU per step nears the step time is saturated: its streams then
fall behind and coalesce.)

Targets at 128 streams (issue 14): scheduler <= 3 ms of CPU per step, executor outside the forward <= 2 ms. With the
scheduler as two processes (the default) each has its column: "loop" is the engine process, whose CPU per step is
what keeps the accelerator waiting; "front" is the gRPC front end writing the streams beside it, on its own core;
"total" is their sum.

    .venv/bin/python bench/host_overhead.py [--streams 8 32 128] [--steps 150]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import spawned_stack
from engine.model.embedded import ensure_embedded_model
from protos import executor_pb2 as epb
from protos import executor_pb2_grpc as epb_grpc

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
PROMPT_LEN = 8
OUTPUT_LEN = 1024  # longer than any window: every stream decodes throughout
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Sample:
    engine_cpu: float  # the process that runs the step loop: the scheduler's, or its engine process
    front_cpu: float  # the scheduler's front end when the engine has its own process, else 0
    executor_cpu: float
    steps: int
    forward_cpu: float


@dataclass(frozen=True)
class Row:
    split: bool  # the scheduler ran as front end + engine process
    streams: int
    steps: int
    engine_ms: float
    front_ms: float
    executor_ms: float
    forward_ms: float
    wall_ms: float  # wall time per step
    messages: float  # stream chunks the clients received per step
    tokens: float  # tokens those chunks carried per step

    @property
    def rest_ms(self) -> float:
        return self.executor_ms - self.forward_ms

    @property
    def scheduler_ms(self) -> float:
        return self.engine_ms + self.front_ms


def tiny_checkpoint(dest: Path) -> Path:
    """A random Llama checkpoint of hidden 64 and 2 layers with the embedded model's tokenizer (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    source = ensure_embedded_model()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, dest / name)
    embedded = LlamaConfig.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=embedded.vocab_size,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=embedded.bos_token_id,
        eos_token_id=embedded.eos_token_id,
        pad_token_id=embedded.pad_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)
    return dest


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime


def engine_child(scheduler_pid: int) -> int | None:
    """The scheduler's engine process (its one child), if it runs one."""
    children = Path(f"/proc/{scheduler_pid}/task/{scheduler_pid}/children").read_text().split()
    return int(children[0]) if children else None


def sample(scheduler_pid: int, executor_pid: int, executor: epb_grpc.ExecutorStub) -> Sample:
    state = executor.GetState(epb.StateRequest(), timeout=10)
    child = engine_child(scheduler_pid)
    scheduler = cpu_seconds(scheduler_pid)
    engine, front = (scheduler, 0.0) if child is None else (cpu_seconds(child), scheduler)
    return Sample(engine, front, cpu_seconds(executor_pid), state.steps, state.forward_cpu_seconds)


async def measure(
    target: str, executor_target: str, pids: tuple[int, int], streams: int, steps: int, pause_s: float = 0.0
) -> Row:
    rng = random.Random(streams)
    decoding = asyncio.Event()
    started = [0]
    received = [0, 0]  # chunks, tokens: read by the window's two samples

    async def stream(stub: pb_grpc.SglangSchedulerStub, i: int) -> None:
        params = pb.SamplingParams(
            temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, max_new_tokens=OUTPUT_LEN
        )
        params.ignore_eos = True
        prompt = [rng.randrange(10, 1900) for _ in range(PROMPT_LEN)]
        request = pb.GenerateRequest(
            request_id=f"overhead-{streams}-{i}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=params,
            stream=True,
        )
        tokens = 0
        counted = False
        async for response in stub.Generate(request, timeout=600):
            tokens += len(response.chunk.token_ids)
            received[0] += 1
            received[1] += len(response.chunk.token_ids)
            if tokens >= 4 and not counted:
                counted = True
                started[0] += 1
                if started[0] == streams:
                    decoding.set()

    with grpc.insecure_channel(executor_target) as channel:
        executor = epb_grpc.ExecutorStub(channel)
        async with grpc.aio.insecure_channel(target) as aio:
            stub = pb_grpc.SglangSchedulerStub(aio)
            tasks = [asyncio.create_task(stream(stub, i)) for i in range(streams)]
            await asyncio.wait_for(decoding.wait(), 300)
            if pause_s:
                print(
                    f"PROFILE scheduler={pids[0]} engine={engine_child(pids[0])} executor={pids[1]} streams={streams}",
                    flush=True,
                )
                await asyncio.sleep(pause_s)
            first = sample(*pids, executor)
            first_received = tuple(received)
            started_at = time.monotonic()
            deadline = time.monotonic() + 300
            while (last := sample(*pids, executor)).steps < first.steps + steps:
                if time.monotonic() > deadline:
                    raise TimeoutError("the window's steps did not come")
                await asyncio.sleep(0.05)
            last_received = tuple(received)
            wall = time.monotonic() - started_at
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    n = last.steps - first.steps
    return Row(
        engine_child(pids[0]) is not None,
        streams,
        n,
        (last.engine_cpu - first.engine_cpu) / n * 1e3,
        (last.front_cpu - first.front_cpu) / n * 1e3,
        (last.executor_cpu - first.executor_cpu) / n * 1e3,
        (last.forward_cpu - first.forward_cpu) / n * 1e3,
        wall / n * 1e3,
        (last_received[0] - first_received[0]) / n,
        (last_received[1] - first_received[1]) / n,
    )


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'scheduler':>15}{'streams':>8}{'steps':>7}{'loop ms/step':>14}{'front ms/step':>15}{'total ms/step':>15}"
        f"{'us/request':>12}{'executor ms/step':>18}{'forward ms/step':>17}{'rest ms/step':>14}"
        f"{'step ms':>9}{'msgs/step':>11}{'tokens/msg':>12}"
    )
    print(header)
    for r in rows:
        mode = "two processes" if r.split else "one process"
        front = f"{r.front_ms:.2f}" if r.split else "-"
        print(
            f"{mode:>15}{r.streams:>8}{r.steps:>7}{r.engine_ms:>14.2f}{front:>15}{r.scheduler_ms:>15.2f}"
            f"{r.scheduler_ms * 1e3 / r.streams:>12.0f}"
            f"{r.executor_ms:>18.2f}{r.forward_ms:>17.2f}{r.rest_ms:>14.2f}{r.wall_ms:>9.2f}"
            f"{r.messages:>11.1f}{r.tokens / max(r.messages, 1e-9):>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--steps", type=int, default=150, help="decode steps measured per row")
    parser.add_argument(
        "--profile-pause", type=float, default=0.0, help="seconds to keep decoding before each window (for py-spy)"
    )
    parser.add_argument(
        "--engine-process",
        nargs="+",
        choices=("on", "off"),
        default=["off", "on"],
        help="the scheduler's modes to measure, each on its own stack, in this run",
    )
    args = parser.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one torch thread: forward CPU is its thread's
    with tempfile.TemporaryDirectory(prefix="ordinal-overhead-") as tmp:
        model = tiny_checkpoint(Path(tmp))
        pages = max(args.streams) * (PROMPT_LEN + OUTPUT_LEN) // 16 + 64
        flags = ["--num-pages", str(pages), "--max-running", str(max(args.streams)), "--chunk-size", "2048"]
        rows: list[Row] = []
        for mode in args.engine_process:
            with spawned_stack(model, flags, scheduler_args=["--engine-process", mode]) as stack:
                executor_pid, scheduler_pid = stack.pids
                pids = (scheduler_pid, executor_pid)
                rows += [
                    asyncio.run(measure(stack.target, stack.executor, pids, n, args.steps, args.profile_pause))
                    for n in args.streams
                ]
    print_table(rows)


if __name__ == "__main__":
    main()
