"""Page-level prefix sharing for attention-only models (vLLM-style).

Every full computed page is registered under its chain hash; a new sequence maps
the longest run of registered pages that prefixes its prompt and prefills only
the rest. A page claim stops one token short of the prompt's end: the logits
after the last token come from computing it.

Kept ends (with `states`, the residency layer's retained states): at the end of a
prompt its next-token logits are kept with a private copy of its partial last page
(the full pages are shared), so a prompt equal to a retained one (an exact retry, a
regenerate, `n > 1`) maps the pages, copies the partial page and samples from the
kept logits: no forward at all. A kept end is a retained state of kind `pages`: it
counts against `reuse.retained_device`, ranks in the one eviction order, spills and
restores through the tiers with its logits, and the Monitor lists it.

With a tierstore, a finished sequence's pages are written to KV-RAM when the
device reuses them (engine/residency/page_chains.py), and a prompt whose pages the device no
longer holds is restored from the store when that beats the device match by the
restore floor.
"""

from __future__ import annotations

import torch

from engine.cache.reuse import Claim, DevicePages, HeldState
from engine.cache.tier_claims import LowerTierClaims, TieredReuse
from engine.facts import ReuseKind, ReuseTier
from engine.kv.chain_hash import StateHash, common_pages, extend_page_hashes, state_name
from engine.kv.page_pool import PagePool
from engine.request import CommitPolicy, EngineSequence
from engine.residency.counters import ReuseCounters
from engine.residency.page_chains import PageChain, PageChains
from engine.residency.retained_state import RetainedState
from engine.residency.retained_states import RetainedStates
from engine.tiers.link import TierLink


class PageReuse(TieredReuse):
    def __init__(self, pages: PagePool, page_size: int, tiers: TierLink | None = None,
                 restore_floor: int = 32, chains: PageChains | None = None,
                 counters: ReuseCounters | None = None, states: RetainedStates | None = None) -> None:
        super().__init__(counters)
        self.pages = pages
        self.page_size = page_size
        self.chains = chains  # the residency layer's: finished chains it writes below as they leave the device
        self.states = states  # the residency layer's: kept prompt ends (None: none are kept)
        self.lower = LowerTierClaims(tiers, pages, page_size, restore_floor) if tiers is not None else None

    def _claimable_pages(self, seq: EngineSequence) -> int:
        """Full pages a claim may cover: one token of the prompt is always computed."""
        return (len(seq.token_ids) - 1) // self.page_size

    def match(self, seq: EngineSequence) -> Claim | None:
        if not seq.request.claims_state:
            return None
        end = self._kept_end(seq)
        if end is not None:
            return Claim(end.num_tokens, ReuseKind.PAGES, HeldState(end))
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

    def _kept_end(self, seq: EngineSequence) -> RetainedState | None:
        """The kept end of a prompt equal to `seq`'s whole prompt, if one is held and claimable."""
        if self.states is None or not self.states:
            return None
        state = self.states.index.get(self._end_name(seq))
        if state is None or not state.ready or state.logits is None or state.num_tokens != len(seq.token_ids):
            return None
        return state

    def _end_name(self, seq: EngineSequence) -> StateHash:
        n = len(seq.token_ids)
        extend_page_hashes(seq.namespace, seq.page_hashes, seq.token_ids, n, self.page_size)
        return state_name(seq.namespace, seq.page_hashes, seq.token_ids, n, self.page_size)

    def device_revived_pages(self, claim: Claim) -> int:
        assert isinstance(claim.source, DevicePages)
        return sum(1 for p in claim.source.pages if self.pages.is_free(p))

    def in_flight(self, seq: EngineSequence, claim: Claim | None, running: list[EngineSequence]) -> bool:
        if not seq.request.claims_state:
            return False
        if self.states is not None and (claim is None or claim.num_tokens < len(seq.token_ids)) \
                and self._end_coming(seq, running):
            return True
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

    def _end_coming(self, seq: EngineSequence, running: list[EngineSequence]) -> bool:
        """Whether the kept end of `seq`'s whole prompt is about to exist: a running sequence with the
        same prompt has not computed its last token yet, or its capture is still being copied."""
        n = len(seq.token_ids)
        assert self.states is not None
        name = self._end_name(seq)
        if any(s.num_tokens == n and s.name == name for s in self.states.pending):
            return True
        # Same prompt: the same whole-prompt name (its full pages' hashes are made at arrival; only the
        # tail under a page is hashed here), not a compare of every token each step.
        return any(other.request.publishes and other.num_prompt == n and other.num_output == 0
                   and other.num_computed < n and other.namespace == seq.namespace and self._end_name(other) == name
                   for other in running)

    def apply_device(self, seq: EngineSequence, claim: Claim) -> None:
        if isinstance(claim.source, HeldState):
            assert self.states is not None
            state = claim.source.state
            self.states.copy_into(seq, state)
            if state.tier is ReuseTier.DEVICE:
                seq.mark_registered(state.num_tokens // self.page_size)  # shared pages, published already
            return
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
        if self.states is not None and next_logits is not None and seq.num_output == 0 \
                and seq.num_computed == seq.num_prompt:
            name = state_name(seq.namespace, seq.page_hashes, seq.token_ids, seq.num_prompt, self.page_size)
            self.states.keep(seq, name, seq.num_prompt, ReuseKind.PAGES, next_logits, None)

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
