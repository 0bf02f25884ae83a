"""Reading a blob's bytes into the arena with their checksum, at the speed of the read alone.

A cold restore is bound by the disk: each chunk is hashed on a worker thread while
the next one is read (xxh3 releases the GIL), so the checksum costs about the last
chunk's hash instead of a pass over the whole state after (or between) the reads.
What is hashed is what was read, in order: the digest is the one a single pass gives.

Measured and not kept (bench/tiers.py prints the raw O_DIRECT read beside the
buffered one): O_DIRECT straight into the arena saves the kernel's copy out of the
page cache, but on the machine it was measured on its cold reads ran from 0.9x to 1.6x the
time of buffered reads (the kernel's readahead keeps the device busier), and a blob
still in the page cache (spilled a moment ago) would be read from the disk again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

CHUNK = 2 << 20  # bytes per read and hash step: the hash of the last one is what stays on the path


class BlobReader:
    def __init__(self, chunk: int = CHUNK) -> None:
        if chunk <= 0:
            raise ValueError(f"the read chunk must be > 0 bytes, got {chunk}")
        self.chunk = chunk
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ignis-kv-disk-hash")  # started at first use

    def read(self, fd: int, offset: int, out: memoryview, progress: Callable[[int], None] | None = None
             ) -> bytes | None:
        """Reads len(out) bytes of the open file `fd` from `offset` into `out`; returns their xxh3_128,
        or None if the file ended first. OSError if a read fails. `progress(n)` after each chunk: the
        first n bytes of `out` are read (not yet checked)."""
        n = len(out)
        hasher = xxhash.xxh3_128()
        pending: Future[None] | None = None
        pos = 0
        try:
            while pos < n:
                got = os.preadv(fd, [out[pos:min(pos + self.chunk, n)]], offset + pos)
                if not got:
                    return None
                if pending is not None:
                    pending.result()
                pending = self._hasher.submit(hasher.update, out[pos:pos + got])  # beside the next read
                pos += got
                if progress is not None:
                    progress(pos)
            if pending is not None:
                pending.result()
            return hasher.digest()
        finally:
            if pending is not None:  # the worker is done with `out` before the caller may release it
                pending.exception()

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
