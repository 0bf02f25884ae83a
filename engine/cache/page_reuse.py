"""Page-level prefix sharing for attention-only models (vLLM-style).

Every full computed page is registered under its chain hash; a new sequence maps
the longest run of registered pages that prefixes its prompt and prefills only
the rest. At least one token is always computed, so the claim stops one token
short of the prompt's end.

With a tierstore, a finished sequence's pages are written to KV-RAM when the
device reuses them (engine/residency/page_chains.py), and a prompt whose pages the device no
longer holds is restored from the store when that beats the device match by the
restore floor.
"""

from __future__ import annotations

import torch

from engine.cache.reuse import Claim, DevicePages
from engine.cache.tier_claims import LowerTierClaims, TieredReuse
from engine.facts import ReuseKind
from engine.kv.chain_hash import common_pages, extend_page_hashes
from engine.kv.page_pool import PagePool
from engine.request import CommitPolicy, EngineSequence
from engine.residency.counters import ReuseCounters
from engine.residency.page_chains import PageChain, PageChains
from engine.tiers.link import TierLink


class PageReuse(TieredReuse):
    def __init__(self, pages: PagePool, page_size: int, tiers: TierLink | None = None,
                 restore_floor: int = 32, chains: PageChains | None = None,
                 counters: ReuseCounters | None = None) -> None:
        super().__init__(counters)
        self.pages = pages
        self.page_size = page_size
        self.chains = chains  # the residency layer's: finished chains it writes below as they leave the device
        self.lower = LowerTierClaims(tiers, pages, page_size, restore_floor) if tiers is not None else None

    def _claimable_pages(self, seq: EngineSequence) -> int:
        """Full pages a claim may cover: one token of the prompt is always computed."""
        return (len(seq.token_ids) - 1) // self.page_size

    def match(self, seq: EngineSequence) -> Claim | None:
        if not seq.request.claims_state:
            return None
        matched: list[int] = []
        for page_hash in seq.page_hashes[:self._claimable_pages(seq)]:
            page = self.pages.page_for(page_hash)
            if page is None:
                break
            matched.append(page)
        lower = self.lower.claim(seq, len(matched) * self.page_size) if self.lower is not None else None
        if lower is not None:
            return lower
        if not matched:
            return None
        return Claim(len(matched) * self.page_size, ReuseKind.PAGES, DevicePages(tuple(matched)))

    def device_revived_pages(self, claim: Claim) -> int:
        assert isinstance(claim.source, DevicePages)
        return sum(1 for p in claim.source.pages if self.pages.is_free(p))

    def in_flight(self, seq: EngineSequence, claim: Claim | None, running: list[EngineSequence]) -> bool:
        if not seq.request.claims_state:
            return False
        claimed = (claim.num_tokens if claim else 0) // self.page_size
        limit = self._claimable_pages(seq)
        for other in running:
            if not other.request.publishes or other.num_computed // self.page_size >= limit:
                continue
            common = common_pages(seq.page_hashes, other.page_hashes, limit)
            # Its pages are registered as it computes them: wait while some shared page is still to come.
            if common > claimed and other.num_computed < common * self.page_size:
                return True
        return False

    def apply_device(self, seq: EngineSequence, claim: Claim) -> None:
        assert isinstance(claim.source, DevicePages)
        pages = list(claim.source.pages)
        for page in pages:
            self.pages.revive(page)
        seq.adopt(pages, claim.num_tokens, registered=len(pages))  # revived pages are already published

    def after_compute(self, seq: EngineSequence, next_logits: torch.Tensor | None) -> None:
        if not seq.request.publishes:
            return  # bypass and commit=none publish nothing
        limit = seq.num_computed
        if seq.request.commit is CommitPolicy.PREFILL_STATE_ONLY:
            limit = min(limit, seq.num_prompt)
        full = min(limit // self.page_size, len(seq.page_table))
        extend_page_hashes(seq.namespace, seq.page_hashes, seq.token_ids, limit, self.page_size)
        for i in range(seq.num_registered, full):
            self.pages.register(seq.page_table[i], seq.page_hashes[i])
        seq.mark_registered(full)

    def after_decodes(self, seqs: list[EngineSequence]) -> None:
        """Only a sequence whose computed tokens now fill a page it has not published can have one to
        publish: one step in page_size of each."""
        page_size = self.page_size
        for seq in seqs:
            if seq.num_computed // page_size > seq.num_registered:
                self.after_compute(seq, None)

    def on_finish(self, seq: EngineSequence) -> None:
        if self.chains is not None and seq.request.publishes and seq.num_registered:
            self.chains.add(PageChain(seq.namespace, tuple(seq.page_hashes[:seq.num_registered]),
                                      seq.request.request_class))
