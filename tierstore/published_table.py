"""The published table, the store's end: what KV-RAM holds, written where engines read it
without asking (layout: common/published_layout.py; protocol: tierstore.proto, "published table").

A claim from KV-RAM used to start with a Match round trip (on the Match socket 0.04 ms back to
back but 0.7-1.1 ms right after a large copy; over gRPC 0.6-1.8 ms). The table lets an engine find
the state itself: the store writes a slot whenever a state enters or leaves KV-RAM (and the filter
whenever a key appears or goes in any tier), under its one lock, so there is one writer; engines
only read. A slot leaving is rewritten (its sequence number bumped) before the lock is let go, so
before its extent can be handed to anyone else. About 3 us a key: a state of a thousand pages
costs 3 ms under the lock to publish.

Its own file beside the arena (``<arena>.table``, 0600), not a header region of the arena:
engines map the arena read/write (they write states into it), and a table inside it could be
scribbled by any engine's bug; this file an engine maps read-only, so only a process that opens
it for writing on purpose can change it (tests/test_published_table.py does, and the engine's
integrity tag catches it). It also lets the table be sized for both tiers, not the arena alone,
and has its life tied to the arena's: one per arena instance, created and closed with it.

The store holds an exclusive flock on the file while it lives (the kernel drops it on any exit,
kill -9 included), as on the arena: an engine that can take a shared lock on it knows the store
that wrote it is gone, and `tierstore.arena.reap_stale_arenas` removes it with the dead store's
arena. Closing it zeroes the header's epoch first, so an engine stops trusting it at once.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from common.mapped_file import file_fault
from common.published_layout import (ANCHORED, ELSEWHERE, EPOCH_OFFSET, FILTER_COLUMNS, HEADER, MAGIC, MAX_TAG,
                                     PAGE_BODY, PAGE_SLOT_BYTES, PROBE, RAM, SATURATED, STATE_BODY, STATE_SLOT_BYTES,
                                     UNPUBLISHED_OFFSET, VERSION, Geometry, PageRecord, StateRecord, epoch_of,
                                     filter_indices, header_bytes, home, key_words)
from tierstore.shm_file import SharedFile

TABLE_SUFFIX = ".table"
_SEQ = struct.Struct("<Q")


class _Slots:
    """One open-addressing region: where each key lies, and the keys with no free slot in their window."""

    def __init__(self, buf: mmap.mmap, at: int, capacity: int, slot_bytes: int) -> None:
        self.buf, self.at, self.capacity, self.slot_bytes = buf, at, capacity, slot_bytes
        self.where: dict[bytes, int] = {}  # key -> slot
        self.taken = bytearray(capacity)
        self.pending: dict[bytes, bytes] = {}  # key -> body: no room in its window (unpublished)
        self.bodies: dict[bytes, bytes] = {}  # key -> the body its slot holds (or will, once it has room)

    def put(self, key: bytes, body: bytes) -> bool:
        """Writes `key`'s slot (in place if it has one); False when its window is full (then pending)."""
        slot = self.where.get(key)
        if slot is not None and self.bodies.get(key) == body:
            return True  # what it holds already: no write, no new sequence number (a reader's entry stays good)
        self.bodies[key] = body
        if slot is None:
            slot = self._free_slot(key)
            if slot is None:
                self.pending[key] = body
                return False
            self.where[key] = slot
            self.taken[slot] = 1
        self._write(slot, body)
        return True

    def remove(self, key: bytes) -> None:
        self.bodies.pop(key, None)
        if self.pending.pop(key, None) is not None:
            return
        slot = self.where.pop(key, None)
        if slot is None:
            return
        self._write(slot, bytes(self.slot_bytes - 8))
        self.taken[slot] = 0
        for waiting in list(self.pending):  # a key waiting for room in a window that holds this slot
            if (slot - home(key_words(waiting)[0], self.capacity)) % self.capacity < PROBE:
                self.put(waiting, self.pending.pop(waiting))
                break

    def _free_slot(self, key: bytes) -> int | None:
        start = home(key_words(key)[0], self.capacity)
        for d in range(PROBE):
            slot = (start + d) & (self.capacity - 1)
            if not self.taken[slot]:
                return slot
        return None

    def _write(self, slot: int, body: bytes) -> None:
        """The seqlock's writer: odd while the slot changes, even (and 2 more) once it is whole."""
        at = self.at + slot * self.slot_bytes
        seq = _SEQ.unpack_from(self.buf, at)[0]
        _SEQ.pack_into(self.buf, at, seq + 1)
        self.buf[at + 8:at + self.slot_bytes] = body
        _SEQ.pack_into(self.buf, at, seq + 2)

    def check_integrity(self) -> None:
        assert sum(self.taken) == len(self.where), "taken slots != keys placed"
        for key, slot in self.where.items():
            assert self.taken[slot], f"slot {slot} of a key is not taken"
            assert (slot - home(key_words(key)[0], self.capacity)) % self.capacity < PROBE, "a key outside its window"
            at = self.at + slot * self.slot_bytes
            assert _SEQ.unpack_from(self.buf, at)[0] % 2 == 0, "a slot left mid-write"
            assert self.buf[at + 8:at + self.slot_bytes] == self.bodies[key], "a slot does not hold what was written"
        assert not set(self.pending) & set(self.where), "a key both placed and pending"
        assert set(self.bodies) == set(self.where) | set(self.pending), "bodies of keys neither placed nor pending"


class _Filter:
    """One column of the file's counting filter; `present` is what it counts, exactly."""

    def __init__(self, buf: mmap.mmap, at: int, size: int, column: int) -> None:
        self.buf, self.at, self.size, self.column = buf, at, size, column
        self.present: set[bytes] = set()

    def set(self, key: bytes, present: bool) -> None:
        if present == (key in self.present):
            return
        step = 1 if present else -1
        for i in filter_indices(key, self.size):
            at = self.at + i * FILTER_COLUMNS + self.column
            value = self.buf[at]
            if value != SATURATED:  # a saturated counter may stand for more than it can count: it stays
                self.buf[at] = value + step
        if present:
            self.present.add(key)
        else:
            self.present.discard(key)


class PublishedTable:
    """The file, its mapping, and the store's writes to it (all under the store's lock)."""

    def __init__(self, path: Path, geometry: Geometry, instance_id: str) -> None:
        geometry.check()
        self.file = SharedFile(path, geometry.nbytes)  # locked while the store lives (see the module docstring)
        self._buf = self.file.mmap
        self.path = path
        self.geometry = geometry
        self.instance_id = instance_id
        self.states = _Slots(self._buf, geometry.states_at, geometry.states, STATE_SLOT_BYTES)
        self.pages = _Slots(self._buf, geometry.pages_at, geometry.pages, PAGE_SLOT_BYTES)
        self.in_ram = _Filter(self._buf, geometry.filter_at, geometry.filter, RAM)
        self.elsewhere = _Filter(self._buf, geometry.filter_at, geometry.filter, ELSEWHERE)
        self.anchors = _Filter(self._buf, geometry.filter_at, geometry.filter, ANCHORED)
        self._unpublished = 0
        self._buf[:HEADER.size] = header_bytes(geometry, epoch_of(instance_id), 0, instance_id)

    @classmethod
    def beside(cls, arena_path: Path, arena_bytes: int, disk_bytes: int, instance_id: str) -> PublishedTable:
        return cls(arena_path.with_name(arena_path.name + TABLE_SUFFIX), Geometry.for_tiers(arena_bytes, disk_bytes),
                   instance_id)

    @property
    def nbytes(self) -> int:
        return self.geometry.nbytes

    def put_state(self, name: bytes, record: StateRecord | None, elsewhere: bool = False) -> None:
        """The state `name` is in KV-RAM as `record`, or (None) it is not; `elsewhere`: a state not in
        KV-RAM answers `name` too."""
        self._put(self.states, name, None if record is None else _state_body(name, record), elsewhere)

    def put_page(self, page: bytes, record: PageRecord | None, elsewhere: bool = False) -> None:
        """A state in KV-RAM holds `page` as a page-aligned prefix (`record`), or (None) none does;
        `elsewhere`: a state not in KV-RAM holds it."""
        self._put(self.pages, page, None if record is None else _page_body(page, record), elsewhere)

    def _put(self, slots: _Slots, key: bytes, body: bytes | None, elsewhere: bool) -> None:
        """A key's slot and its ELSEWHERE mark, in the order that never shows it answered nowhere (a state
        moving to disk is marked elsewhere before its slot goes; one coming back has its slot first)."""
        if elsewhere:
            self.set_elsewhere(key, True)
        if body is None:
            slots.remove(key)
        else:
            slots.put(key, body)
        self._keyed(key)
        if not elsewhere:
            self.set_elsewhere(key, False)

    def set_elsewhere(self, key: bytes, present: bool) -> None:
        """Whether a state not in KV-RAM answers `key` (its name, or a page it holds)."""
        self.elsewhere.set(key, present)

    def shows_state(self, name: bytes, record: StateRecord) -> bool:
        """Whether the table holds `record` for `name` (check_integrity: the store compares with its indexes)."""
        return self.states.bodies.get(name) == _state_body(name, record)

    def shows_page(self, page: bytes, record: PageRecord) -> bool:
        return self.pages.bodies.get(page) == _page_body(page, record)

    def set_anchored(self, page: bytes, present: bool) -> None:
        """Whether some state ends mid-page right after `page`."""
        self.anchors.set(page, present)

    def _keyed(self, key: bytes) -> None:
        """After a write of `key`: the filter's RAM column and the count of keys with no slot."""
        self.in_ram.set(key, any(key in t.where or key in t.pending for t in (self.states, self.pages)))
        self._count_unpublished()

    def _count_unpublished(self) -> None:
        unpublished = len(self.states.pending) + len(self.pages.pending)
        if unpublished != self._unpublished:
            self._unpublished = unpublished
            struct.pack_into("<Q", self._buf, UNPUBLISHED_OFFSET, unpublished)

    def check_integrity(self) -> None:
        magic, version, *_ = HEADER.unpack_from(self._buf, 0)
        assert magic == MAGIC and version == VERSION, "the table's header was overwritten"
        self.states.check_integrity()
        self.pages.check_integrity()
        assert struct.unpack_from("<Q", self._buf, UNPUBLISHED_OFFSET)[0] == \
            len(self.states.pending) + len(self.pages.pending), "the header miscounts unpublished keys"

    def fault(self) -> str | None:
        """Why the file can no longer serve as the table (SharedFile.fault), or None. The store then
        recreates it with the arena (store.py)."""
        return self.file.fault()

    def close(self) -> None:
        """Zeroes the epoch (engines stop using it at their next look), removes the file, drops the lock."""
        if self.file.fd < 0:
            return
        if file_fault(self.file.fd, self.nbytes) is None:  # a truncated one: nothing to write (SIGBUS)
            struct.pack_into("<Q", self._buf, EPOCH_OFFSET, 0)
        self._buf.close()
        self.file.remove()


def _state_body(name: bytes, record: StateRecord) -> bytes:
    if len(record.engine_tag) > MAX_TAG:
        raise ValueError("an engine_tag over 64 bytes was stored: this is a bug")
    return STATE_BODY.pack(*key_words(name), 1, record.kind, record.offset, record.nbytes, record.tokens,
                           len(record.engine_tag), record.namespace, record.engine_tag)


def _page_body(page: bytes, record: PageRecord) -> bytes:
    return PAGE_BODY.pack(*key_words(page), 1, record.tokens, record.holder, record.nbytes)
