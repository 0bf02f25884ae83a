"""The CPU this process runs on, as a decode step's speed depends on it: the part (vendor, model
name, family/model/stepping), the ISA extensions the linear paths choose by, the OpenMP runtime
torch and the C kernels share, and where its threads run.

The engine logs it at load and bench.profile puts it at the head of its report, so two reports
from different machines can be compared (a Zen 4 and a Zen 5 EPYC differ in what MKL and oneDNN
run, not only in bandwidth). Read from /proc (Linux); elsewhere the fields say "unknown".
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# The extensions a linear path or a C kernel is chosen by (cpuinfo's names).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
             "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8")
# Environment variables that change what the OpenMP runtime, oneDNN or MKL do.
RUNTIME_VARIABLES = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY",
                     "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                     "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE")
OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


@dataclass(frozen=True, slots=True)
class CpuHost:
    vendor: str
    model_name: str
    family: str
    model: str
    stepping: str
    isa: tuple[str, ...]  # the ISA_FLAGS this CPU has
    logical_cpus: int
    allowed_cpus: tuple[int, ...]  # this process's affinity mask
    hypervisor: bool
    torch_threads: int
    torch_capability: str  # ATen's vectorized-kernel level (DEFAULT, AVX2, AVX512)
    openmp_runtime: str  # the OpenMP library mapped into this process (one, or several: a problem)
    environment: tuple[tuple[str, str], ...]  # the RUNTIME_VARIABLES that are set

    @property
    def part(self) -> str:
        """'AMD EPYC (AuthenticAMD family 25 model 17 stepping 1)'."""
        return f"{self.model_name} ({self.vendor} family {self.family} model {self.model} stepping {self.stepping})"

    def summary(self) -> str:
        """One line for a log."""
        env = ", ".join(f"{k}={v}" for k, v in self.environment) or "none set"
        return (f"CPU {self.part}{', under a hypervisor' if self.hypervisor else ''}; ISA {' '.join(self.isa) or 'none'}; "
                f"{self.torch_threads} torch threads on CPUs {_ranges(self.allowed_cpus)} of {self.logical_cpus}; "
                f"ATen {self.torch_capability}; OpenMP {self.openmp_runtime}; runtime variables: {env}")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (every core of a socket reports the same part)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def openmp_runtime() -> str:
    """The OpenMP libraries mapped into this process, by path ('none' before torch's first parallel region
    on some builds; two of them: each keeps its own threads, which oversubscribe the cores)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    found = sorted({line.split()[-1] for line in maps.splitlines()
                    if any(name in line.rsplit("/", 1)[-1] for name in OPENMP_LIBRARIES)})
    return " + ".join(found) if found else "none mapped"


@dataclass(frozen=True, slots=True)
class ThreadPlace:
    tid: int
    name: str
    cpu: int  # the CPU it last ran on


def thread_placement() -> tuple[ThreadPlace, ...]:
    """This process's threads and the CPU each last ran on (/proc/self/task/*/stat, field 39): after a
    parallel region, where the OpenMP team's threads sit (two on one core: they share it)."""
    placement: list[ThreadPlace] = []
    tasks = Path("/proc/self/task")
    for task in sorted(tasks.iterdir(), key=lambda t: int(t.name)) if tasks.is_dir() else ():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 1:].split()  # fields from the 3rd (state) on
        if len(fields) > 36:
            placement.append(ThreadPlace(int(task.name), name, int(fields[36])))
    return tuple(placement)


def _ranges(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs) or "none"


def describe() -> CpuHost:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    try:
        allowed = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        allowed = tuple(range(os.cpu_count() or 1))
    return CpuHost(
        vendor=info.get("vendor_id", platform.processor() or "unknown"),
        model_name=info.get("model name", "unknown"), family=info.get("cpu family", "?"),
        model=info.get("model", "?"), stepping=info.get("stepping", "?"),
        isa=tuple(f for f in ISA_FLAGS if f in flags), logical_cpus=os.cpu_count() or 1, allowed_cpus=allowed,
        hypervisor="hypervisor" in flags, torch_threads=torch.get_num_threads(),
        torch_capability=torch.backends.cpu.get_cpu_capability(), openmp_runtime=openmp_runtime(),
        environment=tuple((k, os.environ[k]) for k in RUNTIME_VARIABLES if k in os.environ))
