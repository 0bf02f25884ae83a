"""Length-prefixed messages on a stream socket, and who is at the other end of a Unix one.

The framing of the tierstore's Match socket (protos/ignis/v1/tierstore.proto, "local
match") and of the engine's session socket (engine.proto, ListModelsResponse.session_socket):
each message is its length as 4 bytes (unsigned, little-endian), then the message. Both ends
of each use it: the store (tierstore/match_socket.py) and the engine (engine/tiers/local_match.py);
the engine (engine/session_socket.py) and the gateway (gateway/session_socket.py). They meet only
here and in the protos. The blocking functions are the Match socket's, the async ones the session
socket's.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from common.grpc_server import MAX_MESSAGE_BYTES

M = TypeVar("M")
MAX_FRAME = MAX_MESSAGE_BYTES  # the same bound as a gRPC message to our servers
_CHUNK = 1 << 20
# An asyncio stream reader's buffer before it pauses its socket (a frame may be larger: readexactly resumes it).
STREAM_READ_LIMIT = 1 << 20
_LENGTH = struct.Struct("<I")


class FrameError(Exception):
    """The stream does not hold a well-formed frame: the connection cannot be used further."""


def send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME:
        raise FrameError(f"a {len(payload)}-byte frame is over the {MAX_FRAME}-byte bound")
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> bytes | None:
    """The next frame's payload; None when the peer closed the stream between frames.

    FrameError when it closed inside one or announced one over `limit`; OSError (a
    timeout among them) from the socket.
    """
    head = _recv_exactly(sock, _LENGTH.size, at_start=True)
    if head is None:
        return None
    (n,) = _LENGTH.unpack(head)
    if n > limit:
        raise FrameError(f"a frame of {n} bytes announced: over the {limit}-byte bound")
    body = _recv_exactly(sock, n, at_start=False)
    assert body is not None
    return body


def recv_message(sock: socket.socket, parse: Callable[[bytes], M]) -> M | None:
    """The next frame parsed as a protobuf message (`parse`: its FromString); None when the peer
    closed the stream between frames; FrameError when it is not one."""
    return _parsed(recv_frame(sock), parse)


def _parsed(payload: bytes | None, parse: Callable[[bytes], M]) -> M | None:
    if payload is None:
        return None
    try:
        return parse(payload)
    except DecodeError as exc:
        raise FrameError(f"a frame that is not the message expected: {exc}") from None


def frame(payload: bytes) -> bytes:
    """`payload` with its length in front (FrameError over the bound)."""
    if len(payload) > MAX_FRAME:
        raise FrameError(f"a {len(payload)}-byte frame is over the {MAX_FRAME}-byte bound")
    return _LENGTH.pack(len(payload)) + payload


class FrameSplitter:
    """read_frame for a protocol's `data_received`: feed it bytes as they come, take the frames they complete.

    Why not a StreamReader: a reader wakes its task a loop turn after the bytes land, and each
    frame takes two `readexactly` awaits; a protocol handles a frame in the turn its bytes arrive.
    """

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self._limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads `data` completes, in order (FrameError for an announced length over the bound)."""
        buffer = self._buffer
        buffer += data
        frames: list[bytes] = []
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(buffer, start)
            if n > self._limit:
                raise FrameError(f"a frame of {n} bytes announced: over the {self._limit}-byte bound")
            end = start + _LENGTH.size + n
            if len(buffer) < end:
                break
            frames.append(bytes(buffer[start + _LENGTH.size:end]))
            start = end
        if start:
            del buffer[:start]
        return frames

    def end(self) -> None:
        """The stream is over: FrameError if it stopped inside a frame."""
        if self._buffer:
            raise FrameError(f"the stream ended {len(self._buffer)} bytes into a frame")


def parse_message(payload: bytes, parse: Callable[[bytes], M]) -> M:
    """A frame's payload parsed as a protobuf message (FrameError when it is not one)."""
    message = _parsed(payload, parse)
    assert message is not None
    return message


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes | None:
    """recv_frame on an asyncio stream: None at a clean end between frames, FrameError inside one."""
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError(f"the stream ended {len(exc.partial)} bytes into a frame's length") from None
    (n,) = _LENGTH.unpack(head)
    if n > limit:
        raise FrameError(f"a frame of {n} bytes announced: over the {limit}-byte bound")
    try:
        return await reader.readexactly(n)  # the reader's buffer grows as bytes arrive
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"the stream ended {len(exc.partial)} bytes into a {n}-byte frame") from None


async def read_message(reader: asyncio.StreamReader, parse: Callable[[bytes], M]) -> M | None:
    """recv_message on an asyncio stream."""
    return _parsed(await read_frame(reader), parse)


def _recv_exactly(sock: socket.socket, n: int, at_start: bool) -> bytes | None:
    # Grown as bytes arrive, not sized from the announced length: a peer that announces 64 MiB and
    # sends nothing holds no memory for it.
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            if at_start and not buf:
                return None
            raise FrameError(f"the stream ended {len(buf)} bytes into a {n}-byte read")
        buf += chunk
    return bytes(buf)


def peer_uid(sock: socket.socket | Any) -> int:
    """The user id of the process at the other end of a connected Unix socket (SO_PEERCRED); `sock`
    may be asyncio's TransportSocket (a transport's "socket")."""
    _pid, uid, _gid = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("iII")))  # struct ucred
    return uid


def same_user(sock: socket.socket | Any) -> bool:
    """Whether the peer of a Unix socket runs as this process's user."""
    return peer_uid(sock) == os.getuid()
