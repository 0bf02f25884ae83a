"""Row copies inside one state pool in Triton, behind kernels/state_copy.py's signature.

One launch copies every (src, dst) row pair of a pool: programs over (row chunk, pair),
moving the bytes as 32-bit words when the row size allows (16-bit otherwise), so a claim's
slot clone is one launch per pool tensor whatever the number of layers or pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.state_copy import check_rows
from kernels.triton_support import LAUNCH, check_same_device, interpreting, on_its_device


@triton.jit
def _copy_kernel(pool_ptr, src_ptr, dst_ptr, row_stride, row_words, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    pair = tl.program_id(1)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < row_words
    words = tl.load(pool_ptr + src * row_stride + offs, mask=ok)
    tl.store(pool_ptr + dst * row_stride + offs, words, mask=ok)


def _as_words(pool: torch.Tensor) -> torch.Tensor:
    """The pool as [rows, words] of int32 (int16, uint8 when the sizes are odd) over its memory."""
    rows = pool.view(pool.shape[0], -1).view(torch.uint8)  # each row is contiguous (checked): views
    for word, size in ((torch.int32, 4), (torch.int16, 2)):
        if rows.shape[1] % size == 0 and (rows.shape[0] < 2 or rows.stride(0) % size == 0):
            return rows.view(word)
    return rows


@on_its_device
def copy_rows_(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]] for every i. src: [N], dst: [N] int64 row ids; no dst
    row may also be a src row or appear twice (the copies are independent)."""
    check_rows(pool, src, dst)
    check_same_device(pool=pool, src=src, dst=dst)
    if src.numel() == 0 or pool[0].numel() == 0:
        return
    words = _as_words(pool)
    block = 1024 if interpreting(pool.device) else 4096
    grid = (triton.cdiv(words.shape[1], block), src.numel())
    _copy_kernel[grid](words, src.contiguous(), dst.contiguous(), words.stride(0), words.shape[1],
                       BLOCK=block, num_warps=4, **LAUNCH)
