"""Finished page chains of an attention-only model, spilled to the tierstore as they leave the device.

A finished sequence leaves its full pages on the free list, still findable by
hash (page_reuse.py). When the allocator is about to hand one of them out, the
chain it belongs to is written to KV-RAM as one state (every page hash indexed,
so any page-aligned prefix of it matches later) while all its pages still hold
their content. A chain that is a prefix of a longer tracked chain is not kept:
the longer one covers it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.kv.chain_hash import BlockHash
from engine.kv.page_pool import PagePool
from engine.facts import RequestClass, ReuseKind
from engine.tiers.link import Spillable, TierLink


@dataclass(frozen=True, slots=True)
class PageChain:
    namespace: BlockHash
    hashes: tuple[BlockHash, ...]  # h_1 .. h_k: the chain's name is h_k
    request_class: RequestClass


class PageChains:
    def __init__(self, pages: PagePool, link: TierLink, page_size: int, max_chains: int = 4096) -> None:
        self.pages = pages
        self.link = link
        self.page_size = page_size
        self.max_chains = max_chains
        self._chains: OrderedDict[BlockHash, PageChain] = OrderedDict()  # by last hash, oldest first
        self._holders: dict[BlockHash, set[BlockHash]] = {}  # page hash -> chains containing it
        self.spills = 0
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

    def _evicting(self, page: int, page_hash: BlockHash) -> None:
        """PagePool hook: `page` (content intact) is about to be handed out fresh."""
        for name in list(self._holders.get(page_hash, ())):
            chain = self._chains.get(name)
            if chain is None:
                continue
            self._forget(name)
            pages = [self.pages.page_for(h) for h in chain.hashes]
            if any(p is None for p in pages):
                continue  # a page went without passing through here: nothing whole to write
            spilled = self.link.spill(Spillable(
                name, chain.namespace, len(chain.hashes) * self.page_size, ReuseKind.PAGES, chain.request_class,
                tuple(chain.hashes), None, [p for p in pages if p is not None], None))
            self.spills += int(spilled)

    def _forget(self, name: BlockHash) -> None:
        chain = self._chains.pop(name)
        for h in chain.hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(name)
                if not holders:
                    del self._holders[h]

    def __len__(self) -> int:
        return len(self._chains)

    def check_integrity(self) -> None:
        want: dict[BlockHash, set[BlockHash]] = {}
        for name, chain in self._chains.items():
            if chain.hashes[-1] != name:
                raise AssertionError("page chain filed under another name")
            for h in chain.hashes:
                want.setdefault(h, set()).add(name)
        if want != self._holders:
            raise AssertionError("page chain index is stale")
