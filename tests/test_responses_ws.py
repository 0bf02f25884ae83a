"""WebSocket mode on /v1/responses: response.create events in, the stream's events out.

Real processes on loopback (an engine with its own response store, gateways in front), the raw
`websockets` client and the openai SDK's own Responses WebSocket client."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from socket import SHUT_RDWR, create_connection
from pathlib import Path
from typing import Any, Iterator

import grpc
import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import RunningService, start_engine, start_gateway

MODEL = "ignis-tiny"
TOOLS = [{"type": "function", "name": "add", "description": "add two digits", "parameters": {
    "type": "object", "required": ["a", "b"], "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}]
FORCE_ADD = {"type": "function", "name": "add"}
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    store = tmp_path_factory.mktemp("responses") / "store"
    service = start_engine(tmp_path_factory.mktemp("engine"), str(tiny_model_dir),
                           ["--served-model-name", MODEL, "--set", f"responses.path={store}",
                            "--set", "reuse.retained_interactive_ttl=0"])
    yield service
    assert service.stop() == 0, service.log()


@pytest.fixture(scope="module")
def gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address])
    yield service
    assert service.stop() == 0, service.log()


@pytest.fixture(scope="module")
def stub(engine: RunningService) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def socket(gateway: RunningService, key: str = "k") -> ClientConnection:
    return connect(f"ws://127.0.0.1:{gateway.port}/v1/responses",
                   additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30)


def turn(ws: ClientConnection, **body: Any) -> list[dict[str, Any]]:
    """Send one response.create; the events up to its terminal one (or an error)."""
    ws.send(json.dumps({"type": "response.create", "model": MODEL, "max_output_tokens": 8, **body}))
    events = []
    while True:
        event = json.loads(ws.recv(timeout=120))
        events.append(event)
        if event["type"] in TERMINAL or event["type"] == "error":
            return events


def final(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["type"] in TERMINAL, events[-1]
    response: dict[str, Any] = events[-1]["response"]
    return response


def cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["input_tokens_details"]["cached_tokens"])


def wait_idle(stub: engine_pb2_grpc.EngineStub, timeout: float = 60) -> engine_pb2.GetStatsResponse:
    deadline = time.monotonic() + timeout
    while True:
        s = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)
        busy = s.running.interactive + s.running.agent + s.waiting.interactive + s.waiting.agent
        if (busy == 0 and s.page_pool.used_pages == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def test_a_tool_call_loop_sends_only_new_items(gateway: RunningService) -> None:
    with socket(gateway) as ws:
        events = turn(ws, input="Add 2 and 3, then add the result to 4.", tools=TOOLS, tool_choice=FORCE_ADD,
                      store=False, max_output_tokens=60, seed=1)
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        responses = [final(events)]
        for result in ("5", "9"):
            [call] = [item for item in responses[-1]["output"] if item["type"] == "function_call"]
            assert call["name"] == "add" and set(json.loads(call["arguments"])) == {"a", "b"}
            # Only the new item: the socket keeps the conversation (store is false: nothing is stored).
            responses.append(final(turn(ws, previous_response_id=responses[-1]["id"], tools=TOOLS,
                                        tool_choice=FORCE_ADD, store=False, max_output_tokens=60, seed=1,
                                        input=[{"type": "function_call_output", "call_id": call["call_id"],
                                                "output": result}])))
        for before, after in zip(responses, responses[1:]):
            assert after["previous_response_id"] == before["id"] and after["store"] is False
            assert cached(after) >= before["usage"]["input_tokens"]
            assert cached(after) > cached(before)
        # A later socket does not know these: nothing was stored.
        with socket(gateway) as other:
            [error] = turn(other, previous_response_id=responses[-1]["id"], input="x")
            assert error["type"] == "error" and error["status"] == 404
            assert error["error"]["code"] == "previous_response_not_found"
            assert error["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("claim", ["continue", "resend"])
def test_prewarm_then_claim_from_another_connection(gateway: RunningService, claim: str) -> None:
    head = {"instructions": "You answer questions about the warm-up document. " * 6, "cache_salt": f"warm-{claim}"}
    document = "Here is the document: " + "lorem ipsum " * 20
    with socket(gateway) as ws:
        events = turn(ws, input=document, generate=False, **head)
        warm = final(events)
        assert warm["status"] == "completed" and warm["output"] == []
        assert warm["usage"]["output_tokens"] == 0 and warm["usage"]["input_tokens"] > 100
        assert not [e for e in events if e["type"].startswith("response.output")]
    with socket(gateway) as ws:  # another connection: the next turn claims the prefilled state whole
        if claim == "continue":  # by id (a prewarm is stored like any response) with only the new input
            after = final(turn(ws, previous_response_id=warm["id"], input="What is it about?", **head))
        else:  # or the same input resent, now generating
            after = final(turn(ws, input=document, **head))
        assert cached(after) >= warm["usage"]["input_tokens"] - 1
    with socket(gateway) as ws:  # a cold prompt, for contrast
        cold = final(turn(ws, input=document, instructions="Other instructions.", cache_salt="cold-" + warm["id"]))
        assert cached(cold) == 0


def test_two_sockets_in_parallel(gateway: RunningService) -> None:
    results: dict[int, list[dict[str, Any]]] = {}

    def run(i: int) -> None:
        with socket(gateway) as ws:
            first = final(turn(ws, input=f"Conversation {i}: hello.", cache_salt=f"par-{i}"))
            second = final(turn(ws, input="And then?", previous_response_id=first["id"], cache_salt=f"par-{i}"))
            results[i] = [first, second]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == [0, 1]
    ids = {r["id"] for pair in results.values() for r in pair}
    assert len(ids) == 4
    for first, second in results.values():
        assert second["previous_response_id"] == first["id"] and cached(second) >= first["usage"]["input_tokens"]


def test_events_sent_while_one_runs_are_queued_in_order(gateway: RunningService) -> None:
    with socket(gateway) as ws:
        for i in range(3):
            ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": f"Queued {i}",
                                "max_output_tokens": 4, "store": False, "metadata": {"i": str(i)}}))
        done: list[dict[str, Any]] = []
        running: str | None = None
        while len(done) < 3:
            event = json.loads(ws.recv(timeout=120))
            if event["type"] == "response.created":
                assert running is None, "a response started before the previous one ended"
                running = event["response"]["id"]
            elif event["type"] in TERMINAL:
                assert event["response"]["id"] == running
                running = None
                done.append(event["response"])
            else:
                assert event.get("item_id") is None or running is not None
        assert len({d["id"] for d in done}) == 3
        assert [d["metadata"]["i"] for d in done] == ["0", "1", "2"]  # in the order sent


def test_closing_mid_response_cancels_it_at_the_engine(gateway: RunningService,
                                                        stub: engine_pb2_grpc.EngineStub) -> None:
    before = wait_idle(stub).counters
    with socket(gateway) as ws:
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "Go on forever.",
                            "max_output_tokens": 20000, "ignore_eos": True, "store": False}))
        deltas = 0
        while deltas < 3:
            event = json.loads(ws.recv(timeout=120))
            deltas += event["type"] == "response.output_text.delta"
        assert stub.GetStats(engine_pb2.GetStatsRequest()).page_pool.used_pages > 0
    after = wait_idle(stub)
    assert after.page_pool.used_pages == 0
    assert after.counters.requests_cancelled == before.requests_cancelled + 1
    assert after.counters.generated_tokens - before.generated_tokens < 20000


def test_a_malformed_event_gets_an_error_and_the_socket_stays_open(gateway: RunningService) -> None:
    with socket(gateway) as ws:
        for bad, status, param in (("not json", 400, None), ("[1, 2]", 400, None),
                                   (json.dumps({"type": "response.cancel"}), 400, "type"),
                                   (json.dumps({"type": "response.create", "input": "no model"}), 400, "model"),
                                   (json.dumps({"type": "response.create", "model": MODEL, "input": "x",
                                                "temperature": "hot"}), 400, "temperature"),
                                   (json.dumps({"type": "response.create", "model": MODEL, "input": "x",
                                                "background": True}), 400, "background"),
                                   (json.dumps({"type": "response.create", "model": "nope", "input": "x"}), 404,
                                    "model")):
            ws.send(bad)
            event = json.loads(ws.recv(timeout=60))
            assert event["type"] == "error" and event["status"] == status, event
            assert set(event["error"]) == {"message", "type", "param", "code"} and event["error"]["param"] == param
        good = final(turn(ws, input="Still here?", stream_id="lane-1"))
        assert good["status"] in ("completed", "incomplete")


def test_stream_id_is_echoed_on_every_event(gateway: RunningService) -> None:
    with socket(gateway) as ws:
        events = turn(ws, input="Tag these.", stream_id="lane-7", store=False)
        assert {e.get("stream_id") for e in events} == {"lane-7"}


# The SDK's sync client opens its socket outside a `with` (websockets 17.1+ warns about that).
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
def test_the_openai_sdk_websocket_client(gateway: RunningService) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="k", max_retries=0)
    with client.responses.connect() as conn:
        conn.send({"type": "response.create", "model": MODEL, "input": "Hello over the SDK.",
                   "max_output_tokens": 6})
        events = []
        for event in conn:
            events.append(event)
            if event.type in TERMINAL:
                break
        first = events[-1].response  # type: ignore[union-attr]
        assert events[0].type == "response.created" and first.id.startswith("resp_")
        conn.send({"type": "response.create", "model": MODEL, "input": "Again.", "previous_response_id": first.id,
                   "max_output_tokens": 6})
        for event in conn:
            if event.type in TERMINAL:
                second = event.response  # type: ignore[union-attr]
                break
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # type: ignore[union-attr]
    assert client.responses.retrieve(second.id).output_text == second.output_text  # stored by default


def test_the_api_key_applies_to_the_handshake(engine: RunningService,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(tmp_path_factory.mktemp("keyed"), [engine.address], ["--api-key", "sesame"])
    try:
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            with pytest.raises(InvalidStatus) as refused:
                connect(f"ws://127.0.0.1:{gw.port}/v1/responses", additional_headers=headers, open_timeout=30)
            assert refused.value.response.status_code == 401
            body = json.loads(refused.value.response.body or b"{}")
            assert body["error"]["code"] == "invalid_api_key"
        with socket(gw, "sesame") as ws:
            assert final(turn(ws, input="Let me in.", store=False))["status"] in ("completed", "incomplete")
    finally:
        assert gw.stop() == 0, gw.log()


def open_connections(gateway: RunningService) -> float:
    text = httpx.get(f"http://127.0.0.1:{gateway.port}/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("ignis_gateway_connections_open ")))


def test_closed_sockets_leave_the_open_connections_gauge(gateway: RunningService) -> None:
    """An upgraded connection is counted while open and uncounted once closed (the WebSocket
    protocol takes it over from the HTTP one)."""
    before = open_connections(gateway)
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(socket(gateway))
        assert open_connections(gateway) == before + 3
    deadline = time.monotonic() + 10
    while open_connections(gateway) != before:
        assert time.monotonic() < deadline, "the gauge kept the closed sockets"
        time.sleep(0.05)


@pytest.mark.parametrize("where", ["input", "metadata", "stream_id", "a key"])
def test_a_lone_surrogate_is_an_error_event_and_the_socket_stays_open(gateway: RunningService, where: str) -> None:
    """Issue 49, attack item 4: over HTTP the same field is a clean 400; the socket once crashed with
    UnicodeEncodeError and closed (1000, no error event)."""
    fields = {"input": '"input": "bad \\ud800 text"', "metadata": '"metadata": {"k": "\\udfff"}',
              "stream_id": '"stream_id": "lane-\\ud83d"', "a key": '"metadata": {"\\ud800": "v"}'}[where]
    event = '{"type": "response.create", "model": "%s", "max_output_tokens": 4, "input": "x", %s}' % (MODEL, fields)
    with socket(gateway) as ws:
        ws.send(event)
        got = json.loads(ws.recv(timeout=60))
        assert got["type"] == "error" and got["status"] == 400, got
        assert "unpaired surrogate" in got["error"]["message"] and "stream_id" not in got
        good = final(turn(ws, input="Still here?"))
        assert good["status"] in ("completed", "incomplete")


def metric(gateway: RunningService, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{gateway.port}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_an_idle_socket_outlives_the_header_timeout(engine: RunningService, parser: str,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 47, item 1: the --header-timeout deadline re-armed on the upgraded connection (httptools) and
    closed an idle socket (or a long prefill) with no close frame. A socket's liveness is its ping/pong."""
    gw = start_gateway(tmp_path_factory.mktemp(f"idle-{parser}"), [engine.address],
                       ["--header-timeout", "1", "--http", parser])
    try:
        with socket(gw) as ws:
            time.sleep(3.5)  # several header deadlines pass with nothing sent either way
            assert final(turn(ws, input="Still there?", store=False))["status"] in ("completed", "incomplete")
            time.sleep(2.5)  # and again after an answer
            assert final(turn(ws, input="And now?", store=False))["status"] in ("completed", "incomplete")
        assert metric(gw, 'ignis_gateway_slow_connections_closed_total{phase="headers"}') == 0
        # The deadline still holds for HTTP: a connection that never sends its headers is closed.
        with contextlib.closing(create_connection(("127.0.0.1", gw.port))) as raw:
            raw.settimeout(30)
            assert raw.recv(1024) == b""
        assert metric(gw, 'ignis_gateway_slow_connections_closed_total{phase="headers"}') == 1
    finally:
        assert gw.stop() == 0, gw.log()


def test_a_client_close_logs_one_line_and_no_traceback(gateway: RunningService) -> None:
    """Issue 47, item 2: every close (a normal one included) logged 'Exception in ASGI application' with
    a traceback: the server's close after the client's raised WebSocketDisconnect."""
    start = len(gateway.log())
    with socket(gateway) as ws:  # a normal close (1000), after a turn
        final(turn(ws, input="Bye soon.", store=False))
    with socket(gateway) as ws:  # an abrupt one, mid-response: the connection drops with no close frame
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "Go on forever.",
                            "max_output_tokens": 20000, "ignore_eos": True, "store": False}))
        while json.loads(ws.recv(timeout=120))["type"] != "response.output_text.delta":
            pass
        ws.socket.shutdown(SHUT_RDWR)
    closes: list[str] = []
    log = ""
    deadline = time.monotonic() + 30
    while len(closes) < 2 and "Traceback" not in log:  # the gateway has seen both closes, or failed
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
        log = gateway.log()[start:]
        closes = [line for line in log.splitlines() if "closed its WebSocket" in line]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert not [line for line in log.splitlines() if " ERROR " in line], log
    said = [line.split(" INFO ")[1] for line in closes]
    assert said[0] == "ignis.gateway: the client closed its WebSocket on /v1/responses (code 1000)", said
    # Dropped with no close frame: no status came (1005/1006, as uvicorn reports it).
    assert re.fullmatch(r"ignis\.gateway: the client closed its WebSocket on /v1/responses \(code 100[56]\)",
                        said[1]), said


@pytest.fixture(scope="module")
def app_gateway(engine: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """A gateway that lets one browser origin in (--allowed-origins)."""
    service = start_gateway(tmp_path_factory.mktemp("origins"), [engine.address],
                            ["--allowed-origins", "https://app.example"])
    yield service
    assert service.stop() == 0, service.log()


def refused_origin(gateway: RunningService, origin: str) -> dict[str, Any]:
    with pytest.raises(InvalidStatus) as refused:
        connect(f"ws://127.0.0.1:{gateway.port}/v1/responses", origin=origin, open_timeout=30)  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
    error: dict[str, Any] = json.loads(refused.value.response.body or b"{}")["error"]
    assert error["code"] == "origin_not_allowed" and origin in error["message"]
    return error


def test_a_websocket_from_an_origin_not_allowed_is_refused(app_gateway: RunningService) -> None:
    """Issue 47, item 5: a browser applies no CORS to a WebSocket; the handshake's Origin is checked
    against --allowed-origins. No Origin (not a browser page) is unaffected."""
    for origin in ("https://evil.example", "http://app.example", "https://app.example:8443", "null",
                   "http://localhost:5173"):  # with a list, loopback pages are not let in either
        refused_origin(app_gateway, origin)
    url = f"ws://127.0.0.1:{app_gateway.port}/v1/responses"
    with connect(url, origin="https://app.example", open_timeout=30) as ws:  # type: ignore[arg-type]
        assert final(turn(ws, input="From the app.", store=False))["status"] in ("completed", "incomplete")
    with connect(url, open_timeout=30) as ws:
        assert final(turn(ws, input="No origin.", store=False))["status"] in ("completed", "incomplete")


def test_without_allowed_origins_only_loopback_pages_open_a_websocket(gateway: RunningService) -> None:
    """The default, as local dev servers do: a page on this machine works, any other site is refused."""
    for origin in ("https://evil.example", "http://localhost.evil.example", "http://127.0.0.1.nip.io:8000",
                   "null"):
        refused_origin(gateway, origin)
    url = f"ws://127.0.0.1:{gateway.port}/v1/responses"
    for origin in ("http://localhost:5173", "http://127.0.0.1:8000", "http://[::1]:3000", "http://localhost"):
        with connect(url, origin=origin, open_timeout=30) as ws:  # type: ignore[arg-type]
            if origin == "http://localhost:5173":
                assert final(turn(ws, input="A local page.", store=False))["status"] in ("completed", "incomplete")
