"""End to end: a real `python -m tierstore` process, real shared memory, real LMDB, real files."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ignis.v1 import common_pb2, tierstore_pb2
from services import RunningService, start_tierstore
from tierstore.client import TierStoreClient
from tierstore.disk import DiskTier

NS = b"n" * 16
KiB = 1024
RAM, DISK = common_pb2.REUSE_TIER_RAM, common_pb2.REUSE_TIER_DISK


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def make_data(i: int, n: int = 256 * KiB) -> bytes:
    return np.random.default_rng(i).bytes(n)


def make_meta(i: int, n: int = 256 * KiB, cls: int = common_pb2.REQUEST_CLASS_AGENT) -> tierstore_pb2.StateMetadata:
    return tierstore_pb2.StateMetadata(namespace=NS, tokens=16, kind=common_pb2.REUSE_KIND_CHECKPOINT,
                                       request_class=cls,  # type: ignore[arg-type]
                                       page_hashes=[h(i)], nbytes=n)


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


Start = Callable[..., RunningService]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """start(ram, disk, **kw) -> a running tierstore on tmp_path/kv-disk; stopped at the end."""
    running: list[RunningService] = []

    def _start(ram: str = "1MiB", disk: str = "64MiB", metrics: bool = False) -> RunningService:
        service = start_tierstore(tmp_path / "work", ["--kv-host-pool-bytes", ram, "--kv-disk-path",
                                                      str(tmp_path / "kv-disk"), "--kv-disk-bytes", disk],
                                  metrics=metrics)
        running.append(service)
        return service

    yield _start
    for service in running:
        service.stop()


def test_write_by_offset_match_acquire_read_back(start: Start) -> None:
    ts = start()
    with TierStoreClient(ts.address) as c:
        reg = c.register(NS, model="tiny", page_size=16, layout='{"kv": "f32"}', kv_bytes_per_token=1024)
        assert reg.arena_bytes == 1 << 20 and Path(reg.arena_path).parent == Path("/dev/shm")
        data = make_data(1, 100_000)
        extent = c.reserve(h(1), len(data), protect_seconds=10)
        assert extent.length == len(data) and extent.offset % 4096 == 0
        c.write(extent, data)  # a memcpy into the shared memory, by offset
        c.commit(h(1), make_meta(1, len(data)))
        [hit] = c.match(NS, [h(1), h(2)])
        assert (hit.hash, hit.state_hash, hit.tier, hit.tokens, hit.nbytes) == (h(1), h(1), RAM, 16, len(data))
        assert hit.extent.offset == extent.offset
        lease = c.acquire(h(1), lease_seconds=5)
        assert lease.from_tier == RAM and lease.metadata.nbytes == len(data)
        view = c.read(lease.extent)
        assert bytes(view) == data  # bit-exact, read straight from the arena
        view.release()
        stats = c.stats()
        assert (stats.states_ram, stats.leases_active, stats.arena_bytes_used) == (1, 1, 102400)
        c.release(lease.lease_id)
        assert c.stats().leases_active == 0


def test_status_codes(start: Start) -> None:
    ts = start(ram="64KiB")
    with TierStoreClient(ts.address) as c:
        c.register(NS, page_size=16, layout="a")
        c.register(NS, page_size=16, layout="b")  # nothing stored under "a": "b" replaces it (registry.py)
        assert code_of(lambda: c.register(b"x", page_size=16)) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: c.reserve(b"short", 10)) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: c.match(NS, [b"x" * 17])) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: c.acquire(h(9))) == grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: c.release(99)) == grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: c.commit(h(9), make_meta(9))) == grpc.StatusCode.FAILED_PRECONDITION
        assert code_of(lambda: c.reserve(h(9), 65 * KiB)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        c.store(h(1), make_data(1, 1000), make_meta(1, 1000))
        assert code_of(lambda: c.reserve(h(1), 1000)) == grpc.StatusCode.ALREADY_EXISTS
        assert code_of(lambda: c.put(h(1), make_data(1, 1000), make_meta(1, 1000))) == grpc.StatusCode.ALREADY_EXISTS
        assert code_of(lambda: c.put(h(2), b"abc", make_meta(2, 4))) == grpc.StatusCode.INVALID_ARGUMENT
        assert c.stats().reservations_pending == 0  # the failed Put left nothing behind
        c.store(h(3), make_data(3, 61 * KiB), make_meta(3, 61 * KiB))  # h(1) moves down to disk
        assert c.stats().states_disk == 1
        assert code_of(lambda: c.register(NS, page_size=16, layout="a")) == grpc.StatusCode.FAILED_PRECONDITION
        assert c.drop(h(1)) and not c.drop(h(1))


def test_tiny_arena_spills_to_disk_and_acquire_restores_bit_exact(start: Start) -> None:
    ts = start(ram="1MiB")
    with TierStoreClient(ts.address) as c:
        c.register(NS, page_size=16)
        for i in range(1, 9):  # 8 x 256 KiB through a 1 MiB arena
            c.store(h(i), make_data(i), make_meta(i))
        stats = c.stats()
        assert stats.spills == 4 and stats.states_disk == 4 and stats.states_ram == 4
        [hit] = c.match(NS, [h(1)])
        assert hit.tier == DISK and not hit.HasField("extent")
        lease = c.acquire(h(1))
        assert lease.from_tier == DISK
        view = c.read(lease.extent)
        assert bytes(view) == make_data(1)
        view.release()
        c.release(lease.lease_id)
        assert c.match(NS, [h(1)])[0].tier == RAM
        stats = c.stats()
        assert (stats.restores, stats.spills, stats.checksum_failures) == (1, 5, 0)


def test_disk_budget_full_drops_states_and_keeps_answering(start: Start) -> None:
    ts = start(ram="512KiB", disk="1040KiB")  # 4 blobs of 256 KiB, each with its 4 KiB header block
    with TierStoreClient(ts.address) as c:
        c.register(NS, page_size=16)
        for i in range(1, 13):
            c.store(h(i), make_data(i), make_meta(i))
            stats = c.stats()
            assert stats.disk_bytes_used <= stats.disk_bytes_total == 1040 * KiB
        stats = c.stats()
        assert (stats.states_ram, stats.states_disk, stats.evictions) == (2, 4, 6)
        assert c.match(NS, [h(1)]) == []  # the oldest went first
        assert code_of(lambda: c.acquire(h(1))) == grpc.StatusCode.NOT_FOUND
        lease = c.acquire(h(7))  # the oldest survivor, restored from disk
        assert lease.from_tier == DISK and bytes(c.read(lease.extent)) == make_data(7)
        c.release(lease.lease_id)


def test_put_and_get_stream_the_bytes(start: Start) -> None:
    ts = start(ram="4MiB")
    with TierStoreClient(ts.address) as c:  # no register: an engine on another host never maps the arena
        big = make_data(1, 3 * 1024 * KiB + 123)
        c.put(h(1), big, make_meta(1, len(big)), protect_seconds=5)
        meta, back = c.get(h(1))
        assert back == big and meta.nbytes == len(big) and len(meta.checksum) == 16
        c.put(h(2), make_data(2, len(big)), make_meta(2, len(big)))  # pushes state 1 down to disk
        assert c.match(NS, [h(1)])[0].tier == DISK
        meta, back = c.get(h(1))  # read and verified from the disk tier
        assert back == big
        assert code_of(lambda: c.get(h(3))) == grpc.StatusCode.NOT_FOUND


def test_a_flipped_byte_on_disk_is_data_loss_and_counted(start: Start, tmp_path: Path) -> None:
    ts = start(ram="512KiB")
    with TierStoreClient(ts.address) as c:
        c.register(NS, page_size=16)
        for i in range(1, 4):
            c.store(h(i), make_data(i), make_meta(i))
        blob = tmp_path / "kv-disk" / "blobs" / h(1).hex()
        raw = bytearray(blob.read_bytes())
        raw[77_777] ^= 0x10
        blob.write_bytes(raw)
        assert code_of(lambda: c.acquire(h(1))) == grpc.StatusCode.DATA_LOSS
        assert c.stats().checksum_failures == 1
        assert c.match(NS, [h(1)]) == []  # dropped, never served
        assert code_of(lambda: c.get(h(1))) == grpc.StatusCode.NOT_FOUND


def test_kill_9_during_writes_then_restart(start: Start, tmp_path: Path) -> None:
    ts = start(ram="1MiB", disk="256MiB")
    with TierStoreClient(ts.address) as c:
        arena_path = Path(c.register(NS, page_size=16).arena_path)
    done: list[int] = []  # Puts that returned OK, in completion order
    enough = threading.Event()

    def writer(first: int) -> None:
        with TierStoreClient(ts.address, timeout=10) as c:
            for i in range(first, first + 10_000, 2):
                try:
                    c.put(h(i), make_data(i), make_meta(i))
                except grpc.RpcError:
                    return
                done.append(i)
                if len(done) >= 40:
                    enough.set()

    threads = [threading.Thread(target=writer, args=(first,)) for first in (1, 2)]
    for t in threads:
        t.start()
    assert enough.wait(60), "the writers stalled"
    os.kill(ts.process.pid, signal.SIGKILL)  # in the middle of Puts and the spills they cause
    ts.process.wait()
    for t in threads:
        t.join(30)
    assert arena_path.exists()  # kill -9 leaves the shared memory behind...
    blobs = tmp_path / "kv-disk" / "blobs"
    (blobs / (h(999_999).hex() + ".tmp")).write_bytes(b"torn write")  # ...and we plant both crash windows
    (blobs / h(999_998).hex()).write_bytes(make_data(999_998))

    ts2 = start(ram="1MiB", disk="256MiB")
    assert not arena_path.exists()  # reaped at the next start
    assert not list(blobs.glob("*.tmp")) and not (blobs / h(999_998).hex()).exists()
    attempted = range(1, max(done) + 3)
    with TierStoreClient(ts2.address) as c:
        assert c.register(NS, page_size=16).arena_path != str(arena_path)  # a new instance, a new arena
        stats = c.stats()
        assert stats.states_disk > 0 and stats.states_ram == 0 and stats.checksum_failures == 0
        found = []
        for i in attempted:  # every state the index serves reads back bit-exact
            hits = c.match(NS, [h(i)])
            if hits:
                assert hits[0].tier == DISK
                _, back = c.get(h(i))
                assert back == make_data(i), f"state {i} is torn"
                found.append(i)
        assert len(found) == stats.states_disk
        # Everything committed well before the kill had been spilled, so it survived.
        assert set(done[:-8]) <= set(found)
        lease = c.acquire(h(found[0]))
        assert lease.from_tier == DISK and bytes(c.read(lease.extent)) == make_data(found[0])
        c.release(lease.lease_id)
    assert ts2.stop() == 0

    disk = DiskTier(tmp_path / "kv-disk", 256 << 20)  # the index and the files agree
    try:
        disk.check_integrity()
        assert {r.info.hash for r in disk.records()} == {h(i) for i in found}
    finally:
        disk.close()


def test_health_reflection_metrics_and_graceful_stop(start: Start) -> None:
    ts = start(metrics=True)
    with grpc.insecure_channel(ts.address) as channel:
        for name in ("", "ignis.v1.TierStore"):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        services = {s.name for s in answer.list_services_response.service}
        assert {"ignis.v1.TierStore", "grpc.health.v1.Health"} <= services
    with TierStoreClient(ts.address) as c:
        arena_path = Path(c.register(NS, page_size=16).arena_path)
        c.store(h(1), make_data(1), make_meta(1))
    text = httpx.get(f"http://127.0.0.1:{ts.extra['metrics']}/metrics").text
    for line in ('ignis_kv_ram_arena_bytes{kind="used"} 262144.0', 'ignis_kv_ram_arena_bytes{kind="total"} 1.048576e+06',
                 'ignis_kv_disk_bytes{kind="total"} 6.7108864e+07', "ignis_kv_spills_total 0.0",
                 "ignis_kv_restores_total 0.0", "ignis_kv_evictions_total 0.0",
                 "ignis_kv_checksum_failures_total 0.0", 'ignis_kv_states{tier="ram"} 1.0'):
        assert line in text, line
    assert arena_path.exists()
    assert ts.stop() == 0  # SIGTERM: a clean exit that removes the shared memory
    assert not arena_path.exists()


def test_a_match_that_leases_replaces_the_acquire_round_trip(start: Start) -> None:
    ts = start()
    with TierStoreClient(ts.address) as c:
        c.register(NS, model="tiny", page_size=16, layout="l")
        data = make_data(3, 100_000)
        c.store(h(3), data, make_meta(3, len(data)))
        [plain] = c.match(NS, [h(3)])
        assert plain.lease_id == 0 and not plain.HasField("metadata") and c.stats().leases_active == 0
        [hit] = c.match(NS, [h(3)], lease_seconds=5)
        assert hit.tier == RAM and hit.lease_id > 0
        assert (hit.metadata.nbytes, hit.metadata.tokens, len(hit.metadata.checksum)) == (len(data), 16, 16)
        view = c.read(hit.extent)
        assert bytes(view) == data  # read under the Match's lease, no Acquire
        view.release()
        assert c.stats().leases_active == 1
        c.release(hit.lease_id, instance_id="another-instance")  # another instance's lease ids: nothing ends
        assert c.stats().leases_active == 1
        [again] = c.match(NS, [h(3)], lease_seconds=5)
        c.release(hit.lease_id, [again.lease_id], instance_id=c.instance_id)
        assert c.stats().leases_active == 0
        assert code_of(lambda: c.release(0, [again.lease_id])) == grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: c.match(NS, [h(3)], lease_seconds=-1)) == grpc.StatusCode.INVALID_ARGUMENT
        assert c.stats().leases_active == 0  # the store kept serving


def test_acquire_stream_hands_out_the_bytes_as_they_land(start: Start, tmp_path: Path) -> None:
    """AcquireStream: the lease first, then how far the restore has read, then `verified`; a state in RAM
    comes whole in one message; a blob that fails its checksum ends the stream with DATA_LOSS and no lease."""
    ts = start(ram="8MiB")
    with TierStoreClient(ts.address) as c:
        c.register(NS, page_size=16)
        n = 5 * 1024 * KiB + 321  # several of the reader's 2 MiB chunks
        for i in (1, 2):
            c.store(h(i), make_data(i, n), make_meta(i, n))  # the second pushes the first down to disk
        assert c.match(NS, [h(1)])[0].tier == DISK
        messages = list(c.acquire_stream(h(1), lease_seconds=5))
        first, *middle, last = messages  # progress a slow reader has not taken yet is merged into one step
        # The lease comes first, unverified; how much has landed by then is the disk's and the scheduler's
        # business (a warm page cache may have read it all: the progress is then merged into it).
        assert first.HasField("lease") and first.ready_bytes <= n and not first.verified
        assert first.lease.from_tier == DISK and first.lease.metadata.nbytes == n
        assert not any(m.HasField("lease") or m.verified for m in middle)
        ready = [m.ready_bytes for m in (first, *middle)]
        assert ready == sorted(ready) and last.verified and last.ready_bytes == n
        assert bytes(c.read(first.lease.extent)) == make_data(1, n)
        c.release(first.lease.lease_id)
        [whole] = c.acquire_stream(h(1))  # now in RAM
        assert whole.verified and whole.ready_bytes == n and whole.lease.from_tier == RAM
        c.release(whole.lease.lease_id)
        c.store(h(3), make_data(3, n), make_meta(3, n))  # state 1 goes down again
        blob = tmp_path / "kv-disk" / "blobs" / h(2).hex()
        raw = bytearray(blob.read_bytes())
        raw[-1000] ^= 0x10  # in the last chunk: the stream has handed out progress before it fails
        blob.write_bytes(raw)
        assert c.match(NS, [h(2)])[0].tier == DISK
        got: list[tierstore_pb2.AcquireProgress] = []
        with pytest.raises(grpc.RpcError) as info:
            for message in c.acquire_stream(h(2)):
                got.append(message)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert got and got[0].HasField("lease") and not any(m.verified for m in got)
        stats = c.stats()
        assert stats.leases_active == 0 and stats.checksum_failures == 1 and c.match(NS, [h(2)]) == []
        assert code_of(lambda: list(c.acquire_stream(h(9)))) == grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: list(c.acquire_stream(b"short"))) == grpc.StatusCode.INVALID_ARGUMENT
        assert bytes(c.read(c.acquire(h(3)).extent)) == make_data(3, n)  # still serving
