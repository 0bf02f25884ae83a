"""Retained states for models with recurrent layers: prompt checkpoints and retained prefixes.

A retained state is the whole sequence state at one position: the recurrent
state and conv taps (a copy in a slot reserved at load), and the KV pages up to
that position (full pages shared by reference, a partial last page copied).
It is immutable: a claim copies it into the claimant's own slot and pages.

With a tierstore (`tiers`), a state the device evicts is spilled to KV-RAM
instead of lost, and a lookup also asks the store; a lower-tier state is used
only if it beats the device match by more than `restore_floor` tokens (ties go up).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from common.logs import log_event
from engine.cache.chain_hash import BlockHash, extend_page_hashes, state_name
from engine.cache.device_cache import DeviceCache
from engine.cache.eviction import eviction_key
from engine.cache.page_pool import PagePool
from engine.cache.reuse import Claim
from engine.cache.tier_claims import LowerTierClaims, TieredReuse
from engine.request import CommitPolicy, RequestClass, Sequence
from engine.tiers.link import Spillable, TierHit, TierLink
from ignis.v1 import common_pb2

log = logging.getLogger("ignis.request")
_CLASS_PB = {RequestClass.INTERACTIVE: common_pb2.REQUEST_CLASS_INTERACTIVE,
             RequestClass.AGENT: common_pb2.REQUEST_CLASS_AGENT}


@dataclass(eq=False)
class RetainedState:
    name: BlockHash
    anchor: BlockHash  # hash of the last full page at or before the end (the index key)
    num_tokens: int
    kind: str  # checkpoint | prefix
    slot: int
    pages: list[int]
    request_class: RequestClass
    lineage: int | None
    logits: torch.Tensor | None  # next-token logits at the end (opener checkpoints): a retry prefills nothing
    last_used: float = field(default_factory=time.monotonic)
    seed: bytes = b""  # namespace (for the tierstore)
    page_hashes: tuple[bytes, ...] = ()  # hashes of its full pages (for the tierstore)


class RetainedStateReuse(TieredReuse):
    def __init__(self, cache: DeviceCache, pages: PagePool, first_slot: int, num_slots: int,
                 interactive_ttl: float, max_per_lineage: int = 2, tiers: TierLink | None = None,
                 restore_floor: int = 32) -> None:
        super().__init__()
        self.cache = cache
        self.pages = pages
        self.page_size = cache.page_size
        self.ttl = interactive_ttl
        self.max_per_lineage = max_per_lineage
        self._free_slots = deque(range(first_slot, first_slot + num_slots))
        self.num_slots = num_slots
        self._by_name: dict[BlockHash, RetainedState] = {}
        self._by_anchor: dict[BlockHash, list[RetainedState]] = {}
        self._lineages: dict[int, deque[RetainedState]] = {}
        self._lineage_ids = itertools.count(1)
        self.tiers = tiers
        self.lower = LowerTierClaims(tiers, pages, self.page_size, restore_floor) if tiers is not None else None

    # --- lookup -------------------------------------------------------------
    def match(self, seq: Sequence) -> Claim | None:
        if not seq.request.claims_state:
            return None
        device = self._match_device(seq)
        lower = self.lower.claim(seq, device.num_tokens if device else 0) if self.lower is not None else None
        return lower or device

    def _match_device(self, seq: Sequence) -> Claim | None:
        if not self._by_name:
            return None
        tokens = seq.token_ids
        n = len(tokens)
        # Longest first: walk page boundaries from the end; states anchored at boundary i end in [iP, (i+1)P).
        for i in range(min(len(seq.page_hashes), n // self.page_size), -1, -1):
            anchor = seq.page_hashes[i - 1] if i else seq.seed
            best: RetainedState | None = None
            for state in self._by_anchor.get(anchor, ()):  # type: ignore[call-overload]
                m = state.num_tokens
                usable = m < n or (m == n and state.logits is not None)
                if usable and (best is None or m > best.num_tokens) and \
                        state.name == state_name(seq.seed, seq.page_hashes, tokens, m, self.page_size):  # type: ignore[arg-type]
                    best = state
            if best is not None:
                return Claim(best.num_tokens, best.kind, 0, best)
        return None

    def apply(self, seq: Sequence, claim: Claim) -> None:
        if isinstance(claim.handle, TierHit):
            assert self.lower is not None and seq.slot is not None
            self.lower.apply(seq, claim.handle)
            return
        state = claim.handle
        assert isinstance(state, RetainedState) and seq.slot is not None
        full = state.num_tokens // self.page_size
        shared = state.pages[:full]
        self.pages.share(shared)
        table = list(shared)
        if state.num_tokens % self.page_size:
            got = self.pages.allocate(1)
            if got is None:
                raise RuntimeError("claim admitted without its private page: this is a bug")
            self.cache.kv[got[0]].copy_(self.cache.kv[state.pages[full]])
            table.append(got[0])
        self.cache.copy_slot(state.slot, seq.slot)
        seq.page_table = table
        seq.num_computed = state.num_tokens
        if state.num_tokens == len(seq.token_ids):
            seq.pending_logits = state.logits
        if state.kind == "checkpoint":
            seq.lineage = state.lineage
        state.last_used = time.monotonic()

    def in_flight(self, seq: Sequence, claim: Claim | None, running: list[Sequence]) -> Sequence | None:
        if not seq.request.claims_state:
            return None
        claimed = claim.num_tokens if claim else 0
        n = len(seq.token_ids)
        for other in running:
            if not other.request.publishes:
                continue
            for point in self._pending_captures(other):
                # A prefix is usable inside a longer prompt; a whole-prompt checkpoint also as
                # the whole prompt (it keeps its next-token logits).
                usable = point < n or (point == n == other.num_prompt)
                if usable and point - claimed >= self.page_size and self._shares(seq, other, point):
                    return other
        return None

    @staticmethod
    def _pending_captures(seq: Sequence) -> list[int]:
        """Positions at which `seq` will still capture a retained state (see after_compute)."""
        points = []
        publish = seq.request.publish_point
        if seq.num_computed < publish < seq.num_prompt:
            points.append(publish)
        if seq.num_computed < seq.num_prompt and seq.num_output == 0:
            points.append(seq.num_prompt)
        return points

    def _shares(self, seq: Sequence, other: Sequence, point: int) -> bool:
        """Whether the first `point` tokens of both are the same (same namespace, same tokens)."""
        full = point // self.page_size
        if seq.seed != other.seed or (full and seq.page_hashes[full - 1] != other.page_hashes[full - 1]):
            return False
        return seq.token_ids[full * self.page_size:point] == other.token_ids[full * self.page_size:point]

    # --- capture ------------------------------------------------------------
    def cut_point(self, seq: Sequence) -> int | None:
        if not seq.request.publishes:
            return None
        return min((p for p in self._pending_captures(seq) if p < len(seq.token_ids)), default=None)

    def after_compute(self, seq: Sequence, next_logits: torch.Tensor | None) -> None:
        if not seq.request.publishes:
            return
        m = seq.num_computed
        if m == seq.request.publish_point and 0 < m < seq.num_prompt:
            self._capture(seq, m, "prefix", None)
        elif m == seq.num_prompt and seq.num_output == 0:
            self._capture(seq, m, "checkpoint", next_logits)

    def on_finish(self, seq: Sequence) -> None:
        if seq.request.publishes and seq.request.commit is CommitPolicy.INCLUDING_GENERATED_TOKENS \
                and seq.num_computed > seq.num_prompt:
            self._capture(seq, seq.num_computed, "checkpoint", None)

    def _capture(self, seq: Sequence, m: int, kind: str, logits: torch.Tensor | None) -> None:
        extend_page_hashes(seq.seed, seq.page_hashes, seq.token_ids, m, self.page_size)  # type: ignore[arg-type]
        name = state_name(seq.seed, seq.page_hashes, seq.token_ids, m, self.page_size)  # type: ignore[arg-type]
        existing = self._by_name.get(name)
        if existing is not None:  # a retry or a burst mate: the state is already retained
            existing.last_used = time.monotonic()
            if existing.logits is None and logits is not None:
                existing.logits = logits.clone()
            return
        if seq.slot is None:
            return
        now = time.monotonic()
        if not self._free_slots and not self._evict_for(seq.request.request_class, now):
            self.counters.slot_skips += 1  # never allocated on the fly
            return
        full = m // self.page_size
        private: list[int] = []
        if m % self.page_size:
            got = self.pages.allocate(1)
            if got is None:
                self.counters.slot_skips += 1
                return
            private = got
            self.cache.kv[got[0]].copy_(self.cache.kv[seq.page_table[full]])
        shared = seq.page_table[:full]
        self.pages.share(shared)
        slot = self._free_slots.popleft()
        self.cache.copy_slot(seq.slot, slot)
        lineage = None
        if kind == "checkpoint":
            if seq.lineage is None:
                seq.lineage = next(self._lineage_ids)
            lineage = seq.lineage
        page_hash_index = full  # anchor: hash after `full` pages
        if len(seq.page_hashes) < full:
            raise RuntimeError("page hashes shorter than the computed state: this is a bug")
        anchor = seq.page_hashes[page_hash_index - 1] if page_hash_index else seq.seed
        state = RetainedState(
            name=name, anchor=anchor, num_tokens=m, kind=kind, slot=slot, pages=shared + private,  # type: ignore[arg-type]
            request_class=seq.request.request_class, lineage=lineage,
            logits=None if logits is None else logits.clone(), last_used=now,
            seed=seq.seed, page_hashes=tuple(seq.page_hashes[:full]),
        )
        self._by_name[name] = state
        self._by_anchor.setdefault(anchor, []).append(state)  # type: ignore[arg-type]
        self.counters.captures += 1
        if lineage is not None:
            chain = self._lineages.setdefault(lineage, deque())
            chain.append(state)
            while len(chain) > self.max_per_lineage:  # a conversation keeps its newest two
                self._drop(chain.popleft())

    # --- eviction -------------------------------------------------------------
    def _key(self, state: RetainedState, now: float) -> tuple[int, int, float]:
        return eviction_key(state.request_class, state.last_used, now, self.ttl)

    def _evict_for(self, request_class: RequestClass, now: float) -> bool:
        """Make a slot free for a new capture by evicting a state ranked below it."""
        newcomer = eviction_key(request_class, now, now, self.ttl)
        victim = min(self._by_name.values(), key=lambda s: self._key(s, now), default=None)
        if victim is None or self._key(victim, now) >= newcomer:
            return False
        self._evict(victim)
        return True

    def reclaim(self, pages_needed: int) -> bool:
        now = time.monotonic()
        while self.pages.num_free < pages_needed and self._by_name:
            victim = min(self._by_name.values(), key=lambda s: self._key(s, now))
            self._evict(victim)
        return self.pages.num_free >= pages_needed

    def _evict(self, state: RetainedState) -> None:
        """The device needs the room: move the state down a tier if there is one, then free it."""
        spilled = self.tiers is not None and self.tiers.spill(Spillable(
            state.name, state.seed, state.num_tokens, state.kind, _CLASS_PB[state.request_class],
            state.page_hashes, state.slot, state.pages, state.logits))
        if not spilled:
            log_event(log, "ignis.request.evicted", hash=state.name.hex(), tokens=state.num_tokens, kind=state.kind,
                      tier="device")
        self._drop(state)
        self.counters.evictions += 1

    def _drop(self, state: RetainedState) -> None:
        if self._by_name.pop(state.name, None) is None:
            return
        group = self._by_anchor[state.anchor]
        group.remove(state)
        if not group:
            del self._by_anchor[state.anchor]
        if state.lineage is not None:
            chain = self._lineages.get(state.lineage)
            if chain is not None and state in chain:
                chain.remove(state)
                if not chain:
                    del self._lineages[state.lineage]
        self.pages.release(state.pages)
        self._free_slots.append(state.slot)

    # --- introspection ------------------------------------------------------------
    @property
    def states(self) -> list[RetainedState]:
        return list(self._by_name.values())

    def held_pages(self) -> set[int]:
        return {p for s in self._by_name.values() for p in s.pages}

    @property
    def retained_slots(self) -> tuple[int, int]:
        return (self.num_slots, self.num_slots - len(self._free_slots))

    def check_integrity(self) -> None:
        used = {s.slot for s in self._by_name.values()}
        if len(used) != len(self._by_name) or used & set(self._free_slots):
            raise AssertionError("retained slots are double-booked")
        if len(used) + len(self._free_slots) != self.num_slots:
            raise AssertionError("retained slots leaked")
        indexed = sum(len(v) for v in self._by_anchor.values())
        if indexed != len(self._by_name):
            raise AssertionError("anchor index out of step with the name index")
        for state in self._by_name.values():
            for page in state.pages:
                if self.pages.refcount(page) <= 0:
                    raise AssertionError(f"retained state holds free page {page}")
