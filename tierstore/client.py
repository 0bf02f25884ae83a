"""An example client of ignis.v1.TierStore, for tests and benchmarks.

The engine does not import this (services meet only in protos/); it shows the
whole protocol in one place: Register, map the arena, copy bytes in and out by
offset, and the thin RPC wrappers. Errors surface as grpc.RpcError with the
server's status code.

    with TierStoreClient("unix:/run/user/1000/ignis/tierstore.sock") as ts:   # or "host:port", secret=...
        ts.register(namespace, model="m", page_size=16, layout="{...}")
        extent = ts.reserve(name, len(data))
        ts.write(extent, data)
        ts.commit(name, metadata)          # checksum may be left empty
        lease = ts.acquire(name)
        copy = bytes(ts.read(lease.extent))
        ts.release(lease.lease_id)
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from types import TracebackType

import grpc

from common.bearer import BearerInterceptor
from ignis.v1 import common_pb2, tierstore_pb2, tierstore_pb2_grpc

CHUNK = 1 << 20  # Put sends at most 1 MiB per message (tierstore.proto)


class TierStoreClient:
    def __init__(self, address: str, *, timeout: float = 60.0, secret: bytes | None = None) -> None:
        """``address`` is ``unix:/path`` (one host) or ``host:port`` (TCP: pass the shared ``secret``)."""
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        channel = grpc.intercept_channel(self._channel, BearerInterceptor(secret)) if secret else self._channel
        self.stub = tierstore_pb2_grpc.TierStoreStub(channel)
        self._mmap: mmap.mmap | None = None
        self._view: memoryview | None = None
        self.instance_id = ""

    # ------------------------------------------------------------ arena

    def register(self, namespace: bytes, *, model: str = "", page_size: int = 16, layout: str = "",
                 kv_bytes_per_token: int = 0, fixed_state_bytes: int = 0) -> tierstore_pb2.RegisterResponse:
        """Registers the namespace and maps the arena (again, if the tierstore restarted)."""
        reply: tierstore_pb2.RegisterResponse = self.stub.Register(tierstore_pb2.RegisterRequest(
            namespace=namespace, model=model, page_size=page_size, layout=layout,
            kv_bytes_per_token=kv_bytes_per_token, fixed_state_bytes=fixed_state_bytes), timeout=self.timeout)
        if reply.instance_id != self.instance_id:
            self._unmap()
            fd = os.open(reply.arena_path, os.O_RDWR)
            try:
                self._mmap = mmap.mmap(fd, reply.arena_bytes)
            finally:
                os.close(fd)
            self._view = memoryview(self._mmap)
            self.instance_id = reply.instance_id
        return reply

    def write(self, extent: tierstore_pb2.Extent, data: bytes | bytearray | memoryview) -> None:
        """Copies ``data`` into the arena at the extent (a memcpy into shared memory)."""
        src = memoryview(data).cast("B")
        if len(src) > extent.length:
            raise ValueError(f"{len(src)} bytes do not fit the {extent.length}-byte extent")
        self.arena[extent.offset:extent.offset + len(src)] = src

    def read(self, extent: tierstore_pb2.Extent) -> memoryview:
        """The arena bytes of the extent, zero copy; valid while the lease is held. Release the view when done."""
        return self.arena[extent.offset:extent.offset + extent.length]

    @property
    def arena(self) -> memoryview:
        if self._view is None:
            raise RuntimeError("call register() first: it maps the arena")
        return self._view

    # ------------------------------------------------------------ control plane

    def match(self, namespace: bytes, page_hashes: Sequence[bytes], tail_hash: bytes | None = None, *,
              lease_seconds: float = 0.0) -> list[tierstore_pb2.MatchHit]:
        """The hits; with ``lease_seconds``, each RAM hit carries a lease (``lease_id``, ``metadata``): read its
        ``extent`` without an Acquire, then ``release`` it."""
        request = tierstore_pb2.MatchRequest(namespace=namespace, page_hashes=page_hashes,
                                             lease_seconds=lease_seconds)
        if tail_hash is not None:
            request.tail_hash = tail_hash
        return list(self.stub.Match(request, timeout=self.timeout).hits)

    def reserve(self, hash: bytes, nbytes: int, *, request_class: int = common_pb2.REQUEST_CLASS_INTERACTIVE,
                protect_seconds: float = 0.0) -> tierstore_pb2.Extent:
        return self.stub.Reserve(tierstore_pb2.ReserveRequest(
            hash=hash, nbytes=nbytes, request_class=request_class,  # type: ignore[arg-type]
            protect_seconds=protect_seconds), timeout=self.timeout).extent

    def commit(self, hash: bytes, metadata: tierstore_pb2.StateMetadata) -> None:
        self.stub.Commit(tierstore_pb2.CommitRequest(hash=hash, metadata=metadata), timeout=self.timeout)

    def store(self, hash: bytes, data: bytes | memoryview, metadata: tierstore_pb2.StateMetadata, *,
              protect_seconds: float = 0.0) -> tierstore_pb2.Extent:
        """Reserve, write by offset, Commit: the one-host write path."""
        extent = self.reserve(hash, len(data), request_class=metadata.request_class,
                              protect_seconds=protect_seconds)
        self.write(extent, data)
        self.commit(hash, metadata)
        return extent

    def acquire(self, hash: bytes, lease_seconds: float = 0.0) -> tierstore_pb2.AcquireResponse:
        return self.stub.Acquire(tierstore_pb2.AcquireRequest(
            hash=hash, lease_seconds=lease_seconds), timeout=self.timeout)

    def acquire_stream(self, hash: bytes, lease_seconds: float = 0.0) -> Iterator[tierstore_pb2.AcquireProgress]:
        """Acquire as the bytes land: the first message has the lease, then ``ready_bytes`` grows; the bytes
        are good only once a message says ``verified`` (an error ends the stream instead)."""
        return iter(self.stub.AcquireStream(tierstore_pb2.AcquireRequest(
            hash=hash, lease_seconds=lease_seconds), timeout=self.timeout))

    def release(self, lease_id: int, unused: Sequence[int] = (), *, instance_id: str = "") -> None:
        """Ends a lease (0: none) and the ``unused`` leases of a Match (no hit counted on those), of
        ``instance_id`` (empty: the store's own; another's were void already)."""
        self.stub.Release(tierstore_pb2.ReleaseRequest(lease_id=lease_id, unused_lease_ids=unused,
                                                       instance_id=instance_id), timeout=self.timeout)

    def drop(self, hash: bytes) -> bool:
        return bool(self.stub.Drop(tierstore_pb2.DropRequest(hash=hash), timeout=self.timeout).dropped)

    def stats(self) -> tierstore_pb2.StatsResponse:
        return self.stub.Stats(tierstore_pb2.StatsRequest(), timeout=self.timeout)

    # ------------------------------------------------------------ streaming (another host)

    def put(self, hash: bytes, data: bytes | memoryview, metadata: tierstore_pb2.StateMetadata, *,
            protect_seconds: float = 0.0, chunk: int = CHUNK) -> None:
        def messages() -> Iterator[tierstore_pb2.PutRequest]:
            yield tierstore_pb2.PutRequest(header=tierstore_pb2.PutHeader(
                hash=hash, metadata=metadata, protect_seconds=protect_seconds))
            view = memoryview(data).cast("B")
            for pos in range(0, len(view), chunk):
                yield tierstore_pb2.PutRequest(data=bytes(view[pos:pos + chunk]))

        self.stub.Put(messages(), timeout=self.timeout)

    def get(self, hash: bytes) -> tuple[tierstore_pb2.StateMetadata, bytes]:
        meta: tierstore_pb2.StateMetadata | None = None
        parts: list[bytes] = []
        for message in self.stub.Get(tierstore_pb2.GetRequest(hash=hash), timeout=self.timeout):
            if message.WhichOneof("part") == "metadata":
                meta = message.metadata
            else:
                parts.append(message.data)
        assert meta is not None, "a Get stream starts with the metadata"
        return meta, b"".join(parts)

    # ------------------------------------------------------------ lifetime

    def _unmap(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def close(self) -> None:
        self._unmap()
        self._channel.close()

    def __enter__(self) -> TierStoreClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
