"""engine/cpu_host.py: what the engine logs and bench.profile reports about the CPU it ran on."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine import cpu_host


def test_describe_reads_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    torch.ones(1 << 16).sum()  # a parallel region: torch's OpenMP runtime is mapped
    host = cpu_host.describe()
    assert host.logical_cpus >= 1 and host.allowed_cpus and host.torch_threads == torch.get_num_threads()
    assert set(host.isa) <= set(cpu_host.ISA_FLAGS)
    assert ("ONEDNN_MAX_CPU_ISA", "AVX2") in host.environment
    summary = host.summary()
    assert host.part in summary and "ONEDNN_MAX_CPU_ISA=AVX2" in summary and f"{host.torch_threads} torch threads" in summary
    if Path("/proc/cpuinfo").is_file():
        assert host.vendor != "unknown" and host.model_name != "unknown"
        assert "gomp" in host.openmp_runtime or "omp" in host.openmp_runtime


def test_thread_placement_names_this_thread() -> None:
    seen: list[tuple[cpu_host.ThreadPlace, ...]] = []
    worker = threading.Thread(target=lambda: seen.append(cpu_host.thread_placement()), name="placement-probe")
    worker.start()
    worker.join()
    if not Path("/proc/self/task").is_dir():
        pytest.skip("no /proc")
    [places] = seen
    assert threading.get_native_id() in {p.tid for p in places}
    assert worker.native_id in {p.tid for p in places}
    assert all(0 <= p.cpu < 4096 for p in places)


@pytest.mark.parametrize("cpus, text", [((), "none"), ((3,), "3"), ((0, 1, 2, 5), "0-2,5"),
                                        ((0, 2, 4), "0,2,4"), ((7, 8, 9, 10), "7-10")])
def test_cpu_ranges(cpus: tuple[int, ...], text: str) -> None:
    assert cpu_host._ranges(cpus) == text
