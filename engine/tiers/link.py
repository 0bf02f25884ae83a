"""Retained states moving between the device and the tierstore: spill, look up, restore.

Used on the engine thread, and by the copy worker (engine/residency/copy_worker.py) for
spills written ahead of need. Every failure ends in "nothing happened": a spill that
fails loses the state (as without a store), a restore that fails leaves the sequence
cold.

A lookup asks the Match to lease the RAM states it names, so a claim from KV-RAM is one
round trip: the restore uses the lease of the hit it was given (`_take_held`) instead of an
Acquire, when that lease is recent and of the arena mapped now, and every other lease goes
back in one background Release. Only the last lookup's lease is kept (the scheduler restores
right after the lookup, or within the second its answer is remembered); one whose restore
never comes goes back at the next lookup, or expires in the store (MATCH_LEASE_SECONDS).

A claim from KV-RAM needs no Match at all when the store's published table proves the answer
(engine/tiers/published_table.py; `_from_table` has the rules): the whole prompt's state with its
logits, or a page-aligned prefix with nothing longer anywhere (no disk state, no anchored
candidate), or nothing at all. The restore then copies from the table's entry without a lease,
checks the integrity tag as always, and after the copy checks that the entry's slot is
unchanged: a state evicted meanwhile (its extent maybe another state's now) runs cold, counted
in `table_races`, never served. The store learns of the use in a background Release
(TierClient.report_used). Everything else (disk, anchored candidates, a table incomplete or
not current) asks Match as before.

Two threads share the link, so its calls to the store and its use of the arena mapping
are serialised by one lock; the bulk of a spill (the copy into its reservation, the
checksum and the integrity tag) runs outside it, on the arena tensor the reservation was
made in: holding that tensor keeps its mapping alive, and a store restart meanwhile
voids the reservation at Commit (`still_mapped`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import torch
import xxhash
from opentelemetry import trace

from common.logs import log_event
from engine.facts import RequestClass, ReuseKind, ReuseTier
from engine.kv.chain_hash import StateHash, state_matches, state_name
from engine.proto_convert import request_class_pb, reuse_kind, reuse_kind_pb, reuse_tier, reuse_tier_pb
from engine.tiers.client import TierClient
from engine.tiers.checked_copy import copy_and_check
from engine.tiers.codec import UNPACK_STEP_BYTES, StateCodec
from engine.tiers.integrity import IntegrityKey
from engine.tiers.published_table import PublishedTable, SlotBusy, TableEntry
from ignis.v1 import tierstore_pb2

log = logging.getLogger("ignis.request")

MATCH_LEASE_SECONDS = 3.0  # how long the store keeps a Match's leases if nobody releases them
# A restore copies under a Match's lease only this soon after the Match (a lookup's answer is
# remembered for a second: engine/cache/tier_claims.py), leaving the rest of the lease to copy.
LEASE_USE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class _Held:
    """A Match's lease kept for the restore of its state, as Acquire would have answered."""

    lease: tierstore_pb2.AcquireResponse
    taken: float  # time.monotonic() before the Match was sent: the store's lease ends after taken + its seconds


@dataclass(frozen=True, slots=True)
class TierHit:
    """A usable state in a lower tier (the source of a lower-tier Claim)."""

    state_hash: bytes
    tokens: int
    kind: ReuseKind
    tier: ReuseTier  # where Match saw it; Acquire's from_tier is what gets reported


@dataclass(frozen=True, slots=True)
class Spillable:
    """What a spill needs of a retained state (kept free of engine.cache imports)."""

    name: StateHash
    namespace: StateHash
    tokens: int
    kind: ReuseKind
    request_class: RequestClass
    page_hashes: tuple[StateHash, ...]
    slot: int | None  # None: an attention-only model (no recurrent state)
    pages: list[int]
    logits: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Reservation:
    """An arena extent reserved for a state being written."""

    name: StateHash
    namespace: StateHash
    offset: int
    nbytes: int
    instance: str  # the store instance whose arena holds the extent


class TierLink:
    def __init__(self, client: TierClient, codec: StateCodec, key: IntegrityKey | None = None) -> None:
        self.client = client
        self.codec = codec
        self.key = key or IntegrityKey.ephemeral()
        self.page_size = codec.page_size
        self.spills = 0
        self.spill_failures = 0
        self.restores = 0
        self.restore_failures = 0
        self.rejected = 0  # restores refused: the bytes or metadata are not what this engine wrote
        self.match_leases_used = 0  # restores that copied under a Match's lease (no Acquire round trip)
        self.restores_streamed = 0  # restores from disk copied while the store read them (AcquireStream)
        self.table_answers = 0  # lookups the published table answered (a hit, or nothing anywhere): no Match
        self.table_claims = 0  # restores copied from a published entry: no Match, no lease
        self.table_races = 0  # such restores whose entry changed during the copy (the state left KV-RAM): cold
        self._held: tuple[bytes, _Held] | None = None  # the last lookup's lease: (state hash, lease)
        self._published: tuple[PublishedTable, TableEntry] | None = None  # the last lookup's entry, from the table
        self._lock = threading.RLock()  # the store calls and the mapping: the engine thread and the copy worker
        # A claim from KV-RAM copies and checks on this many threads, the engine thread one of them: the
        # engine's CPU threads (torch's), which wait on the claim anyway.
        self.claim_threads = max(1, torch.get_num_threads())
        self._helper_pool: ThreadPoolExecutor | None = None  # the claims' other threads (first use)

    # --- down ----------------------------------------------------------------------------
    def spill(self, s: Spillable) -> bool:
        """Write a state leaving the device into KV-RAM; True if the store now holds it."""
        nbytes = self.codec.nbytes(s.tokens, s.logits is not None)
        return self.write_state(s.name, s.namespace, s.tokens, s.kind, s.request_class, s.page_hashes, nbytes,
                                lambda arena, offset: self.codec.pack(arena, offset, s.tokens, s.slot, s.pages,
                                                                      s.logits))

    def spill_bytes(self, name: StateHash, namespace: StateHash, tokens: int, kind: ReuseKind,
                    request_class: RequestClass, page_hashes: tuple[StateHash, ...], data: torch.Tensor) -> bool:
        """Write a state already in the arena's byte layout (`data`, uint8: a host slot) into KV-RAM:
        one copy."""
        return self.write_state(name, namespace, tokens, kind, request_class, page_hashes, len(data),
                                lambda arena, offset: arena[offset:offset + len(data)].copy_(data), source="host")

    def write_state(self, name: StateHash, namespace: StateHash, tokens: int, kind: ReuseKind,
                    request_class: RequestClass, page_hashes: tuple[StateHash, ...], nbytes: int,
                    write: Callable[[torch.Tensor, int], object], source: str = "device") -> bool:
        """Reserve `nbytes`, let `write(arena, offset)` fill them in the codec's layout, Commit; True if
        the store now holds the state. Runs on the engine thread or the copy worker."""
        if not self.client.available:
            return False
        # One trace per spill (it belongs to no request): Register, Reserve and Commit are its children.
        with trace.get_tracer("ignis.engine").start_as_current_span(
                "engine.spill", attributes={"ignis.hash": name.hex(), "ignis.tokens": tokens,
                                            "ignis.kind": kind.value}) as span:
            started = time.perf_counter()
            with self._lock:
                reservation = self.reserve(name, namespace, nbytes, request_class)
                if reservation is None:
                    # ALREADY_EXISTS: states are immutable, the store already holds this one.
                    return self.client.last_code is grpc.StatusCode.ALREADY_EXISTS
                arena = self.arena_for(reservation)
            if arena is None:
                return self._abandon(reservation)
            write(arena, reservation.offset)
            spilled = self.commit(reservation, tokens, kind, request_class, page_hashes, arena)
            span.set_attribute("ignis.spilled", spilled)
            if spilled:
                log_event(log, "ignis.request.spilled", hash=name.hex(), tokens=tokens, kind=kind.value, tier="ram",
                          bytes=nbytes, ms=round((time.perf_counter() - started) * 1000, 3), source=source)
            return spilled

    def reserve(self, name: StateHash, namespace: StateHash, nbytes: int, request_class: RequestClass,
                protect_seconds: float = 0.0) -> Reservation | None:
        """An arena extent to write a state into, in the arena mapped now; None (counted as a
        failed spill unless the state exists already) when the store is down or has no room."""
        with self._lock:
            if not self.client.ensure(namespace):
                return None
            reply = self.client.reserve(name, nbytes, request_class_pb(request_class), protect_seconds)
            if reply is None:
                if self.client.last_code is not grpc.StatusCode.ALREADY_EXISTS:
                    self.spill_failures += 1  # no room, or the store is down
                return None
            if not self.client.same_instance(reply.instance_id) and not self.client.ensure(namespace):
                self.client.drop(name)  # the store restarted under us and cannot be mapped
                self.spill_failures += 1
                return None
            return Reservation(name, namespace, reply.extent.offset, nbytes, reply.instance_id)

    def still_mapped(self, reservation: Reservation) -> bool:
        """Whether the reservation's arena is the one mapped now (a store restart voids it)."""
        return self.client.arena is not None and self.client.instance_id == reservation.instance

    def arena_for(self, reservation: Reservation) -> torch.Tensor | None:
        """The arena the reservation lives in while it is the one mapped, else None. Holding the
        tensor keeps its mapping alive, so bytes can be copied into it outside the lock."""
        with self._lock:
            return self.client.arena if self.still_mapped(reservation) else None

    def commit(self, reservation: Reservation, tokens: int, kind: ReuseKind, request_class: RequestClass,
               page_hashes: tuple[StateHash, ...] = (), arena: torch.Tensor | None = None) -> bool:
        """Publish a written reservation (written into `arena`, the one mapped now if not given);
        on failure the reservation is abandoned."""
        r = reservation
        arena = arena if arena is not None else self.arena_for(r)
        if arena is None:
            return self._abandon(r)
        data = arena[r.offset:r.offset + r.nbytes].numpy().data  # a view: hashed outside the lock
        # Our own checksum: Commit rejects it if the bytes landed in a stale mapping (store restarted).
        # The tag is what a restore trusts: the store cannot make one (engine/tiers/integrity.py).
        meta = tierstore_pb2.StateMetadata(
            namespace=r.namespace, tokens=tokens, kind=reuse_kind_pb(kind), request_class=request_class_pb(request_class),
            page_hashes=page_hashes, checksum=xxhash.xxh3_128_digest(data), nbytes=r.nbytes,
            engine_tag=self.key.tag(r.name, r.namespace, tokens, data))
        with self._lock:
            if not self.still_mapped(r) or not self.client.commit(r.name, meta):
                return self._abandon(r)
            self.spills += 1
        return True

    def _abandon(self, reservation: Reservation) -> bool:
        with self._lock:
            self.client.drop(reservation.name)
            self.spill_failures += 1
        return False

    def drop(self, name: StateHash) -> None:
        """Remove a state from every tier (a live sequence's, once it is restored or cancelled)."""
        with self._lock:
            if self.client.available:
                self.client.drop(name)

    # --- lookup --------------------------------------------------------------------------
    def find(self, namespace: StateHash, page_hashes: list[StateHash], tokens: list[int]) -> TierHit | None:
        """The longest usable state below the device for this prompt.

        Match resolves page-aligned names and the whole prompt's name (the tail); states
        that end mid-page earlier in the prompt (a previous turn's checkpoint at its
        opener) come back as anchored candidates, and we keep those whose name is the
        hash of our own tokens up to their end.
        """
        with self._lock:
            return self._find(namespace, page_hashes, tokens)

    def _find(self, namespace: StateHash, page_hashes: list[StateHash], tokens: list[int]) -> TierHit | None:
        if not self.client.available:
            return None
        n = len(tokens)
        full = min(len(page_hashes), n // self.page_size)
        pages = list(page_hashes[:full])
        tail = None
        if n % self.page_size and len(page_hashes) >= n // self.page_size:
            tail = state_name(namespace, page_hashes, tokens, n, self.page_size)
        self._published = None
        table = self.client.table
        answer = self._table_answer(table, namespace, pages, tail, n) if table is not None else None
        if table is not None and answer is not None:
            self._keep_lease(None, [], 0.0)  # a lease held from an earlier lookup goes back
            self.table_answers += 1
            entry, covered = answer
            if entry is None:
                return None
            self._published = (table, entry)
            return TierHit(entry.name, covered, reuse_kind(entry.kind, ReuseKind.CHECKPOINT), ReuseTier.RAM)
        sent = time.monotonic()
        hits, candidates = self.client.match(namespace, pages, tail, MATCH_LEASE_SECONDS)
        leased = [(self.client.match_instance, h) for h in (*hits, *candidates) if h.lease_id]
        best: tierstore_pb2.MatchHit | None = None
        for hit in hits:
            if self._usable(hit, n) and (best is None or hit.tokens > best.tokens):
                best = hit
        if best is None and hits and (tail is not None or pages):
            # The longest hit is the whole prompt without its logits: ask again one step shorter.
            shorter = pages if tail is not None else pages[:-1]
            retry, more = self.client.match(namespace, shorter, None, MATCH_LEASE_SECONDS)
            leased += [(self.client.match_instance, h) for h in (*retry, *more) if h.lease_id]
            best = max((h for h in retry if self._usable(h, n)), key=lambda h: h.tokens, default=None)
        for c in candidates:  # longest first
            if best is not None and c.tokens <= best.tokens:
                break
            m = c.tokens
            if self._usable(c, n) and state_matches(bytes(c.hash), m, namespace, page_hashes, tokens, self.page_size):
                best = c
                break
        self._keep_lease(best, leased, sent)
        if best is None:
            return None
        return TierHit(bytes(best.state_hash or best.hash), best.tokens,
                       reuse_kind(best.kind, ReuseKind.CHECKPOINT), reuse_tier(best.tier, ReuseTier.RAM))

    def _table_answer(self, table: PublishedTable, namespace: StateHash, pages: list[StateHash],
                      tail: bytes | None, n: int) -> tuple[TableEntry | None, int] | None:
        """`_from_table`, or None (ask Match) when a slot it reads is being written all the while: what it
        holds is unknown, so the table cannot settle the answer."""
        try:
            return self._from_table(table, namespace, pages, tail, n)
        except SlotBusy:
            return None

    def _from_table(self, table: PublishedTable, namespace: StateHash, pages: list[StateHash], tail: bytes | None,
                    n: int) -> tuple[TableEntry | None, int] | None:
        """What `_find` would answer, from the published table alone: (the state to claim and the tokens
        it covers, or None when nothing anywhere is usable), or None when only a Match can tell.

        The whole prompt's state with its logits is the best answer there is. Anything shorter is the
        best only if the table is complete and nothing longer answers: no RAM state usable at a longer
        page (those are in the table), no state elsewhere at the tail or a longer page (the disk hit a
        Match would list: the filter's ELSEWHERE column), no state ending mid-page after the hit's page
        or a later one (the anchored candidates: its ANCHORED column). Walking the pages longest first
        as `_find`'s Matches do, a state named by the page before any holder of it, an unusable one
        passed over. A "maybe" the table cannot settle, an entry of another namespace: ask Match."""
        if not table.current():
            return None
        read: dict[bytes, TableEntry | None] = {}  # each state slot read once (the whole prompt's is asked twice)

        def state(key: bytes) -> TableEntry | None:
            if key not in read:
                read[key] = table.state(key)
            return read[key]

        whole = tail if tail is not None else (pages[-1] if pages and len(pages) * self.page_size == n else None)
        if whole is not None:
            entry = state(whole)
            if entry is not None and entry.namespace == namespace and entry.tokens == n \
                    and self.codec.has_logits(n, entry.nbytes):
                return entry, n
        if not table.complete:
            return None
        keys = np.frombuffer(b"".join(pages) + (tail or b""), dtype=np.uint8).reshape(-1, 16)
        maybe = table.maybe(keys)  # [key, (in RAM, elsewhere, anchored after)]
        if tail is not None:
            in_ram, elsewhere, _ = maybe[-1]
            entry = state(tail) if in_ram else None
            if elsewhere or (entry is not None and entry.namespace != namespace):
                return None  # a disk hit for the whole prompt, or a state not ours: Match knows
        for j in np.flatnonzero(maybe[:len(pages)].any(axis=1))[::-1].tolist():  # longest first
            in_ram, elsewhere, anchored = maybe[j]
            if anchored:
                return None  # a state may end mid-page after page j: longer than any hit up to it
            entry = state(pages[j]) if in_ram else None
            if entry is not None:  # a state named by this page (Match takes it before any holder)
                if entry.namespace != namespace:
                    return None
                if self._usable_at(entry.tokens, entry.nbytes, n):
                    return entry, entry.tokens
            elif in_ram and (page := table.page(pages[j])) is not None \
                    and self._usable_at(page.tokens, page.nbytes, n):  # a longer state holds it as a prefix
                entry = state(page.holder)
                # The slot must agree with its holder: page j's tokens, the holder's length (which holder
                # it names is trusted, as a Match answer is: the tag proves only the holder's own bytes).
                if entry is None or entry.namespace != namespace or page.tokens != (j + 1) * self.page_size \
                        or page.nbytes != entry.nbytes:
                    return None
                return entry, page.tokens
            if elsewhere:
                return None  # a state not in RAM answers page j: a Match would list that disk hit
        return None, 0

    # --- a Match's leases -------------------------------------------------------------------
    def _keep_lease(self, best: tierstore_pb2.MatchHit | None, leased: list[tuple[str, tierstore_pb2.MatchHit]],
                    sent: float) -> None:
        """Holds the chosen hit's lease for its restore; the lease held before and every other lease
        of this lookup go back."""
        unused = [self._held[1]] if self._held is not None else []
        self._held = None
        kept = next(((instance, hit.lease_id) for instance, hit in leased if hit is best), None)
        seen: set[tuple[str, int]] = set()
        for instance, hit in leased:
            key = (instance, hit.lease_id)
            if key in seen:
                continue  # one state named twice in a reply: one lease
            seen.add(key)
            held = _Held(tierstore_pb2.AcquireResponse(lease_id=hit.lease_id, extent=hit.extent, metadata=hit.metadata,
                                                       from_tier=reuse_tier_pb(ReuseTier.RAM),
                                                       instance_id=instance), sent)
            if key == kept:
                self._held = (bytes(hit.state_hash or hit.hash), held)
            else:
                unused.append(held)
        self._let_go(unused)

    def _let_go(self, held: list[_Held]) -> None:
        """Releases Match leases nobody will use (one background call per instance that granted some)."""
        by_instance: dict[str, list[int]] = {}
        for h in held:
            by_instance.setdefault(h.lease.instance_id, []).append(h.lease.lease_id)
        for instance, ids in by_instance.items():
            self.client.release(0, ids, instance)

    def _take_held(self, name: bytes) -> tierstore_pb2.AcquireResponse | None:
        """The last lookup's lease if it is on `name`, recent enough to copy under and of the arena
        mapped now; else None (that lease goes back) and the restore Acquires."""
        kept, self._held = self._held, None
        if kept is None:
            return None
        held_name, held = kept
        if held_name != name or time.monotonic() - held.taken > LEASE_USE_SECONDS \
                or held.lease.instance_id != self.client.instance_id:
            self._let_go([held])
            return None
        self.match_leases_used += 1
        return held.lease

    def _usable(self, hit: tierstore_pb2.MatchHit, n: int) -> bool:
        """A state ending before the prompt's end, or at it with its next-token logits stored."""
        return self._usable_at(hit.tokens, hit.nbytes, n)

    def _usable_at(self, tokens: int, nbytes: int, n: int) -> bool:
        return tokens < n or (tokens == n and self.codec.has_logits(tokens, nbytes))

    def _take_published(self, name: bytes) -> tuple[PublishedTable, TableEntry] | None:
        """The last lookup's entry from the published table if it is on `name`, of the table mapped now and
        its slot unchanged since it was read."""
        kept, self._published = self._published, None
        if kept is None or kept[1].name != name or kept[0] is not self.client.table \
                or kept[0].instance_id != self.client.instance_id or not kept[0].unchanged(kept[1]):
            return None  # a slot changed since the lookup (spilled, evicted): Acquire finds where it went
        return kept

    def _as_lease(self, entry: TableEntry) -> tierstore_pb2.AcquireResponse:
        """A published entry as Acquire would have answered, without a lease (lease_id 0: nothing to release)."""
        return tierstore_pb2.AcquireResponse(
            extent=tierstore_pb2.Extent(offset=entry.offset, length=entry.nbytes),
            metadata=tierstore_pb2.StateMetadata(namespace=entry.namespace, tokens=entry.tokens,
                                                 kind=entry.kind,  # type: ignore[arg-type]
                                                 nbytes=entry.nbytes, engine_tag=entry.engine_tag),
            from_tier=reuse_tier_pb(ReuseTier.RAM), instance_id=self.client.instance_id)

    # --- up ------------------------------------------------------------------------------
    def connect(self, namespace: StateHash) -> bool:
        """Register `namespace` and map the arena now, ahead of the first request: the mapping's pages are
        then mapped in (common/prefault.py) before a claim copies through them, not while it does."""
        with self._lock:
            return self.client.ensure(namespace)

    def close(self) -> None:
        """The engine is stopping: the claims' copy thread ends and the store connection closes."""
        if self._helper_pool is not None:
            self._helper_pool.shutdown(wait=True)
        self.client.close()

    def _helpers(self) -> ThreadPoolExecutor | None:
        """The threads that copy and check a claim from KV-RAM beside the engine thread (made at first use)."""
        if self._helper_pool is None and self.claim_threads > 1:
            self._helper_pool = ThreadPoolExecutor(self.claim_threads - 1, thread_name_prefix="ignis-restore-copies")
        return self._helper_pool

    def restore(self, namespace: StateHash, hit: TierHit, slot: int | None, pages: list[int], request_id: str = ""
                ) -> tuple[ReuseTier, torch.Tensor | None] | None:
        """Copy a stored state into `slot` and `pages`; (from tier, logits) or None if it failed.

        A hit of kind `pages` may be a page-aligned prefix of a longer attention-only
        state: its first len(pages) pages are copied (the whole blob is still checksummed).
        """
        with self._lock:
            return self._restore(namespace, hit, slot, pages, request_id)

    def _restore(self, namespace: StateHash, hit: TierHit, slot: int | None, pages: list[int], request_id: str
                 ) -> tuple[ReuseTier, torch.Tensor | None] | None:
        if not self.client.ensure(namespace):
            self.restore_failures += 1
            return None
        started = time.perf_counter()
        on_host = self.codec.cache.kv.device.type == "cpu"
        # From disk into a CPU cache the copy runs while the blob is read (AcquireStream): the tag is
        # checked on what was copied anyway. A device cache checks the arena bytes before its copy.
        stream: Iterator[tierstore_pb2.AcquireProgress] | None = None
        ready = 0
        published = self._take_published(hit.state_hash)
        lease = self._take_held(hit.state_hash) if published is None else self._as_lease(published[1])
        if lease is None and on_host and hit.tier is ReuseTier.DISK:
            stream = self.client.acquire_stream(hit.state_hash)
            first = next(stream, None)
            if first is not None and first.HasField("lease"):
                lease, ready = first.lease, first.ready_bytes
                stream = None if first.verified else stream  # in RAM after all: whole in this message
        elif lease is None:
            lease = self.client.acquire(hit.state_hash)
        if lease is None:
            self.restore_failures += 1
            return None
        if stream is None:
            ready = lease.extent.length
        if not self.client.same_instance(lease.instance_id) and not self.client.ensure(namespace):
            self.restore_failures += 1  # the store restarted under us and cannot be mapped
            return None
        landed = stream is None  # every byte read and checked by the store
        try:
            meta, ext = lease.metadata, lease.extent
            arena = self.client.arena
            sliced = hit.kind is ReuseKind.PAGES and hit.tokens <= meta.tokens and hit.tokens % self.page_size == 0
            tag = bytes(meta.engine_tag)
            ok = (meta.tokens == hit.tokens or sliced) and ext.length >= meta.nbytes and arena is not None \
                and ext.offset + meta.nbytes <= arena.numel() and self.codec.nbytes(meta.tokens, False) <= meta.nbytes
            mac = self.key.hasher(hit.state_hash, namespace, meta.tokens, meta.nbytes, tag)  # the tag's nonce
            if ok and not on_host:  # device copies: the tag is checked on the arena bytes first
                mac.update(self.client.arena_bytes(ext.offset, meta.nbytes))
                ok = self.key.matches(tag, mac)
            logits = None
            # On a CPU cache the tag is checked on what was copied (codec.unpacked_tag says why): from RAM
            # segment by segment on two threads, each hashed from its copies (engine/tiers/checked_copy.py);
            # from disk each copy as it is made, between the reads the restore waits on
            # (engine/tiers/unpacked_tag.py). A failed check leaves the slot and the fresh pages to a cold
            # prefill, which overwrites them.
            if ok and on_host and arena is not None and stream is None:
                pieces, logits = self.codec.claim_pieces(meta.tokens, meta.nbytes, slot, pages)
                copy_and_check(pieces, arena[ext.offset:ext.offset + meta.nbytes], mac, self._helpers(),
                               self.claim_threads)
                ok = self.key.matches(tag, mac)
            elif ok and arena is not None:
                feed = self.codec.unpacked_tag(mac, arena, ext.offset, meta.tokens, meta.nbytes, slot, pages,
                                               UNPACK_STEP_BYTES) if on_host else None
                steps = self.codec.unpack_steps(arena, ext.offset, meta.tokens, meta.nbytes, slot, pages)
                landed, logits = _copy_as_landed(steps, ready, stream, feed.through if feed is not None else None)
                if not landed:  # the store failed the restore (a bad blob, a failing disk): nothing copied counts
                    self.restore_failures += 1
                    return None
                self.restores_streamed += stream is not None
                if feed is not None:
                    feed.finish(logits)
                    ok = self.key.matches(tag, mac)
            if published is not None and not published[0].unchanged(published[1]):
                # The state left KV-RAM while it was copied: what was copied may be another state's.
                self.restore_failures += 1
                self.table_races += 1
                log_event(log, "ignis.request.restore_raced", hash=hit.state_hash.hex()[:16], tokens=hit.tokens,
                          kind=hit.kind.value, reason="the state left KV-RAM during the copy")
                return None
            if not ok:
                self.restore_failures += 1
                self.rejected += 1
                log_event(log, "ignis.request.restore_rejected", logging.WARNING, hash=hit.state_hash.hex()[:16],
                          tokens=hit.tokens, kind=hit.kind.value, reason="metadata or integrity tag mismatch")
                return None
        finally:
            if stream is not None and not landed:  # refused before copying: wait for the lease, to give it back
                landed = any(message.verified for message in stream)
            if landed:
                self.client.release(lease.lease_id, (), lease.instance_id)
        tier = reuse_tier(lease.from_tier, ReuseTier.RAM)
        self.restores += 1
        if published is not None:
            self.table_claims += 1
            self.client.report_used(hit.state_hash, lease.instance_id)
        ids = {"request_id": request_id} if request_id else {}
        log_event(log, "ignis.request.restored", **ids, hash=hit.state_hash.hex(), tokens=hit.tokens,
                  kind=hit.kind.value, tier=tier.value, bytes=meta.nbytes, ms=round((time.perf_counter() - started) * 1000, 3))
        return tier, logits


def _copy_as_landed(steps: list[tuple[int, Callable[[], torch.Tensor | None]]], ready: int,
                    more: Iterator[tierstore_pb2.AcquireProgress] | None,
                    copied: Callable[[int], None] | None = None) -> tuple[bool, torch.Tensor | None]:
    """Runs each copy of `steps` once the bytes it reads have landed (`ready`, then each message of
    `more` until one says verified; all at once without `more`): (whether every byte was read and
    checked by the store, the logits the last step returned). False: the stream ended in an error.
    `copied(end)` after each round of copies: the copies of the bytes before `end` are made."""
    logits = None
    i = 0
    done = 0
    verified = more is None
    while True:
        ran = i
        while i < len(steps) and (verified or steps[i][0] <= ready):
            logits = steps[i][1]()
            done = max(done, steps[i][0])
            i += 1
        if copied is not None and i > ran:
            copied(done)
        if i == len(steps) and verified:
            return True, logits
        assert more is not None
        message = next(more, None)
        if message is None:
            return False, None
        ready, verified = message.ready_bytes, message.verified
