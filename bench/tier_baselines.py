"""The raw copies and file I/O that `bench.tiers` measures the tiers against: a numpy memcpy (on one
thread and in halves on two), a file write + fsync and a cold read (with and without O_DIRECT) in the
scratch folder, and a first copy into a fresh shared-memory mapping. `drop_cache` is how every cold
read here and in bench/tier_claims.py gets its file out of the page cache."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from common.prefault import Prefault

MiB = 1 << 20


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_cache(path: Path) -> None:
    """Evicts a file's pages from the page cache (clean pages: no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class RawCopies:
    """One state's bytes (`src`) and the page-aligned buffer the copies land in (`dst`, as O_DIRECT needs),
    each raw operation timed in seconds. The constructor faults `dst` in and writes the raw file once."""

    def __init__(self, n: int, folder: Path, helpers: ThreadPoolExecutor) -> None:
        self.n = n
        self.src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        self.dst = np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)
        self.src_bytes = memoryview(self.src.data).cast("B")
        self.out = memoryview(self.dst.data).cast("B")
        self.file = folder / "raw.bin"
        self.helpers = helpers  # the second thread of memcpy_threads
        np.copyto(self.dst, self.src)  # fault the destination in once
        self.write()

    def memcpy(self) -> float:
        return timed(lambda: np.copyto(self.dst, self.src))

    def memcpy_threads(self) -> float:
        """A memcpy of the same bytes in halves on two threads (ctypes' memmove lets go of the GIL): the
        copy's own floor on two cores."""
        n, dst, src = self.n, self.dst.ctypes.data, self.src.ctypes.data
        half = n // 2

        def copy() -> None:
            other = self.helpers.submit(ctypes.memmove, dst, src, half)
            ctypes.memmove(dst + half, src + half, n - half)
            other.result()
        return timed(copy)

    def write(self) -> float:
        def write() -> None:
            fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            view = self.src_bytes
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.close(fd)
        return timed(write)

    def read(self, direct: bool = False) -> float:
        drop_cache(self.file)

        def read() -> None:
            fd = os.open(self.file, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                pos = 0
                while pos < self.n:
                    pos += os.readv(fd, [self.out[pos:pos + 8 * MiB]]) or 0
            finally:
                os.close(fd)
        return timed(read)

    def fresh_mapping_copy(self, prefault: bool) -> float:
        """The first copy into a fresh shared-memory file's mapping, as into never-touched arena pages:
        its pages faulted in by the copy itself, or mapped in beforehand (untimed) by common/prefault.py
        as the tierstore and the engine do for the arena."""
        fd, path = tempfile.mkstemp(prefix="ignis-bench-fresh-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        try:
            os.posix_fallocate(fd, 0, self.n)
            mapping = mmap.mmap(fd, self.n)
            if prefault:
                assert Prefault(mapping, "bench").done.wait(120)
            fresh = np.frombuffer(mapping, dtype=np.uint8)
            seconds = timed(lambda: np.copyto(fresh, self.src))
            del fresh
            mapping.close()
            return seconds
        finally:
            os.close(fd)
            os.unlink(path)
