"""Which engine serves a request: a rendezvous (highest random weight) hash.

The key is the model, the tenant salt and the prompt's *stable head*: the
leading system/developer messages and the tools for chat (what a
conversation's later turns and a burst of subagents share), or the first
characters / token ids of a raw prompt. Every engine gets a score
hash(engine, key); engines are tried best score first. Adding or removing an
engine only moves the keys that scored highest on it, and every gateway
computes the same order with no shared state.
"""

from __future__ import annotations

import hashlib
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
