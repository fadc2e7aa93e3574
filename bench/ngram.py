"""N-gram proposer cost per request per step against history length: it must stay flat (an incremental index, no scan).

Each request's history is built first (prompt plus earlier outputs, indexed once, timed separately per token), then
every step appends 1-3 tokens to every request (an accepted run) and drafts for all of them in one ``propose``
call. Two kinds of history: "repeating" text (copies of earlier spans of a 1000-token vocabulary with fresh tokens
between them: n-gram's home ground, most steps find a match and build a draft) and "random" text (a 32000-token
vocabulary: almost no match, the look-up's floor). Printed in one run, per history length, microseconds per request
per step as the median over steps (p50) and the mean (which includes the rare step that a garbage collection or
the OS scheduler stretched):

    history  chain p50  tree p50  random p50  chain mean  tree mean  random mean  drafted  index us/token  KiB/1k

``chain``: topk 1 with 8 draft tokens; ``tree``: topk 4, 16 nodes, depth 6 (both on repeating text); ``drafted``:
the share of repeating-text steps with a non-empty chain draft; ``index``: indexing a history from scratch (a
request's first draft), per token, and the index's size. Host CPU only: no model, no device.

    .venv/bin/python bench/ngram.py [--histories 100 1000 10000] [--requests 32] [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.executor.ngram import NgramConfig, NgramProposer
from engine.executor.proposer import DraftRequest
from engine.executor.sampler import SamplingState
from engine.sampling_params import SamplingParams

SAMPLING = SamplingState(SamplingParams(), (), frozenset(), 32000, "cpu", 0)
CHAIN = (8, 8, 1)  # (max_nodes, max_depth, topk)
TREE = (16, 6, 4)


@dataclass(frozen=True)
class Cost:
    """Microseconds per request per step."""

    p50: float
    mean: float


@dataclass(frozen=True)
class Row:
    history: int
    chain: Cost
    tree: Cost
    random: Cost
    drafted: float
    index_us_per_token: float
    index_kib_per_1k: float


def repeating(rng: random.Random, size: int) -> list[int]:
    tokens = [rng.randrange(1000) for _ in range(16)]
    while len(tokens) < size:
        grow(rng, tokens, rng.randint(4, 24))
    return tokens[:size]


def grow(rng: random.Random, tokens: list[int], count: int) -> None:
    """Append ``count`` tokens: mostly a copy of an earlier span, now and then a fresh token."""
    start = rng.randrange(len(tokens))
    for i in range(count):
        fresh = rng.random() < 0.1 or start + i >= len(tokens)
        tokens.append(rng.randrange(1000) if fresh else tokens[start + i])


def run(
    histories: list[list[int]], steps: int, caps: tuple[int, int, int], rng: random.Random, vocab: int
) -> tuple[Cost, float]:
    """(cost, share drafted) over ``steps`` steps after indexing the given histories; ``vocab`` 0: repeating text."""
    proposer = NgramProposer(NgramConfig())
    max_nodes, max_depth, topk = caps

    def batch() -> list[DraftRequest]:
        return [
            DraftRequest(slot, h, len(h) - 1, (), max_nodes, max_depth, topk, SAMPLING)
            for slot, h in enumerate(histories)
        ]

    proposer.propose(batch())  # index the histories: timed apart (index_cost)
    per_step: list[float] = []
    drafted = 0
    for _ in range(steps):
        for h in histories:
            if vocab:
                h.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
            else:
                grow(rng, h, rng.randint(1, 3))
        requests = batch()
        start = time.perf_counter()
        drafts = proposer.propose(requests)
        per_step.append((time.perf_counter() - start) / len(histories) * 1e6)
        drafted += sum(d.num_nodes > 0 for d in drafts)
    return Cost(statistics.median(per_step), statistics.fmean(per_step)), drafted / (steps * len(histories))


def index_cost(history: list[int]) -> tuple[float, float]:
    """(us per token, KiB per 1000 tokens) to index one history from scratch."""
    proposer = NgramProposer(NgramConfig())
    request = DraftRequest(0, history, len(history) - 1, (), *CHAIN, SAMPLING)
    start = time.perf_counter()
    proposer.propose([request])
    per_token = (time.perf_counter() - start) / len(history) * 1e6
    proposer.release(0)
    tracemalloc.start()
    proposer.propose([request])
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return per_token, size / 1024 / len(history) * 1000


def measure(size: int, requests: int, steps: int, seed: int) -> Row:
    rng = random.Random(seed)
    chain, drafted = run([repeating(rng, size) for _ in range(requests)], steps, CHAIN, rng, 0)
    tree, _ = run([repeating(rng, size) for _ in range(requests)], steps, TREE, rng, 0)
    random_histories = [[rng.randrange(32000) for _ in range(size)] for _ in range(requests)]
    random_cost, _ = run(random_histories, steps, CHAIN, rng, 32000)
    per_token, kib = index_cost(repeating(rng, size))
    return Row(size, chain, tree, random_cost, drafted, per_token, kib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.requests} requests, {args.steps} steps, config {NgramConfig()}")
    print("us per request per step:")
    print(
        "history  chain p50  tree p50  random p50  chain mean  tree mean  random mean  drafted  index us/token  KiB/1k"
    )
    for size in args.histories:
        r = measure(size, args.requests, args.steps, args.seed)
        print(
            f"{r.history:>7}  {r.chain.p50:>9.1f}  {r.tree.p50:>8.1f}  {r.random.p50:>10.1f}  {r.chain.mean:>10.1f}  "
            f"{r.tree.mean:>9.1f}  {r.random.mean:>11.1f}  {r.drafted:>7.0%}  {r.index_us_per_token:>14.2f}  "
            f"{r.index_kib_per_1k:>6.0f}"
        )


if __name__ == "__main__":
    main()
