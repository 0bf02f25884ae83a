"""Retained-state slots in host memory (`reuse.retained_host`): one block reserved at load,
pinned on CUDA so a claim is one host-to-device copy, a separate block from the device
pool on CPU. Each slot is an extent of `slot_bytes` holding one whole state in the same
byte layout the tierstore's arena uses (engine/tiers/codec.py), so moving a host state
down to KV-RAM is one memory copy."""

from __future__ import annotations

from collections import deque

import torch

_ALIGN = 4096  # page-aligned extents: copies in and out run at memory speed


class HostSlots:
    def __init__(self, num_slots: int, slot_bytes: int, pin: bool = False) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"host slots need a count and a size, got {num_slots} x {slot_bytes} bytes")
        self.num_slots = num_slots
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        self.block = torch.zeros(num_slots * self.slot_bytes, dtype=torch.uint8, pin_memory=pin)  # [bytes]
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"release of host slot {slot} that is not in use: this is a bug")
        self._free.append(slot)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, slot: int, nbytes: int) -> memoryview:
        """The first `nbytes` of a slot as bytes (to copy it elsewhere in one go)."""
        start = self.offset(slot)
        return self.block.numpy().data[start:start + nbytes]

    def check_integrity(self, used: set[int]) -> None:
        if used & set(self._free) or len(used) + len(self._free) != self.num_slots:
            raise AssertionError(f"host slots: {len(used)} used + {len(self._free)} free != {self.num_slots}")
