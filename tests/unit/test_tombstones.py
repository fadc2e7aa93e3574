"""The tombstone store: bounded in count and in time, whatever is thrown at it."""

from __future__ import annotations

import pytest

from engine.scheduler.tombstones import TombstoneBounds, Tombstones


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_of_aborts_for_unknown_ids_stays_at_the_bound() -> None:
    """100,000 aborts for ids that never arrive leave exactly ``max_entries`` tombstones, the newest ones.

    Fails if the count bound in `Tombstones.add` is removed: the store then holds all 100,000."""
    clock = Clock()
    store = Tombstones(TombstoneBounds(max_entries=16384, ttl_s=30.0), clock)
    for i in range(100_000):
        store.add(f"random-{i}", "flood")
        clock.now += 1e-5  # a whole second for the flood: nothing expires by time
    assert len(store) == 16384
    assert store.get("random-0") is None and store.get(f"random-{100_000 - 16384}") == "flood"
    assert store.get("random-99999") == "flood"


def test_tombstones_expire_after_their_ttl_and_a_new_abort_restarts_it() -> None:
    clock = Clock()
    store = Tombstones(TombstoneBounds(max_entries=10, ttl_s=5.0), clock)
    store.add("a", "first")
    clock.now = 3.0
    store.add("b", "second")
    clock.now = 4.0
    store.add("a", "again")  # the TTL of "a" restarts: it now expires after "b"
    clock.now = 7.0
    assert store.get("b") == "second" and store.get("a") == "again"
    clock.now = 8.0
    assert store.get("b") is None and len(store) == 1
    clock.now = 9.5
    assert store.pop("a") is None and len(store) == 0  # expired at 9.0


def test_pop_consumes_a_tombstone() -> None:
    store = Tombstones(TombstoneBounds(max_entries=4, ttl_s=60.0), Clock())
    store.add("r", "client went away")
    assert store.pop("r") == "client went away"
    assert store.pop("r") is None and store.get("r") is None


def test_expired_entries_go_even_when_nobody_asks_for_them() -> None:
    """Adding expires what is old, so a store that only ever receives adds does not hold stale entries."""
    clock = Clock()
    store = Tombstones(TombstoneBounds(max_entries=1000, ttl_s=1.0), clock)
    for i in range(500):
        store.add(f"old-{i}", "x")
    clock.now = 2.0
    store.add("new", "x")
    assert len(store) == 1


@pytest.mark.parametrize("bounds", [(0, 1.0), (1, 0.0), (-1, 5.0)])
def test_bounds_must_be_positive(bounds: tuple[int, float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        TombstoneBounds(*bounds)
