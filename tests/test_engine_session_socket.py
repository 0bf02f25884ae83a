"""The engine's session socket (engine/session_socket.py) against a real engine process: its calls
stream what the gRPC session streams, closing a connection frees its work, a bad frame ends only
its own connection, another user cannot use it; and the gateway's end (gateway/session_socket.py)
goes over gRPC when the socket cannot be used."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct
from collections import defaultdict
from collections.abc import Iterator

import grpc
import pytest

from common.frames import recv_frame, send_frame
from gateway.session import EngineSession
from gateway.session_socket import on_this_host
from ignis.v1 import engine_pb2, engine_pb2_grpc
from other_user import as_nobody, open_to_everyone
from services import RunningService
from test_engine_service import collect, make_prompt, make_request, text_of, tokens_of, wait_idle


@pytest.fixture(scope="module")
def stub(engine: RunningService) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


@pytest.fixture(scope="module")
def path(stub: engine_pb2_grpc.EngineStub) -> str:
    found = stub.ListModels(engine_pb2.ListModelsRequest(), timeout=10).session_socket
    assert found, "the engine serves a session socket by default"
    return found


class SocketSession:
    """One connection to the session socket, speaking its frames."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(path)

    def call(self, tag: int, request: engine_pb2.GenerateRequest) -> None:
        message = engine_pb2.SessionRequest(tag=tag, call=engine_pb2.SessionCall(request=request))
        send_frame(self.sock, message.SerializeToString())

    def until_ended(self, tags: set[int]) -> tuple[dict[int, list[engine_pb2.GenerateResponse]],
                                                   dict[int, engine_pb2.SessionEnd]]:
        messages: dict[int, list[engine_pb2.GenerateResponse]] = defaultdict(list)
        ends: dict[int, engine_pb2.SessionEnd] = {}
        while not tags <= set(ends):
            payload = recv_frame(self.sock)
            assert payload is not None, "the engine closed the connection"
            for event in engine_pb2.SessionResponse.FromString(payload).events:
                if event.HasField("end"):
                    ends[event.tag] = event.end
                else:
                    messages[event.tag].append(event.response)
        return messages, ends

    def closed_by_engine(self) -> bool:
        try:
            while chunk := self.sock.recv(1 << 16):
                del chunk
            return True
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def test_it_is_private_and_streams_what_a_generate_call_streams(stub: engine_pb2_grpc.EngineStub, path: str) -> None:
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    requests = {tag: make_request(make_prompt(20 + 5 * tag, seed=tag), temperature=0, max_tokens=10, ignore_eos=True)
                for tag in range(1, 5)}
    requests[5] = make_request(text="Hello", temperature=0, max_tokens=4, n=2, logprobs=True, ignore_eos=True)
    conn = SocketSession(path)
    try:
        for tag, request in requests.items():
            conn.call(tag, request)
        messages, ends = conn.until_ended(set(requests))
    finally:
        conn.close()
    assert {tag: end.code for tag, end in ends.items()} == {tag: 0 for tag in requests}
    for tag, request in requests.items():
        by_choice: dict[int, list[engine_pb2.GenerateResponse]] = defaultdict(list)
        for msg in messages[tag]:
            by_choice[msg.index].append(msg)
        alone = collect(stub, request)
        assert {c: (tokens_of(m), text_of(m)) for c, m in by_choice.items()} == \
            {c: (tokens_of(m), text_of(m)) for c, m in alone.items()}


def test_a_bad_call_ends_with_its_status_and_the_connection_goes_on(path: str) -> None:
    conn = SocketSession(path)
    try:
        conn.call(1, make_request(text="x", max_tokens=10 ** 7))
        conn.call(2, make_request(text="fine", temperature=0, max_tokens=3, ignore_eos=True))
        messages, ends = conn.until_ended({1, 2})
    finally:
        conn.close()
    assert ends[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and ends[2].code == 0
    assert len(tokens_of(messages[2])) == 3


def test_closing_the_connection_frees_its_work(stub: engine_pb2_grpc.EngineStub, path: str) -> None:
    conn = SocketSession(path)
    endless = make_request(make_prompt(16, seed=11), temperature=0, max_tokens=2000, ignore_eos=True)
    conn.call(1, endless)
    conn.call(2, endless)
    assert recv_frame(conn.sock) is not None  # both are running
    conn.close()  # the gateway goes away with both calls open
    idle = wait_idle(stub)
    assert idle.page_pool.used_pages == 0 and idle.running.interactive == 0


@pytest.mark.parametrize("bad", [
    struct.pack("<I", 7) + b"\xff" * 7,  # not a SessionRequest
    struct.pack("<I", 0xFFFFFFFF),  # a frame over the bound
    struct.pack("<I", 50) + b"\x08",  # a frame that never completes: the gateway is gone
])
def test_a_bad_frame_ends_its_own_connection_only(stub: engine_pb2_grpc.EngineStub, path: str, bad: bytes) -> None:
    other = SocketSession(path)
    conn = SocketSession(path)
    try:
        other.call(1, make_request(make_prompt(16, seed=12), temperature=0, max_tokens=40, ignore_eos=True))
        conn.call(1, make_request(make_prompt(16, seed=13), temperature=0, max_tokens=2000, ignore_eos=True))
        conn.sock.sendall(bad)
        if bad.startswith(struct.pack("<I", 50)):
            conn.sock.shutdown(socket.SHUT_WR)
        assert conn.closed_by_engine()
        messages, ends = other.until_ended({1})
        assert ends[1].code == 0 and len(tokens_of(messages[1])) == 40
    finally:
        conn.close()
        other.close()
    assert wait_idle(stub).page_pool.used_pages == 0  # the bad connection's call was freed too


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_another_user_cannot_use_it(path: str) -> None:
    def use() -> bytes:
        conn = SocketSession(path)
        conn.call(1, make_request(text="whose?", max_tokens=2))
        return b"answered" if recv_frame(conn.sock) is not None else b"hung up"

    assert as_nobody(use) == b"refused"  # the socket is 0600 in a 0700 folder
    with open_to_everyone(path):  # past the file modes, the engine's own check (SO_PEERCRED) hangs up
        assert as_nobody(use) == b"hung up"
    conn = SocketSession(path)  # and its own user is still served
    try:
        conn.call(1, make_request(text="mine", temperature=0, max_tokens=2, ignore_eos=True))
        assert conn.until_ended({1})[1][1].code == 0
    finally:
        conn.close()


def test_the_gateway_goes_over_grpc_when_the_socket_cannot_be_used(engine: RunningService,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    async def one_call(socket_path: str) -> tuple[str, str, list[int]]:
        channel = grpc.aio.insecure_channel(engine.address)
        session = EngineSession(engine_pb2_grpc.EngineStub(channel), 1 << 20, lambda: None)
        session.socket_path = socket_path
        try:
            call = session.generate(make_request(text="either way", temperature=0, max_tokens=3, ignore_eos=True),
                                    timeout=60)
            tokens = [t for msg in [m async for m in call] for t in msg.token_ids]
            return session.transport, session.socket_path, tokens
        finally:
            await session.close()
            await channel.close()

    with caplog.at_level(logging.WARNING, "ignis.gateway"):
        transport, left, tokens = asyncio.run(one_call("/nonexistent/session.sock"))
    assert transport == "grpc" and left == "" and len(tokens) == 3
    assert "cannot be used" in caplog.text


@pytest.mark.parametrize("address, here", [
    ("127.0.0.1:50051", True), ("localhost:1", True), ("[::1]:9", True), ("unix:/tmp/e.sock", True),
    ("ipv4:127.0.0.2:80", True), ("10.0.0.7:50051", False), ("engine-0.engines:50051", False),
    ("[2001:db8::1]:5", False),
])
def test_a_socket_is_only_taken_from_an_engine_on_this_host(address: str, here: bool) -> None:
    assert on_this_host(address) is here
