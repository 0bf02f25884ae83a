"""Copies off the engine step: one worker thread, its results collected on the engine thread.

The engine thread submits a job: what runs on the worker (a copy into a host slot,
a whole spill to KV-RAM) and what runs back on the engine thread once the worker
is through (`collect`, at the start of a step), so the engine's pools and indexes
are only ever touched on the engine thread. The memory a job reads stays intact
until its `on_done` has run; a step that needs that memory sooner calls
`wait_for(key)`, which waits for that job (and those queued before it) only.
Torch copies, xxh3 and the integrity tag's GMAC release the GIL, so the worker's
copies run beside the step rather than inside it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

log = logging.getLogger("ignis.engine")


@dataclass(slots=True)
class CopyJob:
    key: Hashable  # what the job is about (a state's name): `pending` / `wait_for` find it by this
    run: Callable[[], bool]  # on the worker: True if the copy landed
    on_done: Callable[[bool], None]  # on the engine thread, with what `run` returned (False if it raised)


class CopyWorker:
    def __init__(self, name: str = "ignis-copies") -> None:
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[tuple[CopyJob, bool]] = queue.SimpleQueue()
        self._pending: dict[Hashable, int] = {}  # key -> jobs submitted and not yet collected (engine thread)
        self.in_flight = 0
        self.completed = 0
        self.failures = 0  # jobs that raised (logged; their on_done got False)
        self.waits = 0  # times the engine thread waited for a job (wait_for found it still pending)
        # A test may hold the worker back (cleared) to see a job that has not finished yet.
        self.running = threading.Event()
        self.running.set()
        self.notify: Callable[[], None] | None = None  # called on the worker after each job (wakes the engine)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        self.in_flight += 1
        self._pending[job.key] = self._pending.get(job.key, 0) + 1
        self._jobs.put(job)

    def pending(self, key: Hashable) -> bool:
        """Whether a job about `key` is submitted and not collected yet."""
        return key in self._pending

    def collect(self, wait: bool = False) -> int:
        """Run `on_done` of every job the worker is through with (engine thread). With `wait`,
        first waits for every job in flight. Returns how many were collected."""
        done = 0
        while self.in_flight:
            try:
                job, ok = self._finished.get(block=wait)
            except queue.Empty:
                break
            self._finish(job, ok)
            done += 1
        return done

    def wait_for(self, key: Hashable) -> None:
        """Block until every job about `key` is collected (its memory may then be reused)."""
        if key in self._pending:
            self.waits += 1
        while key in self._pending:
            job, ok = self._finished.get()
            self._finish(job, ok)

    def _finish(self, job: CopyJob, ok: bool) -> None:
        self.in_flight -= 1
        left = self._pending[job.key] - 1
        if left:
            self._pending[job.key] = left
        else:
            del self._pending[job.key]
        self.completed += 1
        job.on_done(ok)

    def _work(self) -> None:
        torch.set_grad_enabled(False)
        # Copies are bound by memory, not cores: one thread, so the worker never takes the step's
        # cores (an OpenMP team of its own would spin beside the step's after each copy).
        torch.set_num_threads(1)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.running.wait()
            try:
                ok = bool(job.run())
            except BaseException:  # reported here; the engine thread learns it as "not copied"
                self.failures += 1
                log.exception("a copy off the step failed; what it copied is dropped")
                ok = False
            self._finished.put((job, ok))
            notify = self.notify
            if notify is not None:
                notify()

    def close(self) -> None:
        """Finish what is in flight (its on_done runs), then stop the thread."""
        self.running.set()
        self.collect(wait=True)
        self._jobs.put(None)
        self._thread.join(5.0)
