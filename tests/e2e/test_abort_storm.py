"""An abort storm against the split stack: 500 concurrent streams from one client, a third aborted, a tenth cancelled.

``ordinal serve --no-gateway`` runs the grammar service, the executor and the scheduler as processes on loopback;
this process is the only client. Every stream is opened at once over one asyncio channel. A third of them get an
``Abort`` RPC (smg's way: the stream stays open) after a random number of chunks (0 = right after the call
starts), a tenth are cancelled by the client after a random number of chunks, the rest run to the end. Checked:

- every stream ends within its deadline, and the whole storm within its bound;
- a stream that was not aborted, or whose abort came too late to win (the Abort RPC then answers success false, or
  it raced the final commit), ends with "length" and exactly its solo greedy output;
- a stream whose abort won ends with a Complete whose finish reason is "abort", whose output ids are exactly the
  tokens streamed before it (nothing after the abort's finish), a prefix of the solo output;
- a cancelled stream streamed a prefix of the solo output before it was cancelled;
- afterwards the scheduler is back at baseline (nothing running or waiting, no KV in use: ``GetLoads``), the
  executor holds no per-request buffer (``GetState``), and one request that needs every page of the pool is admitted
  and completes, which it could not if a single page or reservation had leaked.

The summary line (requests, aborts that won, cancels, time, peak RSS of client and servers) is printed and recorded
as a test property. Checked once against a leak: without `self._reserved -= req.reserved_pages` in
`Scheduler._release` (an aborted request's unused reservation is never returned) the storm starves and a stream
ends with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import random
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from protos import executor_pb2 as epb
from protos import executor_pb2_grpc as epb_grpc
from tests.e2e.stack import ServeStack, greedy_request, start_serve, wait_for_idle_load

pytestmark = pytest.mark.slow

STREAMS = 500
PAGE_SIZE = 8
NUM_PAGES = 320
MAX_RUNNING = 64
STREAM_DEADLINE_S = 150.0
STORM_BOUND_S = 240.0
RPC_TIMEOUT_S = 60.0
SEED = 2024


@dataclass(frozen=True)
class Job:
    """One stream of the storm: what it sends and what the client does to it."""

    request_id: str
    prompt: tuple[int, ...]
    max_new: int
    kind: str  # "run", "abort" (Abort RPC) or "cancel" (client cancels the call)
    at: int  # after this many chunks (0: as soon as the call is started)


@dataclass
class Seen:
    """What the client saw of one stream."""

    tokens: list[int] = field(default_factory=list)
    complete: pb.GenerateComplete | None = None
    abort_won_rpc: bool | None = None  # the Abort RPC's success, when one was sent
    cancelled: bool = False
    error: str | None = None
    seconds: float = 0.0


def _jobs(vocab: int) -> tuple[list[Job], dict[tuple[tuple[int, ...], int], None]]:
    rng = random.Random(SEED)
    distinct = [
        (tuple(rng.randrange(10, vocab) for _ in range(rng.randint(3, 24))), rng.randint(6, 40)) for _ in range(40)
    ]
    kinds = ["abort"] * (STREAMS // 3) + ["cancel"] * (STREAMS // 10)
    kinds += ["run"] * (STREAMS - len(kinds))
    rng.shuffle(kinds)
    jobs = []
    for i, kind in enumerate(kinds):
        prompt, max_new = distinct[rng.randrange(len(distinct))]
        jobs.append(Job(f"storm-{i}", prompt, max_new, kind, rng.randrange(max_new)))
    return jobs, dict.fromkeys(distinct)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Iterator[ServeStack]:
    flags = ["--no-gateway", "--port", "0", "--executor-port", "0", "--grammar-port", "0", "--metrics-port", "0"]
    flags += ["--page-size", str(PAGE_SIZE), "--num-pages", str(NUM_PAGES), "--max-running", str(MAX_RUNNING)]
    flags += ["--chunk-size", "256", "--log-level", "WARNING"]
    served = start_serve(tmp_path_factory.mktemp("storm") / "serve.stderr", embedded_model_dir, *flags)
    try:
        yield served
    finally:
        served.stop()


def _solo(stub: pb_grpc.SglangSchedulerStub, prompt: tuple[int, ...], max_new: int) -> list[int]:
    replies = list(stub.Generate(greedy_request(list(prompt), max_new), timeout=RPC_TIMEOUT_S))
    complete = replies[-1].complete
    assert complete.finish_reason == "length", complete
    return list(complete.output_ids)


async def _stream(stub: pb_grpc.SglangSchedulerStub, job: Job) -> Seen:
    seen = Seen()
    started = time.monotonic()
    call = stub.Generate(
        greedy_request(list(job.prompt), job.max_new, request_id=job.request_id, stream=True),
        timeout=STREAM_DEADLINE_S,
    )

    async def act() -> bool:
        """Do this job's action now; True when the client stops reading."""
        if job.kind == "abort":
            reply = await stub.Abort(pb.AbortRequest(request_id=job.request_id, reason="storm"), timeout=RPC_TIMEOUT_S)
            seen.abort_won_rpc = reply.success
        elif job.kind == "cancel":
            call.cancel()
            seen.cancelled = True
            return True
        return False

    try:
        stop = job.at == 0 and await act()
        chunks = 0
        while not stop:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                break
            if reply.HasField("complete"):
                seen.complete = reply.complete
                continue
            seen.tokens.extend(reply.chunk.token_ids)
            chunks += 1
            if chunks == job.at and job.kind != "run":
                stop = await act()
    except asyncio.CancelledError:
        seen.cancelled = True  # reading a call the client cancelled
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.CANCELLED and job.kind == "cancel":
            seen.cancelled = True
        else:
            seen.error = f"{exc.code().name}: {exc.details()}"
    seen.seconds = time.monotonic() - started
    return seen


async def _storm(target: str, jobs: list[Job]) -> list[Seen]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        return await asyncio.wait_for(asyncio.gather(*(_stream(stub, job) for job in jobs)), STORM_BOUND_S)


def _check(job: Job, seen: Seen, solo: list[int]) -> str:
    """The outcome of one stream, after asserting what its kind allows."""
    assert seen.error is None, (job, seen)
    assert seen.tokens == solo[: len(seen.tokens)], (job, seen, solo)
    if job.kind == "cancel":
        assert seen.cancelled and seen.complete is None, (job, seen)
        return "cancelled"
    complete = seen.complete
    assert complete is not None, (job, seen)
    assert list(complete.output_ids) == seen.tokens, (job, seen)  # nothing streamed after the finish
    assert complete.completion_tokens == len(seen.tokens), (job, complete)
    if complete.finish_reason == "abort":
        assert job.kind == "abort" and seen.abort_won_rpc, (job, seen)
        return "aborted"
    assert complete.finish_reason == "length" and seen.tokens == solo, (job, seen, solo)
    if job.kind == "run":
        return "ran"
    # The abort came too late to win: the RPC found the request finished, or it raced the final commit (the request
    # was still live when the Abort arrived, but its last token was already committed: the abort is a no-op).
    return "abort too late" if not seen.abort_won_rpc else "abort raced the finish"


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def test_abort_storm(stack: ServeStack, record_property: Callable[[str, object], None]) -> None:
    with grpc.insecure_channel(stack.scheduler) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        vocab = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S).vocab_size
        jobs, distinct = _jobs(vocab)
        solo = {key: _solo(stub, *key) for key in distinct}
        wait_for_idle_load(stub, RPC_TIMEOUT_S)

        started = time.monotonic()
        seen = asyncio.run(_storm(stack.scheduler, jobs))
        storm_s = time.monotonic() - started

        outcomes = Counter(_check(job, s, solo[job.prompt, job.max_new]) for job, s in zip(jobs, seen, strict=True))
        assert max(s.seconds for s in seen) < STREAM_DEADLINE_S
        assert outcomes["aborted"] >= STREAMS // 6, outcomes  # most Abort RPCs win: the storm really aborts
        assert outcomes["cancelled"] == STREAMS // 10 and outcomes["ran"] >= STREAMS // 2, outcomes

        load = wait_for_idle_load(stub, RPC_TIMEOUT_S)
        assert load.num_running_reqs == load.num_waiting_reqs == load.num_used_tokens == 0, load
        with grpc.insecure_channel(stack.fields["executor"]) as ex:
            assert epb_grpc.ExecutorStub(ex).GetState(epb.StateRequest(), timeout=RPC_TIMEOUT_S).buffers == 0

        # The whole pool, reserved by one request: possible only if no page or reservation leaked.
        rng = random.Random(SEED + 1)
        whole = [rng.randrange(10, vocab) for _ in range(NUM_PAGES * PAGE_SIZE)]
        replies = list(stub.Generate(greedy_request(whole, 1, request_id="whole-pool"), timeout=RPC_TIMEOUT_S))
        assert replies[-1].complete.finish_reason == "length", replies[-1]
        wait_for_idle_load(stub, RPC_TIMEOUT_S)

    rss = {"client": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    rss |= {name: _peak_rss_mb(pid) for name, pid in stack.pids.items()}
    summary = (
        f"abort storm: {STREAMS} streams, {outcomes['aborted']} aborted (Abort RPC won), "
        f"{outcomes['abort too late'] + outcomes['abort raced the finish']} aborts too late, "
        f"{outcomes['cancelled']} cancelled, {outcomes['ran']} ran; "
        f"{storm_s:.1f} s; peak RSS MB " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items())
    )
    print(summary)
    record_property("abort_storm", summary)
