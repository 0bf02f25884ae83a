"""The published table, the engine's end: what KV-RAM holds, read without asking the store
(layout: common/published_layout.py; the store's end: tierstore/published_table.py).

Mapped read-only (O_RDONLY, PROT_READ) from a file of our own user with mode 0600 only, as
the arena is; a file that is anything else is not used (the lookups go to Match). Nothing read
here is trusted for content: an entry says where a state's bytes are and what its metadata is,
and the engine's integrity tag, made with a key the store never holds, stays the proof that the
bytes copied are the state it names (engine/tiers/integrity.py). Any process that can write the
arena can write this file too. Forging a state's entry buys a cold prefill, never served bytes.
Which state holds a page as a prefix (a page slot) is trusted as a Match answer is: the tag proves
the holder's bytes are the holder, not that the holder's first pages are the prompt's; the engine
checks only that the slot agrees with the holder's entry (its length, the page's token count).

What an entry is worth is checked twice:

- `current` (before it is used): the file is whole and still linked (a read past a truncated
  end is SIGBUS, as in the arena), the header still carries the epoch of the instance whose arena
  is mapped (the store zeroes it when it closes the table: a clean stop, a recreated arena),
  and the store still holds its lock on the file (a store killed -9 holds nothing: the kernel
  dropped the lock, and whatever a new store does, the table of the dead one is never used);
- `unchanged` (after the copy): the entry's slot has the same even sequence number as when it
  was read (the store bumps it, under its lock, before it frees the extent of a state leaving
  KV-RAM), and the table is still current. A state evicted while its bytes were copied, and its
  extent handed to another state, shows as a changed slot: the copy is not used.

On x86 (TSO) the store's writes are seen in the order it made them, and a copy that read
bytes written into a freed extent reads the slot's new sequence number after it. Elsewhere
the tag still refuses such bytes; the slot check is then what keeps the count honest.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np

from common.mapped_file import file_fault
from common.published_layout import (EPOCH_OFFSET, FILTER_COLUMNS, HEADER, HEADER_BYTES, MAGIC, PAGE_BODY,
                                     PAGE_SLOT_BYTES, PROBE, STATE_BODY, STATE_SLOT_BYTES, UNPUBLISHED_OFFSET, VERSION,
                                     Geometry, PageRecord, StateRecord, epoch_of, filter_indices_many, home, key_words)

_U64 = struct.Struct("<Q")
SPINS = 1000  # reads of a slot the store is writing before giving up on it (then: ask Match)


class SlotBusy(Exception):
    """A slot was being written through every read: what it holds is unknown (not absent): ask Match."""


@dataclass(frozen=True, slots=True)
class TableEntry(StateRecord):
    """A state in KV-RAM as the table published it: what Acquire would have answered, and the slot
    and sequence number that say whether it still is (`PublishedTable.unchanged`)."""

    name: bytes
    slot_at: int  # byte offset of its slot in the file
    seq: int


class PublishedTable:
    def __init__(self, path: str, size: int, instance_id: str) -> None:
        """Maps the table of store instance `instance_id`; OSError when it is not a table we may use."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
                raise OSError(f"the published table {path} is not a 0600 file of this user")
            if size < HEADER_BYTES or st.st_size < size:
                raise OSError(f"the published table is {st.st_size} bytes, not {size}")
            buf = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._buf, self.path, self.instance_id = fd, buf, path, instance_id
        try:
            magic, version, states, pages, filter_size, probe, columns, epoch, _, named = HEADER.unpack_from(buf, 0)
            geometry = Geometry(states, pages, filter_size)
            if magic != MAGIC or version != VERSION or probe != PROBE or columns != FILTER_COLUMNS:
                raise OSError(f"{path} is not a published table this engine reads")
            geometry.check()
            if geometry.nbytes != size:
                raise OSError(f"the published table's header says {geometry.nbytes} bytes, not {size}")
            if named.rstrip(b"\0") != instance_id.encode()[:32] or epoch != epoch_of(instance_id):
                raise OSError("the published table is not the one of the store instance that answered")
        except (OSError, ValueError, struct.error) as exc:
            self.close()
            raise OSError(str(exc)) from None
        self.geometry = geometry
        self._epoch = epoch
        self._filter = np.frombuffer(buf, np.uint8, filter_size * FILTER_COLUMNS,
                                     geometry.filter_at).reshape(filter_size, FILTER_COLUMNS)

    # --- is it worth reading ---------------------------------------------------------
    def current(self) -> bool:
        """The store that wrote it serves it still: the file whole (a read past a truncated end is SIGBUS)
        and not deleted (a new store removes a dead one's), its epoch in the header, its lock on the file."""
        return self._buf is not None and file_fault(self._fd, len(self._buf)) is None \
            and _U64.unpack_from(self._buf, EPOCH_OFFSET)[0] == self._epoch and self._store_holds_it()

    def _store_holds_it(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)  # the store's exclusive lock: it lives
        fcntl.flock(self._fd, fcntl.LOCK_UN)  # nobody holds it: the store is gone
        return False

    @property
    def complete(self) -> bool:
        """Every key the store meant to publish has a slot: a key not found is not held in KV-RAM."""
        return _U64.unpack_from(self._buf, UNPUBLISHED_OFFSET)[0] == 0

    def unchanged(self, entry: TableEntry) -> bool:
        """The table is still current (checked first: a truncated file is not read), and the entry's slot
        was not written since it was read."""
        return self.current() and _U64.unpack_from(self._buf, entry.slot_at)[0] == entry.seq

    # --- lookups ---------------------------------------------------------------------
    def state(self, name: bytes) -> TableEntry | None:
        """The state `name` if the table holds it in KV-RAM (None: not there; SlotBusy: being written)."""
        at = self._find(name, self.geometry.states_at, self.geometry.states, STATE_SLOT_BYTES)
        if at is None:
            return None
        read = self._read(at, STATE_SLOT_BYTES)
        lo, hi, used, kind, offset, nbytes, tokens, tag_len, namespace, tag = STATE_BODY.unpack(read[1])
        if not used or (lo, hi) != key_words(name):
            return None
        return TableEntry(offset, nbytes, tokens, kind, namespace, tag[:tag_len], name=name, slot_at=at, seq=read[0])

    def page(self, page: bytes) -> PageRecord | None:
        """Which state in KV-RAM holds `page` as a page-aligned prefix (None: none; SlotBusy: being written)."""
        at = self._find(page, self.geometry.pages_at, self.geometry.pages, PAGE_SLOT_BYTES)
        if at is None:
            return None
        read = self._read(at, PAGE_SLOT_BYTES)
        lo, hi, used, tokens, holder, nbytes = PAGE_BODY.unpack(read[1])
        if not used or (lo, hi) != key_words(page):
            return None
        return PageRecord(holder, tokens, nbytes)

    def maybe(self, keys: np.ndarray) -> np.ndarray:
        """For each key (uint8 [n, 16]), what the filter allows (bool [n, FILTER_COLUMNS]): in RAM (a slot in
        the states or pages table), answered elsewhere (a disk hit for Match), anchored after (a candidate).
        False is sure (a key being added right now aside); True is "maybe": look it up, or ask Match."""
        return (self._filter[filter_indices_many(keys, len(self._filter))] != 0).all(axis=1)

    def _find(self, key: bytes, region: int, capacity: int, slot_bytes: int) -> int | None:
        """The byte offset of `key`'s slot within its window, or None (read unlocked: then read the slot)."""
        start = home(key_words(key)[0], capacity)
        buf = self._buf
        for d in range(PROBE):
            at = region + ((start + d) & (capacity - 1)) * slot_bytes
            if buf[at + 8:at + 24] == key:
                return at
        return None

    def _read(self, at: int, size: int) -> tuple[int, bytes]:
        """A slot as the seqlock allows: (its sequence number, its body); SlotBusy while it is written."""
        buf = self._buf
        for _ in range(SPINS):
            seq = _U64.unpack_from(buf, at)[0]
            if seq & 1:
                continue
            body = buf[at + 8:at + size]
            if _U64.unpack_from(buf, at)[0] == seq:
                return seq, body
        raise SlotBusy

    def close(self) -> None:
        """Unmaps it (the arrays over the mapping go with it) and closes the file."""
        if hasattr(self, "_filter"):
            del self._filter
        buf, self._buf = self._buf, None  # type: ignore[assignment]
        if buf is not None:
            try:
                buf.close()
            except BufferError:  # an array over it is still referenced somewhere: unmapped with it
                pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

