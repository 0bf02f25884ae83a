"""KV-disk: one self-describing blob file per state, indexed in LMDB.

Layout under ``kv_disk.path`` (folders 0700, files 0600)::

    blobs/<32 hex digits>        a state: a header describing it, then its bytes (tierstore/blob.py)
    blobs/<32 hex digits>.tmp    a write in progress (removed at start)
    blobs/<32 hex digits>.copy.tmp   a copy ahead of need in progress (removed at start)
    index/                       LMDB (tierstore/index.py)
    index.damaged-<time>/        an index found unreadable, moved aside; a new one was rebuilt from the blobs

A write is crash-safe: temp file, fsync, rename, fsync of the folder, and only
then the LMDB transaction that makes it visible. A crash before the commit
leaves an orphan file, removed at the next start; an index entry is never
written before its blob is durable. Each blob's xxh3_128 (in the index) is
checked on every read: a blob that fails is dropped and counted, never served.
``kv_disk.bytes`` is a hard budget, counted in 4 KiB blocks, headers included.

A removal is transactional: the record leaves the in-memory index at once (it is
never served again) but its bytes stay counted against the budget until both
the LMDB delete and the unlink have succeeded; a removal that fails (read-only
or failing disk) is retried (``retry``), so a fault never leaks budget. A blob
deleted behind our back is found on read, counted (``blobs_missing``) and its
record removed. Filesystem and index errors raise DiskFault, are counted
(``errors``), logged at most once per ERROR_LOG_INTERVAL, and make the tier
``usable == False`` until an operation succeeds again; ``writable_now`` tells the
store whether to try one (at most every RETRY_SECONDS while it fails).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import lmdb
import xxhash

from tierstore.auth import private_dir
from tierstore.blob import BadBlob, DiskRecord, blob_cost, read_header, with_header
from tierstore.blob_read import BlobReader
from tierstore.errors import DataLoss
from tierstore.index import Index, IndexDamaged, move_aside
from tierstore.state import StateInfo, short

log = logging.getLogger("ignis.tierstore")
T = TypeVar("T")

_CHUNK = 8 << 20  # bytes per write/hash step: large sequential I/O without a second full copy
_TMP = ".tmp"
_COPY_TMP = ".copy.tmp"  # a copy ahead of need, written outside the store's lock beside a spill's own temp file
ERROR_LOG_INTERVAL = 30.0  # seconds between two log lines about a failing disk
RETRY_SECONDS = 5.0  # while the disk fails, the store tries it again this often
_FAULTS = (OSError, lmdb.Error, IndexDamaged)
# What LMDB raises for a file that is not a sound index (as opposed to one it may not open: a
# permission or a read-only disk, which must stop the start rather than move a good index aside).
_DAMAGE = (IndexDamaged, lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError,
           lmdb.VersionMismatchError, lmdb.IncompatibleError, lmdb.BadValsizeError)

__all__ = ["DiskFault", "DiskIO", "DiskRecord", "DiskTier", "FileRange", "ReconcileReport", "SourceShrank",
           "StagedBlob"]


@dataclass(frozen=True, slots=True)
class StagedBlob:
    """A blob written and fsynced under its temp name, not yet renamed nor indexed (`DiskTier.stage`)."""

    placed: DiskRecord
    tmp: Path
    digest: bytes  # xxh3_128 of the state's bytes as written


def _check_length(info: StateInfo, data: memoryview | bytes) -> None:
    if len(data) != info.nbytes:
        raise ValueError(f"{len(data)} bytes given for a {info.nbytes}-byte state: this is a bug")


@dataclass(frozen=True, slots=True)
class FileRange:
    """Bytes of an open file from `offset` on, read by descriptor (DiskIO.write_file_from)."""

    fd: int
    offset: int


class SourceShrank(Exception):
    """The file a copy read from ended before the bytes it was to copy (truncated under it)."""


class DiskFault(Exception):
    """The filesystem or the index failed (read-only, full, I/O error). Counted and logged by the
    disk tier; nothing was stored, and a removal is pending (its bytes still counted)."""


class DiskIO:
    """The disk tier's writes to the filesystem and the index, in one place.

    Tests replace a method to make it fail as a read-only or full disk does
    (``OSError(EROFS)``, ``lmdb.Error``) where no such filesystem can be mounted, or
    where only one of the two may fail (a bind mount cannot be turned read-only
    while LMDB holds its files open for writing).
    """

    def write_file(self, path: Path, header: bytes, data: memoryview | bytes) -> bytes:
        """Writes ``header`` then ``data`` to ``path`` (0600) and fsyncs; returns the xxh3_128 of ``data``."""
        view = memoryview(data).cast("B")
        return self._write(path, header, (view[pos:pos + _CHUNK] for pos in range(0, len(view), _CHUNK)))

    def write_file_from(self, path: Path, header: bytes, source: FileRange, nbytes: int,
                        pace: Callable[[], None] | None = None) -> bytes:
        """As `write_file`, the data read from ``source`` by pread, a chunk at a time: a file that shrinks
        meanwhile (an arena truncated under the store) is a short read, SourceShrank, where reading it
        through a mapping would be SIGBUS. ``pace()`` runs before each chunk (it may wait, or raise to
        stop the copy); each chunk is flushed to the disk before the next."""
        buffer = memoryview(bytearray(min(_CHUNK, nbytes)))

        def chunks() -> Iterator[memoryview]:
            for pos in range(0, nbytes, _CHUNK):
                if pace is not None:
                    pace()
                chunk = buffer[:min(_CHUNK, nbytes - pos)]
                got = 0
                while got < len(chunk):
                    n = os.preadv(source.fd, [chunk[got:]], source.offset + pos + got)
                    if n == 0:
                        raise SourceShrank(f"the source ended {pos + got} bytes into a {nbytes}-byte copy")
                    got += n
                yield chunk

        return self._write(path, header, chunks(), sync_each=True)

    def _write(self, path: Path, header: bytes, chunks: Iterable[memoryview], sync_each: bool = False) -> bytes:
        """sync_each: each chunk reaches the disk before the next is read (`pace` then sees the device's
        time, not the page cache's)."""
        hasher = xxhash.xxh3_128()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, memoryview(header))
            for chunk in chunks:
                hasher.update(chunk)
                _write_all(fd, chunk)
                if sync_each:
                    os.fdatasync(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        return hasher.digest()

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def fsync_dir(self, path: Path) -> None:
        _fsync_dir(path)

    def commit(self, index: Index, fn: Callable[[lmdb.Transaction], object]) -> None:
        index.write(fn)


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """What the start-up reconcile fixed."""

    temp_files_removed: int
    orphan_files_removed: int
    entries_dropped: int
    states: int
    rebuilt: str = ""  # why the index was rebuilt from the blobs ("" when it was fine)
    unreadable_blobs_removed: int = 0  # at a rebuild: blobs without a format-2 header of their own name


class DiskTier:
    def __init__(self, path: str | os.PathLike[str], budget: int, *, map_size: int = 1 << 30,
                 io: DiskIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if budget <= 0:
            raise ValueError(f"kv_disk.bytes must be > 0 for a disk tier, got {budget}")
        self.path = Path(path)
        self.budget = budget
        self.blobs = self.path / "blobs"
        self._map_size = map_size
        self._io = io or DiskIO()
        self._reader = BlobReader()  # restores: each chunk hashed beside the read of the next
        self._clock = clock
        private_dir(self.path, fix=True)
        private_dir(self.blobs, fix=True)
        self._records: dict[bytes, DiskRecord] = {}
        self._pending: dict[bytes, DiskRecord] = {}  # removals not finished: bytes still counted
        self._namespaces: dict[bytes, bytes] = {}
        self._unsaved: set[bytes] = set()  # namespaces whose LMDB write failed
        self.used_bytes = 0
        self.staging_bytes = 0  # budget held by staged writes in flight (copies ahead of need)
        self.checksum_failures = 0
        self.blobs_missing = 0
        self.errors = 0
        self._fault: str | None = None
        self._retry_at = 0.0
        self._logged_at = -ERROR_LOG_INTERVAL
        self._index, stored, damaged = self._open_index()
        self.last_reconcile = self._rebuild(damaged) if damaged else self._reconcile(stored)

    # ------------------------------------------------------------ health

    @property
    def usable(self) -> bool:
        """False from a failed operation until one succeeds again."""
        return self._fault is None

    @property
    def fault(self) -> str | None:
        return self._fault

    def writable_now(self) -> bool:
        """Whether to try a write: the tier works, or it failed and a retry is due."""
        return self._fault is None or self._clock() >= self._retry_at

    def _failed(self, what: str, exc: BaseException) -> DiskFault:
        self.errors += 1
        now = self._clock()
        self._fault = f"{what}: {exc}"
        self._retry_at = now + RETRY_SECONDS
        if now - self._logged_at >= ERROR_LOG_INTERVAL:
            self._logged_at = now
            log.error("kv-disk %s failed (%s); RAM keeps serving, spills skip the disk, retrying every %.0fs "
                      "(%d disk errors so far; logged at most every %.0fs)", what, exc, RETRY_SECONDS, self.errors,
                      ERROR_LOG_INTERVAL)
        return DiskFault(self._fault)

    def _worked(self) -> None:
        if self._fault is not None:
            log.warning("kv-disk works again (after %d disk errors)", self.errors)
            self._fault = None

    # ------------------------------------------------------------ queries

    def get(self, hash: bytes) -> DiskRecord | None:
        return self._records.get(hash)

    def __contains__(self, hash: bytes) -> bool:
        return hash in self._records

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> Iterator[DiskRecord]:
        return iter(list(self._records.values()))

    def states_with_pages(self, page_hashes: Sequence[bytes]) -> list[list[bytes]]:
        """For each page hash, the sliceable states whose pages include it (from the LMDB page index),
        all in one read transaction; [] for each if it fails."""
        def read(txn: lmdb.Transaction) -> list[list[bytes]]:
            cursor = txn.cursor(db=self._index.pages)
            return [[bytes(v) for v in cursor.iternext_dup()] if cursor.set_key(h) else [] for h in page_hashes]

        try:
            found = self._index_read(read)
        except _FAULTS as exc:
            self._failed("reading the index", exc)
            return [[] for _ in page_hashes]
        return [[h for h in holders if h in self._records] for holders in found]


    def free_bytes(self) -> int:
        """Budget neither used nor held by a staged write in flight (`reserve_staging`)."""
        return self.budget - self.used_bytes - self.staging_bytes

    def reserve_staging(self, nbytes: int) -> None:
        """Holds budget for a blob being staged (outside the store's lock) until `release_staging`."""
        self.staging_bytes += nbytes

    def release_staging(self, nbytes: int) -> None:
        self.staging_bytes -= nbytes
        assert self.staging_bytes >= 0, "staging room released twice: this is a bug"

    def cost(self, info: StateInfo, registration: bytes = b"") -> int:
        """The budget ``put(info's record, ..., registration)`` would take."""
        return blob_cost(info, registration)

    # ------------------------------------------------------------ writes

    def put(self, record: DiskRecord, data: memoryview | bytes, registration: bytes = b"") -> bool:
        """Writes a state durably; False (nothing written) if it would pass the budget.

        ``registration`` is its namespace's (a rebuilt index gets it back from the
        blob). Raises DataLoss (counted) when ``data`` does not match the record's
        checksum: the source was corrupted after commit, so nothing is stored.
        Raises DiskFault when the disk fails: nothing is stored.
        """
        info = record.info
        _check_length(info, data)
        if info.hash in self._records:
            raise RuntimeError(f"state {short(info.hash)} is already on disk: this is a bug")
        placed, header = with_header(record, registration)
        if not self._room_for(placed):
            return False  # capacity is a return value, not an error
        tmp = self._temp_path(info.hash, _TMP)
        try:
            digest = self._io.write_file(tmp, header, data)
        except OSError as exc:
            self._discard(tmp)
            raise self._failed("writing a blob", exc) from None
        return self._place(StagedBlob(placed, tmp, digest))

    def stage(self, record: DiskRecord, source: FileRange, registration: bytes = b"",
              pace: Callable[[], None] | None = None) -> StagedBlob:
        """Writes and fsyncs a state's blob, read from ``source``, under a temp name of its own, touching
        nothing else here: the store runs it outside its lock (a copy ahead of need); `place_staged`
        publishes it under the lock. Raises OSError (`failed_write` counts it) or SourceShrank, the
        temp file removed. ``pace``: as `DiskIO.write_file_from`."""
        placed, header = with_header(record, registration)
        tmp = self._temp_path(record.info.hash, _COPY_TMP)
        try:
            digest = self._io.write_file_from(tmp, header, source, record.info.nbytes, pace)
        except BaseException:  # an error, the source shrank, or the caller stopped it (pace raised)
            self._discard(tmp)
            raise
        return StagedBlob(placed, tmp, digest)

    def failed_write(self, exc: OSError) -> DiskFault:
        """Counts and logs a `stage` that failed, as a failed `put` is."""
        return self._failed("writing a blob", exc)

    def place_staged(self, staged: StagedBlob) -> bool:
        """Renames and indexes a staged blob (as `put` ends; its staging room released first); False, the
        blob removed, if the state is on disk already or the budget has no room. DataLoss / DiskFault as
        `put`, the blob removed too."""
        try:
            room = staged.placed.info.hash not in self._records and self._room_for(staged.placed)
        except BaseException:  # a pending removal of the name that the disk refuses to finish
            self._discard(staged.tmp)
            raise
        if not room:
            self._discard(staged.tmp)
            return False
        return self._place(staged)

    def discard_staged(self, staged: StagedBlob) -> None:
        self._discard(staged.tmp)

    def _room_for(self, placed: DiskRecord) -> bool:
        if placed.info.hash in self._pending:  # its old blob must be gone before a new one takes the name
            self._finish(placed.info.hash)
        return self.used_bytes + self.staging_bytes + placed.blob_bytes <= self.budget

    def _place(self, staged: StagedBlob) -> bool:
        placed, tmp = staged.placed, staged.tmp
        info, size = placed.info, placed.blob_bytes
        if staged.digest != info.checksum:
            self._discard(tmp)
            self.checksum_failures += 1
            raise DataLoss(f"state {short(info.hash)} changed in the arena after commit; not written")
        try:
            self._io.rename(tmp, self._blob_path(info.hash))
            self._io.fsync_dir(self.blobs)
            self._commit(lambda txn: self._index_put(txn, placed))
        except _FAULTS as exc:  # never indexed: the blob goes (or waits for a retry, counted)
            self._discard(tmp)
            self._pending[info.hash] = placed
            self.used_bytes += size
            fault = self._failed("storing a blob", exc)
            self._try_finish(info.hash)
            raise fault from None
        self._records[info.hash] = placed
        self.used_bytes += size
        self._worked()
        return True

    def remove(self, hash: bytes) -> bool:
        """Drops a state: at once from what is served, and from the index and the files when both succeed.

        False if it was not on disk. A removal the disk refuses stays pending, its
        bytes counted, and is retried by ``retry`` (DiskFault is not raised: the
        failure is counted and logged here).
        """
        record = self._records.pop(hash, None)
        if record is None:
            return False
        self._pending[hash] = record
        self._try_finish(hash)
        return True

    def retry(self) -> None:
        """Finishes pending removals and namespace writes; checks the index (the store calls it every second)."""
        if not self.writable_now():
            return
        try:
            if (reason := self._index.check()) is not None:
                self._rebuild_index(reason)
            for h in list(self._pending):
                self._finish(h)
            for ns in list(self._unsaved):
                value = self._namespaces[ns]
                self._commit(lambda txn: txn.put(ns, value, db=self._index.namespaces))
                self._unsaved.discard(ns)
        except DiskFault:
            return
        except _FAULTS as exc:
            self._failed("retrying", exc)
            return
        self._worked()

    def save_namespace(self, namespace: bytes, value: bytes) -> None:
        """Persists a registration; when the disk fails it is kept here and written by a later ``retry``."""
        self._namespaces[namespace] = value
        try:
            self._commit(lambda txn: txn.put(namespace, value, db=self._index.namespaces))
        except _FAULTS as exc:
            self._unsaved.add(namespace)
            self._failed("saving a namespace", exc)
            return
        self._unsaved.discard(namespace)

    def load_namespaces(self) -> dict[bytes, bytes]:
        return dict(self._namespaces)

    # ------------------------------------------------------------ reads

    def read_into(self, hash: bytes, out: memoryview, progress: Callable[[int], None] | None = None) -> bool:
        """Reads a blob into ``out`` (exactly its size) and verifies it.

        False if the state is not on disk, or if the blob is missing, short or
        fails its checksum: then it is dropped (a checksum failure and a missing blob
        counted), and ``out`` holds garbage that must not be served. DiskFault if the
        file cannot be read (an I/O error): the state stays. ``progress(n)`` as the bytes land
        (BlobReader.read).
        """
        record = self._records.get(hash)
        if record is None:
            return False
        if len(out) != record.info.nbytes:
            raise ValueError(f"buffer of {len(out)} bytes for a {record.info.nbytes}-byte state: this is a bug")
        try:
            fd = os.open(self._blob_path(hash), os.O_RDONLY)
        except FileNotFoundError:
            self.blobs_missing += 1
            log.warning("blob %s is missing (deleted behind the tierstore's back); dropped from the index",
                        short(hash))
            self.remove(hash)
            return False
        except OSError as exc:
            raise self._failed("reading a blob", exc) from None
        try:
            if os.fstat(fd).st_size != record.file_size:
                return self._fail(hash, "has the wrong size")
            digest = self._reader.read(fd, record.data_offset, out, progress)
        except OSError as exc:
            raise self._failed("reading a blob", exc) from None
        finally:
            os.close(fd)
        if digest is None:
            return self._fail(hash, "is short")
        if digest != record.info.checksum:
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
        log.error("blob %s %s: dropped, not served", short(hash), why)
        self.remove(hash)
        return False

    # ------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Index == memory == files, page index matches, budget kept; raises AssertionError.

        Pending removals (a failing disk) may linger in the index and the files.
        """
        def read(txn: lmdb.Transaction) -> tuple[dict[bytes, DiskRecord], set[tuple[bytes, bytes]]]:
            stored = {bytes(k): DiskRecord.decode(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._index.states)}
            return stored, {(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._index.pages)}

        stored, pages = self._index_read(read)
        pending = set(self._pending)
        assert {h: r for h, r in stored.items() if h not in pending} == self._records, \
            "LMDB states differ from the in-memory index"
        want_pages = {(p, h) for h, r in stored.items() if r.info.sliceable for p in r.info.page_hashes}
        extra = {(p, h) for p, h in pages - want_pages if h not in pending}
        assert not extra and want_pages <= pages, f"page index differs: extra {extra}, missing {want_pages - pages}"
        files = {p.name for p in self.blobs.iterdir()}
        held = {h.hex() for h in self._records}
        assert held <= files and files - held <= {h.hex() for h in pending}, \
            f"blob files differ from the index: {files ^ held}"
        for h, r in self._records.items():
            st = (self.blobs / h.hex()).stat()
            assert st.st_size == r.file_size, f"blob {short(h)} has the wrong size"
            assert st.st_mode & 0o077 == 0, f"blob {short(h)} is readable by others"
        assert self.used_bytes == sum(r.blob_bytes for r in (*self._records.values(), *self._pending.values()))
        assert self.used_bytes <= self.budget, f"{self.used_bytes} bytes on disk, budget {self.budget}"

    def close(self) -> None:
        self._index.close()
        self._reader.close()

    # ------------------------------------------------------------ internals

    def _blob_path(self, hash: bytes) -> Path:
        return self.blobs / hash.hex()

    def _temp_path(self, hash: bytes, suffix: str) -> Path:
        return self.blobs / (hash.hex() + suffix)

    def _discard(self, path: Path) -> None:
        try:
            self._io.unlink(path)
        except OSError:
            pass  # a temp file: removed at the next start

    def _finish(self, hash: bytes) -> None:
        """Completes a pending removal: the index entry, then the file; DiskFault (still pending) if either fails."""
        record = self._pending[hash]
        try:
            self._commit(lambda txn: self._index_delete(txn, record.info))
            self._io.unlink(self._blob_path(hash))
        except _FAULTS as exc:
            raise self._failed("removing a blob", exc) from None
        del self._pending[hash]
        self.used_bytes -= record.blob_bytes

    def _try_finish(self, hash: bytes) -> None:
        if not self.writable_now():
            return  # counted as pending; retry() finishes it once the disk works again
        try:
            self._finish(hash)
        except DiskFault:
            return
        self._worked()

    def _commit(self, fn: Callable[[lmdb.Transaction], object]) -> None:
        try:
            self._io.commit(self._index, fn)
        except IndexDamaged as exc:  # truncated under us: rebuild it from memory, then write
            self._rebuild_index(str(exc))
            self._io.commit(self._index, fn)

    def _index_read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        try:
            return self._index.read(fn)
        except IndexDamaged as exc:
            self._rebuild_index(str(exc))
            return self._index.read(fn)

    def _index_put(self, txn: lmdb.Transaction, record: DiskRecord) -> None:
        txn.put(record.info.hash, record.encode(), db=self._index.states)
        if record.info.sliceable:
            for page in record.info.page_hashes:
                txn.put(page, record.info.hash, db=self._index.pages, dupdata=True)

    def _index_delete(self, txn: lmdb.Transaction, info: StateInfo) -> None:
        txn.delete(info.hash, db=self._index.states)
        if info.sliceable:
            for page in info.page_hashes:
                txn.delete(page, info.hash, db=self._index.pages)

    def _write_all(self, txn: lmdb.Transaction) -> None:
        for record in self._records.values():
            self._index_put(txn, record)
        for ns, value in self._namespaces.items():
            txn.put(ns, value, db=self._index.namespaces)

    # ------------------------------------------------------------ opening, reconcile, rebuild

    def _open_index(self) -> tuple[Index, dict[bytes, bytes], str]:
        """(index, its raw states, "" ) — or a fresh index and why the old one was moved aside."""
        path = self.path / "index"
        index: Index | None = None
        try:
            index = opened = Index(path, self._map_size)

            def read(txn: lmdb.Transaction) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
                return ({bytes(k): bytes(v) for k, v in txn.cursor(db=opened.states)},
                        {bytes(k): bytes(v) for k, v in txn.cursor(db=opened.namespaces)})

            stored, self._namespaces = opened.read(read)
            return opened, stored, ""
        except _DAMAGE as exc:
            if index is not None:
                index.close()
            reason = str(exc)
        aside = move_aside(path)
        return Index(path, self._map_size), {}, f"{reason}; moved to {aside.name}"

    def _reconcile(self, stored: dict[bytes, bytes]) -> ReconcileReport:
        """Makes the index and the files agree after any crash; loads the survivors."""
        temps = orphans = dropped = 0
        bad: list[tuple[bytes, StateInfo | None]] = []
        for h, raw in stored.items():
            try:
                record = DiskRecord.decode(h, raw)
            except (ValueError, struct.error) as exc:  # an unreadable entry: drop it
                log.warning("index entry %s is unreadable (%s); dropped", short(h), exc)
                bad.append((h, None))
                continue
            try:
                st = self._blob_path(h).stat()
            except FileNotFoundError:
                bad.append((h, record.info))  # no blob: the entry cannot be served
                continue
            if st.st_size != record.file_size:  # a torn one
                bad.append((h, record.info))
                continue
            if st.st_mode & 0o077:
                os.chmod(self._blob_path(h), 0o600)  # written before blobs were private
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
            for h, _ in bad:
                txn.delete(h, db=self._index.states)
                dropped += 1
            # Page entries whose state is gone (the dupsort db is rebuilt from what survived).
            cursor = txn.cursor(db=self._index.pages)
            for page, state in list(cursor):  # every (page, state) duplicate
                if bytes(state) not in self._records or not self._records[bytes(state)].info.sliceable:
                    txn.delete(bytes(page), bytes(state), db=self._index.pages)

        self._index.write(fix)
        self.used_bytes = sum(r.blob_bytes for r in self._records.values())
        report = ReconcileReport(temps, orphans, dropped, len(self._records))
        if temps or orphans or dropped:
            log.warning("kv-disk reconcile: %s", report)
        return report

    def _rebuild(self, reason: str) -> ReconcileReport:
        """A fresh index from the blob headers: what fits the budget, most recently used first."""
        temps = unreadable = over = 0
        found: list[tuple[DiskRecord, bytes]] = []
        for path in self.blobs.iterdir():
            if path.name.endswith(_TMP):
                path.unlink()
                temps += 1
                continue
            if not _is_hex_name(path.name):
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    found.append(read_header(fd, bytes.fromhex(path.name), os.fstat(fd).st_size))
                finally:
                    os.close(fd)
            except (BadBlob, OSError) as exc:
                log.warning("blob %s cannot describe itself (%s): removed", path.name[:8], exc)
                path.unlink(missing_ok=True)
                unreadable += 1
        found.sort(key=lambda f: (-f[0].last_used, f[0].info.hash))
        newest: dict[bytes, float] = {}
        for record, registration in found:
            if self.used_bytes + record.blob_bytes > self.budget:
                self._blob_path(record.info.hash).unlink(missing_ok=True)
                over += 1
                continue
            os.chmod(self._blob_path(record.info.hash), 0o600)
            self._records[record.info.hash] = record
            self.used_bytes += record.blob_bytes
            ns = record.info.namespace
            if registration and ns not in newest:  # the layout its newest state was written with
                newest[ns] = record.last_used
                self._namespaces[ns] = registration
        _fsync_dir(self.blobs)
        self._index.write(self._write_all)
        report = ReconcileReport(temps, over, 0, len(self._records), reason, unreadable)
        log.error("kv-disk index was unreadable (%s): rebuilt from %d blob headers (%d blobs without one removed, "
                  "%d over the budget removed)", reason, len(self._records), unreadable, over)
        return report

    def _rebuild_index(self, reason: str) -> None:
        """The index went bad while serving: move it aside and write a new one from memory.

        If the disk refuses (OSError), the old index stays closed and the next use tries again.
        """
        path = self._index.path
        self._index.close()
        aside = move_aside(path).name if (path / "data.mdb").exists() else "nowhere (it was gone)"
        fresh = Index(path, self._map_size)
        self._index = fresh
        fresh.write(self._write_all)
        log.error("kv-disk index became unreadable (%s): moved to %s and rebuilt (%d states)", reason, aside,
                  len(self._records))


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


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
