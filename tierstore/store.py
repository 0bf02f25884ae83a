"""The tierstore's logic, without gRPC: states by hash across KV-RAM and KV-disk.

- Reserve hands out an arena extent; the engine writes the state into it by
  offset; Commit makes it a state (checksummed here, so a later scribble over
  the arena is caught before it reaches disk).
- Acquire pins a state in the arena (restoring it from disk first if needed);
  Release, or the lease running out, unpins it. A Match may lease the RAM
  states it names in the same step (one round trip for a claim from RAM); such
  a lease counts a hit only when released as used.
- RAM pressure spills unpinned states to disk in the one eviction order
  (common/eviction.py, through policy.py); disk pressure drops only states ranked
  below the one coming down, and only those the Reserve/Put that forced the move
  may displace. ``kv_disk.bytes`` is never exceeded. A state that cannot move down
  is dropped (an eviction) only if that Reserve/Put may displace it; else the
  reservation is refused and counted (``protected_refusals``): protection changes
  decisions, not only the order. A restore is live work: rank order alone.
- A restored state keeps its disk copy (states are immutable), so spilling it
  again only frees its extent. Copies ahead of need (``kv_disk.copy_ahead``) make the
  same true of states that were never on disk: `copy_ahead` writes the disk copy of
  the RAM state next to leave, while the disk has free room, outside the lock, so a
  restore or a Reserve under pressure frees a copied state's extent without a
  write. When the disk needs room, such redundant copies go first: copies only ever
  take room that was free.
- What KV-RAM holds is published in a table beside the arena (published_table.py) that engines
  read without a Match: written under the lock wherever a state enters or leaves RAM (`_publish`).
- Faults degrade, never take the store down: a failing disk (read-only, full,
  I/O errors; disk.py counts and logs them) is skipped by spills while RAM keeps
  serving; an arena file found truncated, deleted or replaced (checked every
  second and before each use) is recreated under a new instance id: states only
  in RAM are lost (counted), states on disk stay, and every engine re-registers
  when a reply names the new instance.

One lock guards everything; disk I/O runs under it, in the server's thread pool
(so the asyncio loop stays free), which serializes moves. The exception is a copy
ahead of need: its blob is written and fsynced outside the lock (a state's bytes
never change after Commit), then renamed and indexed under it, if the state is
still the one it copied.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from common.eviction import EvictionOrder, Resident
from common.published_layout import PageRecord, StateRecord
from common.request_class import RequestClass, from_pb
from ignis.v1 import common_pb2, tierstore_pb2
from tierstore.arena import SHM_DIR, Arena, Extent, align_up, arena_path
from tierstore.disk import DiskFault, DiskIO, DiskRecord, DiskTier, FileRange, SourceShrank, StagedBlob
from tierstore.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from tierstore.policy import last_tier_room, resident
from tierstore.published_table import PublishedTable
from tierstore.registry import NamespaceRegistry, Registration
from tierstore.state import StateInfo, check_hash, checksum, normal_class, short

log = logging.getLogger("ignis.tierstore")

RAM, DISK = common_pb2.REUSE_TIER_RAM, common_pb2.REUSE_TIER_DISK
MAX_CANDIDATES = 32  # anchored Match candidates returned (longest first)
YIELD_POLL_SECONDS = 0.002  # a copy ahead of need looks this often whether the disk is free of waiting calls
YIELD_LIMIT_SECONDS = 5.0  # and waits this long at most between two of its chunks
# Copies ahead of need cover the RAM states that start leaving before this share of the arena has:
# a state further back is not needed on disk soon, and when a spill needs disk room, the copies of
# the states leaving last go first (copying hot states into the last free room only to drop them
# again was a write per spill in bench.chaos).
COPY_WINDOW = 0.5


@dataclass(frozen=True, slots=True)
class StoreConfig:
    arena_bytes: int  # reuse.kv_host_pool_bytes
    disk_path: str  # kv_disk.path
    disk_bytes: int  # kv_disk.bytes; 0 = no disk tier (RAM pressure drops states)
    interactive_ttl: float = 300.0  # reuse.retained_interactive_ttl
    lease_seconds: float = 60.0  # an Acquire with lease_seconds 0 gets this
    reservation_seconds: float = 300.0  # a Reserve never committed is abandoned after this
    copy_ahead: bool = True  # kv_disk.copy_ahead: `copy_ahead` writes RAM states' disk copies ahead of need

    def __post_init__(self) -> None:
        for name in ("interactive_ttl", "lease_seconds", "reservation_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")


# ------------------------------------------------------------ records crossing the boundary

@dataclass(frozen=True, slots=True)
class ArenaInfo:
    path: str
    nbytes: int
    instance_id: str
    table_path: str = ""  # the published table beside it ("": none)
    table_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Hit:
    """The best state of one tier for a prompt (MatchHit)."""

    hash: bytes  # the request's page hash or tail hash that matched
    state_hash: bytes  # the stored state to Acquire
    tokens: int
    tier: int
    kind: int
    extent: Extent | None  # RAM only: (offset, nbytes)
    nbytes: int
    lease_id: int = 0  # a Match that asked for leases: the lease on state_hash (RAM only)
    info: StateInfo | None = None  # with a lease: the leased state's metadata


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    extent: Extent  # (offset, nbytes) of the bytes in the arena
    info: StateInfo
    from_tier: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    arena_bytes_used: int
    arena_bytes_total: int
    disk_bytes_used: int
    disk_bytes_total: int
    states_ram: int
    states_disk: int
    checksum_failures: int
    leases_active: int
    reservations_pending: int
    spills: int
    restores: int
    evictions: int
    protected_refusals: int  # Reserve/Put refused rather than drop a state they may not displace
    disk_usable: bool = True  # False while the disk fails (True with no disk tier)
    disk_errors: int = 0
    blobs_missing: int = 0  # found deleted behind our back on read
    arena_recreations: int = 0
    ram_states_lost: int = 0  # only in an arena that had to be recreated
    copies_ahead: int = 0  # RAM states given their disk copy ahead of need
    arena_path: str = ""
    instance_id: str = ""
    arena_usable: bool = True


MAX_LIST_ROWS = 1000  # rows of one ListStates page
MAX_LIST_NAMESPACES = 4096


@dataclass(frozen=True, slots=True)
class StoredStateView:
    """One stored state as ListStates shows it (a copy: it never changes after the call)."""

    info: StateInfo
    tier: int  # RAM | DISK
    age_seconds: float
    idle_seconds: float
    hits: int
    protected: bool
    rank: int  # place in its tier's eviction order, 0 leaves first


# ------------------------------------------------------------ internal, mutable

@dataclass(slots=True, eq=False)
class _State:
    info: StateInfo
    last_used: float
    protect_until: float = 0.0
    extent: Extent | None = None  # arena allocation (4 KiB aligned) when in RAM
    leases: int = 0  # Acquire leases
    reads: int = 0  # Get streams in flight
    dropped: bool = False  # gone from the index; its extent waits for the last unpin
    hits: int = 0  # Acquires (restores into an engine), for the Monitor
    created: float = 0.0  # when this store took it (set by _add)

    @property
    def pinned(self) -> bool:
        return self.leases + self.reads > 0


@dataclass(slots=True)
class _Reservation:
    extent: Extent
    nbytes: int
    request_class: int
    protect_seconds: float
    expires_at: float


@dataclass(slots=True)
class _LeaseEntry:
    state: _State
    expires_at: float
    from_match: bool = False  # taken by a Match: its hit is counted when it is released as used


@dataclass(slots=True, eq=False)
class _CopyJob:
    """A copy ahead of need in flight: which state, where its bytes were, what to write, the disk room
    it holds (counted as the disk's until the copy is published or given up)."""

    state: _State
    extent: Extent
    generation: int  # the arena's: a recreated arena ends the copy unpublished
    record: DiskRecord
    registration: bytes
    source: FileRange  # the arena file by a descriptor of the job's own: closed when the copy ends
    cost: int  # disk budget the blob takes, reserved while the copy runs
    reserved: bool = True
    cancelled: bool = False  # the state moved or went, the disk needs the room, or the store stops


class CopyCancelled(Exception):
    """A copy ahead of need stops between two chunks: it was cancelled (see _CopyJob.cancelled)."""


@dataclass(slots=True)
class _Counters:
    spills: int = 0
    restores: int = 0
    evictions: int = 0
    checksum_failures: int = 0  # at commit/spill/restore; the disk tier counts its own too
    protected_refusals: int = 0
    arena_recreations: int = 0
    ram_states_lost: int = 0
    copies_ahead: int = 0


class TierStore:
    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.time,
                 disk_io: DiskIO | None = None, arena_dir: Path = SHM_DIR) -> None:
        self.config = config
        self.instance_id = uuid.uuid4().hex
        self._clock = clock
        self._lock = threading.Lock()
        self._order = EvictionOrder(config.interactive_ttl)
        self._disk = DiskTier(config.disk_path, config.disk_bytes, io=disk_io, clock=clock) \
            if config.disk_bytes > 0 else None
        self._arena_dir = arena_dir
        # What KV-RAM holds, for engines to read (published_table.py). Made before the arena: once the
        # arena's name is in /dev/shm, another user could take the table's name beside it first.
        self._table = self._new_table(self.instance_id)
        try:
            self.arena = Arena(config.arena_bytes, instance_id=self.instance_id, directory=arena_dir)
        except BaseException:
            self._close_table()
            raise
        self._arena_fault: str | None = None  # the arena is broken and could not be recreated yet
        self._arena_generation = 0  # a Get that began in an earlier arena ends without touching this one
        known: dict[bytes, Registration] = {}
        if self._disk is not None:
            known = {ns: Registration.decode(raw) for ns, raw in self._disk.load_namespaces().items()}
        disk = self._disk
        self._registry = NamespaceRegistry(known, None if disk is None
                                           else lambda r: disk.save_namespace(r.namespace, r.encode()))
        self._states: dict[bytes, _State] = {}
        self._ram_pages: dict[bytes, set[bytes]] = {}  # page hash -> sliceable RAM states holding it
        self._holders: dict[bytes, set[bytes]] = {}  # page hash -> sliceable states holding it, in any tier
        self._anchored: dict[bytes, set[bytes]] = {}  # last full page hash -> states ending mid-page after it
        self._reservations: dict[bytes, _Reservation] = {}
        self._leases: dict[int, _LeaseEntry] = {}
        self._lease_ids = itertools.count(1)
        self._busy: set[bytes] = set()  # states being restored: their disk copy must stay
        self._zombies: dict[int, _State] = {}  # dropped while pinned: their extents wait for the last unpin
        self._copy_job: _CopyJob | None = None  # the copy ahead of need in flight
        self._copies_stopped = False  # cancel_copies: the service is stopping, no copy starts again
        self._disk_waits = 0  # disk reads and writes someone waits for now: a copy ahead of need pauses meanwhile
        self.copy_wanted = threading.Event()  # set by a Commit: a state may want its disk copy
        self._counters = _Counters()
        if self._disk is not None:  # what survived a restart is served again
            for rec in self._disk.records():
                self._add(_State(rec.info, rec.last_used, rec.protect_until))
        self._publish_all()

    # ------------------------------------------------------------ control plane

    def register(self, reg: Registration) -> ArenaInfo:
        """Records the namespace (registry.py has the rule for another layout); returns the arena to map."""
        with self._lock:
            self._need_arena()
            replaced = self._registry.register(reg, stored=self._on_disk)
            if replaced is not None:
                gone = [s for s in self._states.values() if s.info.namespace == reg.namespace]
                for state in gone:
                    self._forget(state)
                log.warning("namespace=%s registered again with another layout (model %r, was %r): "
                            "%d states in RAM under the old one dropped", short(reg.namespace), reg.model,
                            replaced.model, len(gone))
            table = self._table
            return ArenaInfo(str(self.arena.path), self.arena.size, self.instance_id,
                             str(table.path) if table is not None else "", table.nbytes if table is not None else 0)

    def _on_disk(self, namespace: bytes) -> bool:
        """Whether a state of `namespace` lives on disk only (a RAM state's disk copy goes with it when
        another layout replaces the registration: it locks nothing)."""
        return self._disk is not None and any(
            r.info.namespace == namespace and (s := self._states.get(r.info.hash)) is not None and s.extent is None
            for r in self._disk.records())

    def match_anchored(self, namespace: bytes, page_hashes: Iterable[bytes], tail_hash: bytes | None = None,
                       anchored: bool = True, lease_seconds: float = 0.0) -> tuple[list[Hit], list[Hit]]:
        """The longest state per tier whose tokens prefix the prompt (a lower tier only if longer);
        with `anchored`, also the states ending mid-page right after one of the pages.

        Those candidates are named by a hash over tokens the store never sees, so the
        caller verifies each by name; longest first, at most MAX_CANDIDATES. With
        `lease_seconds` > 0, every RAM state named is leased in the same step (its
        hits carry the lease): the caller copies without an Acquire, then releases
        them all (`release`).
        """
        found = self._match(True, namespace, page_hashes, tail_hash, anchored, lease_seconds)
        assert found is not None
        return found

    def match_now(self, namespace: bytes, page_hashes: Iterable[bytes], tail_hash: bytes | None = None,
                  anchored: bool = True, lease_seconds: float = 0.0) -> tuple[list[Hit], list[Hit]] | None:
        """`match_anchored` if the lock is free now, else None (nothing done): the server runs a Match on
        its event loop this way, and in its pool when the lock is held."""
        return self._match(False, namespace, page_hashes, tail_hash, anchored, lease_seconds)

    def _match(self, blocking: bool, namespace: bytes, page_hashes: Iterable[bytes], tail_hash: bytes | None,
               anchored: bool, lease_seconds: float) -> tuple[list[Hit], list[Hit]] | None:
        check_hash(namespace, "namespace")
        pages = [check_hash(p, f"page_hashes[{i}]") for i, p in enumerate(page_hashes)]
        if tail_hash is not None:
            check_hash(tail_hash, "tail_hash")
        _check_seconds(lease_seconds, "lease_seconds")
        if not self._lock.acquire(blocking=blocking):
            return None
        try:  # no arena check unless leasing: Match reads no arena bytes (Acquire and Get check)
            now = self._clock()
            self._expire(now)
            leasing = lease_seconds > 0 and self._check_arena()  # a broken arena: plain hits, the caller Acquires
            ram = self._best(namespace, pages, tail_hash, in_ram=True)
            disk = self._best(namespace, pages, tail_hash, in_ram=False) if self._disk is not None else None
            candidates = self._anchored_at(namespace, pages) if anchored else []
            hits = [h for h in (ram,) if h is not None]
            if disk is not None and disk.tokens > (ram.tokens if ram is not None else 0):
                hits.append(disk)
            if leasing:
                hits, candidates = self._lease_hits(hits, candidates, now + lease_seconds)
        finally:
            self._lock.release()
        return hits, candidates

    def _lease_hits(self, hits: list[Hit], candidates: list[Hit], expires_at: float) -> tuple[list[Hit], list[Hit]]:
        """The hits with a lease on each RAM state they name (one per state), taken under the lock
        that found them, so the extents they report stay put until released."""
        leases: dict[bytes, int] = {}

        def leased(hit: Hit) -> Hit:
            state = self._states.get(hit.state_hash)
            if hit.tier != RAM or state is None or state.extent is None:
                return hit
            lease_id = leases.get(hit.state_hash)
            if lease_id is None:
                lease_id = leases[hit.state_hash] = next(self._lease_ids)
                state.leases += 1
                self._leases[lease_id] = _LeaseEntry(state, expires_at, from_match=True)
            return replace(hit, lease_id=lease_id, info=state.info)

        return [leased(h) for h in hits], [leased(c) for c in candidates]

    def _anchored_at(self, namespace: bytes, pages: Sequence[bytes]) -> list[Hit]:
        found: list[Hit] = []
        for page in pages:
            for h in self._anchored.get(page, ()):
                state = self._states.get(h)
                if state is not None and state.info.namespace == namespace:
                    found.append(self._hit(h, state, state.info.tokens))
        found.sort(key=lambda hit: (-hit.tokens, hit.hash))
        return found[:MAX_CANDIDATES]

    def _add(self, state: _State) -> None:
        state.created = state.created or self._clock()
        self._states[state.info.hash] = state
        anchor = _anchor(state.info)
        if anchor is not None:
            self._anchored.setdefault(anchor, set()).add(state.info.hash)
        if state.info.sliceable:
            for p in state.info.page_hashes:
                self._holders.setdefault(p, set()).add(state.info.hash)

    def reserve(self, hash: bytes, nbytes: int, request_class: int = common_pb2.REQUEST_CLASS_INTERACTIVE,
                protect_seconds: float = 0.0) -> Extent | None:
        """An arena extent (offset, nbytes) to write the state into; None if it cannot fit even after spilling."""
        check_hash(hash)
        if nbytes <= 0:
            raise InvalidArgument("nbytes must be > 0")
        _check_seconds(protect_seconds, "protect_seconds")
        request_class = normal_class(request_class)
        with self._lock:
            self._need_arena()
            now = self._clock()
            self._expire(now)
            if hash in self._states or hash in self._reservations:
                what = "stored" if hash in self._states else "reserved"
                raise AlreadyExists(f"state {short(hash)} is already {what}")
            extent = self._make_room(nbytes, now, newcomer_interactive=from_pb(request_class) is RequestClass.INTERACTIVE)
            if extent is None:
                return None
            self._reservations[hash] = _Reservation(extent, nbytes, request_class, protect_seconds,
                                                    now + self.config.reservation_seconds)
            return Extent(extent.offset, nbytes)

    def write_reserved(self, hash: bytes, pos: int, data: bytes | memoryview) -> None:
        """Copies ``data`` into a reservation at ``pos`` (Put: the bytes arrive over gRPC)."""
        with self._lock:
            self._need_arena()
            res = self._reservations.get(hash)
            if res is None:
                raise NotFound(f"no reservation for {short(hash)} (dropped, or it expired)")
            if pos + len(data) > res.nbytes:
                raise InvalidArgument(f"data runs past the state's {res.nbytes} bytes")
            self.arena.slice(res.extent.offset + pos, len(data))[:] = data

    def commit(self, hash: bytes, meta: tierstore_pb2.StateMetadata) -> StateInfo:
        """Publishes a reservation, once written, as a state (it becomes visible to Match)."""
        check_hash(hash)
        with self._lock:
            self._need_arena()
            now = self._clock()
            self._expire(now)
            res = self._reservations.get(hash)
            if res is None:
                raise FailedPrecondition(f"no reservation for {short(hash)}: Reserve first (or it expired)")
            info = self._info(hash, meta, res.request_class)
            if info.nbytes != res.nbytes:
                raise InvalidArgument(f"metadata.nbytes is {info.nbytes}, the reservation {res.nbytes}")
            digest = checksum(self.arena.slice(res.extent.offset, res.nbytes))
            if info.checksum and info.checksum != digest:
                self._counters.checksum_failures += 1
                raise FailedPrecondition(f"the arena bytes of {short(hash)} do not match metadata.checksum; "
                                         "write them again and commit, or Drop the reservation")
            del self._reservations[hash]
            state = _State(replace(info, checksum=digest), now,
                           now + res.protect_seconds if res.protect_seconds > 0 else 0.0, res.extent)
            self._add(state)
            self._index_ram(state)
            self._publish(state)
            self.copy_wanted.set()
            return state.info

    def acquire(self, hash: bytes, lease_seconds: float = 0.0,
                progress: Callable[[Lease, int], None] | None = None) -> Lease | None:
        """Pins a state in the arena, restoring it from disk if needed; None if RAM has no room for it.

        With `progress`, a restore calls `progress(lease, n)` as the bytes land: first with n = 0
        (the lease it will return, its extent where they land), then each time the extent's first n
        bytes are read (not yet checked: only a returned lease vouches for them). Under the lock,
        like the whole restore: the callback must only hand the figures on.
        """
        check_hash(hash)
        _check_seconds(lease_seconds, "lease_seconds")
        with self._lock:
            self._need_arena()
            now = self._clock()
            self._expire(now)
            state = self._live(hash)
            from_tier = RAM
            lease_id = next(self._lease_ids)
            if state.extent is None:
                landing = None if progress is None else \
                    lambda extent, n: progress(Lease(lease_id, Extent(extent.offset, state.info.nbytes), state.info,
                                                     DISK), n)
                if not self._restore(state, now, landing):
                    return None
                from_tier = DISK
            state.leases += 1
            state.hits += 1
            state.last_used = now
            self._leases[lease_id] = _LeaseEntry(state, now + (lease_seconds or self.config.lease_seconds))
            assert state.extent is not None
            return Lease(lease_id, Extent(state.extent.offset, state.info.nbytes), state.info, from_tier)

    def release(self, lease_id: int, unused: Iterable[int] = (), used_hashes: Iterable[bytes] = ()) -> None:
        """Ends `lease_id` (0: none) and the `unused` leases of a Match; a Match lease released as
        `lease_id` was used, and counts the hit Acquire would have. NotFound if any was unknown
        (the others are released all the same). `used_hashes`: states claimed without a lease, through
        the published table: each counts its hit and its use as an Acquire would (names gone are skipped)."""
        claimed = [check_hash(h, "used_hashes[]") for h in used_hashes]
        with self._lock:
            now = self._clock()
            for h in claimed:
                state = self._states.get(h)
                if state is not None:
                    state.hits += 1
                    state.last_used = now
            missing = []
            for lid, used in ([(lease_id, True)] if lease_id else []) + [(u, False) for u in unused]:
                entry = self._leases.pop(lid, None)
                if entry is None:
                    missing.append(lid)
                    continue
                state = entry.state
                if used and entry.from_match:
                    state.hits += 1
                    state.last_used = now
                state.leases -= 1
                self._unpinned(state)
            if missing:
                raise NotFound(f"no lease {', '.join(map(str, missing))} "
                               "(released already, expired, or its arena was recreated)")

    def drop(self, hash: bytes) -> bool:
        """Removes a state from every tier, or abandons a reservation; False if neither existed."""
        check_hash(hash)
        with self._lock:
            res = self._reservations.pop(hash, None)
            if res is not None:
                self.arena.free(res.extent)
                return True
            state = self._states.get(hash)
            if state is None:
                return False
            self._forget(state)
            return True

    def abandon(self, hash: bytes) -> bool:
        """Frees a reservation that will not be committed (a failed Put); never touches a stored state."""
        with self._lock:
            res = self._reservations.pop(hash, None)
            if res is not None:
                self.arena.free(res.extent)
            return res is not None

    def open_read(self, hash: bytes) -> tuple[StateInfo, memoryview | bytes, Callable[[], None]]:
        """(info, bytes, done) for Get: RAM bytes stay pinned until ``done()``; disk bytes are read and verified."""
        check_hash(hash)
        with self._lock:
            self._check_arena()
            now = self._clock()
            self._expire(now)
            state = self._live(hash)
            state.last_used = now
            if state.extent is not None:
                state.reads += 1
                generation = self._arena_generation
                return state.info, self.arena.slice(state.extent.offset, state.info.nbytes), \
                    lambda: self._end_read(state, generation)
            assert self._disk is not None
            try:
                with self._foreground_io():
                    data = self._disk.read(hash)
            except DiskFault as exc:
                raise Unavailable("disk", f"kv-disk cannot read {short(hash)} now ({exc}); it stays stored") from None
            if data is None:
                self._forget(state)
                raise DataLoss(f"the blob of {short(hash)} was missing or failed its checksum; it was dropped")
            return state.info, data, lambda: None

    def expire(self) -> None:
        """Ends leases and reservations past their time, checks the arena file and retries what the
        disk failed to do (the server calls it every second)."""
        with self._lock:
            self._check_arena(sweep=True)
            self._expire(self._clock())
            if self._disk is not None:
                self._disk.retry()

    def stats(self) -> StoreStats:
        with self._lock:
            disk = self._disk
            c = self._counters
            return StoreStats(
                arena_bytes_used=self.arena.allocator.used_bytes if self._arena_fault is None else 0,
                arena_bytes_total=self.arena.size,
                disk_bytes_used=disk.used_bytes if disk is not None else 0,
                disk_bytes_total=disk.budget if disk is not None else 0,
                states_ram=sum(1 for s in self._states.values() if s.extent is not None),
                states_disk=sum(1 for s in self._states.values() if s.extent is None),
                checksum_failures=c.checksum_failures + (disk.checksum_failures if disk is not None else 0),
                leases_active=len(self._leases), reservations_pending=len(self._reservations),
                spills=c.spills, restores=c.restores, evictions=c.evictions,
                protected_refusals=c.protected_refusals,
                disk_usable=disk.usable if disk is not None else True,
                disk_errors=disk.errors if disk is not None else 0,
                blobs_missing=disk.blobs_missing if disk is not None else 0,
                arena_recreations=c.arena_recreations, ram_states_lost=c.ram_states_lost,
                copies_ahead=c.copies_ahead, arena_path=str(self.arena.path), instance_id=self.instance_id,
                arena_usable=self._arena_fault is None,
            )

    def list_states(self, namespaces: Iterable[bytes], offset: int = 0, limit: int = 100
                    ) -> tuple[list[StoredStateView], int]:
        """The states of ``namespaces``, RAM's in eviction order then disk's: (this page, total rows). A RAM
        state with a disk copy (written ahead of need) is a row of each tier, as the disk's bytes count it.

        Under the lock only a copy of the index is taken; the ranking happens after."""
        wanted = {check_hash(ns, "namespaces[]") for ns in namespaces}
        if len(wanted) > MAX_LIST_NAMESPACES:
            raise InvalidArgument(f"at most {MAX_LIST_NAMESPACES} namespaces, got {len(wanted)}")
        limit = min(limit or 100, MAX_LIST_ROWS)
        with self._lock:
            now = self._clock()
            disk = self._disk
            rows = [(s, self._resident(s), (s.extent is not None, disk is not None and s.info.hash in disk), s.hits,
                     s.created) for s in self._states.values() if s.info.namespace in wanted]
        views: list[StoredStateView] = []
        for tier, where in ((RAM, 0), (DISK, 1)):
            ranked = sorted((r for r in rows if r[2][where]), key=lambda r: self._order.rank(r[1], now))
            views += [StoredStateView(state.info, tier, max(now - created, 0.0), max(now - res.last_used, 0.0), hits,
                                      self._order.is_protected(res, now), rank)
                      for rank, (state, res, _, hits, created) in enumerate(ranked)]
        return views[offset:offset + limit], len(views)

    def copy_ahead(self) -> bool:
        """Writes the disk copy of one RAM state that has none, the next to leave RAM first, if the disk
        has free room for it (nothing is dropped for a copy); False when there is none to write.

        The blob is written outside the lock, from the committed bytes (read from the arena file, not its
        mapping: a file truncated meanwhile stops the copy instead of SIGBUS); it is published only if the state
        is still where it was (not dropped, moved or in a recreated arena) and the bytes read match its
        checksum. A mismatch drops the state, as a spill would, only if its arena bytes still fail the
        checksum (they changed after Commit); else they changed under the read only, and the copy goes.
        The service calls this from one thread of its own (tierstore/copy_ahead.py)."""
        with self._lock:
            job = self._next_copy()
        if job is None:
            return False
        assert self._disk is not None
        staged: StagedBlob | None = None
        failed: OSError | None = None
        try:
            staged = self._disk.stage(job.record, job.source, job.registration, pace=lambda: self._pace(job))
        except CopyCancelled:
            pass
        except SourceShrank as exc:  # the arena file was truncated: the next check recreates it
            log.warning("a copy ahead of need of state=%s stopped: %s", short(job.record.info.hash), exc)
        except OSError as exc:
            failed = exc
        finally:  # whatever stopped it (MemoryError included), the job ends and its room is given back
            os.close(job.source.fd)
            with self._lock:
                self._end_copy(job, staged, failed)
        return True

    def cancel_copies(self) -> None:
        """Stops the copy ahead of need in flight at its next chunk, and starts none again (the service
        is stopping)."""
        with self._lock:
            self._copies_stopped = True
            self._cancel_copy()

    def check_integrity(self) -> None:
        """Arena, index and disk agree; raises AssertionError."""
        with self._lock:
            self.arena.check_integrity()
            extents = [s.extent for s in (*self._states.values(), *self._zombies.values()) if s.extent]
            extents += [r.extent for r in self._reservations.values()]
            assert sum(e.length for e in extents) == self.arena.allocator.used_bytes, "arena use != extents held"
            assert len({e.offset for e in extents}) == len(extents), "two holders share an extent"
            for h, s in self._states.items():
                assert s.info.hash == h and not s.dropped
                assert s.leases == sum(1 for e in self._leases.values() if e.state is s), f"lease count of {short(h)}"
                assert s.extent is not None or (self._disk is not None and h in self._disk), f"{short(h)} is nowhere"
            want: dict[bytes, set[bytes]] = {}
            for s in self._states.values():
                if s.extent is not None and s.info.sliceable:
                    for p in s.info.page_hashes:
                        want.setdefault(p, set()).add(s.info.hash)
            assert want == self._ram_pages, "RAM page index is stale"
            anchored: dict[bytes, set[bytes]] = {}
            for s in self._states.values():
                if (anchor := _anchor(s.info)) is not None:
                    anchored.setdefault(anchor, set()).add(s.info.hash)
            assert anchored == self._anchored, "anchor index is stale"
            holders: dict[bytes, set[bytes]] = {}
            for s in self._states.values():
                if s.info.sliceable:
                    for p in s.info.page_hashes:
                        holders.setdefault(p, set()).add(s.info.hash)
            assert holders == self._holders, "page holder index is stale"
            self._check_table()
            if self._disk is not None:
                self._disk.check_integrity()
                assert all(r.info.hash in self._states for r in self._disk.records()), "disk state not indexed"

    def _check_table(self) -> None:
        """The published table says what the indexes say (lock held)."""
        table = self._table
        if table is None:
            return
        table.check_integrity()
        in_ram = {h for h, s in self._states.items() if s.extent is not None}
        assert set(table.states.bodies) == in_ram, "published states != RAM states"
        for h in in_ram:
            record = self._state_record(self._states[h])
            assert record is not None and table.shows_state(h, record), f"stale published state {short(h)}"
        pages = {p for p, holders in self._ram_pages.items() if holders}
        assert set(table.pages.bodies) == pages, "published pages != RAM pages"
        for p in pages:
            index = self._states[next(iter(self._ram_pages[p]))].info.page_hashes.index(p)
            page = self._page_record(p, index)
            assert page is not None and table.shows_page(p, page), f"stale published page {short(p)}"
        assert table.in_ram.present == in_ram | pages, "the filter's RAM keys are stale"
        keys = set(self._states) | set(self._holders)
        assert table.elsewhere.present == {k for k in keys if self._answered_elsewhere(k)}, "stale 'elsewhere'"
        assert table.anchors.present == set(self._anchored), "stale anchors"

    def close(self) -> None:
        with self._lock:
            self._cancel_copy()
            self._close_table()
            self.arena.close()
            if self._disk is not None:
                self._disk.close()

    # ------------------------------------------------------------ internals (lock held)

    def _live(self, hash: bytes) -> _State:
        state = self._states.get(hash)
        if state is None:
            raise NotFound(f"no state {short(hash)}")
        return state

    def _info(self, hash: bytes, meta: tierstore_pb2.StateMetadata, reserved_class: int) -> StateInfo:
        reg = self._registry.get(bytes(meta.namespace))
        page_size = reg.page_size if reg is not None else 0
        if page_size == 0 and meta.kind == common_pb2.REUSE_KIND_PAGES and meta.page_hashes \
                and meta.tokens % len(meta.page_hashes) == 0:
            page_size = meta.tokens // len(meta.page_hashes)  # pages-only state: whole pages by definition
        sliceable = meta.kind == common_pb2.REUSE_KIND_PAGES or (reg is not None and reg.attention_only)
        info = StateInfo.from_proto(hash, meta, page_size=page_size, sliceable=sliceable)
        if meta.request_class == common_pb2.REQUEST_CLASS_UNSPECIFIED:  # the class given at Reserve
            info = replace(info, request_class=reserved_class)
        return info

    def _best(self, namespace: bytes, pages: Sequence[bytes], tail: bytes | None, *, in_ram: bool) -> Hit | None:
        """Longest hit among states in RAM (or on disk only): tail first, then pages from the last."""
        def usable(s: _State | None) -> bool:
            return s is not None and s.info.namespace == namespace and (s.extent is not None) == in_ram

        if tail is not None:
            state = self._states.get(tail)
            if usable(state):
                assert state is not None
                return self._hit(tail, state, state.info.tokens)
        on_disk: list[list[bytes]] | None = None  # the disk's page index, read once per Match when needed
        for i in range(len(pages) - 1, -1, -1):
            state = self._states.get(pages[i])
            if usable(state):
                assert state is not None
                return self._hit(pages[i], state, state.info.tokens)
            # A page-aligned prefix of a longer sliceable state: page i of the prompt is page i of it.
            holders: Iterable[bytes] = ()
            if in_ram:
                holders = self._ram_pages.get(pages[i], ())
            elif self._disk is not None:
                if on_disk is None:
                    on_disk = self._disk.states_with_pages(pages[:i + 1])
                holders = on_disk[i]
            found: list[_State] = []
            for h in holders:
                holder = self._states.get(h)
                if holder is not None and usable(holder) and holder.info.page_hashes[i:i + 1] == (pages[i],):
                    found.append(holder)
            if found:
                state = min(found, key=lambda s: (s.info.nbytes, s.info.hash))  # cheapest to copy
                return self._hit(pages[i], state, state.info.prefix_tokens(i))
        return None

    @staticmethod
    def _hit(name: bytes, state: _State, tokens: int) -> Hit:
        extent = Extent(state.extent.offset, state.info.nbytes) if state.extent is not None else None
        return Hit(name, state.info.hash, tokens, RAM if extent is not None else DISK, state.info.kind, extent,
                   state.info.nbytes)

    def _resident(self, state: _State) -> Resident:
        return resident(state.info, last_used=state.last_used, protect_until=state.protect_until,
                        leased=state.pinned, claimed=state.hits > 0)

    def _make_room(self, nbytes: int, now: float, *, newcomer_interactive: bool | None = None) -> Extent | None:
        """An arena extent, moving unpinned states down in eviction order until one fits.

        ``newcomer_interactive`` is the class of an incoming Reserve/Put: a state that
        cannot move down is dropped only if that newcomer may displace it (and the
        disk drops only such states to take one coming down); otherwise the newcomer
        is refused (None, counted), though states already moved down for it stay
        where they went. None: a restore (live work), which takes in rank order and
        drops what cannot move down.
        """
        extent = self.arena.allocate(nbytes)
        if extent is not None:
            return extent
        movable = [s for s in self._states.values() if s.extent is not None and not s.pinned]
        # Spill nothing when even every movable state would not make enough room.
        if self.arena.allocator.free_bytes + sum(s.extent.length for s in movable if s.extent) < align_up(nbytes):
            return None
        for victim in self._order.order(movable, now, resident=self._resident):
            if not self._move_down(victim, now, newcomer_interactive):
                if newcomer_interactive is not None and \
                        not self._order.may_displace(self._resident(victim), newcomer_interactive, now):
                    self._counters.protected_refusals += 1
                    log.info("refused %d bytes: state=%s may not be displaced and cannot move down",
                             nbytes, short(victim.info.hash))
                    return None
                log.info("evicted state=%s bytes=%d (no room below RAM)", short(victim.info.hash), victim.info.nbytes)
                self._counters.evictions += 1
                self._forget(victim)
            extent = self.arena.allocate(nbytes)
            if extent is not None:
                return extent
        return None

    def _move_down(self, state: _State, now: float, newcomer_interactive: bool | None) -> bool:
        """Spills a RAM state to disk; False (nothing changed) when the disk cannot take it.

        True also when the state is gone instead: its arena copy no longer matched its
        checksum, so it must never reach disk.
        """
        assert state.extent is not None and not state.pinned
        disk = self._disk
        if disk is None:
            return False
        self._cancel_copy(state)  # the spill writes it now: a copy of it in flight would be for nothing
        if state.info.hash not in disk:  # a restored state kept its disk copy: nothing to write
            if not disk.writable_now():  # failing: RAM carries on alone until a retry is due
                return False
            registration = self._registration(state.info.namespace)
            if not self._make_disk_room(state, now, newcomer_interactive, registration):
                return False
            data = self.arena.slice(state.extent.offset, state.info.nbytes)
            try:
                with self._foreground_io():
                    stored = disk.put(DiskRecord(state.info, state.last_used, state.protect_until), data,
                                      registration)
            except DataLoss as exc:  # the arena copy was corrupted after commit: never persist it
                log.error("%s", exc)
                self._forget(state)
                return True
            except DiskFault:  # counted and logged by the disk tier; the state stays in RAM
                return False
            finally:
                data.release()
            assert stored, "the disk had room a moment ago: this is a bug"
        self._unindex_ram(state)
        self.arena.free(state.extent)
        state.extent = None
        self._publish(state)
        self._counters.spills += 1
        log.info("spilled state=%s bytes=%d", short(state.info.hash), state.info.nbytes)
        return True

    def _registration(self, namespace: bytes) -> bytes:
        """What a blob of the namespace carries, so a rebuilt index knows its layout again."""
        reg = self._registry.get(namespace)
        return reg.encode() if reg is not None else b""

    def _make_disk_room(self, incoming: _State, now: float, newcomer_interactive: bool | None,
                        registration: bytes) -> bool:
        """Frees disk room for ``incoming`` (policy.last_tier_room); False, nothing dropped, if it cannot."""
        disk = self._disk
        assert disk is not None
        need = disk.cost(incoming.info, registration)
        if need > disk.budget:
            return False
        if disk.free_bytes() < need:
            self._cancel_copy()  # a spill goes before a copy ahead of need: the copy's room is given back
        if disk.free_bytes() >= need:
            return True
        # The disk copies of states also in RAM go first (nothing is lost); those that leave RAM last first,
        # since the next to leave are the copies that save a write soon. Then what the policy drops.
        copies = [s for s in self._states.values() if s.extent is not None and s.info.hash in disk
                  and s.info.hash not in self._busy and s.info.hash != incoming.info.hash]
        copies = self._order.order(copies, now, resident=self._resident)[::-1]
        copy_bytes = sum(rec.blob_bytes for s in copies if (rec := disk.get(s.info.hash)) is not None)
        held = ((state, self._resident(state), r.blob_bytes) for r in disk.records()
                if (state := self._states[r.info.hash]).extent is None and r.info.hash not in self._busy
                and r.info.hash != incoming.info.hash)
        victims = last_tier_room(self._order, self._resident(incoming), held, newcomer_interactive=newcomer_interactive,
                                 free=disk.free_bytes() + copy_bytes, need=need, now=now)
        if victims is None:
            return False  # keep everything that outranks the incoming state or the newcomer may not displace
        for state in copies:
            if disk.free_bytes() >= need or not disk.usable:
                break
            disk.remove(state.info.hash)
        for victim in victims:  # on disk only: its last tier, the state is gone
            if disk.free_bytes() >= need or not disk.usable:
                break
            self._counters.evictions += 1
            log.info("evicted state=%s bytes=%d", short(victim.info.hash), victim.info.nbytes)
            self._forget(victim)
        if disk.free_bytes() < need:
            if not disk.usable:
                return False  # a removal the disk refused: its room stays counted until a retry frees it
            raise AssertionError("disk room was counted but not found: this is a bug")
        return True

    @contextlib.contextmanager
    def _foreground_io(self) -> Iterator[None]:
        """Disk I/O a call waits for (a restore, a spill, a Get's read): copies ahead of need pause."""
        self._disk_waits += 1
        try:
            yield
        finally:
            self._disk_waits -= 1

    def _yield_disk(self) -> None:
        """Between two chunks of a copy ahead of need: wait while a call waits on the disk (the copy's
        writes would share its bandwidth), for YIELD_LIMIT_SECONDS at most (a copy is not starved)."""
        waited = 0.0
        while self._disk_waits and waited < YIELD_LIMIT_SECONDS:  # read without the lock: a hint
            time.sleep(YIELD_POLL_SECONDS)
            waited += YIELD_POLL_SECONDS

    def _next_copy(self) -> _CopyJob | None:
        disk = self._disk
        if disk is None or not self.config.copy_ahead or self._copies_stopped or self._copy_job is not None \
                or not disk.writable_now() or not self._check_arena():
            return None
        in_ram = [s for s in self._states.values() if s.extent is not None]
        now = self._clock()
        ahead = 0  # bytes of the RAM states that leave before this one
        for state in self._order.order(in_ram, now, resident=self._resident):
            if ahead >= self.arena.size * COPY_WINDOW:
                return None  # the rest leave RAM after half of it has: a copy now would likely be dropped first
            ahead += state.info.nbytes
            if state.info.hash in disk:
                continue
            registration = self._registration(state.info.namespace)
            cost = disk.cost(state.info, registration)
            if cost > disk.free_bytes():
                continue  # a copy never drops anything: a smaller state may still fit
            assert state.extent is not None
            try:
                source = FileRange(self.arena.reader(), state.extent.offset)
            except OSError as exc:  # out of descriptors: try again at the next look
                log.warning("no copy ahead of need now: %s", exc)
                return None
            disk.reserve_staging(cost)
            self._copy_job = _CopyJob(state, state.extent, self._arena_generation,
                                      DiskRecord(state.info, state.last_used, state.protect_until), registration,
                                      source, cost)
            return self._copy_job
        return None

    def _pace(self, job: _CopyJob) -> None:
        """Between two chunks of a copy (no lock held): stop if cancelled; wait while a call waits on the disk."""
        if job.cancelled:
            raise CopyCancelled
        self._yield_disk()
        if job.cancelled:
            raise CopyCancelled

    def _cancel_copy(self, state: _State | None = None) -> None:
        """Cancels the copy in flight (only if it copies `state`, when given) and gives its disk room back now."""
        job = self._copy_job
        if job is None or (state is not None and job.state is not state):
            return
        job.cancelled = True
        self._release_copy_room(job)

    def _release_copy_room(self, job: _CopyJob) -> None:
        if job.reserved:
            job.reserved = False
            assert self._disk is not None
            self._disk.release_staging(job.cost)

    def _end_copy(self, job: _CopyJob, staged: StagedBlob | None, failed: OSError | None) -> None:
        """The copy's writing is over (lock held): publish it if it is still the state's bytes, else drop it."""
        disk = self._disk
        assert disk is not None
        self._copy_job = None
        self._release_copy_room(job)  # place_staged counts the blob itself
        if failed is not None:
            disk.failed_write(failed)
        if staged is None:
            return
        state = job.state
        h = state.info.hash
        if job.cancelled or self._states.get(h) is not state or state.extent != job.extent \
                or self._arena_generation != job.generation or h in disk:
            disk.discard_staged(staged)  # dropped, moved down meanwhile, or its arena is gone
            return
        if staged.digest != state.info.checksum:
            disk.discard_staged(staged)
            # What was read does not match the state's checksum: the bytes in the arena changed after
            # Commit, or changed under the read. Only the first is a loss, and the bytes tell which (if
            # the arena is still the one read: checking it may recreate it, and lose the state anyway).
            if not self._check_arena() or self._arena_generation != job.generation \
                    or self._states.get(h) is not state:
                return
            if checksum(self.arena.slice(job.extent.offset, state.info.nbytes)) != state.info.checksum:
                self._counters.checksum_failures += 1
                log.error("state %s changed in the arena after commit; dropped", short(h))
                self._forget(state)
            return
        try:
            if not disk.place_staged(staged):  # its digest is the state's checksum: checked above
                return  # the budget no longer has room (removals still pending)
        except DiskFault:  # counted and logged by the disk tier; the state stays in RAM
            return
        self._counters.copies_ahead += 1
        log.info("copied state=%s bytes=%d to disk ahead of need", short(h), state.info.nbytes)

    def _restore(self, state: _State, now: float, progress: Callable[[Extent, int], None] | None = None) -> bool:
        """Brings a disk state into the arena, checked; False if RAM has no room. DataLoss if the blob is bad.
        `progress(extent, n)`: where the bytes land (n = 0), then how many have."""
        assert self._disk is not None
        h = state.info.hash
        self._busy.add(h)
        try:
            extent = self._make_room(state.info.nbytes, now)
        finally:
            self._busy.discard(h)
        if extent is None:
            return False
        view = self.arena.slice(extent.offset, state.info.nbytes)
        try:
            if progress is not None:
                progress(extent, 0)
            with self._foreground_io():
                ok = self._disk.read_into(h, view, None if progress is None else lambda n: progress(extent, n))
        except DiskFault as exc:
            self.arena.free(extent)
            raise Unavailable("disk", f"kv-disk cannot read {short(h)} now ({exc}); it stays stored") from None
        finally:
            view.release()
        if not ok:
            self.arena.free(extent)
            self._forget(state)
            raise DataLoss(f"the blob of {short(h)} was missing or failed its checksum; it was dropped")
        state.extent = extent
        self._index_ram(state)
        self._publish(state)
        self._counters.restores += 1
        log.info("restored state=%s bytes=%d", short(h), state.info.nbytes)
        return True

    def _forget(self, state: _State) -> None:
        """Removes a state from every tier; a pinned extent is freed at the last unpin."""
        h = state.info.hash
        self._cancel_copy(state)
        if self._states.get(h) is state:
            del self._states[h]
            anchor = _anchor(state.info)
            if anchor is not None:
                self._anchored[anchor].discard(h)
                if not self._anchored[anchor]:
                    del self._anchored[anchor]
            if state.info.sliceable:
                for p in state.info.page_hashes:
                    _discard(self._holders, p, h)
        if self._disk is not None:
            self._disk.remove(h)
        if state.extent is not None:
            self._unindex_ram(state)
        state.dropped = True
        if state.extent is not None and state.pinned:
            self._zombies[id(state)] = state
        self._unpinned(state)
        self._publish(state)

    def _unpinned(self, state: _State) -> None:
        if state.dropped and not state.pinned and state.extent is not None:
            self.arena.free(state.extent)
            state.extent = None
            self._zombies.pop(id(state), None)

    def _end_read(self, state: _State, generation: int) -> None:
        with self._lock:
            if generation != self._arena_generation:
                return  # its arena was recreated: the pin went with it
            state.reads -= 1
            self._unpinned(state)

    # The published table (published_table.py): written wherever a state enters or leaves KV-RAM (after
    # _index_ram / _unindex_ram and the extent change: commit, _restore, _move_down, _forget), and
    # whole for each new arena; each write recomputes the keys of that state from the indexes.

    def _new_table(self, instance_id: str) -> PublishedTable | None:
        """The published table of the arena instance `instance_id` will have (made first: see __init__)."""
        path = arena_path(self._arena_dir, instance_id)
        try:
            return PublishedTable.beside(path, self.config.arena_bytes, self.config.disk_bytes, instance_id)
        except OSError as exc:  # /dev/shm full: engines ask Match for every claim
            log.warning("no published table beside %s (%s): engines ask Match for every claim", path.name, exc)
            return None

    def _close_table(self) -> None:
        table, self._table = self._table, None
        if table is not None:
            table.close()

    def _publish_all(self) -> None:
        for state in list(self._states.values()):
            self._publish(state)

    def _publish(self, state: _State) -> None:
        """The table's records of every key `state` answers, as the indexes stand now (lock held): its
        name, the pages of a sliceable state, the page it is anchored after."""
        table = self._table
        if table is None or table.fault() is not None:
            return  # never written broken (a truncated file is SIGBUS): _check_arena makes a new one, all published
        info = state.info
        table.put_state(info.hash, self._state_record(state) if self._states.get(info.hash) is state else None,
                        self._answered_elsewhere(info.hash))
        if info.sliceable:
            for i, page in enumerate(info.page_hashes):
                table.put_page(page, self._page_record(page, i), self._answered_elsewhere(page))
        anchor = _anchor(info)
        if anchor is not None:
            table.set_anchored(anchor, anchor in self._anchored)

    @staticmethod
    def _state_record(state: _State) -> StateRecord | None:
        """What the table says of a state in KV-RAM (None: it is not)."""
        info, extent = state.info, state.extent
        if extent is None:
            return None
        return StateRecord(extent.offset, info.nbytes, info.tokens, info.kind, info.namespace, info.engine_tag)

    def _page_record(self, page: bytes, index: int) -> PageRecord | None:
        """The RAM state a Match would take for `page` as its `index`-th page: the smallest holder."""
        holders = [s for h in self._ram_pages.get(page, ()) if (s := self._states.get(h)) is not None
                   and s.extent is not None and s.info.page_hashes[index:index + 1] == (page,)]
        if not holders:
            return None
        best = min(holders, key=lambda s: (s.info.nbytes, s.info.hash))
        return PageRecord(best.info.hash, best.info.prefix_tokens(index), best.info.nbytes)

    def _answered_elsewhere(self, key: bytes) -> bool:
        """Whether a state not in KV-RAM answers `key`: named so, or holding it as a page (any namespace)."""
        exact = self._states.get(key)
        if exact is not None and exact.extent is None:
            return True
        return any((s := self._states.get(h)) is not None and s.extent is None for h in self._holders.get(key, ()))

    def _index_ram(self, state: _State) -> None:
        if state.info.sliceable:
            for p in state.info.page_hashes:
                self._ram_pages.setdefault(p, set()).add(state.info.hash)

    def _unindex_ram(self, state: _State) -> None:
        if state.info.sliceable:
            for p in state.info.page_hashes:
                holders = self._ram_pages.get(p)
                if holders is not None:
                    holders.discard(state.info.hash)
                    if not holders:
                        del self._ram_pages[p]

    def _check_arena(self, sweep: bool = False) -> bool:
        """Recreates the arena if its file broke; False while none is usable. Once recreating
        has failed, only the once-a-second sweep (`expire`) tries again, not every call."""
        if self._arena_fault is not None and not sweep:
            return False
        reason = self._arena_fault or self.arena.fault() or self._table_fault()
        return reason is None or self._recreate_arena(reason)

    def _table_fault(self) -> str | None:
        """A published table broken behind our back breaks the arena with it: both are made again, under a
        new instance (a write into a truncated table is SIGBUS; a new instance makes engines map the new one)."""
        broken = self._table.fault() if self._table is not None else None
        return None if broken is None else f"left with its published table {broken}"

    def _need_arena(self) -> None:
        if not self._check_arena():
            raise Unavailable("arena", f"the KV-RAM arena is unusable ({self._arena_fault}); retrying every second")

    def _recreate_arena(self, reason: str) -> bool:
        """A new arena file under a new instance id; what lived only in the old one is lost."""
        first = self._arena_fault is None
        if first:  # noticed now: nothing may touch the old mapping again
            self._close_table()  # engines stop claiming from it at their next look
            lost, kept = self._abandon_arena()
            self._arena_fault = f"arena {self.arena.path.name} was {reason}"
            what = f"{lost} states only in RAM lost, {kept} kept on disk"
        instance_id = uuid.uuid4().hex
        table = self._new_table(instance_id)  # before its arena, as at start
        try:
            arena = Arena(self.config.arena_bytes, instance_id=instance_id, directory=self._arena_dir)
        except OSError as exc:
            if table is not None:
                table.close()
            if first:
                log.error("KV-RAM %s (%s) and cannot be recreated (%s): the RAM tier is unusable until it can; "
                          "retrying every second", self._arena_fault, what, exc)
                self._arena_fault = f"{self._arena_fault}; recreating it failed: {exc}"
            return False
        old, self.arena = self.arena, arena
        self.instance_id = instance_id
        old.close()
        self._close_table()
        self._table = table
        self._publish_all()  # the states kept on disk: their names and pages answer elsewhere
        if first:
            log.warning("KV-RAM %s (%s): recreated as %s, instance %s; engines re-register and map it",
                        self._arena_fault, what, arena.path.name, instance_id[:8])
        else:
            log.warning("KV-RAM arena recreated as %s, instance %s", arena.path.name, instance_id[:8])
        self._arena_fault = None
        return True

    def _abandon_arena(self) -> tuple[int, int]:
        """Forgets every extent of the current arena: leases, reservations, RAM copies (lock held)."""
        lost = kept = 0
        self._cancel_copy()
        for state in list(self._states.values()):
            state.leases = state.reads = 0
            if state.extent is None:
                continue
            self._unindex_ram(state)
            state.extent = None
            if self._disk is not None and state.info.hash in self._disk:
                kept += 1
            else:
                lost += 1
                self._forget(state)
        self._leases.clear()
        self._reservations.clear()
        self._zombies.clear()
        self._arena_generation += 1
        self._counters.arena_recreations += 1
        self._counters.ram_states_lost += lost
        return lost, kept

    def _expire(self, now: float) -> None:
        for lease_id in [i for i, e in self._leases.items() if e.expires_at <= now]:
            entry = self._leases.pop(lease_id)
            entry.state.leases -= 1
            self._unpinned(entry.state)
            log.info("lease %d on %s expired", lease_id, short(entry.state.info.hash))
        for h in [h for h, r in self._reservations.items() if r.expires_at <= now]:
            self.arena.free(self._reservations.pop(h).extent)
            log.info("reservation of %s expired uncommitted", short(h))


def _discard(index: dict[bytes, set[bytes]], key: bytes, value: bytes) -> None:
    holders = index.get(key)
    if holders is not None:
        holders.discard(value)
        if not holders:
            del index[key]


def _anchor(info: StateInfo) -> bytes | None:
    """The last full page hash of a state that ends mid-page (its name is not a page hash); else None."""
    if info.page_hashes and info.hash != info.page_hashes[-1]:
        return info.page_hashes[-1]
    return None


def _check_seconds(value: float, name: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgument(f"{name} must be a finite number >= 0")
