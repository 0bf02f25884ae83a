"""The tierstore is a trust boundary: a private Unix socket by default, TCP only with the shared
secret, one server per port, registrations that cannot lock the owner out, no state names in logs.

Real processes (tests/services.py) on real sockets; the engine's side is engine/tiers/client.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.launch import ROOT, free_port
from engine.tiers.client import TierClient
from ignis.v1 import common_pb2, tierstore_pb2, tierstore_pb2_grpc
from services import RunningService, start_tierstore
from tierstore.client import TierStoreClient

KiB = 1024
NS = bytes(range(16))
LAYOUT = '{"engine": "layout"}'


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def make_data(i: int, n: int = 64 * KiB) -> bytes:
    return np.random.default_rng(i).bytes(n)


def make_meta(i: int, n: int = 64 * KiB, ns: bytes = NS) -> tierstore_pb2.StateMetadata:
    return tierstore_pb2.StateMetadata(namespace=ns, tokens=16, kind=common_pb2.REUSE_KIND_CHECKPOINT,
                                       request_class=common_pb2.REQUEST_CLASS_AGENT,  # type: ignore[arg-type]
                                       page_hashes=[h(i)], nbytes=n, engine_tag=b"T" * 32)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_client(address: str, clock: Clock | None = None, secret_file: str = "", layout: str = LAYOUT) -> TierClient:
    """The engine's client, as engine/builder.py makes it."""
    return TierClient(address, model="m", page_size=16, layout=layout, kv_bytes_per_token=1024, fixed_state_bytes=0,
                      timeout=5.0, retry_seconds=5.0, clock=clock or Clock(), secret_file=secret_file)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secrets" / "tierstore.secret"  # missing: the tierstore creates it
    return path


@pytest.fixture
def tcp_store(tmp_path: Path, secret: Path) -> Iterator[RunningService]:
    service = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", "1MiB", "--kv-disk-path",
                                                str(tmp_path / "kv"), "--kv-disk-bytes", "4MiB",
                                                "--port", "0", "--secret-file", str(secret)])
    yield service
    assert service.stop() == 0, service.log()


def run_tierstore(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """A tierstore that must refuse to start: its exit status and log."""
    return subprocess.run([sys.executable, "-m", "tierstore", "--kv-host-pool-bytes", "1MiB", "--kv-disk-bytes", "0",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp_path)})


# ---------------------------------------------------------------- the socket

def test_by_default_the_store_listens_on_a_private_unix_socket_only(tmp_path: Path) -> None:
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", "1MiB", "--kv-disk-bytes", "0"])
    try:
        assert store.socket is not None and store.address == f"unix:{store.socket}" and store.port == 0
        assert stat.S_ISSOCK(os.stat(store.socket).st_mode)
        assert mode(store.socket) == 0o600 and mode(store.socket.parent) == 0o700
        with TierStoreClient(store.address) as c:  # the socket's mode is the check: no secret
            reply = c.register(NS, page_size=16, layout=LAYOUT)
            c.store(h(1), make_data(1), make_meta(1))
            assert c.get(h(1))[1] == make_data(1)
        assert mode(Path(reply.arena_path)) == 0o600
        assert "TCP" not in store.log()
    finally:
        assert store.stop() == 0, store.log()
    assert not store.socket.exists()  # removed at shutdown


def test_a_second_tierstore_on_the_same_socket_is_refused(tmp_path: Path) -> None:
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", "1MiB", "--kv-disk-bytes", "0"])
    try:
        assert store.socket is not None
        second = run_tierstore(["--socket", str(store.socket)], tmp_path)
        assert second.returncode == 2 and "another tierstore serves" in second.stderr
        with TierStoreClient(store.address) as c:  # gRPC unlinks a socket it binds: ours must still answer
            assert c.stats().arena_bytes_total == 1 << 20
    finally:
        assert store.stop() == 0, store.log()


def test_a_socket_folder_others_may_enter_or_own_is_refused(tmp_path: Path) -> None:
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    os.chmod(open_folder, 0o755)
    result = run_tierstore(["--socket", str(open_folder / "ts.sock")], tmp_path)
    assert result.returncode == 2 and "open to other users" in result.stderr and "chmod 700" in result.stderr
    missing = tmp_path / "made" / "here"
    ok = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", "1MiB", "--kv-disk-bytes", "0",
                                           "--socket", str(missing / "ts.sock")])
    try:
        assert mode(missing) == 0o700 and ok.socket == missing / "ts.sock"  # created private
    finally:
        ok.stop()
    nobody = tmp_path / "nobody"
    nobody.mkdir(mode=0o700)
    os.chown(nobody, 65534, 65534)  # another user's folder (the tests run as root)
    result = run_tierstore(["--socket", str(nobody / "ts.sock")], tmp_path)
    assert result.returncode == 2 and "belongs to uid 65534" in result.stderr


# ---------------------------------------------------------------- TCP and the secret

def test_tcp_without_a_secret_file_does_not_start(tmp_path: Path) -> None:
    result = run_tierstore(["--socket", "", "--port", "0"], tmp_path)
    assert result.returncode == 2 and "tierstore.secret_file" in result.stderr


def test_over_tcp_every_call_but_health_needs_the_secret(tcp_store: RunningService, secret: Path) -> None:
    assert tcp_store.port > 0
    assert mode(secret) == 0o600 and len(secret.read_bytes().strip()) == 64  # generated: 32 random bytes, hex
    tcp = f"127.0.0.1:{tcp_store.port}"
    with TierStoreClient(tcp_store.address) as owner:  # the socket
        owner.register(NS, page_size=16, layout=LAYOUT)
        owner.store(h(1), make_data(1), make_meta(1))
    for given in (None, b"not the secret at all"):
        with TierStoreClient(tcp, secret=given, timeout=10) as intruder:
            for call in (lambda: intruder.get(h(1)), lambda: intruder.drop(h(1)), intruder.stats,
                         lambda: intruder.put(h(2), bytes(4096), make_meta(2, 4096)),
                         lambda: intruder.register(NS, page_size=16, layout="squat"),
                         lambda: intruder.match(NS, [h(1)]), lambda: intruder.acquire(h(1))):
                assert code_of(call) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(tcp) as channel:  # reflection too; health stays open for container probes
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        assert code_of(lambda: list(reflection)) == grpc.StatusCode.UNAUTHENTICATED
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    with TierStoreClient(tcp, secret=secret.read_bytes().strip(), timeout=10) as peer:
        meta, data = peer.get(h(1))
        assert data == make_data(1) and meta.engine_tag == b"T" * 32  # stored and returned verbatim
        peer.put(h(2), make_data(2), make_meta(2))
        assert peer.stats().states_ram == 2


def test_the_engine_client_sends_the_secret_over_tcp_and_counts_a_wrong_one(
        tcp_store: RunningService, secret: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ignis.engine.tiers")
    tcp = f"127.0.0.1:{tcp_store.port}"
    client = make_client(tcp, secret_file=str(secret))
    try:
        assert client.ensure(NS) and client.usable and client.arena is not None
        reply = client.reserve(h(5), 4096, common_pb2.REQUEST_CLASS_AGENT)
        assert reply is not None
    finally:
        client.close()
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("0123456789abcdef0123456789abcdef\n")
    clock = Clock()
    client = make_client(tcp, clock, secret_file=str(wrong))
    try:
        for _ in range(3):
            assert not client.ensure(NS)
            clock.t += 10  # past the backoff: it tries again, fresh channel, secret read again
        assert not client.usable and client.unusable_reason == "unreachable" and client.unavailable_events == 1
        assert len([r for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]) == 1  # logged once
        wrong.write_bytes(secret.read_bytes())  # the secret rotated into place: picked up at the next retry
        assert client.ensure(NS) and client.usable
    finally:
        client.close()
    short = tmp_path / "short.secret"
    short.write_text("abc")
    with pytest.raises(ValueError, match="at least 16"):
        make_client(tcp, secret_file=str(short))


# ---------------------------------------------------------------- one server per port

def test_a_port_in_use_is_refused_for_the_engine_and_the_tierstore(tcp_store: RunningService, secret: Path,
                                                                    tmp_path: Path) -> None:
    from engine.server import EngineService
    from engine.server import create_server as create_engine_server
    from tierstore.server import TierStoreService
    from tierstore.server import create_server as create_tierstore_server

    taken = tcp_store.port
    second = run_tierstore(["--socket", str(tmp_path / "other.sock"), "--port", str(taken), "--secret-file",
                            str(secret)], tmp_path)
    assert second.returncode == 2 and f"127.0.0.1:{taken}" in second.stderr and "in use" in second.stderr

    async def bind_twice() -> None:
        port = free_port()
        first, bound, _ = create_engine_server(EngineService("m"), f"127.0.0.1:{port}")
        await first.start()
        try:
            assert bound == port
            with pytest.raises(OSError, match=f"cannot bind the engine to 127.0.0.1:{port}.*in use"):
                create_engine_server(EngineService("m"), f"127.0.0.1:{port}")
            with pytest.raises(OSError, match=f"cannot bind the tierstore to 127.0.0.1:{port}.*in use"):
                create_tierstore_server(TierStoreService(None), f"127.0.0.1:{port}")  # type: ignore[arg-type]
        finally:
            await first.stop(0)

    asyncio.run(bind_twice())


# ---------------------------------------------------------------- registration

def test_a_squatted_namespace_is_taken_back_and_a_refusal_is_retried(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Whoever registers first with another layout cannot lock the engine out: with nothing of theirs on
    disk the engine's registration replaces theirs; with states on disk the engine is refused, says so
    once, and asks again after its backoff: never device-only for good."""
    caplog.set_level(logging.INFO, logger="ignis.engine.tiers")
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", "256KiB", "--kv-disk-path",
                                              str(tmp_path / "kv"), "--kv-disk-bytes", "4MiB"])
    clock = Clock()
    engine = make_client(store.address, clock)
    try:
        with TierStoreClient(store.address) as squatter:
            squatter.register(NS, page_size=16, layout="squat")
            assert engine.ensure(NS) and engine.usable  # nothing stored under "squat": taken back
            squatter.register(NS, page_size=16, layout="squat")  # and squatted again, states on disk this time
            for i in range(1, 6):  # 5 x 64 KiB through a 256 KiB arena: the first ones go to disk
                squatter.store(h(i), make_data(i), make_meta(i))
            assert squatter.stats().states_disk >= 1
            engine.same_instance("")  # as a reply from another instance would: register again
            for _ in range(3):
                assert not engine.ensure(NS)
                assert engine.match(NS, [h(1)], None) == ([], [])  # nothing read while refused
            assert not engine.usable and "refused" in (engine.unusable_reason or "")
            assert len([r for r in caplog.records if "refused namespace" in r.getMessage()]) == 1
            for i in range(1, 6):
                squatter.drop(h(i))
            assert not engine.ensure(NS)  # still inside the backoff: not asked yet
            clock.t += 6
            assert engine.ensure(NS) and engine.usable  # asked again, and accepted
            assert [r.getMessage() for r in caplog.records if "accepted namespace" in r.getMessage()]
    finally:
        engine.close()
        assert store.stop() == 0, store.log()


# ---------------------------------------------------------------- logs

def test_state_names_never_reach_the_log_in_full(tmp_path: Path) -> None:
    store = start_tierstore(tmp_path / "ts", ["--kv-host-pool-bytes", "256KiB", "--kv-disk-path",
                                              str(tmp_path / "kv"), "--kv-disk-bytes", "256KiB"],
                            env={"IGNIS_LOG_LEVEL": "INFO"})
    names = [h(i) for i in range(1, 12)]
    try:
        with TierStoreClient(store.address) as c:
            c.register(NS, page_size=16, layout=LAYOUT)
            for i in range(1, 12):  # spills, evictions, restores: every line that names a state
                c.store(h(i), make_data(i), make_meta(i))
            lease = c.acquire(h(6))  # on disk by now: restored
            assert lease.from_tier == common_pb2.REUSE_TIER_DISK
            c.release(lease.lease_id)
            c.drop(h(10))
    finally:
        store.stop()
    log = store.log()
    assert "spilled state=" in log and "evicted state=" in log and "restored state=" in log
    assert re.search(r"state=[0-9a-f]{8} ", log)  # a short prefix says which one
    for name in [*names, NS]:
        assert name.hex() not in log
