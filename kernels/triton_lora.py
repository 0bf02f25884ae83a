"""The batched multi-adapter LoRA product in Triton, behind kernels/lora.py's signature (that module's
docstring gives the layout and the arithmetic; lora_delta_reference is the torch reference).

Two launches cover every row whatever adapter it uses, as punica's / S-LoRA's BGMV kernels do: each
program loads its row's slot from the device and reads that slot's weights, so there is no Python
loop over adapters and nothing is read back to the host.

- _shrink_kernel: one program per (row, BLOCK_R ranks) computes v[t, r] = a[s, r, :] @ x[t] in
  float32, looping over `in` in BLOCK_K steps. v [T, R] stays float32.
- _expand_kernel: one program per (row, BLOCK_N output columns) computes delta[t, n] =
  b[n, s, :] @ v[t], looping over R in BLOCK_R steps, and rounds it to x's dtype once.

A row is a matrix-vector product, below tl.dot's 16 rows, so both kernels multiply elementwise in
float32 and sum with tl.sum (exact operands under the interpreter too, which mangles bf16 tl.dot
operands: kernels/triton_support.py). A row without an adapter (slot -1) costs the shrink nothing
(its program returns before loading) and the expand one store of zeros; v's row is left unwritten.
R, in and out need not be multiples of the blocks (masks), and every operand's strides are taken,
so b may be a view of the resident slots of a larger buffer. Slot offsets are int64.

Not yet measured on a GPU: the tiles below are a first guess. At decode the shrink runs only
T x ceil(R / BLOCK_R) programs, each streaming R x in of its adapter's A; splitting `in` across
programs (punica's split-K shrink) is the known way to use more SMs there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.lora import check_operands
from kernels.triton_support import LAUNCH, check_same_device, interpreting, on_its_device


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, v_ptr,
    hidden, rank,
    sx_t, sx_k, sa_s, sa_r, sa_k, sv_t,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # no adapter: the expand writes this row's zeros without reading v
        return
    rr = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rr < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row.to(tl.int64) * sx_t
    a_rows = a_ptr + slot * sa_s + rr[:, None].to(tl.int64) * sa_r  # [BLOCK_R, 1]
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        rk = k0 + offs_k
        k_ok = rk < hidden
        xk = tl.load(x_row + rk * sx_k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(a_rows + rk[None, :] * sa_k, mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    tl.store(v_ptr + row * sv_t + rr, acc, mask=r_ok)


@triton.jit
def _expand_kernel(
    v_ptr, b_ptr, slot_ptr, out_ptr,
    rank, n_out,
    sv_t, sb_n, sb_s, sb_r, so_t,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < n_out
    out = out_ptr + row.to(tl.int64) * so_t + rn
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # no adapter: a zero delta (the output is torch.empty)
        tl.store(out, tl.zeros([BLOCK_N], out_ptr.dtype.element_ty), mask=n_ok)
        return
    offs_r = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + slot * sb_s + rn[:, None].to(tl.int64) * sb_n  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + offs_r
        r_ok = rr < rank
        v = tl.load(v_ptr + row * sv_t + rr, mask=r_ok, other=0.0)  # [BLOCK_R] fp32
        w = tl.load(b_rows + rr[None, :] * sb_r, mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        acc += tl.sum(w.to(tl.float32) * v[None, :], axis=1)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


class Tiles(NamedTuple):
    block_r: int  # ranks of a shrink program, and the expand's step over R
    block_k: int  # the shrink's step over `in`
    block_n: int  # output columns of an expand program


def tiles(rank: int, hidden: int, n_out: int, device: torch.device) -> Tiles:
    """The blocks of both launches. On the GPU a [BLOCK_R, BLOCK_K] or [BLOCK_N, BLOCK_R] tile of 4K
    elements is 32 a thread at 4 warps (unmeasured: see the module docstring)."""
    r = triton.next_power_of_2(rank)
    if interpreting(device):  # few, large tiles: the interpreter pays per program and per loop turn
        return Tiles(min(r, 128), min(triton.next_power_of_2(hidden), 256), min(triton.next_power_of_2(n_out), 256))
    block_r = min(r, 32)
    return Tiles(block_r, 4096 // block_r, 64)


@on_its_device
def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in] through each row's adapter (a [S, R, in], b [out, S, R], slots [T], -1 = none) -> delta
    [T, out] in x's dtype, accumulated in float32 (kernels/lora.py's lora_delta_reference)."""
    check_operands(x, a, b, slots)
    check_same_device(x=x, a=a, b=b, slots=slots)
    (t, hidden), rank, n_out = x.shape, a.shape[1], b.shape[0]
    if t == 0 or n_out == 0:
        return torch.empty(t, n_out, dtype=x.dtype, device=x.device)
    if rank == 0 or hidden == 0:
        return torch.zeros(t, n_out, dtype=x.dtype, device=x.device)
    tile = tiles(rank, hidden, n_out, x.device)
    v = torch.empty(t, rank, dtype=torch.float32, device=x.device)  # [T, R]: a[s] @ x[t]
    _shrink_kernel[(t, triton.cdiv(rank, tile.block_r))](
        x, a, slots, v,
        hidden, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), v.stride(0),
        BLOCK_R=tile.block_r, BLOCK_K=tile.block_k, num_warps=4, **LAUNCH,
    )
    delta = torch.empty(t, n_out, dtype=x.dtype, device=x.device)  # [T, out]
    _expand_kernel[(t, triton.cdiv(n_out, tile.block_n))](
        v, b, slots, delta,
        rank, n_out,
        v.stride(0), b.stride(0), b.stride(1), b.stride(2), delta.stride(0),
        BLOCK_N=tile.block_n, BLOCK_R=tile.block_r, num_warps=4, **LAUNCH,
    )
    return delta
