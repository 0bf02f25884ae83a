"""GenerateSession: many Generate calls on one gRPC stream, one message per step for all of them.

A gateway streams hundreds of requests from one engine. As separate Generate
calls, every token is its own gRPC message (a stream frame, a wake-up of the
caller's gRPC threads, a read): ~100-200 us of CPU per token on each side on a
small host (bench/gateway.py). On a session the engine's step hands all its
updates for the stream's calls over at once (`Outbox`), and they leave as one
SessionResponse, so at width the per-message cost is shared by every token of
the step.

Each call keeps a Generate call's contract: the same messages in the same
order, then an end with the status Generate would end with (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED past its timeout, INTERNAL ...), and the
same SERVER span continuing the caller's trace. A cancel frees the request's
work at once; so does the stream ending, for every call still open on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Generic, Iterator, Protocol, TypeVar

import grpc

from common.tracing import server_call_span, set_rpc_status
from engine.call_status import Abort, submit
from engine.core import EngineCore
from engine.outputs import RequestUpdate
from engine.proto_convert import fill_update_messages
from engine.request import EngineRequest
from ignis.v1 import engine_pb2

log = logging.getLogger("ignis.engine")


class Servicer(Protocol):
    """What a session needs of the engine's servicer (engine/server.py): its checks, not its RPCs."""

    @property
    def core(self) -> EngineCore: ...  # raises Abort while loading or shutting down

    async def engine_request(self, request: engine_pb2.GenerateRequest) -> EngineRequest: ...

    @property
    def max_open_calls(self) -> int: ...  # calls one session may hold open at once

_Item = TypeVar("_Item")
GENERATE_METHOD = "/ignis.v1.Engine/Generate"  # each call's span is named as a Generate call's
# A SessionResponse is split past this size (echoed prompt logprobs can be large; the gateway's
# receive limit is 64 MiB).
MAX_RESPONSE_BYTES = 8 << 20


class Outbox(Generic[_Item]):
    """Updates from the engine thread and ends from the event loop, in order, waking the loop once per burst.

    A step calls every request's sink in a row. The session's sinks queue quietly and the engine
    wakes the loop once the round is out (`EngineCore.add_update_listener`): one wake-up and one
    message a step, where waking on the first update let the loop take a step's updates in ~20
    pieces, each a wake-up, a message and GIL hand-offs with the step thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[_Item] = []
        self._ready = asyncio.Event()
        self._signalled = False

    def put_quietly(self, item: _Item) -> None:
        """From the engine thread, without waking the loop: `wake_threadsafe` follows (once a round)."""
        with self._lock:
            self._items.append(item)

    def wake_threadsafe(self) -> None:
        """Wake the loop for what `put_quietly` queued, if anything and if not woken already."""
        with self._lock:
            wake = bool(self._items) and not self._signalled
            self._signalled = self._signalled or wake
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    def put(self, item: _Item) -> None:
        """From the event loop."""
        with self._lock:
            self._items.append(item)
        self._ready.set()

    async def take(self) -> list[_Item]:
        await self._ready.wait()
        self._ready.clear()
        with self._lock:
            items, self._items = self._items, []
            self._signalled = False
        return items


@dataclass(eq=False)
class _Call:
    tag: int
    core: EngineCore | None = None  # set once submitted
    request_id: str = ""
    echo_ids: tuple[int, ...] | None = None  # the prompt's ids, sent on the first message with echo
    ended: asyncio.Future[grpc.StatusCode] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    task: asyncio.Task[None] | None = None  # held: the loop keeps only a weak reference to a task


class GenerateSession:
    """One GenerateSession stream: its open calls and the messages on their way out."""

    def __init__(self, service: Servicer) -> None:
        self._service = service
        # (call, update) from the engine thread; (tag, end) from the loop; None wakes the writer.
        self._outbox: Outbox[tuple[_Call, RequestUpdate] | tuple[int, engine_pb2.SessionEnd] | None] = \
            Outbox(asyncio.get_running_loop())
        self._calls: dict[int, _Call] = {}
        self._reading = True
        self._core: EngineCore | None = None  # the core that tells the outbox when a round of updates is out

    def _listen(self, core: EngineCore) -> None:
        if self._core is not core:
            if self._core is not None:
                self._core.remove_update_listener(self._outbox.wake_threadsafe)
            core.add_update_listener(self._outbox.wake_threadsafe)
            self._core = core

    async def serve(self, requests: AsyncIterator[engine_pb2.SessionRequest]
                    ) -> AsyncIterator[engine_pb2.SessionResponse]:
        reader = asyncio.create_task(self._read(requests), name="session-reader")
        try:
            while self._reading or self._calls:
                for response in self._responses(await self._outbox.take()):
                    yield response
        finally:
            reader.cancel()
            for call in list(self._calls.values()):
                self._close(call, grpc.StatusCode.CANCELLED)
            await asyncio.gather(reader, return_exceptions=True)
            if self._core is not None:
                self._core.remove_update_listener(self._outbox.wake_threadsafe)

    async def _read(self, requests: AsyncIterator[engine_pb2.SessionRequest]) -> None:
        try:
            async for request in requests:
                if request.HasField("call"):
                    self._start(request.tag, request.call)
                elif request.cancel:
                    call = self._calls.get(request.tag)
                    if call is not None:
                        self._close(call, grpc.StatusCode.CANCELLED)
        finally:
            self._reading = False  # the caller closed its side: end the stream once the open calls end
            self._outbox.put(None)  # wake the writer to notice

    # --- one call ------------------------------------------------------------------------------
    def _start(self, tag: int, spec: engine_pb2.SessionCall) -> None:
        running = self._calls.get(tag)
        if running is not None:  # the two calls cannot be told apart: both end
            self._end(running, grpc.StatusCode.INVALID_ARGUMENT, f"tag {tag} is already in use")
            return
        limit = self._service.max_open_calls
        if len(self._calls) >= limit:  # calls still rendering are not in the engine's queue yet: bound them here
            self._outbox.put((tag, _end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"this session has {limit} calls open (the engine's queue size)")))
            return
        call = _Call(tag)
        self._calls[tag] = call
        call.task = asyncio.create_task(self._run(call, spec), name=f"session-call-{tag}")

    async def _run(self, call: _Call, spec: engine_pb2.SessionCall) -> None:
        with server_call_span(GENERATE_METHOD, spec.trace_context) as span:
            code = grpc.StatusCode.CANCELLED
            try:
                async with _deadline(spec.timeout_seconds):
                    code = await self._generate(call, spec.request)
            except TimeoutError:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                self._end(call, code, "Deadline Exceeded")
            finally:
                set_rpc_status(span, code, server=True)

    async def _generate(self, call: _Call, request: engine_pb2.GenerateRequest) -> grpc.StatusCode:
        service = self._service
        try:
            core = service.core
            engine_request = await service.engine_request(request)  # the servicer's own checks
            if self._calls.get(call.tag) is not call:
                return grpc.StatusCode.CANCELLED  # ended while its prompt was rendered
            call.request_id = engine_request.request_id
            call.echo_ids = engine_request.prompt_ids if engine_request.echo else None
            self._listen(core)
            submit(core, engine_request, lambda update: self._outbox.put_quietly((call, update)))
        except Abort as exc:
            self._end(call, exc.code, exc.message)
            return exc.code
        except Exception:  # a bug: the call still ends with a status, and its place on the stream is free again
            log.exception("admitting the call of tag %d failed", call.tag)
            self._end(call, grpc.StatusCode.INTERNAL, "internal error while admitting the request (see the engine log)")
            return grpc.StatusCode.INTERNAL
        call.core = core
        return await asyncio.shield(call.ended)  # set when the last update goes out (or the call closes)

    def _end(self, call: _Call, code: grpc.StatusCode, details: str) -> None:
        """The call is over on the loop's side: tell the caller, and free the engine's work."""
        if self._close(call, code):
            self._outbox.put((call.tag, _end(code, details)))

    def _close(self, call: _Call, code: grpc.StatusCode) -> bool:
        """End the call, freeing its work; nothing more is sent for it. False: it had ended already."""
        if self._calls.get(call.tag) is not call:
            return False
        del self._calls[call.tag]
        if call.core is not None:
            call.core.abort(call.request_id)  # a no-op once the request has finished
        if not call.ended.done():
            call.ended.set_result(code)
        return True

    # --- the writer ------------------------------------------------------------------------------
    def _responses(self, items: list[tuple[_Call, RequestUpdate] | tuple[int, engine_pb2.SessionEnd] | None]
                   ) -> Iterator[engine_pb2.SessionResponse]:
        out = engine_pb2.SessionResponse()
        size = 0
        for item in items:
            if item is None:
                continue
            if not isinstance(item[0], _Call):
                tag, end = item
                out.events.add(tag=tag, end=end)
                continue
            call, update = item
            if self._calls.get(call.tag) is not call or call.core is None:
                continue  # ended while its update was on the way (its tag may name a newer call now)
            echo, call.echo_ids = call.echo_ids, None
            tag = call.tag
            for msg in fill_update_messages(call.core.tokenizer, update, echo, lambda: out.events.add(tag=tag).response):
                if msg.prompt_logprobs or len(msg.logprobs) > 64:
                    size += msg.ByteSize()
            if update.error is not None:
                self._finish(call, grpc.StatusCode.INTERNAL, update.error, out)
            elif update.done:
                self._finish(call, grpc.StatusCode.OK, "", out)
            if size > MAX_RESPONSE_BYTES:
                yield out
                out, size = engine_pb2.SessionResponse(), 0
        if out.events:
            yield out

    def _finish(self, call: _Call, code: grpc.StatusCode, details: str, out: engine_pb2.SessionResponse) -> None:
        del self._calls[call.tag]
        out.events.add(tag=call.tag, end=_end(code, details))
        if not call.ended.done():
            call.ended.set_result(code)


def _end(code: grpc.StatusCode, details: str) -> engine_pb2.SessionEnd:
    return engine_pb2.SessionEnd(code=code.value[0], details=details)


@contextlib.asynccontextmanager
async def _deadline(seconds: float) -> AsyncIterator[None]:
    if seconds > 0:
        async with asyncio.timeout(seconds):
            yield
    else:
        yield
