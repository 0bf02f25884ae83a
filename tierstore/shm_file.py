"""A tierstore instance's file in shared memory: the KV-RAM arena (arena.py) and its published table
(published_table.py) are each one.

Created exclusively, mode 0600 (only this user's processes open it: the engines check that too);
its pages allocated at once (a full /dev/shm fails here, at start, not as SIGBUS mid-copy); mapped;
and locked with an exclusive flock while the store lives. The kernel drops the lock on any exit,
kill -9 included, so a later start removes a file nobody holds (`arena.reap_stale_arenas`) and an
engine can tell a live store's file from a dead one's.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

from common.mapped_file import file_fault


class SharedFile:
    def __init__(self, path: Path, size: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(fd, 0, size)
            self.mmap = mmap.mmap(fd, size)
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        self.path, self.size, self.fd = path, size, fd
        self._inode = os.fstat(fd).st_ino

    def fault(self) -> str | None:
        """Why the file can no longer serve, or None. Truncated: a write or copy into the missing pages
        would be SIGBUS, here and in every engine mapping it. Deleted or replaced: an engine that maps
        it again by path gets another file (or none)."""
        broken = file_fault(self.fd, self.size)
        if broken is not None:
            return broken
        try:
            if os.stat(self.path).st_ino != self._inode:
                return "replaced by another file"
        except FileNotFoundError:
            return "deleted"
        except OSError as exc:
            return f"cannot stat its path ({exc})"
        return None

    def remove(self) -> None:
        """Removes the file (never another tierstore's file of that name) and closes it: its lock goes.
        The caller unmaps it first; processes that still map it keep their mapping until they unmap."""
        if self.fd < 0:
            return
        try:
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1
