"""Server-Sent Events: encoding, and a pure-ASGI streaming response that notices a client leaving.

`EventStream` pulls the first event before it sends the response head, so an
error the engine reports before any output (queue full, bad input, no
engine) becomes a real HTTP status with an OpenAI body instead of a 200 with
an error event. While streaming it listens for ``http.disconnect``; when the
client goes away it cancels the producer, whose ``finally`` cancels the gRPC
call (upstream.generate), so the engine stops the sequence and frees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.aliases import JSONObject, SSEBytes
from gateway.cancel import wait_disconnect
from gateway.errors import OpenAIError, error_response

DONE: SSEBytes = b"data: [DONE]\n\n"
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-style proxies not to buffer the stream
]


def dumps(data: JSONObject) -> bytes:
    """Compact UTF-8 JSON, the same bytes as ``json.dumps(ensure_ascii=False, separators=(",", ":"))``
    but for floats under 1e-4 (0.00001, not 1e-05) and NaN/Infinity (null, which is JSON). orjson: a
    chunk in ~0.2 us instead of ~4 us, once per streamed token."""
    try:
        return orjson.dumps(data)
    except TypeError:  # an integer beyond 64 bits (a client's schema or metadata echoed back): the stdlib's
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def data_event(data: JSONObject) -> SSEBytes:
    return b"data: " + dumps(data) + b"\n\n"


def named_event(event: str, data: JSONObject) -> SSEBytes:
    return b"event: " + event.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class EventStream(Response):
    """A streaming response of `events`; see the module docstring.

    A `Response` only so handlers have one return type: it sets its own head
    and replaces `__call__`.
    """

    def __init__(self, events: AsyncIterator[SSEBytes], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.extra_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.create_task(self._stream(scope, send))
        listener = asyncio.create_task(wait_disconnect(receive))
        try:
            await asyncio.wait({producer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (listener, producer):
                if not task.done():
                    task.cancel()
            results = await asyncio.gather(producer, listener, return_exceptions=True)
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
            raise results[0]  # a bug in a producer: the app's handler logs it

    async def _stream(self, scope: Scope, send: Send) -> None:
        async with contextlib.aclosing(self.events):  # type: ignore[type-var]
            try:
                first = await anext(self.events)
            except StopAsyncIteration:
                first = None
            except OpenAIError as err:
                await error_response(err)(scope, _no_receive, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS + self.extra_headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
