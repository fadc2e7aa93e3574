"""Executor side of constrained sampling: fetch one step's fenced masks while its forward runs (C3, C4).

The fetch starts before the forward, so waiting at the grammar fence for the scheduler's commit of the previous
step overlaps the forward; only sampling waits for the masks ("delayed sampling"). With delayed sampling an
in-process grammar opens the fence right away and the commit fills it; a remote one, in either mode, sends the
request at once and takes its reply after the forward (:class:`~engine.grammar_calls.FencingBackend`); otherwise
the blocking call runs on a thread of its own.

A draft model drafting under the grammar (``--speculative-draft-grammar on``) gets its masks the same way, one
fetch per draft depth (:class:`DraftMasks`), each started before that depth's draft forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.executor.proposer import DraftGrammar
from engine.grammar_calls import (
    DraftTree,
    FencingBackend,
    MaskEntry,
    MaskRefusals,
    MaskSource,
    MaskWait,
    mask_refused,
    masks_unavailable,
)

ALL_ALLOWED = -1  # an int32 word with every bit set


@dataclass(frozen=True)
class MaskRequest:
    """One constrained entry's masks: from logits row ``row``, its request's grammar at ``ordinal`` (the ordinal of
    the token the row samples, as the executor knows it), one row, or with ``draft`` one row per node after the
    first (C5: computed by pure traversal from the state at ``ordinal``)."""

    row: int
    request_id: str
    ordinal: int
    draft: DraftTree | None = None


@dataclass(frozen=True)
class StepMasks:
    """The bitmask for every sampling row of a step, and the rows whose mask could not be had."""

    bitmask: torch.Tensor | None  # [N, W] int32, xgrammar layout, a row per logits row; None: nothing constrained
    errors: dict[int, str]  # an entry's first row -> why it has no mask (the request ends; the others go on)

    def rows(self, picked: list[int]) -> StepMasks:
        """The masks of rows ``picked`` (one-row entries), renumbered 0, 1, ... in that order."""
        bitmask = self.bitmask
        if bitmask is not None:
            bitmask = bitmask.index_select(0, torch.tensor(picked, dtype=torch.long, device=bitmask.device))  # [P, W]
        errors = {k: self.errors[row] for k, row in enumerate(picked) if row in self.errors}
        return StepMasks(bitmask, errors)


class ThreadedWait:
    """A backend's blocking mask call running on the fetcher's thread."""

    def __init__(self, future: Future[MaskRefusals]) -> None:
        self._future = future

    def result(self) -> MaskRefusals:
        return self._future.result()

    def close(self) -> None:
        """Nothing to stop: the call ends at its deadline at the latest, and its answer is dropped."""


class PendingMasks:
    """A step's masks being written into its bitmask; :meth:`result` waits for them, :meth:`close` gives them up."""

    def __init__(self, wait: MaskWait, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._wait = wait
        self._bitmask = bitmask
        self._rows = rows

    def close(self) -> None:
        self._wait.close()

    def result(self, device: torch.device) -> StepMasks:
        try:
            refusals = self._wait.result()
        except Exception as exc:  # the grammar service is unreachable: these rows cannot be sampled correctly
            unavailable = {row: masks_unavailable(str(exc)) for row in self._rows}
            return StepMasks(_on_device(self._bitmask, device), unavailable)
        errors = {self._rows[i]: mask_refused(code, message) for i, (code, message) in refusals.items()}
        return StepMasks(_on_device(self._bitmask, device), errors)


def _on_device(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The step's bitmask on the sampling device. On CUDA from pinned memory without blocking: a copy from pageable
    memory would first wait for the forward queued on the stream."""
    if device.type != "cuda":
        return bitmask.to(device)
    return bitmask.pin_memory().to(device, non_blocking=True)


class MaskFetcher:
    """Starts a step's batched mask request (one call per step): a fence opened now, or a call on a thread."""

    def __init__(self, backend: MaskSource, vocab_size: int, wait_s: float) -> None:
        self._backend = backend
        # A fence that may wait (delayed sampling) is opened and left to the commits that fill it. One that may not
        # (early commit: every row is answerable at once) is computed on the fetch thread while the forward runs:
        # opened in place in this process, its rows would only be computed after the forward (bench/grammar.py: the
        # executor's wait for masks after the forward went from 0.04 to 0.7 ms p50 with early commit). A remote
        # service computes them in its own process either way: its request is sent from the caller's thread and
        # its reply taken after the forward, with no thread hop on the executor's core.
        fencing = backend if isinstance(backend, FencingBackend) else None
        self._fencing = fencing if fencing is not None and (wait_s > 0 or fencing.computes_meanwhile) else None
        self._words = -(-vocab_size // 32)
        self._wait_s = wait_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-masks")

    def start(self, constrained: Sequence[MaskRequest], num_rows: int) -> PendingMasks | None:
        """``constrained``: each constrained entry of a step whose sampling entries have ``num_rows`` logits rows in
        all. None when no entry is constrained."""
        if not constrained:
            return None
        rows = [c.row for c in constrained]
        entries = [MaskEntry(c.request_id, c.ordinal, c.draft) for c in constrained]
        # Rows without a grammar allow everything; the fetch writes each constrained row in place, where the
        # sampler reads it, so no per-row answer is built or copied.
        # A normal tensor even when the runner steps under inference mode: the fetch thread writes it in place.
        with torch.inference_mode(False):
            bitmask = torch.full((num_rows, self._words), ALL_ALLOWED, dtype=torch.int32)  # [B, W]
        wait: MaskWait
        if self._fencing is not None:
            wait = self._fencing.start_masks(entries, self._wait_s, bitmask, rows)
        else:
            wait = ThreadedWait(self._pool.submit(self._backend.fill_masks_into, entries, self._wait_s, bitmask, rows))
        return PendingMasks(wait, bitmask, rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class DraftMasks:
    """The masks a draft model drafts constrained requests under: one batched fenced call per draft depth (C3).

    For each request: the mask of its grammar's state after the committed tokens, the pending token and the draft
    tokens chosen so far (``spine``), asked at the request's ordinal with the spine as a chain draft and read from
    the chain's last row. The grammar service computes it by pure traversal from the committed state, which it
    leaves as it was (C5): drafting never commits anything."""

    def __init__(self, fetcher: MaskFetcher) -> None:
        self._fetcher = fetcher

    def start(self, positions: Sequence[tuple[DraftGrammar, Sequence[int]]]) -> PendingDraftMasks:
        """Ask for one row per (grammar, spine) now; the draft forward runs while it is answered."""
        requests: list[MaskRequest] = []
        first = 0
        for grammar, spine in positions:
            draft = DraftTree.chain(spine) if spine else None
            requests.append(MaskRequest(first, grammar.request_id, grammar.ordinal, draft))
            first += 1 + len(spine)
        return PendingDraftMasks(self._fetcher.start(requests, first), requests)


class PendingDraftMasks:
    """One depth's draft masks being answered."""

    def __init__(self, pending: PendingMasks | None, requests: list[MaskRequest]) -> None:
        self._pending = pending
        self._requests = requests

    def close(self) -> None:
        if self._pending is not None:
            self._pending.close()

    def result(self, device: torch.device) -> tuple[torch.Tensor | None, list[bool]]:
        """Each position's mask row [P, W] (None: nothing was asked) and whether it was had: a position whose mask
        was refused, or whose call failed, must not be drafted from (its row then allows everything)."""
        if self._pending is None:
            return None, []
        masks = self._pending.result(device)
        assert masks.bitmask is not None
        last = [r.row + (r.draft.num_rows - 1 if r.draft is not None else 0) for r in self._requests]
        rows = masks.bitmask.index_select(0, torch.tensor(last, dtype=torch.long, device=masks.bitmask.device))
        return rows, [r.row not in masks.errors for r in self._requests]  # [P, W]
