"""gRPC load generator against the scheduler's public API (SglangScheduler from smg-grpc-proto).

N concurrent streams, each sending requests one after another from a fixed mixed workload (prompt and output
lengths drawn from a seeded generator). Prints throughput, TTFT and TPOT p50/p99. With ``--compare`` the same
workload also runs against the in-process engine in the same run, and the table prints the ratio.

    .venv/bin/python bench/load.py --streams 32 --requests 128 --compare      # spawns executor + scheduler
    .venv/bin/python bench/load.py --target 127.0.0.1:30000                    # an already running stack
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.model.embedded import ensure_embedded_model
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_new_tokens: int
    regex: str | None = None  # a constraint (its grammar must not end before max_new_tokens: ignore_eos is set)
    min_new_tokens: int = 0  # EOS banned until then (a grammar that may end does not end a request before it)


@dataclass(frozen=True)
class Timing:
    ttft: float
    tpot: float | None
    tokens: int


@dataclass(frozen=True)
class Report:
    name: str
    wall: float
    timings: list[Timing]

    @property
    def tokens_per_s(self) -> float:
        return sum(t.tokens for t in self.timings) / self.wall


def make_jobs(n: int, vocab: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def _timing(started: float, stamps: list[float], tokens: int) -> Timing:
    ttft = stamps[0] - started
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None
    return Timing(ttft, tpot, tokens)


async def _drive(streams: int, jobs: list[Job], one: Callable[[Job], AsyncIterator[int]]) -> tuple[float, list[Timing]]:
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    timings: list[Timing] = []

    async def worker() -> None:
        while not queue.empty():
            job = queue.get_nowait()
            started = time.perf_counter()
            stamps: list[float] = []
            tokens = 0
            async for n in one(job):
                stamps.append(time.perf_counter())
                tokens += n
            # A constrained output may end where its grammar does (the stop token the grammar allows is not banned).
            assert tokens == job.max_new_tokens or (job.regex is not None and tokens <= job.max_new_tokens), tokens
            timings.append(_timing(started, stamps, tokens))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    return time.perf_counter() - started, timings


async def run_grpc(target: str, streams: int, jobs: list[Job], warm: bool = True) -> Report:
    """``jobs`` through ``streams`` concurrent streams, after a warm-up batch (``warm``) that is not timed."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        counter = iter(range(1 << 30))

        async def one(job: Job) -> AsyncIterator[int]:
            params = pb.SamplingParams(
                temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, max_new_tokens=job.max_new_tokens
            )
            params.ignore_eos = True
            params.min_new_tokens = job.min_new_tokens
            if job.regex is not None:
                params.regex = job.regex
            request = pb.GenerateRequest(
                request_id=f"load-{next(counter)}",
                tokenized=pb.TokenizedInput(input_ids=job.prompt),
                sampling_params=params,
                stream=True,
            )
            async for response in stub.Generate(request, timeout=600):
                if response.HasField("chunk") and response.chunk.token_ids:
                    yield len(response.chunk.token_ids)

        if warm:
            await _drive(streams, jobs[:streams], one)
        wall, timings = await _drive(streams, jobs, one)
    return Report(f"gRPC stack ({target})", wall, timings)


async def run_in_process(engine: Engine, streams: int, jobs: list[Job]) -> Report:
    async def one(job: Job) -> AsyncIterator[int]:
        params = SamplingParams(temperature=0.0, max_new_tokens=job.max_new_tokens, ignore_eos=True)
        async for out in engine.generate(job.prompt, params):
            if out.new_token_ids:
                yield len(out.new_token_ids)

    await _drive(streams, jobs[:streams], one)  # warm-up
    wall, timings = await _drive(streams, jobs, one)
    return Report("in-process engine", wall, timings)


@dataclass(frozen=True)
class Cores:
    """Which CPU cores the executor process gets, and which the others share (scheduler, grammar service and the
    bench itself, which drives the streams).

    On a CPU host the executor's forward is the critical path; when the scheduler's loop, the gRPC threads or the
    bench client are woken onto its core they preempt it, and overlap (the scheduler working while the forward
    runs) turns into contention: on this 2-core machine an overlapped n-gram verify's forward took 2.75 ms unpinned
    against 2.1 ms pinned. A CPU deployment does the same with taskset or a compose cpuset."""

    executor: frozenset[int]
    rest: frozenset[int]

    @classmethod
    def split(cls) -> Cores | None:
        """The first core for everything but the executor, the others for the executor; None below two cores."""
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            return None
        return cls(frozenset(cores[1:]), frozenset(cores[:1]))

    def describe(self) -> str:
        executor, rest = sorted(self.executor), sorted(self.rest)
        return f"executor on cores {executor}, scheduler, grammar service and client on {rest}"


@dataclass(frozen=True)
class SpawnedStack:
    """The scheduler's and the executor's addresses and the pid of every service process (for CPU accounting):
    the grammar service's first when there is one, then the executor's, then the scheduler's."""

    target: str
    pids: tuple[int, ...]
    executor: str


@contextmanager
def spawned_stack(
    model: Path,
    config_args: list[str],
    grammar: bool = False,
    cores: Cores | None = None,
    scheduler_args: Sequence[str] = (),
    grammar_args: Sequence[str] = (),
) -> Iterator[SpawnedStack]:
    """Start executor and scheduler (and with ``grammar`` a grammar service both use) as their own processes on
    loopback; yield the scheduler's address and the pids. ``cores``: pin the executor and the others apart.
    ``scheduler_args``: flags for the scheduler only (``--engine-process off``); ``grammar_args`` for the grammar
    service."""
    rest = cores.rest if cores is not None else None
    own = cores.executor if cores is not None else None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[str]] = []
    try:
        links: list[str] = []
        if grammar:
            service, address = _start_grammar(model, env, rest, grammar_args)
            procs.append(service)
            links = ["--grammar", address]
        executor = _start(
            [sys.executable, "-m", "services.executor", "--port", "0", "--model", str(model), *links, *config_args],
            env,
            own,
        )
        procs.append(executor)
        eport = _ready_port(executor, "EXECUTOR_READY")
        scheduler = _start(
            [sys.executable, "-m", "services.scheduler", "--port", "0", "--executor", f"127.0.0.1:{eport}",
             "--model", str(model), *links, *config_args, *scheduler_args],
            env,
            rest,
        )  # fmt: skip
        procs.append(scheduler)
        port = _ready_port(scheduler, "SCHEDULER_READY")
        yield SpawnedStack(f"127.0.0.1:{port}", tuple(p.pid for p in procs), f"127.0.0.1:{eport}")
    finally:
        for proc in reversed(procs):
            _stop(proc)


@contextmanager
def spawned_grammar(model: Path, cores: frozenset[int] | None = None, args: Sequence[str] = ()) -> Iterator[str]:
    """A grammar service for ``model`` as its own process on loopback (on ``cores``); yield its address."""
    proc, address = _start_grammar(model, {**os.environ, "PYTHONUNBUFFERED": "1"}, cores, args)
    try:
        yield address
    finally:
        _stop(proc)


def _start_grammar(
    model: Path, env: dict[str, str], cores: frozenset[int] | None, args: Sequence[str]
) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "services.grammar", "--port", "0", "--model", str(model), *args]
    proc = _start(cmd, env, cores)
    try:
        return proc, f"127.0.0.1:{_ready_port(proc, 'GRAMMAR_READY')}"
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _start(cmd: list[str], env: dict[str, str], cores: frozenset[int] | None = None) -> subprocess.Popen[str]:
    # Set before exec: every thread the service starts inherits it.
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    # Through services/parent_death.py (the same pid once it execs): a bench killed by a signal, even SIGKILL,
    # leaves no service running; its context managers stop them only on a normal exit or an exception.
    dies_with_bench = [sys.executable, "-m", "services.parent_death", str(os.getpid()), *cmd]
    return subprocess.Popen(dies_with_bench, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=pin)


def _ready_port(proc: subprocess.Popen[str], marker: str, timeout: float = 180.0) -> int:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited with {proc.wait()} before {marker}")
        if line.startswith(marker):
            return int(line.split("port=")[1].split()[0])
    raise TimeoutError(f"no {marker} within {timeout} s")


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def print_table(reports: list[Report]) -> None:
    base = reports[-1].tokens_per_s
    print(f"{'target':<34}{'tok/s':>9}{'ratio':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}")
    for r in reports:
        ttft = [t.ttft * 1e3 for t in r.timings]
        tpot = [t.tpot * 1e3 for t in r.timings if t.tpot is not None]
        print(
            f"{r.name:<34}{r.tokens_per_s:>9.1f}{r.tokens_per_s / base:>7.2f}x"
            f"{_pct(ttft, 50):>8.0f}ms{_pct(ttft, 99):>8.0f}ms{_pct(tpot, 50):>8.1f}ms{_pct(tpot, 99):>8.1f}ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="scheduler HOST:PORT; default: spawn executor + scheduler")
    parser.add_argument("--model", type=Path, default=None, help="HF folder; default: the embedded model")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true", help="also run the in-process engine and print the ratio")
    args = parser.parse_args()
    model = args.model or ensure_embedded_model()
    config = EngineConfig(model_path=str(model), num_pages=8192, max_running=128, chunk_size=1024)
    flags = ["--num-pages", str(config.num_pages), "--max-running", str(config.max_running)]
    flags += ["--chunk-size", str(config.chunk_size)]
    from engine.model.tokenizer import Tokenizer

    jobs = make_jobs(args.requests, Tokenizer.from_dir(model).vocab_size, args.seed, args.prompt_len, args.output_len)
    print(f"{args.requests} requests over {args.streams} streams, {sum(j.max_new_tokens for j in jobs)} output tokens")
    reports: list[Report] = []
    if args.target:
        reports.append(asyncio.run(run_grpc(args.target, args.streams, jobs)))
    else:
        with spawned_stack(model, flags) as stack:
            reports.append(asyncio.run(run_grpc(stack.target, args.streams, jobs)))
    if args.compare:
        with Engine(config) as engine:
            reports.append(asyncio.run(run_in_process(engine, args.streams, jobs)))
    print_table(reports)


if __name__ == "__main__":
    main()
