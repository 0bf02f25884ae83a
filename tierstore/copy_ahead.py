"""The service's thread that gives RAM states their disk copies ahead of need (`kv_disk.copy_ahead`).

Without it a state first reaches disk when RAM pressure moves it there: the Reserve or the
restore that needs the room waits for a whole blob write and fsync (a 150 MiB state: 0.15 to
0.5 s on the disks measured) before it can copy a byte. With it the state next to leave RAM
already has its disk copy, written while nobody waited, and leaving RAM only frees its extent.

One copy at a time, outside the store's lock (TierStore.copy_ahead); the thread sleeps until a
Commit names a new state, or for a second at most (a failing disk's retry, room freed on disk).
It runs at the lowest CPU priority (nice 19, this thread only): its hashing and copying yield to
the store's calls and to the engines on the same cores. Between two 8 MiB chunks it waits while a
call waits on the disk (a restore, a spill, a Get's read), up to 5 s a chunk, so that it does not
take their bandwidth (no I/O priority class is set: the block queues measured here schedule none).
"""

from __future__ import annotations

import logging
import os
import threading

from tierstore.store import TierStore

log = logging.getLogger("ignis.tierstore")
IDLE_SECONDS = 1.0  # the longest sleep between looks when nothing was committed
LOWEST_PRIORITY = 19


class CopyAhead:
    def __init__(self, store: TierStore) -> None:
        self._store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ignis-copy-ahead", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops; a copy in flight stops at its next chunk (its temp file removed)."""
        self._stop.set()
        self._store.cancel_copies()
        self._store.copy_wanted.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)  # Linux: this thread
        except OSError as exc:
            log.info("copies ahead of need run at normal priority (%s)", exc)
        wanted = self._store.copy_wanted
        while not self._stop.is_set():
            wanted.clear()  # before the look: a Commit during it sets it again
            try:
                copied = self._store.copy_ahead()
            except Exception:  # never let one bad copy end the thread: spills still work without it
                log.exception("a copy ahead of need failed")
                copied = False
            if not copied:
                wanted.wait(IDLE_SECONDS)
