"""GenerateSession on a Unix socket beside the gRPC port, for a gateway on this host.

The same SessionRequest and SessionResponse messages as the gRPC stream, framed
(common/frames.py), served by the same GenerateSession (engine/session.py): calls,
cancels, deadlines, ends and spans behave as they do over gRPC. Why: on a gateway's
one stream to its engine every step is a message, and grpc.aio pays a few thread
wake-ups per message on each end (~250-600 µs of CPU on this project's VMs, against
~15-270 µs for an asyncio socket read: bench/gateway.py measures both ways).

The socket is private: it lies in a folder only this user can enter (0700, made fresh
at start-up), is itself 0600, and a connection from another user is closed unread
(SO_PEERCRED). A frame that does not parse ends its own connection (and so its calls);
the engine keeps serving. ListModelsResponse.session_socket names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from common.frames import STREAM_READ_LIMIT, FrameError, frame, read_message, same_user
from engine.session import GenerateSession, Servicer
from ignis.v1 import engine_pb2

log = logging.getLogger("ignis.engine")
SOCKET_NAME = "session.sock"


class SessionSocket:
    def __init__(self, service: Servicer) -> None:
        self._service = service
        self._folder: Path | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def path(self) -> str:
        """The socket's path ("" when not serving)."""
        return str(self._folder / SOCKET_NAME) if self._folder is not None and self._server is not None else ""

    async def start(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="ignis-engine-"))  # 0700, this user's
        path = folder / SOCKET_NAME
        old = os.umask(0o177)  # the socket is made 0600, never briefly wider
        try:
            self._server = await asyncio.start_unix_server(self._serve, str(path), limit=STREAM_READ_LIMIT)
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            os.umask(old)
        self._folder = folder

    async def close(self) -> None:
        """Stop listening and end every connection (their calls end as a dropped stream's do)."""
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if not same_user(writer.get_extra_info("socket")):
                log.warning("session socket: a connection from another user was refused")
                return
            async for response in GenerateSession(self._service).serve(_requests(reader, task)):
                writer.write(frame(response.SerializeToString()))
                await writer.drain()  # a gateway that stops reading holds the engine's outbox, as over gRPC
        except ConnectionError as exc:
            log.info("session socket: a connection ended: %s", exc)
        except asyncio.CancelledError:
            pass  # the gateway went away (or sent what is not a frame), or the engine is closing
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _requests(reader: asyncio.StreamReader, serving: asyncio.Task[None]
                    ) -> AsyncIterator[engine_pb2.SessionRequest]:
    """The connection's requests. Its end is the gateway's end (it never half-closes): the task
    serving it is cancelled, which ends every call still open on it, as a dropped gRPC stream does."""
    try:
        while (request := await read_message(reader, engine_pb2.SessionRequest.FromString)) is not None:
            yield request
    except (FrameError, ConnectionError) as exc:
        log.warning("session socket: ending a connection: %s", exc)
    finally:
        serving.cancel()
