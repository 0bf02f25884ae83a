"""How the Triton kernels are tested without a GPU, shared by their test files.

- In the interpreter: a test file's `interpret` cases run in a child pytest that imports Triton under
  TRITON_INTERPRET=1 (`run_interpreted_child`); the `target` fixture gives each case its device and
  kernels (the interpreter on the CPU in the child, CUDA where a GPU is).
- Compiled for the GPU without one: a stand-in driver names sm_90 and each launch only compiles (never
  runs). Catches what the interpreter lets through (typing, rebinding, globals) and tiles over the
  shared-memory limit. The compiling runs in a child process (the driver and JITFunction.run are
  patched for good there), which `compiled_in_a_child` starts and reads back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kernels.select import Kernels, triton_kernels

ROOT = Path(__file__).resolve().parents[1]
HOPPER_SHARED_BYTES = 232448  # the most shared memory one block may use on H100/H200 (227 KiB)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # this process is the child (or a manual run)


@dataclass(frozen=True)
class Target:
    device: torch.device
    ops: Kernels


TARGETS = ([pytest.param("cpu", id="interpret")] if INTERPRETED
           else [pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)])


@pytest.fixture(scope="module", params=TARGETS)
def target(request: pytest.FixtureRequest) -> Target:
    pytest.importorskip("triton")
    return Target(torch.device(request.param), triton_kernels())


def run_interpreted_child(test_file: str) -> None:
    """`test_file`'s `interpret` cases in a child pytest under TRITON_INTERPRET=1; asserts they passed."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
                           str(Path(test_file).resolve().relative_to(ROOT))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert " passed" in done.stdout, done.stdout[-2000:]
    print(f"interpreted Triton cases: {took:.1f} s\n{done.stdout.splitlines()[-1]}")


def compile_only_for_hopper(*modules: ModuleType) -> dict[str, int]:
    """From now on in this process, a Triton launch compiles for sm_90 and records the kernel's shared
    memory (bytes) in the dict returned, by `<kernel name>/<launch number>`; each of `modules` takes the
    GPU's tiles and dots (its `interpreting` says False)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class HopperCompiler:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    driver.set_active(HopperCompiler())
    compiled: dict[str, int] = {}
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]  # JITFunction.run
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled[f"{self.fn.__name__}/{len(compiled)}"] = kernel.metadata.shared
        return kernel

    JITFunction.run = compile_only
    for module in modules:
        setattr(module, "interpreting", lambda device: False)
    return compiled


def compiled_in_a_child(test_module: str) -> dict[str, int]:
    """`tests/<test_module>.py`'s `compile_for_hopper()` run in a process of its own (not interpreted):
    each compiled kernel's shared memory. Asserts the child succeeded and nothing is over the limit."""
    code = (f"import json, sys\nsys.path.insert(0, 'tests')\nimport {test_module} as t\n"
            "print(json.dumps(t.compile_for_hopper()))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(ROOT / ".cache" / "triton-sm90")  # git-ignored; reruns skip the compiler
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    shared: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    too_big = {name: size for name, size in shared.items() if size > HOPPER_SHARED_BYTES}
    assert not too_big, f"over the {HOPPER_SHARED_BYTES} bytes of shared memory a block may use: {too_big}"
    return shared
