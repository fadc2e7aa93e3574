"""Tests of the KV page allocator and the request slot table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.allocator import OutOfPagesError, PageAllocator
from engine.kv.slots import SlotTable

# ---- PageAllocator ----------------------------------------------------------------------------------


def test_alloc_returns_lowest_free_pages_in_order() -> None:
    allocator = PageAllocator(8)
    assert allocator.alloc(3) == [0, 1, 2]
    assert allocator.alloc(2) == [3, 4]
    allocator.free([1, 0])
    assert allocator.alloc(3) == [0, 1, 5]


def test_counters_and_is_free() -> None:
    allocator = PageAllocator(5)
    assert (allocator.num_total, allocator.num_free, allocator.num_used) == (5, 5, 0)
    pages = allocator.alloc(2)
    assert (allocator.num_free, allocator.num_used) == (3, 2)
    assert not allocator.is_free(pages[0])
    assert allocator.is_free(4)
    allocator.free(pages)
    assert (allocator.num_free, allocator.num_used) == (5, 0)


def test_alloc_zero_and_all() -> None:
    allocator = PageAllocator(3)
    assert allocator.alloc(0) == []
    assert allocator.alloc(3) == [0, 1, 2]
    assert allocator.num_free == 0
    assert allocator.alloc(0) == []


def test_alloc_too_many_raises_and_takes_nothing() -> None:
    allocator = PageAllocator(4)
    allocator.alloc(2)
    with pytest.raises(OutOfPagesError, match="requested 3"):
        allocator.alloc(3)
    assert allocator.num_free == 2


def test_alloc_negative_raises() -> None:
    with pytest.raises(ValueError):
        PageAllocator(4).alloc(-1)


def test_double_free_raises_naming_the_page() -> None:
    allocator = PageAllocator(4)
    pages = allocator.alloc(2)
    allocator.free([pages[1]])
    with pytest.raises(ValueError, match=r"page 1\b"):
        allocator.free([pages[1]])


def test_free_of_never_allocated_page_raises() -> None:
    allocator = PageAllocator(4)
    with pytest.raises(ValueError, match="page 3"):
        allocator.free([3])


def test_free_same_page_twice_in_one_call_raises_and_frees_nothing() -> None:
    allocator = PageAllocator(4)
    allocator.alloc(3)
    with pytest.raises(ValueError, match="page 2"):
        allocator.free([0, 2, 2])
    assert allocator.num_free == 1
    assert not allocator.is_free(0)


def test_free_out_of_range_raises_and_frees_nothing() -> None:
    allocator = PageAllocator(4)
    allocator.alloc(4)
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=f"page {bad}"):
            allocator.free([0, bad])
    assert allocator.num_free == 0
    with pytest.raises(ValueError, match="out of range"):
        allocator.is_free(4)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    num_pages=st.integers(0, 16),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 2**16)), max_size=40),
)
def test_allocator_matches_a_set_model(num_pages: int, ops: list[tuple[bool, int, int]]) -> None:
    """Random alloc/free (including bad frees) against a plain set of held pages."""
    allocator = PageAllocator(num_pages)
    held: set[int] = set()
    for is_alloc, count, pick in ops:
        if is_alloc:
            free_before = sorted(set(range(num_pages)) - held)
            if count > len(free_before):
                with pytest.raises(OutOfPagesError):
                    allocator.alloc(count)
            else:
                got = allocator.alloc(count)
                assert got == free_before[:count]
                held.update(got)
        elif held and pick % 3:
            chosen = sorted(held)[pick % len(held) :][:count]
            allocator.free(chosen)
            held.difference_update(chosen)
        else:
            bad = pick % (num_pages + 2) - 1  # -1 .. num_pages: out of range, or in range
            if bad not in held:
                # Out of range or already free: freeing it must fail and change nothing.
                with pytest.raises(ValueError, match=f"page {bad}"):
                    allocator.free([bad])
        assert allocator.num_used == len(held)
        assert allocator.num_free + allocator.num_used == num_pages
        assert all(allocator.is_free(p) == (p not in held) for p in range(num_pages))


# ---- SlotTable --------------------------------------------------------------------------------------


def test_slots_acquire_lowest_first_and_reuse() -> None:
    slots = SlotTable(3)
    assert [slots.acquire() for _ in range(3)] == [0, 1, 2]
    assert slots.num_free == 0
    slots.release(1)
    assert slots.in_use() == frozenset({0, 2})
    assert slots.acquire() == 1


def test_slots_exhausted_raises_runtime_error() -> None:
    slots = SlotTable(1)
    slots.acquire()
    with pytest.raises(RuntimeError, match="slots"):
        slots.acquire()


def test_slots_double_release_raises() -> None:
    slots = SlotTable(2)
    slot = slots.acquire()
    slots.release(slot)
    with pytest.raises(ValueError, match="double release"):
        slots.release(slot)
    with pytest.raises(ValueError, match="out of range"):
        slots.release(2)
    assert (slots.num_free, slots.num_total) == (2, 2)


def test_slots_in_use_is_a_snapshot() -> None:
    slots = SlotTable(2)
    snapshot = slots.in_use()
    slots.acquire()
    assert snapshot == frozenset()
    assert slots.in_use() == frozenset({0})
