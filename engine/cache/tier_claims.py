"""The lower-tier half of prompt reuse, shared by both strategies: ask the tierstore,
restore into fresh pages, and record how it went.

A lower-tier state is used only when it beats the device match by more than
`restore_floor` tokens (ties go up). Asking costs a gRPC round trip, so a blocked
queue head (matched every step) asks at most once per `_MEMO_SECONDS`. A restore
that fails (gone, corrupt, store down) leaves the sequence cold and counts a miss.
"""

from __future__ import annotations

import time
from abc import abstractmethod

from engine.cache.reuse import Claim, HeldState, LowerTier, PromptReuse
from engine.facts import ReuseTier
from engine.kv.page_pool import PagePool
from engine.request import EngineSequence
from engine.residency.retained_states import RetainedStates
from engine.tiers.link import TierHit, TierLink

_MEMO_SECONDS = 1.0


class LowerTierClaims:
    def __init__(self, link: TierLink, pages: PagePool, page_size: int, restore_floor: int) -> None:
        self.link = link
        self.pages = pages
        self.page_size = page_size
        self.restore_floor = restore_floor
        self._memo: dict[int, tuple[float, int, TierHit | None]] = {}  # seq_id -> (at, tokens, hit)
        self._restored: tuple[int, ReuseTier] | None = None  # (seq_id, tier) of the last apply

    def forget(self) -> None:
        """A state was just written below: answers remembered from before may be stale."""
        self._memo.clear()

    def worth_asking(self, seq: EngineSequence, have: int) -> bool:
        """Could anything below the device beat a device match of `have` tokens?"""
        return len(seq.token_ids) - have > self.restore_floor

    def claim(self, seq: EngineSequence, have: int) -> Claim | None:
        """A claim on a lower-tier state that beats `have` device tokens by the floor, else None."""
        if not self.worth_asking(seq, have):
            return None
        hit = self._find(seq)
        if hit is None or hit.tokens <= have + self.restore_floor:
            return None
        return Claim(hit.tokens, hit.kind, LowerTier(hit))

    def fresh_full_pages(self, claim: Claim) -> int:
        """Every page of a restored state is a fresh page: its full pages count against the free
        list like revived ones (a partial last page is counted with the rest of the prompt)."""
        return claim.num_tokens // self.page_size

    def _find(self, seq: EngineSequence) -> TierHit | None:
        now = time.monotonic()
        memo = self._memo.get(seq.seq_id)
        if memo is not None and now - memo[0] < _MEMO_SECONDS and memo[1] == len(seq.token_ids):
            return memo[2]
        hit = self.link.find(seq.namespace, seq.page_hashes, seq.token_ids)
        if len(self._memo) > 1024:
            self._memo = {k: v for k, v in self._memo.items() if now - v[0] < _MEMO_SECONDS}
        self._memo[seq.seq_id] = (now, len(seq.token_ids), hit)
        return hit

    def apply(self, seq: EngineSequence, hit: TierHit) -> bool:
        """Restore `hit` into fresh pages (and the sequence's slot); False leaves `seq` cold."""
        self._memo.pop(seq.seq_id, None)
        self._restored = None
        got = self.pages.allocate(-(-hit.tokens // self.page_size))
        if got is None:
            raise RuntimeError("lower-tier claim admitted without its pages: this is a bug")
        result = self.link.restore(seq.namespace, hit, seq.slot, got)
        if result is None:
            self.pages.release(got)
            return False
        tier, logits = result
        seq.adopt(got, hit.tokens, logits)  # restored pages are published again after the next step
        self._restored = (seq.seq_id, tier)
        return True

    def record(self, seq: EngineSequence, claim: Claim, reuse: PromptReuse) -> None:
        restored, self._restored = self._restored, None
        if restored is None or restored[0] != seq.seq_id:
            reuse.counters.misses += 1  # the restore failed: served cold
            return
        reuse.counters.count_hit(seq, claim.kind, claim.num_tokens, restored[1])


class TieredReuse(PromptReuse):
    """A reuse strategy with an optional tierstore below the device (`lower`): it dispatches
    lower-tier claims there and device claims to `apply_device`."""

    lower: LowerTierClaims | None = None
    states: RetainedStates | None = None  # the residency layer's retained states, claimed as HeldState

    def apply(self, seq: EngineSequence, claim: Claim) -> None:
        if isinstance(claim.source, LowerTier):
            assert self.lower is not None
            self.lower.apply(seq, claim.source.hit)
        else:
            self.apply_device(seq, claim)

    @abstractmethod
    def apply_device(self, seq: EngineSequence, claim: Claim) -> None:
        """Copy a device claim's state into `seq`."""

    def revived_free_pages(self, claim: Claim) -> int:
        if isinstance(claim.source, LowerTier):
            assert self.lower is not None
            return self.lower.fresh_full_pages(claim)
        if isinstance(claim.source, HeldState):
            assert self.states is not None
            return self.states.revived_pages(claim.source.state)
        return self.device_revived_pages(claim)

    def device_revived_pages(self, claim: Claim) -> int:
        """Free-list pages a claim of device pages (not a held state) takes back."""
        return 0

    def reclaim(self, pages_needed: int, keep: Claim | None = None) -> bool:
        if self.states is None:
            return False
        kept = keep.source.state if keep is not None and isinstance(keep.source, HeldState) else None
        return self.states.reclaim(pages_needed, kept)

    def record(self, seq: EngineSequence, claim: Claim | None) -> None:
        if claim is not None and isinstance(claim.source, LowerTier):
            assert self.lower is not None
            self.lower.record(seq, claim, self)
        else:
            super().record(seq, claim)

    @property
    def tiers(self) -> TierLink | None:
        return self.lower.link if self.lower is not None else None
