"""The order in which retained state loses device residency.

Class first (agent state goes before interactive), then protection (a retained
prefix in use by a burst, or an interactive state inside its TTL, goes last),
then recency (least recently used first). The smallest key is evicted first.
"""

from __future__ import annotations

from engine.request import RequestClass


def eviction_key(request_class: RequestClass, last_used: float, now: float, ttl: float) -> tuple[int, int, float]:
    class_rank = 0 if request_class is RequestClass.AGENT else 1
    protected = 1 if now - last_used < ttl else 0
    return (class_rank, protected, last_used)
