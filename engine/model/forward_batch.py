"""One model step's inputs, flattened, with every attention index built once per batch."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class LogitsMode(enum.Enum):
    """Which of a sequence's tokens get a logits row: none, the last one, or every one."""

    NONE = "none"
    LAST = "last"
    ALL = "all"


@dataclass(frozen=True)
class SeqInput:
    """One request's share of a step.

    ``start_pos`` is how many of this request's tokens are already in the KV cache; the step writes KV
    for positions ``start_pos .. start_pos + len(token_ids) - 1``. ``page_table`` lists the request's
    pages in position order and must cover positions ``[0, start_pos + len(token_ids))``.
    """

    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    logits: LogitsMode

    def __post_init__(self) -> None:
        if len(self.token_ids) == 0:
            raise ValueError("SeqInput.token_ids must not be empty")
        if self.start_pos < 0:
            raise ValueError(f"SeqInput.start_pos must be >= 0, got {self.start_pos}")

    @property
    def end_pos(self) -> int:
        """One past the last position this step writes."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, eq=False)
class DecodeGroup:
    """Every single-token sequence of the batch, attended together in one padded SDPA call.

    Keys of sequence b are gathered from ``kv_slots[b, :kv_lens[b]]`` in position order; the rest of the
    row is padding that points at slots of page 0 and is masked out.
    """

    rows: torch.Tensor  # [B] row of each query token in the flattened batch
    kv_slots: torch.Tensor  # [B, L] pool slot of key position l
    kv_lens: torch.Tensor  # [B] number of keys (= query position + 1)
    mask: torch.Tensor  # [B, 1, 1, L] bool, True = attend

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask when each query may only see the last ``window`` positions (itself included)."""
        key_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)  # [L]
        recent = key_pos[None, :] >= (self.kv_lens[:, None] - window)  # [B, L]
        return self.mask & recent[:, None, None, :]  # [B, 1, 1, L]


@dataclass(frozen=True, eq=False)
class PrefillChunk:
    """A run of two or more consecutive tokens of one sequence, attended in its own SDPA call.

    When ``start_pos`` is 0 the chunk's keys are exactly its own freshly computed K/V, so nothing is
    gathered (``kv_slots`` is None) and the mask is plain causal (``mask`` is None).
    """

    row_start: int
    row_end: int
    start_pos: int
    kv_slots: torch.Tensor | None  # [ctx] pool slots of positions 0 .. ctx-1, or None
    mask: torch.Tensor | None  # [n, ctx] bool causal mask offset by start_pos, or None

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
        query_pos = torch.arange(self.start_pos, self.context_len, device=device)  # [n]
        key_pos = torch.arange(self.context_len, device=device)  # [ctx]
        delta = query_pos[:, None] - key_pos[None, :]  # [n, ctx]
        return (delta >= 0) & (delta < window)  # [n, ctx]


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
    def build(cls, seqs: Sequence[SeqInput], page_size: int, device: torch.device | str) -> ForwardBatch:
        """Validate page tables and precompute ids, positions, write slots, gather indices and masks."""
        if not seqs:
            raise ValueError("ForwardBatch.build needs at least one sequence")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        tables = [_used_pages(i, seq, page_size) for i, seq in enumerate(seqs)]
        lens = [len(seq.token_ids) for seq in seqs]
        row_starts = [0]
        for n in lens:
            row_starts.append(row_starts[-1] + n)
        num_pages = max(len(t) for t in tables)
        padded = [t + [0] * (num_pages - len(t)) for t in tables]
        page_tables = torch.tensor(padded, dtype=torch.long, device=device)  # [S, P]
        seq_of_row = torch.repeat_interleave(
            torch.arange(len(seqs), device=device),
            torch.tensor(lens, device=device),
            output_size=row_starts[-1],
        )  # [T]
        starts = torch.tensor([seq.start_pos for seq in seqs], dtype=torch.long, device=device)  # [S]
        first_row = torch.tensor(row_starts[:-1], dtype=torch.long, device=device)  # [S]
        offsets = torch.arange(row_starts[-1], device=device) - first_row[seq_of_row]  # [T]
        positions = starts[seq_of_row] + offsets  # [T]
        write_slots = page_tables[seq_of_row, positions // page_size] * page_size + positions % page_size
        return cls(
            input_ids=torch.tensor([t for seq in seqs for t in seq.token_ids], dtype=torch.long, device=device),  # [T]
            positions=positions,
            write_slots=write_slots,  # [T]
            logits_rows=_logits_rows(seqs, row_starts, device),
            decode=_decode_group(seqs, row_starts, page_tables, page_size),
            prefills=_prefill_chunks(seqs, row_starts, page_tables, page_size),
            page_size=page_size,
            max_position=max(seq.end_pos for seq in seqs) - 1,
            max_page=max(max(t) for t in tables),
        )


def _used_pages(index: int, seq: SeqInput, page_size: int) -> list[int]:
    """The prefix of the page table this step touches; raises if the table is too short."""
    needed = -(-seq.end_pos // page_size)
    if len(seq.page_table) < needed:
        raise ValueError(
            f"seq {index}: page_table has {len(seq.page_table)} pages of {page_size} tokens but positions "
            f"0..{seq.end_pos - 1} (start_pos {seq.start_pos} + {len(seq.token_ids)} new tokens) "
            f"need {needed} pages"
        )
    pages = [int(p) for p in seq.page_table[:needed]]
    if min(pages) < 0:
        raise ValueError(f"seq {index}: page_table contains a negative page id: {pages}")
    return pages


def _slots(pages: torch.Tensor, num_positions: int, page_size: int) -> torch.Tensor:
    """Pool slots of positions 0 .. num_positions-1 for page table(s) ``pages`` ([..., P])."""
    pos = torch.arange(num_positions, device=pages.device)  # [L]
    return pages[..., pos // page_size] * page_size + pos % page_size  # [..., L]


def _decode_group(
    seqs: Sequence[SeqInput], row_starts: list[int], page_tables: torch.Tensor, page_size: int
) -> DecodeGroup | None:
    members = [i for i, seq in enumerate(seqs) if len(seq.token_ids) == 1]
    if not members:
        return None
    device = page_tables.device
    kv_lens = torch.tensor([seqs[i].end_pos for i in members], dtype=torch.long, device=device)  # [B]
    max_len = max(seqs[i].end_pos for i in members)
    member_idx = torch.tensor(members, dtype=torch.long, device=device)  # [B]
    valid = torch.arange(max_len, device=device)[None, :] < kv_lens[:, None]  # [B, L]
    return DecodeGroup(
        rows=torch.tensor([row_starts[i] for i in members], dtype=torch.long, device=device),  # [B]
        kv_slots=_slots(page_tables[member_idx], max_len, page_size),  # [B, L]
        kv_lens=kv_lens,
        mask=valid[:, None, None, :],  # [B, 1, 1, L]
    )


def _prefill_chunks(
    seqs: Sequence[SeqInput], row_starts: list[int], page_tables: torch.Tensor, page_size: int
) -> tuple[PrefillChunk, ...]:
    chunks = []
    for i, seq in enumerate(seqs):
        if len(seq.token_ids) == 1:
            continue
        kv_slots = mask = None
        if seq.start_pos > 0:
            kv_slots = _slots(page_tables[i], seq.end_pos, page_size)  # [ctx]
            device = page_tables.device
            query_pos = torch.arange(seq.start_pos, seq.end_pos, device=device)  # [n]
            mask = torch.arange(seq.end_pos, device=device)[None, :] <= query_pos[:, None]  # [n, ctx]
        chunks.append(PrefillChunk(row_starts[i], row_starts[i + 1], seq.start_pos, kv_slots, mask))
    return tuple(chunks)


def _logits_rows(seqs: Sequence[SeqInput], row_starts: list[int], device: torch.device | str) -> torch.Tensor:
    rows: list[int] = []
    for i, seq in enumerate(seqs):
        if seq.logits is LogitsMode.LAST:
            rows.append(row_starts[i + 1] - 1)
        elif seq.logits is LogitsMode.ALL:
            rows.extend(range(row_starts[i], row_starts[i + 1]))
    return torch.tensor(rows, dtype=torch.long, device=device)  # [R]
