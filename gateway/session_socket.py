"""The GenerateSession stream over an engine's session socket (engine/session_socket.py).

Read as EngineSession reads a grpc.aio stream: iterate it for SessionResponse
messages (a broken connection or a frame that does not parse raises ConnectionError
or FrameError, which EngineSession ends as UNAVAILABLE, as a dropped gRPC stream),
and `cancel()` closes it. The same
messages as the gRPC stream, framed (common/frames.py). It is opened only to a
socket whose server runs as this gateway's user (SO_PEERCRED): the path comes from
the engine's ListModels answer, and a socket put there by another user is not ours
to trust with prompts.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator

from common.frames import STREAM_READ_LIMIT, FrameError, frame, read_message, same_user
from ignis.v1 import engine_pb2



class NotOurs(OSError):
    """The socket's server runs as another user."""


def on_this_host(address: str) -> bool:
    """Whether a gRPC target names this host: a Unix socket or a loopback address (so a path the
    engine reports is a path here)."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return True
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.removeprefix("ipv4:").removeprefix("ipv6:").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SocketStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 requests: AsyncIterator[engine_pb2.SessionRequest]) -> None:
        self._reader, self._writer = reader, writer
        self._sending = asyncio.create_task(self._send(requests), name="engine-session-socket-writer")

    @classmethod
    async def open(cls, path: str, requests: AsyncIterator[engine_pb2.SessionRequest]) -> SocketStream:
        """Connect (OSError, NotOurs among them, when it cannot be used: the caller takes gRPC)."""
        reader, writer = await asyncio.open_unix_connection(path, limit=STREAM_READ_LIMIT)
        if not same_user(writer.get_extra_info("socket")):
            writer.close()
            raise NotOurs(f"the session socket {path} is served by another user")
        return cls(reader, writer, requests)

    async def _send(self, requests: AsyncIterator[engine_pb2.SessionRequest]) -> None:
        try:
            async for request in requests:
                self._writer.write(frame(request.SerializeToString()))
                await self._writer.drain()
        except (ConnectionError, FrameError):
            pass  # the reading side sees the connection end and says so
        finally:
            self._writer.close()  # the session is over on this side: the engine ends its calls

    def __aiter__(self) -> SocketStream:
        return self

    async def __anext__(self) -> engine_pb2.SessionResponse:
        """ConnectionError or FrameError when the connection breaks (EngineSession says UNAVAILABLE)."""
        response = await read_message(self._reader, engine_pb2.SessionResponse.FromString)
        if response is None:
            raise StopAsyncIteration
        return response

    def cancel(self) -> None:
        self._sending.cancel()
        self._writer.close()
