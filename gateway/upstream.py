"""Calling an engine's Generate: engine choice with failover, error mapping, cancellation.

`generate` is an async generator over one request's GenerateResponse
messages, from a call on the engine's session stream (gateway/session.py) or
a Generate call of its own (`--upstream calls`). Before the first message arrives, an engine that answers
UNAVAILABLE (down, unreachable, shutting down, the connection lost) is marked
down and the next candidate is tried, and one that answers RESOURCE_EXHAUSTED
(its queue is full) is passed over for the next (nothing was produced, so the
retry is invisible; a full engine stays up). After the first message, errors
are the client's to see, and so is DEADLINE_EXCEEDED (the request's own
deadline is spent: a retry could not meet it). While a call runs it counts in
its engine's in-flight load (the routing rule's load term). Closing the generator (the client went away) cancels the gRPC call, and
the engine then frees the sequence. The server's stop ends a call still running when its grace is
spent: `ShuttingDown` (gateway/shutdown.py). Use it under `contextlib.aclosing`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
from opentelemetry import trace

from common.tracing import client_span, grpc_metadata, set_rpc_status
from gateway.engines import EngineClient, EnginePool
from gateway.errors import OpenAIError, from_grpc, unavailable
from gateway.routing import route_keys
from gateway.session import SessionBroken, SessionCall, SlowReader
from gateway.shutdown import ShuttingDown
from ignis.v1 import engine_pb2

GENERATE = "/ignis.v1.Engine/Generate"


@dataclass(frozen=True, slots=True)
class CallSpec:
    """How errors of one endpoint are named, and the call's deadline."""

    prompt_param: str  # "messages", "prompt" or "input"
    max_tokens_param: str
    timeout: float | None = None


async def generate(pool: EnginePool, request: engine_pb2.GenerateRequest, key: bytes, spec: CallSpec,
                   candidates: list[EngineClient] | None = None) -> AsyncIterator[engine_pb2.GenerateResponse]:
    """`candidates`: the engines to try, in order, when the caller has ordered them already (a stored
    conversation's engine first); else the routing rule's order."""
    reasons: list[str] = []
    full: grpc.aio.AioRpcError | None = None  # the last engine that was at capacity
    direct: set[EngineClient] = set()  # engines to call with Generate: their session stream failed
    engines = collections.deque(candidates if candidates is not None
                                else pool.candidates(request.model, route_keys(request, key)))
    while engines:
        engine = engines.popleft()
        if full is not None and not engine.healthy:
            break  # every healthy engine is full: say so (429), rather than try the down ones
        # One CLIENT span per attempt (a child of the request's SERVER span); the engine continues it.
        # Without an exporter (pool.traced false) no span is made: ~20 us a request.
        span = client_span(GENERATE, engine.address) if pool.traced else None
        pool.acquire(engine)
        metadata = grpc_metadata(trace.set_span_in_context(span)) if span is not None else ()
        session = engine.session if engine not in direct else None
        call: grpc.aio.UnaryStreamCall | SessionCall = (
            session.generate(request, spec.timeout, metadata) if session is not None
            else engine.stub.Generate(request, timeout=spec.timeout, metadata=metadata))
        started = False
        code = grpc.StatusCode.CANCELLED  # unless the call ends by itself: the client went away
        try:
            with pool.shutdown.generation(call):  # once the stop's grace is spent, it cancels the call
                async for msg in call:
                    started = True
                    yield msg
            code = grpc.StatusCode.OK
            return
        except asyncio.CancelledError:
            # A Generate call of its own raises this when cancelled (a session call: CANCELLED, below); the
            # task itself was not cancelled (the client is still there): the stop ended it.
            task = asyncio.current_task()
            if pool.shutdown.ended and task is not None and not task.cancelling():
                raise ShuttingDown() from None
            raise
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.CANCELLED and pool.shutdown.ended:
                raise ShuttingDown() from None
            if isinstance(exc, SlowReader):  # the client's pace ended it: no other engine is tried
                raise OpenAIError(408, exc.details() or "", code="slow_reader") from None
            if isinstance(exc, SessionBroken) and code != grpc.StatusCode.UNAVAILABLE and not started:
                # The engine does not serve sessions (an older one), or the stream was reset: the same
                # engine again, with a Generate call of its own.
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    pool.without_session(engine)
                direct.add(engine)
                engines.appendleft(engine)
                continue
            if code == grpc.StatusCode.UNAVAILABLE and not started:
                pool.mark_down(engine, exc.details() or "unavailable")
                reasons.append(f"{engine.address}: {exc.details()}")
                continue
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not started:
                full = exc
                continue
            if code == grpc.StatusCode.UNAVAILABLE:  # started: what was sent stands, no other engine can go on
                raise OpenAIError(502, f"engine {engine.address} failed after output began "
                                       f"({exc.details() or 'unavailable'}): the output ends here",
                                  code="engine_failed") from None
            raise from_grpc(exc, prompt_param=spec.prompt_param, max_tokens_param=spec.max_tokens_param) from None
        finally:
            call.cancel()  # no-op when the call already ended; frees the engine's work when it did not
            pool.release(engine)
            if span is not None:
                set_rpc_status(span, code)
                span.end()
    if full is not None:
        raise from_grpc(full, prompt_param=spec.prompt_param, max_tokens_param=spec.max_tokens_param)
    raise unavailable("no engine is available" + (f" ({'; '.join(reasons)})" if reasons else ""))


async def collect(stream: AsyncIterator[engine_pb2.GenerateResponse]) -> list[engine_pb2.GenerateResponse]:
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        return [msg async for msg in stream]


async def merge(streams: Sequence[AsyncIterator[engine_pb2.GenerateResponse]]
                ) -> AsyncIterator[tuple[int, engine_pb2.GenerateResponse]]:
    """Interleave several calls (one per prompt) as (stream index, message), in arrival order.

    The first error ends the merge; closing it closes (cancels) every call.
    """
    if len(streams) == 1:  # the common case, without the tasks
        async with contextlib.aclosing(streams[0]):  # type: ignore[type-var]
            async for msg in streams[0]:
                yield 0, msg
        return
    # Bounded: a pump waits for a slow reader, so each call's own buffer bound (--max-stream-buffer) holds.
    queue: asyncio.Queue[tuple[int, engine_pb2.GenerateResponse | None, BaseException | None]] = \
        asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: AsyncIterator[engine_pb2.GenerateResponse]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for msg in stream:
                    await queue.put((i, msg, None))
            await queue.put((i, None, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_all(streams: Sequence[AsyncIterator[engine_pb2.GenerateResponse]]
                      ) -> list[list[engine_pb2.GenerateResponse]]:
    """Every call's messages; the first failure cancels the other calls and is raised."""
    if len(streams) == 1:  # the common case, without the tasks
        return [await collect(streams[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(collect(s)) for s in streams]
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None
    return [t.result() for t in tasks]
