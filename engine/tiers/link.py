"""Retained states moving between the device and the tierstore: spill, look up, restore.

Used by RetainedStateReuse on the engine thread. Every failure ends in "nothing
happened": a spill that fails loses the state (as without a store), a restore that
fails leaves the sequence cold.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import torch
import xxhash
from opentelemetry import trace

from common.logs import log_event
from engine.cache.chain_hash import BlockHash, state_name
from engine.tiers.client import TierClient
from engine.tiers.codec import StateCodec
from ignis.v1 import common_pb2, tierstore_pb2

log = logging.getLogger("ignis.request")

_KINDS = {"checkpoint": common_pb2.REUSE_KIND_CHECKPOINT, "prefix": common_pb2.REUSE_KIND_PREFIX,
          "pages": common_pb2.REUSE_KIND_PAGES}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_TIERS = {common_pb2.REUSE_TIER_RAM: "ram", common_pb2.REUSE_TIER_DISK: "disk"}


@dataclass(frozen=True, slots=True)
class TierHit:
    """A usable state in a lower tier (the handle of a Claim)."""

    state_hash: bytes
    tokens: int
    kind: str
    tier: str  # where Match saw it; Acquire's from_tier is what gets reported


@dataclass(frozen=True, slots=True)
class Spillable:
    """What a spill needs of a retained state (kept free of engine.cache imports)."""

    name: BlockHash
    seed: bytes
    tokens: int
    kind: str
    request_class: int  # common_pb2.RequestClass
    page_hashes: tuple[bytes, ...]
    slot: int | None  # None: an attention-only model (no recurrent state)
    pages: list[int]
    logits: torch.Tensor | None


class TierLink:
    def __init__(self, client: TierClient, codec: StateCodec) -> None:
        self.client = client
        self.codec = codec
        self.page_size = codec.page_size
        self.spills = 0
        self.spill_failures = 0
        self.restores = 0
        self.restore_failures = 0

    # --- down ----------------------------------------------------------------------------
    def spill(self, s: Spillable) -> bool:
        """Write a state leaving the device into KV-RAM; True if the store now holds it."""
        if not self.client.available:
            return False
        # One trace per spill (it belongs to no request): Register, Reserve and Commit are its children.
        with trace.get_tracer("ignis.engine").start_as_current_span(
                "engine.spill", attributes={"ignis.hash": s.name.hex(), "ignis.tokens": s.tokens,
                                            "ignis.kind": s.kind}) as span:
            spilled = self._spill(s)
            span.set_attribute("ignis.spilled", spilled)
            return spilled

    def _spill(self, s: Spillable) -> bool:
        if not self.client.ensure(s.seed):
            return False
        started = time.perf_counter()
        nbytes = self.codec.nbytes(s.tokens, s.logits is not None)
        extent = self.client.reserve(s.name, nbytes, s.request_class)
        if extent is None:
            if self.client.last_code is grpc.StatusCode.ALREADY_EXISTS:
                return True  # states are immutable: the store already holds this one
            self.spill_failures += 1  # no room, or the store is down
            return False
        arena = self.client.arena
        assert arena is not None
        self.codec.pack(arena, extent.offset, s.tokens, s.slot, s.pages, s.logits)
        # Our own checksum: Commit rejects it if the bytes landed in a stale mapping (store restarted).
        digest = xxhash.xxh3_128_digest(self.client.arena_bytes(extent.offset, nbytes))
        meta = tierstore_pb2.StateMetadata(
            namespace=s.seed, tokens=s.tokens, kind=_KINDS[s.kind], request_class=s.request_class,  # type: ignore[arg-type]
            page_hashes=s.page_hashes, checksum=digest, nbytes=nbytes)
        if not self.client.commit(s.name, meta):
            self.client.drop(s.name)  # abandon the reservation
            self.spill_failures += 1
            return False
        self.spills += 1
        log_event(log, "ignis.request.spilled", hash=s.name.hex(), tokens=s.tokens, kind=s.kind, tier="ram",
                  bytes=nbytes, ms=round((time.perf_counter() - started) * 1000, 3))
        return True

    # --- lookup --------------------------------------------------------------------------
    def lookup(self, seed: bytes, page_hashes: list[BlockHash], tokens: list[int]) -> TierHit | None:
        """The longest usable state below the device for this prompt.

        Match resolves page-aligned names and the whole prompt's name (the tail); states
        that end mid-page earlier in the prompt (a previous turn's checkpoint at its
        opener) come back as anchored candidates, and we keep those whose name is the
        hash of our own tokens up to their end.
        """
        if not self.client.available:
            return None
        n = len(tokens)
        full = min(len(page_hashes), n // self.page_size)
        pages = list(page_hashes[:full])
        tail = None
        if n % self.page_size and len(page_hashes) >= n // self.page_size:
            tail = state_name(seed, page_hashes, tokens, n, self.page_size)  # type: ignore[arg-type]
        hits, candidates = self.client.match(seed, pages, tail)
        best: tierstore_pb2.MatchHit | None = None
        for hit in hits:
            if self._usable(hit, n) and (best is None or hit.tokens > best.tokens):
                best = hit
        if best is None and hits and (tail is not None or pages):
            # The longest hit is the whole prompt without its logits: ask again one step shorter.
            shorter = pages if tail is not None else pages[:-1]
            retry, _ = self.client.match(seed, shorter, None)
            best = max((h for h in retry if self._usable(h, n)), key=lambda h: h.tokens, default=None)
        for c in candidates:  # longest first
            if best is not None and c.tokens <= best.tokens:
                break
            m = c.tokens
            if self._usable(c, n) and m // self.page_size <= len(page_hashes) and \
                    bytes(c.hash) == state_name(seed, page_hashes, tokens, m, self.page_size):  # type: ignore[arg-type]
                best = c
                break
        if best is None:
            return None
        return TierHit(bytes(best.state_hash or best.hash), best.tokens, _KIND_NAMES.get(best.kind, "checkpoint"),
                       _TIERS.get(best.tier, "ram"))

    def _usable(self, hit: tierstore_pb2.MatchHit, n: int) -> bool:
        """A state ending before the prompt's end, or at it with its next-token logits stored."""
        return hit.tokens < n or (hit.tokens == n and self.codec.has_logits(hit.tokens, hit.nbytes))

    # --- up ------------------------------------------------------------------------------
    def restore(self, seed: bytes, hit: TierHit, slot: int | None, pages: list[int]
                ) -> tuple[str, torch.Tensor | None] | None:
        """Copy a stored state into `slot` and `pages`; (from tier, logits) or None if it failed.

        A hit of kind `pages` may be a page-aligned prefix of a longer attention-only
        state: its first len(pages) pages are copied (the whole blob is still checksummed).
        """
        if not self.client.ensure(seed):
            self.restore_failures += 1
            return None
        started = time.perf_counter()
        lease = self.client.acquire(hit.state_hash)
        if lease is None:
            self.restore_failures += 1
            return None
        try:
            meta, ext = lease.metadata, lease.extent
            arena = self.client.arena
            sliced = hit.kind == "pages" and hit.tokens <= meta.tokens and hit.tokens % self.page_size == 0
            if (meta.tokens != hit.tokens and not sliced) or ext.length < meta.nbytes or arena is None or \
                    xxhash.xxh3_128_digest(self.client.arena_bytes(ext.offset, meta.nbytes)) != meta.checksum:
                self.restore_failures += 1
                log_event(log, "ignis.request.restore_rejected", logging.WARNING, hash=hit.state_hash.hex(),
                          tokens=hit.tokens, kind=hit.kind, reason="metadata or checksum mismatch")
                return None
            logits = self.codec.unpack(arena, ext.offset, meta.tokens, meta.nbytes, slot, pages)
        finally:
            self.client.release(lease.lease_id)
        tier = _TIERS.get(lease.from_tier, "ram")
        self.restores += 1
        log_event(log, "ignis.request.restored", hash=hit.state_hash.hex(), tokens=hit.tokens, kind=hit.kind,
                  tier=tier, bytes=meta.nbytes, ms=round((time.perf_counter() - started) * 1000, 3))
        return tier, logits
