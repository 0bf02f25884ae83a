"""The C kernels' test fixture: the kernel from the library `make kernels` built, a skip where no
gcc could build it, and a failure where gcc is here but the library is not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from kernels.cpu.library import LIBRARY

KERNELS = LIBRARY.parent.parent  # kernels/cpu/

T = TypeVar("T")


def built_kernel(load: Callable[[], T | None]) -> T:
    fn = load()
    if fn is None:
        if shutil.which("gcc") is None:
            pytest.skip("no gcc: `make kernels` cannot build the CPU kernels (the engine runs the references)")
        pytest.fail(f"{LIBRARY} is not built: `make kernels` (make test builds it first)")
    return fn


def build_for(source: str, flags: list[str], folder: Path) -> Path:
    """`source` (a kernels/cpu/ file) built alone as `make kernels` builds it, with `flags` for another
    CPU (e.g. -march=x86-64-v3: an AVX2-only one); skips without gcc."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    out = folder / "libignis_cpu.so"
    built = subprocess.run(["gcc", "-O3", *flags, "-fopenmp", "-shared", "-fPIC", "-o", str(out),
                            str(KERNELS / source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    return out
