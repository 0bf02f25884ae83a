"""Copies ahead of need (kv_disk.copy_ahead): a RAM state's disk copy written in the background, so
that leaving RAM later frees it without a write; what happens to a copy when the state changes
under it (dropped, moved down, scribbled, its arena recreated); copies only take free disk room."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import tierstore.disk
from tests import test_tierstore_faults as service_side
from tests.services import start_tierstore
from tests.test_tierstore_faults import FailingCommits
from tests.test_tierstore_store import (AGENT, DISK_SLOT, NS, SIZE, Clock, arena_offset, flip_byte, h, make_data,
                                        make_meta, put, read_back, where)
from ignis.v1 import common_pb2
from tierstore.client import TierStoreClient
from tierstore.copy_ahead import CopyAhead
from tierstore.disk import DiskFault, DiskIO, DiskRecord, DiskTier, FileRange
from tierstore.errors import FailedPrecondition
from tierstore.registry import Registration
from tierstore.state import StateInfo, checksum
from tierstore.store import DISK, StoreConfig, TierStore

KiB = 1024


class CountingIO(DiskIO):
    """Counts blob writes; `during_write` runs inside the next one (a copy's: the store's lock is not held)."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.during_write: Callable[[], None] | None = None

    def _started(self, path: Path) -> None:
        self.writes.append(path.name)
        hook, self.during_write = self.during_write, None
        if hook is not None:
            hook()

    def write_file(self, path: Path, header: bytes, data: memoryview | bytes) -> bytes:
        self._started(path)
        return super().write_file(path, header, data)

    def write_file_from(self, path: Path, header: bytes, source: FileRange, nbytes: int,
                        pace: Callable[[], None] | None = None) -> bytes:
        self._started(path)
        return super().write_file_from(path, header, source, nbytes, pace)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def io() -> CountingIO:
    return CountingIO()


def make(tmp_path: Path, clock: Clock, io: DiskIO, *, ram: int = 3, disk: int = 10, copy_ahead: bool = True
         ) -> TierStore:
    store = TierStore(StoreConfig(ram * SIZE, str(tmp_path / "kv-disk"), disk * DISK_SLOT, lease_seconds=30,
                                  reservation_seconds=60, copy_ahead=copy_ahead), clock=clock, disk_io=io)
    store.register(Registration(NS, "m", 16, "layout-a", 1024, 0))
    return store


@pytest.fixture
def sized(tmp_path: Path, clock: Clock, io: CountingIO) -> Iterator[Callable[..., TierStore]]:
    """make(...) with this test's folder, clock and disk IO; each store made is checked and closed after."""
    made: list[TierStore] = []

    def sized_store(**sizes: int) -> TierStore:
        made.append(make(tmp_path, clock, io, **sizes))  # type: ignore[arg-type]
        return made[-1]

    yield sized_store
    for s in made:
        s.check_integrity()
        s.close()


@pytest.fixture
def store(sized: Callable[..., TierStore]) -> TierStore:
    return sized()


def put_in_order(store: TierStore, clock: Clock, *names: str) -> None:
    """Agent states, one a second: they leave RAM in this order."""
    for name in names:
        put(store, name, cls=AGENT)
        clock.t += 1


def at_looks(store: TierStore, hooks: dict[int, Callable[[], None]]) -> list[int]:
    """Runs hooks[n] before the copy's chunk n (0 is the first), without the store's lock; the list
    returned counts the looks before chunks that the copy went on to."""
    looks = [0]
    plain = store._yield_disk

    def pace() -> None:
        hook = hooks.get(looks[0])
        if hook is not None:
            hook()
        plain()
        looks[0] += 1

    store._yield_disk = pace  # type: ignore[method-assign]
    return looks


def blob_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "kv-disk" / "blobs").iterdir())


def copy_all(store: TierStore) -> int:
    copies = 0
    while store.copy_ahead():
        copies += 1
    return copies


def test_the_next_state_to_leave_is_copied_first_and_then_leaves_without_a_write(
        store: TierStore, clock: Clock, io: CountingIO) -> None:
    put_in_order(store, clock, "a", "b", "c")
    read_back(store, "a")  # a is now the most recent: b leaves first, then c, then a
    assert store.copy_wanted.is_set()  # a Commit asks for a copy
    assert store.copy_ahead()
    assert where(store) == {"a": "ram", "b": "ram+disk", "c": "ram"}  # b: the next to leave RAM
    # Then c; a, which leaves after half the arena has, is not needed on disk soon (COPY_WINDOW).
    assert copy_all(store) == 1 and not store.copy_ahead()
    assert where(store) == {"a": "ram", "b": "ram+disk", "c": "ram+disk"}
    assert store.stats().copies_ahead == 2 and len(io.writes) == 2
    clock.t += 1
    put(store, "d", cls=AGENT)  # RAM is full: b leaves, and it was copied: no write now
    assert where(store)["b"] == "disk" and len(io.writes) == 2
    s = store.stats()
    assert (s.spills, s.evictions, s.states_ram, s.states_disk) == (1, 0, 3, 1)
    data, tier = read_back(store, "b")
    assert tier == DISK and data == make_data("b")


def test_only_the_states_leaving_before_half_the_arena_are_copied(
        sized: Callable[..., TierStore], clock: Clock, io: CountingIO) -> None:
    store = sized(ram=4)
    put_in_order(store, clock, "a", "b", "c", "d")
    assert copy_all(store) == 2
    assert where(store) == {"a": "ram+disk", "b": "ram+disk", "c": "ram", "d": "ram"}
    clock.t += 1
    put(store, "e", cls=AGENT)  # a leaves (no write); now b, c, d, e: c enters the window
    assert copy_all(store) == 1 and where(store)["c"] == "ram+disk" and where(store)["d"] == "ram"


def test_without_copy_ahead_nothing_is_copied(sized: Callable[..., TierStore], clock: Clock, io: CountingIO) -> None:
    store = sized(copy_ahead=False)
    put(store, "a")
    assert not store.copy_ahead() and where(store) == {"a": "ram"} and not io.writes


def test_a_copy_only_takes_free_disk_room(sized: Callable[..., TierStore], clock: Clock, io: CountingIO) -> None:
    store = sized(ram=2, disk=1)
    put_in_order(store, clock, "a", "b", "c")  # a goes down and fills the disk
    assert where(store) == {"a": "disk", "b": "ram", "c": "ram"}
    assert not store.copy_ahead()  # no free room: a is never dropped for a copy
    assert where(store) == {"a": "disk", "b": "ram", "c": "ram"} and store.stats().evictions == 0


def test_disk_room_is_taken_from_redundant_copies_before_any_state_is_dropped(
        sized: Callable[..., TierStore], clock: Clock, io: CountingIO) -> None:
    store = sized(ram=2, disk=2)
    put_in_order(store, clock, "a", "b", "c")  # a down to disk
    assert copy_all(store) == 1  # b's copy fills the disk; c's does not fit
    assert where(store) == {"a": "disk", "b": "ram+disk", "c": "ram"}
    clock.t += 1
    read_back(store, "b")  # b is now the most recent: c leaves RAM next
    clock.t += 1
    put(store, "d", cls=AGENT)  # c goes down: the disk needs room, and b's copy is the one that goes
    assert where(store) == {"a": "disk", "b": "ram", "c": "disk", "d": "ram"}
    s = store.stats()
    assert (s.evictions, s.disk_bytes_used) == (0, 2 * DISK_SLOT)


def test_of_two_copies_the_one_of_the_state_leaving_ram_last_makes_room_first(
        sized: Callable[..., TierStore], clock: Clock, io: CountingIO) -> None:
    store = sized(ram=3, disk=2)
    put_in_order(store, clock, "a", "b", "c")
    assert copy_all(store) == 2 and where(store) == {"a": "ram+disk", "b": "ram+disk", "c": "ram"}
    read_back(store, "a")
    clock.t += 1
    read_back(store, "b")  # RAM leaves in the order c, a, b
    clock.t += 1
    put(store, "d", cls=AGENT)  # c goes down and needs disk room: b's copy goes, a's (next to leave) stays
    assert where(store) == {"a": "ram+disk", "b": "ram", "c": "disk", "d": "ram"}
    writes = len(io.writes)
    clock.t += 1
    put(store, "e", cls=AGENT)  # a leaves RAM, without a write
    assert where(store)["a"] == "disk" and len(io.writes) == writes
    assert store.stats().evictions == 0


def test_a_spill_that_cannot_happen_drops_no_copy(sized: Callable[..., TierStore], clock: Clock, io: CountingIO) -> None:
    """A big state comes down where even the copies' room would not do: the disk state beside them ranks
    above it, so the disk refuses it, and the copy stays."""
    store = sized(ram=6, disk=2)
    extent = store.reserve(h("big"), 2 * SIZE, AGENT)  # the oldest: it leaves first
    assert extent is not None
    store.arena.slice(extent.offset, 2 * SIZE)[:] = make_data("big", 2 * SIZE)
    store.commit(h("big"), make_meta("big", nbytes=2 * SIZE))
    clock.t += 1
    put(store, "p", cls=AGENT)
    with store._lock:
        assert store._move_down(store._states[h("p")], clock.t, None)  # p is on disk only
    clock.t += 1
    put(store, "q", cls=AGENT)
    assert store.copy_ahead()  # big does not fit beside p; q does
    assert where(store) == {"big": "ram", "p": "disk", "q": "ram+disk"}
    with store._lock:
        assert not store._make_disk_room(store._states[h("big")], clock.t, None, b"")
    assert where(store) == {"big": "ram", "p": "disk", "q": "ram+disk"}


def test_a_state_dropped_during_its_copy_is_not_published(store: TierStore, tmp_path: Path, io: CountingIO) -> None:
    put(store, "a")
    io.during_write = lambda: store.drop(h("a"))  # the write runs outside the lock: a Drop gets in
    assert store.copy_ahead()
    assert where(store) == {} and blob_files(tmp_path) == [] and store.stats().copies_ahead == 0


def test_a_state_moved_down_during_its_copy_keeps_the_spill_and_drops_the_copy(
        store: TierStore, clock: Clock, tmp_path: Path, io: CountingIO) -> None:
    put_in_order(store, clock, "a", "b", "c")

    def pressure() -> None:  # RAM pressure while a's copy is being written: a is spilled by the Reserve itself
        put(store, "d", cls=AGENT)

    io.during_write = pressure
    assert store.copy_ahead()
    assert where(store) == {"a": "disk", "b": "ram", "c": "ram", "d": "ram"}
    assert io.writes == [h("a").hex() + ".copy.tmp", h("a").hex() + ".tmp"]
    assert blob_files(tmp_path) == [h("a").hex()] and store.stats().copies_ahead == 0
    data, tier = read_back(store, "a")
    assert tier == DISK and data == make_data("a")


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies in 4 KiB chunks: a 12 KiB state is three, with a look (pace) before each."""
    monkeypatch.setattr(tierstore.disk, "_CHUNK", 4096)


def test_a_state_moved_down_mid_copy_cancels_the_copy(
        store: TierStore, clock: Clock, tmp_path: Path, io: CountingIO, small_chunks: None) -> None:
    put_in_order(store, clock, "a", "b", "c")
    looks = at_looks(store, {1: lambda: put(store, "d", cls=AGENT)})  # a is spilled after its first chunk
    assert store.copy_ahead()
    assert looks == [2]  # it stopped at the look after the spill, not after reading all three chunks
    assert where(store)["a"] == "disk" and blob_files(tmp_path) == [h("a").hex()]
    s = store.stats()
    assert (s.copies_ahead, s.checksum_failures, s.spills) == (0, 0, 1)
    assert store._disk is not None and store._disk.staging_bytes == 0


def test_moved_down_and_restored_to_the_same_place_mid_copy_loses_nothing(
        store: TierStore, clock: Clock, io: CountingIO, small_chunks: None) -> None:
    """The review's case: the bytes under the copy change and come back; the state must not be taken for
    scribbled (it is cancelled at the move), and its bytes are served as they were."""
    put_in_order(store, clock, "a", "b", "c")

    def churn() -> None:
        put(store, "d", cls=AGENT)  # a goes down: d takes its extent
        store.drop(h("d"))
        read_back(store, "a")  # a comes back, into the extent it had

    at_looks(store, {1: churn})
    assert store.copy_ahead()
    assert "a" in where(store) and store.stats().checksum_failures == 0
    assert read_back(store, "a")[0] == make_data("a")


def test_bytes_that_change_under_the_read_and_back_are_not_a_loss(
        store: TierStore, tmp_path: Path, small_chunks: None) -> None:
    """The copy reads a byte of its second chunk changed, and the byte is back before the copy ends: the
    digest does not match, but the arena does, so the copy is dropped and the state kept (and copied
    again whole), not taken for scribbled."""
    put(store, "a")
    at = arena_offset(store, "a") + 4096 + 7  # in the second chunk
    at_looks(store, {1: lambda: flip_byte(store, at), 2: lambda: flip_byte(store, at)})  # changed, then back
    assert store.copy_ahead()
    s = store.stats()
    assert where(store) == {"a": "ram"} and (s.copies_ahead, s.checksum_failures) == (0, 0)
    assert blob_files(tmp_path) == []
    assert store.copy_ahead() and where(store) == {"a": "ram+disk"}
    assert read_back(store, "a")[0] == make_data("a")


def test_a_mismatch_found_as_the_arena_is_replaced_is_not_counted_as_a_scribble(
        store: TierStore, small_chunks: None) -> None:
    """The copy read a changed byte, and the arena file was deleted meanwhile: checking the bytes again
    recreates the arena (the state, only in RAM, is lost with it, counted as such), and is no checksum
    failure."""
    put(store, "a")
    at = arena_offset(store, "a") + 4096 + 7
    # The byte changes before chunk 1; before chunk 2 the file goes (the copy reads on through its own fd).
    at_looks(store, {1: lambda: flip_byte(store, at), 2: lambda: os.unlink(store.arena.path)})
    assert store.copy_ahead()
    s = store.stats()
    assert (s.checksum_failures, s.arena_recreations, s.ram_states_lost) == (0, 1, 1) and where(store) == {}


def test_a_copy_in_flight_ends_unpublished_when_the_arena_is_recreated(
        store: TierStore, tmp_path: Path, small_chunks: None) -> None:
    put(store, "a")

    def recreate() -> None:
        with store._lock:
            store._recreate_arena("replaced by the test")

    at_looks(store, {1: recreate})
    assert store.copy_ahead()
    assert where(store) == {} and blob_files(tmp_path) == [] and store.stats().ram_states_lost == 1


def test_a_spill_that_needs_the_room_of_a_copy_in_flight_takes_it(
        sized: Callable[..., TierStore], clock: Clock, io: CountingIO, small_chunks: None) -> None:
    store = sized(ram=2, disk=1)
    put_in_order(store, clock, "a", "b")
    read_back(store, "a")  # b leaves RAM first: the copy takes b

    def pressure() -> None:
        assert store._disk is not None and store._disk.free_bytes() == 0  # the copy holds the disk's room
        put(store, "c", cls=AGENT)  # b goes down now: the copy of b is cancelled, its room is the spill's

    at_looks(store, {1: pressure})
    assert store.copy_ahead()
    assert where(store) == {"a": "ram", "b": "disk", "c": "ram"}
    assert store._disk is not None and store._disk.staging_bytes == 0 and store.stats().copies_ahead == 0


def test_cancel_copies_stops_the_copy_in_flight_and_starts_none(
        store: TierStore, tmp_path: Path, small_chunks: None) -> None:
    put(store, "a")
    at_looks(store, {1: store.cancel_copies})
    assert store.copy_ahead()
    assert where(store) == {"a": "ram"} and blob_files(tmp_path) == []
    assert not store.copy_ahead()


def test_a_ram_state_with_its_copy_does_not_lock_its_namespace(store: TierStore) -> None:
    """Another layout replaces a registration with nothing on disk only; a copy of a RAM state does not
    count (it goes with the state), or a squatter's state could lock the namespace's owner out."""
    store.register(Registration(b"S" * 16, "squatter", 16, "layout-b", 1024, 0))
    put(store, "s", ns=b"S" * 16)
    assert store.copy_ahead() and where(store) == {"s": "ram+disk"}
    store.register(Registration(b"S" * 16, "owner", 16, "layout-a", 1024, 0))  # accepted: s goes
    assert where(store) == {}
    put(store, "d", ns=b"S" * 16)
    for i in range(3):  # fills RAM until d, the oldest, goes down
        put(store, f"fill{i}")
    assert where(store)["d"] == "disk"
    with pytest.raises(FailedPrecondition):  # a state on disk only does lock it
        store.register(Registration(b"S" * 16, "other", 16, "layout-c", 1024, 0))


def test_a_staged_blob_whose_name_cannot_be_freed_is_removed(tmp_path: Path) -> None:
    """A pending removal of the same name that the disk refuses to finish: the staged temp file goes."""
    io = FailingCommits()
    disk = DiskTier(tmp_path / "kv", 10 * DISK_SLOT, io=io)
    try:
        data = make_data("a")
        info = StateInfo.from_proto(h("a"), make_meta("a"), page_size=16, sliceable=False)
        record = DiskRecord(replace(info, checksum=checksum(data)), 0.0, 0.0)
        assert disk.put(record, data)
        io.failing = True
        disk.remove(h("a"))  # pending: the index refuses the delete
        fd = os.open(tmp_path / "src", os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, data)
        staged = disk.stage(record, FileRange(fd, 0))
        os.close(fd)
        assert staged.tmp.exists()
        with pytest.raises(DiskFault):
            disk.place_staged(staged)
        assert not staged.tmp.exists()
    finally:
        disk.close()


def test_a_state_scribbled_after_commit_is_caught_by_its_copy(store: TierStore, tmp_path: Path) -> None:
    put(store, "a")
    flip_byte(store, arena_offset(store, "a"))
    assert store.copy_ahead()
    assert where(store) == {} and blob_files(tmp_path) == []  # never served, never persisted
    s = store.stats()
    assert (s.checksum_failures, s.copies_ahead) == (1, 0)


def test_a_copy_in_flight_when_the_arena_is_recreated_is_dropped(store: TierStore, tmp_path: Path,
                                                                  io: CountingIO) -> None:
    put(store, "a")
    io.during_write = lambda: os.truncate(store.arena.path, 4096)  # what an attacker on the host may do
    assert store.copy_ahead()
    store.expire()  # the sweep finds the truncated file and recreates the arena: a was only in RAM
    assert where(store) == {} and blob_files(tmp_path) == [] and store.stats().arena_recreations == 1


def test_a_failing_disk_is_counted_and_the_state_stays_in_ram(store: TierStore, io: CountingIO) -> None:
    put(store, "a")

    def full() -> None:
        raise OSError(28, "No space left on device")

    io.during_write = full
    assert store.copy_ahead()
    s = store.stats()
    assert where(store) == {"a": "ram"} and s.disk_errors == 1 and not s.disk_usable
    assert not store.copy_ahead()  # no retry before the disk's retry time


def test_a_copy_waits_while_a_call_waits_on_the_disk(store: TierStore) -> None:
    put(store, "a")
    with store._foreground_io():  # as a restore's read does, under the lock (held here by nobody)
        copier = threading.Thread(target=store.copy_ahead)
        copier.start()
        copier.join(0.2)
        assert copier.is_alive() and where(store) == {"a": "ram"}  # paused before its first chunk
    copier.join(30)
    assert not copier.is_alive() and where(store) == {"a": "ram+disk"}


def test_the_thread_copies_what_is_committed_and_stops(store: TierStore) -> None:
    copier = CopyAhead(store)
    copier.start()
    try:
        put(store, "a")
        deadline = time.monotonic() + 30
        while where(store) != {"a": "ram+disk"} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert where(store) == {"a": "ram+disk"}
    finally:
        copier.stop()
    assert not copier._thread.is_alive()


def test_the_service_copies_ahead_and_a_restart_serves_the_copies(tmp_path: Path) -> None:
    args = ["--kv-host-pool-bytes", "256KiB", "--kv-disk-path", str(tmp_path / "kv"), "--kv-disk-bytes", "8MiB"]
    store = start_tierstore(tmp_path / "ts", args)
    try:
        with TierStoreClient(store.address) as c:
            _store_one(c)
            deadline = time.monotonic() + 30
            while c.stats().copies_ahead < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            s = c.stats()
            assert (s.copies_ahead, s.states_ram, s.states_disk) == (1, 1, 0)
    finally:
        assert store.stop() == 0
    store = start_tierstore(tmp_path / "ts", args)  # the arena is gone with the process; the copy is not
    try:
        with TierStoreClient(store.address) as c:
            c.register(service_side.NS, page_size=16, layout=service_side.LAYOUT)
            lease = c.acquire(service_side.h("s0"))
            assert lease.from_tier == DISK
            assert bytes(c.read(lease.extent)) == service_side.make_data("s0", 64 * KiB)
            c.release(lease.lease_id)
    finally:
        store.stop()


def test_the_service_without_copy_ahead_copies_nothing(tmp_path: Path) -> None:
    args = ["--kv-host-pool-bytes", "256KiB", "--kv-disk-path", str(tmp_path / "kv"), "--kv-disk-bytes", "8MiB"]
    store = start_tierstore(tmp_path / "ts", args, env={"IGNIS_KV_DISK__COPY_AHEAD": "false"})
    try:
        with TierStoreClient(store.address) as c:
            _store_one(c)
            time.sleep(1.5)  # past the copier's idle wake-up: it would have copied by now
            assert c.stats().copies_ahead == 0
    finally:
        store.stop()


def _store_one(c: TierStoreClient) -> None:
    """One 64 KiB state through the service, as tests/test_tierstore_faults.py stores them."""
    c.register(service_side.NS, page_size=16, layout=service_side.LAYOUT)
    c.store(service_side.h("s0"), service_side.make_data("s0", 64 * KiB), service_side.make_meta("s0", 64 * KiB))


def test_a_copy_made_ahead_is_listed_on_the_disk_too(store: TierStore, clock: Clock, io: CountingIO) -> None:
    """The Monitor's KV-disk bytes count copies made ahead of need: the listing shows them, a RAM state
    with its disk copy as a row of each tier (issue 47 item 12: hundreds of MiB used, no disk row)."""
    put_in_order(store, clock, "a", "b", "c")
    assert store.copy_ahead()
    copied = [name for name, tiers in where(store).items() if tiers == "ram+disk"]
    rows, total = store.list_states([NS])
    assert len(copied) == 1 and total == 4
    assert sorted((r.info.hash, r.tier) for r in rows) == sorted(
        [(h(n), common_pb2.REUSE_TIER_RAM) for n in ("a", "b", "c")] + [(h(copied[0]), common_pb2.REUSE_TIER_DISK)])
