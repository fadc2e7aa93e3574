"""Stream coalescing through the scheduler's gRPC service: a stream that keeps up gets every step's token at once, in
its own chunk; a stream whose previous message is still being written gets the tokens it missed merged into its next
chunk, never delayed and never lost.

    client ──gRPC──▶ SchedulerServicer ──▶ Engine ──RemoteRunner──▶ StepGate ──▶ executor service (embedded model)

The gate holds every step result and the test releases them one at a time, reading the caught-up stream's chunk
after each, so "one chunk per step" is a state, not a timing. The other stream's writes are held with the
servicer's ``before_write`` hook (the moment its previous message is still being written) while steps go on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as spb_grpc

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from services.scheduler.servicer import ServicerOptions
from tests.contract.gated_stack import WAIT_S, WritePause, gated_engine
from tests.helpers import smg_request
from tests.support.gate import StepGate
from tests.support.servers import ExecutorThread, ThreadedServer

PROMPT = [17, 240, 993, 5, 1400, 62]
MAX_NEW = 10
HELD_STEPS = 4  # steps that run while the behind stream's write is held


@pytest.fixture(scope="module")
def config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_path=str(embedded_model_dir), page_size=4, num_pages=64, max_running=4, check_invariants=True
    )


@pytest.fixture(scope="module")
def executor(config: EngineConfig) -> Iterator[str]:
    runner = ModelRunner.load(config)
    server = ExecutorThread(runner)
    yield f"127.0.0.1:{server.port}"
    server.stop()
    runner.shutdown()


@dataclass
class Reader:
    """One streaming Generate read chunk by chunk from the test thread (each read bounded by the RPC deadline)."""

    call: Iterator[spb.GenerateResponse]
    chunks: list[spb.GenerateStreamChunk] = field(default_factory=list)
    complete: spb.GenerateComplete | None = None

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    def next_chunk(self) -> spb.GenerateStreamChunk:
        response = next(self.call)
        assert response.WhichOneof("response") == "chunk", response
        self.chunks.append(response.chunk)
        return response.chunk

    def read_until(self, count: int) -> None:
        while len(self.tokens) < count:
            self.next_chunk()
        assert len(self.tokens) == count, self.tokens

    def finish(self) -> spb.GenerateComplete:
        response = next(self.call)
        assert response.WhichOneof("response") == "complete", response
        self.complete = response.complete
        assert list(self.call) == []
        return self.complete


def _release_step(gate: StepGate, sampled: dict[str, int]) -> set[str]:
    """Let the next held result go; the requests that step sampled (their counts moved)."""
    step = gate.release_next_result(WAIT_S)
    names = {rid for rid in sampled if (entry := step.entry(rid)) is not None and entry.sample}
    for rid in names:
        sampled[rid] += 1
    return names


def test_a_caught_up_stream_gets_a_chunk_per_step_and_a_stream_behind_gets_the_missed_tokens_in_one(
    config: EngineConfig, executor: str
) -> None:
    """Stream "up" is read after every step and gets exactly one chunk of one token per step. Stream "behind" has
    its second message held in the servicer (still being written) while HELD_STEPS more steps commit: once let go,
    it gets that message, then one chunk carrying the HELD_STEPS tokens it missed, then a chunk per step again. Both
    requests have the same prompt (greedy), so "behind"'s tokens and logprobs must be exactly "up"'s, chunk
    boundaries aside; each chunk's completion_tokens counts what the stream carried, and the Complete has every id
    and logprob, completion_tokens MAX_NEW.

    Fails if `_delivered` in services/scheduler/servicer.py stops merging what queued up (one chunk per output:
    the behind stream then gets HELD_STEPS one-token chunks), and if the relay waits to batch a caught-up stream
    (its per-step read then times out at the gate). Checked once by making `_delivered` return every item unmerged.
    """
    hold = WritePause("behind", after=1)
    sampled = {"behind": 0, "up": 0}
    with (
        gated_engine(executor, config) as (engine, gate),
        ThreadedServer(engine, options=ServicerOptions(before_write=hold)) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.start()}") as channel,
    ):
        stub = spb_grpc.SglangSchedulerStub(channel)
        gate.hold_results(lambda step: True)

        def generate(rid: str) -> Reader:
            request = smg_request(PROMPT, rid, stream=True, max_new_tokens=MAX_NEW, ignore_eos=True)
            request.return_logprob = True
            return Reader(stub.Generate(request, timeout=WAIT_S))

        # "behind" first: in every step its output is posted before "up"'s, so "up" having read a step's chunk
        # means "behind"'s output of that step is in its inbox.
        behind = generate("behind")
        while not sampled["behind"]:
            _release_step(gate, sampled)
        up = generate("up")
        while sampled["up"] < MAX_NEW:
            names = _release_step(gate, sampled)
            if sampled["behind"] == 2:
                assert hold.paused.wait(WAIT_S), "the behind stream never tried its second write"
            if "up" in names:
                chunk = up.next_chunk()
                assert len(chunk.token_ids) == 1 and chunk.completion_tokens == sampled["up"], chunk
            if sampled["behind"] == 2 + HELD_STEPS and not hold.released:
                hold.release()
                behind.read_until(2 + HELD_STEPS)
                assert [len(c.token_ids) for c in behind.chunks] == [1, 1, HELD_STEPS]
            elif hold.released and "behind" in names and sampled["behind"] <= MAX_NEW:
                behind.read_until(sampled["behind"])  # caught up again: a chunk per step
        gate.release_all()
        behind.read_until(MAX_NEW)
        done = behind.finish(), up.finish()

    assert [len(c.token_ids) for c in up.chunks] == [1] * MAX_NEW
    assert [len(c.token_ids) for c in behind.chunks] == [1, 1, HELD_STEPS] + [1] * (MAX_NEW - 2 - HELD_STEPS)
    assert behind.tokens == up.tokens
    assert [c.completion_tokens for c in behind.chunks] == [1, 2, 2 + HELD_STEPS, *range(3 + HELD_STEPS, MAX_NEW + 1)]
    merged = behind.chunks[2].output_logprobs
    assert list(merged.token_ids) == up.tokens[2 : 2 + HELD_STEPS]
    # The same tokens in another batch position: logprobs equal up to the forward's float rounding.
    up_logprobs = [lp for c in up.chunks for lp in c.output_logprobs.token_logprobs]
    assert list(merged.token_logprobs) == pytest.approx(up_logprobs[2 : 2 + HELD_STEPS], abs=1e-4)
    streamed = [list(c.output_logprobs.token_logprobs) for c in behind.chunks]
    assert [len(lps) for lps in streamed] == [len(c.token_ids) for c in behind.chunks]
    for complete, reader in zip(done, (behind, up), strict=True):
        assert list(complete.output_ids) == reader.tokens and complete.completion_tokens == MAX_NEW
        assert complete.finish_reason == "length" and complete.prompt_tokens == len(PROMPT)
        assert list(complete.output_logprobs.token_ids) == reader.tokens
        assert list(complete.output_logprobs.token_logprobs) == [
            lp for c in reader.chunks for lp in c.output_logprobs.token_logprobs
        ]
