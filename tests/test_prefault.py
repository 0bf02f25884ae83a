"""common.prefault: a shared-memory mapping's pages mapped in by a background thread, bytes untouched,
read back from the kernel's own account of the mapping (/proc/self/smaps)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.prefault import Prefault, address_of

MiB = 1 << 20


def resident_bytes(mapping: mmap.mmap) -> int:
    """The mapping's Rss: the bytes of its pages this process has mapped in."""
    start = address_of(mapping)
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if "-" in line.split(" ", 1)[0] and int(line.split("-", 1)[0], 16) == start:
            rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


@pytest.fixture
def shm_file(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = folder / f"ignis-test-prefault-{os.getpid()}-{tmp_path.name}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        yield fd, path
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def test_every_page_is_mapped_in_and_no_byte_changes(shm_file: tuple[int, Path]) -> None:
    fd, _ = shm_file
    n = 24 * MiB + 4096 * 3  # not a whole number of chunks
    os.posix_fallocate(fd, 0, n)
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8).tobytes()
    os.pwrite(fd, data, 0)  # written through the file: no page of the mapping below is mapped yet
    mapping = mmap.mmap(fd, n)
    assert resident_bytes(mapping) == 0
    prefault = Prefault(mapping, "test")
    assert prefault.done.wait(60)
    assert prefault.error == "" and prefault.mapped == n
    assert resident_bytes(mapping) == n
    assert mapping[:] == data
    mapping.close()


def test_a_stop_ends_it_after_its_chunk(shm_file: tuple[int, Path]) -> None:
    fd, _ = shm_file
    n = 256 * MiB
    os.posix_fallocate(fd, 0, n)
    mapping = mmap.mmap(fd, n)
    prefault = Prefault(mapping, "test")
    prefault.stop()
    assert prefault.done.is_set()
    assert prefault.mapped <= n and resident_bytes(mapping) >= prefault.mapped
    mapping.close()  # allowed: the thread held no buffer export


def test_a_truncated_file_stops_it_without_a_signal(shm_file: tuple[int, Path]) -> None:
    """A page past the file's end would be SIGBUS on a touch; the kernel answers the populate with EFAULT."""
    fd, _ = shm_file
    os.posix_fallocate(fd, 0, 8 * MiB)
    mapping = mmap.mmap(fd, 8 * MiB)
    os.ftruncate(fd, 2 * MiB)
    prefault = Prefault(mapping, "test")
    assert prefault.done.wait(60)
    assert prefault.error == "EFAULT" and prefault.mapped < 8 * MiB
    mapping.close()
