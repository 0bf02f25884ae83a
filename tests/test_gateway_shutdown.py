"""The gateway's stop (gateway/shutdown.py, issue 47 item 10): a SIGINT or SIGTERM drains for --grace, then
ends the streams still running with a final event, never a cut: an error then [DONE] on chat and
completions, response.failed on /v1/responses (over SSE, and over a WebSocket, which then closes with
1001); the process exits 0 and logs no traceback. Real engine and gateway processes on loopback."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from services import RunningService, start_gateway

MODEL = "ignis-tiny"  # the conftest engine's served name
LONG = 30_000  # tokens, with ignore_eos: far longer than any test lets it run
# What uvicorn logged when it cut the streams at the grace's end, and what must never show.
NOT_IN_LOG = ("Traceback", "CancelledError", "Exception in ASGI", "graceful shutdown exceeded")


def gateway_for(engine: RunningService, workdir: Path, *args: str) -> RunningService:
    return start_gateway(workdir, [engine.address], list(args))


def data_lines(reply: httpx.Response) -> Iterator[str]:
    for line in reply.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def stopped_cleanly(gateway: RunningService) -> None:
    assert gateway.process.wait(120) == 0, gateway.log()
    log = gateway.log()
    for text in NOT_IN_LOG:
        assert text not in log, log


def wait_for_log(gateway: RunningService, text: str) -> None:
    """Polls the log (the gateway says when its stop begins); a loaded machine gets all the room it needs."""
    deadline = time.monotonic() + 120
    while text not in gateway.log():
        assert gateway.process.poll() is None and time.monotonic() < deadline, gateway.log()
        time.sleep(0.05)


def chat_body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


@pytest.mark.parametrize("upstream", ["session", "calls"])
def test_a_chat_stream_ends_with_an_error_event_then_done(engine: RunningService, tmp_path: Path,
                                                          upstream: str) -> None:
    """--grace 0: the stop ends the stream at once (the other tests show the drain before it)."""
    gateway = gateway_for(engine, tmp_path, "--grace", "0", "--upstream", upstream)
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{gateway.port}/v1/chat/completions", json=chat_body(LONG),
                          timeout=120) as reply:
            assert reply.status_code == 200
            lines = data_lines(reply)
            for _ in range(3):
                assert "choices" in json.loads(next(lines))  # output has begun
            gateway.process.send_signal(signal.SIGINT)
            rest = list(lines)
        assert rest[-1] == "[DONE]", rest[-3:]
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"], error
        assert all("error" not in json.loads(line) for line in rest[:-2])
        stopped_cleanly(gateway)
    finally:
        gateway.stop()


def test_a_responses_stream_ends_with_response_failed(engine: RunningService, tmp_path: Path) -> None:
    gateway = gateway_for(engine, tmp_path, "--grace", "0")
    body = {"model": MODEL, "input": "tell me a long story", "max_output_tokens": LONG, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{gateway.port}/v1/responses", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            events = []
            for line in data_lines(reply):
                events.append(json.loads(line))
                if len(events) == 5:  # created, in_progress, then output
                    gateway.process.send_signal(signal.SIGINT)
        created, last = events[0], events[-1]
        assert created["type"] == "response.created" and last["type"] == "response.failed", last
        response = last["response"]
        assert response["id"] == created["response"]["id"] and response["status"] == "failed"
        assert response["error"]["code"] == "server_error" and "shutting down" in response["error"]["message"]
        assert response["output"]  # what it had said stays in the failed response
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        stopped_cleanly(gateway)
    finally:
        gateway.stop()


def test_a_websocket_turn_ends_with_response_failed_and_every_socket_closes_going_away(
        engine: RunningService, tmp_path: Path) -> None:
    gateway = gateway_for(engine, tmp_path, "--grace", "0")
    url = f"ws://127.0.0.1:{gateway.port}/v1/responses"
    try:
        with connect(url, open_timeout=30) as busy, connect(url, open_timeout=30) as idle:
            busy.send(json.dumps({"type": "response.create", "model": MODEL, "input": "tell me a long story",
                                  "max_output_tokens": LONG, "ignore_eos": True}))
            events = [json.loads(busy.recv(timeout=120)) for _ in range(4)]
            assert events[0]["type"] == "response.created"
            gateway.process.send_signal(signal.SIGTERM)
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    events.append(json.loads(busy.recv(timeout=120)))
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001, closed.value
            last = events[-1]
            assert last["type"] == "response.failed" and last["response"]["status"] == "failed", last
            assert "shutting down" in last["response"]["error"]["message"]
            with pytest.raises(ConnectionClosed) as closed:
                idle.recv(timeout=120)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001, closed.value
        stopped_cleanly(gateway)
    finally:
        gateway.stop()


def test_the_drain_lets_a_stream_finish_and_a_second_signal_ends_the_rest(engine: RunningService,
                                                                         tmp_path: Path) -> None:
    """A long grace: a short stream running at the signal finishes whole; a second signal ends the long one now."""
    gateway = gateway_for(engine, tmp_path, "--grace", "600")
    url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
    try:
        with httpx.stream("POST", url, json=chat_body(LONG), timeout=120) as long_reply, \
                httpx.stream("POST", url, json=chat_body(16), timeout=120) as short_reply:
            long_lines, short_lines = data_lines(long_reply), data_lines(short_reply)
            next(long_lines), next(short_lines)  # both have begun
            gateway.process.send_signal(signal.SIGINT)
            wait_for_log(gateway, "stopping:")
            short = list(short_lines)
            assert short[-1] == "[DONE]" and all("error" not in json.loads(line) for line in short[:-1]), short
            assert any(c["finish_reason"] == "length" for line in short[:-1] for c in json.loads(line)["choices"])
            assert gateway.process.poll() is None  # still draining: the long stream has its grace
            gateway.process.send_signal(signal.SIGINT)
            rest = list(long_lines)
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "server_shutting_down", rest[-3:]
        stopped_cleanly(gateway)
    finally:
        gateway.stop()


def test_the_monitor_stream_ends_at_the_signal(engine: RunningService, tmp_path: Path) -> None:
    """An endless stream does not hold the stop for its grace: it ends when the drain begins."""
    gateway = gateway_for(engine, tmp_path, "--grace", "600")
    try:
        with httpx.stream("GET", f"http://127.0.0.1:{gateway.port}/v1/ignis/state/stream", timeout=120) as reply:
            lines = data_lines(reply)
            assert json.loads(next(lines))["object"] == "ignis.state"
            gateway.process.send_signal(signal.SIGTERM)
            for line in lines:
                assert json.loads(line)["object"] == "ignis.state"
        stopped_cleanly(gateway)
    finally:
        gateway.stop()
