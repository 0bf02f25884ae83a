"""The gateway's stop: a drain, then whatever still runs ends with a final event, never a cut.

A SIGTERM or SIGINT (gateway/__main__.py) starts the drain: no new connection is taken, the
Monitor's endless streams end, a WebSocket closes with 1001 (going away) once its running turn is
over, and generations in flight get `--grace` seconds to finish. When the grace is spent (or a second
signal comes), every generation still running is ended with `ShuttingDown`, which its stream reports
as it reports any error after output began: a chat or completions stream sends ``data: {"error": ...}``
then ``data: [DONE]``, a Responses stream (SSE or WebSocket) ``response.failed``; a request whose
output had not begun is answered 503. Left to uvicorn, they were cancelled instead: the client's
stream cut with no final event, and a CancelledError logged.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator, Protocol

from gateway.errors import OpenAIError


class ShuttingDown(OpenAIError):
    """A generation the server's stop ended (a 503 before output began)."""

    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down: the generation was stopped", code="server_shutting_down",
                         headers={"Retry-After": "1"})


class Cancellable(Protocol):
    def cancel(self) -> bool: ...


class Shutdown:
    """Where the server is in its stop, for the handlers that end what they run (one per app)."""

    def __init__(self) -> None:
        self.draining = asyncio.Event()
        self.ended = False  # the grace is spent: generations are stopped, new ones refused
        self._calls: set[Cancellable] = set()
        self._sockets = 0
        self._no_sockets = asyncio.Event()
        self._no_sockets.set()

    def drain(self) -> None:
        self.draining.set()

    def end(self) -> None:
        """Stop every generation still running: each raises `ShuttingDown` to its stream (gateway/upstream.py)."""
        self.drain()
        self.ended = True
        for call in list(self._calls):
            call.cancel()

    @contextlib.contextmanager
    def generation(self, call: Cancellable) -> Iterator[None]:
        """`call` (an engine call) runs in this block; `end` cancels it."""
        if self.ended:
            raise ShuttingDown()
        self._calls.add(call)
        try:
            yield
        finally:
            self._calls.discard(call)

    async def sleep(self, seconds: float) -> bool:
        """Wait `seconds`, or less if the drain begins: True then (an endless stream ends)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.draining.wait()
        return self.draining.is_set()

    @contextlib.contextmanager
    def socket(self) -> Iterator[None]:
        """A WebSocket is open in this block: `sockets_closed` waits for it (it closes itself on the drain,
        with 1001 once its turn is over; uvicorn's own shutdown would cut it with 1012)."""
        self._sockets += 1
        self._no_sockets.clear()
        try:
            yield
        finally:
            self._sockets -= 1
            if self._sockets == 0:
                self._no_sockets.set()

    async def sockets_closed(self) -> None:
        await self._no_sockets.wait()
