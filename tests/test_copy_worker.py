"""The copy worker (engine/residency/copy_worker.py): jobs run off the engine thread, their results
are collected on it, and a key stays pending until every job about it is collected."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine.residency.copy_worker import CopyJob, CopyWorker

ROOM = 60.0  # seconds a job may take on a loaded machine: an outcome is awaited, never timed


@pytest.fixture
def worker() -> Iterator[CopyWorker]:
    w = CopyWorker("test-copies")
    yield w
    w.running.set()
    w.close()


def gated_job(key: str, gate: threading.Event, done: list[tuple[str, bool]], tag: str) -> CopyJob:
    def run() -> bool:
        assert gate.wait(ROOM), "the test never opened the gate"
        return True
    return CopyJob(key, run, lambda ok: done.append((tag, ok)))


def test_a_key_stays_pending_until_its_last_job_is_collected(worker: CopyWorker) -> None:
    """Two jobs about one state in flight (a staged copy, then a write ahead): the first collected
    must not make the key look free while the second still reads its memory."""
    first_gate, second_gate = threading.Event(), threading.Event()
    done: list[tuple[str, bool]] = []
    worker.submit(gated_job("a", first_gate, done, "first"))
    worker.submit(gated_job("a", second_gate, done, "second"))
    assert worker.pending("a") and not worker.pending("b")
    first_gate.set()
    while not done:
        worker.collect(wait=False)
        threading.Event().wait(0.01)
    assert done == [("first", True)]
    assert worker.pending("a")  # the second job still runs
    second_gate.set()
    worker.wait_for("a")
    assert done == [("first", True), ("second", True)] and not worker.pending("a")
    assert worker.in_flight == 0 and worker.completed == 2


def test_wait_for_waits_for_that_key_and_counts_only_real_waits(worker: CopyWorker) -> None:
    gate = threading.Event()
    done: list[tuple[str, bool]] = []
    worker.wait_for("nothing")
    assert worker.waits == 0
    worker.submit(gated_job("a", gate, done, "a"))
    threading.Timer(0.2, gate.set).start()
    worker.wait_for("a")
    assert done == [("a", True)] and worker.waits == 1


def test_a_job_that_raises_reports_not_copied_and_the_worker_goes_on(worker: CopyWorker) -> None:
    done: list[tuple[str, bool]] = []

    def broken() -> bool:
        raise RuntimeError("the store went away")
    worker.submit(CopyJob("bad", broken, lambda ok: done.append(("bad", ok))))
    worker.submit(CopyJob("good", lambda: True, lambda ok: done.append(("good", ok))))
    worker.wait_for("good")
    assert done == [("bad", False), ("good", True)]
    assert worker.failures == 1 and not worker.pending("bad")
