"""One state on KV-disk: its index record and its self-describing blob file.

Blob format 2 (written since the index could be lost: the blobs alone rebuild it)::

    prefix   "IGNISKV\\n", u16 version = 2, u16 flags = 0, u32 record length,
             u32 registration length, 16-byte state name (little endian)
    record   the index record (below), the state's metadata included
    regist.  the namespace's registration when the state was written (JSON), or empty
    digest   xxh3_128 of everything above
    data     the state's bytes (their xxh3_128 is the record's checksum)

Blobs of format 1 (before this header) are only the state's bytes; their index
records say version 1, so one is never read as the other. A rebuilt index cannot
describe a format-1 blob: the rebuild removes it.

Index record: ``<4sHBxIdd`` magic "IGTS", version, flags (1: sliceable), page size,
last used, protect until; version 2 adds ``I`` the offset of the data in the blob;
then the StateMetadata message.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace

import xxhash

from ignis.v1 import tierstore_pb2
from tierstore.arena import align_up
from tierstore.state import StateHash, StateInfo

_RECORD_V1 = struct.Struct("<4sHBxIdd")  # magic, version, flags, page_size, last_used, protect_until
_RECORD_V2 = struct.Struct("<4sHBxIddI")  # ... and the data's offset in the blob
_RECORD_MAGIC = b"IGTS"
_SLICEABLE = 1

BLOB_MAGIC = b"IGNISKV\n"
BLOB_VERSION = 2
_PREFIX = struct.Struct("<8sHHII16s")  # magic, version, flags, record length, registration length, name
_DIGEST = 16


class BadBlob(ValueError):
    """A blob whose header is not a format-2 header of the state it is named for."""


@dataclass(frozen=True, slots=True)
class DiskRecord:
    """A state on disk: its metadata and what the eviction order needs across restarts."""

    info: StateInfo
    last_used: float
    protect_until: float = 0.0
    data_offset: int = 0  # where the bytes start in the blob; 0: a format-1 blob (no header)

    @property
    def blob_bytes(self) -> int:
        """What the blob counts against kv_disk.bytes: whole 4 KiB blocks, as the filesystem stores it."""
        return align_up(self.data_offset + self.info.nbytes)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.info.nbytes

    def encode(self) -> bytes:
        i = self.info
        flags = _SLICEABLE if i.sliceable else 0
        if self.data_offset:
            head = _RECORD_V2.pack(_RECORD_MAGIC, 2, flags, i.page_size, self.last_used, self.protect_until,
                                   self.data_offset)
        else:
            head = _RECORD_V1.pack(_RECORD_MAGIC, 1, flags, i.page_size, self.last_used, self.protect_until)
        return head + i.to_proto().SerializeToString()

    @classmethod
    def decode(cls, hash: bytes, raw: bytes) -> DiskRecord:
        magic, version = struct.unpack_from("<4sH", raw)
        if magic != _RECORD_MAGIC or version not in (1, 2):
            raise ValueError(f"unknown index record format {magic!r} v{version}")
        if version == 1:
            _, _, flags, page_size, last_used, protect_until = _RECORD_V1.unpack_from(raw)
            offset, body = 0, raw[_RECORD_V1.size:]
        else:
            _, _, flags, page_size, last_used, protect_until, offset = _RECORD_V2.unpack_from(raw)
            body = raw[_RECORD_V2.size:]
            if offset <= 0:
                raise ValueError("a version-2 index record without a data offset")
        meta = tierstore_pb2.StateMetadata.FromString(body)
        info = StateInfo(StateHash(hash), bytes(meta.namespace), meta.tokens, meta.kind, meta.request_class,
                         tuple(bytes(p) for p in meta.page_hashes), bytes(meta.checksum), meta.nbytes,
                         page_size, bool(flags & _SLICEABLE), bytes(meta.engine_tag))
        return cls(info, last_used, protect_until, offset)


def with_header(record: DiskRecord, registration: bytes) -> tuple[DiskRecord, bytes]:
    """``record`` placed after a format-2 header, and that header."""
    record_len = len(replace(record, data_offset=1).encode())  # its length does not depend on the offset
    offset = _PREFIX.size + record_len + len(registration) + _DIGEST
    placed = replace(record, data_offset=offset)
    body = _PREFIX.pack(BLOB_MAGIC, BLOB_VERSION, 0, record_len, len(registration), record.info.hash) \
        + placed.encode() + registration
    header = body + xxhash.xxh3_128_digest(body)
    assert len(header) == offset, "blob header length: this is a bug"
    return placed, header


def blob_cost(info: StateInfo, registration: bytes) -> int:
    """The budget a format-2 blob of ``info`` takes (what DiskTier.put will count)."""
    return with_header(DiskRecord(info, 0.0), registration)[0].blob_bytes


def read_header(fd: int, name: bytes, file_size: int) -> tuple[DiskRecord, bytes]:
    """(record, registration) from the header of the blob open at ``fd``; BadBlob unless it is a whole
    format-2 blob of the state ``name``."""
    prefix = os.pread(fd, _PREFIX.size, 0)
    if len(prefix) < _PREFIX.size:
        raise BadBlob("shorter than a header")
    magic, version, _, record_len, reg_len, named = _PREFIX.unpack(prefix)
    if magic != BLOB_MAGIC or version != BLOB_VERSION:
        raise BadBlob("no format-2 header (a format-1 blob, or not a blob)")
    size = _PREFIX.size + record_len + reg_len
    if size + _DIGEST > file_size:
        raise BadBlob("header runs past the end of the file")
    rest = os.pread(fd, record_len + reg_len + _DIGEST, _PREFIX.size)
    body = prefix + rest[:record_len + reg_len]
    if xxhash.xxh3_128_digest(body) != rest[record_len + reg_len:]:
        raise BadBlob("header fails its digest")
    if named != name:
        raise BadBlob("header names another state")
    try:
        record = DiskRecord.decode(name, rest[:record_len])
    except (ValueError, struct.error) as exc:
        raise BadBlob(f"unreadable record ({exc})") from None
    if record.data_offset != size + _DIGEST or record.file_size != file_size:
        raise BadBlob(f"{file_size} bytes, the header describes {record.file_size}")
    return record, rest[record_len:record_len + reg_len]
