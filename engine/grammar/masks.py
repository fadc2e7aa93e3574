"""Executor side of constrained sampling: fetch one step's fenced masks while its forward runs (C3, C4).

The fetch starts before the forward, on its own thread, so waiting at the grammar fence for the scheduler's commit
of the previous step overlaps the forward; only sampling waits for the masks ("delayed sampling").
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.grammar.backend import GrammarBackend
from engine.grammar.registry import MaskEntry, MaskOutcome
from engine.step import StepEntry

ALL_ALLOWED = -1  # an int32 word with every bit set


@dataclass(frozen=True)
class StepMasks:
    """The bitmask for every sampling row of a step, and the rows whose mask could not be had."""

    bitmask: torch.Tensor | None  # [B, W] int32, xgrammar layout; None when no row is constrained
    errors: dict[int, str]  # sampling row -> why it has no mask (the request ends; the others go on)


class PendingMasks:
    def __init__(self, future: Future[list[MaskOutcome]], rows: list[int], num_rows: int, words: int) -> None:
        self._future = future
        self._rows = rows
        self._num_rows = num_rows
        self._words = words

    def result(self, device: torch.device) -> StepMasks:
        bitmask = torch.full((self._num_rows, self._words), ALL_ALLOWED, dtype=torch.int32)  # [B, W]
        errors: dict[int, str] = {}
        try:
            outcomes = self._future.result()
        except Exception as exc:  # the grammar service is unreachable: these rows cannot be sampled correctly
            return StepMasks(bitmask.to(device), {row: f"grammar masks unavailable: {exc}" for row in self._rows})
        filled: list[int] = []
        words: list[torch.Tensor] = []
        for row, outcome in zip(self._rows, outcomes, strict=True):
            if outcome.rows is None:
                code = outcome.refusal.value if outcome.refusal is not None else "error"
                errors[row] = f"grammar mask refused ({code}): {outcome.message}"
            else:
                filled.append(row)
                words.append(outcome.rows.words[:1])  # [1, W]
        if filled:
            bitmask[filled] = torch.cat(words)  # [F, W] into their sampling rows, one copy
        return StepMasks(bitmask.to(device), errors)


class MaskFetcher:
    """Starts a step's batched mask request (one call per step) on a background thread."""

    def __init__(self, backend: GrammarBackend, vocab_size: int, wait_s: float) -> None:
        self._backend = backend
        self._words = -(-vocab_size // 32)
        self._wait_s = wait_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-masks")

    def start(self, sampling: Sequence[StepEntry]) -> PendingMasks | None:
        """``sampling``: the step's sampling entries in row order. None when none is constrained."""
        rows = [i for i, entry in enumerate(sampling) if entry.constrained]
        if not rows:
            return None
        entries = [MaskEntry(sampling[i].request_id, sampling[i].ordinal) for i in rows]
        future = self._pool.submit(self._backend.fill_masks, entries, self._wait_s)
        return PendingMasks(future, rows, len(sampling), self._words)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
