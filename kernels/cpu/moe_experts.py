"""An MoE layer's routed experts on the CPU: kernels/cpu/moe_experts.c via ctypes, for decode steps.

Behind engine/model/layers.py's Experts, whose oracle is kernels/moe_gemm.py's moe_experts_reference
(tests/test_cpu_moe_experts.py). torch's CPU _grouped_mm (Experts.grouped) runs a matmul and a host
read for each of the E experts every call; this reads only the experts a step's tokens hit, each
expert's weights once, like llama.cpp's mul_mat_id. fp32 x (rows contiguous, any row stride) over
contiguous fp32 expert weights goes to C; anything else returns None and the caller runs its torch
path. An expert id outside [0, E) is refused (ValueError) before any weight is read.

Measured against Experts.grouped (E=128, K=8, fp32; milliseconds per call, medians of 5-7 rounds,
the two paths interleaved, the routing cycled over 8 draws as successive layers hit other experts)
on this project's 2-core AVX-512 EPYC *while loaded* (two test runs, load average 8-9 on 2 cores):

    T     H=1024, I=128 (C / grouped)         H=2048, I=768 (C / grouped)
          1 thread         2 threads          1 thread          2 threads
    1     0.54 / 1.15      12.0 / 52.0        4.7 / 9.5         14.0 / 64.5
    2     1.08 / 2.02      12.0 / 72.0        9.4 / 16.5        16.4 / 100
    4     2.04 / 3.95      13.0 / 173         18.3 / 31.5       28.4 / 209
    8     3.97 / 6.26      9.3 / 32.5         34.6 / 62.2       49.0 / 262
    16    7.22 / 10.8      12.3 / 1188        58.2 / 110        72.6 / 821
    32    11.8 / 16.3      18.0 / 104         94.0 / 182        105 / 1902
    64    19.2 / 23.5      24.0 / 114         147 / 242         172 / 991
    128   -                -                  289 / 377         245 / 963
    512   65.9 / 55.0      75.7 / 1850        565 / 599         616 / 1417

With 2 threads on the loaded cores every OpenMP barrier waits out a scheduler slice (the C kernel's
~12 ms floor): a call with fewer parallel regions wins, and grouped() runs several per expert, so
those columns overstate the gap. One thread shows the arithmetic: the C kernel wins ~2x at decode
(it streams 8 experts' weights, grouped() pays a matmul and a host read for all 128) and still at 64
tokens (most experts hit, each read once for its few tokens); at 512 tokens grouped()'s GEMMs, which
reuse each expert's weights over many tokens, win (0.83x at H=1024). Hence engine/model/layers.py's
CPU_KERNEL_MAX_PAIRS = 512 (64 tokens at top-8). 1 thread at T=1, H=2048: 151 MB of weights in
4.7 ms, ~32 GB/s.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from kernels import moe_gemm
from kernels.cpu.library import LIBRARY, bind

if TYPE_CHECKING:
    from kernels.select import MoeExperts

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr]

def load(path: Path = LIBRARY) -> MoeExperts | None:
    """The experts bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "moe_experts_rows", _ARGTYPES, "the MoE experts run torch's grouped GEMM")
    return None if fn is None else functools.partial(_run, fn)


def _takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    # The weights are never copied (a layer's experts are ~1 GB): they must already be what C reads.
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1
            and gate_up.dtype == torch.float32 and down.dtype == torch.float32
            and gate_up.device.type == "cpu" and down.device.type == "cpu"
            and gate_up.is_contiguous() and down.is_contiguous())


def _run(fn: Callable[..., int], x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
         expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """x [T, H] through experts gate_up [E, 2I, H] and down [E, H, I] picked by expert_ids [T, K],
    weighted by weights [T, K] -> a new contiguous fp32 [T, H], or None where the C kernel does not
    take the operands (the caller runs its torch path)."""
    if not _takes(x, gate_up, down):
        return None
    moe_gemm.check_operands(x, gate_up, down, expert_ids, weights)
    (tokens, hidden), (experts, inter), top_k = x.shape, (down.shape[0], down.shape[2]), expert_ids.shape[1]
    # [T, K] each: no copy when already int64 / fp32 and contiguous, as the router makes them.
    ids = expert_ids.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    y = torch.empty(tokens, hidden, dtype=torch.float32)
    status = fn(x.data_ptr(), tokens, x.stride(0), hidden, gate_up.data_ptr(), down.data_ptr(), experts, inter,
                ids.data_ptr(), w.data_ptr(), top_k, y.data_ptr())
    if status == -2:
        raise ValueError(f"expert_ids must lie in [0, {experts}), got {ids.min().item()}..{ids.max().item()}")
    if status == -3:
        raise MemoryError(f"moe_experts_rows could not allocate its scratch for {tokens * top_k} pairs")
    if status != 0:
        raise RuntimeError(f"moe_experts_rows refused T {tokens}, H {hidden}, E {experts}, I {inter}, "
                           f"K {top_k}: this is a bug")
    return y
