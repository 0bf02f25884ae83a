"""Copying one row of a host pool onto another by address: a state clone's page or slot row.

A fork or a claim copies a partial last page (and a hybrid model's slot row) on the step
thread. On the CPU, torch's `pool[dst].copy_(pool[src])` pays for two index calls and the
copy's dispatch before a byte moves, ~50 us of a 512 KiB page's ~130 when that code is out
of the cache (an engine idle between requests), and its two threads win only on larger
rows. Measured on the 2-vCPU dev VM with cold bytes: 0.25 MiB 0.062 ms (torch) vs 0.026
(memmove), 0.5 MiB 0.104 vs 0.049, 1 MiB 0.092 vs 0.065, 2 MiB 0.143 vs 0.124, 4 MiB 0.205
vs 0.232, 13 MiB 0.524 vs 0.740. So rows up to MAX_BYTES are one memmove (libc's, through
ctypes); larger ones, and every pool off the CPU, stay torch copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

MAX_BYTES = 2 << 20

RowCopy = Callable[[int, int], None]  # (src, dst): row dst becomes a copy of row src


def host_row_copier(pool: torch.Tensor) -> RowCopy | None:
    """A copier of `pool`'s rows (its first dimension) by address, or None where a torch copy is the
    better one (off the CPU, a non-contiguous pool, rows over MAX_BYTES, no rows). A closure, not an
    object: its cells are cheaper to reach than attributes when a clone's code is out of the cache
    (all-cold clone of a 512 KiB page 0.82x -> 0.86-0.90x a bare memmove in bench.reuse's way)."""
    if pool.device.type != "cpu" or not pool.is_contiguous() or pool.dim() == 0 or pool.shape[0] == 0:
        return None
    row_bytes = pool[0].numel() * pool.element_size()
    if not 0 < row_bytes <= MAX_BYTES:
        return None
    # `pool` stays referenced below (its shape in the error), so `base` stays its memory.
    base, rows, memmove = pool.data_ptr(), pool.shape[0], ctypes.memmove

    def copy(src: int, dst: int) -> None:
        # Raw addresses: a row outside the pool would write over other memory, so both are checked.
        if not (0 <= src < rows and 0 <= dst < rows):
            raise IndexError(f"row copy {src} -> {dst} outside a pool of {rows} rows ({pool.shape})")
        if src != dst:
            memmove(base + dst * row_bytes, base + src * row_bytes, row_bytes)
    return copy
