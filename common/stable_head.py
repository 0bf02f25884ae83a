"""The stable head of a chat request: the leading run of system/developer messages,
plus the tools. It is what a conversation's later turns and a burst of subagents
share, so both services key on it: the gateway routes by it (gateway/routing.py),
and the engine publishes the retained prefix at the end of its rendering
(engine/prompt.py). One definition, here, so the two never drift apart."""

from __future__ import annotations

from collections.abc import Iterable

HEAD_ROLES = frozenset({"system", "developer"})


def stable_head_length(roles: Iterable[str]) -> int:
    """How many leading messages (given their roles, in order) belong to the stable head."""
    n = 0
    for role in roles:
        if role not in HEAD_ROLES:
            break
        n += 1
    return n
