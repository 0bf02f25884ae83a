"""engine/model/openmp.py: what loads a model before serving runs on a thread that ends with it, and
the caller gets its result or its exception."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.model.openmp import on_own_thread


def test_it_runs_on_a_thread_that_ends_and_returns_what_it_returned() -> None:
    seen: list[threading.Thread] = []

    def work() -> float:
        seen.append(threading.current_thread())
        return float(torch.ones(1 << 16).sum())  # a parallel region, as loading runs

    assert on_own_thread(work) == float(1 << 16)
    assert seen[0] is not threading.current_thread() and seen[0].name == "ignis-engine-load"
    assert not seen[0].is_alive()


def test_its_exception_is_raised_in_the_caller() -> None:
    def broken() -> None:
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        on_own_thread(broken)
