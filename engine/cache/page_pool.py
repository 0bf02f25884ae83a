"""Allocation of KV pages: reference counts and an O(1) free list.

A page in use has a refcount > 0 (forks and shared prefixes hold one reference
each). A freed page goes to the tail of the free list; allocation takes from the
head, so the least recently freed page is reused first. Later, content-hashed
pages stay findable on the free list until reused (prefix caching).
"""

from __future__ import annotations

from collections import OrderedDict


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages with refcount 1, or None when the pool cannot supply them."""
        if n > len(self._free):
            return None
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: list[int]) -> None:
        """Take another reference to pages already in use (a fork)."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise RuntimeError(f"share of free page {page}: this is a bug")
            self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            count = self._refcount[page]
            if count <= 0:
                raise RuntimeError(f"double free of page {page}: this is a bug")
            self._refcount[page] = count - 1
            if count == 1:
                self._free[page] = None

    def check_integrity(self) -> None:
        in_use = sum(1 for c in self._refcount if c > 0)
        if in_use + len(self._free) != self.num_pages:
            raise AssertionError(f"pages: {in_use} used + {len(self._free)} free != {self.num_pages}")
        for page in self._free:
            if self._refcount[page] != 0:
                raise AssertionError(f"free page {page} has refcount {self._refcount[page]}")
        if any(c < 0 for c in self._refcount):
            raise AssertionError("negative refcount")


class SlotPool:
    """Recurrent-state slots (hybrid models): one per live sequence."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot, _ = self._free.popitem(last=False)
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"double free of slot {slot}: this is a bug")
        self._free[slot] = None

    def check_integrity(self) -> None:
        if len(self._free) > self.num_slots or any(not 0 <= s < self.num_slots for s in self._free):
            raise AssertionError("slot free list is corrupt")
