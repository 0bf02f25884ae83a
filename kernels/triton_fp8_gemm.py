"""The block-scaled FP8 linear in Triton, behind kernels/fp8_gemm.py's signature (weight-only:
that module's docstring says why the activations are not quantized).

One program per (BLOCK_M rows, BLOCK_N output columns) tile of y [M, N], computed as its transpose
W x.T so the converted weight tile is the dot's left operand. It walks K one scale
block (the checkpoint's `cols`) at a time: the block's fp8 weight tiles are loaded as they are
stored (one byte a weight), converted to the activations' dtype (exact for e4m3) and multiplied
with fp32 accumulation into a partial sum, which is then scaled by that block's scale_inv, one
per output column (its row block n // rows), and added to the accumulator. A K-block wider than
BLOCK_K takes several tiles; a partial block (the last one when `cols` does not divide K) and a
block size that is not a power of two are handled by masks, as are N and M: any M (1 at decode).

The weights are read as float8_e4m3fn: GPUs of compute capability 8.9+ convert them in hardware
(Triton refuses the type below; engine/model/fp8.py keeps FP8 weights only where it runs), and
Triton's interpreter loads them too. The interpreter decodes the two NaN codes (0x7F, 0xFF) as
+-480 where torch gives NaN; checkpoints hold no NaN weights (quantizing a finite value to e4m3fn
saturates at 448), so the tests use finite weights only.

Speed, measured on an H200 (torch 2.11, Triton 3.6, bf16 activations, blocks of 128), against torch's
bf16 F.linear on the same weights dequantized: at decode (M = 1 or 8) 0.037 ms against 0.041 for
N x K = 14336 x 4096, but 0.026 against 0.019 for 4096 x 4096 and 0.068 against 0.043 for 4096 x 14336:
0.6-1.6 TB/s of fp8 weights where bf16 streams 1.8-2.8 TB/s, since one long K loop in ~128 programs keeps
too few bytes in flight (split-K is the known fix). At M = 4096 (14336 x 4096): 1.47 ms (327 TFLOP/s)
against 0.68 ms: each weight tile's conversion and block rescale cost the tensor cores half their
rate (fp8 tensor cores, i.e. w8a8, or dequantizing into a bf16 scratch for cuBLAS at large M are the
ways up). So far FP8 serving halves the weights' memory; it does not make steps faster.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import check_operands
from kernels.fp8_gemm import fp8_block_linear as reference_fp8_block_linear
from kernels.triton_support import (LAUNCH, check_last_dim_contiguous, check_same_device, dot, dot_flags,
                                    interpreting, on_its_device)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    m, n, k,
    sx_m, sw_n, ss_n, ss_k, so_m,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    # Computed as y.T = W @ x.T: the converted weight tile is the dot's left operand, which Hopper's
    # wgmma reads from registers, so the conversion needs no trip through shared memory.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < m
    n_ok = rn < n
    scale_row = rn // BLOCK_ROWS  # each output column's row of the scale grid
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y.T tile
    for kb in range(0, tl.cdiv(k, BLOCK_COLS)):  # one scale block of K per turn
        part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for t in tl.static_range(TILES):
            in_block = t * BLOCK_K + offs_k  # [BLOCK_K] offsets inside this scale block
            rk = kb * BLOCK_COLS + in_block
            k_ok = (rk < k) & (in_block < BLOCK_COLS)  # a partial block, or a block that is not a power of 2
            w = tl.load(w_ptr + rn[:, None] * sw_n + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptr + rm[None, :] * sx_m + rk[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            part += dot(w.to(x_ptr.dtype.element_ty), xt, UPCAST, IEEE)  # w: [BLOCK_N, BLOCK_K], e4m3 exact
        scale = tl.load(s_ptr + scale_row * ss_n + kb * ss_k, mask=n_ok, other=0.0)  # [BLOCK_N] fp32
        acc += part * scale[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rm[None, :] * so_m + rn[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & m_ok[None, :])


class Tiles(NamedTuple):
    block_m: int  # rows of x (the dot's N side)
    block_n: int  # output columns, i.e. weight rows (the dot's M side: 64 is one Hopper warpgroup's wgmma)
    block_k: int
    stages: int


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tiles(m: int, n: int, block_cols: int, x: torch.Tensor) -> Tiles:
    """The tiles for y [m, n] over K-blocks of `block_cols`. Measured on an H200 (bf16, blocks of 128,
    N x K of 4096 x 4096, 14336 x 4096 and 4096 x 14336): at decode 16 x 32 or 16 x 64 (narrower tiles
    when 64 would leave SMs without one); at M of 512 and 4096, 128 x 64 (327 TFLOP/s at M=4096, where
    128 x 128 with 8 warps made 296 and 64 x 128 made 267)."""
    block_k = max(16, min(128, triton.next_power_of_2(block_cols)))  # tl.dot wants >= 16 on every side
    if interpreting(x.device):  # few, large tiles: the interpreter pays per program
        return Tiles(max(16, min(64, triton.next_power_of_2(m))), max(16, min(256, triton.next_power_of_2(n))),
                     block_k, 1)
    stages = 3 if x.element_size() <= 2 else 2  # fp32 tiles take twice the shared memory
    if m <= 16:  # decode: the weights stream once and every SM should have a share of them
        return Tiles(16, 64 if triton.cdiv(n, 64) >= _multiprocessors(x.device) else 32, block_k, stages + 1)
    return Tiles(min(128, triton.next_power_of_2(m)), 64, block_k, stages)


@on_its_device
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32/bf16/fp16) through the fp8 weight [N, K] with float32 scale_inv
    [ceil(N / rows), ceil(K / cols)] -> [..., N] in x's dtype, accumulated in float32."""
    check_operands(x, weight, scale_inv, block, bias)
    n, k = weight.shape
    rows = x.reshape(-1, k)  # [M, K]: a view when x's rows are evenly strided
    check_last_dim_contiguous("x", rows)
    check_last_dim_contiguous("weight", weight)
    check_same_device(x=x, weight=weight, scale_inv=scale_inv, **({} if bias is None else {"bias": bias}))
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    if k == 0:  # nothing to sum (the bias alone): the reference is exact and free
        return reference_fp8_block_linear(x, weight, scale_inv, block, bias)
    tile = tiles(m, n, block[1], x)
    upcast, ieee = dot_flags(x.dtype, x.device)
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))
    b = bias if bias is not None else scale_inv  # a placeholder pointer when there is no bias
    _fp8_gemm_kernel[grid](
        rows, weight, scale_inv, b, out,
        m, n, k,
        rows.stride(0), weight.stride(0), scale_inv.stride(0), scale_inv.stride(1), out.stride(0),
        BLOCK_ROWS=block[0], BLOCK_COLS=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, TILES=triton.cdiv(block[1], tile.block_k),
        UPCAST=upcast, IEEE=ieee,
        num_warps=4, num_stages=tile.stages, **LAUNCH,
    )
    return out.reshape(*x.shape[:-1], n)
