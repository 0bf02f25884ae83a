"""PagePool and SlotPool: exact page ids, refcounts, integrity."""

from __future__ import annotations

import pytest

from engine.kv.page_pool import PagePool, SlotPool


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
    assert pool.page_for(h) == a  # type: ignore[arg-type]
    pool.revive(a)
    assert pool.refcount(a) == 1 and pool.num_free == 2 and pool.num_cached == 0
    pool.revive(a)  # a second claimant shares it
    assert pool.refcount(a) == 2
    pool.release([a, a])
    pool.check_integrity()
    # Fresh allocation takes the least recently freed pages; the cached page goes last and loses its name.
    assert pool.allocate(2) == [1, 2]
    assert pool.page_for(h) == a  # type: ignore[arg-type]
    assert pool.allocate(1) == [a]
    assert pool.page_for(h) is None  # type: ignore[arg-type]
    pool.check_integrity()


def test_evict_hook_sees_a_findable_page_just_before_it_is_handed_out_fresh() -> None:
    pool = PagePool(3)
    seen: list[tuple[int, bytes, int | None]] = []
    pool.on_evict = lambda page, h: seen.append((page, h, pool.page_for(h)))  # type: ignore[arg-type, assignment]
    a, b = pool.allocate(2)  # type: ignore[misc]
    pool.register(a, b"A" * 16)  # type: ignore[arg-type]
    pool.release([a, b])
    assert pool.allocate(1) == [2] and seen == []  # never-hashed pages first: nothing to evict
    assert pool.allocate(1) == [b] and seen == []  # b had no content: taken before the cached a
    assert pool.allocate(1) == [a]
    assert seen == [(a, b"A" * 16, a)]  # still findable while the hook runs
    assert pool.page_for(b"A" * 16) is None  # type: ignore[arg-type]
    pool.check_integrity()


def test_a_freed_chain_loses_its_tail_before_its_head() -> None:
    """Pages are freed tail first and cached pages go after blank ones, so pressure takes the
    last pages of a chain first and a lookup (which stops at the first miss) keeps its head."""
    pool = PagePool(4)
    chain = pool.allocate(3)
    assert chain == [0, 1, 2]
    for i, page in enumerate(chain):
        pool.register(page, bytes([i]) * 16)  # type: ignore[arg-type]
    pool.release(chain)
    assert pool.allocate(1) == [3]  # the blank page first
    assert pool.allocate(1) == [2]  # then the chain's tail
    assert pool.page_for(b"\x00" * 16) == 0 and pool.page_for(b"\x01" * 16) == 1  # type: ignore[arg-type]
    pool.check_integrity()
