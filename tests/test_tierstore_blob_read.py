"""KV-disk reads (tierstore/blob_read.py): the checksum computed beside the reads is the one a single
pass over the bytes gives, whatever the size, chunk and offset; a file that ends early is None."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.blob_read import BlobReader

_names = itertools.count()


def write_file(folder: Path, data: bytes, offset: int) -> Path:
    path = folder / f"f{next(_names)}"
    path.write_bytes(b"h" * offset + data)
    return path


def read(reader: BlobReader, path: Path, offset: int, out: memoryview) -> bytes | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return reader.read(fd, offset, out)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("blob-read")


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 200_000), chunk=st.integers(1, 70_000), offset=st.integers(0, 5000))
def test_the_bytes_and_their_checksum_are_exact(folder: Path, size: int, chunk: int, offset: int) -> None:
    data = os.urandom(size)
    path = write_file(folder, data, offset)
    reader = BlobReader(chunk)
    buf = bytearray(size)
    try:
        assert read(reader, path, offset, memoryview(buf)) == xxhash.xxh3_128_digest(data)
        assert buf == data
    finally:
        reader.close()
        path.unlink()


def test_a_file_that_ends_early_reads_as_none_and_leaves_nothing_in_flight(folder: Path) -> None:
    data = os.urandom(300_000)
    path = write_file(folder, data, 100)
    os.truncate(path, 100 + 250_001)
    reader = BlobReader(65536)
    buf = bytearray(len(data))
    view = memoryview(buf)
    assert read(reader, path, 100, view) is None
    view.release()  # no hash step still holds a slice of it (BufferError otherwise)
    buf.extend(b"x")  # a bytearray with a live export cannot be resized
    reader.close()


def test_the_hash_runs_beside_the_reads(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk is hashed on the reader's worker thread, never on the caller's."""
    data = os.urandom(1 << 20)
    path = write_file(folder, data, 0)
    reader = BlobReader(1 << 16)
    threads: set[str] = set()
    real = xxhash.xxh3_128

    class Spy:
        def __init__(self) -> None:
            self.h = real()

        def update(self, b: memoryview) -> None:
            threads.add(threading.current_thread().name)
            self.h.update(b)

        def digest(self) -> bytes:
            return self.h.digest()

    monkeypatch.setattr(xxhash, "xxh3_128", Spy)
    try:
        assert read(reader, path, 0, memoryview(bytearray(len(data)))) == xxhash.xxh3_128_digest(data)
    finally:
        reader.close()
    assert threads and all(t.startswith("ignis-kv-disk-hash") for t in threads)
