"""A client that goes away cancels its work.

For streamed answers `sse.EventStream` does this; for a non-streamed answer
the handler awaits its result through `until_disconnect`, which cancels it
(and so the gRPC call) when ``http.disconnect`` arrives first.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import Request
from starlette.types import Message, Receive

from gateway.errors import OpenAIError

T = TypeVar("T")


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancels it and raises a 499 if the client disconnects first.

    Call it after the body was read: the next ``receive`` then only returns on disconnect.
    """
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)
    if task.cancelled():
        raise OpenAIError(499, "the client closed the request", code="client_closed_request")
    return task.result()
