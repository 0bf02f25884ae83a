"""The engine is a trust boundary: a private Unix socket by default, TCP only with the shared secret
(every call but health, the response store and ListState included), and the gateway reaching it either
way. Real processes (tests/services.py) on real sockets; the server half is common/secret_auth.py, as
the tierstore's (tests/test_tierstore_trust.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.bearer import BearerInterceptor, read_secret
from common.launch import ROOT
from ignis.v1 import engine_pb2, engine_pb2_grpc
from other_user import NOBODY
from services import RunningService, start_engine, start_gateway

MODEL = "trusted"
ENGINE_ARGS = ["--served-model-name", MODEL]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def make_request(max_tokens: int = 2) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=uuid.uuid4().hex, model=MODEL, token_ids=engine_pb2.TokenIds(ids=[1, 2, 3]),
                                      sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))


def listening_tcp_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (from /proc: its socket inodes in LISTEN state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture(scope="module")
def secret_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("engine-secret")
    os.chmod(folder, 0o700)
    return folder


@pytest.fixture(scope="module")
def tcp_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, secret_dir: Path
               ) -> Iterator[RunningService]:
    """An engine on its socket and on TCP; its secret file does not exist before it starts."""
    workdir = tmp_path_factory.mktemp("tcp-engine")
    engine = start_engine(workdir, str(tiny_model_dir),
                          [*ENGINE_ARGS, "--port", "0", "--secret-file", str(secret_dir / "engine.secret")])
    try:
        yield engine
    finally:
        assert engine.stop() == 0, engine.log()


def test_by_default_the_engine_serves_a_private_unix_socket_and_no_tcp_port(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    engine = start_engine(tmp_path, str(tiny_model_dir), ENGINE_ARGS)
    try:
        assert engine.address.startswith("unix:") and engine.port == 0
        socket = Path(engine.address.removeprefix("unix:"))
        assert stat.S_ISSOCK(socket.stat().st_mode)
        assert mode(socket) == 0o600 and mode(socket.parent) == 0o700
        assert listening_tcp_ports(engine.process.pid) == []
        with grpc.insecure_channel(engine.address) as channel:  # this user, over the socket: no secret needed
            stub = engine_pb2_grpc.EngineStub(channel)
            assert [m.id for m in stub.ListModels(engine_pb2.ListModelsRequest()).models] == [MODEL]
            assert list(stub.Generate(make_request()))[-1].HasField("usage")
    finally:
        assert engine.stop() == 0, engine.log()
    assert not socket.exists()  # removed on shutdown


def test_tcp_without_a_secret_file_does_not_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited with 2") as info:
        start_engine(tmp_path, str(tiny_model_dir), [*ENGINE_ARGS, "--port", "0"])
    assert "engine.secret_file" in str(info.value)


def test_a_tcp_engine_creates_its_secret_file_private(tcp_engine: RunningService, secret_dir: Path) -> None:
    secret = secret_dir / "engine.secret"
    assert mode(secret) == 0o600 and len(read_secret(secret)) >= 32
    assert tcp_engine.port and tcp_engine.port in listening_tcp_ports(tcp_engine.process.pid)


def test_over_tcp_every_call_but_health_needs_the_secret(tcp_engine: RunningService, secret_dir: Path) -> None:
    tcp = f"127.0.0.1:{tcp_engine.port}"
    with grpc.insecure_channel(tcp) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        calls: dict[str, Callable[[], object]] = {
            "Generate": lambda: list(stub.Generate(make_request())),
            "GenerateSession": lambda: list(stub.GenerateSession(iter([]))),
            "GetResponse": lambda: stub.GetResponse(engine_pb2.GetResponseRequest(id="resp_x", scope="s")),
            "PutResponse": lambda: stub.PutResponse(engine_pb2.PutResponseRequest(id="resp_x", scope="s",
                                                                                  record=b"{}")),
            "DeleteResponse": lambda: stub.DeleteResponse(engine_pb2.DeleteResponseRequest(id="resp_x", scope="s")),
            "ListState": lambda: stub.ListState(engine_pb2.ListStateRequest()),
            "ListModels": lambda: stub.ListModels(engine_pb2.ListModelsRequest()),
            "Tokenize": lambda: stub.Tokenize(engine_pb2.TokenizeRequest(text="hi")),
            "GetStats": lambda: stub.GetStats(engine_pb2.GetStatsRequest()),
        }
        assert {name: code_of(call) for name, call in calls.items()} == \
            {name: grpc.StatusCode.UNAUTHENTICATED for name in calls}
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # container probes carry no secret
    wrong = grpc.intercept_channel(grpc.insecure_channel(tcp), BearerInterceptor(b"w" * 64))
    with wrong:
        assert code_of(lambda: engine_pb2_grpc.EngineStub(wrong).ListState(engine_pb2.ListStateRequest())) \
            == grpc.StatusCode.UNAUTHENTICATED
    secret = read_secret(secret_dir / "engine.secret")
    with grpc.intercept_channel(grpc.insecure_channel(tcp), BearerInterceptor(secret)) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        engine_id = stub.ListModels(engine_pb2.ListModelsRequest()).engine_id
        assert list(stub.Generate(make_request()))[-1].HasField("usage")
        rid = f"resp_{engine_id}_{uuid.uuid4().hex}"
        stub.PutResponse(engine_pb2.PutResponseRequest(id=rid, scope="s", record=b'{"a": 1}'))
        assert stub.GetResponse(engine_pb2.GetResponseRequest(id=rid, scope="s")).record == b'{"a": 1}'
        assert stub.DeleteResponse(engine_pb2.DeleteResponseRequest(id=rid, scope="s")).deleted
        stub.ListState(engine_pb2.ListStateRequest())


def chat_through(gateway: RunningService) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    return httpx.post(f"http://{gateway.address}/v1/chat/completions", json=body, timeout=120).status_code


def test_the_gateway_reaches_the_engine_over_tcp_with_the_secret_and_over_its_socket(
        tcp_engine: RunningService, secret_dir: Path, tmp_path: Path) -> None:
    for name, engines, args in (
            ("tcp", [f"127.0.0.1:{tcp_engine.port}"], ["--engine-secret-file", str(secret_dir / "engine.secret"),
                                                        "--upstream", "grpc-session"]),
            ("tcp-calls", [f"127.0.0.1:{tcp_engine.port}"], ["--engine-secret-file",
                                                              str(secret_dir / "engine.secret"), "--upstream", "calls"]),
            ("unix", [tcp_engine.address], [])):
        gateway = start_gateway(tmp_path / name, engines, args)
        try:
            assert chat_through(gateway) == 200, gateway.log()
            [engine] = httpx.get(f"http://{gateway.address}/health", timeout=10).json()["engines"]
            assert engine["healthy"] is True and engine["address"] == engines[0]
        finally:
            assert gateway.stop() == 0, gateway.log()


def test_a_gateway_without_the_secret_gets_nothing_over_tcp(tcp_engine: RunningService, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, [f"127.0.0.1:{tcp_engine.port}"])
    try:
        assert chat_through(gateway) in (500, 503)  # the engine refuses it: a configuration error, not the client's
        assert "UNAUTHENTICATED" in gateway.log() and "without --engine-secret-file" in gateway.log()
    finally:
        assert gateway.stop() == 0, gateway.log()


OTHER_USER = textwrap.dedent("""
    import sys, grpc
    from ignis.v1 import engine_pb2, engine_pb2_grpc
    out = []
    for address in sys.argv[1:]:
        with grpc.insecure_channel(address) as channel:
            try:
                engine_pb2_grpc.EngineStub(channel).ListState(engine_pb2.ListStateRequest(), timeout=10)
                out.append("answered")
            except grpc.RpcError as exc:
                out.append(exc.code().name)
    print(" ".join(out))
""")


@pytest.mark.skipif(os.getuid() != 0, reason="becoming another user needs root")
def test_another_user_gets_nothing_over_tcp_or_the_socket(tcp_engine: RunningService) -> None:
    """As `nobody`: the TCP port refuses ListState (recent request ids) without the secret, and the
    socket (0600 in a 0700 folder) cannot be connected to at all."""
    tcp = f"127.0.0.1:{tcp_engine.port}"
    result = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                             sys.executable, "-c", OTHER_USER, tcp, tcp_engine.address],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["UNAUTHENTICATED", "UNAVAILABLE"]
