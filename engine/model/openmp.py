"""Keeping the step thread's OpenMP fast: work that uses torch's CPU parallelism before serving
(loading a model, building the engine core) runs on a thread that ends with it.

libgomp keeps an OpenMP team for each thread that ran a parallel region, and once the threads of
its teams outnumber the CPUs it stops spin-waiting between regions ("throttled" spinning): every
parallel region of the step thread's forward pass then pays thread wake-ups. A model loaded on the
main thread (or on a pooled thread that lives on) and stepped on the engine's step thread is that
case: on 2 CPUs a batch-1 decode step of the bench model took 4.5-6 ms instead of 1.6-1.8 ms, and a
served one 8.2 ms instead of 2.1-3.2 (bench/overhead.py measures the core as served; the figures
are in docs/architecture.md). A thread that ends frees its team.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], name: str = "ignis-engine-load") -> T:
    """fn() on a fresh thread, waited for; its exception is raised here."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # raised again in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
