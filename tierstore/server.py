"""The gRPC face of the tierstore: a thin servicer over TierStore, plus health and reflection.

Every store call runs in the default thread pool (it may fsync or hash a large
state) so the asyncio loop keeps answering health checks. Match, on every claim's
path, runs on the loop itself when the store's lock is free (it reads only the
in-memory index and the LMDB one, and saves the two thread hops of the pool); when
the lock is held (a spill or a restore is moving bytes) it goes to the pool too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2

from common.grpc_server import build_server
from common.grpc_server import set_serving as set_health
from common.tracing import ServerTracingInterceptor
from ignis.v1 import tierstore_pb2, tierstore_pb2_grpc
from tierstore.arena import Extent
from common.secret_auth import SecretAuth
from tierstore.errors import (AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound, TierStoreError,
                              Unavailable)
from tierstore.registry import Registration
from tierstore.state import check_hash, short
from tierstore.store import Hit, Lease, StoreStats, TierStore

log = logging.getLogger("ignis.tierstore")
SERVICE_NAME = "ignis.v1.TierStore"
CHUNK = 1 << 20  # Get sends at most 1 MiB per message (tierstore.proto)
T = TypeVar("T")

_CODES: dict[type[TierStoreError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}
TIER_FAULT_KEY = "ignis-tier-fault"  # trailing metadata of an UNAVAILABLE from a failing lower tier
INTERNAL_DETAILS = "internal error in the tierstore; see its log"  # a bug: the traceback is in the log


def _extent(e: Extent) -> tierstore_pb2.Extent:
    return tierstore_pb2.Extent(offset=e.offset, length=e.length)


def _hit(h: Hit) -> tierstore_pb2.MatchHit:
    return tierstore_pb2.MatchHit(hash=h.hash, state_hash=h.state_hash, tokens=h.tokens, tier=h.tier,  # type: ignore[arg-type]
                                  kind=h.kind, nbytes=h.nbytes,  # type: ignore[arg-type]
                                  extent=_extent(h.extent) if h.extent is not None else None, lease_id=h.lease_id,
                                  metadata=h.info.to_proto() if h.info is not None else None)


def match_args(request: tierstore_pb2.MatchRequest) -> tuple[bytes, list[bytes], bytes | None, bool, float]:
    """A MatchRequest as TierStore.match_anchored's arguments (checked there)."""
    tail = bytes(request.tail_hash) if request.HasField("tail_hash") else None
    return (bytes(request.namespace), [bytes(p) for p in request.page_hashes], tail, request.anchored,
            request.lease_seconds)


def match_response(store: TierStore, found: tuple[list[Hit], list[Hit]]) -> tierstore_pb2.MatchResponse:
    hits, candidates = found
    return tierstore_pb2.MatchResponse(hits=[_hit(h) for h in hits], candidates=[_hit(c) for c in candidates],
                                       instance_id=store.instance_id)


def refusal_code(exc: TierStoreError) -> grpc.StatusCode:
    """The status a refusal of the store ends its call with."""
    return next(c for cls, c in _CODES.items() if isinstance(exc, cls))


def stats_message(s: StoreStats) -> tierstore_pb2.StatsResponse:
    return tierstore_pb2.StatsResponse(
        arena_bytes_used=s.arena_bytes_used, arena_bytes_total=s.arena_bytes_total,
        disk_bytes_used=s.disk_bytes_used, disk_bytes_total=s.disk_bytes_total, states_ram=s.states_ram,
        states_disk=s.states_disk, checksum_failures=s.checksum_failures, leases_active=s.leases_active,
        reservations_pending=s.reservations_pending, spills=s.spills, restores=s.restores, evictions=s.evictions,
        protected_refusals=s.protected_refusals, disk_usable=s.disk_usable, disk_errors=s.disk_errors,
        blobs_missing=s.blobs_missing, arena_recreations=s.arena_recreations, ram_states_lost=s.ram_states_lost,
        arena_path=s.arena_path, instance_id=s.instance_id, arena_usable=s.arena_usable,
        copies_ahead=s.copies_ahead)


class TierStoreService(tierstore_pb2_grpc.TierStoreServicer):
    def __init__(self, store: TierStore, match_socket: str = "") -> None:
        self.store = store
        self.match_socket = match_socket  # the Match socket's path, told to each Register ("": none)

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: object,
                    inline: bool = False) -> T:
        """Runs a store call off the loop (on it with `inline`: never one that may wait); its refusals
        become their status codes."""
        try:
            return fn(*args) if inline else await asyncio.to_thread(fn, *args)
        except TierStoreError as exc:
            await _abort(context, exc)
        except Exception:  # a bug: say so with INTERNAL rather than a bare UNKNOWN
            log.exception("%s failed", getattr(fn, "__name__", fn))
            await _fail(context, grpc.StatusCode.INTERNAL, INTERNAL_DETAILS)

    async def Register(self, request: tierstore_pb2.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> tierstore_pb2.RegisterResponse:
        try:
            reg = Registration(bytes(request.namespace), request.model, request.page_size, request.layout,
                               request.kv_bytes_per_token, request.fixed_state_bytes)
        except TierStoreError as exc:
            await _abort(context, exc)
        arena = await self._call(context, self.store.register, reg)
        log.info("registered namespace=%s model=%r page_size=%d", short(reg.namespace), reg.model, reg.page_size)
        return tierstore_pb2.RegisterResponse(arena_path=arena.path, arena_bytes=arena.nbytes,
                                              instance_id=arena.instance_id, match_socket=self.match_socket,
                                              published_table=arena.table_path,
                                              published_table_bytes=arena.table_bytes)

    async def Match(self, request: tierstore_pb2.MatchRequest, context: grpc.aio.ServicerContext
                    ) -> tierstore_pb2.MatchResponse:
        args = match_args(request)
        found = await self._call(context, self.store.match_now, *args, inline=True)
        if found is None:  # the lock is held: wait in the pool
            found = await self._call(context, self.store.match_anchored, *args)
        return match_response(self.store, found)

    async def Reserve(self, request: tierstore_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> tierstore_pb2.ReserveResponse:
        extent = await self._call(context, self.store.reserve, bytes(request.hash), request.nbytes,
                                  request.request_class, request.protect_seconds)
        if extent is None:
            await self._exhausted(context, request.nbytes)
        return tierstore_pb2.ReserveResponse(extent=_extent(extent), instance_id=self.store.instance_id)

    async def Commit(self, request: tierstore_pb2.CommitRequest, context: grpc.aio.ServicerContext
                     ) -> tierstore_pb2.CommitResponse:
        await self._call(context, self.store.commit, bytes(request.hash), request.metadata)
        return tierstore_pb2.CommitResponse()

    async def Acquire(self, request: tierstore_pb2.AcquireRequest, context: grpc.aio.ServicerContext
                      ) -> tierstore_pb2.AcquireResponse:
        lease = await self._call(context, self.store.acquire, bytes(request.hash), request.lease_seconds)
        if lease is None:
            await _fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "no room in the arena to restore the state: every extent is pinned; retry later")
        return tierstore_pb2.AcquireResponse(lease_id=lease.lease_id, extent=_extent(lease.extent),
                                             metadata=lease.info.to_proto(), from_tier=lease.from_tier,  # type: ignore[arg-type]
                                             instance_id=self.store.instance_id)

    async def AcquireStream(self, request: tierstore_pb2.AcquireRequest, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[tierstore_pb2.AcquireProgress]:
        """Acquire, answered as a restore's bytes land (the caller copies while the rest is read)."""
        loop = asyncio.get_running_loop()
        landed: asyncio.Queue[tierstore_pb2.AcquireProgress] = asyncio.Queue()

        def progress(lease: Lease, n: int) -> None:  # on the store's thread, under its lock: hand it on only
            message = tierstore_pb2.AcquireProgress(ready_bytes=n)
            if n == 0:
                message.lease.CopyFrom(self._lease_message(lease))
            loop.call_soon_threadsafe(landed.put_nowait, message)

        acquiring = asyncio.ensure_future(asyncio.to_thread(self.store.acquire, bytes(request.hash),
                                                            request.lease_seconds, progress))
        # A caller that goes away mid-stream leaves the restore to finish (its lease expires); its
        # outcome is then nobody's, and must not be logged as a task exception never retrieved.
        acquiring.add_done_callback(lambda task: task.cancelled() or task.exception())
        started = False
        while not acquiring.done() or not landed.empty():
            waiting = asyncio.ensure_future(landed.get())
            await asyncio.wait({waiting, acquiring}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                waiting.cancel()
                continue
            message = waiting.result()
            while not landed.empty():  # a slow reader gets fewer, larger steps (the lease is never dropped)
                later = landed.get_nowait()
                if message.HasField("lease"):
                    later.lease.CopyFrom(message.lease)
                message = later
            started = started or message.HasField("lease")
            yield message
        lease = await self._call(context, lambda: acquiring.result(), inline=True)  # its refusal, as Acquire's
        if lease is None:
            await _fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "no room in the arena to restore the state: every extent is pinned; retry later")
        done = tierstore_pb2.AcquireProgress(ready_bytes=lease.extent.length, verified=True)
        if not started:  # in RAM already: the lease and all of it in one message
            done.lease.CopyFrom(self._lease_message(lease))
        yield done

    def _lease_message(self, lease: Lease) -> tierstore_pb2.AcquireResponse:
        return tierstore_pb2.AcquireResponse(lease_id=lease.lease_id, extent=_extent(lease.extent),
                                             metadata=lease.info.to_proto(), from_tier=lease.from_tier,  # type: ignore[arg-type]
                                             instance_id=self.store.instance_id)

    async def Release(self, request: tierstore_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
                      ) -> tierstore_pb2.ReleaseResponse:
        if not request.instance_id or request.instance_id == self.store.instance_id:
            await self._call(context, self.store.release, request.lease_id, list(request.unused_lease_ids),
                             [bytes(h) for h in request.used_hashes])
        return tierstore_pb2.ReleaseResponse()

    async def Drop(self, request: tierstore_pb2.DropRequest, context: grpc.aio.ServicerContext
                   ) -> tierstore_pb2.DropResponse:
        return tierstore_pb2.DropResponse(dropped=await self._call(context, self.store.drop, bytes(request.hash)))

    async def Stats(self, request: tierstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> tierstore_pb2.StatsResponse:
        return stats_message(await self._call(context, self.store.stats))

    async def ListStates(self, request: tierstore_pb2.ListStatesRequest, context: grpc.aio.ServicerContext
                         ) -> tierstore_pb2.ListStatesResponse:
        rows, total = await self._call(context, self.store.list_states, [bytes(n) for n in request.namespaces],
                                       request.offset, request.limit)
        return tierstore_pb2.ListStatesResponse(total=total, states=[tierstore_pb2.StoredStateRow(
            hash=v.info.hash, tier=v.tier, kind=v.info.kind, request_class=v.info.request_class,  # type: ignore[arg-type]
            tokens=v.info.tokens, nbytes=v.info.nbytes, age_seconds=v.age_seconds, idle_seconds=v.idle_seconds,
            hits=v.hits, protected=v.protected, rank=v.rank) for v in rows])

    async def Put(self, request_iterator: AsyncIterator[tierstore_pb2.PutRequest],
                  context: grpc.aio.ServicerContext) -> tierstore_pb2.PutResponse:
        messages = request_iterator.__aiter__()
        first = await anext(messages, None)
        if first is None or first.WhichOneof("part") != "header":
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, "a Put stream starts with its header")
        header = first.header
        try:
            name = check_hash(bytes(header.hash))
        except TierStoreError as exc:
            await _abort(context, exc)
        meta = header.metadata
        extent = await self._call(context, self.store.reserve, name, meta.nbytes, meta.request_class,
                                  header.protect_seconds)
        if extent is None:
            await self._exhausted(context, meta.nbytes)
        committed = False
        try:
            pos = 0
            async for message in messages:
                if message.WhichOneof("part") != "data":
                    await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, "only the first Put message is a header")
                await self._call(context, self.store.write_reserved, name, pos, message.data)
                pos += len(message.data)
            if pos != meta.nbytes:
                await _fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the stream carried {pos} bytes; metadata.nbytes is {meta.nbytes}")
            await self._call(context, self.store.commit, name, meta)
            committed = True
        finally:
            if not committed:  # a failed or cancelled stream leaves no reservation behind
                self.store.abandon(name)
        return tierstore_pb2.PutResponse()

    async def Get(self, request: tierstore_pb2.GetRequest, context: grpc.aio.ServicerContext
                  ) -> AsyncIterator[tierstore_pb2.GetResponse]:
        info, data, done = await self._call(context, self.store.open_read, bytes(request.hash))
        view = memoryview(data)
        try:
            yield tierstore_pb2.GetResponse(metadata=info.to_proto())
            for pos in range(0, len(view), CHUNK):
                yield tierstore_pb2.GetResponse(data=bytes(view[pos:pos + CHUNK]))
        finally:
            view.release()
            if isinstance(data, memoryview):
                data.release()
            done()  # unpins a RAM state (it may be spilled again)

    async def _exhausted(self, context: grpc.aio.ServicerContext, nbytes: int) -> NoReturn:
        arena = self.store.arena
        await _fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"no room for {nbytes} bytes in the {arena.size}-byte arena even after spilling every "
                            "unpinned state; release leases or raise reuse.kv_host_pool_bytes")


async def _abort(context: grpc.aio.ServicerContext, exc: TierStoreError) -> NoReturn:
    if isinstance(exc, Unavailable):
        context.set_trailing_metadata(((TIER_FAULT_KEY, exc.tier),))
    await _fail(context, refusal_code(exc), str(exc))


async def _fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """Ends the call with ``code``; context.abort raises, so this never returns."""
    await context.abort(code, message)
    raise AssertionError("unreachable")


def create_server(service: TierStoreService, address: str | list[str], tracing: bool = False,
                  secret: bytes | None = None) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build (not start) the server on `address` (``unix:/path``, ``host:port``, port 0 picks a free one,
    or a list of them); returns (server, port, health), port being the TCP port (0: none).

    Calls over a Unix socket are let in (the socket's mode decides who connects); calls over TCP
    need `authorization: Bearer <secret>`, all refused without a `secret` (auth.py); health is open.
    With `tracing`, each call is a SERVER span continuing the engine's trace (from the gRPC metadata).
    """
    interceptors: list[grpc.aio.ServerInterceptor] = [SecretAuth(secret)]
    if tracing:
        interceptors.append(ServerTracingInterceptor())
    return build_server(lambda server: tierstore_pb2_grpc.add_TierStoreServicer_to_server(service, server),
                        tierstore_pb2.DESCRIPTOR.services_by_name["TierStore"].full_name, address, "tierstore",
                        interceptors)


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    await set_health(health_servicer, SERVICE_NAME, serving)


TIER_SERVICES = {"ram": f"{SERVICE_NAME}.ram", "disk": f"{SERVICE_NAME}.disk"}  # health names of the tiers


async def set_tier_health(health_servicer: health.aio.HealthServicer, stats: StoreStats) -> None:
    """Health of each tier under its own name (``ignis.v1.TierStore.ram``, ``.disk``): NOT_SERVING while it is
    unusable. The store's own name and "" stay SERVING: a store with a failing tier still serves."""
    for tier, usable in (("ram", stats.arena_usable), ("disk", stats.disk_usable)):
        status = health_pb2.HealthCheckResponse.SERVING if usable else health_pb2.HealthCheckResponse.NOT_SERVING
        await health_servicer.set(TIER_SERVICES[tier], status)
