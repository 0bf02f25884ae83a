"""Captures off the step: a staging ring of two buffers and a copy worker.

A capture into a host slot must not make the prefill wait while its KV pages are
copied (the bulk of a long state). On the step, only the part that keeps
changing is copied: the sequence's recurrent slot and its partial last page go
into a free ring buffer. Its full pages are immutable once computed; the capture
holds a reference to them, and the worker thread copies them, and the staged
bytes, into the host slot while the engine steps on. The engine thread collects
finished copies at the start of a step (`collect`): only then is the state
claimable and are the page references dropped. A capture that finds both
buffers busy is skipped and counted, never torn.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

RING_SIZE = 2
log = logging.getLogger("ignis.engine")


@dataclass(slots=True)
class StagedCopy:
    """One capture in flight: the buffer it holds and the copy the worker runs."""

    buffer: int
    copy: Callable[[torch.Tensor], None]  # (staging buffer) -> None, on the worker thread
    on_done: Callable[[bool], None]  # (copied?) on the engine thread, once the worker is through


class StagingRing:
    def __init__(self, nbytes: int, pin: bool = False) -> None:
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(RING_SIZE)]  # [bytes]
        self._free = list(range(RING_SIZE))
        self._jobs: queue.SimpleQueue[StagedCopy | None] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[tuple[StagedCopy, BaseException | None]] = queue.SimpleQueue()
        self.in_flight = 0
        self.copies = 0
        self.skips = 0  # captures that found both buffers busy
        self.failures = 0
        # A test may hold the worker back (cleared) to see a capture that is not finished yet.
        self.running = threading.Event()
        self.running.set()
        self._worker = threading.Thread(target=self._work, name="ignis-staging", daemon=True)
        self._worker.start()

    def acquire(self) -> int | None:
        """A free buffer (engine thread), or None: the capture is skipped and counted."""
        if not self._free:
            self.skips += 1
            return None
        return self._free.pop()

    def submit(self, staged: StagedCopy) -> None:
        self.in_flight += 1
        self._jobs.put(staged)

    def collect(self, wait: bool = False) -> int:
        """Finish what the worker has copied (engine thread): frees buffers, runs each `on_done`.
        With `wait`, first waits for every copy in flight. Returns how many finished."""
        done = 0
        while self.in_flight:
            try:
                staged, error = self._finished.get(block=wait)
            except queue.Empty:
                break
            self.in_flight -= 1
            self._free.append(staged.buffer)
            if error is None:
                self.copies += 1
            else:
                self.failures += 1
                log.error("a staged capture failed to copy; it is dropped", exc_info=error)
            staged.on_done(error is None)
            done += 1
        return done

    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            staged = self._jobs.get()
            if staged is None:
                return
            self.running.wait()
            error: BaseException | None = None
            try:
                staged.copy(self.buffers[staged.buffer])
            except BaseException as exc:  # reported on the engine thread; the capture is dropped
                error = exc
            self._finished.put((staged, error))

    def close(self) -> None:
        self.running.set()
        self._jobs.put(None)
        self._worker.join(5.0)
