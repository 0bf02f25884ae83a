"""RMSNorm on the CPU: kernels/cpu/rms_norm.c via ctypes, both of the models' forms.

Behind engine/model/layers.py's RMSNorm, whose torch forms are its oracle
(tests/test_cpu_rms_norm.py): one C call where the zero-centered form (Qwen3.5/Next) runs about
a dozen small ops and F.rms_norm a handful, ~40 norms in every decode step. fp32 rows whose last
dim is contiguous (a plain tensor, or heads viewed inside a fused projection's output) go to C;
anything else returns None and the caller runs the torch form.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.cpu.library import LIBRARY, bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, ctypes.c_float, _i64, _ptr]

RmsNorm = Callable[[torch.Tensor, torch.Tensor, float, bool], "torch.Tensor | None"]


def load(path: Path = LIBRARY) -> RmsNorm | None:
    """The norm bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "rms_norm_rows", _ARGTYPES, "RMSNorm runs in torch")
    return None if fn is None else functools.partial(_run, fn)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(outer, outer stride, inner, inner stride) addressing x's rows, or None."""
    if x.stride(-1) != 1 or x.dim() > 3 or x.dim() < 1:
        return None
    if x.dim() == 1:
        return 1, 0, 1, 0
    if x.dim() == 2:
        return x.shape[0], x.stride(0), 1, 0
    return x.shape[0], x.stride(0), x.shape[1], x.stride(1)


def _run(fn: Callable[..., int], x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
         ) -> torch.Tensor | None:
    """x: [..., D] fp32 on the CPU, weight [D] -> a new contiguous tensor of x's shape, or None
    where the C kernel does not take x (the caller runs the reference)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" \
            or weight.shape != x.shape[-1:] or not weight.is_contiguous():
        return None
    rows = _rows(x)
    if rows is None:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    if fn(x.data_ptr(), *rows, x.shape[-1], weight.data_ptr(), eps, int(zero_centered), out.data_ptr()) != 0:
        raise RuntimeError(f"rms_norm_rows refused shape {tuple(x.shape)}: this is a bug")
    return out
