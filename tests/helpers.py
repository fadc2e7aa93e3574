"""Helpers shared by the contract and end-to-end tests: prompts, greedy runs, the engine's baseline, and the
scheduler's gRPC API served on loopback with smg-shaped requests."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from engine.finish import FinishReason
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from tests.support.servers import ThreadedServer

# The sampling fields smg always sets, greedy; proto3 would read an unset n as 0 and an unset top_p as 0.
_GREEDY_FIELDS: dict[str, Any] = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1)


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``lo..hi`` token ids drawn from ``10..vocab - 1`` (clear of the special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def length_outputs(
    engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], timeout: float = 600.0
) -> list[list[int]]:
    """Run ``prompts`` as one batch; every request must end by length. Returns each one's output ids."""
    outs = engine.generate_batch(prompts, params, timeout=timeout)
    assert all(o.finish is not None and o.finish.reason is FinishReason.LENGTH for o in outs), outs
    return [list(o.output_ids or ()) for o in outs]


def assert_engine_baseline(engine: Engine, timeout: float) -> None:
    """The engine idle again with nothing leaked: every page free or evictable, no reservation, every slot free,
    no step in flight."""
    assert engine.wait_idle(timeout)
    s = engine.stats()
    assert s.free_pages + s.evictable_pages == s.total_pages, s
    assert s.reserved_pages == 0 and s.free_slots == s.total_slots and s.inflight_steps == 0, s


@contextmanager
def serve_scheduler(engine: Engine) -> Iterator[grpc.Channel]:
    """``engine`` behind the scheduler's gRPC server on a free loopback port, and a channel to it."""
    with ThreadedServer(engine) as server:
        port = server.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel


def smg_params(**fields: Any) -> pb.SamplingParams:
    """Greedy ``SamplingParams`` with every field smg always sends set explicitly; ``fields`` override them."""
    return pb.SamplingParams(**{**_GREEDY_FIELDS, **fields})


def smg_request(ids: list[int], rid: str = "", stream: bool = False, **fields: Any) -> pb.GenerateRequest:
    """A ``GenerateRequest`` of token ids with ``smg_params(**fields)``."""
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=smg_params(**fields), stream=stream
    )
