"""`--body-timeout`: a pure-ASGI middleware that answers 408 when a request's body stops arriving.

The deadline runs from the end of the headers (when the app is called) to the body's last
chunk; only the reads of the body are timed, so the later ``receive`` calls that wait for a
client's disconnect (gateway/cancel.py, gateway/sse.py) are not. The 408 carries
``Connection: close``: the rest of that body is never read. A body the app never reads (an
early 401 or 413) is bounded by the protocol instead (gateway/http_protocol.py).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import OpenAIError
from gateway.connection_faults import ConnectionFaults


class BodyDeadline:
    def __init__(self, app: ASGIApp, timeout: float, faults: ConnectionFaults) -> None:
        self.app = app
        self.timeout = timeout
        self.faults = faults

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        complete = False

        async def timed_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                self.faults.closed("body")
                raise OpenAIError(408, f"the request body did not arrive within {self.timeout:g} s",
                                  code="request_timeout", headers={"Connection": "close"}) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)
