"""The one eviction order of retained state, shared by the engine (device and host
slots) and the tierstore (KV-RAM and KV-disk). docs/architecture.md, "The one
eviction order", is the prose of this module.

Lowest rank leaves first:

1. class: ``agent`` states before ``interactive`` ones;
2. protection: unprotected before protected. A state is protected while it is
   leased (in use right now), inside its protect window, or, once it has been
   claimed, within ``reuse.retained_interactive_ttl`` of its last use when it is
   interactive or a retained prefix (the shared head a burst of subagents is
   claiming). Protection by age is earned by a claim: a state nobody claimed
   keeps no newer one out of its tier (single-use states held every device slot
   for the whole TTL, and full small tiers refused most spills);
3. recency: least recently used first, then by tiebreak (the state's hash) so the
   order is total.

Protection changes decisions, not only the order: a protected state is never
displaced by a newcomer of the same or a lower class (the newcomer is skipped
and counted instead), a leased one by nobody. Live work needing room is not a
newcomer: it takes what it needs in rank order, and a tier below moves the state
down instead of dropping it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
RankKey = tuple[int, int, float, bytes]


@dataclass(frozen=True, slots=True)
class Resident:
    """What the order needs to know about one retained state."""

    interactive: bool
    last_used: float  # seconds on the caller's clock (monotonic in the engine, wall time in the store)
    prefix: bool = False  # a retained prefix: the shared head of a burst
    leased: bool = False  # in use right now: never displaced, never moved
    protect_until: float = 0.0  # an explicit window (the store's protect_seconds after commit); 0: none
    tiebreak: bytes = b""
    claimed: bool = False  # claimed at least once in its tier: only then does its age protect it


class EvictionOrder:
    def __init__(self, interactive_ttl: float) -> None:
        if not interactive_ttl >= 0:  # also refuses NaN, which would switch protection off
            raise ValueError(f"reuse.retained_interactive_ttl must be >= 0, got {interactive_ttl}")
        self.interactive_ttl = interactive_ttl

    def is_protected(self, s: Resident, now: float) -> bool:
        if s.leased or now < s.protect_until:
            return True
        return (s.interactive or s.prefix) and s.claimed and now - s.last_used < self.interactive_ttl

    def rank(self, s: Resident, now: float) -> RankKey:
        """Sort key: the smallest leaves first."""
        return (int(s.interactive), int(self.is_protected(s, now)), s.last_used, s.tiebreak)

    def order(self, items: Iterable[T], now: float, resident: Callable[[T], Resident]) -> list[T]:
        """`items` in eviction order (the first leaves first); `resident` describes each."""
        return sorted(items, key=lambda item: self.rank(resident(item), now))

    def may_displace(self, victim: Resident, newcomer_interactive: bool, now: float) -> bool:
        """Whether a newcomer (a capture, an incoming spill) of the given class may take `victim`'s room.

        Class first: an agent newcomer never displaces an interactive state. Protection:
        a protected state is displaced only by a newcomer of a higher class, a leased
        one never.
        """
        if victim.leased:
            return False
        victim_class, newcomer_class = int(victim.interactive), int(newcomer_interactive)
        if victim_class > newcomer_class:
            return False
        return victim_class < newcomer_class or not self.is_protected(victim, now)
