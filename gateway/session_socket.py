"""The GenerateSession stream over an engine's session socket (engine/session_socket.py).

EngineSession hands it the function it runs on each SessionResponse of a gRPC stream;
`closed()` waits for the end (a broken connection or a frame that does not parse
raises ConnectionError or FrameError, which EngineSession ends as UNAVAILABLE, as a
dropped gRPC stream), and `cancel()` closes it. The same
messages as the gRPC stream, framed (common/frames.py). It is opened only to a
socket whose server runs as this gateway's user (SO_PEERCRED): the path comes from
the engine's ListModels answer, and a socket put there by another user is not ours
to trust with prompts.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Callable
from typing import cast

from common.frames import FrameError, FrameSplitter, frame, parse_message, same_user
from ignis.v1 import engine_pb2



class NotOurs(OSError):
    """The socket's server runs as another user."""


def on_this_host(address: str) -> bool:
    """Whether a gRPC target names this host: a Unix socket or a loopback address (so a path the
    engine reports is a path here)."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return True
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return loopback_host(host.removeprefix("ipv4:").removeprefix("ipv6:"))


def loopback_host(host: str) -> bool:
    """Whether `host` (an address or a name, IPv6 in brackets or not) is this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name: it may resolve anywhere


class SocketStream(asyncio.Protocol):
    """The session's connection. Each SessionResponse goes to `on_response` in the loop turn its bytes
    arrive: a StreamReader would wake a reading task a turn later and take two awaits a frame, and on
    a stream where every engine step is a message that turn is a good part of a token's cost
    (bench.gateway, beside the bare relay)."""

    def __init__(self, on_response: Callable[[engine_pb2.SessionResponse], None]) -> None:
        self._on_response = on_response
        self._frames = FrameSplitter()
        self._transport: asyncio.Transport | None = None
        self._ours = False  # the peer runs as this user: only then is a byte of it read
        loop = asyncio.get_running_loop()
        self._closed: asyncio.Future[None] = loop.create_future()
        self._writable: asyncio.Future[None] | None = None  # while the transport asks for a pause
        self._sending: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, path: str, requests: AsyncIterator[engine_pb2.SessionRequest],
                   on_response: Callable[[engine_pb2.SessionResponse], None]) -> SocketStream:
        """Connect (OSError, NotOurs among them, when it cannot be used: the caller takes gRPC)."""
        _, stream = await asyncio.get_running_loop().create_unix_connection(lambda: cls(on_response), path)
        if not stream._ours:
            raise NotOurs(f"the session socket {path} is served by another user")
        stream._sending = asyncio.create_task(stream._send(requests), name="engine-session-socket-writer")
        return stream

    # --- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is one, though not a subclass
        self._ours = same_user(transport.get_extra_info("socket"))  # checked before any byte is read
        if not self._ours:
            transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._ours or self._closed.done():
            return
        try:
            for payload in self._frames.feed(data):
                self._on_response(parse_message(payload, engine_pb2.SessionResponse.FromString))
        except FrameError as exc:
            self._end(exc)
            assert self._transport is not None
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._frames.end()
        except FrameError as cut:
            exc = exc or cut
        self._end(exc if exc is None or isinstance(exc, (ConnectionError, FrameError)) else ConnectionError(str(exc)))
        self.resume_writing()

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # --- the session's side -------------------------------------------------------------------
    async def closed(self) -> None:
        """Until the connection ends: ConnectionError or FrameError when it broke, None at a clean end."""
        await self._closed

    def cancel(self) -> None:
        if self._sending is not None:
            self._sending.cancel()
        if self._transport is not None:
            self._transport.close()

    def _end(self, error: BaseException | None) -> None:
        if self._closed.done():
            return
        if error is None:
            self._closed.set_result(None)
        else:
            self._closed.set_exception(error)

    async def _send(self, requests: AsyncIterator[engine_pb2.SessionRequest]) -> None:
        assert self._transport is not None
        try:
            async for request in requests:
                if self._transport.is_closing():
                    break
                self._transport.write(frame(request.SerializeToString()))
                if self._writable is not None:
                    await self._writable
        except FrameError:
            pass  # a request over the frame bound: the session ends and its calls fail, as over gRPC
        finally:
            self._transport.close()  # the session is over on this side: the engine ends its calls
