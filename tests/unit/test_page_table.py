"""The executor's persistent page table and the batch built from it: the same batch as from each sequence's list."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.kv.page_table import PageTable
from engine.model.forward_batch import ForwardBatch, LogitsMode, PageRows, SeqInput

PAGE_SIZE = 4


def _same(a: ForwardBatch, b: ForwardBatch) -> None:
    for name in ("input_ids", "positions", "write_slots", "logits_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.max_page, a.max_position) == (b.max_page, b.max_position)
    assert (a.decode is None) == (b.decode is None)
    if a.decode is not None and b.decode is not None:
        assert torch.equal(a.decode.page_tables, b.decode.page_tables)
        assert torch.equal(a.decode.kv_lens, b.decode.kv_lens)
        assert torch.equal(a.decode.rows, b.decode.rows)
    assert len(a.prefills) == len(b.prefills)
    for x, y in zip(a.prefills, b.prefills, strict=True):
        assert (x.pages is None) == (y.pages is None)
        if x.pages is not None and y.pages is not None:
            assert torch.equal(x.pages, y.pages)


@pytest.mark.parametrize("seed", range(5))
def test_a_batch_gathered_from_the_table_equals_one_copied_from_the_lists(seed: int) -> None:
    """Slots reused by shorter requests leave stale pages past their own: the gathered batch never names them (it
    zeroes them as the copied one pads), so both batches are the same tensor for tensor. Fails if the gather skips
    the zeroing (a decode's page table row names an earlier request's page)."""
    rng = random.Random(seed)
    table = PageTable(num_slots=2, width=2)  # small: the writes below make it grow in both directions
    for slot in range(12):  # an earlier, longer occupant of every slot
        table.write(slot, 0, [rng.randrange(1, 90) for _ in range(rng.randrange(6, 12))])
    seqs, slots = [], rng.sample(range(12), 8)
    for slot in slots:
        kind = rng.choice(("decode", "prefill", "chain", "tree"))
        start = 0 if kind == "prefill" else rng.randrange(1, 14)
        n = {"decode": 1, "prefill": rng.randrange(2, 9), "chain": rng.randrange(2, 5), "tree": 4}[kind]
        need = -(-(start + n) // PAGE_SIZE)
        pages = [rng.randrange(1, 90) for _ in range(need + rng.randrange(0, 2))]  # sometimes a page ahead
        table.write(slot, 0, pages)
        parents = (-1, 0, 0, 1) if kind == "tree" else None
        mode = LogitsMode.ALL if kind in ("chain", "tree") else LogitsMode.LAST
        seqs.append(SeqInput([rng.randrange(50) for _ in range(n)], start, pages, mode, parents))
    rows = np.array(slots, dtype=np.int64)
    _same(
        ForwardBatch.build(seqs, PAGE_SIZE, "cpu", PageRows(table.array, rows)),
        ForwardBatch.build(seqs, PAGE_SIZE, "cpu"),
    )


def test_pages_written_later_extend_a_row_in_place() -> None:
    table = PageTable(num_slots=1, width=1)
    table.write(3, 0, [7, 8])
    table.write(3, 2, [9])
    assert table.array[3, :3].tolist() == [7, 8, 9]
    assert table.array.shape[0] >= 4


def test_a_negative_page_is_refused() -> None:
    with pytest.raises(ValueError, match="pages"):
        PageTable().write(0, 0, [1, -2])


def test_a_sequence_short_of_pages_is_refused_whatever_the_table_holds() -> None:
    """The count check reads the sequence's own list: stale pages in its row never make up for missing ones."""
    table = PageTable()
    table.write(0, 0, [5, 6, 7])
    seq = SeqInput([1], 5, [5], LogitsMode.LAST)  # positions 0..5 need 2 pages, the request has 1
    with pytest.raises(ValueError, match="seq 0: page_table has 1 pages"):
        ForwardBatch.build([seq], PAGE_SIZE, "cpu", PageRows(table.array, np.array([0])))
