"""A small synchronous TierStore client for the engine thread.

Every call has a short deadline. The store is an optimisation: when it is down or
slow the client marks it unavailable, logs once, counts it, answers "nothing"
to every call until a backoff has passed, then tries a fresh channel. No call
here raises because of the store.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
from opentelemetry import context as otel_context
import torch

from common.tracing import ClientTracingInterceptor
from ignis.v1 import tierstore_pb2, tierstore_pb2_grpc

log = logging.getLogger("ignis.engine.tiers")

T = TypeVar("T")


class TierClient:
    def __init__(self, address: str, *, model: str, page_size: int, layout: str, kv_bytes_per_token: int,
                 fixed_state_bytes: int, timeout: float = 2.0, retry_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, pin: bool = False) -> None:
        self.address = address
        self.pin = pin  # CUDA: register the mapping as pinned memory so copies to the GPU are DMA
        self._pinned_ptr: int | None = None
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self._clock = clock
        self._register_fields = dict(model=model, page_size=page_size, layout=layout,
                                     kv_bytes_per_token=kv_bytes_per_token, fixed_state_bytes=fixed_state_bytes)
        self._channel: grpc.Channel | None = None
        self._stub: tierstore_pb2_grpc.TierStoreStub | None = None
        self._retry_at = 0.0
        self._down = False
        self._instance = ""
        self._mmap: mmap.mmap | None = None
        self.arena: torch.Tensor | None = None  # uint8 view of the whole mapped arena
        self.unavailable_events = 0  # times the store went from usable to down
        self.errors = 0  # calls answered "nothing" because of the store (down, slow, refused)
        self.last_code: grpc.StatusCode | None = None  # status of the last call (None: OK or not sent)
        self._refused: set[bytes] = set()  # namespaces whose Register was refused (layout mismatch)
        self._registered: set[bytes] = set()  # namespaces registered with the instance mapped now
        # Release runs off the engine thread: the copy is done, nothing waits for the answer.
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="ignis-tier-release")

    # --- availability ----------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Worth a call now: up, or down but due for a retry."""
        return not self._down or self._clock() >= self._retry_at

    @property
    def up(self) -> bool:
        """The last call reached the store (False from a failure until a call succeeds again)."""
        return not self._down

    def _connect(self) -> tierstore_pb2_grpc.TierStoreStub | None:
        if self._down and self._clock() < self._retry_at:
            return None
        if self._stub is None:
            # A fresh channel per attempt: a dead one would sit in gRPC's own (long) reconnect backoff.
            self._channel = grpc.insecure_channel(self.address)
            # Each call is a CLIENT span carrying the current trace (a request's, or a new one for a spill).
            traced = grpc.intercept_channel(self._channel, ClientTracingInterceptor(self.address))
            self._stub = tierstore_pb2_grpc.TierStoreStub(traced)
        return self._stub

    def _mark_down(self, why: str) -> None:
        self.errors += 1
        if not self._down:
            self.unavailable_events += 1
            log.warning("tierstore at %s unavailable (%s): serving with device-only reuse, retrying every %.1fs",
                        self.address, why, self.retry_seconds)
        self._down = True
        self._retry_at = self._clock() + self.retry_seconds
        self._instance = ""  # whatever comes back may be another instance: register again
        self._registered.clear()
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def _call(self, fn: Callable[[tierstore_pb2_grpc.TierStoreStub], T], quiet: Sequence[grpc.StatusCode] = ()
              ) -> T | None:
        """Run one RPC; None when the store is down/slow or answered an error (quiet codes are expected)."""
        self.last_code = None
        stub = self._connect()
        if stub is None:
            return None
        try:
            result = fn(stub)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            self.last_code = code
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                self._mark_down(f"{code.name}")
            elif code not in quiet:
                self.errors += 1
                log.warning("tierstore call failed: %s %s", code, exc.details() if hasattr(exc, "details") else exc)
            return None
        if self._down:
            self._down = False
            log.info("tierstore at %s is back", self.address)
        return result

    # --- arena -------------------------------------------------------------------------
    def ensure(self, namespace: bytes) -> bool:
        """Register `namespace` and (re)map the arena; False if the store is unusable.

        Called before each spill and restore; it costs a Register only the first time per
        store instance. A restarted store is a new instance with a new arena, and a stale
        mapping must never be used: every Match, Reserve and Acquire reply names its
        instance (`same_instance`), and one from another instance makes us register again.
        """
        if namespace in self._refused:
            return False
        if namespace in self._registered and self.arena is not None:
            return True
        refusals = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
        reply = self._call(lambda s: s.Register(tierstore_pb2.RegisterRequest(
            namespace=namespace, **self._register_fields), timeout=self.timeout),  # type: ignore[arg-type]
            quiet=refusals)
        if reply is None:
            if self.last_code in refusals:
                # Its states were written under another layout: never read them, never write more.
                self._refused.add(namespace)
                log.warning("tierstore at %s refused namespace %s (%s): device-only reuse for it",
                            self.address, namespace.hex(), self.last_code)
            return False
        if reply.instance_id != self._instance:
            try:
                self._map(reply.arena_path, reply.arena_bytes)
            except OSError as exc:  # not on this host, or gone
                self._mark_down(f"cannot map the arena {reply.arena_path}: {exc}")
                return False
            self._instance = reply.instance_id
            self._registered.clear()
        self._registered.add(namespace)
        return True

    def same_instance(self, instance_id: str) -> bool:
        """Whether a reply came from the instance whose arena is mapped; if not, the next
        `ensure` registers again and maps the new arena."""
        if instance_id == self._instance:
            return True
        self._registered.clear()
        return False

    def _map(self, path: str, size: int) -> None:
        self._unmap()
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.arena = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if self.pin and torch.cuda.is_available():
            ptr = self.arena.data_ptr()
            code = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            if int(code) == 0:
                self._pinned_ptr = ptr
            else:  # copies still work, through a staging buffer
                log.warning("cudaHostRegister of the arena failed (%s): unpinned copies", code)

    def _unmap(self) -> None:
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self.arena = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view still exists somewhere: the collector unmaps it later
                pass
            self._mmap = None

    def arena_bytes(self, offset: int, length: int) -> memoryview:
        assert self._mmap is not None
        return memoryview(self._mmap)[offset:offset + length]

    # --- control plane -------------------------------------------------------------------
    def match(self, namespace: bytes, page_hashes: Sequence[bytes], tail_hash: bytes | None
              ) -> tuple[list[tierstore_pb2.MatchHit], list[tierstore_pb2.MatchHit]]:
        """(hits, anchored candidates): candidates end mid-page and must be verified by name."""
        if namespace in self._refused:
            return [], []
        request = tierstore_pb2.MatchRequest(namespace=namespace, page_hashes=page_hashes, anchored=True)
        if tail_hash is not None:
            request.tail_hash = tail_hash
        reply = self._call(lambda s: s.Match(request, timeout=self.timeout))
        if reply is None:
            return [], []
        self.same_instance(reply.instance_id)
        return list(reply.hits), list(reply.candidates)

    @property
    def instance_id(self) -> str:
        """The store instance whose arena is mapped now ("" when none is)."""
        return self._instance

    def reserve(self, hash: bytes, nbytes: int, request_class: int, protect_seconds: float = 0.0
                ) -> tierstore_pb2.ReserveResponse | None:
        return self._call(lambda s: s.Reserve(tierstore_pb2.ReserveRequest(
            hash=hash, nbytes=nbytes, request_class=request_class,  # type: ignore[arg-type]
            protect_seconds=protect_seconds), timeout=self.timeout),
            quiet=(grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED))

    def commit(self, hash: bytes, metadata: tierstore_pb2.StateMetadata) -> bool:
        reply = self._call(lambda s: s.Commit(tierstore_pb2.CommitRequest(hash=hash, metadata=metadata),
                                              timeout=self.timeout))
        return reply is not None

    def drop(self, hash: bytes) -> None:
        self._call(lambda s: s.Drop(tierstore_pb2.DropRequest(hash=hash), timeout=self.timeout))

    def acquire(self, hash: bytes, lease_seconds: float = 30.0) -> tierstore_pb2.AcquireResponse | None:
        return self._call(lambda s: s.Acquire(tierstore_pb2.AcquireRequest(
            hash=hash, lease_seconds=lease_seconds), timeout=self.timeout),
            quiet=(grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED))

    def release(self, lease_id: int) -> None:
        """Unpin a lease in the background; if the call fails the lease simply expires."""
        stub = self._stub
        if stub is None:
            return
        parent = otel_context.get_current()

        def send() -> None:
            token = otel_context.attach(parent)  # the Release span joins the caller's trace
            try:
                stub.Release(tierstore_pb2.ReleaseRequest(lease_id=lease_id), timeout=self.timeout)
            except grpc.RpcError:
                pass
            finally:
                otel_context.detach(token)

        self._releaser.submit(send)

    def close(self) -> None:
        self._releaser.shutdown(wait=True)
        self._unmap()
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
