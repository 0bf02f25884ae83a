"""Which engine serves a request: a rendezvous (highest random weight) hash, bounded by load.

The key is the model, the tenant salt and the prompt's *stable head*: the
leading system/developer messages and the tools for chat (what a
conversation's later turns and a burst of subagents share), or the first
characters / token ids of a raw prompt. Every engine gets a score
hash(engine, key); engines are tried best score first. Adding or removing an
engine only moves the keys that scored highest on it, and every gateway
computes the same order with no shared state.

Three rules (`--routing`):

- ``affinity``: that order over the head key, as it is.
- ``bounded`` (the default): the order over the *conversation key* (for chat
  the head plus the first message after it, which every later turn of one
  conversation repeats; a raw prompt or ``prompt_cache_key`` keeps its key),
  then consistent hashing with bounded loads: an engine already carrying
  ``ceil(load_bound * mean)`` requests (the mean counting this one) moves
  behind the others. The order is a pure function of key and engine set; only
  the load term, this gateway's own in-flight count per engine, differs
  between gateways, and only where an engine is over the bound.
- ``round-robin``: healthy engines in turn, no affinity (a baseline).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence, TypeVar

from common.stable_head import stable_head_length
from ignis.v1 import engine_pb2

T = TypeVar("T")
# About the first pages of a raw prompt: enough to tell prompts apart, short
# enough that a conversation's growing tail never changes its key.
HEAD_CHARS = 512
HEAD_TOKENS = 128


def _score(node: str, key: bytes) -> int:
    digest = hashlib.blake2b(key, digest_size=8, key=node.encode()[:64]).digest()
    return int.from_bytes(digest, "little")


def rendezvous_order(nodes: Sequence[T], names: Sequence[str], key: bytes) -> list[T]:
    """`nodes` sorted by descending score for `key` (`names[i]` identifies `nodes[i]`)."""
    scored = sorted(zip((_score(n, key) for n in names), range(len(nodes))), reverse=True)
    return [nodes[i] for _, i in scored]


def route_key(model: str, salt: str, head: str) -> bytes:
    return b"\x00".join((model.encode(), salt.encode(), head.encode()))


RULES = ("bounded", "affinity", "round-robin")


@dataclass(slots=True)
class RoutingRule:
    """One of RULES and its load bound (bounded only: an engine takes at most ceil(bound * mean))."""

    rule: str = "bounded"
    load_bound: float = 1.25
    _turn: itertools.count[int] = field(default_factory=itertools.count, repr=False, compare=False)  # round-robin

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"routing must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not self.load_bound >= 1.0:  # `not >=`: NaN fails too
            raise ValueError(f"the load bound must be >= 1.0 (1.0: perfectly even), got {self.load_bound}")

    def order(self, nodes: Sequence[T], names: Sequence[str], loads: Sequence[int], keys: RouteKeys) -> list[T]:
        """`nodes` in the order to try them for a request with `keys`; `loads[i]` is `nodes[i]`'s in-flight count."""
        if self.rule == "round-robin":
            start = next(self._turn) % len(nodes) if nodes else 0
            return [*nodes[start:], *nodes[:start]]
        if self.rule == "affinity":
            return rendezvous_order(nodes, names, keys.head)
        ranked = rendezvous_order(list(range(len(nodes))), names, keys.conversation)
        return [nodes[i] for i in bounded_order(ranked, [loads[i] for i in ranked], self.load_bound)]


def bounded_order(order: Sequence[T], loads: Sequence[int], bound: float) -> list[T]:
    """`order` with every node at its capacity moved behind the others (each part keeps its order).

    Capacity is ceil(bound * (sum(loads) + 1) / n): the mean load once this request is placed,
    times the bound. With bound >= 1 the least loaded node is always under it (consistent hashing
    with bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018), so no node ends above capacity.
    """
    if not order:
        return []
    capacity = math.ceil(bound * (sum(loads) + 1) / len(order))
    return [n for n, load in zip(order, loads) if load < capacity] + \
        [n for n, load in zip(order, loads) if load >= capacity]


@dataclass(frozen=True, slots=True)
class RouteKeys:
    head: bytes  # what the route computed: the stable head's key, or prompt_cache_key's
    conversation: bytes  # the bounded rule's: one conversation's key (equal to head where there is none finer)


def route_keys(request: engine_pb2.GenerateRequest, key: bytes) -> RouteKeys:
    """The keys of `request`, whose route computed `key`. A chat routed on its stable head gets a
    conversation key too: the head plus the first message after it (a `prompt_cache_key` is kept as given)."""
    if request.WhichOneof("input") != "chat":
        return RouteKeys(key, key)
    chat = request.chat
    if key != route_key(request.model, request.cache_salt, chat_head(chat)):
        return RouteKeys(key, key)  # the client's prompt_cache_key: its own affinity, as asked
    return RouteKeys(key, route_key(request.model, request.cache_salt, conversation_head(chat)))


def conversation_head(chat: engine_pb2.ChatInput) -> str:
    """The stable head plus the first message after it: what one conversation's every turn starts with."""
    n = stable_head_length(m.role for m in chat.messages)
    first = [_text(m) for m in chat.messages[n:n + 1]] if n else []
    return "\x1d".join([chat_head(chat), *first])


def chat_head(chat: engine_pb2.ChatInput) -> str:
    """The stable head (common/stable_head.py: leading system/developer messages plus the tools).
    Without head messages the first message stands in, so conversations still spread."""
    n = stable_head_length(m.role for m in chat.messages) or min(1, len(chat.messages))
    parts = [_text(msg) for msg in chat.messages[:n]]
    parts.append(chat.tools_json)
    return "\x1e".join(parts)


def _text(msg: engine_pb2.ChatMessage) -> str:
    return msg.content if msg.HasField("content") else "".join(p.text for p in msg.content_parts)


def text_head(text: str) -> str:
    return text[:HEAD_CHARS]


def token_head(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids[:HEAD_TOKENS]))
