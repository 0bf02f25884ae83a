"""Allocation of KV pages: reference counts and an O(1) free list.

A page in use has a refcount > 0 (forks and shared prefixes hold one reference
each). A freed page goes to the tail of the free list; allocation takes from the
head, so the least recently freed page is reused first. Later, content-hashed
pages stay findable on the free list until reused (prefix caching).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.kv.chain_hash import StateHash


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        # Every free page, least recently freed first; `_blank` is the subset holding no findable
        # content, handed out before any cached page is given up.
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self._blank: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        # Content-addressed pages: a full page whose KV is known to be the state of its
        # hash chain. Stays findable while free, until allocate() hands it out fresh.
        self._hash_of: dict[int, StateHash] = {}
        self._page_of: dict[StateHash, int] = {}
        self._num_cached_free = 0
        # Called with (page, hash) just before a findable free page is handed out fresh,
        # its content still intact: the moment to move that content down a tier.
        self.on_evict: Callable[[int, StateHash], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Free pages that still hold findable content."""
        return self._num_cached_free

    @property
    def num_blank(self) -> int:
        """Free pages holding no findable content: allocate() hands these out first."""
        return len(self._blank)

    def next_cached(self, limit: int) -> list[tuple[int, StateHash]]:
        """The first `limit` cached free pages allocate() will give up, in that order, with their
        hashes (after the blank ones): what to write below before the pool needs them."""
        out: list[tuple[int, StateHash]] = []
        for page in self._free:
            if len(out) >= limit:
                break
            page_hash = self._hash_of.get(page)
            if page_hash is not None:
                out.append((page, page_hash))
        return out

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_registered(self) -> int:
        """Pages holding findable content, in use or free."""
        return len(self._hash_of)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages with refcount 1, or None when the pool cannot supply them. Blank pages
        go first; then cached ones, least recently freed first (their content is lost)."""
        if n > len(self._free):
            return None
        pages = []
        for _ in range(n):
            if self._blank:
                page, _ = self._blank.popitem(last=False)
                del self._free[page]
            else:
                page, _ = self._free.popitem(last=False)
            page_hash = self._hash_of.get(page)
            if page_hash is not None and self.on_evict is not None:
                self.on_evict(page, page_hash)
            self._forget(page)  # a fresh page: its old content is no longer findable
            self._refcount[page] = 1
            pages.append(page)
        return pages

    # --- content addressing -------------------------------------------------------
    def register(self, page: int, page_hash: StateHash) -> None:
        """Record that `page` (in use, full) holds the state named `page_hash`."""
        if self._refcount[page] <= 0:
            raise RuntimeError(f"register of free page {page}: this is a bug")
        if page_hash in self._page_of or page in self._hash_of:
            return  # first writer wins; an identical page elsewhere stays private
        self._hash_of[page] = page_hash
        self._page_of[page_hash] = page

    def page_for(self, page_hash: StateHash) -> int | None:
        return self._page_of.get(page_hash)

    def is_free(self, page: int) -> bool:
        return self._refcount[page] == 0

    def revive(self, page: int) -> None:
        """Take a reference to a cached page (in use or free): reuse, not a fresh allocation."""
        if page not in self._hash_of:
            raise RuntimeError(f"revive of page {page} with no content: this is a bug")
        if self._refcount[page] == 0:
            del self._free[page]
            self._num_cached_free -= 1
        self._refcount[page] += 1

    def _forget(self, page: int) -> None:
        page_hash = self._hash_of.pop(page, None)
        if page_hash is not None:
            del self._page_of[page_hash]
            self._num_cached_free -= 1

    def share(self, pages: list[int]) -> None:
        """Take another reference to pages already in use (a fork)."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise RuntimeError(f"share of free page {page}: this is a bug")
            self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page. A page table is freed tail first, so under pressure a
        chain loses its last pages before its first ones (a lookup stops at the first miss)."""
        for page in reversed(pages):
            count = self._refcount[page]
            if count <= 0:
                raise RuntimeError(f"double free of page {page}: this is a bug")
            self._refcount[page] = count - 1
            if count == 1:
                self._free[page] = None
                if page in self._hash_of:
                    self._num_cached_free += 1
                else:
                    self._blank[page] = None

    def check_integrity(self) -> None:
        in_use = sum(1 for c in self._refcount if c > 0)
        if in_use + len(self._free) != self.num_pages:
            raise AssertionError(f"pages: {in_use} used + {len(self._free)} free != {self.num_pages}")
        for page in self._free:
            if self._refcount[page] != 0:
                raise AssertionError(f"free page {page} has refcount {self._refcount[page]}")
        if any(c < 0 for c in self._refcount):
            raise AssertionError("negative refcount")
        if len(self._hash_of) != len(self._page_of):
            raise AssertionError("page hash index is not a bijection")
        cached_free = sum(1 for p in self._free if p in self._hash_of)
        if set(self._blank) != {p for p in self._free if p not in self._hash_of}:
            raise AssertionError("blank free list out of step with the free pages")
        if cached_free != self._num_cached_free:
            raise AssertionError(f"cached free pages {cached_free} != counter {self._num_cached_free}")


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
