"""The routed experts of an MoE layer as a grouped GEMM in Triton, behind kernels/moe_gemm.py's
signature (that module's docstring gives the layout and the arithmetic).

The pairs are sorted by expert and padded per expert to BLOCK_M rows (moe_gemm.align_by_expert, on
the device), then two launches cover every expert at once, as in vLLM's fused_moe:

- _gate_up_kernel: one program per (BLOCK_M sorted rows, BLOCK_N columns of I). Its rows are pairs
  of one expert; it gathers their tokens' rows of x and multiplies them by that expert's gate and up
  rows for the same columns, into two fp32 accumulators, and writes h = silu(gate) * up [P, I] in
  x's dtype. Fused in the epilogue because a program holds matching gate and up columns anyway:
  the step then writes and rereads [P, I] in x's dtype instead of [P, 2I] in fp32, and a decode
  step (where launches, not FLOPs, cost) makes no third launch for the activation. The price is two
  weight tiles a K step, which the tiles below leave room for.
- _down_kernel: the same over h's rows and the expert's down rows, times each pair's routing weight
  in the epilogue, stored in fp32 [P, H] at the pair's own row (no atomics: the result does not depend
  on scheduling). The K rows of each token are then summed in fp32 by torch and rounded once.

Nothing is read back to the host: the grid's M side is moe_gemm.max_blocks (from T * K and E), and
programs past the padded length (a device scalar) return before loading anything. Padding rows hold
the sentinel pair P; their loads are masked and their stores skipped.

Expert offsets are computed in int64 (E * 2I * H passes 2^31 in the largest MoE checkpoints).

Measured on an H200 (torch 2.11, Triton 3.6) at Qwen3-30B-A3B's expert sizes (E=128, top-8,
H=2048, I=768), medians of CUDA-event times, equal to moe_gemm's reference (bf16 2e-3..4e-3, fp32
1e-6) and with no host sync in a call:

| tokens | bf16 this | bf16 torch._grouped_mm | bf16 per-expert loop | fp32 this | fp32 loop |
|---|---|---|---|---|---|
| 1   | 0.53 ms | 0.26 ms | 1.4 ms  | 1.1 ms | 3.2 ms |
| 8   | 0.56 ms | 0.37 ms | 8.9 ms  | 1.8 ms | 11.6 ms |
| 64  | 0.75 ms | 0.60 ms | 22.8 ms | 3.4 ms | 29.2 ms |
| 512 | 0.76 ms | 0.81 ms | 22.0 ms | 6.8 ms | 31.3 ms |

So bf16 on Hopper runs torch._grouped_mm (CUTLASS; engine/model/layers.py's Experts chooses), and this
kernel runs the rest: fp32 and fp16, and GPUs _grouped_mm does not serve. Both are bound by their
launches at decode (75 MB of experts at T=1 streams in ~16 us at the card's bandwidth); a tile sweep
gained 10-15% over the tiles below, within run-to-run spread, so they were left as they are.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.moe_gemm import align_by_expert, check_operands, max_blocks
from kernels.triton_support import (LAUNCH, check_last_dim_contiguous, check_same_device, dot, dot_flags,
                                    interpreting, on_its_device)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, pair_ptr, expert_ptr, padded_ptr,
    pairs, hidden, inter, top_k,
    sx_t, sw_e, sw_n, sh_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):  # a block past the padded pairs (the grid is a bound)
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M], P in padding
    m_ok = pair < pairs
    token = (pair // top_k).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of I
    n_ok = rn < inter
    offs_k = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert * sw_e + rn[None, :].to(tl.int64) * sw_n  # [1, BLOCK_N]
    up_rows = gate_rows + inter * sw_n  # the up projection: rows I.. of gate_up
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        rk = k0 + offs_k
        k_ok = rk < hidden
        a = tl.load(x_ptr + token[:, None] * sx_t + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        gate += dot(a, tl.load(gate_rows + rk[:, None], mask=w_ok, other=0.0), UPCAST, IEEE)  # W.T: [BLOCK_K, BLOCK_N]
        up += dot(a, tl.load(up_rows + rk[:, None], mask=w_ok, other=0.0), UPCAST, IEEE)
    h = gate * tl.sigmoid(gate) * up  # silu(gate) * up, in fp32
    tl.store(h_ptr + pair[:, None].to(tl.int64) * sh_p + rn[None, :], h.to(h_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, weight_ptr, out_ptr, pair_ptr, expert_ptr, padded_ptr,
    pairs, hidden, inter,
    sh_p, sw_e, sw_n, so_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pair < pairs
    row = pair.to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of H
    n_ok = rn < hidden
    offs_k = tl.arange(0, BLOCK_K)
    down_rows = w_ptr + expert * sw_e + rn[None, :].to(tl.int64) * sw_n  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        rk = k0 + offs_k
        k_ok = rk < inter
        a = tl.load(h_ptr + row[:, None] * sh_p + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += dot(a, tl.load(down_rows + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0), UPCAST, IEEE)
    acc *= tl.load(weight_ptr + row, mask=m_ok, other=0.0).to(tl.float32)[:, None]  # the routing weight
    tl.store(out_ptr + row[:, None] * so_p + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_m_for(pairs: int, num_experts: int, x: torch.Tensor) -> int:
    """The rows of one block, shared by both launches (the alignment is made for it): 16 while an
    expert averages at most 16 pairs (decode and small batches: padding stays small and each
    expert's weights stream once), 64 above (fewer rereads of an expert's weights per pair)."""
    if interpreting(x.device) or pairs <= 16 * num_experts:
        return 16
    return 64


def tiles(n: int, k: int, block_m: int, blocks: int, x: torch.Tensor) -> Tiles:
    """The tiles of one launch over N = n output columns and a K loop of k. Sized for Hopper's shared
    memory with two weight tiles a stage (the gate/up launch): bf16 at block_m 16, (16x128 + 2 x
    128x64) x 2 bytes x 3 stages = 108 KB; fp32 halves BLOCK_K and keeps 2 stages."""
    if interpreting(x.device):  # few, large tiles: the interpreter pays per program
        return Tiles(max(16, min(128, triton.next_power_of_2(n))), max(16, min(128, triton.next_power_of_2(k))), 4, 1)
    wide = x.element_size() <= 2
    stages = 3 if wide else 2
    if block_m == 16:  # decode: the weights stream once, and every SM should get a share of them
        block_n = 64 if triton.cdiv(n, 64) * blocks >= _multiprocessors(x.device) else 32
        return Tiles(block_n, 128 if wide else 64, 4, stages)
    return Tiles(64, 64 if wide else 32, 4, stages)


@on_its_device
def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """x [T, H] through the experts expert_ids [T, K] picks, weighted by weights [T, K] -> [T, H] in x's
    dtype, accumulated in float32 (kernels/moe_gemm.py's moe_experts_reference)."""
    check_operands(x, gate_up, down, expert_ids, weights)
    for name, operand in (("x", x), ("gate_up", gate_up), ("down", down)):
        check_last_dim_contiguous(name, operand)
    check_same_device(x=x, gate_up=gate_up, down=down, expert_ids=expert_ids, weights=weights)
    t, hidden = x.shape
    e, inter, top_k = down.shape[0], down.shape[2], expert_ids.shape[1]
    pairs = t * top_k
    if pairs == 0 or hidden == 0 or inter == 0:
        return torch.zeros(t, hidden, dtype=x.dtype, device=x.device)
    block_m = block_m_for(pairs, e, x)
    aligned = align_by_expert(expert_ids, e, block_m)
    blocks = max_blocks(pairs, e, block_m)
    upcast, ieee = dot_flags(x.dtype, x.device)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # silu(gate) * up, per pair
    tile = tiles(inter, hidden, block_m, blocks, x)
    _gate_up_kernel[(blocks, triton.cdiv(inter, tile.block_n))](
        x, gate_up, h, aligned.pair_ids, aligned.block_expert, aligned.padded_len,
        pairs, hidden, inter, top_k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, UPCAST=upcast, IEEE=ieee,
        num_warps=tile.warps, num_stages=tile.stages, **LAUNCH,
    )
    rows = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)  # each pair's weighted row
    tile = tiles(hidden, inter, block_m, blocks, x)
    _down_kernel[(blocks, triton.cdiv(hidden, tile.block_n))](
        h, down, weights.reshape(-1), rows, aligned.pair_ids, aligned.block_expert, aligned.padded_len,
        pairs, hidden, inter,
        h.stride(0), down.stride(0), down.stride(1), rows.stride(0),
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, UPCAST=upcast, IEEE=ieee,
        num_warps=tile.warps, num_stages=tile.stages, **LAUNCH,
    )
    return rows.view(t, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]: the K pairs of a token, in fp32
