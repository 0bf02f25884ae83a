"""Copies of whole rows of a state tensor inside one pool: torch reference.

A retained-state claim clones a slot (recurrent state and conv taps, one row each of
DeviceCache.recurrent and .conv) and copies a partial last page (one row of DeviceCache.kv);
a capture does the same the other way. Each row of these tensors is contiguous, so a
claim is a few row copies: copy_rows_ takes them all for one tensor at once.
"""

from __future__ import annotations

import torch


def check_rows(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    if pool.dim() < 1 or not pool[0].is_contiguous():
        raise ValueError(f"each row of the pool must be contiguous, got strides {tuple(pool.stride())}")
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src and dst must be 1-D and alike, got {tuple(src.shape)} and {tuple(dst.shape)}")


def copy_rows_(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]] for every i. src: [N], dst: [N] int64 row ids; no dst
    row may also be a src row or appear twice (the copies are independent)."""
    check_rows(pool, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):  # one contiguous copy per row (index_copy_ is 20x slower here)
        pool[d].copy_(pool[s])
