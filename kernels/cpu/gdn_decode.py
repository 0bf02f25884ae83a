"""The fused Gated DeltaNet decode step on the CPU: kernels/cpu/gdn_decode.c via ctypes.

One call per layer does what the torch references do in a chain of small ops: the causal conv
over each sequence's carried taps (kernels/causal_conv.py), the head split and q/k
normalisation, and the gated delta rule (kernels/gated_delta.py: gated_delta_decode_step_),
each sequence's conv taps and recurrent state updated in place in its slot. Those references
are its oracle (tests/test_cpu_gdn_decode.py). kernels/select.py's `cpu_kernels` loads it into
the CPU's kernel table; `load()` returns None, logging why, when the library `make kernels`
builds is not there, and the references run.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.cpu.library import LIBRARY, bind

MAX_HEAD_DIM = 256  # the C kernel's per-thread buffers

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64,
                        _i64, _i64, _ptr, _ptr]

FusedDecode = Callable[..., torch.Tensor]


def load(path: Path = LIBRARY) -> FusedDecode | None:
    """The fused step bound to the library at `path`, or None (logged) when it cannot be loaded."""
    fn = bind(path, "gdn_decode_step", _ARGTYPES, "GDN decode runs the torch references")
    return None if fn is None else functools.partial(_run, fn)


def supports(conv_pool: torch.Tensor, state_pool: torch.Tensor, dk: int, dv: int) -> bool:
    """Whether the C kernel takes these pools (fp32, on the CPU, inner dims contiguous)."""
    taps = conv_pool.shape[-1]
    return (conv_pool.device.type == "cpu" and conv_pool.dtype == torch.float32 and state_pool.dtype == torch.float32
            and dk <= MAX_HEAD_DIM and dv <= MAX_HEAD_DIM
            and conv_pool.stride(-1) == 1 and conv_pool.stride(-2) == taps
            and state_pool.stride(-1) == 1 and state_pool.stride(-2) == dv and state_pool.stride(-3) == dk * dv)


def _run(fn: Callable[..., int], x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
         conv_pool: torch.Tensor, state_pool: torch.Tensor, layer: int, slots: list[int],
         hk: int, dk: int, dv: int) -> torch.Tensor:
    """x: [B, C] mixed q|k|v rows; g, beta: [B, Hv]; weight: [C, K]; conv_pool: [slots, L, C, K-1];
    state_pool: [slots, L, Hv, Dk, Dv]; `layer`: this layer's index in the pools; `slots`: each
    sequence's slot. Updates the pools in place; returns the delta rule's output [B, Hv, Dv] fp32."""
    batch, channels = x.shape
    hv = g.shape[1]
    kernel = weight.shape[1]
    assert channels == 2 * hk * dk + hv * dv and weight.shape[0] == channels, (x.shape, weight.shape)
    assert conv_pool.shape[-2:] == (channels, kernel - 1) and state_pool.shape[-3:] == (hv, dk, dv)
    x, g, beta, weight = (t.to(torch.float32).contiguous() for t in (x, g, beta, weight))
    slot_ids = torch.tensor(slots, dtype=torch.int64)
    y = torch.empty(batch, channels, dtype=torch.float32)
    out = torch.empty(batch, hv, dv, dtype=torch.float32)
    status = fn(x.data_ptr(), g.data_ptr(), beta.data_ptr(), weight.data_ptr(),
                conv_pool.data_ptr(), conv_pool.stride(0), layer * conv_pool.stride(1),
                state_pool.data_ptr(), state_pool.stride(0), layer * state_pool.stride(1),
                slot_ids.data_ptr(), batch, hk, hv, dk, dv, kernel, y.data_ptr(), out.data_ptr())
    if status != 0:
        raise RuntimeError(f"gdn_decode_step refused Hk {hk}, Hv {hv}, Dk {dk}, Dv {dv}: this is a bug")
    return out
