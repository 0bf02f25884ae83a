"""WebSocket mode on /v1/responses: ``response.create`` events in, the stream's events out.

The client sends ``{"type": "response.create", ...}`` with the fields of a
create body (``stream`` is implied, ``background`` refused; a nested
``"response": {...}`` is read too); the server answers with the events SSE
would carry (``response.created`` ... ``response.completed``) as JSON text
frames. One response at a time per connection, in the order asked: a
``response.create`` sent while one runs waits its turn (queued, not refused).

The connection remembers its latest response's conversation, so
``previous_response_id`` naming it works with ``store: false`` too and the
client sends only the new items. ``generate: false`` is a prewarm: the input is
prefilled (``max_tokens`` 0), the engine retains the state at its end, and the
answer is a completed response with no output; the next turn, on any
connection, claims it.

Errors are ``{"type": "error", "status", "error": {"type", "code", "message",
"param"}}`` events (OpenAI's shape); a malformed event gets one and the socket
stays open. The client closing mid-response cancels the engine call; a client's close, however it
comes, is the normal end of a socket (one INFO line, no traceback). The server's stop (gateway/shutdown.py)
lets the running turn finish within its grace (else it ends with ``response.failed``), drops the turns
still queued, and closes the socket with 1001 (going away).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from gateway.aliases import JSONObject
from gateway.body import Fields, check_strings
from gateway.errors import OpenAIError, invalid
from gateway.routes.responses import Conversation, prepare
from gateway.state import GatewayState

log = logging.getLogger("ignis.gateway")
MAX_EVENT_BYTES = 16 << 20  # one client event (the gateway's HTTP body limit applies too)
GOING_AWAY = 1001  # the close code of a server that stops (RFC 6455)


def error_event(err: OpenAIError, stream_id: Any = None) -> JSONObject:
    event: JSONObject = {"type": "error", "status": err.status_code, "error": err.body()["error"]}
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event


class _Socket:
    def __init__(self, ws: WebSocket, state: GatewayState) -> None:
        self.ws, self.state = ws, state
        self.latest: Conversation | None = None  # the last response's conversation (store or not)

    async def send(self, event: JSONObject) -> None:
        await self.ws.send_text(json.dumps(event, ensure_ascii=False, separators=(",", ":")))

    def parse(self, text: str) -> tuple[Fields, bool, Any]:
        limit = min(MAX_EVENT_BYTES, self.state.config.max_request_bytes)
        if len(text) > limit:
            raise OpenAIError(413, f"the event is larger than {limit} bytes", code="request_too_large")
        try:
            event = json.loads(text)
        except ValueError as exc:
            raise invalid(f"the event is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(event, dict):
            raise invalid("an event must be a JSON object", code="invalid_event")
        if "\\u" in text:  # only a \uD800-\uDFFF escape puts a lone surrogate in a decoded str
            check_strings(event)  # a 400 naming the field, as over HTTP: it could never be sent back as UTF-8
        kind = event.get("type")
        if kind != "response.create":
            raise invalid(f"unknown event type {kind!r}: send 'response.create'", param="type",
                          code="invalid_event")
        nested = event.get("response")
        body: dict[str, Any] = nested if isinstance(nested, dict) else event
        body = {k: v for k, v in body.items() if k not in ("type", "stream", "stream_id", "generate")}
        if body.pop("background", False):
            raise invalid("background responses are not supported over a WebSocket", param="background")
        generate = event.get("generate", True)
        if not isinstance(generate, bool):
            raise invalid("'generate' must be a boolean", param="generate")
        return Fields(body), not generate, event.get("stream_id")

    async def turn(self, text: str) -> None:
        stream_id = None
        try:
            body, prewarm, stream_id = self.parse(text)
            turn = await prepare(self.state, body, self.ws.headers, self.latest, prewarm)
            async with contextlib.aclosing(turn.reply.events(turn.upstream())) as events:  # type: ignore[type-var]
                async for event in events:
                    if event["type"] == "error":  # an error after output began: the socket's shape
                        err = OpenAIError(500, event["message"], param=event["param"], code=event["code"])
                        event = dict(error_event(err), sequence_number=event["sequence_number"])
                    if stream_id is not None:
                        event["stream_id"] = stream_id
                    await self.send(event)
            if turn.reply.final is not None:
                self.latest = turn.conversation(turn.reply.final)
        except OpenAIError as err:
            await self.send(error_event(err, stream_id))


async def responses_socket(ws: WebSocket) -> None:
    """One connection: a reader queues the client's events, turns run one at a time in order;
    a disconnect cancels the running turn (and with it the engine call)."""
    state: GatewayState = ws.app.state.gateway
    with state.shutdown.socket():  # the stop waits for our close (1001) before uvicorn closes what is left
        await _serve(ws, state)


async def _serve(ws: WebSocket, state: GatewayState) -> None:
    await ws.accept()
    sock = _Socket(ws, state)
    draining = state.shutdown.draining
    inbox: asyncio.Queue[str | None] = asyncio.Queue()
    client_close: int | None = None  # the code of the client's close (1005/1006: it went without one)

    async def read() -> None:
        nonlocal client_close
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    client_close = int(message.get("code", 1005))
                    break
                text = message.get("text")
                if text is None and message.get("bytes") is not None:
                    text = message["bytes"].decode("utf-8", "replace")
                if text is not None:
                    inbox.put_nowait(text)
        finally:
            inbox.put_nowait(None)

    reader = asyncio.create_task(read(), name="responses-socket-reader")
    # The stop wakes an idle socket; one in a turn sees it when the turn is over.
    woken = asyncio.create_task(draining.wait(), name="responses-socket-drain")
    woken.add_done_callback(lambda _: inbox.put_nowait(None))
    try:
        while (text := await inbox.get()) is not None and not draining.is_set():
            running = asyncio.create_task(sock.turn(text))
            # Wait for the turn, but end it the moment the reader sees the client go.
            while not running.done():
                await asyncio.wait({running, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader.done() and not running.done():
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, RuntimeError, OSError):
                        await running
                    return
            exc = running.exception()
            if isinstance(exc, (WebSocketDisconnect, RuntimeError, OSError)):
                return  # the client went away while we wrote
            if exc is not None:
                raise exc
    finally:
        woken.cancel()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        if draining.is_set():
            await _close(ws, GOING_AWAY, "the server is shutting down")
        else:
            await _close(ws)
        if client_close is not None:  # the normal end of a socket: one line, no traceback
            log.info("the client closed its WebSocket on /v1/responses (code %d)", client_close)


async def _close(ws: WebSocket, code: int = 1000, reason: str | None = None) -> None:
    """Close our side unless the client already went: a client's close is the normal end, not an error.

    Starlette raises WebSocketDisconnect for a send after the client left (uvicorn's ClientDisconnected
    under it), and RuntimeError when the close was already sent: either way the socket is gone.
    """
    if ws.client_state is not WebSocketState.CONNECTED or ws.application_state is not WebSocketState.CONNECTED:
        return
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await ws.close(code, reason)
