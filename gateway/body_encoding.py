"""Compressed request bodies (``Content-Encoding: gzip | zstd | deflate``), inflated under a bound.

Codex CLI can send its request bodies (long: instructions, tools, the whole conversation)
zstd-compressed. A body is inflated to at most the gateway's --max-request-bytes, the limit a plain
body has: a small compressed body that would inflate past it (a decompression bomb) is a 413
once that many bytes came out, never a buffer of all of it. An encoding the gateway does not
know is a 415; a body that is not what its header says (or is cut short) is a 400.
"""

from __future__ import annotations

import zlib

import zstandard

from gateway.errors import OpenAIError, invalid

ENCODINGS = ("gzip", "x-gzip", "deflate", "zstd", "identity")
_CHUNK = 1 << 20


def codings(header: str) -> list[str]:
    """The codings a Content-Encoding header lists, in the order they were applied; a 415 for one
    the gateway cannot undo."""
    names = [c.strip().lower() for c in header.split(",") if c.strip()]
    for name in names:
        if name not in ENCODINGS:
            raise OpenAIError(415, f"Content-Encoding {name!r} is not supported: send gzip, zstd, deflate "
                                   "or an uncompressed body", code="unsupported_content_encoding")
    return [n for n in names if n != "identity"]


def decode(raw: bytes, names: list[str], max_bytes: int) -> bytes:
    """`raw` with the codings undone (last applied first), each output at most `max_bytes`."""
    for name in reversed(names):
        raw = _zstd(raw, max_bytes) if name == "zstd" else _zlib(raw, name, max_bytes)
    return raw


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"the request body decompresses to more than the limit of {max_bytes} bytes",
                       code="request_too_large")


def _zlib(raw: bytes, name: str, max_bytes: int) -> bytes:
    wbits = zlib.MAX_WBITS | 16 if name in ("gzip", "x-gzip") else zlib.MAX_WBITS
    out = bytearray()
    data = raw
    try:
        while True:  # gzip allows several members one after another
            inflater = zlib.decompressobj(wbits)
            out += inflater.decompress(data, max_bytes + 1 - len(out))
            if len(out) > max_bytes:
                raise _too_large(max_bytes)
            if not inflater.eof:
                raise invalid(f"the {name} request body is cut short")
            data = inflater.unused_data
            if not data:
                return bytes(out)
    except zlib.error as exc:
        raise invalid(f"the request body is not valid {name}: {exc}") from None


def _zstd(raw: bytes, max_bytes: int) -> bytes:
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
            while chunk := reader.read(min(_CHUNK, max_bytes + 1 - len(out))):
                out += chunk
                if len(out) > max_bytes:
                    raise _too_large(max_bytes)
    except zstandard.ZstdError as exc:
        raise invalid(f"the request body is not valid zstd: {exc}") from None
    if raw and not out and not _is_empty_frame(raw):
        raise invalid("the zstd request body holds no complete frame")
    return bytes(out)


def _is_empty_frame(raw: bytes) -> bool:
    try:
        return zstandard.ZstdDecompressor().decompress(raw) == b""
    except zstandard.ZstdError:
        return False
