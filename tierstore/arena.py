"""KV-RAM: one shared-memory file carved into extents.

The engine maps the same file (its path travels in RegisterResponse) and copies
state in and out by offset, so the bytes of a state never cross gRPC on one host.
The allocator is best-fit over a free list sorted by offset, coalescing on free;
every extent starts and ends on a 4 KiB boundary (page-aligned copies, and
``cudaHostRegister`` on the engine side wants whole pages).
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from common.prefault import Prefault
from tierstore.shm_file import SharedFile

log = logging.getLogger("ignis.tierstore")

ALIGN = 4096
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "ignis-tierstore-"


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True, order=True)
class Extent:
    """A byte range of the arena: [offset, offset + length)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class ExtentAllocator:
    """Best-fit extents over ``total`` bytes (a multiple of ALIGN)."""

    def __init__(self, total: int) -> None:
        if total <= 0 or total % ALIGN:
            raise ValueError(f"the arena size must be a positive multiple of {ALIGN} bytes, got {total}")
        self.total = total
        self._free: list[Extent] = [Extent(0, total)]  # sorted by offset, never adjacent (coalesced)
        self._used: dict[int, Extent] = {}  # offset -> extent handed out
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.total - self.used_bytes

    def allocate(self, nbytes: int) -> Extent | None:
        """An extent of at least ``nbytes`` (rounded up to ALIGN), or None if no free run is long enough."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = align_up(nbytes)
        best = -1
        for i, run in enumerate(self._free):  # best fit: least waste left behind
            if run.length >= size and (best < 0 or run.length < self._free[best].length):
                best = i
                if run.length == size:
                    break
        if best < 0:
            return None
        run = self._free[best]
        extent = Extent(run.offset, size)
        if run.length == size:
            del self._free[best]
        else:
            self._free[best] = Extent(run.offset + size, run.length - size)
        self._used[extent.offset] = extent
        self.used_bytes += size
        return extent

    def free(self, extent: Extent) -> None:
        """Returns an extent from allocate(); merges it with free neighbours."""
        if self._used.get(extent.offset) != extent:
            raise RuntimeError(f"free of {extent}, which is not allocated: this is a bug")
        del self._used[extent.offset]
        self.used_bytes -= extent.length
        i = bisect.bisect_left(self._free, extent)
        start, end = extent.offset, extent.end
        if i < len(self._free) and self._free[i].offset == end:  # merge with the right neighbour
            end = self._free.pop(i).end
        if i > 0 and self._free[i - 1].end == start:  # and the left one
            i -= 1
            start = self._free.pop(i).offset
        self._free.insert(i, Extent(start, end - start))

    def check_integrity(self) -> None:
        """free + used == total, no overlaps, free runs coalesced; raises AssertionError."""
        spans = sorted([*self._free, *self._used.values()])
        pos = 0
        for span in spans:
            assert span.offset == pos, f"gap or overlap at {pos}: {span}"
            assert span.length > 0 and span.offset % ALIGN == 0 and span.length % ALIGN == 0, span
            pos = span.end
        assert pos == self.total, f"extents cover {pos} of {self.total} bytes"
        assert sum(e.length for e in self._used.values()) == self.used_bytes
        for a, b in zip(self._free, self._free[1:]):
            assert a.end < b.offset, f"free runs {a} and {b} are not coalesced"


class Arena:
    """The shared-memory file, its mapping, and the extents carved from it."""

    def __init__(self, nbytes: int, *, instance_id: str | None = None, directory: Path = SHM_DIR) -> None:
        size = nbytes // ALIGN * ALIGN
        if size <= 0:
            raise ValueError(f"reuse.kv_host_pool_bytes must be at least {ALIGN} bytes, got {nbytes}")
        reap_stale_arenas(directory)
        self.file = SharedFile(arena_path(directory, instance_id or uuid.uuid4().hex), size)
        self.path = self.file.path
        self._mmap = self.file.mmap
        # This process's page tables for it, filled ahead of the first restores into it (common/prefault.py).
        self.prefault = Prefault(self._mmap, "arena")
        self.size = size
        self.view = memoryview(self._mmap)
        self.allocator = ExtentAllocator(size)
        self.instance_id = instance_id or ""

    def allocate(self, nbytes: int) -> Extent | None:
        return self.allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def reader(self) -> int:
        """A descriptor of the arena file of its own (the caller closes it): reads through it see a
        truncated file as a short read, where the mapping would be SIGBUS; it outlives `close`."""
        return os.dup(self.file.fd)

    def slice(self, offset: int, nbytes: int) -> memoryview:
        """The arena bytes [offset, offset + nbytes), zero copy."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"[{offset}, {offset + nbytes}) lies outside the {self.size}-byte arena")
        return self.view[offset:offset + nbytes]

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    def fault(self) -> str | None:
        """Why the file can no longer serve as the arena, or None (SharedFile.fault): then a new arena
        (store.py)."""
        return self.file.fault()

    def close(self) -> None:
        """Unmaps and removes the file. Engines that still map it keep their mapping until they unmap."""
        self.prefault.stop()  # no madvise under way when the mapping goes
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:  # a slice is still exported (an in-flight Get): the unlink below still happens
            log.warning("arena still referenced at close; unmapped at exit")
        self.file.remove()


def arena_path(directory: Path, instance_id: str) -> Path:
    """Where the arena of instance `instance_id` lives (its published table beside it: a name nobody can
    guess before the store makes it)."""
    return directory / f"{SHM_PREFIX}{os.getpid()}-{instance_id}"


def reap_stale_arenas(directory: Path = SHM_DIR, min_age: float = 10.0) -> list[Path]:
    """Removes arena files of tierstores that died without cleaning up (kill -9), and the published
    tables beside them (``<arena>.table``, tierstore/published_table.py: held by an flock the same way).

    A live tierstore holds an flock on its file. A file nobody holds is stale once its
    owner's pid is gone, or once it is `min_age` seconds old (in a container a restarted
    tierstore often gets the dead one's pid; the age covers a file just created by a
    tierstore starting next to us, not yet locked).
    """
    removed: list[Path] = []
    for path in directory.glob(SHM_PREFIX + "*"):
        pid_text = path.name[len(SHM_PREFIX):].partition("-")[0]
        try:
            stat = path.stat()
            if stat.st_uid != os.getuid():
                continue
            if pid_text.isdigit() and _alive(int(pid_text)) and time.time() - stat.st_mtime < min_age:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its tierstore is alive
            else:
                path.unlink()
            finally:
                os.close(fd)
        except OSError:
            continue
        log.info("removed the arena %s of a tierstore that is gone", path.name)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
