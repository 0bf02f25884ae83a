"""The gateway's Generate calls to one engine, multiplexed on one GenerateSession stream.

Each request's call is a tag on the stream (protos/ignis/v1/engine.proto); the
engine sends every call's messages of one step in one SessionResponse, and a
reader task here hands them to each call's queue. A call behaves as the
`grpc.aio` Generate call it replaces: iterate it for GenerateResponse messages;
it raises `grpc.aio.AioRpcError` with the status the engine ended it with, or
with the stream's own error for every open call when the stream breaks (an
engine gone is UNAVAILABLE, as a Generate call would see); `cancel()` tells
the engine to stop the request. Its deadline is kept on both sides: the engine
ends the call at its timeout, and the gateway stops waiting then too (an engine
that hangs with its connection open).

A client that reads slower than the engine writes leaves its call's messages here (per-call
streams had HTTP/2 flow control per call; one session has it per engine, and stalling the
stream would stall every call on it). So each call holds at most `max_buffered` bytes of
messages not yet taken: past that it ends RESOURCE_EXHAUSTED (after the messages it holds)
and the engine stops the request, as Redis ends a client past its output buffer limit.

Why: per-call streams cost a gRPC message, and its wake-ups, per token on both
sides (bench/gateway.py measures both ways: `--upstream calls` is the old path).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from typing import AsyncIterator, Callable

import grpc

from common.frames import FrameError
from common.status_codes import code_of
from gateway.session_socket import SocketStream
from ignis.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("ignis.gateway")
_CLOSED = "the gateway closed its session with the engine"


def rpc_error(code: grpc.StatusCode, details: str, kind: type[grpc.aio.AioRpcError] = grpc.aio.AioRpcError
              ) -> grpc.aio.AioRpcError:
    return kind(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class SessionBroken(grpc.aio.AioRpcError):
    """The session stream itself failed (not the call): the engine is gone (UNAVAILABLE), does not serve
    GenerateSession (UNIMPLEMENTED, or a reset stream), or the gateway is closing it."""


class SlowReader(grpc.aio.AioRpcError):
    """A call ended because its client read too slowly (over its buffer): the client's doing, not the
    engine's (a RESOURCE_EXHAUSTED that no other engine should be tried for)."""


class SessionCall:
    """One Generate call on a session: an async iterator of its messages."""

    def __init__(self, session: EngineSession, tag: int, timeout: float | None) -> None:
        self._session = session
        self.tag = tag
        self._messages: collections.deque[tuple[engine_pb2.GenerateResponse, int]] = collections.deque()
        self._buffered = 0  # bytes of the messages not taken yet
        self._error: grpc.aio.AioRpcError | None = None
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout if timeout is not None else None

    # --- the reader's side --------------------------------------------------------------------
    def push(self, message: engine_pb2.GenerateResponse) -> None:
        if self._ended:
            return  # ended here (cancelled, over its buffer) while the engine was still sending
        size = message.ByteSize()
        self._buffered += size
        if self._buffered > self._session.max_buffered and self._messages:  # one message, however big, fits
            self._overflow()
            return
        self._messages.append((message, size))
        self._wake()

    def _overflow(self) -> None:
        """The reader fell too far behind: end the call rather than hold every token it is late for."""
        self._session.on_slow_reader()
        self.end(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the stream was ended: its client read too slowly (over {self._session.max_buffered} "
                           "bytes of output waited for it; the gateway's --max-stream-buffer)", SlowReader))
        self._session.cancel(self.tag)

    def end(self, error: grpc.aio.AioRpcError | None) -> None:
        self._ended = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- the caller's side --------------------------------------------------------------------
    def __aiter__(self) -> SessionCall:
        return self

    async def __anext__(self) -> engine_pb2.GenerateResponse:
        while not self._messages:
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if self._deadline is None:
                    await self._waiter
                else:
                    remaining = self._deadline - asyncio.get_running_loop().time()
                    await asyncio.wait_for(self._waiter, max(remaining, 0.0))
            except TimeoutError:
                self.cancel()
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            finally:
                self._waiter = None
        message, size = self._messages.popleft()
        self._buffered -= size
        return message

    def cancel(self) -> bool:
        """Stop the call (a no-op once it has ended), as `grpc.aio.Call.cancel`."""
        if self._ended:
            return False
        self.end(rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        self._session.cancel(self.tag)
        return True


class EngineSession:
    """The GenerateSession stream to one engine, opened on the first call and again after it breaks."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub, max_buffered: int,
                 on_slow_reader: Callable[[], None]) -> None:
        self._stub = stub
        self.max_buffered = max_buffered  # bytes a call holds for a slow reader (SessionCall)
        self.on_slow_reader = on_slow_reader  # told of each call ended for one (the gateway's fault summary)
        self._tags = itertools.count(1)
        self._calls: dict[int, SessionCall] = {}
        self._outbox: asyncio.Queue[engine_pb2.SessionRequest | None] | None = None
        self._reader: asyncio.Task[None] | None = None
        # The engine's session socket, when it is on this host and says it has one (the probe sets it):
        # the next stream opened goes there instead of gRPC (gateway/session_socket.py).
        self.socket_path = ""
        self.transport = ""  # what the open stream runs on: "socket", "grpc" ("" before the first)

    def generate(self, request: engine_pb2.GenerateRequest, timeout: float | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()) -> SessionCall:
        if self._outbox is None:
            self._open()
        assert self._outbox is not None
        call = SessionCall(self, next(self._tags), timeout)
        self._calls[call.tag] = call
        spec = engine_pb2.SessionCall(request=request, timeout_seconds=timeout or 0.0, trace_context=dict(metadata))
        self._outbox.put_nowait(engine_pb2.SessionRequest(tag=call.tag, call=spec))
        return call

    def cancel(self, tag: int) -> None:
        if self._calls.pop(tag, None) is not None and self._outbox is not None:
            self._outbox.put_nowait(engine_pb2.SessionRequest(tag=tag, cancel=True))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    def _open(self) -> None:
        outbox: asyncio.Queue[engine_pb2.SessionRequest | None] = asyncio.Queue()
        self._outbox = outbox

        async def requests() -> AsyncIterator[engine_pb2.SessionRequest]:
            while (request := await outbox.get()) is not None:
                yield request

        self._reader = asyncio.create_task(self._read(requests(), outbox), name="engine-session")

    async def _connect(self, requests: AsyncIterator[engine_pb2.SessionRequest]
                       ) -> grpc.aio.StreamStreamCall | SocketStream:
        path = self.socket_path
        if path:
            try:
                stream: grpc.aio.StreamStreamCall | SocketStream = await SocketStream.open(path, requests,
                                                                                         self._dispatch)
                self.transport = "socket"
                log.info("session with the engine opened on its session socket %s", path)
                return stream
            except OSError as exc:
                log.warning("the engine's session socket %s cannot be used (%s): the session goes over gRPC",
                            path, exc)
                self.socket_path = ""
        self.transport = "grpc"
        log.info("session with the engine opened over gRPC")
        return self._stub.GenerateSession(requests)

    def _dispatch(self, response: engine_pb2.SessionResponse) -> None:
        """Each event of one SessionResponse to its call."""
        for event in response.events:
            call = self._calls.get(event.tag)
            if call is None:
                continue  # cancelled here while the engine was sending
            if event.HasField("end"):
                del self._calls[event.tag]
                code = code_of(event.end.code)
                call.end(None if code is grpc.StatusCode.OK else rpc_error(code, event.end.details))
            else:
                call.push(event.response)

    async def _read(self, requests: AsyncIterator[engine_pb2.SessionRequest],
                    outbox: asyncio.Queue[engine_pb2.SessionRequest | None]) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the engine ended the session", SessionBroken)
        stream: grpc.aio.StreamStreamCall | SocketStream | None = None
        try:
            stream = await self._connect(requests)
            if isinstance(stream, SocketStream):
                await stream.closed()  # it hands each response to _dispatch as it lands
            else:
                async for response in stream:
                    self._dispatch(response)
        except grpc.aio.AioRpcError as exc:
            error = rpc_error(exc.code(), exc.details() or "", SessionBroken)
        except (ConnectionError, FrameError) as exc:  # the session socket broke
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the session socket failed: {exc}", SessionBroken)
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, _CLOSED, SessionBroken)
            if stream is not None:
                stream.cancel()
            raise
        finally:
            # This stream is done: the next call opens another; every call still open here has failed.
            if self._outbox is outbox:
                self._outbox = None
                self._reader = None
            outbox.put_nowait(None)
            calls = list(self._calls.values())
            self._calls.clear()
            if calls:
                log.info("session with the engine ended (%s: %s); %d calls failed", error.code().name,
                         error.details(), len(calls))
            for call in calls:
                call.end(error)
