"""The C kernels' test fixture: the kernel from the library `make kernels` built, a skip where no
gcc could build it, and a failure where gcc is here but the library is not."""

from __future__ import annotations

import shutil
from typing import Callable, TypeVar

import pytest

from kernels.cpu.library import LIBRARY

T = TypeVar("T")


def built_kernel(load: Callable[[], T | None]) -> T:
    fn = load()
    if fn is None:
        if shutil.which("gcc") is None:
            pytest.skip("no gcc: `make kernels` cannot build the CPU kernels (the engine runs the references)")
        pytest.fail(f"{LIBRARY} is not built: `make kernels` (make test builds it first)")
    return fn
