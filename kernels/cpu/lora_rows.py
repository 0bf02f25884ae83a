"""The batched multi-adapter LoRA product on the CPU: kernels/cpu/lora_rows.c via ctypes.

Behind kernels/lora.py's signature (lora_delta_reference is its oracle, tests/test_cpu_lora_rows.py):
each row through its own slot's adapter, each used slot's A and B read once per call, where
engine/lora/sites.py's torch path multiplies every row by all the step's slots and masks. C takes
fp32 CPU operands as they lie, never copied (a site holds every slot's weights): x with unit column
stride (any row stride), a [S, R, in] contiguous, and b [out, S, R] as the view `bt.permute(2, 0, 1)`
of a contiguous bt [S, R, out] (each slot's B rows contiguous over `out`: the expand is an axpy over
them). Anything else returns None and the caller runs its torch path. A slot outside [-1, S) is a
ValueError, raised before anything is read through it.

`load_add` binds lora_rows_add: several linears over the same rows (a FusedLinears group) in one call,
each delta added into its linear's output in place (engine/lora/sites.py's hooks); it also takes the
adapters' a and b in bfloat16 (lora.dtype=bfloat16), x and the outputs in fp32. The weights are
checked and their pointers packed once per group (`PreparedAdd`): a decode step makes ~64 such calls,
and checking every operand each time was ~30 us of Python a call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

import torch

from kernels import lora
from kernels.cpu.library import LIBRARY, bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64]

_ADD_ARGTYPES: list[Any] = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64]

_ADD_WEIGHTS = (torch.float32, torch.bfloat16)  # the adapters' dtypes lora_rows_add reads

LoraDelta = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


def load(path: Path = LIBRARY) -> LoraDelta | None:
    """The kernel bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "lora_rows", _ARGTYPES, "the LoRA product runs in torch")
    return None if fn is None else functools.partial(_run, fn)


def load_add(path: Path = LIBRARY) -> Callable[[Sequence[tuple[torch.Tensor, torch.Tensor]]], PreparedAdd | None] | None:
    """lora_rows_add bound to the library at `path`, as `prepare(sites)`: the call for those linears' weights
    (PreparedAdd), or None where C does not take them; None (logged) when the library cannot be loaded."""
    fn = bind(path, "lora_rows_add", _ADD_ARGTYPES, "the LoRA product runs one linear a call")
    return None if fn is None else functools.partial(PreparedAdd.prepare, fn)


class PreparedAdd:
    """lora_rows_add for fixed linears: each site's (a [S, R, in], b [out_i, S, R], as `_run` takes them, or
    both in bfloat16), checked and their pointers packed once (a hook calls it for every forward; a site's
    weights are written in place, so the views stay valid). A call adds each delta of the rows x [T, in]
    into its output outs[i] [T, out_i] (fp32, unit column stride) in place."""

    __slots__ = ("_fn", "_n", "_in", "_num_slots", "_rank", "_sizes", "_a", "_b", "_out_sizes", "_bf16")

    def __init__(self, fn: Callable[..., int], sites: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = self._n = len(sites)
        a0 = sites[0][0]
        self._fn, self._in, (self._num_slots, self._rank) = fn, a0.shape[2], a0.shape[:2]
        self._sizes = tuple(b.shape[0] for _, b in sites)
        self._a = (_ptr * n)(*(a.data_ptr() for a, _ in sites))
        self._b = (_ptr * n)(*(b.data_ptr() for _, b in sites))
        self._out_sizes = (_i64 * n)(*self._sizes)
        self._bf16 = int(a0.dtype == torch.bfloat16)

    @classmethod
    def prepare(cls, fn: Callable[..., int], sites: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> PreparedAdd | None:
        """The call for these sites, or None where C does not take them (one S, R, `in` and dtype for all)."""
        if not sites:
            return None
        a0 = sites[0][0]
        probe = torch.empty(0, a0.shape[2] if a0.ndim == 3 else 0)
        slots = torch.empty(0, dtype=torch.int64)
        for a, b in sites:
            lora.check_operands(probe, a, b, slots)
            if not (_takes(probe, a, b, slots, _ADD_WEIGHTS) and a.shape == a0.shape and a.dtype == a0.dtype):
                return None
        return cls(fn, sites)

    def __call__(self, x: torch.Tensor, outs: Sequence[torch.Tensor], slots: torch.Tensor) -> bool:
        """False, with nothing written, where C does not take x, an output or the slots."""
        rows = x.shape[0]
        if not (x.dtype == torch.float32 and x.is_cpu and x.ndim == 2 and x.shape[1] == self._in and x.stride(1) == 1
                and slots.dtype == torch.int64 and slots.is_cpu and slots.shape == (rows,) and slots.is_contiguous()
                and len(outs) == self._n):
            return False
        for out, size in zip(outs, self._sizes):
            if not (out.dtype == torch.float32 and out.is_cpu and out.shape == (rows, size) and out.stride(1) == 1
                    and out.stride(0) >= size):
                return False
        if rows == 0:
            return True
        n = self._n
        status = self._fn(x.data_ptr(), rows, x.stride(0), self._in, slots.data_ptr(), self._num_slots, self._rank, n,
                          self._a, self._b, self._out_sizes, (_ptr * n)(*(out.data_ptr() for out in outs)),
                          (_i64 * n)(*(out.stride(0) for out in outs)), self._bf16)
        if status == -2:
            bad = slots[(slots < -1) | (slots >= self._num_slots)]
            raise ValueError(f"slots must be in [-1, {self._num_slots}) (-1: no adapter), got {bad[:8].tolist()}")
        if status == -3:
            return False
        if status != 0:
            raise RuntimeError(f"lora_rows_add refused x {tuple(x.shape)} and {n} sites (status {status}): this is a bug")
        return True


def _takes(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
           weights: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether C reads these as they lie: x fp32, a and b of one dtype of `weights`."""
    # Property reads, no views: at T=1 a call's C work is a few microseconds.
    if not (x.dtype == torch.float32 and a.dtype == b.dtype and a.dtype in weights and slots.dtype == torch.int64
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
