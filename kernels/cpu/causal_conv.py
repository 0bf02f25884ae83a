"""The GDN layers' depthwise causal conv over a prefill chunk on the CPU: kernels/cpu/causal_conv.c.

Behind the signature of kernels/causal_conv.py's causal_conv1d, its oracle. For a prefill
chunk that reference calls F.conv1d with groups=C, which oneDNN runs as a depthwise
convolution far from the memory's pace: 197 ms a call for 2048 tokens x 4096 channels
(hidden 1024), a third of a hybrid model's whole prefill in bench.profile. The C kernel reads
the chunk once, time-major as the projections produced it, and fuses the SiLU. A decode step
(T = 1), a chunk shorter than the taps, or other dtypes run the reference. Results differ from
F.conv1d's by summation order only (fp32 rounding).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.cpu.library import LIBRARY, bind
from kernels.causal_conv import causal_conv1d as reference


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr]

CausalConv = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def load(path: Path = LIBRARY) -> CausalConv | None:
    """The conv bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "causal_conv_prefill", _ARGTYPES, "the GDN prefill conv runs the torch reference")
    return None if fn is None else functools.partial(_run, fn)


def _run(fn: Callable[..., int], x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, C, T] (a channels-last view is read as it lies); weight: [C, K]; state: [B, C, K-1]
    or None (zeros). Returns (silu(conv) [B, C, T] (a view of time-major rows), new_state [B, C, K-1])."""
    b, c, t = x.shape
    kernel = weight.shape[-1]
    if b != 1 or t < kernel - 1 or t == 1 or x.dtype != torch.float32 or x.device.type != "cpu" or kernel > 16:
        return reference(x, weight, state)
    rows = x[0].t()  # [T, C]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    taps_before = (torch.zeros(c, kernel - 1) if state is None else state[0].to(torch.float32)).contiguous()
    wt = weight.to(torch.float32).t().contiguous()  # [K, C]
    out = torch.empty(t, c, dtype=torch.float32)
    taps = torch.empty(c, kernel - 1, dtype=torch.float32)
    status = fn(rows.data_ptr(), rows.stride(0), wt.data_ptr(), taps_before.data_ptr(), t, c, kernel,
                out.data_ptr(), taps.data_ptr())
    if status != 0:
        raise RuntimeError(f"causal_conv_prefill refused T {t}, K {kernel}: this is a bug")
    return out.t().unsqueeze(0), taps.unsqueeze(0)
