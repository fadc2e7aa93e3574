"""Speculative decoding: tokens per second and acceptance length with and without it, side by side in one run.

For each proposer (the draft model, n-gram lookup), each kind of prompt (ones that repeat themselves, n-gram's home
ground, and ones that do not) and each concurrency (1, 8, 32 streams), the same greedy requests run on the engine
(in process, the real scheduler loop and executor) four ways:

    plain          no speculation, overlap on (the default serving mode): the baseline
    spec           speculation, overlap off (the scheduler commits step N before launching N+1)
    spec+overlap   speculation overlapped (the next verify's draft starts from the previous one's accepted tokens
                   on the executor before the scheduler has committed them)
    fixed          spec+overlap with the adaptive rule off (every decode drafts the full depth): what "never
                   slower" protects against

Printed: output tokens per second of wall time for each, the acceptance length (tokens per verify: accepted drafts
plus the sampled one), and the ratios spec+overlap / plain and spec+overlap / spec. Targets (issue 15): >= 2x at one
stream with the draft model, >= 1.0x at 32 streams (never slower), overlapped >= 1.1x non-overlapped.

    .venv/bin/python bench/spec.py [--streams 1 8 32] [--max-new 96] [--algorithms draft ngram]
        [--target PATH] [--draft PATH] [--steps 4] [--topk 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig, SpecAlgorithm, SpeculativeConfig
from engine.executor.proposers import draft_dir
from engine.model.folder import model_dir
from engine.model.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine

# Prompts whose continuation repeats what they hold (lists, code, a passage to copy), and ones that do not.
_REPEATING = (
    "Copy this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, kiwis. "
    "apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, kiwis. apples, pears, plums,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\ndef",
    '{"name": "Ada", "city": "Paris"}\n{"name": "Bob", "city": "Rome"}\n{"name": "Cy", "city": "Oslo"}\n{"name":',
    "one two three four five one two three four five one two three four five one two three",
)
_FRESH = (
    "Tell me about the weather in the mountains in spring.",
    "Write a short note to a friend about a trip to the sea.",
    "What is the best way to learn to cook simple meals?",
    "Describe a quiet library on a rainy afternoon.",
)


@dataclass(frozen=True)
class Run:
    tokens_per_s: float
    accept_length: float


@dataclass(frozen=True)
class Row:
    algorithm: str
    prompts: str
    streams: int
    plain: Run
    spec: Run
    overlapped: Run
    fixed: Run


def _prompts(tokenizer: Tokenizer, kind: str, n: int, seed: int) -> list[list[int]]:
    texts = _REPEATING if kind == "repeating" else _FRESH
    rng = random.Random(seed)
    return [tokenizer.encode(texts[i % len(texts)] + " " * rng.randint(0, 2)) for i in range(n)]


def _measure(config: EngineConfig, prompts: list[list[int]], streams: int, max_new: int) -> Run:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    with Engine(config) as engine:
        engine.generate_batch(prompts[:streams], [replace(params, max_new_tokens=8)] * streams)  # warm up
        before = engine.stats().spec
        started = time.perf_counter()
        tokens = 0
        for start in range(0, len(prompts), streams):
            batch = prompts[start : start + streams]
            outs = engine.generate_batch(batch, [params] * len(batch), timeout=1800)
            tokens += sum(o.num_output_tokens for o in outs)
        elapsed = time.perf_counter() - started
        after = engine.stats().spec
    steps = after.verify_steps - before.verify_steps
    accepted = after.accepted_tokens - before.accepted_tokens
    return Run(tokens / elapsed, (accepted + steps) / steps if steps else 0.0)


def bench(args: argparse.Namespace) -> list[Row]:
    base = EngineConfig(model_path=args.target, max_running=max(args.streams), num_pages=8192, prefix_cache=False)
    target = model_dir(base)
    base = replace(base, model_path=str(target))
    tokenizer = Tokenizer.from_dir(target)
    rows = []
    for algorithm in args.algorithms:
        spec = SpeculativeConfig(SpecAlgorithm(algorithm), num_steps=args.steps, topk=args.topk)
        if spec.algorithm is SpecAlgorithm.DRAFT:
            spec = replace(spec, draft_model_path=args.draft or str(draft_dir(replace(base, model_path=None))))
        for kind in ("repeating", "fresh"):
            for streams in args.streams:
                prompts = _prompts(tokenizer, kind, max(streams * args.rounds, args.min_requests), seed=streams)
                runs = [
                    _measure(replace(base, speculative=s, overlap=o), prompts, streams, args.max_new)
                    for s, o in (
                        (SpeculativeConfig(), True),
                        (spec, False),
                        (spec, True),
                        (replace(spec, adaptive=False), True),
                    )
                ]
                rows.append(Row(algorithm, kind, streams, *runs))
                _print_row(rows[-1])
    return rows


_HEADER = (
    f"{'proposer':>8} {'prompts':>9} {'streams':>7} | {'plain':>7} {'spec':>7} {'spec+ov':>7} {'fixed':>7} tok/s | "
    f"{'acc len':>7} {'fixed':>6} | {'ov/plain':>8} {'ov/spec':>7} {'fixed/plain':>11}"
)


def _print_row(r: Row) -> None:
    print(
        f"{r.algorithm:>8} {r.prompts:>9} {r.streams:>7} | {r.plain.tokens_per_s:7.0f} {r.spec.tokens_per_s:7.0f} "
        f"{r.overlapped.tokens_per_s:7.0f} {r.fixed.tokens_per_s:7.0f}       | {r.overlapped.accept_length:7.2f} "
        f"{r.fixed.accept_length:6.2f} | {r.overlapped.tokens_per_s / r.plain.tokens_per_s:7.2f}x "
        f"{r.overlapped.tokens_per_s / r.spec.tokens_per_s:6.2f}x {r.fixed.tokens_per_s / r.plain.tokens_per_s:10.2f}x",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--algorithms", nargs="+", default=["draft", "ngram"], choices=["draft", "ngram"])
    parser.add_argument("--target", default=None, help="target checkpoint (default: the embedded model)")
    parser.add_argument("--draft", default=None, help="draft checkpoint (default: the embedded draft)")
    parser.add_argument("--steps", type=int, default=4, help="--speculative-num-steps")
    parser.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk")
    parser.add_argument("--rounds", type=int, default=2, help="batches of `streams` requests per measurement")
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"target {args.target or 'embedded'}, draft {args.draft or 'embedded draft'}, greedy, {args.max_new} tokens")
    print(_HEADER, flush=True)
    bench(args)


if __name__ == "__main__":
    main()
