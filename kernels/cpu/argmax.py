"""Greedy sampling's argmax on the CPU: kernels/cpu/argmax.c via ctypes.

Behind engine/sampling/sampler.py's greedy pick, with torch.argmax as its oracle
(tests/test_cpu_argmax.py): torch's CPU argmax is a scalar loop, ~10x its vectorised amax, and a
decode step runs it over every greedy row's logits. 2-D fp32 CPU tensors with contiguous rows go
to C; anything else returns None and the caller runs torch.argmax. The capped form reads a plain
greedy batch's raw logits as sampling would have processed them, so such a batch needs no copy.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.cpu.library import LIBRARY, bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, _ptr]
_CAPPED_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, ctypes.c_float, _ptr]

ArgmaxRows = Callable[[torch.Tensor], "torch.Tensor | None"]
# (raw logits, ceiling) -> the argmax of each row with NaN as -inf and values above ceiling as ceiling
CappedArgmaxRows = Callable[[torch.Tensor, float], "torch.Tensor | None"]


def load(path: Path = LIBRARY) -> ArgmaxRows | None:
    """The argmax bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "argmax_rows", _ARGTYPES, "greedy sampling runs torch.argmax")
    return None if fn is None else functools.partial(_run, fn)


def load_capped(path: Path = LIBRARY) -> CappedArgmaxRows | None:
    """The capped argmax (argmax_rows_capped) bound to the library at `path`, or None (logged)."""
    fn = bind(path, "argmax_rows_capped", _CAPPED_ARGTYPES, "greedy sampling processes a copy of the logits")
    return None if fn is None else functools.partial(_run, fn)


def _run(fn: Callable[..., int], x: torch.Tensor, *args: float) -> torch.Tensor | None:
    """x: [B, V] fp32 on the CPU -> int64 [B], each row's argmax (lowest index among equals) as `fn`
    reads it (`args` go between the shape and the output: the capped form's ceiling), or None where
    the C kernels do not take x."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0 \
            or x.stride(1) != 1:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), *args, out.data_ptr()) != 0:
        raise RuntimeError(f"{fn.__name__} refused shape {tuple(x.shape)}: this is a bug")
    return out
