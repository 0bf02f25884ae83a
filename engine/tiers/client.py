"""A small synchronous TierStore client for the engine thread.

Every call has a short deadline. The store is an optimisation: when it is down or
slow the client marks it unavailable, logs once, counts it, answers "nothing"
to every call until a backoff has passed, then tries a fresh channel. No call
here raises because of the store.

The address is ``unix:/path`` (the store's socket, one host) or ``host:port``
(TCP: every call carries ``authorization: Bearer <secret>`` from ``secret_file``,
read again with each fresh channel). A namespace the store refuses is retried
after the same backoff (logged once), never given up for good. The arena is
mapped by the instance a reply names, never trusted by path: a mapping whose file
was truncated or deleted is dropped before any copy, and the next Register maps
the arena of the instance that recreated it. ``usable`` says whether all of that
holds now.

Beside the arena the client maps the store's published table (engine/tiers/published_table.py),
read-only, when the store has one beside the arena: the link finds states there without a
Match. A state claimed that way held no lease, so nothing tells the store it was used; the
client tells it in a background Release (``report_used``), all the names claimed since the last
one in one call, so the store's eviction order (by last use) and its hit counts stay right
without a round trip on the claim's path.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
import torch

from common.bearer import BearerInterceptor, read_secret
from common.mapped_file import file_fault
from common.prefault import Prefault
from common.status_codes import code_of
from common.tracing import ClientTracingInterceptor, client_span, exporting, grpc_metadata, set_rpc_status
from engine.tiers.local_match import LocalMatch
from engine.tiers.published_table import PublishedTable
from ignis.v1 import tierstore_pb2, tierstore_pb2_grpc

log = logging.getLogger("ignis.engine.tiers")

T = TypeVar("T")
TIER_FAULT_KEY = "ignis-tier-fault"  # an UNAVAILABLE carrying it is one failing tier of a store that is up
MATCH_METHOD = "/ignis.v1.TierStore/Match"


class TierClient:
    def __init__(self, address: str, *, model: str, page_size: int, layout: str, kv_bytes_per_token: int,
                 fixed_state_bytes: int, timeout: float = 2.0, retry_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, pin: bool = False, secret_file: str = "",
                 local_match: bool = True, published_table: bool = True) -> None:
        """``secret_file``: the shared secret of a TCP ``address`` (tierstore.secret_file); read now, so a
        missing or short one fails the start (OSError, ValueError), and again with each fresh channel.
        ``local_match``: ask Match on the store's Match socket when it has one (False: always gRPC).
        ``published_table``: map the store's published table when it has one (False: never)."""
        self.address = address
        self.secret_file = secret_file
        self._tcp = not address.startswith(("unix:", "unix-abstract:"))
        if self._tcp and secret_file:
            read_secret(secret_file)
        elif self._tcp:
            log.warning("the tierstore at %s is reached over TCP without tierstore.secret_file: it refuses every "
                        "call but health checks (UNAUTHENTICATED); set one, or use its unix: socket", address)
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
        self._prefault: Prefault | None = None
        self.arena: torch.Tensor | None = None  # uint8 view of the whole mapped arena
        self.unavailable_events = 0  # times the store went from usable to down
        self.errors = 0  # calls answered "nothing" because of the store (down, slow, refused)
        self.last_code: grpc.StatusCode | None = None  # status of the last call (None: OK or not sent)
        self._refused: dict[bytes, float] = {}  # namespace -> when to ask again (its Register was refused)
        self._registered: set[bytes] = set()  # namespaces registered with the instance mapped now
        self._arena_fd = -1  # the mapped arena file, kept open to see it truncated or deleted
        self._arena_size = 0
        self._lost_instance = ""  # an instance whose arena file broke: never mapped again
        self._detached = "not attached yet (no spill or restore has registered)"  # why no arena is mapped
        # Release runs off the engine thread: the copy is done, nothing waits for the answer.
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="ignis-tier-release")
        self.match_instance = ""  # the instance that answered the last Match (its leases are that instance's)
        self._local_match = local_match
        self.local: LocalMatch | None = None  # the Match socket of the instance mapped now (local_match.py)
        self._local_retry_at = 0.0  # after a fault of that socket, Match goes over gRPC until then
        self._use_table = published_table
        self.table: PublishedTable | None = None  # the published table of the instance mapped now
        self._used: dict[str, list[bytes]] = {}  # instance -> states claimed through its table, not yet reported
        self._used_queued = False  # a report of them is queued on the releaser
        self._used_context: otel_context.Context | None = None  # the trace of the first claim in the queued report
        self._used_lock = threading.Lock()
        # The Monitor's read-only calls, on a channel of their own (side_stats, side_list).
        self._side_channel: grpc.Channel | None = None
        self._side_stub: tierstore_pb2_grpc.TierStoreStub | None = None

    # --- availability ----------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Worth a call now: up, or down but due for a retry."""
        return not self._down or self._clock() >= self._retry_at

    @property
    def up(self) -> bool:
        """The last call reached the store (False from a failure until a call succeeds again)."""
        return not self._down

    @property
    def usable(self) -> bool:
        """The lower tiers are in use now: the store is reachable, a namespace is registered with the
        instance mapped now, no namespace is refused, and the mapped arena file is whole and still
        there. False before the first spill or restore has attached (``unusable_reason`` says why)."""
        return self.unusable_reason is None

    @property
    def unusable_reason(self) -> str | None:
        """Why ``usable`` is False, or None."""
        if self._down:
            return "unreachable"
        if self._refused:
            return "a namespace is refused (another layout is registered, with states on disk)"
        if self.arena is None:
            return self._detached
        if not self._registered:
            return "not registered with the store instance mapped now"
        return self._arena_broken()

    def _connect(self) -> tierstore_pb2_grpc.TierStoreStub | None:
        if self._down and self._clock() < self._retry_at:
            return None
        if self._stub is None:
            squatted = _foreign_socket_folder(self.address)
            if squatted is not None:  # whoever owns the folder could answer as the store
                self._mark_down(squatted)
                return None
            # A fresh channel per attempt: a dead one would sit in gRPC's own (long) reconnect backoff.
            channel = self._channel = grpc.insecure_channel(self.address)
            if self._tcp and self.secret_file:
                try:
                    channel = grpc.intercept_channel(channel, BearerInterceptor(read_secret(self.secret_file)))
                except (OSError, ValueError) as exc:
                    self._mark_down(f"cannot read tierstore.secret_file: {exc}")
                    return None
            # Each call is a CLIENT span carrying the current trace (a request's, or a new one for a spill).
            traced = grpc.intercept_channel(channel, ClientTracingInterceptor(self.address))
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
        self._drop_local()

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
            self._failed(exc, quiet)
            return None
        if self._down:
            self._down = False
            log.info("tierstore at %s is back", self.address)
        return result

    def _failed(self, exc: grpc.RpcError, quiet: Sequence[grpc.StatusCode]) -> None:
        code = exc.code() if hasattr(exc, "code") else None
        tier = _tier_fault(exc) if code == grpc.StatusCode.UNAVAILABLE else None
        self._ended(code, exc.details() if hasattr(exc, "details") else str(exc), tier, quiet)

    def _ended(self, code: grpc.StatusCode | None, details: str, tier: str | None,
               quiet: Sequence[grpc.StatusCode]) -> None:
        """What a failed call means: the store down, its disk failing, or a refusal (counted unless quiet)."""
        self.last_code = code
        if tier == "disk":  # the store is up; its disk is failing: this call finds nothing
            self.errors += 1
        elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.CANCELLED):
            self._mark_down(code.name if tier is None else f"its {tier} is unusable")
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            self._mark_down("UNAUTHENTICATED: the shared secret is missing or not the store's "
                            "(tierstore.secret_file)")
        elif code not in quiet:
            self.errors += 1
            log.warning("tierstore call failed: %s %s", code, details)

    # --- arena -------------------------------------------------------------------------
    def ensure(self, namespace: bytes) -> bool:
        """Register `namespace` and (re)map the arena; False if the store is unusable.

        Called before each spill and restore; it costs a Register only the first time per
        store instance. A restarted store is a new instance with a new arena, and a stale
        mapping must never be used: every Match, Reserve and Acquire reply names its
        instance (`same_instance`), and one from another instance makes us register again.
        """
        if self._refusing(namespace):
            return False
        if self.arena is not None and (broken := self._arena_broken()) is not None:
            self._lose_arena(broken)  # before any copy: a truncated mapping is SIGBUS
        if namespace in self._registered and self.arena is not None:
            return True
        refusals = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
        reply = self._call(lambda s: s.Register(tierstore_pb2.RegisterRequest(
            namespace=namespace, **self._register_fields), timeout=self.timeout),  # type: ignore[arg-type]
            quiet=refusals)
        if reply is None:
            if self.last_code in refusals:
                # Its states were written under another layout: never read them, write none now; ask again later.
                if namespace not in self._refused:
                    log.warning("tierstore at %s refused namespace %s (%s): device-only reuse for it, asking "
                                "again every %.1fs", self.address, namespace[:4].hex(), self.last_code,
                                self.retry_seconds)
                self._refused[namespace] = self._clock() + self.retry_seconds
            return False
        if namespace in self._refused:
            del self._refused[namespace]
            log.info("tierstore at %s accepted namespace %s", self.address, namespace[:4].hex())
        if reply.instance_id == self._lost_instance:
            return False  # the store has not noticed its arena broke yet: it recreates it within a second
        if reply.instance_id != self._instance:
            try:
                self._map(reply.arena_path, reply.arena_bytes)
            except OSError as exc:  # not on this host, or gone
                self._detached = f"cannot map the arena {reply.arena_path}: {exc}"
                self._mark_down(self._detached)
                return False
            self._instance = reply.instance_id
            self._registered.clear()
            self._drop_local()
            if self._local_match and _beside(reply.match_socket, self.address):
                self.local, self._local_retry_at = LocalMatch(reply.match_socket, self.timeout), 0.0
            self._map_table(reply)
        self._registered.add(namespace)
        return True

    def _refusing(self, namespace: bytes) -> bool:
        retry_at = self._refused.get(namespace)
        return retry_at is not None and self._clock() < retry_at

    def _arena_broken(self) -> str | None:
        """Why the mapped arena file must not be touched, or None."""
        broken = file_fault(self._arena_fd, self._arena_size)
        return None if broken is None else f"the arena file: {broken}"

    def _lose_arena(self, why: str) -> None:
        log.warning("tierstore at %s: %s; waiting for the store to recreate it (device-only reuse meanwhile)",
                    self.address, why)
        self._detached = why
        self._lost_instance = self._instance
        self._instance = ""
        self._registered.clear()
        self._unmap()
        self._drop_local()

    def _drop_local(self) -> None:
        if self.local is not None:
            self.local.close()
            self.local = None

    def same_instance(self, instance_id: str) -> bool:
        """Whether a reply came from the instance whose arena is mapped; if not, the next
        `ensure` registers again and maps the new arena."""
        if instance_id == self._instance:
            return True
        self._registered.clear()
        return False

    def _map(self, path: str, size: int) -> None:
        self._unmap()
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():  # never write KV bytes into a file another user gave us
                raise OSError(f"the arena file {path} belongs to uid {st.st_uid}, not to this user")
            if st.st_size < size:
                raise OSError(f"the arena file is {st.st_size} bytes, not {size}")
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._arena_fd, self._arena_size = fd, size
        # This process's page tables for the arena, filled in the background before the first copies
        # into it need them (common/prefault.py).
        self._prefault = Prefault(self._mmap, "arena")
        self.arena = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if self.pin and torch.cuda.is_available():
            ptr = self.arena.data_ptr()
            code = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            if int(code) == 0:
                self._pinned_ptr = ptr
            else:  # copies still work, through a staging buffer
                log.warning("cudaHostRegister of the arena failed (%s): unpinned copies", code)

    def _map_table(self, reply: tierstore_pb2.RegisterResponse) -> None:
        """The published table of the instance just mapped, if it has one beside its arena (a reply never
        makes us map a file elsewhere); without it every lookup asks Match."""
        path = reply.published_table
        if not self._use_table or not path or os.path.dirname(path) != os.path.dirname(reply.arena_path):
            return
        try:
            self.table = PublishedTable(path, reply.published_table_bytes, reply.instance_id)
        except OSError as exc:
            log.warning("not using the tierstore's published table %s (%s): every claim asks Match", path, exc)

    def _unmap(self) -> None:
        if self.table is not None:
            self.table.close()
            self.table = None
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        if self._prefault is not None:
            self._prefault.stop(wait=False)  # it holds the mapping until its chunk is done
            self._prefault = None
        self.arena = None
        # Dropped, never closed: a torch.frombuffer tensor (the arena, and any view of it a copy on
        # another thread holds now) keeps the mmap object alive but not its buffer export, so close()
        # would unmap memory that copy still reads or writes (a SIGSEGV, bench.chaos's deleted arena).
        # The last reference, ours or a view's, unmaps it.
        self._mmap = None
        if self._arena_fd >= 0:
            os.close(self._arena_fd)
            self._arena_fd = -1

    def wait_mapped(self, timeout: float) -> bool:
        """Until this process's mapping of the arena has its pages mapped in (common/prefault.py); False
        on the timeout or when nothing is mapped."""
        prefault = self._prefault
        return prefault is not None and prefault.done.wait(timeout)

    def arena_bytes(self, offset: int, length: int) -> memoryview:
        assert self._mmap is not None
        return memoryview(self._mmap)[offset:offset + length]

    # --- control plane -------------------------------------------------------------------
    def match(self, namespace: bytes, page_hashes: Sequence[bytes], tail_hash: bytes | None,
              lease_seconds: float = 0.0) -> tuple[list[tierstore_pb2.MatchHit], list[tierstore_pb2.MatchHit]]:
        """(hits, anchored candidates): candidates end mid-page and must be verified by name. With
        `lease_seconds`, each RAM hit carries a lease of the instance in `match_instance` (release them)."""
        self.match_instance = ""
        if self._refusing(namespace):
            return [], []
        request = tierstore_pb2.MatchRequest(namespace=namespace, page_hashes=page_hashes, anchored=True,
                                             lease_seconds=lease_seconds)
        if tail_hash is not None:
            request.tail_hash = tail_hash
        asks_locally = self.local is not None and not self._down and self._clock() >= self._local_retry_at
        answered, reply = self._match_locally(request) if asks_locally else (False, None)
        if not answered:  # no Match socket, or it failed
            reply = self._call(lambda s: s.Match(request, timeout=self.timeout))
        if reply is None:
            return [], []
        self.match_instance = reply.instance_id
        self.same_instance(reply.instance_id)
        return list(reply.hits), list(reply.candidates)

    def _match_locally(self, request: tierstore_pb2.MatchRequest
                       ) -> tuple[bool, tierstore_pb2.MatchResponse | None]:
        """Match over the Match socket, traced as the RPC is: (answered, the reply; None when the store
        refused or timed out, counted as the RPC's would be). Not answered when the socket failed: the
        caller asks over gRPC, and so does every Match for `retry_seconds` (then the socket is tried again)."""
        assert self.local is not None
        self.last_code = None
        span = client_span(MATCH_METHOD, self.local.path) if exporting() else None
        carried = dict(grpc_metadata(trace.set_span_in_context(span))) if span is not None else {}
        code = grpc.StatusCode.UNAVAILABLE
        try:
            reply = self.local.call(request, carried)
            code = code_of(reply.code)
        except TimeoutError:  # the store is slow, not the socket broken: as a gRPC deadline would
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            self._ended(code, f"no answer on the match socket within {self.timeout}s", None, ())
            return True, None
        except OSError as exc:
            log.warning("tierstore match socket failed (%s): Match over gRPC for %.1fs", exc, self.retry_seconds)
            self._local_retry_at = self._clock() + self.retry_seconds
            return False, None
        finally:
            if span is not None:
                set_rpc_status(span, code)
                span.end()
        if code is not grpc.StatusCode.OK:
            self._ended(code, reply.details, reply.tier_fault or None, ())
            return True, None
        return True, reply.response

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

    def acquire_stream(self, hash: bytes, lease_seconds: float = 30.0) -> Iterator[tierstore_pb2.AcquireProgress]:
        """Acquire as a restore's bytes land (AcquireStream): the lease first, then `ready_bytes`, then
        `verified`. Ends early, without `verified`, when the store fails or refuses (as `acquire`
        answers None): whatever was copied must not be used."""
        stub = self._connect()
        if stub is None:
            return
        self.last_code = None
        span = client_span("/ignis.v1.TierStore/AcquireStream", self.address)  # the interceptor traces unary calls
        code: grpc.StatusCode | None = grpc.StatusCode.OK
        call = None
        try:
            call = stub.AcquireStream(tierstore_pb2.AcquireRequest(hash=hash, lease_seconds=lease_seconds),
                                      timeout=self.timeout, metadata=grpc_metadata(trace.set_span_in_context(span)))
            yield from call
            if self._down:
                self._down = False
                log.info("tierstore at %s is back", self.address)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            self._failed(exc, (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS,
                               grpc.StatusCode.RESOURCE_EXHAUSTED))
        finally:
            if call is not None:
                call.cancel()  # the caller stopped reading: a lease the restore still makes expires
            set_rpc_status(span, code)
            span.end()

    def release(self, lease_id: int, unused: Sequence[int] = (), instance_id: str = "") -> None:
        """Unpin a lease (0: none) and the `unused` leases of a Match, granted by `instance_id` (a
        store restarted since releases nothing: lease ids are per instance), in the background; if
        the call fails the leases simply expire."""
        stub = self._stub
        if stub is None or not (lease_id or unused):
            return
        request = tierstore_pb2.ReleaseRequest(lease_id=lease_id, unused_lease_ids=unused, instance_id=instance_id)
        parent = otel_context.get_current()

        def send() -> None:
            token = otel_context.attach(parent)  # the Release span joins the caller's trace
            try:
                stub.Release(request, timeout=self.timeout)
            except grpc.RpcError:
                pass
            finally:
                otel_context.detach(token)

        self._releaser.submit(send)

    def report_used(self, name: bytes, instance_id: str) -> None:
        """Tell the store (`instance_id`) that a state found in its published table was claimed: a Release
        naming it in `used_hashes`, in the background, in the claiming request's trace (as a lease's
        Release is). Names reported while one is queued go with it, in the first one's trace."""
        with self._used_lock:
            self._used.setdefault(instance_id, []).append(name)
            if self._used_queued:
                return
            self._used_queued = True
            self._used_context = otel_context.get_current()
        self._releaser.submit(self._send_used)

    def _send_used(self) -> None:
        with self._used_lock:
            used, self._used, self._used_queued = self._used, {}, False
            parent, self._used_context = self._used_context, None
        stub = self._stub
        token = otel_context.attach(parent) if parent is not None else None
        try:
            for instance, names in used.items():
                if stub is None:
                    return  # the store is down: those uses are lost, as an unreleased lease's hit would be
                try:
                    stub.Release(tierstore_pb2.ReleaseRequest(used_hashes=names, instance_id=instance),
                                 timeout=self.timeout)
                except grpc.RpcError:
                    pass
        finally:
            if token is not None:
                otel_context.detach(token)

    # --- read-only side calls (the Monitor, off the engine thread) ------------------------
    def side_stats(self) -> tierstore_pb2.StatsResponse | None:
        """The store's Stats, or None. On a channel of its own: it never touches what the engine
        thread's calls read (last_code, up/down), and a failure marks nothing down."""
        return self._side(lambda s: s.Stats(tierstore_pb2.StatsRequest(), timeout=self.timeout))

    def side_list(self, namespaces: Sequence[bytes], offset: int, limit: int
                  ) -> tierstore_pb2.ListStatesResponse | None:
        """One page of the store's states of `namespaces` (ListStates), or None; as side_stats."""
        request = tierstore_pb2.ListStatesRequest(namespaces=list(namespaces), offset=offset, limit=limit)
        return self._side(lambda s: s.ListStates(request, timeout=self.timeout))

    def _side(self, fn: Callable[[tierstore_pb2_grpc.TierStoreStub], T]) -> T | None:
        side = self._side_stub
        if side is None:
            if _foreign_socket_folder(self.address) is not None:
                return None
            channel: grpc.Channel = grpc.insecure_channel(self.address)
            if self._tcp and self.secret_file:
                try:
                    channel = grpc.intercept_channel(channel, BearerInterceptor(read_secret(self.secret_file)))
                except (OSError, ValueError):
                    return None
            side = self._side_stub = tierstore_pb2_grpc.TierStoreStub(channel)
            self._side_channel = channel
        try:
            return fn(side)
        except grpc.RpcError:
            return None

    def close(self) -> None:
        if self._side_channel is not None:
            self._side_channel.close()
        self._releaser.shutdown(wait=True)
        self._unmap()
        self._drop_local()
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


def _tier_fault(exc: grpc.RpcError) -> str | None:
    """The failing tier an UNAVAILABLE names in its trailing metadata ("disk", "arena"), or None."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == TIER_FAULT_KEY:
            return value if isinstance(value, str) else bytes(value).decode()
    return None


def _beside(match_socket: str, address: str) -> bool:
    """Whether a Register reply's Match socket lies in the folder of the gRPC socket we reached it by
    (a folder `_foreign_socket_folder` found private): over TCP, or anywhere else, it is not used, so a
    reply cannot send the engine's lookups to a socket of somebody's choosing."""
    path = _socket_path(address)
    return bool(match_socket) and path is not None and os.path.dirname(match_socket) == os.path.dirname(path)


def _socket_path(address: str) -> str | None:
    """The file of a ``unix:`` address, else None."""
    return address.removeprefix("unix:").removeprefix("//") if address.startswith("unix:") else None


def _foreign_socket_folder(address: str) -> str | None:
    """Why a `unix:` address's folder is not ours alone (not ours, a symlink, open to others), or None."""
    path = _socket_path(address)
    if path is None:
        return None
    folder = os.path.dirname(path)
    try:
        st = os.lstat(folder)
    except OSError:
        return None  # not there (yet): nothing answers at it either
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return f"the socket folder {folder} is not a private folder of this user: refusing to connect"
    return None
