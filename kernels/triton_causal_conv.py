"""Depthwise causal conv with carried taps in Triton, behind kernels/causal_conv.py's signature.

One program per (sequence, channel block, time block): out[c, t] = silu(sum_j w[c, j] x~[c, t + j])
over x~ = [state | x] (the K-1 taps carried in, then the new inputs), read in place from both;
the time-block-0 programs also write the new taps (the last K-1 of x~). Accumulates in fp32.
The output is laid out [B, T, C] in memory and returned as its [B, C, T] view, so the caller's
transpose back to [B, T, C] (GDN layers split q/k/v along C) costs nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.causal_conv import causal_conv1d as reference_causal_conv1d
from kernels.triton_support import LAUNCH, check_same_device, interpreting, on_its_device


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, new_state_ptr,
    sx_b, sx_c, sx_t, sw_c, sw_k, ss_b, ss_c, ss_k, so_b, so_c, so_t, sn_b, sn_c, sn_k,
    channels, t_len,
    KERNEL: tl.constexpr, TAPS: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    c_ok = c < channels
    t_ok = t < t_len
    acc = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    for j in tl.static_range(KERNEL):
        w = tl.load(w_ptr + c * sw_c + j * sw_k, mask=c_ok, other=0.0).to(tl.float32)
        src = t + j - (KERNEL - 1)  # index into x; negative: a carried tap
        from_x = src >= 0
        xv = tl.load(x_ptr + b * sx_b + c[:, None] * sx_c + src[None, :] * sx_t,
                     mask=c_ok[:, None] & (t_ok & from_x)[None, :], other=0.0).to(tl.float32)
        if HAS_STATE:
            tap = src + (KERNEL - 1)
            sv = tl.load(state_ptr + b * ss_b + c[:, None] * ss_c + tap[None, :] * ss_k,
                         mask=c_ok[:, None] & (t_ok & (src < 0))[None, :], other=0.0).to(tl.float32)
            xv = xv + sv
        acc += w[:, None] * xv
    out = acc * tl.sigmoid(acc)  # silu
    tl.store(out_ptr + b * so_b + c[:, None] * so_c + t[None, :] * so_t, out.to(out_ptr.dtype.element_ty),
             mask=c_ok[:, None] & t_ok[None, :])
    if tl.program_id(2) == 0:
        # new taps: x~[T .. T+K-2], i.e. x[T-K+1+j] or, while that is negative, state[T+j]
        taps = tl.arange(0, TAPS)
        tap_ok = taps < KERNEL - 1
        tap_src = t_len + taps - (KERNEL - 1)
        tap_from_x = tap_src >= 0
        tap_x = tl.load(x_ptr + b * sx_b + c[:, None] * sx_c + tap_src[None, :] * sx_t,
                        mask=c_ok[:, None] & (tap_ok & tap_from_x)[None, :], other=0.0)
        if HAS_STATE:
            tap_s = tl.load(state_ptr + b * ss_b + c[:, None] * ss_c + (t_len + taps)[None, :] * ss_k,
                            mask=c_ok[:, None] & (tap_ok & (tap_src < 0))[None, :], other=0.0)
            tap_x = tl.where(tap_from_x[None, :], tap_x, tap_s.to(tap_x.dtype))
        tl.store(new_state_ptr + b * sn_b + c[:, None] * sn_c + taps[None, :] * sn_k,
                 tap_x.to(new_state_ptr.dtype.element_ty), mask=c_ok[:, None] & tap_ok[None, :])


@on_its_device
def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a depthwise causal conv over new inputs, continuing from `state`.

    x: [B, C, T] new inputs (any strides); weight: [C, K]; state: [B, C, K-1] (the last K-1
    inputs seen before x) or None for a fresh sequence (zeros).
    Returns (silu(conv) [B, C, T] in x's dtype, new_state [B, C, K-1] in x's dtype).
    """
    b, c, t = x.shape
    kernel = weight.shape[-1]
    if weight.shape != (c, kernel):
        raise ValueError(f"weight must be [C={c}, K], got {tuple(weight.shape)}")
    if state is not None and state.shape != (b, c, kernel - 1):
        raise ValueError(f"state must be [{b}, {c}, {kernel - 1}], got {tuple(state.shape)}")
    if kernel < 2 or t == 0:  # no taps to carry (or nothing to run): the reference is exact and free
        return reference_causal_conv1d(x, weight, state)
    check_same_device(x=x, weight=weight, **({} if state is None else {"state": state}))
    out = torch.empty(b, t, c, dtype=x.dtype, device=x.device).transpose(1, 2)  # [B, C, T] over [B, T, C]
    new_state = torch.empty(b, c, kernel - 1, dtype=x.dtype, device=x.device)
    if interpreting(x.device):  # few, large tiles: the interpreter pays per program
        block_c, block_t = min(256, triton.next_power_of_2(c)), min(64, triton.next_power_of_2(t))
    else:
        block_c, block_t = 128, min(32, triton.next_power_of_2(t))
    grid = (b, triton.cdiv(c, block_c), triton.cdiv(t, block_t))
    s = state if state is not None else new_state  # a placeholder pointer when there is no state
    _conv_kernel[grid](
        x, weight, s, out, new_state,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1),
        s.stride(0), s.stride(1), s.stride(2), out.stride(0), out.stride(1), out.stride(2),
        new_state.stride(0), new_state.stride(1), new_state.stride(2),
        c, t,
        KERNEL=kernel, TAPS=triton.next_power_of_2(kernel - 1), HAS_STATE=state is not None,
        BLOCK_C=block_c, BLOCK_T=block_t,
        num_warps=4, **LAUNCH,
    )
    return out, new_state
