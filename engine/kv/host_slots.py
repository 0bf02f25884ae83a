"""Retained-state slots in host memory (`reuse.retained_host`): one block reserved at load,
pinned on CUDA so a claim is one host-to-device copy, a separate block from the device
pool on CPU. Each slot is an extent of `slot_bytes` holding one whole state in the same
byte layout the tierstore's arena uses (engine/tiers/codec.py), so moving a host state
down to KV-RAM is one memory copy."""

from __future__ import annotations

import torch

from engine.kv.page_pool import SlotPool

_ALIGN = 4096  # page-aligned extents: copies in and out run at memory speed


class HostSlots(SlotPool):
    """A SlotPool whose slots are extents of one host block."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool = False) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"host slots need a count and a size, got {num_slots} x {slot_bytes} bytes")
        super().__init__(num_slots)
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        self.block = torch.zeros(num_slots * self.slot_bytes, dtype=torch.uint8, pin_memory=pin)  # [bytes]

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of a slot (uint8), to copy it elsewhere in one go."""
        start = self.offset(slot)
        return self.block[start:start + nbytes]

    def check_used(self, used: set[int]) -> None:
        """The slots the retained states hold are exactly the ones not free."""
        self.check_integrity()
        if len(used) != self.num_used or any(not 0 <= s < self.num_slots for s in used):
            raise AssertionError(f"host slots: {len(used)} held but {self.num_used} in use")
