"""Finished page chains of an attention-only model, spilled to the tierstore as they leave the device.

A finished sequence leaves its full pages on the free list, still findable by
hash (page_reuse.py). When the allocator is about to hand one of them out, the
chain it belongs to is written to KV-RAM as one state (every page hash indexed,
so any page-aligned prefix of it matches later) while all its pages still hold
their content. A chain that is a prefix of a longer tracked chain is not kept:
the longer one covers it.

With a copy worker, that write happens ahead of need, off the step: once fewer than
`ahead_pages` blank pages are free, the chain whose pages the allocator will give up
first is written by the worker while its pages stay findable, so handing them out
later costs nothing. Should the allocator reach a page of the chain being written, it
waits for that write (`ignis_tier_spill_waits_total`); a chain whose write ahead fails
is not tried again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.kv.chain_hash import StateHash
from engine.kv.page_pool import PagePool
from engine.residency.retained_state import StateView
from engine.residency.counters import ReuseCounters
from engine.facts import RequestClass, ReuseKind, ReuseTier
from engine.residency.copy_worker import CopyJob, CopyWorker
from engine.tiers.link import Spillable, TierLink


@dataclass(frozen=True, slots=True)
class PageChain:
    namespace: StateHash
    hashes: tuple[StateHash, ...]  # h_1 .. h_k: the chain's name is h_k
    request_class: RequestClass


class PageChains:
    def __init__(self, pages: PagePool, link: TierLink, page_size: int, max_chains: int = 4096,
                 worker: CopyWorker | None = None, ahead_pages: int = 0, counters: ReuseCounters | None = None) -> None:
        self.pages = pages
        self.link = link
        self.page_size = page_size
        self.max_chains = max_chains
        self.worker = worker
        self.ahead_pages = ahead_pages
        self._chains: OrderedDict[StateHash, PageChain] = OrderedDict()  # by last hash, oldest first
        self._holders: dict[StateHash, set[StateHash]] = {}  # page hash -> chains containing it
        self._writing: dict[StateHash, StateHash] = {}  # page hash -> the chain being written ahead holding it
        self.spills = 0
        self.counters = counters or ReuseCounters()  # spills_ahead / spills_on_step: off or on the step
        pages.on_evict = self._evicting

    def add(self, chain: PageChain) -> None:
        """Track a finished sequence's registered pages until one of them is reused."""
        if not chain.hashes:
            return
        last = chain.hashes[-1]
        if last in self._chains or self._holders.get(last):
            return  # already tracked, or a prefix of a tracked chain
        for h in chain.hashes[:-1]:
            if h in self._chains:
                self._forget(h)  # a shorter chain this one extends
        self._chains[last] = chain
        for h in chain.hashes:
            self._holders.setdefault(h, set()).add(last)
        while len(self._chains) > self.max_chains:
            self._forget(next(iter(self._chains)))  # untracked chains just are not spilled

    def covered(self, page_hashes: tuple[StateHash, ...]) -> None:
        """A state holding these pages (every hash indexed) was written below: the tracked chains
        that end in one of them need no write of their own (a chain's last hash names its tokens)."""
        for h in page_hashes:
            if h in self._chains:
                self._forget(h)

    def _evicting(self, page: int, page_hash: StateHash) -> None:
        """PagePool hook: `page` (content intact) is about to be handed out fresh."""
        writing = self._writing.get(page_hash)
        if writing is not None and self.worker is not None:
            self.worker.wait_for(writing)  # the write ahead still reads this page
        for name in list(self._holders.get(page_hash, ())):
            spillable = self._take(name)
            if spillable is not None:
                self.counters.spills_on_step += 1
                self.spills += int(self.link.spill(spillable))

    def _take(self, name: StateHash) -> Spillable | None:
        """Stop tracking chain `name`; what writing it below needs, if all its pages are intact."""
        chain = self._chains.get(name)
        if chain is None:
            return None
        self._forget(name)
        pages = [self.pages.page_for(h) for h in chain.hashes]
        if any(p is None for p in pages):
            return None  # a page went without passing through here: nothing whole to write
        return Spillable(name, chain.namespace, len(chain.hashes) * self.page_size, ReuseKind.PAGES,
                         chain.request_class, tuple(chain.hashes), None, [p for p in pages if p is not None], None)

    def write_ahead(self) -> None:
        """Once blank pages run short, hand the chain the allocator reaches first to the worker
        (engine thread, each step). One chain at a time."""
        if self.worker is None or not self.ahead_pages or self._writing or self.pages.num_blank >= self.ahead_pages \
                or not self.link.client.available:
            return
        for _, page_hash in self.pages.next_cached(self.ahead_pages):
            for name in list(self._holders.get(page_hash, ())):
                spillable = self._take(name)
                if spillable is not None:
                    self._submit(spillable)
                    return

    def _submit(self, spillable: Spillable) -> None:
        assert self.worker is not None
        name, link = spillable.name, self.link
        for h in spillable.page_hashes:
            self._writing[h] = name

        def done(written: bool) -> None:  # engine thread
            for h in spillable.page_hashes:
                if self._writing.get(h) == name:
                    del self._writing[h]
            if written:
                self.spills += 1
                self.counters.spills_ahead += 1

        self.worker.submit(CopyJob(name, lambda: link.spill(spillable), done))

    def _forget(self, name: StateHash) -> None:
        chain = self._chains.pop(name)
        for h in chain.hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(name)
                if not holders:
                    del self._holders[h]

    def __len__(self) -> int:
        return len(self._chains)

    def views(self) -> list[StateView]:
        """The tracked chains, oldest first, as the Monitor lists them (engine thread)."""
        page_bytes = self.link.codec.page_bytes
        return [StateView(name, ReuseKind.PAGES, ReuseTier.DEVICE, c.request_class, len(c.hashes) * self.page_size,
                          len(c.hashes) * page_bytes, len(c.hashes), None, None)
                for name, c in self._chains.items()]

    def check_integrity(self) -> None:
        want: dict[StateHash, set[StateHash]] = {}
        for name, chain in self._chains.items():
            if chain.hashes[-1] != name:
                raise AssertionError("page chain filed under another name")
            for h in chain.hashes:
                want.setdefault(h, set()).add(name)
        if want != self._holders:
            raise AssertionError("page chain index is stale")
