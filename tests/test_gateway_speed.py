"""The gateway's fast path changes nothing a client sees: real engine and gateway processes on loopback.

- SSE chunks are encoded by orjson: the same bytes as the stdlib's compact JSON (fuzzed), but for
  floats under 1e-4 and NaN; an integer beyond 64 bits falls back to the stdlib.
- `--http httptools` (the default) and `--http h11` answer the same streams with the same bytes
  (ids and timestamps aside) and keep the same hardening: the socket-level tests of
  tests/test_gateway_hardening.py run again on h11 and on uvloop (`--loop uvloop`), and a request
  head over 16 KiB is a 400 on either parser (h11 bounds it itself; llhttp does not).
- 256 concurrent streams through one gateway all complete (a correctness check, not a timing).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import resource
import socket
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import test_gateway_hardening as hardening
from gateway.sse import data_event, dumps, named_event
from services import RunningService, start_engine, start_gateway
from test_gateway_hardening import read_until_closed

MODEL = "ignis-tiny"


def _stdlib(data: Any) -> bytes:
    """How the gateway encoded every SSE chunk before orjson."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


# ---------------------------------------------------------------- the bytes of a chunk

CHUNKS: list[dict[str, Any]] = [
    {"id": "chatcmpl-0f3a", "object": "chat.completion.chunk", "created": 1764590000, "model": MODEL,
     "system_fingerprint": None, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}], "usage": None},
    {"id": "chatcmpl-0f3a", "object": "chat.completion.chunk", "created": 1764590000, "model": MODEL,
     "system_fingerprint": None, "choices": [{"index": 0, "delta": {"content": "héllo \u2028 😀 \"q\" \\ \x00"},
                                              "logprobs": {"content": [{"token": "h", "logprob": -0.0123456789,
                                                                        "bytes": [104], "top_logprobs": []}]},
                                              "finish_reason": None}]},
    {"id": "chatcmpl-0f3a", "object": "chat.completion.chunk", "created": 1764590000, "model": MODEL,
     "system_fingerprint": None, "choices": [{"index": 0, "delta": {"tool_calls": [
         {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
         "logprobs": None, "finish_reason": None}]},
    {"id": "cmpl-9", "object": "text_completion", "created": 1, "model": MODEL, "system_fingerprint": None,
     "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 0},
                              "completion_tokens_details": {"reasoning_tokens": 0}},
     "ignis": {"tier": "none", "kind": "none", "reused_tokens": 0, "time_to_first_token_ms": 12.345}},
    {"error": {"message": "the engine failed", "type": "server_error", "param": None, "code": "internal_error"}},
]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_a_chunk_is_the_bytes_the_stdlib_wrote(chunk: dict[str, Any]) -> None:
    assert data_event(chunk) == b"data: " + _stdlib(chunk) + b"\n\n"
    assert named_event("response.output_text.delta", chunk) == \
        b"event: response.output_text.delta\ndata: " + _stdlib(chunk) + b"\n\n"


def test_what_orjson_cannot_encode_is_the_stdlibs() -> None:
    big = {"type": "json_schema", "schema": {"maximum": 1 << 70}, "keys": {1: "int key"}}
    assert dumps(big) == _stdlib(big)


def test_small_floats_and_nan_differ_only_in_notation() -> None:
    data = {"logprob": -1e-7, "tiny": 1e-05, "nan": math.nan}
    assert json.loads(dumps(data)) == {"logprob": -1e-7, "tiny": 1e-05, "nan": None}  # NaN is not JSON: null


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # engine text is valid UTF-8
_FLOAT = st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f == 0 or abs(f) >= 1e-4)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | _FLOAT | _TEXT,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
                     max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_TEXT, _JSON, max_size=6))
def test_orjson_writes_the_stdlib_bytes_for_any_chunk(data: dict[str, Any]) -> None:
    assert dumps(data) == _stdlib(data)


# ---------------------------------------------------------------- the parsers and loops, end to end


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """conftest's engine, with a queue that takes 256 streams at once."""
    service = start_engine(tmp_path_factory.mktemp("engine"), str(tiny_model_dir),
                           ["--served-model-name", MODEL, "--max-queue", "512",
                            "--set", "reuse.retained_interactive_ttl=0"])
    yield service
    assert service.stop() == 0, service.log()


@pytest.fixture(scope="module")
def gateways(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningService]]:
    started: dict[str, RunningService] = {}
    try:
        for name, flags in {"httptools": [], "h11": ["--http", "h11"], "uvloop": ["--loop", "uvloop"]}.items():
            started[name] = start_gateway(tmp_path_factory.mktemp(f"gateway-{name}"), [engine.address], flags)
        yield started
    finally:
        for service in started.values():
            assert service.stop() == 0, service.log()
            assert "Traceback" not in service.log(), service.log()


def test_each_gateway_says_its_parser_and_loop(gateways: dict[str, RunningService]) -> None:
    said = {name: re.search(r"http: (\w+), loop: (\w+)", g.log()) for name, g in gateways.items()}
    assert {name: m.groups() if m else None for name, m in said.items()} == {
        "httptools": ("httptools", "asyncio"), "h11": ("h11", "asyncio"), "uvloop": ("httptools", "uvloop")}


def _raw_stream(address: str, path: str, body: dict[str, Any]) -> tuple[dict[str, str], bytes]:
    """The answer's headers (no date) and its body bytes, ids and timestamps replaced."""
    with httpx.Client(base_url=f"http://{address}", timeout=60) as http:
        reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    # content-length follows the time to first token's digits: the body is compared instead
    headers = {k: v for k, v in reply.headers.items() if k not in ("date", "x-request-id", "content-length")}
    text = re.sub(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]+"', b'"id":"ID"', reply.content)
    text = re.sub(rb'"time_to_first_token_ms":[0-9.e+-]+', b'"time_to_first_token_ms":0', text)
    return headers, re.sub(rb'"created":\d+', b'"created":0', text)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about caches"}],
                              "max_tokens": 8, "temperature": 0, "stream": True, "logprobs": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                         "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
])
def test_every_parser_and_loop_sends_the_same_bytes(gateways: dict[str, RunningService], path: str,
                                                    body: dict[str, Any]) -> None:
    # a salt of its own per gateway: no answer reuses another's prompt state (its usage would differ)
    answers = {name: _raw_stream(g.address, path, {**body, "cache_salt": f"{path}-{name}"})
               for name, g in gateways.items()}
    (headers, content), *others = answers.values()
    assert content.startswith(b"data: {" if body.get("stream") else b"{") and len(content) > 100
    for other in others:
        assert other == (headers, content)


def test_the_openai_sdk_streams_through_each(gateways: dict[str, RunningService]) -> None:
    texts = {}
    for name, g in gateways.items():
        client = openai.OpenAI(base_url=f"http://{g.address}/v1", api_key="none", max_retries=0)
        with client:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=6, temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
            chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        texts[name] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(set(texts.values())) == 1, texts


# ---------------------------------------------------------------- 256 streams at once


async def _stream(http: httpx.AsyncClient, i: int, tokens: int) -> tuple[int, bool]:
    body = {"model": MODEL, "prompt": f"Stream {i}:", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    count, done = 0, False
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    count = chunk["usage"]["completion_tokens"]
    return count, done


def test_256_concurrent_streams_all_complete(gateways: dict[str, RunningService]) -> None:
    async def run(address: str) -> list[tuple[int, bool]]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=120, limits=limits) as http:
            return list(await asyncio.gather(*(_stream(http, i, 3) for i in range(256))))

    results = asyncio.run(run(gateways["httptools"].address))
    assert results == [(3, True)] * 256
    with httpx.Client(base_url=f"http://{gateways['httptools'].address}", timeout=60) as http:
        assert hardening.metric(http, 'ignis_gateway_requests_total{method="POST",route="/v1/completions",'
                                      'status="200"}') >= 256


# ---------------------------------------------------------------- the hardening, on h11 and on uvloop

SOCKET_TESTS = [hardening.test_slow_clients_are_closed_while_others_are_served,
                hardening.test_malformed_and_upgrade_requests_are_counted_not_logged,
                hardening.test_connections_beyond_the_limit_are_refused_with_503]
VARIANTS = {"h11": ["--http", "h11"], "uvloop": ["--loop", "uvloop"]}


def _with_flags(flags: list[str]) -> Callable[..., RunningService]:
    def start(workdir: Path, engines: list[str], args: list[str] | None = None, **kw: Any) -> RunningService:
        return start_gateway(workdir, engines, [*(args or []), *flags], **kw)
    return start


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("test", SOCKET_TESTS, ids=lambda t: t.__name__.removeprefix("test_"))
def test_the_hardening_holds_on(test: Callable[[RunningService, Path], None], variant: str,
                                engine: RunningService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardening, "start_gateway", _with_flags(VARIANTS[variant]))
    test(engine, tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_body_nobody_reads_is_drained_then_closed_on(variant: str, engine: RunningService,
                                                       tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, [engine.address], ["--header-timeout", "0.5", "--body-timeout", "0.5",
                                                    "--max-request-bytes", "64KiB", "--fault-log-interval",
                                                    "3600", *VARIANTS[variant]])
    try:
        with httpx.Client(base_url=f"http://{gw.address}", timeout=60) as http:
            hardening.test_a_body_nobody_reads_is_drained_then_closed(gw, http)
    finally:
        assert gw.stop() == 0, gw.log()


@pytest.mark.parametrize("flags", [[], ["--http", "h11"]], ids=["httptools", "h11"])
def test_a_head_over_16_kib_is_a_400_and_one_under_is_served(flags: list[str], engine: RunningService,
                                                              tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, [engine.address], ["--fault-log-interval", "3600", *flags])
    try:
        host, port = gw.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=60) as sock:  # 12 KiB of headers: served
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"a" * 12 * 1024 + b"\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection((host, int(port)), timeout=60) as sock:  # 4 MiB of one header: closed
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
            answer = b""
            try:
                for _ in range(64):
                    sock.sendall(b"a" * 65536)
                answer = read_until_closed(sock)
            except (ConnectionResetError, BrokenPipeError):
                pass  # closed while this client still sent: the kernel may drop the 400 for a reset
            assert answer == b"" or answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            # a 60 KiB body with the next request pipelined after it: both answered (the head bound counts
            # the reads after the one a head begins in, not the body before it)
            body = json.dumps({"model": "no-such-model", "prompt": "x", "user": "u" * 60_000}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body[:-20_000])
            sock.sendall(body[-20_000:] + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answers = b""
            while answers.count(b"HTTP/1.1 ") < 2 or not answers.endswith(b"}"):
                answers += sock.recv(65536)
            assert re.findall(rb"HTTP/1.1 (\d+) ", answers) == [b"404", b"200"], answers[:500]
        with httpx.Client(base_url=f"http://{gw.address}", timeout=60) as http:
            assert http.get("/health").status_code == 200  # serving on
    finally:
        assert gw.stop() == 0, gw.log()
    assert "answered 1 malformed HTTP request with 400" in gw.log(), gw.log()[-2000:]


def test_out_of_descriptors_on_h11_is_counted(engine: RunningService, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardening, "start_gateway", _with_flags(VARIANTS["h11"]))
    hardening.test_running_out_of_descriptors_is_counted_not_a_log_flood(engine, tmp_path)


def test_out_of_descriptors_on_uvloop_drops_the_excess_and_serves_on(engine: RunningService,
                                                                      tmp_path: Path) -> None:
    """libuv meets EMFILE by accepting and closing what waits (its reserve-descriptor trick): those
    clients see their connection closed at once, none is counted in ignis_gateway_accept_failures
    (the loop never reports them), nothing is logged, and the gateway serves on once descriptors free."""
    gw = start_gateway(tmp_path, [engine.address], ["--header-timeout", "600", "--fault-log-interval", "3600",
                                                    *VARIANTS["uvloop"]])
    clients: list[socket.socket] = []
    try:
        resource.prlimit(gw.process.pid, resource.RLIMIT_NOFILE, (256, 256))
        host, port = gw.address.rsplit(":", 1)
        for _ in range(400):
            sock = socket.create_connection((host, int(port)), timeout=60)
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            clients.append(sock)
        dropped = 0
        for sock in clients[-50:]:  # the last ones came after the descriptors ran out
            sock.settimeout(2)
            try:
                dropped += sock.recv(1) == b""
            except ConnectionResetError:
                dropped += 1
            except TimeoutError:
                pass  # held open: it was accepted
        assert dropped == 50
        for sock in clients:
            sock.close()
        clients.clear()
        with httpx.Client(base_url=f"http://{gw.address}", timeout=60) as http:
            hardening.wait_for(http, "ignis_gateway_connections_open", 1)
            assert http.post("/v1/chat/completions", json=hardening.CHAT).status_code == 200
    finally:
        for sock in clients:
            sock.close()
        assert gw.stop() == 0, gw.log()
    log = gw.log()
    assert "Traceback" not in log and len(log.splitlines()) < 30, log[-3000:]


def test_an_unknown_parser_or_loop_stops_startup() -> None:
    from gateway.__main__ import parse_args

    for flags in (["--http", "zttp"], ["--loop", "trio"]):
        with pytest.raises(SystemExit):
            parse_args(["--engine", "e:1", *flags])
    args, _ = parse_args(["--engine", "e:1"])
    assert (args.http, args.loop) == ("httptools", "asyncio")

