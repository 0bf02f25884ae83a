"""Page-level prefix sharing for attention-only models (vLLM-style).

Every full computed page is registered under its chain hash; a new sequence maps
the longest run of registered pages that prefixes its prompt and prefills only
the rest. At least one token is always computed, so the claim stops one token
short of the prompt's end.

With a tierstore, a finished sequence's pages are written to KV-RAM when the
device reuses them (page_chains.py), and a prompt whose pages the device no
longer holds is restored from the store when that beats the device match by the
restore floor.
"""

from __future__ import annotations

import torch

from engine.cache.chain_hash import common_pages, extend_page_hashes
from engine.cache.page_chains import PageChain, PageChains
from engine.cache.page_pool import PagePool
from engine.cache.reuse import Claim
from engine.cache.tier_claims import LowerTierClaims, TieredReuse
from engine.request import CommitPolicy, Sequence
from engine.tiers.link import TierHit, TierLink


class PageReuse(TieredReuse):
    def __init__(self, pages: PagePool, page_size: int, tiers: TierLink | None = None,
                 restore_floor: int = 32) -> None:
        super().__init__()
        self.pages = pages
        self.page_size = page_size
        self.tiers = tiers
        self.lower = LowerTierClaims(tiers, pages, page_size, restore_floor) if tiers is not None else None
        self.chains = PageChains(pages, tiers, page_size) if tiers is not None else None

    def match(self, seq: Sequence) -> Claim | None:
        if not seq.request.claims_state:
            return None
        limit = (len(seq.token_ids) - 1) // self.page_size
        matched: list[int] = []
        for page_hash in seq.page_hashes[:limit]:
            page = self.pages.lookup(page_hash)
            if page is None:
                break
            matched.append(page)
        lower = self.lower.claim(seq, len(matched) * self.page_size) if self.lower is not None else None
        if lower is not None:
            return lower
        if not matched:
            return None
        from_free = sum(1 for p in matched if self.pages.is_free(p))
        return Claim(len(matched) * self.page_size, "pages", from_free, tuple(matched))

    def in_flight(self, seq: Sequence, claim: Claim | None, running: list[Sequence]) -> Sequence | None:
        if not seq.request.claims_state:
            return None
        claimed = (claim.num_tokens if claim else 0) // self.page_size
        limit = (len(seq.token_ids) - 1) // self.page_size
        for other in running:
            if not other.request.publishes or other.num_computed // self.page_size >= limit:
                continue
            common = common_pages(seq.page_hashes, other.page_hashes, limit)
            # Its pages are registered as it computes them: wait while some shared page is still to come.
            if common > claimed and other.num_computed < common * self.page_size:
                return other
        return None

    def apply(self, seq: Sequence, claim: Claim) -> None:
        if isinstance(claim.handle, TierHit):
            assert self.lower is not None
            if self.lower.apply(seq, claim.handle):
                seq.num_registered = 0  # restored pages are published again after the next step
            return
        pages = list(claim.handle)  # type: ignore[call-overload]
        for page in pages:
            self.pages.revive(page)
        seq.page_table = pages
        seq.num_computed = claim.num_tokens
        seq.num_registered = len(pages)  # revived pages are already published

    def after_compute(self, seq: Sequence, next_logits: torch.Tensor | None) -> None:
        if not seq.request.publishes:
            return  # bypass and commit=none publish nothing
        limit = seq.num_computed
        if seq.request.commit is CommitPolicy.PREFILL_STATE_ONLY:
            limit = min(limit, seq.num_prompt)
        full = limit // self.page_size
        extend_page_hashes(seq.seed, seq.page_hashes, seq.token_ids, limit, self.page_size)  # type: ignore[arg-type]
        for i in range(seq.num_registered, min(full, len(seq.page_table))):
            self.pages.register(seq.page_table[i], seq.page_hashes[i])
        seq.num_registered = max(seq.num_registered, min(full, len(seq.page_table)))

    def on_finish(self, seq: Sequence) -> None:
        if self.chains is not None and seq.request.publishes and seq.num_registered:
            self.chains.add(PageChain(seq.seed, tuple(seq.page_hashes[:seq.num_registered]),
                                      seq.request.request_class))

    def check_integrity(self) -> None:
        if self.chains is not None:
            self.chains.check_integrity()
