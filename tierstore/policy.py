"""The one eviction order across the tiers (DESIGN.md "Tiers and movement").

Lowest rank leaves first:

1. class: ``agent`` states before ``interactive`` ones;
2. protection: unprotected before protected. A state is protected while it is
   leased (a retained prefix in use by a burst), inside its protect window
   (``protect_seconds`` after commit), or, for an interactive state, within
   ``reuse.retained_interactive_ttl`` of its last use;
3. recency: least recently used first (then by hash, so the order is total).

The same order picks what RAM spills to disk and what disk drops. Leased states
are ranked (as protected) but never moved: the store skips them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ignis.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the policy needs to know about one state."""

    hash: bytes
    request_class: int  # common_pb2.RequestClass
    last_used: float  # seconds (time.time()) of commit or the last Acquire/Get
    protect_until: float = 0.0  # commit time + protect_seconds; 0 = no window
    leased: bool = False


RankKey = tuple[int, int, float, bytes]


class EvictionPolicy:
    def __init__(self, interactive_ttl: float) -> None:
        if interactive_ttl < 0:
            raise ValueError(f"reuse.retained_interactive_ttl must be >= 0, got {interactive_ttl}")
        self.interactive_ttl = interactive_ttl

    def is_protected(self, c: Candidate, now: float) -> bool:
        if c.leased or now < c.protect_until:
            return True
        return _is_interactive(c.request_class) and now - c.last_used < self.interactive_ttl

    def rank(self, c: Candidate, now: float) -> RankKey:
        """Sort key: the smallest leaves first."""
        return (1 if _is_interactive(c.request_class) else 0, 1 if self.is_protected(c, now) else 0,
                c.last_used, c.hash)

    def order(self, candidates: Iterable[Candidate], now: float) -> list[Candidate]:
        """``candidates`` in eviction order: the first one leaves first."""
        return sorted(candidates, key=lambda c: self.rank(c, now))


def _is_interactive(request_class: int) -> bool:
    return request_class != common_pb2.REQUEST_CLASS_AGENT  # UNSPECIFIED counts as interactive
