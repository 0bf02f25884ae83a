"""A linear layer at a decode step's row counts: kernels/cpu/linear_rows.c via ctypes.

With bf16 weights a call means what oneDNN's bf16 inner product means (engine.weight_dtype=bfloat16):
rows rounded to bf16, fp32 sums, outputs rounded to bf16 (biases are kept as given: the caller rounds
them as oneDNN's packing does).

engine/model/cpu_linear.py runs it for calls of at most `max_rows` rows when its load-time
measurement finds it faster than oneDNN on the CPU at hand. It reads nn.Linear's own [out, in]
weights (fp32, or a bf16 copy), several weights reading the same rows (a fused q|k|v) in one
call. Its oracle is `reference`, F.linear in float64 (tests/test_cpu_linear_rows.py).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.cpu.library import LIBRARY, bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64]
SEGMENTS_MAX = 8  # linear_rows.c's
WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True, slots=True)
class RowWeights:
    """Weights [out_s, in] that read the same rows, with the C arrays naming them made once
    (a decode step calls each linear once per layer: no per-call marshalling)."""

    tensors: tuple[torch.Tensor, ...]  # kept alive: C reads their memory
    biases: tuple[torch.Tensor | None, ...]
    in_features: int
    out_features: int
    dtype: torch.dtype
    c_weights: Any
    c_outs: Any
    c_biases: Any

    @classmethod
    def of(cls, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> RowWeights:
        if not 1 <= len(weights) <= SEGMENTS_MAX or len(biases) != len(weights):
            raise ValueError(f"1-{SEGMENTS_MAX} weights with a bias (or None) each, got {len(weights)}")
        dtypes = {w.dtype for w in weights}
        if len(dtypes) != 1 or not dtypes <= WEIGHT_CODES.keys():
            raise ValueError(f"weights must all be float32 or all bfloat16, got {sorted(map(str, dtypes))}")
        if any(w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu" for w in weights) \
                or len({w.shape[1] for w in weights}) != 1:
            raise ValueError("weights must be contiguous CPU [out, in] tensors of one `in`")
        if any(b is not None and (b.shape != (w.shape[0],) or b.dtype != torch.float32 or not b.is_contiguous())
               for w, b in zip(weights, biases)):
            raise ValueError("a bias must be a contiguous float32 [out] tensor")
        n = len(weights)
        return cls(tuple(weights), tuple(biases), weights[0].shape[1], sum(w.shape[0] for w in weights),
                   weights[0].dtype, (_ptr * n)(*(w.data_ptr() for w in weights)),
                   (_i64 * n)(*(w.shape[0] for w in weights)),
                   (_ptr * n)(*(None if b is None else b.data_ptr() for b in biases)))


LinearRows = Callable[[torch.Tensor, RowWeights], torch.Tensor]


def load(path: Path = LIBRARY) -> LinearRows | None:
    """The kernel bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "linear_rows", _ARGTYPES, "linears run on oneDNN at every row count")
    return None if fn is None else functools.partial(_run, fn)


def _run(fn: Callable[..., int], x: torch.Tensor, weights: RowWeights) -> torch.Tensor:
    """x [..., in] fp32 -> [..., out] fp32, the segments' outputs side by side."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != weights.in_features:
        raise ValueError(f"linear_rows takes fp32 CPU rows of {weights.in_features}, got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, weights.in_features)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < weights.in_features):  # expanded rows
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], weights.out_features, dtype=torch.float32)
    if fn(rows.data_ptr(), rows.shape[0], rows.stride(0), weights.in_features, len(weights.tensors),
          weights.c_weights, weights.c_outs, weights.c_biases, WEIGHT_CODES[weights.dtype],
          y.data_ptr(), y.stride(0)) != 0:
        raise RuntimeError(f"linear_rows refused rows {tuple(rows.shape)} (or had no memory for them)")
    return y.view(*x.shape[:-1], weights.out_features)


def reference(x: torch.Tensor, weights: RowWeights) -> torch.Tensor:
    """The oracle: each segment's F.linear in float64, side by side, as fp32 (bf16 weights: the rows
    rounded to bf16 before, the outputs after)."""
    bf16 = weights.dtype == torch.bfloat16
    rows = x.to(torch.bfloat16).double() if bf16 else x.double()
    outs = [torch.nn.functional.linear(rows, w.double(), None if b is None else b.double())
            for w, b in zip(weights.tensors, weights.biases)]
    y = torch.cat(outs, dim=-1).float()
    return y.to(torch.bfloat16).float() if bf16 else y
