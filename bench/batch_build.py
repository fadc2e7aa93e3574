"""Host CPU to build one decode step's ForwardBatch, page tables copied from each request's list against gathered from
the executor's persistent page table (engine/kv/page_table.py), side by side in one run.

N decodes, each with C tokens of context (C / page_size pages), built repeatedly on the host; printed per (N, C):
milliseconds per build both ways and their ratio. The copy grows with every page of every running request; the
gather with the batch's width only.

    .venv/bin/python bench/batch_build.py [--streams 32 128] [--context 128 1024 8192] [--repeat 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kv.page_table import PageTable
from engine.model.forward_batch import ForwardBatch, LogitsMode, PageRows, SeqInput

PAGE_SIZE = 16


def _ms_per_build(seqs: list[SeqInput], rows: PageRows | None, repeat: int) -> float:
    ForwardBatch.build(seqs, PAGE_SIZE, "cpu", rows)  # warm
    started = time.perf_counter()
    for _ in range(repeat):
        ForwardBatch.build(seqs, PAGE_SIZE, "cpu", rows)
    return (time.perf_counter() - started) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    print(f"{'streams':>8} {'context':>8} {'copied ms':>10} {'gathered ms':>12} {'ratio':>6}")
    for streams in args.streams:
        for context in args.context:
            pages = -(-context // PAGE_SIZE)
            table = PageTable()
            seqs = []
            for slot in range(streams):
                own = list(range(slot * pages, (slot + 1) * pages))
                table.write(slot, 0, own)
                seqs.append(SeqInput((1,), context - 1, own, LogitsMode.LAST))
            rows = PageRows(table.array, np.arange(streams, dtype=np.int64))
            copied = _ms_per_build(seqs, None, args.repeat)
            gathered = _ms_per_build(seqs, rows, args.repeat)
            print(f"{streams:>8} {context:>8} {copied:>10.3f} {gathered:>12.3f} {copied / gathered:>5.1f}x")


if __name__ == "__main__":
    main()
