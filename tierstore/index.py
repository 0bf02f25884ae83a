"""KV-disk's LMDB index: states (hash -> record), pages (page hash -> state hashes, sliceable
states only), namespaces (h0 -> registration).

An index file shorter than the pages LMDB believes it holds (truncated, a full
disk that lost a write) would kill the process with SIGBUS at the first read of a
missing page, so the file size is checked against LMDB's last page before every
transaction. A damaged index is moved aside (``index.damaged-<time>``), never
deleted: the operator may want it; the disk tier rebuilds a fresh one.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import lmdb

DATA_FILE = "data.mdb"
T = TypeVar("T")


class IndexDamaged(Exception):
    """The index cannot be read safely; the message says why."""


class Index:
    def __init__(self, path: Path, map_size: int) -> None:
        """Opens (creating) the index in ``path``; IndexDamaged if what is there cannot be used."""
        self.path = path
        self.data_file = path / DATA_FILE
        if self.data_file.exists() and (size := self.data_file.stat().st_size) < 2 * mmap.PAGESIZE:
            # LMDB would take an empty file for a new index and lose every entry without a word.
            raise IndexDamaged(f"{self.data_file} is truncated to {size} bytes")
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=4, subdir=True, mode=0o700)
        self._closed = False
        for file in (path, *path.iterdir()):  # an index made before the tierstore kept it private
            want = 0o700 if file.is_dir() else 0o600
            if file.stat().st_mode & 0o777 != want:
                os.chmod(file, want)
        self._psize = int(self._env.stat()["psize"])
        if (reason := self.check()) is not None:
            self._env.close()
            raise IndexDamaged(reason)
        try:
            self.states = self._env.open_db(b"states")
            self.pages = self._env.open_db(b"pages", dupsort=True)
            self.namespaces = self._env.open_db(b"namespaces")
        except lmdb.Error:
            self._env.close()
            raise

    def check(self) -> str | None:
        """Why the index cannot be read safely now, or None."""
        if self._closed:
            return "it was closed (a rebuild did not finish)"
        try:
            size = self.data_file.stat().st_size
        except FileNotFoundError:
            return f"{self.data_file} is gone"
        if size < 2 * self._psize:
            return f"{self.data_file} is truncated to {size} bytes"
        need = (int(self._env.info()["last_pgno"]) + 1) * self._psize
        if size < need:
            return f"{self.data_file} has {size} of its {need} bytes"
        return None

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """``fn`` in a read transaction; IndexDamaged instead of a SIGBUS, lmdb.Error as LMDB raises it."""
        if (reason := self.check()) is not None:
            raise IndexDamaged(reason)
        with self._env.begin() as txn:
            return fn(txn)

    def write(self, fn: Callable[[lmdb.Transaction], object]) -> None:
        """``fn`` in one write transaction; grows the map when it is full (the map is virtual address space)."""
        if (reason := self.check()) is not None:
            raise IndexDamaged(reason)
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)

    def close(self) -> None:
        self._closed = True
        self._env.close()


def move_aside(path: Path) -> Path:
    """Renames a damaged index out of the way; returns where it went."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    os.rename(path, target)
    return target
