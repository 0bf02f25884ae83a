"""Mapping a shared-memory arena's pages in ahead of use, on a background thread.

`posix_fallocate` gives the arena's file its pages, but each process that maps it still
takes a page fault on its first touch of every 4 KiB page. In a VM that is the larger
part of a first copy: 150 MiB into never-touched arena pages took 60-66 ms against
11-14 ms once mapped, and a reader's first pass 21-25 ms against 11-13 (this project's
2-vCPU VM). So the arena's first states paid 2-5x the copy they were measured at.
`MADV_POPULATE_WRITE` (Linux 5.14) maps the pages in without touching their bytes; done
here chunk by chunk on a thread at the lowest CPU priority, through libc (ctypes lets go
of the GIL around the call, Python's `mmap.madvise` does not), it costs ~0.45 s of CPU
per GiB, off every request's path, and a page a copy reaches first simply faults as before.

The thread holds the mapping object, so an engine's mapping (dropped, never closed)
stays mapped until the thread is done; `stop()` ends it after its chunk, and a
mapping that is closed explicitly is stopped first (tierstore/arena.py).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading

log = logging.getLogger("ignis.prefault")

MADV_POPULATE_WRITE = 23  # <linux/mman.h>; EINVAL on kernels before 5.14
CHUNK = 4 << 20  # bytes a call: a stop waits for at most one


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def address_of(mapping: mmap.mmap) -> int:
    """Where `mapping` starts in this process: its buffer is exported for the lookup only, so the mapping
    can still be closed."""
    view = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(view)
    del view
    return address


class Prefault:
    """Maps every page of `mapping` in, in the background; `done` is set when it is through."""

    def __init__(self, mapping: mmap.mmap, name: str) -> None:
        self._stop = threading.Event()
        self.done = threading.Event()
        self.mapped = 0  # bytes mapped in so far
        self.error = ""  # why it stopped short, if it did (an old kernel: "EINVAL")
        self._thread = threading.Thread(target=self._run, args=(mapping, address_of(mapping), len(mapping)),
                                        name=f"ignis-prefault-{name}", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self, mapping: mmap.mmap, address: int, length: int) -> None:
        try:
            madvise = _madvise()
            if madvise is None:
                self.error = "no madvise in libc"
                return
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
            except OSError:
                pass
            while self.mapped < length and not self._stop.is_set():
                n = min(CHUNK, length - self.mapped)
                if madvise(address + self.mapped, n, MADV_POPULATE_WRITE) != 0:
                    code = ctypes.get_errno()
                    self.error = errno.errorcode.get(code, str(code))
                    log.debug("prefault of %d bytes stopped at %d: %s", length, self.mapped, self.error)
                    return
                self.mapped += n
        finally:
            del mapping  # the last reference may unmap it: only once no call is under way
            self.done.set()
