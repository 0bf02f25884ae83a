"""KV-RAM arena: the extent allocator (exact offsets) and the shared-memory file."""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierstore.arena import ALIGN, SHM_PREFIX, Arena, Extent, ExtentAllocator, reap_stale_arenas

K = ALIGN


def make_allocator(pages: int = 16) -> ExtentAllocator:
    return ExtentAllocator(pages * K)


def test_extents_are_page_aligned_and_rounded_up() -> None:
    a = make_allocator()
    assert a.allocate(1) == Extent(0, K)
    assert a.allocate(K + 1) == Extent(K, 2 * K)
    assert a.allocate(K) == Extent(3 * K, K)
    assert a.used_bytes == 4 * K and a.free_bytes == 12 * K
    a.check_integrity()


def test_best_fit_takes_the_smallest_run_that_fits() -> None:
    a = make_allocator(16)
    e = [a.allocate(K) for _ in range(16)]  # fill, then open holes of 3, 1 and 2 pages
    for i in (1, 2, 3, 6, 10, 11):
        a.free(e[i])  # type: ignore[arg-type]
    a.check_integrity()
    assert a.allocate(2 * K) == Extent(10 * K, 2 * K)  # the 2-page hole, not the first (3-page) one
    assert a.allocate(K) == Extent(6 * K, K)  # the exact 1-page hole
    assert a.allocate(3 * K) == Extent(1 * K, 3 * K)
    assert a.allocate(K) is None  # full: capacity is a return value
    a.check_integrity()


def test_free_coalesces_with_both_neighbours() -> None:
    a = make_allocator(8)
    x, y, z = a.allocate(2 * K), a.allocate(2 * K), a.allocate(2 * K)
    assert x and y and z
    a.free(x)
    a.free(z)
    a.free(y)  # joins [0,2) [2,4) [4,6) [6,8) into one run
    a.check_integrity()
    assert a.allocate(8 * K) == Extent(0, 8 * K)


def test_too_large_and_bad_requests() -> None:
    a = make_allocator(4)
    assert a.allocate(4 * K + 1) is None
    with pytest.raises(ValueError):
        a.allocate(0)
    e = a.allocate(K)
    assert e is not None
    a.free(e)
    with pytest.raises(RuntimeError, match="this is a bug"):
        a.free(e)  # double free
    with pytest.raises(RuntimeError, match="this is a bug"):
        a.free(Extent(K, K))  # never allocated
    with pytest.raises(ValueError):
        ExtentAllocator(K + 1)


def test_random_alloc_free_keeps_integrity() -> None:
    rng = random.Random(7)
    a = make_allocator(256)
    held: list[Extent] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            e = a.allocate(rng.randint(1, 12 * K))
            if e is not None:
                held.append(e)
        a.check_integrity()
    assert a.used_bytes == sum(e.length for e in held)
    for e in held:
        a.free(e)
    a.check_integrity()
    assert a.allocate(a.total) == Extent(0, a.total)  # one run again: the whole arena


def test_arena_is_a_shared_memory_file_another_mapping_sees(tmp_path: Path) -> None:
    arena = Arena(64 * K + 100, directory=tmp_path)  # rounded down to whole pages
    other = Arena(8 * K, directory=tmp_path)
    try:
        assert arena.size == 64 * K and arena.path.stat().st_size == 64 * K
        assert arena.path.name.startswith(f"{SHM_PREFIX}{os.getpid()}-") and arena.path != other.path
        e = arena.allocate(3 * K)
        assert e is not None
        fd = os.open(arena.path, os.O_RDWR)
        peer = mmap.mmap(fd, arena.size)  # what an engine does with RegisterResponse.arena_path
        os.close(fd)
        peer[e.offset:e.offset + 5] = b"hello"
        assert bytes(arena.slice(e.offset, 5)) == b"hello"
        arena.slice(e.offset + 10, 3)[:] = b"abc"
        assert peer[e.offset + 10:e.offset + 13] == b"abc"
        peer.close()
        with pytest.raises(ValueError):
            arena.slice(arena.size - 1, 2)
    finally:
        arena.close()
        other.close()
    assert not arena.path.exists() and not other.path.exists()


def test_the_real_arena_lives_in_dev_shm() -> None:
    arena = Arena(4 * K)
    try:
        assert arena.path.parent == Path("/dev/shm") and arena.path.exists()
    finally:
        arena.close()
    assert not arena.path.exists()


def test_stale_arenas_are_reaped_and_live_ones_kept(tmp_path: Path) -> None:
    """Live means locked by its tierstore: the pid in the name only speeds up the common case."""
    live = Arena(4 * K, directory=tmp_path)  # (its own start reaps: create the others after it)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{SHM_PREFIX}{int(dead.stdout)}-abc"
    reused_pid = tmp_path / f"{SHM_PREFIX}{os.getpid()}-old"  # a container restart: same pid, nobody holds it
    starting = tmp_path / f"{SHM_PREFIX}{os.getpid()}-new"  # just created by a tierstore starting beside us
    unrelated = tmp_path / "something-else"
    for p in (stale, reused_pid, starting, unrelated):
        p.write_bytes(b"x")
    os.utime(reused_pid, (time.time() - 60, time.time() - 60))
    os.utime(live.path, (time.time() - 60, time.time() - 60))
    try:
        assert sorted(reap_stale_arenas(tmp_path)) == sorted([stale, reused_pid])
        assert live.path.exists() and starting.exists() and unrelated.exists()
    finally:
        live.close()
    assert not live.path.exists()


def test_the_arena_of_a_killed_tierstore_is_reaped_at_the_next_start(tmp_path: Path) -> None:
    code = (f"import sys, time; from pathlib import Path; from tierstore.arena import Arena; "
            f"a = Arena(4096, directory=Path({str(tmp_path)!r})); print(a.path, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    path = Path(proc.stdout.readline().strip())
    assert path.exists() and reap_stale_arenas(tmp_path) == []  # alive: kept
    proc.kill()
    proc.wait()
    proc.stdout.close()
    again = Arena(4 * K, directory=tmp_path)  # a start reaps what the killed one left
    try:
        assert not path.exists() and again.path.exists()
    finally:
        again.close()
