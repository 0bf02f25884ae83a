"""What a stored state is: the checked, immutable form of the proto's StateMetadata."""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from common.request_class import from_pb
from common.state_hash import HASH_BYTES, StateHash
from ignis.v1 import common_pb2, tierstore_pb2
from tierstore.errors import InvalidArgument

MAX_ENGINE_TAG = 64  # bytes of StateMetadata.engine_tag the store keeps (the engine's is 32: a nonce and its GMAC)

_KINDS = (common_pb2.REUSE_KIND_CHECKPOINT, common_pb2.REUSE_KIND_PREFIX, common_pb2.REUSE_KIND_PAGES)


def check_hash(value: bytes, what: str = "hash") -> StateHash:
    """``value`` as a StateHash; InvalidArgument unless it is exactly 16 bytes."""
    if not isinstance(value, bytes) or len(value) != HASH_BYTES:
        size = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise InvalidArgument(f"{what} must be {HASH_BYTES} bytes (an xxh3_128 chain hash), got {size}")
    return StateHash(value)


def short(value: bytes) -> str:
    """The first 8 hex digits of a hash: what logs show (full names are blob file names, and tenants' keys)."""
    return value[:4].hex()


def checksum(data: bytes | memoryview) -> bytes:
    """xxh3_128 digest (16 bytes) of a state's bytes."""
    return xxhash.xxh3_128_digest(data)


def normal_class(request_class: int) -> int:
    """The class as the store keeps it: UNSPECIFIED is INTERACTIVE; unknown is InvalidArgument (common/request_class.py)."""
    try:
        return int(from_pb(request_class).pb)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


@dataclass(frozen=True, slots=True)
class StateInfo:
    """A committed state: never changes (reuse copies and never consumes)."""

    hash: StateHash
    namespace: bytes
    tokens: int
    kind: int  # common_pb2.ReuseKind, never NONE
    request_class: int  # common_pb2.RequestClass, never UNSPECIFIED
    page_hashes: tuple[bytes, ...]
    checksum: bytes  # xxh3_128 of the bytes
    nbytes: int
    # Tokens per page when known, 0 if not: sizes a page-prefix hit.
    page_size: int = 0
    # Every page-aligned prefix is itself a valid state (attention-only KV): the
    # disk index then maps each page hash to this state.
    sliceable: bool = False
    # The engine's keyed integrity tag: kept and returned verbatim, never checked here.
    engine_tag: bytes = b""

    def prefix_tokens(self, page_index: int) -> int:
        """Tokens covered by the first ``page_index + 1`` pages of this state."""
        return (page_index + 1) * self.page_size

    def to_proto(self) -> tierstore_pb2.StateMetadata:
        return tierstore_pb2.StateMetadata(
            namespace=self.namespace, tokens=self.tokens, kind=self.kind,  # type: ignore[arg-type]
            request_class=self.request_class, page_hashes=self.page_hashes,  # type: ignore[arg-type]
            checksum=self.checksum, nbytes=self.nbytes, engine_tag=self.engine_tag,
        )

    @classmethod
    def from_proto(cls, hash: bytes, meta: tierstore_pb2.StateMetadata, *, page_size: int = 0,
                   sliceable: bool = False) -> StateInfo:
        """Checks a client's metadata; InvalidArgument names the field at fault.

        An empty checksum is allowed here (the store fills it in at commit).
        """
        name = check_hash(hash)
        check_hash(meta.namespace, "metadata.namespace")
        pages = tuple(check_hash(p, f"metadata.page_hashes[{i}]") for i, p in enumerate(meta.page_hashes))
        if meta.kind not in _KINDS:
            raise InvalidArgument("metadata.kind must be CHECKPOINT, PREFIX or PAGES")
        if meta.checksum and len(meta.checksum) != HASH_BYTES:
            raise InvalidArgument(f"metadata.checksum must be empty or {HASH_BYTES} bytes")
        if meta.nbytes <= 0:
            raise InvalidArgument("metadata.nbytes must be > 0")
        if len(meta.engine_tag) > MAX_ENGINE_TAG:
            raise InvalidArgument(f"metadata.engine_tag must be at most {MAX_ENGINE_TAG} bytes")
        if page_size <= 0:
            sliceable = False  # a prefix hit cannot be sized without the page size
        return cls(name, bytes(meta.namespace), meta.tokens, meta.kind, normal_class(meta.request_class), pages,
                   bytes(meta.checksum), meta.nbytes, page_size, sliceable, bytes(meta.engine_tag))
