"""Bad input is a 4xx, never a 500, and no client can hurt another: a real engine and real gateways.

Unpaired surrogates, deep nesting, reserved template kwargs, other content types, negative seeds,
bodies over --max-request-bytes, slow clients (--header-timeout, --body-timeout), the connection
limit (--max-connections), /metrics behind the key (--metrics-auth), and keep-alive connections
that survive every error answer (raw sockets, parsed with h11).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import resource
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import h11
import httpx
import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.__main__ import parse_args
from gateway.app import create_app
from gateway.body import MAX_JSON_DEPTH, parse_json_object
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError
from gateway.http_protocol import protocol_class
from services import RunningService, start_gateway

MODEL = "ignis-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LIMIT = 64 * 1024  # --max-request-bytes of the module's gateway
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    # Short timeouts so slow clients are closed within the test; the summary line comes at shutdown.
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address], [
        "--header-timeout", "0.5", "--body-timeout", "0.5", "--max-request-bytes", "64KiB",
        "--fault-log-interval", "3600"])
    yield service
    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log(), service.log()


@pytest.fixture(scope="module")
def http(gateway: RunningService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as client:
        yield client


# ---------------------------------------------------------------- helpers


class RawHTTP:
    """One TCP connection, requests written by hand and answers parsed with h11 (a client's view)."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.conn = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.sock.close()

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
                ) -> tuple[int, dict[str, str], bytes]:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        hdrs = [("host", "gateway"), ("content-length", str(len(body))), *(headers or {}).items()]
        self.sock.sendall(self.conn.send(h11.Request(method=method, target=path, headers=hdrs))
                          + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
        return self.read_response()

    def read_response(self) -> tuple[int, dict[str, str], bytes]:
        status, headers, body = 0, {}, b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, headers, body
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection before answering")


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def error_of(body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return dict(error)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None
                 ) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = error_of(response.content)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST a JSON text as written (so "\\ud800" escapes reach the gateway as a client sent them)."""
    return http.post(path, content=text.encode(), headers=JSON)


def metric(http: httpx.Client, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# ---------------------------------------------------------------- 1. unpaired surrogates


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "model": "\udfff"}, "model"),
    ("/v1/chat/completions", {**CHAT, "cache_salt": "tenant-\ud800"}, "cache_salt"),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", "\ud800"]}, "stop[1]"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f\udc00"}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs"),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", "\ud800"], "max_tokens": 2}, "prompt[1]"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "\ud800"}]}, "input[0].content"),
])
def test_unpaired_surrogates_are_400_naming_the_field(http: httpx.Client, path: str, body: dict[str, Any],
                                                     param: str) -> None:
    error = assert_error(post_raw(http, path, json.dumps(body)), 400, param=param)
    assert "unpaired surrogate" in error["message"]


def test_a_surrogate_pair_is_a_character_and_is_served(http: httpx.Client) -> None:
    text = json.dumps({**CHAT, "messages": [{"role": "user", "content": "smile \U0001F600"}]})
    assert "\\ud83d\\ude00" in text  # the escaped pair, which decodes to one astral character
    assert post_raw(http, "/v1/chat/completions", text).status_code == 200


# ---------------------------------------------------------------- 2. nesting depth


def nested(depth: int) -> str:
    """A chat body whose unknown field makes the whole text nest exactly `depth` levels."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return json.dumps(CHAT)[:-1] + f', "x": {inner}}}'


def test_nesting_up_to_the_bound_is_served_and_beyond_it_is_400(http: httpx.Client) -> None:
    assert post_raw(http, "/v1/chat/completions", nested(MAX_JSON_DEPTH)).status_code == 200
    error = assert_error(post_raw(http, "/v1/chat/completions", nested(MAX_JSON_DEPTH + 1)), 400)
    assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
    for text in (nested(990), "[" * 50_000, '{"a":' * 10_000):  # the review's RecursionError, and unclosed
        assert_error(post_raw(http, "/v1/chat/completions", text), 400)


@pytest.mark.parametrize("text", [
    '{"s": "' + "[" * 500 + '"}',  # brackets inside a string do not nest
    '{"s": "\\"' + "{" * 500 + '\\\\"}',  # nor after escaped quotes and backslashes
])
def test_brackets_inside_strings_are_not_nesting(text: str) -> None:
    assert parse_json_object(text.encode())["s"].endswith(("[", "\\"))


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": -Infinity}', '{"a": 1' + "0" * 5000 + "}", '\ufeff{"a": 1}'])
def test_not_quite_json_is_400(text: str) -> None:
    with pytest.raises(OpenAIError) as err:
        parse_json_object(text.encode())
    assert err.value.status_code == 400 and "not valid JSON" in err.value.message


def test_invalid_utf8_is_400() -> None:
    with pytest.raises(OpenAIError, match="not valid JSON"):
        parse_json_object(b'{"a": "\xff"}')


def test_numbers_too_large_for_a_float_are_400(http: httpx.Client) -> None:
    text = json.dumps(CHAT)[:-1] + ', "temperature": 1' + "0" * 400 + "}"
    assert_error(post_raw(http, "/v1/chat/completions", text), 400, param="temperature")


# ---------------------------------------------------------------- 3. chat_template_kwargs


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_template_kwargs_the_engine_sets_itself_are_400(http: httpx.Client, key: str) -> None:
    body = {**CHAT, "chat_template_kwargs": {key: [], "enable_thinking": False}}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, param=f"chat_template_kwargs.{key}")
    assert key in error["message"]


def test_other_template_kwargs_are_passed(http: httpx.Client) -> None:
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---------------------------------------------------------------- 4. content type, 6. keep-alive


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_declared_json_is_415_and_the_connection_serves_on(
        gateway: RunningService, content_type: str | None) -> None:
    raw = RawHTTP(gateway.address)
    try:
        headers = {"content-type": content_type} if content_type else {}
        status, _, body = raw.request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), headers)
        assert status == 415
        assert error_of(body)["code"] == "unsupported_media_type"
        status, _, _ = raw.request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), JSON)
        assert status == 200
    finally:
        raw.close()


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/vnd.openai+json"])
def test_json_media_types_are_accepted(http: httpx.Client, content_type: str) -> None:
    assert http.post("/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": content_type}
                     ).status_code == 200


def test_every_error_answer_keeps_the_connection(gateway: RunningService) -> None:
    raw = RawHTTP(gateway.address)
    try:
        bad = [
            ("POST", "/v1/chat/completions", b"{not json", 400),
            ("POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "\ud800"}).encode(), 400),
            ("POST", "/v1/chat/completions", nested(990).encode(), 400),
            ("POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "gpt-17"}).encode(), 404),
            ("GET", "/v1/chat/completions", b"", 405),
            ("POST", "/v1/chat/completions", json.dumps({**CHAT, "x": "y" * LIMIT}).encode(), 413),
        ]
        for method, path, body, status in bad:
            got, headers, answer = raw.request(method, path, body, JSON)
            assert got == status, answer
            assert headers.get("connection") != "close"
        assert raw.request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), JSON)[0] == 200
    finally:
        raw.close()


async def test_an_unexpected_error_is_one_logged_500_and_the_connection_survives(
        caplog: pytest.LogCaptureFixture) -> None:
    # The real app and protocol in this process, with one route that fails as a bug would.
    async def boom(request: Request) -> Response:
        raise RuntimeError("a bug")

    config = GatewayConfig(engines=["127.0.0.1:9"])  # no engine: /health answers 503, which is fine here
    app = create_app(config)
    app.router.routes.append(Route("/boom", boom))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on",
                                           http=protocol_class(config, app.state.gateway.faults,
                                                               app.state.gateway.metrics)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not serving.done()
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(sock=socket.create_connection(sock.getsockname()))
        conn = h11.Connection(h11.CLIENT)

        async def get(path: str) -> tuple[int, bytes]:
            if conn.our_state is h11.DONE:
                conn.start_next_cycle()
            writer.write(conn.send(h11.Request(method="GET", target=path, headers=[("host", "x")]))
                         + conn.send(h11.EndOfMessage()))
            status, body = 0, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    assert (b"connection", b"close") not in event.headers
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return status, body
                else:
                    raise AssertionError(event)

        with caplog.at_level(logging.INFO):
            status, body = await get("/boom")
            assert status == 500 and error_of(body)["code"] == "internal_error"
            status, _ = await get("/health")  # on the same connection
            assert status == 503
        writer.close()
    finally:
        server.should_exit = True
        await serving
    logged = [r for r in caplog.records if r.exc_info is not None]
    assert len(logged) == 1 and "unhandled error on GET /boom" in logged[0].getMessage()
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


# ---------------------------------------------------------------- 5. seeds


def test_a_negative_seed_is_accepted_and_reproducible(http: httpx.Client) -> None:
    body = {**CHAT, "max_tokens": 8, "temperature": 1.0, "seed": -5}
    first, second = (http.post("/v1/chat/completions", json=body) for _ in range(2))
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"] == second.json()["choices"][0]["message"]["content"]
    assert http.post("/v1/chat/completions", json={**body, "seed": -(2**63)}).status_code == 200


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_outside_int64_is_400(http: httpx.Client, seed: int) -> None:
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "seed": seed}), 400, param="seed")


# ---------------------------------------------------------------- 9. --max-request-bytes


def padded(size: int) -> bytes:
    """A valid chat body of exactly `size` bytes (padded with whitespace)."""
    text = json.dumps(CHAT).encode()
    return text[:-1] + b" " * (size - len(text)) + b"}"


def test_a_body_at_the_limit_is_served_and_one_byte_more_is_413(http: httpx.Client) -> None:
    assert http.post("/v1/chat/completions", content=padded(LIMIT), headers=JSON).status_code == 200
    error = assert_error(http.post("/v1/chat/completions", content=padded(LIMIT + 1), headers=JSON), 413,
                         code="request_too_large")
    assert str(LIMIT) in error["message"]


def test_a_chunked_body_over_the_limit_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is found while reading
        body = padded(4 * LIMIT)
        for start in range(0, len(body), 8192):
            yield body[start:start + 8192]

    assert_error(http.post("/v1/chat/completions", content=chunks(), headers=JSON), 413, code="request_too_large")


def test_max_request_bytes_takes_sizes() -> None:
    args, config = parse_args(["--engine", "e:1", "--max-request-bytes", "2MiB"])
    assert config.max_request_bytes == 2 << 20
    assert parse_args(["--engine", "e:1"])[1].max_request_bytes == 16 << 20
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e:1", "--max-request-bytes", "lots"])


# ---------------------------------------------------------------- 8. slow clients


def test_slow_clients_are_closed_while_others_are_served(engine: RunningService, tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, [engine.address], ["--header-timeout", "0.5", "--body-timeout", "0.5",
                                                    "--fault-log-interval", "3600"])
    slow: list[socket.socket] = []
    others: list[socket.socket] = []
    try:
        host, port = gw.address.rsplit(":", 1)
        for _ in range(20):
            sock = socket.create_connection((host, int(port)), timeout=60)
            sock.sendall(b"POST /v1/chat/comp")  # half a request line, then nothing
            slow.append(sock)
        silent = socket.create_connection((host, int(port)), timeout=60)  # connects, sends nothing
        trickle = socket.create_connection((host, int(port)), timeout=60)  # headers, then part of the body
        others = [silent, trickle]
        trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: 100\r\n\r\n{\"mod")
        with httpx.Client(base_url=f"http://{gw.address}", timeout=60) as http:
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200  # served meanwhile
            for sock in slow:
                answer = read_until_closed(sock)
                assert answer.startswith(b"HTTP/1.1 408 "), answer
                assert error_of(answer.partition(b"\r\n\r\n")[2])["code"] == "request_timeout"
            assert read_until_closed(silent) == b""  # nothing sent: closed without an answer
            answer = read_until_closed(trickle)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer.lower(), answer
            assert error_of(answer.partition(b"\r\n\r\n")[2])["code"] == "request_timeout"
            assert metric(http, 'ignis_gateway_slow_connections_closed_total{phase="headers"}') == 21
            assert metric(http, 'ignis_gateway_slow_connections_closed_total{phase="body"}') == 1
            assert http.get("/health").status_code == 200
    finally:
        for sock in slow + others:
            sock.close()
        assert gw.stop() == 0, gw.log()
    summaries = [line for line in gw.log().splitlines() if "slow connection" in line]
    assert len(summaries) == 1, gw.log()  # one line for the lot, at the end of the interval (here: shutdown)
    assert "closed 22 slow connections (21 sending headers, 1 sending a body)" in summaries[0]


def test_a_body_nobody_reads_is_drained_then_closed(gateway: RunningService, http: httpx.Client) -> None:
    before = metric(http, 'ignis_gateway_slow_connections_closed_total{phase="body"}')
    raw = RawHTTP(gateway.address)
    try:  # declared too large: answered 413 at once; the client sends a little of the body and stalls
        head = h11.Request(method="POST", target="/v1/chat/completions", headers=[
            ("host", "x"), ("content-type", "application/json"), ("content-length", str(10 * LIMIT))])
        raw.sock.sendall(raw.conn.send(head) + raw.conn.send(h11.Data(data=b" " * 1000)))
        status, _, body = raw.read_response()
        assert status == 413 and error_of(body)["code"] == "request_too_large"
        assert read_until_closed(raw.sock) == b""  # closed once the drain's deadline passed
    finally:
        raw.close()
    assert metric(http, 'ignis_gateway_slow_connections_closed_total{phase="body"}') == before + 1


def test_malformed_and_upgrade_requests_are_counted_not_logged(engine: RunningService, tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, [engine.address], ["--fault-log-interval", "3600"])
    try:
        host, port = gw.address.rsplit(":", 1)
        for _ in range(5):
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                assert read_until_closed(sock).startswith(b"HTTP/1.1 400 ")
        raw = RawHTTP(gw.address)
        try:
            for _ in range(3):  # uvicorn serves these as plain HTTP, with a warning each (WebSocket it takes up)
                upgrade = {"connection": "Upgrade", "upgrade": "h2c"}
                assert raw.request("GET", "/health", headers=upgrade)[0] == 200
        finally:
            raw.close()
    finally:
        assert gw.stop() == 0, gw.log()
    log = gw.log()
    assert not [line for line in log.splitlines()
                if "Invalid HTTP request" in line or "Unsupported upgrade" in line or "WebSocket library" in line]
    assert "answered 5 malformed HTTP requests with 400" in log and "served 3 Upgrade requests as plain HTTP" in log


def wait_for(http: httpx.Client, name: str, value: float) -> None:
    """Poll a gauge until it reads `value` (connections open and close asynchronously at the server)."""
    deadline = time.monotonic() + 60
    while metric(http, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_connections_beyond_the_limit_are_refused_with_503(engine: RunningService, tmp_path: Path) -> None:
    # All from 127.0.0.1: no per-client limit here (tests/test_gateway_client_limit.py has it).
    gw = start_gateway(tmp_path, [engine.address], ["--max-connections", "3", "--max-connections-per-client", "0",
                                                    "--header-timeout", "600", "--fault-log-interval", "3600"])
    held: list[socket.socket] = []
    try:
        host, port = gw.address.rsplit(":", 1)
        with httpx.Client(base_url=f"http://{gw.address}", timeout=60) as http:
            wait_for(http, "ignis_gateway_connections_open", 1)  # this client's own (start-up probes closed)
            held = [socket.create_connection((host, int(port)), timeout=60) for _ in range(2)]  # silent
            wait_for(http, "ignis_gateway_connections_open", 3)
            with socket.create_connection((host, int(port)), timeout=60) as extra:
                answer = read_until_closed(extra)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            error = error_of(answer.partition(b"\r\n\r\n")[2])
            assert error["code"] == "service_unavailable" and "3 connections" in error["message"]
            assert metric(http, 'ignis_gateway_connections_refused_total{limit="total"}') == 1
            for sock in held:
                sock.close()
            wait_for(http, "ignis_gateway_connections_open", 1)
            with httpx.Client(base_url=f"http://{gw.address}", timeout=60) as fresh:  # room again
                assert fresh.post("/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        for sock in held:
            sock.close()
        assert gw.stop() == 0, gw.log()
    assert "refused 1 at the connection limit" in gw.log()


def test_running_out_of_descriptors_is_counted_not_a_log_flood(engine: RunningService, tmp_path: Path) -> None:
    # The review's flood: with its descriptors gone, asyncio logs every failed accept with a traceback,
    # up to `backlog` times a second. Here the gateway's hard limit is lowered once it serves.
    gw = start_gateway(tmp_path, [engine.address], ["--header-timeout", "600", "--fault-log-interval", "3600"])
    clients: list[socket.socket] = []
    try:
        resource.prlimit(gw.process.pid, resource.RLIMIT_NOFILE, (256, 256))
        host, port = gw.address.rsplit(":", 1)
        for _ in range(400):  # the kernel completes the handshakes; the gateway runs out while accepting
            sock = socket.create_connection((host, int(port)), timeout=60)
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # half a request: held (for --header-timeout)
            clients.append(sock)
        for sock in clients:
            sock.close()
        clients.clear()
        with httpx.Client(base_url=f"http://{gw.address}", timeout=60) as http:  # serving again, once freed
            wait_for(http, "ignis_gateway_connections_open", 1)
            assert metric(http, "ignis_gateway_accept_failures_total") > 0
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        for sock in clients:
            sock.close()
        assert gw.stop() == 0, gw.log()
    log = gw.log()
    assert "out of system resource" not in log and "Traceback" not in log, log[-3000:]
    assert len(re.findall(r"failed \d+ accepts for want of file descriptors", log)) == 1, log[-3000:]
    assert len(log.splitlines()) < 30, log[-3000:]


# ---------------------------------------------------------------- 10. /metrics behind the key


def test_metrics_auth_puts_metrics_behind_the_key(engine: RunningService, tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, [engine.address], ["--api-key", "sekret", "--metrics-auth"])
    try:
        url = f"http://{gw.address}"
        assert_error(httpx.get(url + "/metrics"), 401, code="invalid_api_key")
        reply = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sekret"})
        assert reply.status_code == 200 and "ignis_gateway_requests_total" in reply.text
        assert httpx.get(url + "/health").status_code == 200  # probes still need no key
    finally:
        assert gw.stop() == 0, gw.log()


def test_metrics_auth_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IGNIS_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e:1", "--metrics-auth"])
    assert parse_args(["--engine", "e:1", "--api-key", "k", "--metrics-auth"])[1].public_paths == ("/health",)
    assert parse_args(["--engine", "e:1", "--api-key", "k"])[1].public_paths == ("/health", "/metrics")


@pytest.mark.parametrize("flags", [["--header-timeout", "0"], ["--body-timeout", "nan"], ["--max-connections", "0"],
                                   ["--max-request-bytes", "10"], ["--fault-log-interval", "-1"]])
def test_bad_limits_stop_startup(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e:1", *flags])


def test_an_unclosed_string_of_escaped_quotes_is_scanned_once() -> None:
    """`{"a":"` then 8 MiB of `\\"` and no closing quote: the depth scan reads it once (it used to
    restart at every escaped quote: hours at this size, on the event loop) and it is a 400."""
    body = b'{"a":"' + b'\\"' * (4 << 20)
    with pytest.raises(OpenAIError) as info:
        parse_json_object(body)
    assert info.value.status_code == 400


def test_surrogates_are_found_through_their_escapes_only() -> None:
    assert parse_json_object(b'{"a": "caf\\u00e9 \\ud83d\\ude00"}') == {"a": "caf\u00e9 \U0001F600"}
    with pytest.raises(OpenAIError) as info:
        parse_json_object(b'{"x": ["ok", "\\udc00"]}')
    assert info.value.status_code == 400 and "x[1]" in f"{info.value.param} {info.value.message}"
