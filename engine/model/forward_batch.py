"""One model step's inputs, flattened, with every attention index built once per batch."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch


class LogitsMode(enum.Enum):
    """Which of a sequence's tokens get a logits row: none, the last one, or every one."""

    NONE = "none"
    LAST = "last"
    ALL = "all"


@dataclass(slots=True)  # not frozen: one per entry per step, where frozen's __init__ costs five times as much
class SeqInput:
    """One request's share of a step.

    ``start_pos`` is how many of this request's tokens are already in the KV cache; the step writes KV
    for positions ``start_pos .. start_pos + len(token_ids) - 1``. ``page_table`` lists the request's
    pages in position order and must cover positions ``[0, start_pos + len(token_ids))``.

    ``tree_parents`` (speculative verify) makes the run a tree instead of a chain: token 0 is the root, token
    ``j >= 1`` follows token ``tree_parents[j] < j``. Each token's KV still goes to position ``start_pos + j`` (the
    layout slot), but it is rotated for position ``start_pos + depth(j)`` and attends the context
    ``[0, start_pos)``, its ancestors and itself only. None (a chain) is the same as parents ``j - 1``.
    """

    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    logits: LogitsMode
    tree_parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) == 0:
            raise ValueError("SeqInput.token_ids must not be empty")
        if self.start_pos < 0:
            raise ValueError(f"SeqInput.start_pos must be >= 0, got {self.start_pos}")
        if self.tree_parents is not None:
            parents = self.tree_parents
            if len(parents) != len(self.token_ids) or parents[0] != -1:
                raise ValueError("SeqInput.tree_parents: one parent per token, -1 for the root (token 0)")
            if any(not 0 <= parents[j] < j for j in range(1, len(parents))):
                raise ValueError("SeqInput.tree_parents: every token but the root follows an earlier one")

    def depths(self) -> list[int]:
        """Each token's distance from the root: its rotary position is ``start_pos`` plus this."""
        if self.tree_parents is None:
            return list(range(len(self.token_ids)))
        depths = [0] * len(self.token_ids)
        for j in range(1, len(depths)):
            depths[j] = depths[self.tree_parents[j]] + 1
        return depths

    def ancestry(self) -> torch.Tensor:
        """[n, n] bool: row j is True at j and at each of its ancestors (lower-triangular for a chain)."""
        n = len(self.token_ids)
        if self.tree_parents is None:
            return torch.ones(n, n, dtype=torch.bool).tril()  # [n, n]
        seen = torch.zeros(n, n, dtype=torch.bool)  # [n, n]
        for j in range(n):
            seen[j, j] = True
            if j:
                seen[j] |= seen[self.tree_parents[j]]
        return seen

    @property
    def end_pos(self) -> int:
        """One past the last position this step writes."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, eq=False)
class PageRows:
    """The batch's page tables as rows of one persistent array (engine/kv/page_table.py): sequence ``s``'s pages are
    ``array[rows[s], :len(seqs[s].page_table)]``, the same ids as its ``page_table``. Lets a step gather every page
    table at once instead of copying each one."""

    array: npt.NDArray[np.int64]  # [N, W] one row per slot
    rows: npt.NDArray[np.int64]  # [S] the row of each sequence


@dataclass(frozen=True, eq=False)
class DecodeGroup:
    """Every decode-attended query of the batch (single tokens, and short runs after cached context, one query per
    token), attended together in one call.

    Query b's keys are positions ``0 .. kv_lens[b]-1``, found through its sequence's page table row
    ``page_tables[b]`` (padded with page 0 past its last page). Attention reads the pool by page, never by
    token: the native kernel walks the table in place, the torch path gathers whole pages. ``runs`` groups the
    queries of one sequence's run (a verify's chain), which the native kernel attends together: each key read once
    for all of them.
    """

    rows: torch.Tensor  # [B] row of each query token in the flattened batch
    page_tables: torch.Tensor  # [B, P] pages of each sequence in position order, 0-padded
    kv_lens: torch.Tensor  # [B] number of keys (= query position + 1)
    page_size: int
    covers_batch: bool  # rows == 0 .. T-1: the batch is all decodes, queries need no gather/scatter
    runs: torch.Tensor | None = None  # [M + 1] queries runs[m] .. runs[m + 1] - 1 are one sequence's; None: one each

    @property
    def padded_len(self) -> int:
        """Key positions covered by the padded page tables (P * page_size)."""
        return int(self.page_tables.shape[1]) * self.page_size

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, P * page_size] bool, True = attend: the sequence's own keys, restricted to the last
        ``window`` positions (its own included) when ``window`` is set."""
        key_pos = torch.arange(self.padded_len, device=self.kv_lens.device)  # [L]
        lens = self.kv_lens[:, None]  # [B, 1]
        visible = key_pos[None, :] < lens  # [B, L]
        if window is not None:
            visible &= key_pos[None, :] >= lens - window  # [B, L]
        return visible[:, None, None, :]  # [B, 1, 1, L]


@dataclass(frozen=True, eq=False)
class PrefillChunk:
    """A run of two or more consecutive tokens of one sequence, attended in its own SDPA call.

    When ``start_pos`` is 0 the chunk's keys are exactly its own freshly computed K/V, so nothing is
    gathered (``pages`` is None) and the mask is plain causal (``mask`` is None). Otherwise its keys are
    positions ``0 .. context_len-1``, read from the pool through ``pages``.
    """

    row_start: int
    row_end: int
    start_pos: int
    pages: torch.Tensor | None  # [ceil(ctx / page_size)] pages of positions 0 .. ctx-1, or None
    mask: torch.Tensor | None  # [n, ctx] bool causal mask offset by start_pos (a tree's mask), or None
    depths: list[int] | None = None  # a draft tree's depth per token (its rotary offset); None for a chain

    @property
    def num_tokens(self) -> int:
        return self.row_end - self.row_start

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens

    def window_mask(self, window: int, device: torch.device) -> torch.Tensor | None:
        """Causal mask restricted to the last ``window`` positions; None when the window changes nothing."""
        if window >= self.context_len:
            return self.mask
        if self.depths is None:
            query_pos = torch.arange(self.start_pos, self.context_len, device=device)  # [n]
            key_pos = torch.arange(self.context_len, device=device)  # [ctx]
            delta = query_pos[:, None] - key_pos[None, :]  # [n, ctx]
            return (delta >= 0) & (delta < window)  # [n, ctx]
        # A tree: distances count rotary positions (a node's depth), the ancestry stays the tree's own.
        own = self.start_pos + torch.tensor(self.depths, device=device)  # [n]
        key_pos = torch.cat((torch.arange(self.start_pos, device=device), own))  # [ctx]
        delta = own[:, None] - key_pos[None, :]  # [n, ctx]
        assert self.mask is not None
        return self.mask & (delta < window)  # [n, ctx]


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """The flattened tokens of a step plus all indices attention needs, built once and shared by layers.

    Rows are the concatenation of every sequence's tokens in sequence order. Logits come back in
    sequence order: 0, 1 or len(token_ids) rows per sequence according to its ``LogitsMode``.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] pool slot receiving each token's K/V
    logits_rows: torch.Tensor  # [R] rows whose hidden state becomes logits
    decode: DecodeGroup | None
    prefills: tuple[PrefillChunk, ...]
    page_size: int
    max_position: int  # largest position written; checked against the RoPE table
    max_page: int  # largest page id referenced; checked against the pool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_logits_rows(self) -> int:
        return int(self.logits_rows.shape[0])

    @classmethod
    def build(
        cls, seqs: Sequence[SeqInput], page_size: int, device: torch.device | str, pages: PageRows | None = None
    ) -> ForwardBatch:
        """Validate page tables and precompute ids, positions, write slots, attention indices and masks.

        Index arithmetic runs on host numpy arrays with no per-token Python, then moves to ``device``: this
        runs once per step and must stay small next to a decode forward. ``pages``: the same page tables as rows of
        a persistent array, gathered at once (the executor's); without it each sequence's list is copied.
        """
        if not seqs:
            raise ValueError("ForwardBatch.build needs at least one sequence")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        layout = _HostLayout.of(seqs, page_size, pages)
        positions = layout.positions()  # [T] KV positions (layout slots)
        decode_runs = _decode_runs(layout, seqs)  # [S]
        rows_page = layout.page_tables[layout.seq_of_row, positions // page_size]  # [T]
        return cls(
            input_ids=_to(_flat_ints((seq.token_ids for seq in seqs), layout.num_tokens), device),  # [T]
            positions=_to(_rotary_positions(seqs, layout, positions), device),  # [T]
            write_slots=_to(rows_page * page_size + positions % page_size, device),  # [T]
            logits_rows=_to(layout.logits_rows([seq.logits for seq in seqs]), device),  # [R]
            decode=_decode_group(layout, device, decode_runs),
            prefills=_prefill_chunks(layout, device, seqs, decode_runs),
            page_size=page_size,
            max_position=int(layout.ends.max()) - 1,
            max_page=int(layout.page_tables.max()),
        )


_Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class _HostLayout:
    """Per-sequence counts and page tables of a step as host numpy arrays (S sequences, T tokens)."""

    page_size: int
    lens: _Ints  # [S] tokens of this step
    starts: _Ints  # [S] first position written
    row_starts: _Ints  # [S + 1] first row of each sequence, then T
    seq_of_row: _Ints  # [T] sequence of each row
    page_counts: _Ints  # [S] pages covering positions 0 .. end - 1
    page_tables: _Ints  # [S, P] those pages, 0-padded

    @classmethod
    def of(cls, seqs: Sequence[SeqInput], page_size: int, pages: PageRows | None = None) -> _HostLayout:
        count = len(seqs)
        # Lists, not generators, feed numpy: this runs once per step over every sequence of the batch.
        lens = np.array([len(seq.token_ids) for seq in seqs], dtype=np.int64)  # [S]
        starts = np.array([seq.start_pos for seq in seqs], dtype=np.int64)  # [S]
        row_starts = np.zeros(count + 1, dtype=np.int64)  # [S + 1]
        np.cumsum(lens, out=row_starts[1:])
        needed = -(-(starts + lens) // page_size)  # [S] pages covering positions 0 .. end - 1
        _check_page_counts(seqs, page_size, needed)
        page_tables = _copied_tables(seqs, needed) if pages is None else _gathered_tables(pages, needed)
        return cls(
            page_size=page_size,
            lens=lens,
            starts=starts,
            row_starts=row_starts,
            seq_of_row=np.repeat(np.arange(count, dtype=np.int64), lens),  # [T]
            page_counts=needed,
            page_tables=page_tables,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.row_starts[-1])

    @property
    def ends(self) -> _Ints:
        """[S] one past the last position written."""
        return self.starts + self.lens

    def positions(self) -> _Ints:
        """[T] position of every row."""
        offsets = np.arange(self.num_tokens, dtype=np.int64) - self.row_starts[self.seq_of_row]  # [T]
        return self.starts[self.seq_of_row] + offsets  # [T]

    def logits_rows(self, modes: list[LogitsMode]) -> _Ints:
        """[R] rows that produce logits, in row (= sequence) order."""
        last = np.array([m is LogitsMode.LAST for m in modes], dtype=np.bool_)  # [S]
        every = np.array([m is LogitsMode.ALL for m in modes], dtype=np.bool_)  # [S]
        is_last_row = np.zeros(self.num_tokens, dtype=np.bool_)  # [T]
        is_last_row[self.row_starts[1:] - 1] = True
        keep = every[self.seq_of_row] | (last[self.seq_of_row] & is_last_row)  # [T]
        return np.flatnonzero(keep).astype(np.int64)  # [R]


def _check_page_counts(seqs: Sequence[SeqInput], page_size: int, needed: _Ints) -> None:
    have = np.fromiter((len(seq.page_table) for seq in seqs), dtype=np.int64, count=len(seqs))  # [S]
    short = np.flatnonzero(have < needed)
    if short.size:
        index = int(short[0])
        seq, count = seqs[index], int(needed[index])
        raise ValueError(
            f"seq {index}: page_table has {len(seq.page_table)} pages of {page_size} tokens but positions "
            f"0..{seq.end_pos - 1} (start_pos {seq.start_pos} + {len(seq.token_ids)} new tokens) "
            f"need {count} pages"
        )


def _copied_tables(seqs: Sequence[SeqInput], needed: _Ints) -> _Ints:
    """[S, P] the pages each sequence's positions need, copied from its list, 0-padded; validated."""
    counts = needed.tolist()
    flat = _flat_ints((seq.page_table[:count] for seq, count in zip(seqs, counts, strict=True)), sum(counts))
    if int(flat.min()) < 0:
        index = int(np.searchsorted(np.cumsum(counts), int(flat.argmin()), side="right"))
        pages = list(seqs[index].page_table[: counts[index]])
        raise ValueError(f"seq {index}: page_table contains a negative page id: {pages}")
    tables = np.zeros((len(seqs), int(needed.max())), dtype=np.int64)  # [S, P]
    # Row-major boolean assignment fills each row's leading needed[s] entries in order.
    tables[np.arange(tables.shape[1])[None, :] < needed[:, None]] = flat
    return tables


def _gathered_tables(pages: PageRows, needed: _Ints) -> _Ints:
    """[S, P] the same, gathered from the persistent rows: what lies past a sequence's own pages is zeroed, so that no
    page of another request (an earlier one of the slot) is ever named."""
    width = int(needed.max())
    if width > pages.array.shape[1]:
        raise ValueError(f"page rows hold {pages.array.shape[1]} pages, a sequence needs {width}")
    tables = pages.array[pages.rows, :width]  # [S, P] a copy (fancy index)
    tables[np.arange(width)[None, :] >= needed[:, None]] = 0
    if int(tables.min()) < 0:
        raise ValueError(f"seq {int(np.argwhere(tables < 0)[0, 0])}: page rows contain a negative page id")
    return tables


def _flat_ints(parts: Iterable[Sequence[int]], total: int) -> _Ints:
    """Concatenate integer sequences into one int64 array without building an intermediate list."""
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=total)


def _to(array: _Ints, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


# A short run after cached context (a speculative verify's chain, a small last chunk) is attended as that many
# decode queries, query j seeing positions [0, start + j]: the same causal attention, through the paged decode
# kernel that reads K/V in place, instead of gathering the context for one SDPA call.
MAX_DECODE_RUN = 8


def _decode_runs(layout: _HostLayout, seqs: Sequence[SeqInput]) -> npt.NDArray[np.bool_]:
    """[S] which sequences are attended as decode queries: single tokens, and short chains after cached context."""
    short = (layout.lens == 1) | ((layout.lens <= MAX_DECODE_RUN) & (layout.starts > 0))  # [S]
    trees = np.array([seq.tree_parents is not None for seq in seqs], dtype=np.bool_)  # [S]
    return short & ~trees  # [S]


def _decode_group(
    layout: _HostLayout, device: torch.device | str, members: npt.NDArray[np.bool_]
) -> DecodeGroup | None:
    picked = np.flatnonzero(members)  # [M] decode-attended sequences
    if picked.size == 0:
        return None
    lens = layout.lens[picked]  # [M]
    seq = np.repeat(picked, lens)  # [B] sequence of each query
    offset = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)  # [B]
    width = int(layout.page_counts[picked].max())
    runs = None
    if int(lens.max()) > 1:
        runs = np.zeros(picked.size + 1, dtype=np.int64)  # [M + 1]
        np.cumsum(lens, out=runs[1:])
    return DecodeGroup(
        rows=_to(layout.row_starts[seq] + offset, device),  # [B]
        page_tables=_to(layout.page_tables[seq, :width], device),  # [B, P]
        kv_lens=_to(layout.starts[seq] + offset + 1, device),  # [B] query j of a run sees positions 0 .. start + j
        page_size=layout.page_size,
        covers_batch=bool(members.all()),
        runs=None if runs is None else _to(runs, "cpu"),  # host-side: only the native kernel reads it
    )


def _rotary_positions(seqs: Sequence[SeqInput], layout: _HostLayout, positions: _Ints) -> _Ints:
    """[T] the position each token is rotated for: its KV position, except inside a draft tree (its depth)."""
    if all(seq.tree_parents is None for seq in seqs):
        return positions
    rotary = positions.copy()  # [T]
    for i, seq in enumerate(seqs):
        if seq.tree_parents is not None:
            first = int(layout.row_starts[i])
            rotary[first : first + len(seq.token_ids)] = seq.start_pos + np.asarray(seq.depths(), dtype=np.int64)
    return rotary


def _prefill_chunks(
    layout: _HostLayout, device: torch.device | str, seqs: Sequence[SeqInput], decode_runs: npt.NDArray[np.bool_]
) -> tuple[PrefillChunk, ...]:
    chunks = []
    for i in np.flatnonzero(~decode_runs).tolist():
        start, end = int(layout.starts[i]), int(layout.ends[i])
        pages = mask = None
        if start > 0:
            pages = _to(layout.page_tables[i, : layout.page_counts[i]], device)  # [ceil(ctx / page_size)]
        tree = seqs[i].tree_parents is not None
        if tree:
            # The context, then the run's own slots where they are the query's ancestors (or itself).
            context = torch.ones(end - start, start, dtype=torch.bool)  # [n, start]
            mask = torch.cat((context, seqs[i].ancestry()), dim=1).to(device)  # [n, ctx]
        elif start > 0:
            query_pos = torch.arange(start, end, device=device)  # [n]
            mask = torch.arange(end, device=device)[None, :] <= query_pos[:, None]  # [n, ctx]
        rows = int(layout.row_starts[i]), int(layout.row_starts[i + 1])
        depths = seqs[i].depths() if tree else None
        chunks.append(PrefillChunk(*rows, start, pages, mask, depths))
    return tuple(chunks)
