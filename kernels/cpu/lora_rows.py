"""The batched multi-adapter LoRA product on the CPU: kernels/cpu/lora_rows.c via ctypes.

Behind kernels/lora.py's signature (lora_delta_reference is its oracle, tests/test_cpu_lora_rows.py):
each row through its own slot's adapter, each used slot's A and B read once per call, where
engine/lora/sites.py's torch path multiplies every row by all the step's slots and masks. C takes
fp32 CPU operands as they lie, never copied (a site holds every slot's weights): x with unit column
stride (any row stride), a [S, R, in] contiguous, and b [out, S, R] as the view `bt.permute(2, 0, 1)`
of a contiguous bt [S, R, out] (each slot's B rows contiguous over `out`: the expand is an axpy over
them). Anything else returns None and the caller runs its torch path. A slot outside [-1, S) is a
ValueError, raised before anything is read through it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable

import torch

from kernels import lora
from kernels.cpu.library import LIBRARY, bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64]

LoraDelta = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


def load(path: Path = LIBRARY) -> LoraDelta | None:
    """The kernel bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "lora_rows", _ARGTYPES, "the LoRA product runs in torch")
    return None if fn is None else functools.partial(_run, fn)


def _takes(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> bool:
    # Property reads, no views: at T=1 a call's C work is a few microseconds.
    if not (x.dtype == a.dtype == b.dtype == torch.float32 and slots.dtype == torch.int64
            and x.is_cpu and a.is_cpu and b.is_cpu and slots.is_cpu):
        return False
    (n_out, num_slots, rank), (s_out, s_slot, s_rank) = b.shape, b.stride()
    # b [out, S, R] over a contiguous bt [S, R, out] (b.permute(1, 2, 0).is_contiguous()); a size-1
    # dimension's stride is free, as C never steps along it.
    over_bt = ((n_out == 1 or s_out == 1) and (rank == 1 or s_rank == n_out)
               and (num_slots == 1 or s_slot == rank * n_out))
    return over_bt and x.stride(1) == 1 and a.is_contiguous() and slots.is_contiguous()


def _run(fn: Callable[..., int], x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         slots: torch.Tensor) -> torch.Tensor | None:
    """x [T, in] through each row's adapter (a [S, R, in], b [out, S, R], slots [T], -1 = none) ->
    a new contiguous fp32 delta [T, out], or None where C does not take the operands."""
    lora.check_operands(x, a, b, slots)
    if not _takes(x, a, b, slots):
        return None
    (rows, hidden), (num_slots, rank), n_out = x.shape, a.shape[:2], b.shape[0]
    y = torch.empty(rows, n_out, dtype=torch.float32)
    if rows == 0:
        return y
    status = fn(x.data_ptr(), rows, x.stride(0), hidden, slots.data_ptr(), num_slots, a.data_ptr(), b.data_ptr(),
                rank, n_out, y.data_ptr(), y.stride(0))
    if status == -2:
        bad = slots[(slots < -1) | (slots >= num_slots)]
        raise ValueError(f"slots must be in [-1, {num_slots}) (-1: no adapter), got {bad[:8].tolist()}")
    if status == -3:  # no memory for the [T, R] scratch: the torch path may still fit
        return None
    if status != 0:
        raise RuntimeError(f"lora_rows refused x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} "
                           f"(status {status}): this is a bug")
    return y
