"""Faults in the lower tiers degrade and recover: a truncated index, a read-only or full disk, blobs
deleted behind the store's back, an arena file truncated or deleted.

The faults are real where this machine allows: real truncated files, a blob folder whose write
permission is taken away (the kernel refuses every write in it; nothing outside the test's folder
changes, so nothing is left behind however the test ends), a small tmpfs (needs mount privileges:
that test skips without them). Two seams stand in where no filesystem can fail that way: DiskIO
(tierstore/disk.py), through which every disk write goes, fails only the LMDB commit; and a store
call raising Unavailable shows the engine's client what a failing disk read answers.
No sleeps: a fake clock moves past back-offs, a poll waits for what a process does on its own.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import lmdb
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.tiers.client import TierClient
from ignis.v1 import common_pb2, tierstore_pb2
from services import RunningService, start_tierstore
from tierstore.client import TierStoreClient
from tierstore.disk import DiskIO, DiskRecord, DiskTier
from tierstore.errors import DataLoss, Unavailable
from tierstore.index import Index
from tierstore.registry import Registration
from tierstore.server import TierStoreService, create_server
from tierstore.state import StateHash, StateInfo, checksum
from tierstore.store import DISK, RAM, StoreConfig, TierStore

KiB = 1024
SIZE = 3 * 4096
SLOT = SIZE + 4096  # a state on disk: its bytes and its header block
NS = b"N" * 16
AGENT = common_pb2.REQUEST_CLASS_AGENT
LAYOUT = '{"engine": "layout"}'


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def h(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def make_data(name: str, n: int = SIZE) -> bytes:
    return np.random.default_rng(int.from_bytes(h(name)[:8], "big")).bytes(n)


def make_meta(name: str, n: int = SIZE) -> tierstore_pb2.StateMetadata:
    return tierstore_pb2.StateMetadata(namespace=NS, tokens=16, kind=common_pb2.REUSE_KIND_CHECKPOINT,
                                       request_class=AGENT, page_hashes=[h(name)], nbytes=n,  # type: ignore[arg-type]
                                       engine_tag=b"tag:" + h(name))


def make_store(tmp_path: Path, clock: Clock, *, ram: int = 2, disk: int = 10, io: DiskIO | None = None) -> TierStore:
    store = TierStore(StoreConfig(ram * SIZE, str(tmp_path / "kv"), disk * SLOT, interactive_ttl=0,
                                  lease_seconds=30, reservation_seconds=60), clock=clock, disk_io=io)
    store.register(Registration(NS, "m", 16, LAYOUT, 1024, 0))
    return store


def put(store: TierStore, name: str) -> bytes:
    data = make_data(name)
    extent = store.reserve(h(name), len(data), AGENT)
    assert extent is not None, f"no room for {name}"
    store.arena.slice(extent.offset, extent.length)[:] = data
    store.commit(h(name), make_meta(name))
    return data


def where(store: TierStore) -> dict[str, str]:
    out = {}
    for key, state in store._states.items():
        tiers = (["ram"] if state.extent is not None else []) + (["disk"] if store._disk and key in store._disk else [])
        out[key.rstrip(b".").decode()] = "+".join(tiers)
    return out


def read_back(store: TierStore, name: str) -> tuple[bytes, int]:
    lease = store.acquire(h(name))
    assert lease is not None
    data = bytes(store.arena.slice(lease.extent.offset, lease.extent.length))
    store.release(lease.lease_id)
    return data, lease.from_tier


def disk_errors_logged(caplog: pytest.LogCaptureFixture) -> int:
    return len([r for r in caplog.records if r.getMessage().startswith("kv-disk ") and "failed" in r.getMessage()])


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=10).status)


def poll(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------- real filesystems that fail

def _can_mount() -> bool:
    probe = Path(f"/tmp/ignis-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    except OSError:
        return False
    finally:
        probe.rmdir()


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs mount privileges (a tmpfs)")

# Root passes permission checks by its DAC capabilities (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH). A store
# of the test's own gives them up, so that a folder without write permission refuses it as it refuses any
# user: in this process, the calling thread for a block (capabilities are per thread; nothing else changes
# and a process that ends takes them along); a store process is started without them (setpriv).
_DAC_CAPS = (1 << 1) | (1 << 2)
_CAPS_V3 = 0x20080522
_SETPRIV = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _thread_caps(effective: int | None = None) -> int:
    """The calling thread's effective capabilities (the low word); with `effective`, set them first."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(_CAPS_V3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    if effective is not None:
        data[0].effective = effective
        if libc.capset(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    return int(data[0].effective)


def _root_can_give_up_dac() -> bool:
    if os.geteuid() != 0:
        return True  # not needed
    try:
        _thread_caps()
    except (OSError, AttributeError):
        return False
    try:
        return subprocess.run([*_SETPRIV, "true"], capture_output=True).returncode == 0
    except OSError:  # no setpriv
        return False


needs_read_only = pytest.mark.skipif(not _root_can_give_up_dac(),
                                     reason="root here cannot give up its DAC capabilities (capset, setpriv)")


@contextmanager
def read_only(folder: Path, this_thread_writes: bool = True) -> Iterator[None]:
    """``folder`` refuses every write until the block ends: its write permission is taken away (the kernel
    answers EACCES, as a read-only mount answers EROFS; reads go on). As root, the calling thread gives up
    its DAC capabilities meanwhile when `this_thread_writes` (an in-process store); a store process of the
    test's was started without them (`store_without_dac`)."""
    mode = folder.stat().st_mode & 0o7777
    folder.chmod(mode & ~0o222)
    caps = _thread_caps() if this_thread_writes and os.geteuid() == 0 else None
    try:
        if caps is not None:
            _thread_caps(caps & ~_DAC_CAPS)
        yield
    finally:
        if caps is not None:
            _thread_caps(caps)
        folder.chmod(mode)


def store_without_dac(workdir: Path, args: list[str], metrics: bool = False) -> RunningService:
    """A tierstore process that permissions bind (as root: without its DAC capabilities)."""
    return start_tierstore(workdir, args, metrics=metrics, prefix=_SETPRIV if os.geteuid() == 0 else [])


@contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


class FailingCommits(DiskIO):
    """The index refuses to commit while ``failing`` (what LMDB says on a read-only or full disk)."""

    def __init__(self) -> None:
        self.failing = False

    def commit(self, index: Index, fn: Callable[[lmdb.Transaction], object]) -> None:
        if self.failing:
            raise lmdb.Error("mdb_txn_commit: Read-only file system")
        super().commit(index, fn)


# ---------------------------------------------------------------- a truncated index

def test_a_truncated_index_is_moved_aside_and_rebuilt_from_the_blobs(tmp_path: Path) -> None:
    """A real index file cut short (it used to be SIGBUS at the first read, then InvalidError at every
    start): the tierstore starts, says so once, and serves every state from the blob headers."""
    args = ["--kv-host-pool-bytes", "256KiB", "--kv-disk-path", str(tmp_path / "kv"), "--kv-disk-bytes", "8MiB"]
    store = start_tierstore(tmp_path / "ts", args)
    with TierStoreClient(store.address) as c:
        c.register(NS, page_size=16, layout=LAYOUT)
        for i in range(8):  # 8 x 64 KiB through a 256 KiB arena
            c.store(h(f"s{i}"), make_data(f"s{i}", 64 * KiB), make_meta(f"s{i}", 64 * KiB))
        assert c.stats().states_disk >= 4
    assert store.stop() == 0
    # Every blob: the states moved down, and those in RAM with their copy ahead of need (kv_disk.copy_ahead).
    on_disk = sum(1 for p in (tmp_path / "kv" / "blobs").iterdir() if not p.name.endswith(".tmp"))
    data_file = tmp_path / "kv" / "index" / "data.mdb"
    size = data_file.stat().st_size
    assert size > 3 * 4096
    os.truncate(data_file, 2 * 4096)  # its meta pages survive; the tree it points at does not

    store = start_tierstore(tmp_path / "ts", args)
    try:
        log = store.log()
        assert log.count("kv-disk index was unreadable") == 1 and "moved to index.damaged-" in log
        [aside] = (tmp_path / "kv").glob("index.damaged-*")
        assert (aside / "data.mdb").stat().st_size == 2 * 4096  # kept for the operator, not deleted
        with TierStoreClient(store.address) as c:
            assert c.stats().states_disk == on_disk
            c.register(NS, page_size=16, layout=LAYOUT)  # the layout it was written with: accepted
            lease = c.acquire(h("s0"))
            assert lease.from_tier == DISK and bytes(c.read(lease.extent)) == make_data("s0", 64 * KiB)
            assert lease.metadata.engine_tag == b"tag:" + h("s0")
            c.release(lease.lease_id)
            # The namespace came back from the blob headers too: another layout is still refused.
            with pytest.raises(grpc.RpcError) as refused:
                c.register(NS, page_size=16, layout="another")
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        assert store.stop() == 0, store.log()


def test_an_index_truncated_to_nothing_is_rebuilt_not_taken_for_a_new_one(tmp_path: Path) -> None:
    """LMDB reads an empty file as a new index: without the check every blob would be an orphan."""
    disk = DiskTier(tmp_path, 1 << 20)
    data = make_data("a")
    rec = DiskRecord(StateInfo(StateHash(h("a")), NS, 16, common_pb2.REUSE_KIND_CHECKPOINT, AGENT, (h("a"),),
                               checksum(data), len(data), 16, False, b"tag"), 1.0)
    disk.put(rec, data, b'{"layout": 1}')
    disk.close()
    os.truncate(tmp_path / "index" / "data.mdb", 0)
    again = DiskTier(tmp_path, 1 << 20)
    assert again.last_reconcile.rebuilt and "truncated to 0 bytes" in again.last_reconcile.rebuilt
    assert again.read(h("a")) == data and again.load_namespaces() == {NS: b'{"layout": 1}'}
    again.check_integrity()
    again.close()


def test_an_index_truncated_while_serving_is_rebuilt_from_memory(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    for name in ("a", "b"):
        data = make_data(name)
        disk.put(DiskRecord(StateInfo(StateHash(h(name)), NS, 16, common_pb2.REUSE_KIND_PAGES, AGENT, (h(name),),
                                      checksum(data), len(data), 16, True), 1.0), data)
    os.truncate(tmp_path / "index" / "data.mdb", 2 * 4096)  # under the open index
    assert disk.states_with_pages([h("a")])[0] == [h("a")]  # the next read finds it short: no SIGBUS, a new index
    assert len(list(tmp_path.glob("index.damaged-*"))) == 1
    disk.check_integrity()
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert len(again) == 2 and not again.last_reconcile.rebuilt
    again.close()


# ---------------------------------------------------------------- a disk that fails

@needs_read_only
def test_a_read_only_disk_keeps_ram_serving_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ignis.tierstore")
    clock = Clock()
    store = make_store(tmp_path, clock, ram=2)
    try:
        put(store, "a")
        clock.t += 1
        put(store, "b")
        clock.t += 1
        put(store, "c")  # a moves down
        assert where(store) == {"a": "disk", "b": "ram", "c": "ram"}
        with read_only(tmp_path / "kv" / "blobs"):
            for name in ("d", "e", "f"):  # each one pushes the oldest RAM state down: the disk refuses it
                clock.t += 1
                put(store, name)
            assert where(store) == {"a": "disk", "e": "ram", "f": "ram"}  # dropped, as without a disk tier
            s = store.stats()
            assert not s.disk_usable and s.disk_errors == 1 and s.evictions == 3
            assert disk_errors_logged(caplog) == 1  # once, not per call; and retried only after a while
            assert read_back(store, "f") == (make_data("f"), RAM)  # RAM restores keep working
            assert read_back(store, "a") == (make_data("a"), DISK)  # so do disk reads on a read-only disk
            assert where(store) == {"a": "ram+disk", "f": "ram"}  # e made room: it could not move down
            assert [hit.tier for hit in store.match_anchored(NS, [h("a")], anchored=False)[0]] == [RAM]
            used = s.disk_bytes_used
            store.drop(h("a"))  # its unlink is refused: the removal waits, its bytes still counted
            assert h("a") not in store._disk and store.stats().disk_bytes_used == used  # type: ignore[operator]
            store.check_integrity()
        clock.t += 10  # past the retry back-off
        store.expire()  # what the server does every second: the pending removal completes
        s = store.stats()
        assert s.disk_usable and s.disk_bytes_used == 0 and not (tmp_path / "kv" / "blobs" / h("a").hex()).exists()
        assert [r.getMessage() for r in caplog.records if "kv-disk works again" in r.getMessage()]
        for name in ("g", "h"):
            clock.t += 1
            put(store, name)
        assert where(store) == {"f": "disk", "g": "ram", "h": "ram"}  # spills reach the disk again
        store.check_integrity()
    finally:
        store.close()


@needs_read_only
def test_a_read_only_disk_never_turns_a_ram_restore_into_an_internal_error(tmp_path: Path) -> None:
    args = ["--kv-host-pool-bytes", "256KiB", "--kv-disk-path", str(tmp_path / "kv"), "--kv-disk-bytes", "8MiB"]
    store = store_without_dac(tmp_path / "ts", args, metrics=True)
    try:
        with TierStoreClient(store.address) as c:
            c.register(NS, page_size=16, layout=LAYOUT)
            c.store(h("s0"), make_data("s0", 64 * KiB), make_meta("s0", 64 * KiB))
            with read_only(tmp_path / "kv" / "blobs", this_thread_writes=False):
                for i in range(1, 12):
                    c.store(h(f"s{i}"), make_data(f"s{i}", 64 * KiB), make_meta(f"s{i}", 64 * KiB))
                    lease = c.acquire(h(f"s{i}"))  # a RAM restore, while spills fail underneath
                    assert bytes(c.read(lease.extent)) == make_data(f"s{i}", 64 * KiB)
                    c.release(lease.lease_id)
                stats = c.stats()
                assert not stats.disk_usable and stats.disk_errors >= 1 and stats.arena_usable
                text = httpx.get(f"http://127.0.0.1:{store.extra['metrics']}/metrics").text
                poll(lambda: health(store.address, "ignis.v1.TierStore.disk") == NOT_SERVING, "disk health")
                assert health(store.address, "") == health(store.address, "ignis.v1.TierStore.ram") == SERVING
                assert 'ignis_kv_tier_usable{tier="disk"} 0.0' in text
                assert 'ignis_kv_tier_usable{tier="ram"} 1.0' in text
                assert f"ignis_kv_disk_errors_total {float(stats.disk_errors)}" in text
    finally:
        assert store.stop() == 0
    log = store.log()
    assert "Traceback" not in log and log.count("kv-disk storing a blob failed") + \
        log.count("kv-disk writing a blob failed") == 1


@needs_mount
def test_a_full_disk_keeps_ram_serving_and_leaks_no_budget(tmp_path: Path) -> None:
    clock = Clock()
    with small_tmpfs(tmp_path / "kv", "256k"):
        store = make_store(tmp_path, clock, ram=2, disk=40)  # a budget far above what the filesystem holds
        try:
            for i in range(30):
                clock.t += 10  # each spill may retry the disk
                put(store, f"s{i}")
            s = store.stats()
            assert s.disk_errors >= 1 and s.disk_bytes_used < 256 * KiB
            assert read_back(store, "s29") == (make_data("s29"), RAM)
            assert not list((tmp_path / "kv" / "blobs").glob("*.tmp"))  # a failed write leaves no temp file
            store.check_integrity()  # used bytes == what the blobs on disk hold
            for key in [k for k, st in list(store._states.items()) if st.extent is None]:
                store.drop(key)  # room again
            clock.t += 10
            store.expire()
            for i in range(30, 33):
                clock.t += 1
                put(store, f"s{i}")
            assert store.stats().disk_usable and where(store)[f"s{31}"] in ("disk", "ram")
            store.check_integrity()
        finally:
            store.close()


def test_a_removal_the_index_refuses_keeps_its_bytes_counted_until_it_completes(tmp_path: Path) -> None:
    """The old removal forgot the record before the LMDB delete: a failed delete leaked its budget for good."""
    io = FailingCommits()
    clock = Clock()
    data = make_data("a")
    info = StateInfo(StateHash(h("a")), NS, 16, common_pb2.REUSE_KIND_CHECKPOINT, AGENT, (h("a"),),
                     checksum(data), len(data), 16, False)
    disk = DiskTier(tmp_path, SLOT, io=io, clock=clock)  # room for exactly one state
    assert disk.put(DiskRecord(info, 1.0), data)
    io.failing = True
    assert disk.remove(h("a"))
    assert h("a") not in disk and disk.read(h("a")) is None  # never served again...
    assert disk.used_bytes == SLOT and not disk.usable and disk.errors == 1  # ...but its room is not free yet
    assert (tmp_path / "blobs" / h("a").hex()).exists()
    disk.check_integrity()
    other = make_data("b")
    b = DiskRecord(StateInfo(StateHash(h("b")), NS, 16, common_pb2.REUSE_KIND_CHECKPOINT, AGENT, (h("b"),),
                             checksum(other), len(other), 16, False), 2.0)
    assert disk.put(b, other) is False  # no room: the budget is still held honestly
    disk.retry()  # inside the back-off: not even tried
    assert disk.errors == 1
    io.failing = False
    clock.t += 10
    disk.retry()
    assert disk.usable and disk.used_bytes == 0 and not (tmp_path / "blobs" / h("a").hex()).exists()
    assert disk.put(b, other)  # the room came back
    disk.check_integrity()
    disk.close()
    again = DiskTier(tmp_path, SLOT)
    assert len(again) == 1 and h("b") in again
    again.close()


def test_a_write_the_index_refuses_stores_nothing_and_frees_its_room(tmp_path: Path) -> None:
    io = FailingCommits()
    clock = Clock()
    store = make_store(tmp_path, clock, ram=1, io=io)
    try:
        put(store, "a")
        io.failing = True
        clock.t += 1
        put(store, "b")  # a cannot move down (the index refuses): dropped, b stored
        assert where(store) == {"b": "ram"} and store.stats().disk_errors == 1
        assert store.stats().disk_bytes_used == SLOT  # the renamed blob awaits its removal, counted
        store.check_integrity()
        io.failing = False
        clock.t += 10
        store.expire()
        assert store.stats().disk_bytes_used == 0 and list((tmp_path / "kv" / "blobs").iterdir()) == []
        store.check_integrity()
    finally:
        store.close()


def test_a_blob_deleted_behind_the_stores_back_is_counted_and_its_bytes_reconciled(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock, ram=1)
    try:
        put(store, "a")
        clock.t += 1
        put(store, "b")
        assert where(store)["a"] == "disk" and store.stats().disk_bytes_used == SLOT
        (tmp_path / "kv" / "blobs" / h("a").hex()).unlink()
        with pytest.raises(DataLoss, match="missing"):
            store.acquire(h("a"))
        s = store.stats()
        # a's record and bytes are gone; b moved down to make room for the restore that then found nothing.
        assert (s.blobs_missing, s.disk_bytes_used, s.states_disk, s.checksum_failures) == (1, SLOT, 1, 0)
        assert where(store) == {"b": "disk"}
        store.check_integrity()
    finally:
        store.close()


def test_a_failing_disk_read_is_unavailable_for_that_call_not_the_store_down(tmp_path: Path) -> None:
    """The store answers UNAVAILABLE with `ignis-tier-fault: disk`; the engine's client counts a miss and
    keeps the store up (a plain UNAVAILABLE would make it device-only for its back-off)."""
    clock = Clock()
    store = make_store(tmp_path, clock)

    def failing_acquire(hash: bytes, lease_seconds: float = 0.0) -> object:
        raise Unavailable("disk", "kv-disk cannot read it now (EIO); it stays stored")

    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()
    socket = tmp_path / "ts.sock"

    def serve() -> None:  # the real servicer, in a loop of its own
        async def main() -> None:
            server, _, _ = create_server(TierStoreService(store), f"unix:{socket}")
            await server.start()
            started.set()
            await stop.wait()
            await server.stop(0)
        loop.run_until_complete(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    client = TierClient(f"unix:{socket}", model="m", page_size=16, layout=LAYOUT, kv_bytes_per_token=1024,
                        fixed_state_bytes=0, timeout=10.0, clock=Clock())
    try:
        assert client.ensure(NS)
        store.acquire = failing_acquire  # type: ignore[method-assign]
        assert client.acquire(h("a")) is None
        assert client.last_code == grpc.StatusCode.UNAVAILABLE and client.up and client.usable
        assert client.unavailable_events == 0 and client.errors == 1
    finally:
        client.close()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        assert not thread.is_alive()
        loop.close()
        store.close()


# ---------------------------------------------------------------- the arena file

@pytest.mark.parametrize("fault", ["truncated", "deleted"])
def test_a_broken_arena_is_recreated_under_a_new_instance_disk_states_survive(tmp_path: Path, fault: str) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock, ram=3)
    try:
        for name in ("a", "b", "c", "d"):  # a moves down
            clock.t += 1
            put(store, name)
        clock.t += 1
        assert read_back(store, "a") == (make_data("a"), DISK)  # back in RAM, its disk copy kept; b moves down
        assert where(store) == {"a": "ram+disk", "b": "disk", "c": "ram", "d": "ram"}
        old_path, old_id = store.arena.path, store.instance_id
        lease = store.acquire(h("c"))
        assert lease is not None
        if fault == "truncated":
            os.truncate(old_path, 4096)  # a copy into the rest would be SIGBUS
        else:
            old_path.unlink()  # an engine mapping it again by path would find nothing
        extent = store.reserve(h("e"), SIZE, AGENT)  # checked before an extent is handed out
        assert extent is not None and store.instance_id != old_id and store.arena.path != old_path
        assert not old_path.exists() and store.arena.path.exists()
        s = store.stats()
        assert (s.arena_recreations, s.ram_states_lost, s.leases_active, s.arena_usable) == (1, 2, 0, True)
        assert s.instance_id == store.instance_id and s.arena_path == str(store.arena.path)
        assert where(store) == {"a": "disk", "b": "disk"}  # c and d lived only in the old arena
        with pytest.raises(Exception, match="no lease"):
            store.release(lease.lease_id)  # void with its arena
        store.arena.slice(extent.offset, SIZE)[:] = make_data("e")
        store.commit(h("e"), make_meta("e"))
        assert read_back(store, "a") == (make_data("a"), DISK)
        assert read_back(store, "b") == (make_data("b"), DISK)
        store.check_integrity()
    finally:
        store.close()


def test_the_sweep_recreates_a_broken_arena_without_a_call(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock)
    try:
        put(store, "a")
        old_id = store.instance_id
        store.arena.path.unlink()
        store.expire()  # the server's once-a-second sweep
        assert store.instance_id != old_id and store.stats().ram_states_lost == 1
        store.check_integrity()
    finally:
        store.close()


def _write_state(client: TierClient, name: str) -> None:
    """The engine's spill path: Reserve, copy into its own mapping, Commit."""
    data = make_data(name, 64 * KiB)
    reply = client.reserve(h(name), len(data), AGENT)
    assert reply is not None and client.same_instance(reply.instance_id) and client.arena is not None
    client.arena_bytes(reply.extent.offset, len(data))[:] = data
    assert client.commit(h(name), make_meta(name, len(data)))


@contextmanager
def engine_and_store(tmp_path: Path, **client: object) -> Iterator[tuple[RunningService, TierClient, TierStoreClient]]:
    """A tierstore (1 MiB arena, 8 MiB disk), the engine's tier client of it (`client`: its keyword arguments
    over the defaults) and an admin client; all closed after."""
    store: RunningService = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", "1MiB", "--kv-disk-path",
                                                              str(tmp_path / "kv"), "--kv-disk-bytes", "8MiB"])
    client = TierClient(store.address, **{"model": "m", "page_size": 16, "layout": LAYOUT,  # type: ignore[arg-type]
                                          "kv_bytes_per_token": 1024, "fixed_state_bytes": 0, "timeout": 10.0,
                                          "clock": Clock(), **client})
    admin = TierStoreClient(store.address)
    try:
        yield store, client, admin
    finally:
        admin.close()
        client.close()
        assert store.stop() == 0, store.log()


@pytest.mark.parametrize("fault", ["deleted", "truncated"])
def test_the_engine_follows_a_recreated_arena_by_instance_without_a_restart(
        tmp_path: Path, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    """It used to map the old path again after a stall and run device-only for good, reported healthy."""
    caplog.set_level(logging.WARNING, logger="ignis.engine.tiers")
    with engine_and_store(tmp_path) as (store, client, admin):
        assert client.ensure(NS) and client.usable
        _write_state(client, "a")
        first = admin.stats()
        assert first.instance_id == client.instance_id
        if fault == "deleted":  # the store's once-a-second sweep sees it; the engine learns it from a reply
            os.unlink(first.arena_path)
            poll(lambda: admin.stats().instance_id != first.instance_id, "the store to recreate its arena")
            client.match(NS, [h("a")], None)  # the reply names the new instance
            assert not client.same_instance(admin.stats().instance_id)
        else:  # the engine sees it first, before it copies anything: a truncated mapping is SIGBUS
            os.truncate(first.arena_path, 4096)
            assert not client.usable and "truncated" in (client.unusable_reason or "")
            assert [r for r in caplog.records if "truncated" in r.getMessage()] == []  # seen, not yet acted on
        assert client.ensure(NS)  # registers, and maps the arena of the instance that answered
        second = admin.stats()
        assert second.arena_recreations == 1 and second.arena_path != first.arena_path
        assert client.usable and client.instance_id == second.instance_id != first.instance_id
        if fault == "truncated":
            assert len([r for r in caplog.records if "truncated" in r.getMessage()]) == 1
        _write_state(client, "b")  # into the new arena
        lease = client.acquire(h("b"))
        assert lease is not None and lease.instance_id == second.instance_id
        assert bytes(client.arena_bytes(lease.extent.offset, 64 * KiB)) == make_data("b", 64 * KiB)
        client.release(lease.lease_id)
        assert "recreated as" in store.log()


def test_losing_a_deleted_arena_keeps_a_copy_in_flight_mapped_until_it_ends(tmp_path: Path) -> None:
    """A copy on another thread holds a view of the arena while `ensure` finds the file deleted: the mapping
    must outlive the view (mmap.close() unmapped it under the copy: bench.chaos saw the SIGSEGV, and a new
    arena mapped at the same addresses took the copy's bytes), and go with its last reference (no deleted
    arena stays mapped)."""
    with engine_and_store(tmp_path) as (store, client, admin):
        assert client.ensure(NS) and client.arena is not None
        path = admin.stats().arena_path
        in_flight = client.arena[4096:4096 + 64 * KiB]  # what a copy worker reads or writes right now
        os.unlink(path)
        client.ensure(NS)  # sees the deleted file: loses (and replaces) the mapping
        if client.arena is not None:  # the new arena must not lie where the old view points (the old
            start = client.arena.data_ptr()  # mapping unmapped, its addresses were the new one's: the copy
            assert not start <= in_flight.data_ptr() < start + client.arena.numel()  # wrote into it)
        in_flight.fill_(7)  # the copy goes on: still mapped (a SIGSEGV here before)
        assert int(in_flight.sum()) == 7 * 64 * KiB
        assert any(path in line for line in Path("/proc/self/maps").read_text().splitlines())
        del in_flight
        gc.collect()
        assert not any(path in line for line in Path("/proc/self/maps").read_text().splitlines())
