"""The tierstore's side of the one eviction order (``common/eviction.py``, the rule the engine uses too).

``resident`` describes a stored state to that order; ``last_tier_room`` is the one
decision the last tier makes with it. The store (store.py) applies the rest:

- RAM is the staging tier: an incoming state (Reserve, Put, a restore) spills
  unpinned RAM states to disk in eviction order until it fits; moving down is not
  displacing, so protection does not stop it. Leased (pinned) states never move.
- A state that cannot move down (no disk tier, or the disk refuses it) is dropped
  only when ``may_displace`` allows it for the Reserve/Put's class; otherwise the
  reservation is refused and counted (``protected_refusals``). A restore is live
  work, not a newcomer: it drops what cannot move down, in rank order.
- Disk (the last tier) drops a state for one coming down only when it ranks below
  the one coming down *and* the Reserve/Put that forced the move may displace it
  (``last_tier_room``): protection holds all the way down, not only in RAM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from common.eviction import EvictionOrder, Resident
from common.request_class import RequestClass, from_pb
from ignis.v1 import common_pb2
from tierstore.state import StateInfo

T = TypeVar("T")


def resident(info: StateInfo, *, last_used: float, protect_until: float, leased: bool, claimed: bool = False
             ) -> Resident:
    """A stored state as the one order sees it."""
    return Resident(
        interactive=from_pb(info.request_class) is RequestClass.INTERACTIVE,
        last_used=last_used,
        prefix=info.kind == common_pb2.REUSE_KIND_PREFIX,  # the shared head of a burst: TTL-protected too
        leased=leased,
        protect_until=protect_until,
        tiebreak=info.hash,
        claimed=claimed,  # restored into an engine at least once
    )


def last_tier_room(order: EvictionOrder, incoming: Resident, held: Iterable[tuple[T, Resident, int]], *,
                   newcomer_interactive: bool | None, free: int, need: int, now: float) -> list[T] | None:
    """What the last tier drops, in eviction order, so ``need`` bytes fit beside ``free``; None if they cannot.

    ``incoming`` is the state coming down; ``held`` is (key, resident, bytes) for
    each state the tier may drop for it. Only states ranked below ``incoming`` are
    taken, so the tier keeps the highest-ranked ones. ``newcomer_interactive`` is
    the class of the Reserve/Put whose arrival forced the move: its loss is that
    newcomer's doing, so only states it may displace are taken (None: live work,
    a restore, which takes in rank order alone). None, and nothing to drop, when
    even all of those would not make room: the incoming state does not fit.
    """
    if free >= need:
        return []
    bar = order.rank(incoming, now)

    def takeable(r: Resident) -> bool:
        return order.rank(r, now) < bar and (newcomer_interactive is None
                                             or order.may_displace(r, newcomer_interactive, now))

    victims = sorted(((order.rank(r, now), key, size) for key, r, size in held if takeable(r)), key=lambda t: t[0])
    chosen: list[T] = []
    for _, key, size in victims:
        chosen.append(key)
        free += size
        if free >= need:
            return chosen
    return None
