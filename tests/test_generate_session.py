"""GenerateSession: many tagged Generate calls on one stream of a real engine process.

Each call on the stream must be what a Generate call is (the same messages, then the status a
Generate call ends with), a step's messages for several calls travel together, and a cancel, a
timeout or the stream's end frees the engine's work.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import socket
import stat
import time
from pathlib import Path
from collections import defaultdict
from typing import Iterator

import grpc
import h11
import httpx
import openai
import pytest

from gateway.session import EngineSession, SessionCall, SlowReader
from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import RunningService, start_gateway
from test_engine_service import MODEL, collect, make_prompt, make_request, stats, text_of, tokens_of, wait_idle

_CLOSE = None


class Session:
    """One GenerateSession stream, driven from the test: `call`/`cancel` write, `events` reads."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._outbox: queue.Queue[engine_pb2.SessionRequest | None] = queue.Queue()
        # the stream's deadline: a test's calls take seconds quiet, and over 120 s were seen at load 9
        self.responses = stub.GenerateSession(self._requests(), timeout=600)

    def _requests(self) -> Iterator[engine_pb2.SessionRequest]:
        while (request := self._outbox.get()) is not _CLOSE:
            yield request

    def call(self, tag: int, request: engine_pb2.GenerateRequest, timeout: float = 0.0) -> None:
        spec = engine_pb2.SessionCall(request=request, timeout_seconds=timeout)
        self._outbox.put(engine_pb2.SessionRequest(tag=tag, call=spec))

    def cancel(self, tag: int) -> None:
        self._outbox.put(engine_pb2.SessionRequest(tag=tag, cancel=True))

    def close(self) -> None:
        self._outbox.put(_CLOSE)

    def until_ended(self, tags: set[int]) -> tuple[dict[int, list[engine_pb2.GenerateResponse]],
                                                   dict[int, engine_pb2.SessionEnd], list[engine_pb2.SessionResponse]]:
        messages: dict[int, list[engine_pb2.GenerateResponse]] = defaultdict(list)
        ends: dict[int, engine_pb2.SessionEnd] = {}
        seen = []
        for response in self.responses:
            seen.append(response)
            for event in response.events:
                assert event.tag not in ends, f"an event for tag {event.tag} after its end"
                if event.HasField("end"):
                    ends[event.tag] = event.end
                else:
                    messages[event.tag].append(event.response)
            if tags <= set(ends):
                break
        return messages, ends, seen


@pytest.fixture(scope="module")
def stub(engine: RunningService) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


@pytest.fixture
def session(stub: engine_pb2_grpc.EngineStub) -> Iterator[Session]:
    s = Session(stub)
    yield s
    s.close()


def test_calls_on_a_session_stream_what_generate_calls_stream(stub: engine_pb2_grpc.EngineStub,
                                                              session: Session) -> None:
    requests = {tag: make_request(make_prompt(20 + 7 * tag, seed=tag), temperature=0, max_tokens=12, ignore_eos=True)
                for tag in range(1, 7)}
    requests[7] = make_request(text="Hello there", temperature=0, max_tokens=5, n=2, logprobs=True, top_logprobs=2,
                               ignore_eos=True)
    requests[7].echo = True
    for tag, request in requests.items():
        session.call(tag, request)
    messages, ends, seen = session.until_ended(set(requests))
    assert {tag: end.code for tag, end in ends.items()} == {tag: 0 for tag in requests}
    for tag, request in requests.items():
        alone = collect(stub, request)  # the same request as its own Generate call
        by_choice: dict[int, list[engine_pb2.GenerateResponse]] = defaultdict(list)
        for msg in messages[tag]:
            by_choice[msg.index].append(msg)
        assert set(by_choice) == set(alone)
        for choice, msgs in alone.items():
            assert tokens_of(by_choice[choice]) == tokens_of(msgs)
            assert text_of(by_choice[choice]) == text_of(msgs)
            assert [lp.token_id for m in by_choice[choice] for lp in m.logprobs] == \
                   [lp.token_id for m in msgs for lp in m.logprobs]
        last = messages[tag][-1]
        assert last.HasField("usage") and last.usage.completion_tokens == request.sampling.max_tokens * \
            (request.sampling.n or 1)
    assert list(messages[7][0].prompt_token_ids) and len(messages[7][0].prompt_logprobs) == \
        len(messages[7][0].prompt_token_ids)
    # A step's messages for the stream's calls travel together: fewer responses than messages, and
    # some response carries several calls' messages.
    assert len(seen) < sum(len(m) for m in messages.values())
    assert any(len({e.tag for e in r.events}) > 1 for r in seen)


def test_a_bad_call_ends_with_its_status_and_the_others_on_the_stream_finish(
        stub: engine_pb2_grpc.EngineStub, session: Session) -> None:
    good = make_request(make_prompt(30, seed=5), temperature=0, max_tokens=10, ignore_eos=True)
    long = make_request(make_prompt(20, seed=7), temperature=0, max_tokens=200, ignore_eos=True)
    session.call(1, good)
    session.call(2, engine_pb2.GenerateRequest(model="no-such-model", text="hi"))
    session.call(3, make_request(make_prompt(10, seed=6), temperature=0, max_tokens=10 ** 6))
    session.call(4, make_request(text="x", temperature=-1.0))
    session.call(5, long)
    session.call(5, good)  # a tag already running
    messages, ends, _ = session.until_ended({1, 2, 3, 4, 5})
    assert ends[2].code == grpc.StatusCode.NOT_FOUND.value[0] and "no-such-model" in ends[2].details
    assert ends[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert ends[4].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not messages[2] and not messages[3] and not messages[4]
    # A tag reused while its call runs: the engine cannot tell the two apart, so both end (INVALID_ARGUMENT)
    # and nothing more comes for the tag (until_ended checks).
    assert ends[5].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already in use" in ends[5].details
    assert ends[1].code == 0 and tokens_of(messages[1]) == tokens_of(collect(stub, good)[0])
    session.call(6, good)  # the stream serves on
    messages, ends, _ = session.until_ended({6})
    assert ends[6].code == 0 and tokens_of(messages[6]) == tokens_of(collect(stub, good)[0])
    assert wait_idle(stub).page_pool.used_pages == 0  # the refused call's work was freed


def test_cancel_and_timeout_free_the_engines_work(stub: engine_pb2_grpc.EngineStub, session: Session) -> None:
    cancelled_before = stats(stub).counters.requests_cancelled
    endless = make_request(make_prompt(16, seed=8), temperature=0, max_tokens=2000, ignore_eos=True)
    session.call(1, endless)
    session.call(2, endless, timeout=0.3)
    got = 0
    early: dict[int, engine_pb2.SessionEnd] = {}  # on a loaded machine tag 2 times out before tag 1's third token
    for response in session.responses:
        early |= {e.tag: e.end for e in response.events if e.HasField("end")}
        assert 1 not in early
        got += sum(1 for e in response.events if e.tag == 1 and e.HasField("response"))
        if got >= 3:
            break
    assert stats(stub).page_pool.used_pages > 0
    session.cancel(1)
    short = make_request(make_prompt(12, seed=9), temperature=0, max_tokens=4, ignore_eos=True)
    session.call(3, short)  # the stream serves on after a cancel
    messages, ends, _ = session.until_ended({2, 3} - set(early))
    assert not set(early) & set(ends)  # one end a tag
    ends |= early
    assert ends[2].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert 1 not in ends  # a cancelled call gets nothing more, not even an end
    assert ends[3].code == 0 and tokens_of(messages[3]) == tokens_of(collect(stub, short)[0])
    idle = wait_idle(stub)
    assert idle.page_pool.used_pages == 0 and idle.state_slots.used == 0
    assert idle.counters.requests_cancelled == cancelled_before + 2


def test_closing_the_stream_aborts_its_open_calls(stub: engine_pb2_grpc.EngineStub) -> None:
    s = Session(stub)
    endless = make_request(make_prompt(16, seed=10), temperature=0, max_tokens=2000, ignore_eos=True)
    s.call(1, endless)
    s.call(2, endless)
    for response in s.responses:
        if any(e.HasField("response") for e in response.events):
            break
    s.responses.cancel()  # the caller goes away with both calls running
    s.close()
    idle = wait_idle(stub)
    assert idle.page_pool.used_pages == 0 and idle.state_slots.used == 0
    # The engine serves on, on a new stream as on a Generate call.
    assert len(tokens_of(collect(stub, make_request(text="still here", temperature=0, max_tokens=3,
                                                    ignore_eos=True))[0])) == 3


# --- through the gateway: its session upstream (the default) against a Generate call per request ---------------
@pytest.fixture(scope="module")
def gateway_services(engine: RunningService, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[dict[str, RunningService]]:
    started = {name: start_gateway(tmp_path_factory.mktemp(f"gateway-{name}"), [engine.address], flags)
               for name, flags in (("session", []), ("grpc-session", ["--upstream", "grpc-session"]),
                                   ("calls", ["--upstream", "calls"]))}
    try:
        yield started
    finally:
        for g in started.values():
            g.stop()


@pytest.fixture(scope="module")
def gateways(gateway_services: dict[str, RunningService]) -> dict[str, str]:
    return {name: f"http://127.0.0.1:{g.port}/v1" for name, g in gateway_services.items()}


async def _stream_text(http: httpx.AsyncClient, url: str, i: int) -> tuple[str, int]:
    body = {"model": MODEL, "prompt": f"Stream {i} says", "max_tokens": 6 + i % 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, tokens = "", 0
    async with http.stream("POST", url + "/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return text, tokens


def test_the_gateway_answers_the_same_over_its_session_and_over_calls(gateways: dict[str, str]) -> None:
    answers = {}
    for name, url in gateways.items():
        client = openai.OpenAI(base_url=url, api_key="none")
        whole = client.completions.create(model=MODEL, prompt="Reused state", max_tokens=8, temperature=0, n=2,
                                          logprobs=2, extra_body={"ignore_eos": True})
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="x", max_tokens=10 ** 6)

        async def many() -> list[tuple[str, int]]:
            async with httpx.AsyncClient(timeout=120) as http:
                return list(await asyncio.gather(*(_stream_text(http, url, i) for i in range(24))))

        answers[name] = ([(c.text, c.logprobs.tokens if c.logprobs else None) for c in whole.choices], streamed,
                         bad.value.status_code, asyncio.run(many()))
    assert answers["session"] == answers["grpc-session"] == answers["calls"]
    assert [tokens for _, tokens in answers["session"][3]] == [6 + i % 5 for i in range(24)]


def test_a_gateway_on_the_engines_host_takes_its_session_socket(gateways: dict[str, str],
                                                                 gateway_services: dict[str, RunningService],
                                                                 stub: engine_pb2_grpc.EngineStub) -> None:
    path = stub.ListModels(engine_pb2.ListModelsRequest()).session_socket
    assert path and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    for name in gateways:  # each has served a request by now (the test above)
        openai.OpenAI(base_url=gateways[name], api_key="none").completions.create(
            model=MODEL, prompt="which way", max_tokens=2)
    assert f"opened on its session socket {path}" in gateway_services["session"].log()
    assert "opened over gRPC" in gateway_services["grpc-session"].log()
    assert "session socket" not in gateway_services["grpc-session"].log()


def test_a_session_holds_at_most_the_engines_queue_of_open_calls(stub: engine_pb2_grpc.EngineStub) -> None:
    """A flood of calls on one stream (the module's engine queues 64) cannot pile up tasks and prompt renders
    past the queue: the extra calls end RESOURCE_EXHAUSTED, the admitted ones run, and closing frees them."""
    s = Session(stub)
    endless = make_request(make_prompt(16, seed=12), temperature=0, max_tokens=2000, ignore_eos=True)
    for tag in range(1, 71):
        s.call(tag, endless)
    ends: dict[int, engine_pb2.SessionEnd] = {}
    running: set[int] = set()
    for response in s.responses:
        for event in response.events:
            if event.HasField("end"):
                ends[event.tag] = event.end
            else:
                running.add(event.tag)
        if len(ends) >= 6 and running:
            break
    assert {e.code for e in ends.values()} == {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
    assert len(ends) >= 6 and not running & set(ends)
    s.responses.cancel()
    s.close()
    idle = wait_idle(stub)
    assert idle.page_pool.used_pages == 0 and idle.state_slots.used == 0


def _send_buffer_max() -> int:
    """The most a TCP socket's send buffer grows to (the kernel autotunes up to tcp_wmem's max)."""
    return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])


class StalledStream:
    """A streamed request on a raw socket with a tiny receive buffer (h11 speaks HTTP): it reads the
    head and the first chunk, then stops reading until `read_rest`."""

    def __init__(self, port: int, body: dict[str, object]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        self.sock.settimeout(60)
        self.sock.connect(("127.0.0.1", port))
        self.http = h11.Connection(h11.CLIENT)
        payload = json.dumps(body).encode()
        self.sock.sendall(self.http.send(h11.Request(method="POST", target="/v1/completions", headers=[
            ("Host", "x"), ("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])))
        self.sock.sendall(self.http.send(h11.Data(data=payload)) + self.http.send(h11.EndOfMessage()))
        self.status = 0
        self.body = b""
        while b"data: {" not in self.body and self._pump():
            pass

    def _pump(self) -> bool:
        """Reads once and takes in its events; False at the end of the response (or of the connection)."""
        while True:
            event = self.http.next_event()
            if event is h11.NEED_DATA:
                self.http.receive_data(self.sock.recv(1 << 16))
                continue
            if isinstance(event, h11.Response):
                self.status = event.status_code
            elif isinstance(event, h11.Data):
                self.body += bytes(event.data)
                return True
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)) or event is h11.PAUSED:
                return False

    def read_rest(self) -> list[dict[str, object]]:
        while self._pump():
            pass
        return [json.loads(line[6:]) for line in self.body.decode().splitlines() if line.startswith("data: {")]

    def close(self) -> None:
        self.sock.close()


def test_a_client_that_reads_too_slowly_loses_its_stream_and_nobody_else_does(
        engine: RunningService, stub: engine_pb2_grpc.EngineStub, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One session carries every call to the engine, so a stalled reader's messages wait in the gateway:
    past --max-stream-buffer its call ends (a slow_reader error after what it holds), the engine stops
    the request, and a stream beside it on the same session finishes whole."""
    gateway = start_gateway(tmp_path_factory.mktemp("gateway-slow-reader"), [engine.address],
                            ["--max-stream-buffer", "16KiB"])
    try:
        # ~450 bytes a chunk with 5 logprobs: 8 choices are more than a stalled connection takes in before
        # the gateway's writes wait (the kernel grows the send buffer up to tcp_wmem's max, 4 MiB here).
        choices = -(-8 * _send_buffer_max() // (4 << 20))
        if choices > 32:
            pytest.skip(f"tcp_wmem lets a socket buffer {_send_buffer_max()} bytes: too much to fill here")
        n = max(8, choices)
        endless = {"model": MODEL, "prompt": "A slow reader", "max_tokens": 1500, "temperature": 0,
                   "ignore_eos": True, "stream": True, "logprobs": 5, "n": n}
        before = stats(stub).counters
        stalled = StalledStream(gateway.port, endless)
        try:
            assert stalled.status == 200

            async def beside() -> tuple[str, int]:
                async with httpx.AsyncClient(timeout=120) as http:
                    return await _stream_text(http, f"http://127.0.0.1:{gateway.port}/v1", 3)

            text, tokens = asyncio.run(beside())
            assert tokens == 6 + 3 % 5 and text
            # It ends once ~4 MiB wait in the socket (most of its tokens, on a busy machine many seconds):
            # the limit only stops a hang. That the engine stopped it is in its counters, not in the time.
            deadline = time.monotonic() + 600
            while (s := stats(stub)).running.interactive + s.waiting.interactive:
                assert time.monotonic() < deadline, "the stalled stream's request never ended"
                time.sleep(0.1)
            events = stalled.read_rest()  # now everything: what it held, then the error
        finally:
            stalled.close()
        after = stats(stub).counters
        assert after.requests_cancelled == before.requests_cancelled + 1  # stopped, not run to its end
        assert after.generated_tokens - before.generated_tokens < n * 1500
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == "slow_reader", errors
        assert "--max-stream-buffer" in errors[0]["message"]
        assert 1 < len(events) - 1 < n * 1500
        idle = wait_idle(stub)
        assert idle.page_pool.used_pages == 0 and idle.state_slots.used == 0
    finally:
        gateway.stop()
    assert "ended 1 stream whose client read too slowly (--max-stream-buffer)" in gateway.log()  # summed at exit


def test_a_call_holds_one_message_of_any_size_and_at_most_its_bound_beyond() -> None:
    """SessionCall's buffer on its own (a session never opened: nothing is sent)."""
    async def run() -> None:
        slow: list[None] = []
        session = EngineSession(engine_pb2_grpc.EngineStub(grpc.aio.insecure_channel("127.0.0.1:9")), 100,
                                lambda: slow.append(None))
        big, small = engine_pb2.GenerateResponse(text="x" * 500), engine_pb2.GenerateResponse(text="y" * 30)
        call = SessionCall(session, 1, None)
        call.push(big)  # alone it fits, however big (a whole prompt's logprobs may be one message)
        assert await anext(call) == big
        for _ in range(3):  # 96 bytes waiting: within the bound
            call.push(small)
        for _ in range(3):
            assert await anext(call) == small
        for _ in range(3):
            call.push(small)
        call.push(small)  # 128 bytes waiting: over
        call.push(small)  # after the end: dropped
        for _ in range(3):  # what it held comes first, then the error
            assert await anext(call) == small
        with pytest.raises(SlowReader) as ended:
            await anext(call)
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "100 bytes" in (ended.value.details() or "")
        assert not call.cancel()  # it has ended already
        assert len(slow) == 1  # the gateway's fault summary was told once
    asyncio.run(run())
