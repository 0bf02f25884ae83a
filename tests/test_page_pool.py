"""PagePool and SlotPool: exact page ids, refcounts, integrity."""

from __future__ import annotations

import pytest

from engine.cache.page_pool import PagePool, SlotPool


def test_allocate_release_reuses_least_recently_freed_first() -> None:
    pool = PagePool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None  # capacity is a return value, not an exception
    pool.release([1])
    pool.release([0])
    assert pool.allocate(3) == [3, 1, 0]
    assert pool.num_free == 0
    pool.check_integrity()


def test_shared_pages_free_on_last_release() -> None:
    pool = PagePool(3)
    pages = pool.allocate(2)
    assert pages == [0, 1]
    pool.share([0])
    assert pool.refcount(0) == 2
    pool.release([0, 1])
    assert pool.num_used == 1 and pool.refcount(0) == 1
    pool.release([0])
    assert pool.num_used == 0
    pool.check_integrity()


def test_double_free_is_a_bug() -> None:
    pool = PagePool(2)
    pool.allocate(1)
    pool.release([0])
    with pytest.raises(RuntimeError, match="this is a bug"):
        pool.release([0])
    with pytest.raises(RuntimeError, match="this is a bug"):
        pool.share([1])


def test_slots() -> None:
    slots = SlotPool(2)
    assert [slots.allocate(), slots.allocate(), slots.allocate()] == [0, 1, None]
    slots.release(0)
    assert slots.allocate() == 0
    with pytest.raises(RuntimeError):
        slots.release(5)
    slots.check_integrity()


def test_cached_pages_are_revived_not_reallocated() -> None:
    pool = PagePool(3)
    h = b"h" * 16
    [a] = pool.allocate(1)  # type: ignore[misc]
    pool.register(a, h)  # type: ignore[arg-type]
    pool.release([a])
    assert pool.num_free == 3 and pool.num_cached == 1
    assert pool.lookup(h) == a  # type: ignore[arg-type]
    pool.revive(a)
    assert pool.refcount(a) == 1 and pool.num_free == 2 and pool.num_cached == 0
    pool.revive(a)  # a second claimant shares it
    assert pool.refcount(a) == 2
    pool.release([a, a])
    pool.check_integrity()
    # Fresh allocation takes the least recently freed pages; the cached page goes last and loses its name.
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(h) == a  # type: ignore[arg-type]
    assert pool.allocate(1) == [a]
    assert pool.lookup(h) is None  # type: ignore[arg-type]
    pool.check_integrity()


def test_evict_hook_sees_a_findable_page_just_before_it_is_handed_out_fresh() -> None:
    pool = PagePool(3)
    seen: list[tuple[int, bytes, int | None]] = []
    pool.on_evict = lambda page, h: seen.append((page, h, pool.lookup(h)))  # type: ignore[arg-type, assignment]
    a, b = pool.allocate(2)  # type: ignore[misc]
    pool.register(a, b"A" * 16)  # type: ignore[arg-type]
    pool.release([a, b])
    assert pool.allocate(1) == [2] and seen == []  # a never-hashed page first: nothing to evict
    assert pool.allocate(1) == [a]
    assert seen == [(a, b"A" * 16, a)]  # still findable while the hook runs
    assert pool.lookup(b"A" * 16) is None  # type: ignore[arg-type]
    assert pool.allocate(1) == [b] and len(seen) == 1  # b had no content
    pool.check_integrity()
