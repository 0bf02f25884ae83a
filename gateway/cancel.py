"""A client that goes away cancels its work.

For streamed answers `sse.EventStream` does this; for a non-streamed answer
the handler awaits its result through `until_disconnect`, which cancels it
(and so the gRPC call) when ``http.disconnect`` arrives first.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
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


class DisconnectWatch:
    """Cancels the current task when ``http.disconnect`` arrives, and ends that cancel at the block's end.

    The work runs in the request's own task (no task of its own, no wait on two: each would cost the
    event loop a turn per request); one listener task waits for the disconnect. A cancel the watch
    caused is swallowed at the end of the ``with`` (check `disconnected`); any other goes on.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.disconnected = False

    def __enter__(self) -> DisconnectWatch:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._active = True
        self._listener = asyncio.create_task(wait_disconnect(self._receive))
        self._listener.add_done_callback(self._on_disconnect)
        return self

    def _on_disconnect(self, listener: asyncio.Task[None]) -> None:
        # A callback queued in the turn the block ended runs despite remove_done_callback: not past the block.
        if self._active and not listener.cancelled() and listener.exception() is None:
            self.disconnected = True
            self._task.cancel()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        self._active = False
        self._listener.remove_done_callback(self._on_disconnect)
        self._listener.cancel()
        return kind is asyncio.CancelledError and self.disconnected and self._task.uncancel() == 0


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancels it and raises a 499 if the client disconnects first.

    Call it after the body was read: the next ``receive`` then only returns on disconnect.
    """
    with DisconnectWatch(request.receive):
        return await work
    raise OpenAIError(499, "the client closed the request", code="client_closed_request")
