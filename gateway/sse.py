"""Server-Sent Events: encoding, and a pure-ASGI streaming response that notices a client leaving.

`EventStream` pulls the first event before it sends the response head, so an
error the engine reports before any output (queue full, bad input, no
engine) becomes a real HTTP status with an OpenAI body instead of a 200 with
an error event. The stream runs in the request's own task under a
`DisconnectWatch`: when the client goes away the watch cancels that task, whose
``finally`` cancels the engine call (upstream.generate), so the engine stops the
sequence and frees it.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.aliases import JSONObject, SSEBytes
from gateway.cancel import DisconnectWatch
from gateway.json_body import dumps
from gateway.errors import OpenAIError, error_response

DONE: SSEBytes = b"data: [DONE]\n\n"
# Scope key (set by gateway.app.GatewayApp): the server's own `send`, under every middleware's wrapper.
# The middlewares watch a response's head and first body bytes only, so a stream's later chunks skip them.
SERVER_SEND = "ignis.server_send"
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-style proxies not to buffer the stream
]


def data_event(data: JSONObject) -> SSEBytes:
    return b"data: " + dumps(data) + b"\n\n"


def chunk_frame(chunk: JSONObject) -> tuple[SSEBytes, SSEBytes]:
    """The event bytes of `chunk` before and after where its one choice goes (its "choices" replaced):
    ``head + dumps(choice) + tail == data_event({**chunk, "choices": [choice]})``, so a stream encodes
    its fixed fields once and each token's choice alone."""
    encoded = data_event({**chunk, "choices": [0]})
    head, sep, tail = encoded.partition(b'"choices":[0]')  # a key: quotes inside strings are escaped
    assert sep, encoded
    return head + b'"choices":[', b"]" + tail


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
        with DisconnectWatch(receive):  # the stream runs in this task; a disconnect cancels it
            try:
                await self._stream(scope, send)
            except OSError:
                pass  # the client's socket went away mid-write

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
                # Events ending in [DONE] end the stream: the body's end leaves in the same write.
                more = not first.endswith(DONE)
                await send({"type": "http.response.body", "body": first, "more_body": more})
                if not more:
                    return
                send = scope.get(SERVER_SEND, send)
                async for event in self.events:
                    more = not event.endswith(DONE)
                    await send({"type": "http.response.body", "body": event, "more_body": more})
                    if not more:
                        return
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
