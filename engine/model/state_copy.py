"""The row-copy kernel the device cache clones states with, picked with every other kernel.

On CUDA a retained-state claim, a capture and an n>1 fork copy their slot and
partial page with the Triton row copy (kernels/triton_state_copy.py); elsewhere the
cache is given none and copies by itself (a row of at most 2 MiB on the CPU by one
memmove, engine/kv/host_copy.py; larger rows by a plain tensor copy).
"""

from __future__ import annotations

import torch

from engine.kv.device_cache import RowCopier
from kernels.select import kernels_for


def row_copier(device: torch.device) -> RowCopier | None:
    if device.type != "cuda":
        return None
    ops = kernels_for(device)
    return ops.copy_rows_ if ops.name == "triton" else None
