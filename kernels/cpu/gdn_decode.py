"""The fused Gated DeltaNet decode step on the CPU: kernels/cpu/gdn_decode.c via ctypes.

One call per layer does what the torch references do in a chain of small ops, from the input
projections to the output projection's input: the gates, the causal conv over each sequence's
carried taps (kernels/causal_conv.py), the head split and q/k normalisation, the gated delta
rule (kernels/gated_delta.py: gated_delta_decode_step_), each sequence's conv taps and
recurrent state updated in place in its slot, and the gated RMSNorm of the output. A sequence may
bring several tokens (`tokens`), stepped in order inside the call. Those references and the layer's
own gates and norm are its oracle (tests/test_cpu_gdn_decode.py). kernels/select.py's `cpu_kernels` loads it into
the CPU's kernel table; `load()` returns None, logging why, when the library `make kernels`
builds is not there, and the references run.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.cpu.library import LIBRARY, bind

MAX_HEAD_DIM = 256  # the C kernel's per-thread buffers

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_float, _ptr,
                        _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]

FusedDecode = Callable[..., torch.Tensor]


def load(path: Path = LIBRARY) -> FusedDecode | None:
    """The fused step bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "gdn_decode_layer", _ARGTYPES, "GDN decode runs the torch references")
    return None if fn is None else functools.partial(_run, fn)


def supports(conv_pool: torch.Tensor, state_pool: torch.Tensor, dk: int, dv: int) -> bool:
    """Whether the C kernel takes these pools (fp32, on the CPU, inner dims contiguous)."""
    taps = conv_pool.shape[-1]
    return (conv_pool.device.type == "cpu" and conv_pool.dtype == torch.float32 and state_pool.dtype == torch.float32
            and dk <= MAX_HEAD_DIM and dv <= MAX_HEAD_DIM
            and conv_pool.stride(-1) == 1 and conv_pool.stride(-2) == taps
            and state_pool.stride(-1) == 1 and state_pool.stride(-2) == dv and state_pool.stride(-3) == dk * dv)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    # A check in Python is cheaper than the two no-op torch calls a decode step would make ~100 times.
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


def _run(fn: Callable[..., int], x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
         a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
         conv_pool: torch.Tensor, state_pool: torch.Tensor, layer: int, slots: list[int],
         hk: int, dk: int, dv: int, out: torch.Tensor | None = None, tokens: list[int] | None = None
         ) -> torch.Tensor:
    """x: [R, C] mixed q|k|v rows; a, b: [R, Hv] the gates' projections; z: [R, Hv, Dv] (or [R, Hv*Dv]);
    a_log, dt_bias: [Hv]; norm_weight: [Dv]; weight: [C, K]; conv_pool: [slots, L, C, K-1];
    state_pool: [slots, L, Hv, Dk, Dv]; `layer`: this layer's index in the pools; `slots`: each
    sequence's slot; `tokens`: each sequence's number of rows, one after another in order (None: one
    row each). Updates the pools in place; returns the gated RMSNorm of the delta rule's
    output, [R, Hv * Dv] fp32: the output projection's input (written into `out` if given: a
    contiguous fp32 [R, Hv * Dv])."""
    rows, channels = x.shape
    batch = len(slots)
    hv = a.shape[1]
    kernel = weight.shape[1]
    assert channels == 2 * hk * dk + hv * dv and weight.shape[0] == channels, (x.shape, weight.shape)
    assert conv_pool.shape[-2:] == (channels, kernel - 1) and state_pool.shape[-3:] == (hv, dk, dv)
    assert b.shape == (rows, hv) and z.numel() == rows * hv * dv and norm_weight.shape == (dv,)
    runs = None
    if tokens is not None:
        assert len(tokens) == batch and sum(tokens) == rows and min(tokens, default=1) >= 1, (tokens, rows)
        runs = (ctypes.c_int64 * (batch + 1))(0, *itertools.accumulate(tokens))
    else:
        assert rows == batch, (rows, batch)
    x, a, b, z, a_log, dt_bias, norm_weight, weight = (
        _fp32(t) for t in (x, a, b, z, a_log, dt_bias, norm_weight, weight))
    slot_ids = (ctypes.c_int64 * batch)(*slots)
    y = torch.empty(rows, channels, dtype=torch.float32)
    if out is None:
        out = torch.empty(rows, hv * dv, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == (rows, hv * dv)
    status = fn(x.data_ptr(), a.data_ptr(), b.data_ptr(), a_log.data_ptr(), dt_bias.data_ptr(), z.data_ptr(),
                norm_weight.data_ptr(), eps, weight.data_ptr(),
                conv_pool.data_ptr(), conv_pool.stride(0), layer * conv_pool.stride(1),
                state_pool.data_ptr(), state_pool.stride(0), layer * state_pool.stride(1),
                ctypes.addressof(slot_ids), batch, hk, hv, dk, dv, kernel, y.data_ptr(), out.data_ptr(),
                None if runs is None else ctypes.addressof(runs))
    if status != 0:
        raise RuntimeError(f"gdn_decode_layer refused Hk {hk}, Hv {hv}, Dk {dk}, Dv {dv}: this is a bug")
    return out
