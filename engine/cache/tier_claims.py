"""The lower-tier half of prompt reuse, shared by both strategies: ask the tierstore,
restore into fresh pages, and record how it went.

A lower-tier state is used only when it beats the device match by more than
`restore_floor` tokens (ties go up). Asking costs a gRPC round trip, so a blocked
queue head (matched every step) asks at most once per `_MEMO_SECONDS`. A restore
that fails (gone, corrupt, store down) leaves the sequence cold and counts a miss.
"""

from __future__ import annotations

import time

from engine.cache.page_pool import PagePool
from engine.cache.reuse import Claim, PromptReuse, ReuseCounters
from engine.outputs import ReuseReport
from engine.request import Sequence
from engine.tiers.link import TierHit, TierLink

_MEMO_SECONDS = 1.0


class LowerTierClaims:
    def __init__(self, link: TierLink, pages: PagePool, page_size: int, restore_floor: int) -> None:
        self.link = link
        self.pages = pages
        self.page_size = page_size
        self.restore_floor = restore_floor
        self._memo: dict[int, tuple[float, int, TierHit | None]] = {}  # seq_id -> (at, tokens, hit)
        self._restored: tuple[int, str] | None = None  # (seq_id, tier) of the last apply

    def worth_asking(self, seq: Sequence, have: int) -> bool:
        """Could anything below the device beat a device match of `have` tokens?"""
        return len(seq.token_ids) - have > self.restore_floor

    def claim(self, seq: Sequence, have: int) -> Claim | None:
        """A claim on a lower-tier state that beats `have` device tokens by the floor, else None."""
        if not self.worth_asking(seq, have):
            return None
        hit = self._lookup(seq)
        if hit is None or hit.tokens <= have + self.restore_floor:
            return None
        # Every page of a restored state is a fresh page: its full pages count against the free
        # list like revived ones (a partial last page is counted with the rest of the prompt).
        return Claim(hit.tokens, hit.kind, hit.tokens // self.page_size, hit)

    def _lookup(self, seq: Sequence) -> TierHit | None:
        now = time.monotonic()
        memo = self._memo.get(seq.seq_id)
        if memo is not None and now - memo[0] < _MEMO_SECONDS and memo[1] == len(seq.token_ids):
            return memo[2]
        hit = self.link.lookup(seq.seed, seq.page_hashes, seq.token_ids)
        if len(self._memo) > 1024:
            self._memo = {k: v for k, v in self._memo.items() if now - v[0] < _MEMO_SECONDS}
        self._memo[seq.seq_id] = (now, len(seq.token_ids), hit)
        return hit

    def apply(self, seq: Sequence, hit: TierHit) -> bool:
        """Restore `hit` into fresh pages (and the sequence's slot); False leaves `seq` cold."""
        self._memo.pop(seq.seq_id, None)
        self._restored = None
        got = self.pages.allocate(-(-hit.tokens // self.page_size))
        if got is None:
            raise RuntimeError("lower-tier claim admitted without its pages: this is a bug")
        result = self.link.restore(seq.seed, hit, seq.slot, got)
        if result is None:
            self.pages.release(got)
            return False
        tier, logits = result
        seq.page_table = got
        seq.num_computed = hit.tokens
        if hit.tokens == len(seq.token_ids):
            seq.pending_logits = logits
        self._restored = (seq.seq_id, tier)
        return True

    def record(self, seq: Sequence, claim: Claim, counters: ReuseCounters) -> None:
        restored, self._restored = self._restored, None
        if restored is None or restored[0] != seq.seq_id:
            counters.misses += 1  # the restore failed: served cold
            return
        tier = restored[1]
        counters.hits += 1
        counters.reused_tokens[tier] += claim.num_tokens
        if claim.kind == "prefix":
            counters.prefix_reused_tokens += claim.num_tokens
        seq.num_cached = claim.num_tokens
        seq.reuse = ReuseReport(tier, claim.kind, claim.num_tokens)


class TieredReuse(PromptReuse):
    """A reuse strategy with an optional tierstore below the device (`lower`)."""

    lower: LowerTierClaims | None = None

    def record(self, seq: Sequence, claim: Claim | None) -> None:
        if claim is not None and isinstance(claim.handle, TierHit):
            assert self.lower is not None
            self.lower.record(seq, claim, self.counters)
        else:
            super().record(seq, claim)

    @property
    def restore_floor(self) -> int:
        return self.lower.restore_floor if self.lower is not None else 0

    @restore_floor.setter
    def restore_floor(self, tokens: int) -> None:
        if self.lower is not None:
            self.lower.restore_floor = tokens
