"""--max-connections-per-client (issue 49, item 10): one client address cannot take the gateway's whole
connection budget. Before it, one peer holding --max-connections half-sent request heads locked every
other client out (503) until the header timeout.

Real sockets on a real gateway: 127.0.0.1 holds half-sent heads up to its limit, its next connection is
answered 429 and closed, and 127.0.0.2 (Linux routes all of 127/8 to lo) is served meanwhile. Nothing
here waits on a clock: each step polls the gateway's own gauge of open connections."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets.sync.client

from gateway.__main__ import parse_args
from gateway.client_connections import ClientConnections
from services import RunningService, start_gateway
from test_gateway_hardening import read_until_closed

MODEL = "ignis-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HOLDER, OTHER = "127.0.0.1", "127.0.0.2"


def other_client(gateway: RunningService) -> httpx.Client:
    """An HTTP client whose connections come from 127.0.0.2."""
    return httpx.Client(base_url=f"http://{gateway.address}", timeout=60,
                        transport=httpx.HTTPTransport(local_address=OTHER))


def connect(gateway: RunningService, source: str) -> socket.socket:
    host, port = gateway.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60, source_address=(source, 0))


def error_of(answer: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    return error


def metric(http: httpx.Client, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_for(http: httpx.Client, name: str, value: float) -> None:
    """Poll a gauge until it reads `value` (connections open and close asynchronously at the server);
    the deadline only ends a test that would otherwise hang."""
    deadline = time.monotonic() + 120
    while metric(http, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value} (at {metric(http, name)})"
        time.sleep(0.02)


OPEN = "ignis_gateway_connections_open"
PER_CLIENT = 'ignis_gateway_connections_refused_total{limit="per_client"}'
TOTAL = 'ignis_gateway_connections_refused_total{limit="total"}'


@pytest.fixture(params=["httptools", "h11"])
def gateway(request: pytest.FixtureRequest, engine: RunningService, tmp_path: Path) -> Iterator[RunningService]:
    # A budget of 6 connections, 3 per client address; heads are never timed out during the test.
    service = start_gateway(tmp_path, [engine.address], [
        "--max-connections", "6", "--max-connections-per-client", "3", "--header-timeout", "600",
        "--fault-log-interval", "3600", "--http", request.param])
    yield service
    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log(), service.log()


def test_one_address_cannot_take_the_whole_budget(gateway: RunningService) -> None:
    held: list[socket.socket] = []
    try:
        with other_client(gateway) as other:
            wait_for(other, OPEN, 1)  # this client's own connection (start-up probes closed)
            for _ in range(3):  # 127.0.0.1 takes its share with half-sent heads
                sock = connect(gateway, HOLDER)
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-ty")
                held.append(sock)
            wait_for(other, OPEN, 4)
            with connect(gateway, HOLDER) as extra:  # and is refused past it, at once, with an answer saying why
                answer = read_until_closed(extra)
            assert answer.startswith(b"HTTP/1.1 429 "), answer
            assert b"retry-after: 1\r\n" in answer.lower() and b"connection: close\r\n" in answer.lower()
            error = error_of(answer)
            assert error["code"] == "rate_limit_exceeded" and "3 connections" in error["message"], error
            with connect(gateway, HOLDER) as extra:
                extra.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                try:  # the answer is best effort: closed with a request unread, the socket may be reset first
                    answer = read_until_closed(extra)
                    assert answer == b"" or answer.startswith(b"HTTP/1.1 429 "), answer
                except ConnectionResetError:
                    pass
            wait_for(other, OPEN, 4)  # the refused ones are gone, the held ones stay
            # 127.0.0.2 is served meanwhile, on its kept-alive connection and on new ones
            assert other.post("/v1/chat/completions", json=CHAT).status_code == 200
            with other_client(gateway) as second, other_client(gateway) as third:
                assert second.post("/v1/chat/completions", json=CHAT).status_code == 200
                assert third.get("/v1/models").status_code == 200
            assert metric(other, PER_CLIENT) == 2 and metric(other, TOTAL) == 0
            # 127.0.0.1 gets a connection again once it closes one of its own
            held.pop().close()
            wait_for(other, OPEN, 3)
            with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as holder:
                assert holder.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert metric(other, PER_CLIENT) == 2
    finally:
        for sock in held:
            sock.close()
    assert gateway.stop() == 0, gateway.log()
    summaries = [line for line in gateway.log().splitlines() if "per-client" in line]
    assert len(summaries) == 1, gateway.log()
    assert "refused 2 over the per-client limit (--max-connections-per-client), 2 from 127.0.0.1" in summaries[0]


def test_the_total_limit_still_holds_for_many_addresses(gateway: RunningService) -> None:
    held: list[socket.socket] = []
    try:
        with other_client(gateway) as other:
            wait_for(other, OPEN, 1)
            for source in ("127.0.0.3", "127.0.0.3", "127.0.0.4", "127.0.0.4", "127.0.0.5"):
                held.append(connect(gateway, source))
            wait_for(other, OPEN, 6)
            with connect(gateway, "127.0.0.6") as extra:  # a new address, but the gateway is full
                answer = read_until_closed(extra)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert metric(other, TOTAL) == 1 and metric(other, PER_CLIENT) == 0
    finally:
        for sock in held:
            sock.close()


def test_websockets_count_and_give_their_room_back(gateway: RunningService) -> None:
    """An upgraded connection is its client's until it closes (the WebSocket protocol takes it over)."""
    url = f"ws://{gateway.address}/v1/responses"
    with other_client(gateway) as other:
        wait_for(other, OPEN, 1)
        for _ in range(2):  # twice: what the sockets held is given back when they close
            with contextlib.ExitStack() as sockets:  # websockets 17 wants its connections as context managers
                for _ in range(3):
                    sockets.enter_context(websockets.sync.client.connect(url, open_timeout=60))
                wait_for(other, OPEN, 4)
                with connect(gateway, HOLDER) as extra:
                    assert read_until_closed(extra).startswith(b"HTTP/1.1 429 ")
            wait_for(other, OPEN, 1)
        assert metric(other, PER_CLIENT) == 2
        with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as holder:
            assert holder.get("/v1/models").status_code == 200


def test_the_flag() -> None:
    assert parse_args(["--engine", "e:1"])[1].client_connection_limit == 1024  # half of --max-connections
    assert parse_args(["--engine", "e:1", "--max-connections", "100"])[1].client_connection_limit == 50
    assert parse_args(["--engine", "e:1", "--max-connections", "1"])[1].client_connection_limit == 1
    assert parse_args(["--engine", "e:1", "--max-connections-per-client", "7"])[1].client_connection_limit == 7
    assert parse_args(["--engine", "e:1", "--max-connections-per-client", "0"])[1].client_connection_limit == 0
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e:1", "--max-connections-per-client", "-1"])


def test_the_tally() -> None:
    clients = ClientConnections(2)
    assert clients.take("10.0.0.1") and clients.take("10.0.0.1") and not clients.take("10.0.0.1")
    assert clients.take("::1") and clients.held("10.0.0.1") == 2 and clients.held("::1") == 1
    clients.check_integrity(open_connections=3)
    clients.give_back("10.0.0.1")
    assert clients.take("10.0.0.1")  # room again
    for address in ("10.0.0.1", "10.0.0.1", "::1"):
        clients.give_back(address)
    assert clients.held("10.0.0.1") == 0 and clients.held("::1") == 0
    clients.check_integrity(open_connections=0)
    with pytest.raises(RuntimeError, match="this is a bug"):
        clients.give_back("::1")
