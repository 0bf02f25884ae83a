"""KV-disk: blob files + LMDB index, crash windows, checksums, the hard budget, the blob format, modes.

Faults (a failing or truncated disk) are in test_tierstore_faults.py.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from ignis.v1 import common_pb2
from tierstore.blob import BLOB_MAGIC
from tierstore.disk import DiskIO, DiskRecord, DiskTier
from tierstore.errors import DataLoss
from tierstore.index import Index
from tierstore.state import StateHash, StateInfo, checksum

NS = bytes(range(16))
K = 4096


def make_hash(i: int) -> StateHash:
    return StateHash(i.to_bytes(2, "big") * 8)


def make_data(i: int, n: int = 10_000) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def make_record(i: int, data: bytes, *, pages: int = 2, sliceable: bool = False, used: float = 1.0) -> DiskRecord:
    info = StateInfo(make_hash(i), NS, pages * 16, common_pb2.REUSE_KIND_CHECKPOINT,
                     common_pb2.REQUEST_CLASS_INTERACTIVE, tuple(make_hash(1000 * i + p) for p in range(pages)),
                     checksum(data), len(data), 16, sliceable, engine_tag=b"tag-%d" % i)
    return DiskRecord(info, used)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_put_read_and_reopen(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    data = make_data(1)
    rec = make_record(1, data)
    assert disk.put(rec, data)
    placed = disk.get(make_hash(1))
    assert placed is not None and placed.info == rec.info and placed.data_offset > 0
    raw = (tmp_path / "blobs" / make_hash(1).hex()).read_bytes()  # named by the hex of its hash
    assert raw.startswith(BLOB_MAGIC) and raw[placed.data_offset:] == data  # a header, then the bytes
    assert disk.used_bytes == disk.cost(rec.info) == placed.blob_bytes == 3 * K  # the header fits the last block
    assert disk.read(make_hash(1)) == data
    disk.check_integrity()
    disk.close()

    again = DiskTier(tmp_path, 1 << 20)  # survivors are served after a restart
    assert again.get(make_hash(1)) == placed and placed.info.engine_tag == b"tag-1"
    assert again.read(make_hash(1)) == data
    assert again.last_reconcile.states == 1 and again.last_reconcile.entries_dropped == 0
    again.check_integrity()
    assert again.remove(make_hash(1)) and not again.remove(make_hash(1))
    assert again.used_bytes == 0 and not (tmp_path / "blobs" / make_hash(1).hex()).exists()
    again.check_integrity()
    again.close()


def test_page_index_maps_every_page_of_sliceable_states(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    a, b = make_data(1), make_data(2)
    disk.put(make_record(1, a, pages=3, sliceable=True), a)
    disk.put(make_record(2, b, pages=3, sliceable=False), b)
    assert [disk.states_with_pages([make_hash(1000 + p)])[0] for p in range(3)] == [[make_hash(1)]] * 3
    assert disk.states_with_pages([make_hash(2000)])[0] == []  # a checkpoint of a hybrid model: exact name only
    disk.check_integrity()
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert again.states_with_pages([make_hash(1002)])[0] == [make_hash(1)]
    again.remove(make_hash(1))
    assert again.states_with_pages([make_hash(1002)])[0] == []
    again.check_integrity()
    again.close()


def test_budget_is_hard(tmp_path: Path) -> None:
    d1, d2 = make_data(1, 2 * K + 1), make_data(2, K)  # with their headers: 3 blocks + 2 blocks
    r1, r2 = make_record(1, d1), make_record(2, d2)
    disk = DiskTier(tmp_path, 5 * K)
    assert (disk.cost(r1.info), disk.cost(r2.info)) == (3 * K, 2 * K)
    assert disk.put(r1, d1)
    assert disk.put(r2, d2)
    d3 = make_data(3, 1)
    assert disk.put(make_record(3, d3), d3) is False  # one more byte (and its header) is one block too many
    assert disk.used_bytes == 5 * K and not (tmp_path / "blobs" / make_hash(3).hex()).exists()
    disk.check_integrity()
    disk.close()


def test_data_that_does_not_match_its_checksum_is_never_written(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    data = make_data(1)
    with pytest.raises(DataLoss):
        disk.put(make_record(1, data), data[:-1] + bytes([data[-1] ^ 1]))
    assert disk.checksum_failures == 1 and make_hash(1) not in disk
    assert list((tmp_path / "blobs").iterdir()) == []
    disk.check_integrity()
    disk.close()


def test_a_flipped_byte_is_dropped_counted_and_never_served(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    data = make_data(1)
    disk.put(make_record(1, data, sliceable=True), data)
    blob = tmp_path / "blobs" / make_hash(1).hex()
    raw = bytearray(blob.read_bytes())
    raw[1234] ^= 0x01
    blob.write_bytes(raw)
    assert disk.read(make_hash(1)) is None
    assert disk.checksum_failures == 1
    assert make_hash(1) not in disk and not blob.exists() and disk.used_bytes == 0
    assert disk.states_with_pages([make_hash(1000)])[0] == []
    assert disk.read(make_hash(1)) is None and disk.checksum_failures == 1  # not found, not counted twice
    disk.check_integrity()
    disk.close()


def test_start_removes_temp_files_and_orphans_and_drops_entries_without_blobs(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    for i in (1, 2, 3):
        d = make_data(i)
        disk.put(make_record(i, d, sliceable=True), d)
    disk.close()
    blobs = tmp_path / "blobs"
    # Crash before the rename: a temp file. Crash after the rename, before the LMDB commit: an orphan.
    (blobs / (make_hash(7).hex() + ".tmp")).write_bytes(b"torn")
    (blobs / make_hash(8).hex()).write_bytes(make_data(8))
    (blobs / make_hash(2).hex()).unlink()  # an entry whose blob is gone
    with (blobs / make_hash(3).hex()).open("r+b") as f:  # a torn (short) blob
        f.truncate(100)
    (blobs / "README").write_text("not ours")  # foreign files are left alone... and flagged by check_integrity

    again = DiskTier(tmp_path, 1 << 20)
    report = again.last_reconcile
    assert (report.temp_files_removed, report.orphan_files_removed, report.entries_dropped, report.states) \
        == (1, 2, 2, 1)  # the torn blob of 3 is an orphan once its entry is dropped
    assert sorted(p.name for p in blobs.iterdir()) == sorted([make_hash(1).hex(), "README"])
    assert again.read(make_hash(1)) == make_data(1)
    assert again.states_with_pages([make_hash(2000)])[0] == [] and again.states_with_pages([make_hash(1000)])[0] == [make_hash(1)]
    (blobs / "README").unlink()
    again.check_integrity()
    assert again.used_bytes == again.cost(make_record(1, make_data(1)).info)
    again.close()


def test_namespaces_persist(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    disk.save_namespace(NS, b'{"x": 1}')
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert again.load_namespaces() == {NS: b'{"x": 1}'}
    again.close()


def test_writes_fsync_before_they_become_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order of a crash-safe write: data fsync, rename, directory fsync, then the index."""
    events: list[str] = []

    class Recording(DiskIO):
        def commit(self, index: Index, fn: Callable[[lmdb.Transaction], object]) -> None:
            events.append("index")
            super().commit(index, fn)

    disk = DiskTier(tmp_path, 1 << 20, io=Recording())
    events.clear()  # the start-up reconcile
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    def rename(a: str, b: str) -> None:
        events.append("rename")
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    data = make_data(1)
    disk.put(make_record(1, data), data)
    assert events == ["fsync", "rename", "fsync", "index"]
    disk.close()


def test_blobs_and_index_are_private_and_old_modes_are_fixed_at_start(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a permissive umask: the modes must not depend on it
    try:
        disk = DiskTier(tmp_path / "kv", 1 << 20)
        data = make_data(1)
        disk.put(make_record(1, data), data)
        disk.close()
    finally:
        os.umask(old)
    kv = tmp_path / "kv"
    blob = kv / "blobs" / make_hash(1).hex()
    assert [mode(p) for p in (kv, kv / "blobs", kv / "index")] == [0o700] * 3
    assert [mode(p) for p in (blob, kv / "index" / "data.mdb", kv / "index" / "lock.mdb")] == [0o600] * 3
    # What an older tierstore left: 0755 folders, 0644 files.
    for p in (kv, kv / "blobs", kv / "index"):
        os.chmod(p, 0o755)
    for p in (blob, kv / "index" / "data.mdb"):
        os.chmod(p, 0o644)
    again = DiskTier(kv, 1 << 20)
    assert [mode(p) for p in (kv, kv / "blobs", kv / "index")] == [0o700] * 3
    assert [mode(p) for p in (blob, kv / "index" / "data.mdb")] == [0o600] * 2
    again.check_integrity()
    again.close()


def test_format_1_blobs_stay_readable_and_are_never_taken_for_format_2(tmp_path: Path) -> None:
    """A blob written before blobs had headers: its index record says so (version 1)."""
    data = BLOB_MAGIC + make_data(1)  # even state bytes that begin like a header
    rec = make_record(1, data)
    assert rec.data_offset == 0 and rec.encode()[4:6] == (1).to_bytes(2, "little")
    disk = DiskTier(tmp_path, 1 << 20)
    disk.close()
    (tmp_path / "blobs" / make_hash(1).hex()).write_bytes(data)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(make_hash(1), rec.encode(), db=env.open_db(b"states", txn=txn))
    env.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert again.get(make_hash(1)) == rec and again.read(make_hash(1)) == data
    assert again.used_bytes == 3 * K
    again.check_integrity()
    again.close()
