"""Offline throughput: ordinal's in-process engine vs transformers ``generate()`` on the same checkpoint.

64 requests (by default) with mixed prompt lengths (16-512) and output lengths (16-256), greedy. Both sides
produce exactly the requested number of tokens per request and only those tokens are counted. transformers
runs as a user would batch it: left-padded batches in submission order, each batch generating until its
longest request is done (min_new_tokens keeps EOS from ending it early), outputs cut to each request's length.

    .venv/bin/python bench/offline.py            # prints a table with both rates and the ratio
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model.embedded import ensure_embedded_model
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 512))] for _ in range(n)]
    return Workload(prompts, [rng.randint(16, 256) for _ in range(n)])


def run_ordinal(path: Path, work: Workload, overlap: bool) -> float:
    config = EngineConfig(model_path=str(path), num_pages=8192, max_running=128, chunk_size=1024, overlap=overlap)
    with Engine(config) as engine:
        warm = [SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)]
        engine.generate_batch([work.prompts[0]], warm)
        params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in work.output_lens]
        started = time.perf_counter()
        outs = engine.generate_batch(work.prompts, params)
        elapsed = time.perf_counter() - started
    assert [len(o.output_ids or ()) for o in outs] == work.output_lens
    return work.output_tokens / elapsed


@torch.inference_mode()
def run_transformers(path: Path, work: Workload, batch_size: int, pad_id: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    produced = 0
    started = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[i : i + batch_size]
        lens = work.output_lens[i : i + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [b, width], left padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [b, width]
        longest = max(lens)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
        )  # [b, width + longest]
        produced += sum(min(n, out.shape[1] - width) for n in lens)
    elapsed = time.perf_counter() - started
    assert produced == work.output_tokens
    return work.output_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF folder; default: the embedded model")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16, help="transformers batch size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    path = args.model or ensure_embedded_model()
    from engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    work = make_workload(args.requests, tok.vocab_size, args.seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    print(f"{args.requests} requests, {work.output_tokens} output tokens, torch threads {torch.get_num_threads()}")
    rows = [
        ("ordinal (overlap)", run_ordinal(path, work, overlap=True)),
        ("ordinal (no overlap)", run_ordinal(path, work, overlap=False)),
        (f"transformers generate (batch {args.hf_batch})", run_transformers(path, work, args.hf_batch, pad)),
    ]
    reference = rows[-1][1]
    print(f"{'engine':<40}{'tokens/s':>12}{'vs transformers':>18}")
    for name, rate in rows:
        print(f"{name:<40}{rate:>12.1f}{rate / reference:>17.2f}x")


if __name__ == "__main__":
    main()
