"""KV-disk: one blob file per state, indexed in LMDB.

Layout under ``kv_disk.path``::

    blobs/<32 hex digits>        a state's bytes, named by its 16-byte chain hash
    blobs/<32 hex digits>.tmp    a write in progress (removed at start)
    index/                       LMDB: states (hash -> record), pages (page hash
                                 -> state hashes, sliceable states only),
                                 namespaces (h0 -> registration)

A write is crash-safe: temp file, fsync, rename, fsync of the folder, and only
then the LMDB transaction that makes it visible. A crash before the commit
leaves an orphan file, removed at the next start; an index entry is never
written before its blob is durable. Each blob's xxh3_128 (in the index) is
checked on every read: a blob that fails is dropped and counted, never served.
``kv_disk.bytes`` is a hard budget, counted in 4 KiB blocks.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import xxhash

from ignis.v1 import tierstore_pb2
from tierstore.arena import align_up
from tierstore.errors import DataLoss
from tierstore.state import StateHash, StateInfo

log = logging.getLogger("ignis.tierstore")

_HEADER = struct.Struct("<4sHBxIdd")  # magic, version, flags, page_size, last_used, protect_until
_MAGIC, _VERSION = b"IGTS", 1
_SLICEABLE = 1
_CHUNK = 8 << 20  # bytes per write/hash step: large sequential I/O without a second full copy
_TMP = ".tmp"


@dataclass(frozen=True, slots=True)
class DiskRecord:
    """A state on disk: its metadata and what the eviction order needs across restarts."""

    info: StateInfo
    last_used: float
    protect_until: float = 0.0

    def encode(self) -> bytes:
        i = self.info
        header = _HEADER.pack(_MAGIC, _VERSION, _SLICEABLE if i.sliceable else 0, i.page_size, self.last_used,
                              self.protect_until)
        return header + i.to_proto().SerializeToString()

    @classmethod
    def decode(cls, hash: bytes, raw: bytes) -> DiskRecord:
        magic, version, flags, page_size, last_used, protect_until = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(f"unknown index record format {magic!r} v{version}")
        meta = tierstore_pb2.StateMetadata.FromString(raw[_HEADER.size:])
        info = StateInfo(StateHash(hash), bytes(meta.namespace), meta.tokens, meta.kind, meta.request_class,
                         tuple(bytes(p) for p in meta.page_hashes), bytes(meta.checksum), meta.nbytes,
                         page_size, bool(flags & _SLICEABLE))
        return cls(info, last_used, protect_until)


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """What the start-up reconcile fixed."""

    temp_files_removed: int
    orphan_files_removed: int
    entries_dropped: int
    states: int


def blob_size(nbytes: int) -> int:
    """Bytes a blob counts against the budget: whole 4 KiB blocks, as the filesystem stores it."""
    return align_up(nbytes)


class DiskTier:
    def __init__(self, path: str | os.PathLike[str], budget: int, *, map_size: int = 1 << 30) -> None:
        if budget <= 0:
            raise ValueError(f"kv_disk.bytes must be > 0 for a disk tier, got {budget}")
        self.path = Path(path)
        self.budget = budget
        self.blobs = self.path / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        # max_spare_txns/lock defaults suit one writer process; the store serializes writers.
        self._env = lmdb.open(str(self.path / "index"), map_size=map_size, max_dbs=4, subdir=True)
        self._states = self._env.open_db(b"states")
        self._pages = self._env.open_db(b"pages", dupsort=True)
        self._namespaces = self._env.open_db(b"namespaces")
        self._records: dict[bytes, DiskRecord] = {}
        self.used_bytes = 0
        self.checksum_failures = 0
        self.last_reconcile = self._reconcile()

    # ------------------------------------------------------------ queries

    def get(self, hash: bytes) -> DiskRecord | None:
        return self._records.get(hash)

    def __contains__(self, hash: bytes) -> bool:
        return hash in self._records

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> Iterator[DiskRecord]:
        return iter(list(self._records.values()))

    def states_with_page(self, page_hash: bytes) -> list[bytes]:
        """Sliceable states whose pages include ``page_hash`` (from the LMDB page index)."""
        with self._env.begin(db=self._pages) as txn:
            cursor = txn.cursor()
            if not cursor.set_key(page_hash):
                return []
            return [bytes(v) for v in cursor.iternext_dup()]

    def free_bytes(self) -> int:
        return self.budget - self.used_bytes

    # ------------------------------------------------------------ writes

    def put(self, record: DiskRecord, data: memoryview | bytes) -> bool:
        """Writes a state durably; False (nothing written) if it would pass the budget.

        Raises DataLoss (counted) when ``data`` does not match the record's
        checksum: the source was corrupted after commit, so nothing is stored.
        """
        info = record.info
        if len(data) != info.nbytes:
            raise ValueError(f"{len(data)} bytes given for a {info.nbytes}-byte state: this is a bug")
        if info.hash in self._records:
            raise RuntimeError(f"state {info.hash.hex()} is already on disk: this is a bug")
        size = blob_size(info.nbytes)
        if self.used_bytes + size > self.budget:
            return False  # capacity is a return value, not an error
        final = self._blob_path(info.hash)
        tmp = final.with_name(final.name + _TMP)
        digest = self._write_file(tmp, data)
        if digest != info.checksum:
            tmp.unlink(missing_ok=True)
            self.checksum_failures += 1
            raise DataLoss(f"state {info.hash.hex()} changed in the arena after commit; not written")
        os.rename(tmp, final)
        _fsync_dir(self.blobs)
        self._txn_write(lambda txn: self._index_put(txn, record))
        self._records[info.hash] = record
        self.used_bytes += size
        return True

    def remove(self, hash: bytes) -> bool:
        """Drops a state: index first, then the file (a crash between leaves an orphan, removed at start)."""
        record = self._records.pop(hash, None)
        if record is None:
            return False
        self._txn_write(lambda txn: self._index_delete(txn, record.info))
        self._blob_path(hash).unlink(missing_ok=True)
        self.used_bytes -= blob_size(record.info.nbytes)
        return True

    def save_namespace(self, namespace: bytes, value: bytes) -> None:
        self._txn_write(lambda txn: txn.put(namespace, value, db=self._namespaces))

    def load_namespaces(self) -> dict[bytes, bytes]:
        with self._env.begin(db=self._namespaces) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}

    # ------------------------------------------------------------ reads

    def read_into(self, hash: bytes, out: memoryview) -> bool:
        """Reads a blob into ``out`` (exactly its size) and verifies it.

        False if the state is not on disk, or if the blob is missing, short or
        fails its checksum: then it is dropped (and a checksum failure counted),
        and ``out`` holds garbage that must not be served.
        """
        record = self._records.get(hash)
        if record is None:
            return False
        if len(out) != record.info.nbytes:
            raise ValueError(f"buffer of {len(out)} bytes for a {record.info.nbytes}-byte state: this is a bug")
        try:
            with open(self._blob_path(hash), "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != record.info.nbytes:
                    return self._fail(hash, "has the wrong size")
                hasher = xxhash.xxh3_128()
                pos = 0
                while pos < len(out):
                    n = f.readinto(out[pos:pos + _CHUNK])
                    if not n:
                        return self._fail(hash, "is short")
                    hasher.update(out[pos:pos + n])
                    pos += n
        except FileNotFoundError:
            log.warning("blob %s is missing; dropped from the index", hash.hex())
            self.remove(hash)
            return False
        if hasher.digest() != record.info.checksum:
            return self._fail(hash, "failed its checksum")
        return True

    def read(self, hash: bytes) -> bytes | None:
        """The verified bytes of a state, or None (as read_into)."""
        record = self._records.get(hash)
        if record is None:
            return None
        buf = bytearray(record.info.nbytes)
        return bytes(buf) if self.read_into(hash, memoryview(buf)) else None

    def _fail(self, hash: bytes, why: str) -> bool:
        self.checksum_failures += 1
        log.error("blob %s %s: dropped, not served", hash.hex(), why)
        self.remove(hash)
        return False

    # ------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Index == memory == files, page index matches, budget kept; raises AssertionError."""
        with self._env.begin() as txn:
            stored = {bytes(k): DiskRecord.decode(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._states)}
            pages = {(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._pages)}  # every duplicate
        assert stored == self._records, "LMDB states differ from the in-memory index"
        want_pages = {(p, h) for h, r in stored.items() if r.info.sliceable for p in r.info.page_hashes}
        assert pages == want_pages, f"page index differs: extra {pages - want_pages}, missing {want_pages - pages}"
        files = {p.name for p in self.blobs.iterdir()}
        assert files == {h.hex() for h in stored}, f"blob files differ from the index: {files ^ {h.hex() for h in stored}}"
        for h, r in stored.items():
            assert (self.blobs / h.hex()).stat().st_size == r.info.nbytes, f"blob {h.hex()} has the wrong size"
        assert self.used_bytes == sum(blob_size(r.info.nbytes) for r in stored.values())
        assert self.used_bytes <= self.budget, f"{self.used_bytes} bytes on disk, budget {self.budget}"

    def close(self) -> None:
        self._env.close()

    # ------------------------------------------------------------ internals

    def _blob_path(self, hash: bytes) -> Path:
        return self.blobs / hash.hex()

    def _write_file(self, path: Path, data: memoryview | bytes) -> bytes:
        """Writes and fsyncs ``path``; returns the xxh3_128 of what was written."""
        view = memoryview(data).cast("B")
        hasher = xxhash.xxh3_128()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for pos in range(0, len(view), _CHUNK):
                chunk = view[pos:pos + _CHUNK]
                hasher.update(chunk)
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return hasher.digest()

    def _txn_write(self, fn: Callable[[lmdb.Transaction], object]) -> None:
        """One write transaction; grows the map when it is full (the map is virtual address space)."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)

    def _index_put(self, txn: lmdb.Transaction, record: DiskRecord) -> None:
        txn.put(record.info.hash, record.encode(), db=self._states)
        if record.info.sliceable:
            for page in record.info.page_hashes:
                txn.put(page, record.info.hash, db=self._pages, dupdata=True)

    def _index_delete(self, txn: lmdb.Transaction, info: StateInfo) -> None:
        txn.delete(info.hash, db=self._states)
        if info.sliceable:
            for page in info.page_hashes:
                txn.delete(page, info.hash, db=self._pages)

    def _reconcile(self) -> ReconcileReport:
        """Makes the index and the files agree after any crash; loads the survivors."""
        temps = orphans = dropped = 0
        with self._env.begin() as txn:
            stored: dict[bytes, bytes] = {bytes(k): bytes(v) for k, v in txn.cursor(db=self._states)}
        bad: list[tuple[bytes, StateInfo | None]] = []
        for h, raw in stored.items():
            try:
                record = DiskRecord.decode(h, raw)
            except (ValueError, struct.error) as exc:  # an unreadable entry: drop it
                log.warning("index entry %s is unreadable (%s); dropped", h.hex(), exc)
                bad.append((h, None))
                continue
            try:
                size = self._blob_path(h).stat().st_size
            except FileNotFoundError:
                size = -1
            if size != record.info.nbytes:  # no blob (or a torn one): the entry cannot be served
                bad.append((h, record.info))
            else:
                self._records[h] = record
        known = {h.hex() for h in self._records}
        for path in self.blobs.iterdir():
            if path.name.endswith(_TMP):  # a write that never reached its rename
                path.unlink()
                temps += 1
            elif path.name not in known and _is_hex_name(path.name):  # renamed, never indexed (or dropped)
                path.unlink()
                orphans += 1
        if bad or orphans or temps:
            _fsync_dir(self.blobs)

        def fix(txn: lmdb.Transaction) -> None:
            nonlocal dropped
            for h, info in bad:
                txn.delete(h, db=self._states)
                dropped += 1
            # Page entries whose state is gone (the dupsort db is rebuilt from what survived).
            cursor = txn.cursor(db=self._pages)
            for page, state in list(cursor):  # every (page, state) duplicate
                if bytes(state) not in self._records or not self._records[bytes(state)].info.sliceable:
                    txn.delete(bytes(page), bytes(state), db=self._pages)

        self._txn_write(fix)
        self.used_bytes = sum(blob_size(r.info.nbytes) for r in self._records.values())
        report = ReconcileReport(temps, orphans, dropped, len(self._records))
        if temps or orphans or dropped:
            log.warning("kv-disk reconcile: %s", report)
        return report


def _is_hex_name(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _fsync_dir(path: Path) -> None:
    """Makes a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on a directory; the data is still synced
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
