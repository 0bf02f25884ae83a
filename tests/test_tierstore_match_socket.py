"""The tierstore's Match socket against a real `python -m tierstore`: it answers what the Match RPC
answers, refuses what the RPC refuses with the same codes, and a bad frame ends only its own
connection (tierstore/match_socket.py, protos/ignis/v1/tierstore.proto "local match"). And the
engine's end (engine/tiers/local_match.py): its client asks there, and falls back to gRPC, or
counts the store down, as the RPC would have made it.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.frames import recv_frame, send_frame
from engine.tiers.client import TierClient, _beside
from ignis.v1 import common_pb2, tierstore_pb2, tierstore_pb2_grpc
from services import RunningService, start_tierstore
from other_user import as_nobody, open_to_everyone
from test_tierstore_faults import LAYOUT, Clock, engine_and_store
from tierstore.client import TierStoreClient

NS = b"n" * 16
KiB = 1024
RAM, DISK = common_pb2.REUSE_TIER_RAM, common_pb2.REUSE_TIER_DISK


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def meta(pages: list[bytes], tokens: int, n: int) -> tierstore_pb2.StateMetadata:
    return tierstore_pb2.StateMetadata(namespace=NS, tokens=tokens, kind=common_pb2.REUSE_KIND_CHECKPOINT,
                                       request_class=common_pb2.REQUEST_CLASS_AGENT, page_hashes=pages, nbytes=n)


class Conn:
    """One connection to the Match socket, speaking its frames."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)

    def call(self, request: tierstore_pb2.MatchRequest) -> tierstore_pb2.LocalMatchReply:
        send_frame(self.sock, tierstore_pb2.LocalMatchCall(request=request).SerializeToString())
        frame = recv_frame(self.sock)
        assert frame is not None, "the store closed the connection"
        return tierstore_pb2.LocalMatchReply.FromString(frame)

    def closed_by_store(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningService, str]]:
    """A store with states in RAM and on disk, page-aligned and anchored: (service, Match socket path)."""
    work = tmp_path_factory.mktemp("match-socket")
    service = start_tierstore(work / "ts", ["--kv-host-pool-bytes", "1MiB", "--kv-disk-path", str(work / "kv-disk"),
                                            "--kv-disk-bytes", "64MiB"])
    with TierStoreClient(service.address) as c:
        reg = c.register(NS, model="tiny", page_size=16, layout="bytes", fixed_state_bytes=4 * KiB)  # not sliceable
        n = 300 * KiB
        for i in range(1, 7):  # seven states of 300 KiB in a 1 MiB arena: the first four go to disk
            pages = [h(k) for k in range(1, i + 1)]
            c.store(h(i), np.random.default_rng(i).bytes(n), meta(pages, 16 * i, n))
        c.store(b"x" * 16, np.random.default_rng(9).bytes(n), meta([h(1), h(2)], 40, n))  # anchored at h(2)
    yield service, reg.match_socket
    assert service.stop() == 0, service.log()


def stub(service: RunningService) -> tierstore_pb2_grpc.TierStoreStub:
    return tierstore_pb2_grpc.TierStoreStub(grpc.insecure_channel(service.address))


def without_leases(reply: tierstore_pb2.MatchResponse) -> tierstore_pb2.MatchResponse:
    reply = tierstore_pb2.MatchResponse.FromString(reply.SerializeToString())
    for hit in (*reply.hits, *reply.candidates):
        hit.lease_id = 0
    return reply


def test_the_socket_lies_beside_the_grpc_socket_and_is_the_stores_own(store: tuple[RunningService, str]) -> None:
    service, path = store
    assert Path(path) == Path(service.address.removeprefix("unix:") + ".match")
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


@pytest.mark.parametrize("pages,tail,lease,tiers,candidates", [
    ([1, 2, 3, 4, 5, 6, 7], None, 0.0, [RAM], 1),  # RAM is longest; the anchored state is a candidate
    ([1, 2], b"t" * 16, 0.0, [DISK], 1),  # a tail nobody stored; only disk has h(2)
    ([1, 2, 3, 4, 5, 6], h(6), 5.0, [RAM], 1),  # leased: the RAM hit and the candidate carry leases
    ([1, 2], None, 5.0, [DISK], 1),  # a disk hit (never leased by Match), a leased candidate
    ([42], None, 0.0, [], 0),  # nothing
])
def test_it_answers_what_the_rpc_answers(store: tuple[RunningService, str], pages: list[int], tail: bytes | None,
                                         lease: float, tiers: list[int], candidates: int) -> None:
    service, path = store
    request = tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(p) for p in pages], anchored=True,
                                         lease_seconds=lease)
    if tail is not None:
        request.tail_hash = tail
    conn = Conn(path)
    try:
        local = conn.call(request)
    finally:
        conn.close()
    assert local.code == 0 and not local.details
    rpc = stub(service).Match(request, timeout=10)
    assert without_leases(local.response) == without_leases(rpc)
    assert [hit.tier for hit in local.response.hits] == tiers and len(local.response.candidates) == candidates
    assert local.response.instance_id == rpc.instance_id
    leases = [hit.lease_id for hit in (*local.response.hits, *local.response.candidates) if hit.lease_id]
    if lease:
        assert leases, "a leasing Match on the socket leases as the RPC does"
    with TierStoreClient(service.address) as c:
        for r in (rpc, local.response):
            ids = sorted({hit.lease_id for hit in (*r.hits, *r.candidates) if hit.lease_id})
            if ids:
                c.release(0, ids)
        assert c.stats().leases_active == 0


def test_a_refused_call_ends_with_the_rpcs_code_and_the_connection_goes_on(store: tuple[RunningService, str]) -> None:
    service, path = store
    bad = tierstore_pb2.MatchRequest(namespace=b"abc", page_hashes=[h(1)])
    with pytest.raises(grpc.RpcError) as rpc:
        stub(service).Match(bad, timeout=10)
    conn = Conn(path)
    try:
        refused = conn.call(bad)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] == rpc.value.code().value[0]
        assert refused.details == rpc.value.details() and "namespace" in refused.details
        assert not refused.HasField("response")
        also = conn.call(tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(1)], lease_seconds=-1))
        assert also.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        good = conn.call(tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(1), h(2), h(3)]))
        assert good.code == 0 and good.response.hits
    finally:
        conn.close()


@pytest.mark.parametrize("frame", [
    struct.pack("<I", 5) + b"\xff\xff\xff\xff\xff",  # not a LocalMatchCall
    struct.pack("<I", 1 << 30),  # announces 1 GiB: over the bound, refused before any read
    struct.pack("<I", 100) + b"short",  # ends inside the frame
])
def test_a_bad_frame_ends_its_connection_only(store: tuple[RunningService, str], frame: bytes) -> None:
    service, path = store
    other = Conn(path)
    bad = Conn(path)
    try:
        bad.sock.sendall(frame)
        if frame.endswith(b"short"):
            bad.sock.shutdown(socket.SHUT_WR)
        assert bad.closed_by_store()
        assert other.call(tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(1), h(2), h(3)])).code == 0
        fresh = Conn(path)
        assert fresh.call(tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(3)])).code == 0
        fresh.close()
        assert service.process.poll() is None
    finally:
        bad.close()
        other.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=300))
def test_any_frame_gets_a_reply_or_a_hang_up_and_the_store_serves_on(store: tuple[RunningService, str],
                                                                   payload: bytes) -> None:
    service, path = store
    conn = Conn(path)
    try:
        send_frame(conn.sock, payload)
        try:
            frame = recv_frame(conn.sock)
        except ConnectionResetError:
            frame = None
        if frame is not None:  # it parsed (protobuf takes much): a reply with a status, never a crash
            reply = tierstore_pb2.LocalMatchReply.FromString(frame)
            assert reply.code == 0 or reply.details
            assert reply.code != grpc.StatusCode.INTERNAL.value[0], reply.details
    finally:
        conn.close()
    assert service.process.poll() is None
    assert stub(service).Match(tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(3)]), timeout=10).hits


def _as_nobody(path: str) -> bytes:
    """What a process of another user gets from the socket: refused, hung up on, or answered."""
    def use() -> bytes:
        conn = Conn(path)
        send_frame(conn.sock, tierstore_pb2.LocalMatchCall(
            request=tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(3)])).SerializeToString())
        return b"answered" if recv_frame(conn.sock) is not None else b"hung up"
    return as_nobody(use)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_another_user_cannot_use_it(store: tuple[RunningService, str]) -> None:
    _, path = store
    assert _as_nobody(path) == b"refused"  # the socket is 0600 in a 0700 folder
    with open_to_everyone(path):  # past the file modes, the store's own check (SO_PEERCRED) hangs up
        assert _as_nobody(path) == b"hung up"
    conn = Conn(path)  # and its own user is still served
    try:
        assert conn.call(tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(3)])).code == 0
    finally:
        conn.close()


# --- the engine's end ---------------------------------------------------------------------
@contextmanager
def engine_client(tmp_path: Path, **kw: object) -> Iterator[tuple[RunningService, TierClient, TierStoreClient]]:
    """engine_and_store's store with one state in RAM, the engine's tier client registered with it."""
    with engine_and_store(tmp_path, **kw) as (store, client, admin):
        admin.register(NS, model="m", page_size=16, layout=LAYOUT, kv_bytes_per_token=1024)
        admin.store(h(1), b"\1" * (64 * KiB), meta([h(1)], 16, 64 * KiB))
        assert client.ensure(NS)
        yield store, client, admin


def tiers_of(found: tuple[list[tierstore_pb2.MatchHit], list[tierstore_pb2.MatchHit]]) -> list[tuple[int, int]]:
    return [(hit.tier, hit.tokens) for hit in found[0]]


def test_the_engines_client_asks_on_the_socket_and_gets_what_grpc_gives(tmp_path: Path) -> None:
    with engine_client(tmp_path) as (store, client, admin):
        over_grpc = TierClient(store.address, model="m", page_size=16, layout=LAYOUT, kv_bytes_per_token=1024,
                               fixed_state_bytes=0, local_match=False)
        try:
            assert over_grpc.ensure(NS) and over_grpc.local is None
            assert client.local is not None and client.local.path.endswith(".match")
            local_hits = client.match(NS, [h(1), h(2)], None, lease_seconds=5.0)
            grpc_hits = over_grpc.match(NS, [h(1), h(2)], None, lease_seconds=5.0)
            assert client.local.calls == 1 and client.match_instance == over_grpc.match_instance
            assert tiers_of(local_hits) == tiers_of(grpc_hits) == [(RAM, 16)]
            assert local_hits[0][0].lease_id and local_hits[0][0].metadata.nbytes == 64 * KiB
            for c, found in ((client, local_hits), (over_grpc, grpc_hits)):
                c.release(found[0][0].lease_id, (), c.match_instance)
                c._releaser.submit(lambda: None).result()
            assert admin.stats().leases_active == 0
            assert client.match(NS, [b"abc"], None) == ([], [])  # refused on the socket: nothing, counted
            assert client.last_code == grpc.StatusCode.INVALID_ARGUMENT and client.errors == 1 and client.up
            assert client.local is not None and client.local.calls == 2
        finally:
            over_grpc.close()


def test_a_restarted_store_is_asked_over_grpc_then_on_its_own_socket(tmp_path: Path) -> None:
    with engine_client(tmp_path) as (store, client, admin):
        assert tiers_of(client.match(NS, [h(1)], None)) == [(RAM, 16)]
        first = admin.stats().instance_id
        assert store.stop() == 0
        store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", "1MiB", "--kv-disk-bytes", "0"])
        try:
            old = client.local
            assert client.match(NS, [h(1)], None) == ([], [])  # the socket broke: gRPC asked the new store
            assert client.up and client.match_instance not in ("", first) and old is not None and old.calls == 1
            assert client.ensure(NS)  # registers with the new instance: its socket, at once
            assert client.local is not None and client.local is not old
            assert client.match(NS, [h(1)], None) == ([], []) and client.local.calls == 1
        finally:
            store.stop()


def test_a_stalled_store_is_a_deadline_as_over_grpc(tmp_path: Path) -> None:
    clock = Clock()
    with engine_client(tmp_path, timeout=0.5, clock=clock) as (store, client, admin):
        store.process.send_signal(signal.SIGSTOP)
        try:
            assert client.match(NS, [h(1)], None) == ([], [])
            assert client.last_code == grpc.StatusCode.DEADLINE_EXCEEDED and not client.up
            assert client.match(NS, [h(1)], None) == ([], [])  # down: not asked again until the backoff
        finally:
            store.process.send_signal(signal.SIGCONT)
        clock.t += client.retry_seconds
        assert client.ensure(NS) and client.up and client.local is not None
        assert tiers_of(client.match(NS, [h(1)], None)) == [(RAM, 16)] and client.local.calls == 1


def test_a_socket_that_fails_is_passed_over_for_a_while(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    with engine_client(tmp_path, clock=clock) as (store, client, admin):
        assert client.local is not None
        path = client.local.path
        os.rename(path, path + ".away")  # never connected yet: the connect fails
        assert tiers_of(client.match(NS, [h(1)], None)) == [(RAM, 16)]  # asked over gRPC instead
        assert client.up and client.errors == 0

        def failures() -> int:
            return sum("match socket failed" in r.getMessage() for r in caplog.records)

        assert failures() == 1
        assert tiers_of(client.match(NS, [h(1)], None)) == [(RAM, 16)] and failures() == 1  # not tried again yet
        os.rename(path + ".away", path)
        clock.t += client.retry_seconds
        assert tiers_of(client.match(NS, [h(1)], None)) == [(RAM, 16)]
        assert failures() == 1 and client.local.calls == 1  # tried again after the backoff: back on the socket


def test_a_match_socket_not_beside_the_grpc_socket_is_not_used(tmp_path: Path) -> None:
    """A Register reply names the socket; the engine uses it only in its gRPC socket's (private) folder,
    and never for a store it reaches over TCP."""
    assert _beside("/run/ignis/tierstore.sock.match", "unix:/run/ignis/tierstore.sock")
    assert _beside("/run/ignis/tierstore.sock.match", "unix:///run/ignis/tierstore.sock")
    assert not _beside("/tmp/elsewhere.sock", "unix:/run/ignis/tierstore.sock")
    assert not _beside("/run/ignis/tierstore.sock.match", "127.0.0.1:7000")
    assert not _beside("", "unix:/run/ignis/tierstore.sock")


def test_closing_the_socket_hangs_up_and_waits_for_its_threads(tmp_path: Path) -> None:
    """In-process (a real TierStore): after close() no thread of the socket runs a Match on the store."""
    from tierstore.match_socket import MatchSocket
    from tierstore.registry import Registration
    from tierstore.store import StoreConfig, TierStore
    store = TierStore(StoreConfig(arena_bytes=1 << 20, disk_path=str(tmp_path / "kv"), disk_bytes=0))
    try:
        store.register(Registration(NS, "tiny", 16, "bytes", 0, 4 * KiB))
        served = MatchSocket(store, tmp_path / "store.sock.match")
        served.start()
        conns = [Conn(str(served.path)) for _ in range(3)]
        for conn in conns:
            assert conn.call(tierstore_pb2.MatchRequest(namespace=NS, page_hashes=[h(1)])).code == 0
        threads = [t for t in threading.enumerate() if t.name.startswith("ignis-match")]
        assert len(threads) == 4  # the acceptor and one per connection
        served.close()
        assert not any(t.is_alive() for t in threads) and not served.path.exists()
        assert all(conn.closed_by_store() for conn in conns)
        for conn in conns:
            conn.close()
    finally:
        store.close()
