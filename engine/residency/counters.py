"""What reuse and residency counted: hits and misses, captures, spills, evictions, promotions."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.facts import ReuseKind, ReuseReport, ReuseTier
from engine.request import EngineSequence


def _per_tier() -> dict[ReuseTier, int]:
    return {tier: 0 for tier in ReuseTier if tier is not ReuseTier.NONE}


@dataclass(slots=True)
class ReuseCounters:
    hits: int = 0
    misses: int = 0
    reused_tokens: dict[ReuseTier, int] = field(default_factory=_per_tier)
    prefix_reused_tokens: int = 0
    slot_skips: int = 0  # captures lost: no slot, no state the newcomer may displace, no tier below took it
    protected_skips: int = 0  # captures that found the lowest-ranked state protected (not displaced)
    captures_below: int = 0  # captures written straight to the tier below (no device slot to take)
    staging_skips: int = 0  # host captures skipped because both staging buffers were busy
    spills_ahead: int = 0  # states written to KV-RAM off the step, before the device gave them up
    spills_on_step: int = 0  # states written to KV-RAM on the step, as the device gave them up
    promotions: int = 0  # host states moved up to a free device slot when claimed
    inflight_holds: int = 0  # admissions held back while a running sequence computed what they would claim
    captures: int = 0
    evictions: int = 0

    def count_hit(self, seq: EngineSequence, kind: ReuseKind, tokens: int, tier: ReuseTier) -> None:
        self.hits += 1
        self.reused_tokens[tier] += tokens
        if kind is ReuseKind.PREFIX:
            self.prefix_reused_tokens += tokens
        seq.record_reuse(ReuseReport(tier, kind, tokens))
