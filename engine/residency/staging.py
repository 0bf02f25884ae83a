"""Captures off the step: a staging ring of two buffers, copied onward by the copy worker.

A capture into a host slot must not make the prefill wait while its KV pages are
copied (the bulk of a long state). On the step, only the part that keeps
changing is copied: the sequence's recurrent slot and its partial last page go
into a free ring buffer. Its full pages are immutable once computed; the capture
holds a reference to them, and the worker thread (engine/residency/copy_worker.py)
copies them, and the staged bytes, into the host slot while the engine steps on.
The engine thread collects finished copies at the start of a step: only then is
the state claimable and are the page references dropped. A capture that finds
both buffers busy is skipped and counted, never torn.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.residency.copy_worker import CopyJob, CopyWorker
from engine.tiers.codec import StateCodec

RING_SIZE = 2


@dataclass(slots=True, eq=False)
class StagedCopy:
    """One capture in flight: the buffer it holds and the copy the worker runs."""

    buffer: int
    copy: Callable[[torch.Tensor], bool | None]  # (staging buffer) -> False if it did not land; worker thread
    on_done: Callable[[bool], None]  # (copied?) on the engine thread, once the worker is through


class StagingRing:
    def __init__(self, nbytes: int, pin: bool = False, worker: CopyWorker | None = None) -> None:
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(RING_SIZE)]  # [bytes]
        self._free = list(range(RING_SIZE))
        self._owns_worker = worker is None
        self.worker = worker or CopyWorker("ignis-staging")
        self.in_flight = 0
        self.copies = 0
        self.skips = 0  # captures that found both buffers busy
        self.failures = 0

    @property
    def running(self) -> threading.Event:
        """Cleared, the worker holds back (tests use it to see a capture not yet finished)."""
        return self.worker.running

    def acquire(self) -> int | None:
        """A free buffer (engine thread), or None: the capture is skipped and counted."""
        if not self._free:
            self.skips += 1
            return None
        return self._free.pop()

    def submit(self, staged: StagedCopy) -> None:
        self.in_flight += 1

        def run() -> bool:  # worker thread
            return staged.copy(self.buffers[staged.buffer]) is not False

        def done(copied: bool) -> None:  # engine thread
            self.in_flight -= 1
            self._free.append(staged.buffer)
            if copied:
                self.copies += 1
            else:
                self.failures += 1
            staged.on_done(copied)

        self.worker.submit(CopyJob(staged, run, done))

    def collect(self, wait: bool = False) -> int:
        """Finish what the worker has copied (engine thread): frees buffers, runs each `on_done`.
        With `wait`, first waits for every copy in flight. Returns how many jobs finished."""
        return self.worker.collect(wait)

    def close(self) -> None:
        if self._owns_worker:
            self.worker.close()
        else:
            self.worker.collect(wait=True)


def staged_write(codec: StateCodec, m: int, full_pages: list[int], partial: bool, logits: torch.Tensor | None
                 ) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    """(staging buffer, destination, offset) -> writes the state at `m` in the codec's layout: its slot
    and partial page from the buffer (where the step put them), its full pages from the device."""
    full = m // codec.page_size
    head = codec.sections(0).kv

    def write(buf: torch.Tensor, dest: torch.Tensor, offset: int) -> None:
        dest[offset:offset + head].copy_(buf[:head])
        codec.pack_pages(dest, offset, m, full_pages, 0)
        if partial:
            start = offset + codec.sections(m).kv + full * codec.page_bytes
            dest[start:start + codec.page_bytes].copy_(buf[head:head + codec.page_bytes])
        if logits is not None:
            codec.write_logits(dest, offset, m, logits)
    return write


def stage_changing_part(codec: StateCodec, buffer: torch.Tensor, slot: int | None, page_table: list[int], m: int
                        ) -> tuple[list[int], bool]:
    """On the step: the state at `m`'s slot and partial last page into `buffer` ([slot | one page]);
    returns its full pages (immutable: the capture references them) and whether it has a partial one."""
    full = m // codec.page_size
    partial = [page_table[full]] if m % codec.page_size else []
    codec.pack_window(buffer, 0, codec.page_size, slot, partial, 0)
    return page_table[:full], bool(partial)
