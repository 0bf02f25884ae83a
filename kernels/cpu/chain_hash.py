"""The reuse key's hash chain over many pages in one C call: kernels/cpu/chain_hash.c via ctypes.

Behind engine/kv/chain_hash.py's page_hashes, whose Python loop is its oracle
(tests/test_chain_hash.py): that loop spends ~0.3-0.5 µs a page in the interpreter around a ~20 ns
xxh3; here the chain is one call and its digests come back as one buffer, cut into 16-byte
`bytes` by cached `struct.Struct`s (one C loop, not a slice a page).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import struct
from pathlib import Path
from typing import Callable

from kernels.cpu.library import LIBRARY, bind

HASH_BYTES = 16
_GROUP = 256  # digests cut per Struct call: a bounded format, reused for every long chain
_i64, _bytes = ctypes.c_int64, ctypes.c_char_p

# (parent digest, the pages' tokens as little-endian uint32 bytes, page size) -> each page's digest
ChainPages = Callable[[bytes, bytes, int], "list[bytes] | None"]


def load(path: Path = LIBRARY) -> ChainPages | None:
    """The chain bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "chain_page_hashes", [_bytes, _bytes, _i64, _i64, _bytes], "the hash chain runs in Python")
    return None if fn is None else functools.partial(_run, fn)


def _run(fn: Callable[..., int], parent: bytes, tokens: bytes, page_size: int) -> list[bytes] | None:
    """h_i = xxh3_128(h_{i-1} || page i's bytes) for each full page of `tokens`, or None where the C
    kernel does not take the page size."""
    if len(parent) != HASH_BYTES:
        raise ValueError(f"a chain's parent is {HASH_BYTES} bytes, not {len(parent)}")
    pages = len(tokens) // (4 * page_size) if page_size > 0 else 0
    out = ctypes.create_string_buffer(pages * HASH_BYTES)
    if fn(parent, tokens, pages, page_size, out) != 0:
        return None
    return split_digests(out.raw)


def split_digests(blob: bytes) -> list[bytes]:
    """`blob` cut into its 16-byte digests, in order."""
    n = len(blob) // HASH_BYTES
    if n < _GROUP:
        return list(_digests(n).unpack(blob))
    grouped = n - n % _GROUP
    out = list(itertools.chain.from_iterable(_digests(_GROUP).iter_unpack(memoryview(blob)[:grouped * HASH_BYTES])))
    out.extend(_digests(n - grouped).unpack_from(blob, grouped * HASH_BYTES))
    return out


@functools.lru_cache(maxsize=_GROUP + 1)
def _digests(count: int) -> struct.Struct:
    return struct.Struct(f"{HASH_BYTES}s" * count)
