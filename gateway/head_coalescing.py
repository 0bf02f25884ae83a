"""A transport that sends a response's head together with the start of its body: one send, not two.

uvicorn writes the status line and headers as soon as the app sends ``http.response.start``, and
the body with the next message, so every answer costs two ``send`` calls (and two wake-ups of the
client). On a small host each send is ~10-30 us of the gateway's CPU (bench/gateway.py). This
proxy holds a head (a write that starts with ``HTTP/1.`` and ends the header block) until the
next write, which is then joined to it, or until the loop's next turn, whichever comes first; so
nothing waits longer than one turn, and the order of the bytes never changes.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeadCoalescingTransport:
    """Wraps the connection's transport for uvicorn's protocol; everything but `write` passes through."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head + bytes(data))
        elif isinstance(data, bytes) and data.startswith(b"HTTP/1.") and data.endswith(b"\r\n\r\n"):
            self._head = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def writelines(self, lines: Any) -> None:
        self.write(b"".join(lines))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
